#!/bin/bash
# cluster.sh - boot N throw-away QEMU guests ("nodes", one vCPU each) joined by virtual Ethernet links, each
# with SoftRoCE (rdma_rxe) devices on its data links, and run one shell command on every node.
#
# Usage:   cluster.sh [--topology T] [--nodes N] [--forward] [--timeout S] [--grace S] [--mem MiB]
#                     [--master-port P] [--logdir DIR] 'shell command'       (or: cluster.sh [opts] -- cmd arg...)
# Output:  every node's stdout+stderr (merged), line by line prefixed "[nodeK] ", as it comes; also kept in
#          DIR/nodeK/cmd.log (kernel console: DIR/nodeK/console.log). DIR defaults to a new
#          $RXE_VM_WORKDIR/logs/cluster-T-<time> (printed at the end; kept).
# Exit:    0 if every node's command exited 0; else the nonzero exit code of the lowest-ranked node that gave
#          one; else 125 (a node gave none: boot failure, timeout, killed; its console tail is printed). Once a
#          node has failed, the others get --grace seconds (default 60) to end, then are killed; --timeout
#          (default 1800) kills everything.
#
# Topologies (node K's host part is K+1 on every subnet; on each node, ethI/rxeI is its I-th data link in the
# order listed; every link and the management segment is /24):
#   switch  N nodes (--nodes 2-4, default 2), one segment through a userspace switch: eth0 10.80.0.(K+1)
#   direct  2 nodes, two links between them (the two ports of one cable): eth0 10.81.0.x, eth1 10.81.1.x
#   mesh3   3 nodes, a link per pair: 0-1 10.82.0.0, 0-2 10.82.1.0, 1-2 10.82.2.0
#   ring4   4 nodes, links 0-1 10.83.0.0, 1-2 10.83.1.0, 2-3 10.83.2.0, 3-0 10.83.3.0; the diagonals (0-2, 1-3)
#           have no link. --forward: every node forwards IPv4 and routes the two subnets it is not on via the
#           neighbour that is, so the diagonals are reachable in two hops; without it they are unreachable.
# Every node also has mgmt0, 10.90.0.(K+1), on one management segment (a switch), without rxe: the names
# node0..node3 resolve to these addresses (/etc/hosts), so torchrun's rendezvous and gloo run over it.
# Links are QEMU `-netdev dgram` over unix sockets: a point-to-point link joins two guests' sockets directly;
# a segment of more goes through cluster_hub.py (a learning switch, one host process per segment). No host
# bridge, tap or multicast.
#
# Inside every node these variables are exported to the command:
#   NODE_RANK NNODES MASTER_ADDR (node0's mgmt address) MASTER_PORT (default 29500) MGMT_IP MGMT_IF=mgmt0
#   CLUSTER_TOPOLOGY CLUSTER_FORWARD (0|1)
#   CLUSTER_IFS "eth0 eth1"  CLUSTER_RXE "rxe0 rxe1"  CLUSTER_IPS  CLUSTER_GID_INDEX (the IPv4-mapped RoCE v2
#     GID index of each rxe device): parallel lists, one entry per data link
#   CLUSTER_PEERS     "rxeI:rank:ip ..." every node reachable over a link of this node, and its address there
#   CLUSTER_ALL_IPS   "rank:ip ..." every data address of every node
#   CLUSTER_OUT       this node's private writable dir, kept as DIR/nodeK/out on the host
#   CLUSTER_RC        where the node's exit code goes: a command that powers its own node off on purpose (a host
#                     gone: echo o > /proc/sysrq-trigger) writes its verdict there first
#   plus the host's environment (as rxe_vm.sh passes it); hostname nodeK.
#
# Shared: only the host's root file system, read-only over 9p, and the cwd at its own path, read-only too (also
# where the guests' tmpfs on /tmp would hide it: a clone under /tmp); write to /tmp, a tmpfs, or $CLUSTER_OUT. Each node's control dir (DIR/nodeK, with CLUSTER_OUT) is its own; no directory is
# shared read-write between nodes, so nothing but the network joins them (no FileStore across nodes).
# /etc /var /root /home are per-node overlays whose writes are discarded.
#
# Knobs (environment): RXE_VM_KERNEL, RXE_VM_KVER, RXE_VM_PVH, RXE_VM_ACCEL, RXE_VM_TCG_THREAD, RXE_VM_WORKDIR
# and RXE_VM_OVERLAYS as for rxe_vm.sh (vm_common.sh); CLUSTER_VERBOSE=1 prints each node's console at the end.
# Guest CPUs are emulated where KVM is not usable (TCG: `import torch` takes about a minute). Must run as root.
# Smoke test of a topology: cluster.sh --topology T 'bash tests/rdma/cluster_smoke.sh'.
set -euo pipefail

