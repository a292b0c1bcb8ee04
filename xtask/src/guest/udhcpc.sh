#!/bin/sh
# busybox udhcpc's hook: configure eth0 from the lease and record what the
# lease said (and the guest's uptime when it came) in /run/lease.
case "$1" in
  deconfig)
    ip addr flush dev "$interface"
    ;;
  bound|renew)
    ip addr flush dev "$interface"
    ip addr add "$ip/$mask" dev "$interface"
    [ -n "$mtu" ] && ip link set "$interface" mtu "$mtu"
    if [ -n "$staticroutes" ]; then
      set -- $staticroutes
      while [ $# -ge 2 ]; do ip route add "$1" via "$2" dev "$interface"; shift 2; done
    elif [ -n "$router" ]; then
      ip route add default via "${router%% *}" dev "$interface"
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
