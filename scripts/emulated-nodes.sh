#!/usr/bin/env bash
# Emulated cluster nodes on one machine: network namespaces joined by a bridge, each link
# rate-limited with tbf, so that labavg's multi-node paths (mpiexec --hosts, torchrun
# --nnodes) run across separate network stacks. Root only. docs/cluster.md, "Emulated nodes".
#
#   scripts/emulated-nodes.sh up N RATE    N nodes (1-16), RATE a tc rate (1gbit, 10gbit,
#                                          500mbit) or "none" for unlimited veth links
#   scripts/emulated-nodes.sh down         remove everything `up` made (idempotent)
#   scripts/emulated-nodes.sh status       what exists now; exit 1 when nothing is up
#
# Node i is namespace labavg-n<i> with interface lab0 at 198.18.0.<i+1>/24; its veth peer
# lbn<i> sits on bridge labavg-br0 (198.18.0.254/24) in the root namespace, where mpiexec runs.
# tbf shapes both ends of every link (traffic leaving a node, and traffic the bridge sends into
# it), as a switch port of RATE would. Its bucket (LABAVG_TBF_BURST bytes; default 1 ms of RATE,
# at least 128 KiB) passes a message that fits in it at veth speed: smaller buckets shape small
# messages too but, on a busy machine, lose throughput on large ones (docs/cost-model.md,
# "Measured links"). One emulation per machine: `up` replaces any previous one.
#
# `up` writes, in $LABAVG_NODES_DIR (default /run/labavg-nodes):
#   hosts      the node addresses, comma-separated: labavg train --hosts "$(cat hosts)"
#   env        KEY=VALUE lines for mpiexec's environment (hydra's launcher, interface, MPICH's
#              netmod): set -a; . "$LABAVG_NODES_DIR/env"; set +a
#   launcher   what hydra runs instead of ssh: the proxy command under `ip netns exec`
#   nodes      "address namespace" per line, read by the launcher
set -euo pipefail

BRIDGE=labavg-br0
NS_PREFIX=labavg-n
VETH_PREFIX=lbn
NODE_IFACE=lab0
SUBNET=198.18.0
ROOT_ADDR=$SUBNET.254
MAX_NODES=16
STATE=${LABAVG_NODES_DIR:-/run/labavg-nodes}

usage() {
    echo "usage: $0 up N RATE | down | status   (N 1-$MAX_NODES; RATE e.g. 1gbit, 10gbit, none)" >&2
    exit 2
}

bad() {
    echo "emulated-nodes: $*" >&2
    exit 2
}

our_namespaces() {
    ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${NS_PREFIX}[0-9]+$" || true
}

our_links() {
    ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' \
        | grep -E "^(${VETH_PREFIX}[0-9]+(-p)?|${BRIDGE})$" || true
}

# tc takes rates as <number><unit>; bytes per second of one, for sizing tbf's bucket.
rate_bytes_per_s() {
    local number=${1%%[a-z]*} unit=${1##*[0-9.]}
    local scale
    case $unit in
        bit) scale=1 ;; kbit) scale=1000 ;; mbit) scale=1000000 ;; gbit) scale=1000000000 ;;
        tbit) scale=1000000000000 ;;
        *) bad "rate '$1': use a tc rate such as 100mbit, 1gbit, 10gbit, or none" ;;
    esac
    awk -v n="$number" -v s="$scale" 'BEGIN { printf "%.0f\n", n * s / 8 }'
}