T_START=$(date +%s.%N)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WORKDIR=${RXE_VM_WORKDIR:-/tmp/softroce}
VERBOSE=${CLUSTER_VERBOSE:-0}
log() { if [ "$VERBOSE" = 1 ]; then echo "[cluster] $*" >&2; fi; }
die() { echo "[cluster] ERROR: $*" >&2; exit 125; }
usage() { sed -n '2,49p' "$0" >&2; exit 2; }

TOPO=switch NODES= FORWARD=0 TIMEOUT=1800 GRACE=60 MEM=1536 MPORT=29500 LOGDIR=
while [ $# -gt 0 ]; do
  case $1 in
    --topology) TOPO=$2; shift 2 ;;
    --nodes) NODES=$2; shift 2 ;;
    --forward) FORWARD=1; shift ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --grace) GRACE=$2; shift 2 ;;
    --mem) MEM=$2; shift 2 ;;
    --master-port) MPORT=$2; shift 2 ;;
    --logdir) LOGDIR=$2; shift 2 ;;
    --) shift; break ;;
    -*) usage ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || usage
if [ $# -eq 1 ]; then CMD=$1; else CMD=$(printf '%q ' "$@"); fi

# ---------------------------------------------------------------- topology
# Segment i: SEG_NET[i] (first three octets of its /24) and SEG_NODES[i] (its members, in order).
SEG_NET=() SEG_NODES=()
link() { SEG_NET+=("$1"); shift; SEG_NODES+=("$*"); }
case $TOPO in
  switch) N=${NODES:-2}; [[ $N =~ ^[234]$ ]] || die "switch takes --nodes 2, 3 or 4"
          link 10.80.0 $(seq 0 $((N - 1))) ;;
  direct) N=2; link 10.81.0 0 1; link 10.81.1 0 1 ;;
  mesh3)  N=3; link 10.82.0 0 1; link 10.82.1 0 2; link 10.82.2 1 2 ;;
  ring4)  N=4; link 10.83.0 0 1; link 10.83.1 1 2; link 10.83.2 2 3; link 10.83.3 3 0 ;;
  *) die "unknown topology '$TOPO' (switch, direct, mesh3, ring4)" ;;
esac
[ -z "$NODES" ] || [ "$NODES" = "$N" ] || die "$TOPO has $N nodes, not $NODES"
MGMT_NET=10.90.0
in_seg() { [[ " ${SEG_NODES[$2]} " == *" $1 "* ]]; }   # node $1 is on segment $2

. "$HERE/vm_common.sh"

