# Sourced by the scenarios' host scripts (fleet/fleetnet.sh, systemd/machines.sh): a bridge on
# this machine and one network namespace per host on it, each reached through a veth pair. The
# caller defines BRIDGE, BRIDGE_ADDR (address/prefix on this machine's side) and note().

# The bridge, with this machine's address on it (idempotent).
bridge_up() {
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
        ip addr add "$BRIDGE_ADDR" dev "$BRIDGE"
        note "created bridge $BRIDGE ($BRIDGE_ADDR)"
    fi
    ip link set "$BRIDGE" up
}

# netns_exists NS: the namespace is there (`ip netns list` may append "(id: N)").
netns_exists() {
    ip netns list | grep -qx "$1\( .*\)\?"
}

# netns_up NS VETH IFNAME ADDR: namespace NS with interface IFNAME at ADDR/24 inside, its peer
# VETH on the bridge, a default route through this machine (idempotent).
netns_up() {
    local ns=$1 veth=$2 ifname=$3 addr=$4
    netns_exists "$ns" && return 0
    # A namespace removed while a process (a zombie) still held it keeps its veth.
    ip link del "$veth" 2>/dev/null && note "removed the stale $veth"
    ip netns add "$ns"
    ip link add "$veth" type veth peer name "$ifname" netns "$ns"
    ip link set "$veth" master "$BRIDGE" up
    ip -n "$ns" addr add "$addr/24" dev "$ifname"
    ip -n "$ns" link set lo up
    ip -n "$ns" link set "$ifname" up
    ip -n "$ns" route add default via "${BRIDGE_ADDR%/*}"
    note "created namespace $ns ($addr) on $BRIDGE"
}
