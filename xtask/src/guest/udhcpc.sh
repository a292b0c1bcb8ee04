#!/bin/sh
# busybox udhcpc's hook: configure eth0 from the lease and record what the
# lease said (and the guest's uptime when it came) in /run/lease. IPv4
# only: the interface's IPv6 addresses (link-local, DHCPv6's) are not its
# business. A renew that keeps the address changes nothing on the
# interface, so the guest's connections and routes stay as they are.
case "$1" in
  deconfig)
    ip -4 addr flush dev "$interface"
    ;;
  bound|renew)
    if ! ip -4 addr show dev "$interface" | grep -q "inet $ip/$mask "; then
      ip -4 addr flush dev "$interface"
      ip addr add "$ip/$mask" dev "$interface"
    fi
    [ -n "$mtu" ] && ip link set "$interface" mtu "$mtu"
    if [ -n "$staticroutes" ]; then
      set -- $staticroutes
      while [ $# -ge 2 ]; do ip route replace "$1" via "$2" dev "$interface"; shift 2; done
    elif [ -n "$router" ]; then
      ip route replace default via "${router%% *}" dev "$interface"
    fi
    : > /etc/resolv.conf
    for d in $dns; do echo "nameserver $d" >> /etc/resolv.conf; done
    {
      echo "ip=$ip"; echo "mask=$mask"; echo "router=$router"; echo "dns=$dns"
      echo "mtu=$mtu"; echo "staticroutes=$staticroutes"; echo "search=$search"
      echo "domain=$domain"; echo "lease=$lease"; echo "serverid=$serverid"
      echo "uptime=$(cut -d' ' -f1 /proc/uptime)"
    } > /run/lease.tmp
    mv /run/lease.tmp /run/lease
    ;;
esac
exit 0