# ---------------------------------------------------------------- per-run dirs
STAMP=$(date +%Y%m%d-%H%M%S)
FWD=; [ "$FORWARD" = 0 ] || FWD=-fwd
LOGDIR=${LOGDIR:-$WORKDIR/logs/cluster-$TOPO$FWD-$STAMP-$$}
mkdir -p "$LOGDIR"
LOGDIR=$(cd "$LOGDIR" && pwd -P)
NET=$(mktemp -d "$WORKDIR/runs/net.XXXXXX")   # the link sockets (a short path: unix sockets take 107 bytes)
HOST_PWD=$(pwd -P)
HUBPY=$(command -v /usr/bin/python3 python3 | head -1)
PIDS=() HELPERS=() TAILS=()
cleanup() {
  local p
  for p in "${PIDS[@]}" "${HELPERS[@]}" "${TAILS[@]}"; do [ -n "$p" ] && kill "$p" 2>/dev/null; done
  rm -rf "$NET"
  return 0
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

hub() {   # hub SOCKET PORT...: a switch for one segment
  "$HUBPY" "$HERE/cluster_hub.py" "$@" < /dev/null &
  HELPERS+=($!)
}
mgmt_ports=()
for k in $(seq 0 $((N - 1))); do mgmt_ports+=("$NET/m-n$k"); done
hub "$NET/m-hub" "${mgmt_ports[@]}"
for i in "${!SEG_NET[@]}"; do
  set -- ${SEG_NODES[$i]}
  if [ $# -gt 2 ]; then hub "$NET/d$i-hub" $(for k; do echo "$NET/d$i-n$k"; done); fi
done

ALL_IPS=$(for i in "${!SEG_NET[@]}"; do for k in ${SEG_NODES[$i]}; do printf '%s:%s ' $k "${SEG_NET[$i]}.$((k + 1))"; done; done)
ALL_IPS=${ALL_IPS% }

# ---------------------------------------------------------------- one guest per node
dgram() {   # dgram ID LOCAL REMOTE: a QEMU netdev over unix datagram sockets
  echo "dgram,id=$1,local.type=unix,local.path=$2,remote.type=unix,remote.path=$3"
}
APPEND="console=ttyS0 loglevel=4 panic=-1 rdinit=/init mitigations=off tsc=reliable no_timer_check audit=0 nokaslr quiet"
for k in $(seq 0 $((N - 1))); do
  D=$LOGDIR/node$k
  mkdir -p "$D"
  cp "$HERE/cluster_node.sh" "$D/stage2.sh"
  printf '%s\n' "$CMD" > "$D/cmd.sh"
  export -p | grep -v -E '^declare -[a-zA-Z]*x[a-zA-Z]* (BASH[A-Z_]*|SHELLOPTS|PPID|UID|EUID|SHLVL|OLDPWD|PWD|TERM|TMUX[A-Z_]*|SSH_[A-Z_]*|DISPLAY|XDG_RUNTIME_DIR|_)=' > "$D/env.sh" || true
  echo "OVERLAYS=\"${RXE_VM_OVERLAYS:-/etc /var /root /home}\"" > "$D/mounts.sh"
  : > "$D/rw.list"
  CWDARGS=()
  if [ "$HOST_PWD" != / ]; then  # vm_common.sh's init mounts it, also over the guest's /tmp tmpfs
    printf 'cwd %s\n' "$HOST_PWD" > "$D/rw.list"
    CWDARGS=(-fsdev "local,id=cwd,path=${HOST_PWD//,/,,},security_model=none,readonly=on,multidevs=remap"
             -device "virtio-9p-pci,fsdev=cwd,mount_tag=cwd")
  fi
  { echo "127.0.0.1 localhost"; for j in $(seq 0 $((N - 1))); do echo "$MGMT_NET.$((j + 1)) node$j"; done; } > "$D/hosts"
  mac() { printf '52:54:00:00:%02x:%02x' "$1" "$k"; }
  NETARGS=(-netdev "$(dgram m "$NET/m-n$k" "$NET/m-hub")"
           -device "virtio-net-pci,netdev=m,mac=$(mac 255),romfile=")
  echo "mgmt0 $(mac 255) $MGMT_NET.$((k + 1))/24 -" > "$D/nics.list"
  : > "$D/routes.list"
  IFS_= RXE= IPS= PEERS= e=0
  for i in "${!SEG_NET[@]}"; do
    in_seg $k $i || continue
    set -- ${SEG_NODES[$i]}
    if [ $# -gt 2 ]; then remote=$NET/d$i-hub; else remote=$NET/d$i-n$([ "$1" = $k ] && echo "$2" || echo "$1"); fi
    NETARGS+=(-netdev "$(dgram d$i "$NET/d$i-n$k" "$remote")" -device "virtio-net-pci,netdev=d$i,mac=$(mac $i),romfile=")
    ip=${SEG_NET[$i]}.$((k + 1))
    echo "eth$e $(mac $i) $ip/24 rxe$e" >> "$D/nics.list"
    IFS_="$IFS_ eth$e" RXE="$RXE rxe$e" IPS="$IPS $ip"
    for j; do [ "$j" = $k ] || PEERS="$PEERS rxe$e:$j:${SEG_NET[$i]}.$((j + 1))"; done
    e=$((e + 1))
  done
  if [ "$FORWARD" = 1 ]; then
    # each subnet this node is not on: via a member of it that shares a link with this node
    for i in "${!SEG_NET[@]}"; do
      in_seg $k $i && continue
      for j in ${SEG_NODES[$i]}; do
        for s in "${!SEG_NET[@]}"; do
          if in_seg $k $s && in_seg $j $s; then
            echo "${SEG_NET[$i]}.0/24 ${SEG_NET[$s]}.$((j + 1))" >> "$D/routes.list"; continue 3
          fi
        done
      done
    done
  fi
  q() { printf '%q' "$*"; }
  cat > "$D/vars.sh" <<EOF
export NODE_RANK=$k NNODES=$N MASTER_ADDR=$MGMT_NET.1 MASTER_PORT=$MPORT MGMT_IP=$MGMT_NET.$((k + 1)) MGMT_IF=mgmt0
export CLUSTER_TOPOLOGY=$TOPO CLUSTER_FORWARD=$FORWARD CLUSTER_IFS=$(q ${IFS_# }) CLUSTER_RXE=$(q ${RXE# })
export CLUSTER_IPS=$(q ${IPS# }) CLUSTER_PEERS=$(q ${PEERS# }) CLUSTER_ALL_IPS=$(q $ALL_IPS)
HOST_PWD=$(q "$HOST_PWD")
EOF
  timeout -k 10 "$TIMEOUT" qemu-system-x86_64 \
    "${ACCEL_ARGS[@]}" -M pc -smp 1 -m "$MEM" \
    -nodefaults -no-user-config -display none -vga none -no-reboot \
    -kernel "$KERNEL" -initrd "$INITRD" -append "$APPEND" \
    -serial "file:$D/console.log" \
    -chardev "file,id=out,path=$D/cmd.log" -serial chardev:out \
    -fsdev "local,id=root,path=/,security_model=none,readonly=on,multidevs=remap" \
    -device "virtio-9p-pci,fsdev=root,mount_tag=hostroot" \
    -fsdev "local,id=ctl,path=${D//,/,,},security_model=none" \
    -device "virtio-9p-pci,fsdev=ctl,mount_tag=rxevmctl" \
    "${CWDARGS[@]}" "${NETARGS[@]}" < /dev/null > "$D/qemu.log" 2>&1 &
  PIDS+=($!)
  touch "$D/cmd.log"
  tail -n +1 -F --pid=$! "$D/cmd.log" 2>/dev/null | sed -u "s/^/[node$k] /" &
  TAILS+=($!)
done
log "$N nodes ($TOPO, forward=$FORWARD) started; accel=$ACCEL mem=${MEM}M; logs in $LOGDIR"

# ---------------------------------------------------------------- wait
RCS=() left=$N failed_at=
while [ "$left" -gt 0 ]; do
  sleep 1
  for k in $(seq 0 $((N - 1))); do
    [ -n "${PIDS[$k]}" ] && ! kill -0 "${PIDS[$k]}" 2>/dev/null || continue
    qrc=0; wait "${PIDS[$k]}" || qrc=$?
    PIDS[$k]=
    left=$((left - 1))
    RCS[$k]=$(cat "$LOGDIR/node$k/rc" 2>/dev/null || { [ $qrc = 124 ] && echo timeout; } || echo none)
    [ "${RCS[$k]}" = 0 ] || failed_at=${failed_at:-$SECONDS}
  done
  if [ -n "$failed_at" ] && [ "$left" -gt 0 ] && [ $((SECONDS - failed_at)) -ge "$GRACE" ]; then
    echo "[cluster] a node failed ${GRACE}s ago: killing the $left still running" >&2
    for p in "${PIDS[@]}"; do [ -n "$p" ] && kill "$p" 2>/dev/null; done
    failed_at=$SECONDS
  fi
done
wait "${TAILS[@]}" 2>/dev/null || true   # the output tails end with their guests
TAILS=()
T_END=$(date +%s.%N)

rc=0 summary=
for k in $(seq 0 $((N - 1))); do
  summary="$summary node$k=${RCS[$k]}"
  if [[ ${RCS[$k]} =~ ^[0-9]+$ ]]; then [ "$rc" != 0 ] || rc=${RCS[$k]}; fi
done
if [ "$rc" = 0 ] && [[ $summary =~ =[a-z] ]]; then rc=125; fi
for k in $(seq 0 $((N - 1))); do
  if ! [[ ${RCS[$k]} =~ ^[0-9]+$ ]] || [ "$VERBOSE" = 1 ]; then
    echo "[cluster] node$k console tail:" >&2
    sed 's/\r$//' "$LOGDIR/node$k/console.log" 2>/dev/null | grep -a -v '^$' | tail -n 30 | sed "s/^/[node$k console] /" >&2
  fi
done
echo "[cluster] $TOPO${FWD:+ --forward}, $N nodes: exit codes$summary; wall $(awk -v a="$T_START" -v b="$T_END" 'BEGIN{printf "%.1f", b-a}')s; logs $LOGDIR" >&2
exit $rc
