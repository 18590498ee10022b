#!/usr/bin/env bash
# The fleet's "machines": one network namespace per inventory host, joined by a bridge, each with
# an sshd on its own address, so Ansible reaches them over ssh like separate hosts.
#
#   fleetnet.sh up   HOST=ADDRESS ...   create what is missing (idempotent); print what changed
#   fleetnet.sh down HOST ... [--ceph-fsid FSID]
#                                       stop every process of each namespace (the namespace's
#                                       own first), then remove the namespaces, the bridge, the
#                                       fleet's mounts, loop devices, users and data; with
#                                       --ceph-fsid, also the Ceph cluster of that fsid when the
#                                       site's teardown could not run
#
# Only the network is separate: the filesystem and the process table are shared with this
# machine, which is why the inventory derives every per-host path from the host.
set -euo pipefail

BRIDGE=kvtfleet0
BRIDGE_ADDR=10.77.0.1/24
ROOT=/var/lib/kvtier-fleet
SSH_DIR=$ROOT/ssh
NS_PREFIX=kvtier-fleet-

changed=0
note() { echo "fleetnet: $*"; changed=1; }

ns_of() { echo "${NS_PREFIX}$1"; }
# veth names are at most 15 characters.
veth_of() { echo "kvtf-${1:0:10}"; }
# shellcheck source=../shared/netns.sh
source "$(dirname "${BASH_SOURCE[0]}")/../shared/netns.sh"

up() {
    mkdir -p "$SSH_DIR" /run/sshd
    chmod 0700 "$ROOT" "$SSH_DIR"
    if [[ ! -f $SSH_DIR/id_ed25519 ]]; then
        ssh-keygen -q -t ed25519 -N '' -C kvtier-fleet -f "$SSH_DIR/id_ed25519"
        cp "$SSH_DIR/id_ed25519.pub" "$SSH_DIR/authorized_keys"
        note "generated the fleet's ssh key"
    fi
    bridge_up
    for spec in "$@"; do
        local host=${spec%%=*} addr=${spec#*=}
        local ns veth
        ns=$(ns_of "$host")
        veth=$(veth_of "$host")
        netns_up "$ns" "$veth" eth0 "$addr"
        local conf=$SSH_DIR/sshd-$host.conf pid=/run/sshd-kvtier-fleet-$host.pid
        cat >"$conf" <<EOF
# sshd of fleet host $host, inside network namespace $ns
ListenAddress $addr
PidFile $pid
PermitRootLogin prohibit-password
AuthorizedKeysFile $SSH_DIR/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
StrictModes no
UsePAM no
MaxStartups 30:30:60
MaxSessions 30
Subsystem sftp internal-sftp
EOF
        if ! [[ -f $pid ]] || ! kill -0 "$(cat "$pid")" 2>/dev/null; then
            ip netns exec "$ns" /usr/sbin/sshd -f "$conf"
            note "started sshd of $host on $addr:22"
        fi
    done
    for spec in "$@"; do
        local addr=${spec#*=}
        for _ in $(seq 1 50); do
            if timeout 1 bash -c "exec 3<>/dev/tcp/$addr/22" 2>/dev/null; then continue 2; fi
            sleep 0.2
        done
        echo "fleetnet: sshd on $addr:22 does not answer" >&2
        exit 1
    done
}

# Processes of a namespace: SIGTERM, a grace period, then SIGKILL. Ceph daemons linger as
# zombies for a moment after SIGTERM; they count as stopped.
stop_namespace() {
    local ns=$1 pids
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [[ -z $pids ]] && return 0
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null || true
    for _ in $(seq 1 100); do
        pids=$(ip netns pids "$ns" 2>/dev/null | while read -r p; do
            state=$(awk '/^State:/ {print $2}' "/proc/$p/status" 2>/dev/null || true)
            [[ -n $state && $state != Z ]] && echo "$p"
        done || true)
        [[ -z $pids ]] && return 0
        sleep 0.1
    done
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    note "killed what did not stop in $ns: $pids"
}

down() {
    local fsid="" hosts=()
    while [[ $# -gt 0 ]]; do
        case $1 in
            --ceph-fsid) fsid=$2; shift 2 ;;
            *) hosts+=("$1"); shift ;;
        esac
    done
    for host in "${hosts[@]}"; do
        local ns
        ns=$(ns_of "$host")
        if netns_exists "$ns"; then
            stop_namespace "$ns"
            ip netns del "$ns"
            note "removed namespace $ns"
        fi
        # Gone with the namespace, unless a lingering process still holds it.
        ip link del "$(veth_of "$host")" 2>/dev/null && note "removed $(veth_of "$host")"
        rm -f "/run/sshd-kvtier-fleet-$host.pid" "/run/supervisor-kvtier-$host.sock" \
            "/run/supervisord-kvtier-$host.pid"
        rm -rf "/etc/supervisor/kvtier-$host" "/etc/kvtier/$host" "/var/log/kvtier/$host" \
            "/opt/kvtier/models/$host"
        rm -f "/var/log/supervisor/kvtier-$host.log" "/etc/haproxy/kvtier-s3-$host.cfg" \
            "/etc/haproxy/kvtier-rgw-$host.cfg"
        if id "kvtier-$host" >/dev/null 2>&1; then
            userdel --remove "kvtier-$host" 2>/dev/null || userdel "kvtier-$host"
            note "removed user kvtier-$host"
        fi
        getent group "kvtier-$host" >/dev/null && groupdel "kvtier-$host"
    done
    if ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link del "$BRIDGE"
        note "removed bridge $BRIDGE"
    fi
    # The disk tiers: mounts under /var/cache/kvtier-fleet, loop devices over files in $ROOT.
    while read -r target; do
        umount "$target" && note "unmounted $target"
    done < <(findmnt -rn -o TARGET | grep '^/var/cache/kvtier-fleet/' | sort -r || true)
    while read -r dev; do
        losetup -d "$dev" && note "detached $dev"
    done < <(losetup -rn -O NAME,BACK-FILE | awk -v r="$ROOT/" 'index($2, r) == 1 {print $1}')
    rm -rf /var/cache/kvtier-fleet
    if [[ -n $fsid ]] && grep -qs "^fsid = $fsid\$" /etc/ceph/ceph.conf; then
        # The fleet's cluster outlived a teardown that could not run: its data goes too. Another
        # cluster's (the embedded default's) is never touched.
        rm -rf /var/lib/ceph/osd/ceph-0 /var/lib/ceph/mgr/ceph-* /var/lib/ceph/mon/ceph-* \
            /var/lib/ceph/radosgw/ceph-rgw.* /var/lib/ceph/tmp/kvtier-bootstrap \
            /etc/ceph/ceph.conf /etc/ceph/ceph.client.admin.keyring \
            /var/lib/ceph/bootstrap-osd/ceph.keyring
        note "removed the fleet's Ceph cluster $fsid"
    fi
    rm -rf "$ROOT"
}

case ${1:-} in
    up) shift; up "$@" ;;
    down) shift; down "$@" ;;
    *) echo "usage: $0 up HOST=ADDR ... | down HOST ... [--ceph-fsid FSID]" >&2; exit 2 ;;
esac
[[ $changed == 1 ]] && echo "fleetnet: changed" || echo "fleetnet: unchanged"
