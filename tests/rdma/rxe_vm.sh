#!/bin/bash
# (The project's copy of ../shared/softroce/run-in-rxe-vm.sh, so that CI depends on nothing outside the repo; its
# kernel, accelerator and initramfs part is in vm_common.sh, which cluster.sh shares.)
# run-in-rxe-vm.sh - run a shell command inside a throw-away QEMU VM whose
# kernel has SoftRoCE (rdma_rxe) loaded and an rxe device ("rxe0") up.
#
# Usage:   run-in-rxe-vm.sh 'shell command'      (or: run-in-rxe-vm.sh cmd arg...)
# Output:  the command's stdout+stderr (merged) stream to this script's stdout.
# Exit:    the command's exit code; 125 if the VM itself failed (no exit code
#          came back: boot failure, timeout, crash) - the kernel console log
#          tail is then printed to stderr.
#
# The guest uses the HOST's root filesystem, shared read-only over virtio-9p,
# so every binary/library/Python env of the host is available in the guest.
# Writable in the guest: the current directory (and RXE_VM_RW_DIRS), shared
# read-write with the host; /tmp, /run (tmpfs); /etc /var /root /home are
# overlays whose writes are discarded when the VM exits.
#
# Inside the guest these variables are exported to the command:
#   RXE_DEV=rxe0  RXE_NETDEV=dummy0  RXE_IP=10.77.0.1
#   RXE_GID_INDEX=<index of the RoCE v2 IPv4-mapped GID ::ffff:10.77.0.1>
#   RXE_VM=1
# (rxe only implements RoCE v2, so every GID on rxe0 is RoCE v2; the
# IPv4 one is usually index 1, but always use $RXE_GID_INDEX.)
#
# Knobs (environment):
#   RXE_VM_KERNEL   path to vmlinuz (default: newest /boot/vmlinuz-* whose
#                   /lib/modules/<ver> has rdma_rxe.ko)
#   RXE_VM_ACCEL    kvm | tcg | auto (default auto: kvm only if /dev/kvm is
#                   usable AND the host hypervisor is not kvm_pvm)
#   RXE_VM_CPUS     guest vCPUs (default: 2)
#   RXE_VM_TCG_THREAD multi | single (TCG only; default multi; use single
#                   on a host whose cores are busy with other work)
#   RXE_VM_MEM      guest RAM in MiB (default 2048)
#   RXE_VM_TIMEOUT  seconds before the VM is killed (default 1800)
#   RXE_VM_RW_DIRS  extra ':'-separated host dirs shared read-write
#   RXE_VM_IP       guest address for dummy0 (default 10.77.0.1; exists
#                   only inside the guest)
#   RXE_VM_WORKDIR  cache/run dir (default /tmp/softroce)
#   RXE_VM_KVER     module dir name for RXE_VM_KERNEL (default: from file name)
#   RXE_VM_PVH=0    boot the compressed vmlinuz instead of the extracted
#                   vmlinux (PVH entry; saves ~3 s per boot under TCG)
#   RXE_VM_OVERLAYS dirs given a throw-away tmpfs overlay (default
#                   "/etc /var /root /home")
#   RXE_VM_KEEP=1   keep the per-run dir (console log etc.)
#   RXE_VM_VERBOSE=1 print kernel console + timing to stderr
#   RXE_VM_QUIET=1  don't print the one-line rxe summary to stderr at the end
#
# Requirements (Debian 12): qemu-system-x86 busybox-static kmod iproute2
#   linux-image-amd64 (any kernel with rdma_rxe.ko + 9p/virtio modules)
#   rdma-core ibverbs-providers ibverbs-utils (+ perftest, python3-pyverbs)
# Must run as root (9p export of / with security_model=none).
set -euo pipefail

T_START=$(date +%s.%N)
WORKDIR=${RXE_VM_WORKDIR:-/tmp/softroce}
VERBOSE=${RXE_VM_VERBOSE:-0}
log() { if [ "$VERBOSE" = 1 ]; then echo "[rxe-vm] $*" >&2; fi; }
die() { echo "[rxe-vm] ERROR: $*" >&2; exit 125; }

