#!/usr/bin/env bash
# The systemd scenario's "machines": one systemd-nspawn container per inventory host, each with
# its own root file system (a Debian tree), systemd as PID 1 and its own network namespace on a
# bridge, reached by Ansible over ssh like a separate host.
#
#   machines.sh tree RELEASE PACKAGE...   build (once, cached) a Debian tree of RELEASE with
#                                         PACKAGE... installed; print its path
#   machines.sh up HOST=ADDRESS=TREE[=LOOPS[=DIR,...]] ...
#                                         create what is missing (idempotent) and print what
#                                         changed: the host's copy of TREE, its namespace, its
#                                         container booted under a loop that boots it again when
#                                         it reboots; LOOPS free loop devices of this machine and
#                                         the directories DIR (at the same path) are handed in
#   machines.sh down HOST ...             power the containers off, then remove them, their
#                                         namespaces, the bridge and their loop devices
#   machines.sh leader HOST               print the pid of the container's init (for nsenter)
#
# This machine has no systemd: nothing would start a container again after `systemctl reboot`
# inside it (nspawn exits with 133). On a systemd host, systemd-nspawn@.service does that; here
# the loop in boot_loop does.
set -euo pipefail

BRIDGE=kvtsd0
BRIDGE_ADDR=10.78.0.1/24
ROOT=/var/lib/kvtier-systemd
# Trees outlive a run (like apt's cache): building one takes 1 to 3 minutes of downloads.
TREES=/var/cache/kvtier-systemd-trees
SSH_DIR=$ROOT/ssh
NS_PREFIX=kvtier-sd-
MIRROR=${KVTIER_DEBIAN_MIRROR:-http://deb.debian.org/debian}

changed=0
note() { echo "machines: $*"; changed=1; }

ns_of() { echo "${NS_PREFIX}$1"; }
veth_of() { echo "kvtsd-${1:0:9}"; }
# shellcheck source=../shared/netns.sh
source "$(dirname "${BASH_SOURCE[0]}")/../shared/netns.sh"
host_dir() { echo "$ROOT/hosts/$1"; }

tree() {
    local release=$1; shift
    # The tree's name says what is in it, so that a changed package list builds a new one.
    local key dir
    key=$( { echo "$release"; printf '%s\n' "$@" | sort -u; } | sha256sum | cut -c1-12)
    dir=$TREES/$release-$key
    if [[ ! -f $dir/.kvtier-tree-complete ]]; then
        rm -rf "$dir" "$dir.tmp"
        mkdir -p "$TREES"
        local include
        include=$(IFS=,; echo "$*")
        # minbase and --include: one resolver run, no recommends (the roles install with none).
        debootstrap --variant=minbase --include="$include" "$release" "$dir.tmp" "$MIRROR" \
            >"$TREES/$release-$key.log" 2>&1 \
            || { echo "machines: debootstrap of $release failed, see $TREES/$release-$key.log" >&2; exit 1; }
        # Pulled in by ceph-osd (nvme-cli); it finds no NVMe-oF and fails the boot.
        ln -sf /dev/null "$dir.tmp/etc/systemd/system/nvmf-autoconnect.service"
        # Debian's own haproxy.service listens nowhere; the roles run their own unit.
        ln -sf /dev/null "$dir.tmp/etc/systemd/system/haproxy.service"
        rm -f "$dir.tmp/etc/machine-id" "$dir.tmp/var/lib/dbus/machine-id"
        touch "$dir.tmp/.kvtier-tree-complete"
        mv "$dir.tmp" "$dir"
    fi
    echo "$dir"
}

boot_loop() {  # runs detached: boots the container again each time it reboots (exit 133)
    local host=$1 dir rc
    dir=$(host_dir "$host")
    local -a binds=()
    while read -r path; do binds+=("--bind=$path"); done <"$dir/binds"
    while true; do
        rc=0
        # Started inside the namespace (not --network-namespace-path, nor `ip netns exec`, whose
        # own /sys hides the cgroup mounts nspawn reads): the container's /sys
        # then shows the namespace's interfaces, which Ansible's facts read.
        nsenter --net="/run/netns/$(ns_of "$host")" systemd-nspawn --quiet --boot --register=no --keep-unit \
            -M "$host" -D "$dir/root" "${binds[@]}" --console=read-only \
            >>"$dir/console.log" 2>&1 || rc=$?
        echo "$(date -u +%FT%TZ) nspawn exited $rc" >>"$dir/boots.log"
        [[ $rc == 133 ]] || break
    done
    rm -f "$dir/loop.pid"
}

leader() {
    # The container's init: the child of the nspawn process whose machine name is HOST.
    local host=$1 pid
    for pid in $(pgrep -x systemd-nspawn || true); do
        if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "-M $host "; then
            pgrep -P "$pid" | head -1
            return 0
        fi
    done
    return 1
}

up() {
    mkdir -p "$SSH_DIR"
    chmod 0700 "$ROOT" "$SSH_DIR"
    if [[ ! -f $SSH_DIR/id_ed25519 ]]; then
        ssh-keygen -q -t ed25519 -N '' -C kvtier-systemd -f "$SSH_DIR/id_ed25519"
        note "generated the scenario's ssh key"
    fi
    bridge_up
    for spec in "$@"; do
        IFS== read -r host addr src loops dirs <<<"$spec"
        local ns veth dir
        ns=$(ns_of "$host"); veth=$(veth_of "$host"); dir=$(host_dir "$host")
        netns_up "$ns" "$veth" host0 "$addr"
        if [[ ! -d $dir/root ]]; then
            mkdir -p "$dir"
            cp -a "$src" "$dir/root.tmp"
            systemd-machine-id-setup --root="$dir/root.tmp" >/dev/null 2>&1
            echo "$host" >"$dir/root.tmp/etc/hostname"
            # Names resolve without a DNS server (none is reachable): gloo, which vLLM starts
            # even for one worker, looks its host's name up and waits 2 minutes otherwise.
            printf '127.0.0.1 localhost\n%s %s\n' "$addr" "$host" >"$dir/root.tmp/etc/hosts"
            : >"$dir/root.tmp/etc/resolv.conf"
            install -d -m 0700 "$dir/root.tmp/root/.ssh"
            install -m 0600 "$SSH_DIR/id_ed25519.pub" "$dir/root.tmp/root/.ssh/authorized_keys"
            # No route out: the roles' apt tasks must find the lists fresh (no update).
            mkdir -p "$dir/root.tmp/var/lib/apt/periodic"
            touch "$dir/root.tmp/var/lib/apt/periodic/update-success-stamp"
            mv "$dir/root.tmp" "$dir/root"
            # Loop devices of the host handed to the container (its disk tier attaches one; the
            # lowest free ones, which losetup --find inside picks), and shared directories.
            : >"$dir/binds"
            tr ',' '\n' <<<"${dirs:-}" | sed '/^$/d' >>"$dir/binds"
            if [[ ${loops:-0} -gt 0 ]]; then
                echo /dev/loop-control >>"$dir/binds"
                local taken=" $(cat "$ROOT"/hosts/*/binds 2>/dev/null | tr '\n' ' ') "
                for dev in $(ls /dev/loop[0-9]* | grep -E '^/dev/loop[0-9]+$' | sort -V); do
                    [[ $taken == *" $dev "* ]] && continue
                    losetup "$dev" >/dev/null 2>&1 && continue
                    echo "$dev" >>"$dir/binds"; taken+="$dev "
                    (( --loops == 0 )) && break
                done
                if (( loops > 0 )); then
                    echo "machines: not enough free loop devices for $host" >&2; exit 1
                fi
            fi
            note "made $host's root file system from $src"
        fi
        if ! [[ -f $dir/loop.pid ]] || ! kill -0 "$(cat "$dir/loop.pid")" 2>/dev/null; then
            setsid "$0" boot-loop "$host" </dev/null >/dev/null 2>&1 &
            echo $! >"$dir/loop.pid"
            note "booted $host"
        fi
    done
    for spec in "$@"; do
        IFS== read -r host addr _ <<<"$spec"
        for _ in $(seq 1 150); do
            if timeout 1 bash -c "exec 3<>/dev/tcp/$addr/22" 2>/dev/null; then continue 2; fi
            sleep 0.2
        done
        echo "machines: $host's sshd on $addr:22 does not answer; see $(host_dir "$host")/console.log" >&2
        exit 1
    done
}

down() {
    for host in "$@"; do
        local dir ns pid
        dir=$(host_dir "$host"); ns=$(ns_of "$host")
        if [[ -f $dir/loop.pid ]]; then
            kill "$(cat "$dir/loop.pid")" 2>/dev/null || true
            rm -f "$dir/loop.pid"
        fi
        if pid=$(leader "$host"); then
            # SIGRTMIN+4 asks systemd to power off; the nspawn process then exits.
            kill -s SIGRTMIN+4 "$pid" 2>/dev/null || true
            for _ in $(seq 1 300); do leader "$host" >/dev/null || break; sleep 0.1; done
            if pid=$(leader "$host"); then
                pkill -KILL -f -- "-M $host " || true
                note "killed $host, which did not power off within 30 s"
            fi
            note "powered $host off"
        fi
        if [[ -f $dir/binds ]]; then
            while read -r dev; do
                [[ $dev =~ ^/dev/loop[0-9]+$ ]] || continue
                if losetup "$dev" >/dev/null 2>&1; then
                    # Its partitions first: a mount the container left behind.
                    while read -r target; do umount "$target" && note "unmounted $target"; done \
                        < <(findmnt -rn -o TARGET -S "${dev}p1" 2>/dev/null || true)
                    losetup -d "$dev" && note "detached $dev"
                fi
            done <"$dir/binds"
        fi
        if netns_exists "$ns"; then
            ip netns del "$ns"
            note "removed namespace $ns"
        fi
        ip link del "$(veth_of "$host")" 2>/dev/null && note "removed $(veth_of "$host")"
        if [[ -d $dir ]]; then
            rm -rf "$dir"
            note "removed $host's root file system"
        fi
    done
    if ip link show "$BRIDGE" >/dev/null 2>&1 && [[ -z $(ls "$ROOT/hosts" 2>/dev/null) ]]; then
        ip link del "$BRIDGE"
        note "removed bridge $BRIDGE"
    fi
    [[ -z $(ls "$ROOT/hosts" 2>/dev/null) ]] && rm -rf "$ROOT"
    return 0
}

case ${1:-} in
    tree) shift; tree "$@"; exit 0 ;;
    boot-loop) shift; boot_loop "$@"; exit 0 ;;
    leader) shift; leader "$@"; exit $? ;;
    up) shift; up "$@" ;;
    down) shift; down "$@" ;;
    *) echo "usage: $0 tree RELEASE PKG... | up HOST=ADDR=TREE[=LOOPS] ... | down HOST ... | leader HOST" >&2; exit 2 ;;
esac
[[ $changed == 1 ]] && echo "machines: changed" || echo "machines: unchanged"
