#!/bin/sh
# ISC dhclient's hook for DHCPv6 (dhclient -6 -sf /etc/dhclient6.sh): put
# the leased address on the interface and record what the lease said, how
# it came (reason: BOUND6, RENEW6, REBIND6, REBOOT6 after a CONFIRM) and the
# guest's uptime then in /run/lease6; every call is appended to
# /run/dhclient6.log.
echo "$reason $new_ip6_address/$new_ip6_prefixlen" >> /run/dhclient6.log
case "$reason" in
  BOUND6|RENEW6|REBIND6|REBOOT6)
    if [ -n "$old_ip6_address" ] && [ "$old_ip6_address" != "$new_ip6_address" ]; then
      ip -6 addr del "$old_ip6_address/$old_ip6_prefixlen" dev "$interface"
    fi
    ip -6 addr replace "$new_ip6_address/$new_ip6_prefixlen" dev "$interface"
    {
      echo "reason=$reason"; echo "ip6=$new_ip6_address"
      echo "prefixlen=$new_ip6_prefixlen"; echo "dns6=$new_dhcp6_name_servers"
      echo "uptime=$(cut -d' ' -f1 /proc/uptime)"
    } > /run/lease6.tmp
    mv /run/lease6.tmp /run/lease6
    ;;
  EXPIRE6|RELEASE6)
    [ -n "$old_ip6_address" ] && ip -6 addr del "$old_ip6_address/$old_ip6_prefixlen" dev "$interface"
    ;;
esac
exit 0
