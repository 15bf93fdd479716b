# cluster_node.sh - stage 2 of one cluster.sh guest: runs as PID 1, root = the host's / read-only with throw-away
# overlays on /etc /var /root /home. cluster.sh copies it into the node's private control dir (/run/rxe-vm here)
# with vars.sh (the exports), nics.list ("name mac address/prefix rxe-or-dash" lines), routes.list ("subnet via"
# lines), hosts, env.sh (the host's environment) and cmd.sh; the command's exit code is left in rc there.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
C=/run/rxe-vm
. $C/vars.sh
step() { echo "node$NODE_RANK: $* (t=$(cut -d' ' -f1 /proc/uptime)s)" > /dev/ttyS0; }
finish() { echo "$1" > $C/rc.tmp; mv $C/rc.tmp $C/rc; sync; echo o > /proc/sysrq-trigger; sleep 30; }
fail() { step "ERROR: $*"; finish 125; }
mkdir -p /dev/pts /dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
ln -sf /proc/self/fd /dev/fd; ln -sf fd/0 /dev/stdin; ln -sf fd/1 /dev/stdout; ln -sf fd/2 /dev/stderr
[ -e /dev/ptmx ] || ln -sf pts/ptmx /dev/ptmx
mount -t cgroup2 none /sys/fs/cgroup 2>/dev/null
hostname "node$NODE_RANK"
cp $C/hosts /etc/hosts
ip link set lo up
for m in virtio_net rdma_rxe rdma_ucm ib_umad ib_uverbs; do modprobe $m || fail "modprobe $m"; done
step "modules loaded"

# Name the NICs by MAC, in two passes (the kernel's ethN names may collide with ours), then address them.
i=0
while read -r name mac cidr rxe; do
  dev=
  for _ in $(seq 100); do
    dev=$(grep -lx "$mac" /sys/class/net/*/address 2>/dev/null | head -1)
    [ -n "$dev" ] && break
    sleep 0.1
  done
  [ -n "$dev" ] || fail "no NIC with MAC $mac"
  dev=${dev%/address}
  ip link set dev "${dev##*/}" name "tmp$i" || fail "cannot rename ${dev##*/}"
  i=$((i + 1))
done < $C/nics.list
i=0
while read -r name mac cidr rxe; do
  { ip link set dev "tmp$i" name "$name" && ip addr add "$cidr" dev "$name" && ip link set "$name" up; } \
    || fail "cannot set up $name ($cidr)"
  i=$((i + 1))
done < $C/nics.list
if [ "$CLUSTER_FORWARD" = 1 ]; then sysctl -qw net.ipv4.ip_forward=1 || fail "cannot enable forwarding"; fi
while read -r net via; do
  ip route add "$net" via "$via" || fail "cannot add route $net via $via"
done < $C/routes.list

# One rxe device per data NIC; wait until each port is ACTIVE with its IPv4-mapped RoCE v2 GID.
GIDS=
while read -r name mac cidr rxe; do
  [ "$rxe" = - ] && continue
  rdma link add "$rxe" type rxe netdev "$name" || fail "rdma link add $rxe on $name failed"
  ip=${cidr%/*}
  want="0000:0000:0000:0000:0000:ffff:$(printf '%02x%02x:%02x%02x' ${ip//./ })"
  port=/sys/class/infiniband/$rxe/ports/1
  gidx=
  for _ in $(seq 300); do
    if grep -q ACTIVE $port/state 2>/dev/null; then
      for n in 0 1 2 3 4 5 6 7; do
        if [ "$(cat $port/gids/$n 2>/dev/null)" = "$want" ] && [ "$(cat $port/gid_attrs/types/$n 2>/dev/null)" = "RoCE v2" ]; then
          gidx=$n; break
        fi
      done
    fi
    [ -n "$gidx" ] && break
    sleep 0.1
  done
  [ -n "$gidx" ] || fail "$rxe on $name: no ACTIVE port with a RoCE v2 GID for $ip ($(cat $port/state 2>&1))"
  GIDS="$GIDS${GIDS:+ }$gidx"
done < $C/nics.list
step "network up: $(ip -br -4 addr | grep -v '^lo' | awk '{print $1 "=" $3}' | tr '\n' ' ')rxe GID index $GIDS"

ulimit -l unlimited 2>/dev/null
ulimit -n 65536 2>/dev/null
set -a; . $C/env.sh 2>/dev/null; set +a
. $C/vars.sh
export CLUSTER_GID_INDEX="$GIDS" CLUSTER_OUT=$C/out CLUSTER_RC=$C/rc HOSTNAME="node$NODE_RANK" HOME=${HOME:-/root} PWD=$HOST_PWD
mkdir -p $C/out
cd "$HOST_PWD" 2>/dev/null || cd /
stty -F /dev/ttyS1 raw -echo 2>/dev/null
step "running command"
bash $C/cmd.sh < /dev/null > /dev/ttyS1 2>&1
rc=$?
step "command exited rc=$rc"
finish $rc