down() {
    local ns pids link
    for ns in $(our_namespaces); do
        # A namespace outlives `ip netns del` while processes hold it, and so do its links.
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        if [ -n "$pids" ]; then
            echo "emulated-nodes: ending processes left in $ns: $(echo $pids)" >&2
            kill -TERM $pids 2>/dev/null || true
            for _ in 1 2 3 4 5 6 7 8 9 10; do
                [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] && break
                sleep 0.2
            done
            pids=$(ip netns pids "$ns" 2>/dev/null || true)
            [ -n "$pids" ] && kill -KILL $pids 2>/dev/null || true
        fi
        ip netns del "$ns" 2>/dev/null || true
    done
    for link in $(our_links); do
        ip link del "$link" 2>/dev/null || true
    done
    # Only the files `up` writes, then the directory if that leaves it empty: LABAVG_NODES_DIR
    # may name a directory that holds other things.
    rm -f -- "$STATE/hosts" "$STATE/env" "$STATE/launcher" "$STATE/nodes"
    rmdir -- "$STATE" 2>/dev/null || true
    local left
    left="$(our_namespaces)$(our_links)"
    if [ -n "$left" ]; then
        echo "emulated-nodes: could not remove: $left" >&2
        return 1
    fi
}

shape() {  # shape DEV [NETNS]: tbf at RATE on DEV's egress
    local dev=$1 ns=${2:-}
    [ "$RATE" = none ] && return 0
    local bytes burst limit
    bytes=$(rate_bytes_per_s "$RATE")
    # The bucket holds 1 ms of traffic, and at least two 64 KiB GSO segments: with less, a
    # late timer on a busy machine loses tokens and the link runs below RATE (1gbit with 16 KiB:
    # a 32 MB allreduce took 357 ms, against 301 ms with 128 KiB).
    burst=${LABAVG_TBF_BURST:-$(( bytes / 1000 > 131072 ? bytes / 1000 : 131072 ))}
    # 10 ms of queue: TCP sees a bottleneck, not drops from a queue shorter than a window.
    limit=$(( bytes / 100 + burst ))
    ${ns:+ip netns exec "$ns"} tc qdisc replace dev "$dev" root tbf rate "$RATE" burst "$burst" \
        limit "$limit"
}

reachable() {  # reachable NETNS ADDR: a TCP connection is answered, even if refused
    local out
    out=$(ip netns exec "$1" timeout 3 bash -c "exec 3<>/dev/tcp/$2/9" 2>&1) && return 0
    [[ $out == *"refused"* ]]
}

write_launcher() {
    cat >"$STATE/launcher" <<EOF
#!/bin/sh
# hydra's ssh launcher runs: launcher [ssh options] HOST COMMAND...; run COMMAND in the
# namespace that owns HOST (the file "nodes" beside this one) instead of over ssh.
while [ \$# -gt 0 ]; do
    case \$1 in
        -[io]) shift 2 ;;
        -*) shift ;;
        *) break ;;
    esac
done
host=\$1
shift
ns=\$(awk -v h="\$host" '\$1 == h { print \$2 }' "$STATE/nodes")
if [ -z "\$ns" ]; then
    echo "emulated-nodes launcher: no emulated node has address \$host (see $STATE/nodes)" >&2
    exit 255
fi
exec ip netns exec "\$ns" sh -c "\$*"
EOF
    chmod 755 "$STATE/launcher"
}