[ $# -ge 1 ] || { sed -n '2,40p' "$0" >&2; exit 2; }
if [ $# -eq 1 ]; then CMD=$1; else CMD=$(printf '%q ' "$@"); fi

. "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/vm_common.sh"
CPUS=${RXE_VM_CPUS:-2}
MEM=${RXE_VM_MEM:-2048}
TIMEOUT=${RXE_VM_TIMEOUT:-1800}
GUEST_IP=${RXE_VM_IP:-10.77.0.1}

# ---------------------------------------------------------------- per-run dir
RUN=$(mktemp -d "$WORKDIR/runs/run.XXXXXX")
QPID=
cleanup() {
  [ -n "$QPID" ] && kill "$QPID" 2>/dev/null || true
  if [ "${RXE_VM_KEEP:-0}" != 1 ]; then rm -rf "$RUN"; else echo "[rxe-vm] run dir kept: $RUN" >&2; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

printf '%s\n' "$CMD" > "$RUN/cmd.sh"
# host environment, minus things that must not leak into the guest
export -p | grep -v -E '^declare -[a-zA-Z]*x[a-zA-Z]* (BASH[A-Z_]*|SHELLOPTS|PPID|UID|EUID|SHLVL|OLDPWD|PWD|TERM|TMUX[A-Z_]*|SSH_[A-Z_]*|DISPLAY|XDG_RUNTIME_DIR|_)=' > "$RUN/env.sh" || true
HOST_PWD=$(pwd -P)

QEMU_RW=()
RW_SEEN=
: > "$RUN/rw.list"
n=0
IFS=: read -r -a EXTRA_RW <<< "${RXE_VM_RW_DIRS:-}"
for d in "$HOST_PWD" "${EXTRA_RW[@]}"; do
  [ -n "$d" ] || continue
  d=$(cd "$d" && pwd -P) || die "rw dir $d does not exist"
  [ "$d" = / ] && { echo "[rxe-vm] not sharing / read-write (cwd is /); it stays read-only" >&2; continue; }
  case "$d" in *$'\n'*) die "rw dir name contains a newline: $d" ;; esac
  case "$RW_SEEN" in *"|$d|"*) continue ;; esac
  RW_SEEN="$RW_SEEN|$d|"
  n=$((n+1))
  QEMU_RW+=(-fsdev "local,id=rw$n,path=${d//,/,,},security_model=none,multidevs=remap"
            -device "virtio-9p-pci,fsdev=rw$n,mount_tag=rw$n")
  printf 'rw%s %s\n' "$n" "$d" >> "$RUN/rw.list"
done
cat > "$RUN/mounts.sh" <<EOF
OVERLAYS="${RXE_VM_OVERLAYS:-/etc /var /root /home}"
EOF
cat > "$RUN/vars.sh" <<EOF
HOST_PWD=$(printf '%q' "$HOST_PWD")
GUEST_IP=$(printf '%q' "$GUEST_IP")
T_START=$T_START
EOF

cat > "$RUN/stage2.sh" <<'EOF'
# runs as PID 1 in the guest, root = host / (ro) with overlays
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
C=/run/rxe-vm
. $C/vars.sh
step() { echo "rxe-vm: $* (t=$(cut -d' ' -f1 /proc/uptime)s)" > /dev/ttyS0; }
finish() { echo "$1" > $C/rc.tmp; mv $C/rc.tmp $C/rc; sync; echo o > /proc/sysrq-trigger; sleep 30; }
mkdir -p /dev/pts /dev/shm /dev/mqueue
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
ln -sf /proc/self/fd /dev/fd; ln -sf fd/0 /dev/stdin; ln -sf fd/1 /dev/stdout; ln -sf fd/2 /dev/stderr
[ -e /dev/ptmx ] || ln -sf pts/ptmx /dev/ptmx
mount -t cgroup2 none /sys/fs/cgroup 2>/dev/null
hostname rxe-vm
ip link set lo up
step "stage2 start"
for m in rdma_rxe rdma_ucm ib_umad ib_uverbs; do modprobe $m || echo "modprobe $m failed" > /dev/ttyS0; step "modprobe $m"; done
ip link add dummy0 type dummy && ip addr add "$GUEST_IP/24" dev dummy0 && ip link set dummy0 up \
  || { echo "rxe-vm: cannot create dummy0" > /dev/ttyS0; finish 125; }
rdma link add rxe0 type rxe netdev dummy0 || { echo "rxe-vm: rdma link add failed" > /dev/ttyS0; finish 125; }
step "rdma link add done"
# wait for port ACTIVE and the IPv4-mapped RoCE v2 GID
IPHEX=$(printf '%02x%02x:%02x%02x' $(echo "$GUEST_IP" | tr . ' '))
WANT="0000:0000:0000:0000:0000:ffff:$IPHEX"
P=/sys/class/infiniband/rxe0/ports/1
GIDX=
for i in $(seq 1 200); do
  if grep -q ACTIVE $P/state 2>/dev/null; then
    for n in 0 1 2 3 4 5 6 7; do
      if [ "$(cat $P/gids/$n 2>/dev/null)" = "$WANT" ] && [ "$(cat $P/gid_attrs/types/$n 2>/dev/null)" = "RoCE v2" ]; then GIDX=$n; break; fi
    done
  fi
  [ -n "$GIDX" ] && break
  sleep 0.1
done
[ -n "$GIDX" ] || { echo "rxe-vm: no RoCE v2 GID for $GUEST_IP on rxe0" > /dev/ttyS0; cat $P/state $P/gids/[0-7] > /dev/ttyS0 2>&1; finish 125; }
step "rxe0 ACTIVE, RoCE v2 IPv4 GID index $GIDX"
echo "rxe0 up on dummy0 ($GUEST_IP), RoCE v2 IPv4 GID index $GIDX (\$RXE_GID_INDEX); guest ready at t=$(cut -d' ' -f1 /proc/uptime)s" > $C/info
ulimit -l unlimited 2>/dev/null
ulimit -n 65536 2>/dev/null
set -a; . $C/env.sh 2>/dev/null; set +a
export RXE_VM=1 RXE_DEV=rxe0 RXE_NETDEV=dummy0 RXE_IP=$GUEST_IP RXE_GID_INDEX=$GIDX
export HOME=${HOME:-/root} PWD=$HOST_PWD
cd "$HOST_PWD" 2>/dev/null || cd /
stty -F /dev/ttyS1 raw -echo 2>/dev/null
step "running command"
bash $C/cmd.sh < /dev/null > /dev/ttyS1 2>&1
rc=$?
step "command exited rc=$rc"
finish $rc
EOF

# ---------------------------------------------------------------- boot
APPEND="console=ttyS0 loglevel=${RXE_VM_LOGLEVEL:-4} panic=-1 rdinit=/init mitigations=off tsc=reliable no_timer_check audit=0 nokaslr"
[ "$VERBOSE" = 1 ] || APPEND="$APPEND quiet"
log "accel=$ACCEL cpus=$CPUS mem=${MEM}M rw dirs: $(tr '\n' ' ' < "$RUN/rw.list")"
set +e
timeout -k 10 "$TIMEOUT" qemu-system-x86_64 \
  "${ACCEL_ARGS[@]}" -M pc -smp "$CPUS" -m "$MEM" \
  -nodefaults -no-user-config -display none -vga none -nic none -no-reboot \
  -kernel "$KERNEL" -initrd "$INITRD" -append "$APPEND" \
  -serial "file:$RUN/console.log" \
  -chardev stdio,id=out,signal=off -serial chardev:out \
  -fsdev "local,id=root,path=/,security_model=none,readonly=on,multidevs=remap" \
  -device "virtio-9p-pci,fsdev=root,mount_tag=hostroot" \
  -fsdev "local,id=ctl,path=${RUN//,/,,},security_model=none" \
  -device "virtio-9p-pci,fsdev=ctl,mount_tag=rxevmctl" \
  "${QEMU_RW[@]}" < /dev/null &
QPID=$!
wait $QPID
QRC=$?
QPID=
set -e
T_END=$(date +%s.%N)
if [ "$VERBOSE" = 1 ]; then
  sed 's/\r$//' "$RUN/console.log" | grep -a -v '^$' | sed 's/^/[console] /' >&2
  log "qemu exit $QRC, wall $(awk -v a="$T_START" -v b="$T_END" 'BEGIN{printf "%.1f", b-a}')s"
fi
if [ -s "$RUN/info" ] && [ "${RXE_VM_QUIET:-0}" != 1 ]; then
  echo "[rxe-vm] $(cat "$RUN/info"); total wall $(awk -v a="$T_START" -v b="$T_END" 'BEGIN{printf "%.1f", b-a}')s" >&2
fi
if [ -s "$RUN/rc" ]; then
  exit "$(cat "$RUN/rc")"
fi
echo "[rxe-vm] VM produced no exit code (qemu rc=$QRC$([ $QRC = 124 ] && echo ', timeout')). Console tail:" >&2
tail -n 40 "$RUN/console.log" 2>/dev/null | sed 's/^/[console] /' >&2
exit 125