up() {
    local n=$1
    [[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le "$MAX_NODES" ] \
        || bad "N must be a whole number from 1 to $MAX_NODES, got '$n'"
    if [ "$RATE" != none ]; then
        [[ $RATE =~ ^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit|tbit)$ ]] \
            || bad "RATE '$RATE': use a tc rate such as 100mbit, 1gbit, 10gbit, or none"
        # Below 1 Mbit/s the 64 KiB segments veth hands tbf take ages; tc garbles rates far
        # above 100 Gbit/s, which no veth reaches anyway.
        local bytes
        bytes=$(rate_bytes_per_s "$RATE")
        [ "$bytes" -ge 125000 ] && [ "$bytes" -le 12500000000 ] \
            || bad "RATE '$RATE': choose from 1mbit to 100gbit, or none"
    fi
    [ -z "${LABAVG_TBF_BURST:-}" ] || [[ $LABAVG_TBF_BURST =~ ^[1-9][0-9]{3,9}$ ]] \
        || bad "LABAVG_TBF_BURST '$LABAVG_TBF_BURST': bytes, 1000 or more"
    [ "$(id -u)" -eq 0 ] || bad "network namespaces need root"
    down
    # From here a failure removes whatever was made so far.
    trap 'status=$?; trap - EXIT; if [ $status -ne 0 ]; then
              echo "emulated-nodes: up failed; removing what it made" >&2; down || true; fi
          exit $status' EXIT
    # An interrupted `up` is a failed one: exit, so that the EXIT trap cleans up.
    trap 'exit 130' INT
    trap 'exit 143' TERM HUP
    mkdir -p "$STATE"
    ip link add "$BRIDGE" type bridge
    ip addr add "$ROOT_ADDR/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    : >"$STATE/nodes"
    local i ns addr hosts=""
    for ((i = 0; i < n; i++)); do
        ns=$NS_PREFIX$i
        addr=$SUBNET.$((i + 1))
        ip netns add "$ns"
        ip link add "$VETH_PREFIX$i" type veth peer name "$VETH_PREFIX$i-p"
        ip link set "$VETH_PREFIX$i-p" netns "$ns"
        ip -n "$ns" link set "$VETH_PREFIX$i-p" name "$NODE_IFACE"
        ip -n "$ns" addr add "$addr/24" dev "$NODE_IFACE"
        ip -n "$ns" link set lo up
        ip -n "$ns" link set "$NODE_IFACE" up
        ip link set "$VETH_PREFIX$i" master "$BRIDGE"
        ip link set "$VETH_PREFIX$i" up
        shape "$VETH_PREFIX$i"
        shape "$NODE_IFACE" "$ns"
        echo "$addr $ns" >>"$STATE/nodes"
        hosts=${hosts:+$hosts,}$addr
    done
    echo "$hosts" >"$STATE/hosts"
    write_launcher
    # hydra reads these from its environment and passes the whole environment to the ranks:
    # proxies launched through the wrapper, connecting back to mpiexec on the bridge; MPICH's
    # ranks on libfabric's tcp provider over the node's interface (its shared-memory paths
    # would otherwise bypass the emulated network between "nodes" of one machine).
    cat >"$STATE/env" <<EOF
HYDRA_LAUNCHER=ssh
HYDRA_LAUNCHER_EXEC=$STATE/launcher
HYDRA_IFACE=$BRIDGE
MPIR_CVAR_CH4_NETMOD=ofi
FI_PROVIDER=tcp
FI_TCP_IFACE=$NODE_IFACE
GLOO_SOCKET_IFNAME=$NODE_IFACE
EOF
    for ((i = 0; i < n; i++)); do
        reachable "$NS_PREFIX$i" "$ROOT_ADDR" \
            || { echo "emulated-nodes: node $i cannot reach $ROOT_ADDR" >&2; exit 1; }
    done
    trap - EXIT INT TERM HUP
    echo "emulated-nodes: $n nodes up at ${RATE}: hosts $hosts; state in $STATE"
}

status() {
    local ns
    ns=$(our_namespaces)
    if [ -z "$ns" ] && [ -z "$(our_links)" ]; then
        echo "emulated-nodes: nothing up"
        return 1
    fi
    for n in $ns; do
        echo "$n: $(ip -n "$n" -br addr show dev "$NODE_IFACE" 2>/dev/null | awk '{print $3}')" \
             "$(ip netns exec "$n" tc qdisc show dev "$NODE_IFACE" 2>/dev/null | head -1)"
    done
    [ -f "$STATE/hosts" ] && echo "hosts: $(cat "$STATE/hosts")"
    return 0
}

[ $# -ge 1 ] || usage
command=$1
shift
# Concurrent up/down take turns; the lock is on this script, so no lock file is left behind.
exec 9<"$0"
flock 9
case $command in
    up)
        [ $# -eq 2 ] || usage
        RATE=$2
        up "$1"
        ;;
    down)
        [ $# -eq 0 ] || usage
        [ "$(id -u)" -eq 0 ] || bad "network namespaces need root"
        down
        ;;
    status)
        [ $# -eq 0 ] || usage
        status
        ;;
    *) usage ;;
esac
