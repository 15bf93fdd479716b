#!/bin/bash
# cluster_smoke.sh - the smoke test of a cluster.sh topology, run on every node:
#   tests/rdma/cluster.sh --topology T [--nodes N] [--forward] 'bash tests/rdma/cluster_smoke.sh'
# 1. pings every other node's management address, and every data address of every other node: one on a subnet of
#    this node must answer; one on no subnet of this node (mesh3's third link, ring4's far links) must answer only
#    with --forward (routed by a neighbour), and must not answer without;
# 2. ibv_rc_pingpong over every link's rxe devices (the lower rank serves), and with --forward between each pair
#    of nodes with no link (ring4's diagonals), routed through a neighbour;
# 3. torchrun over the management network (static rendezvous at node0) with a gloo all_reduce of ones: sum NNODES.
# Exit 0 if all passed. PYTHON picks the interpreter (default python3).
set -uo pipefail
fails=0
t0=$SECONDS
pass() { echo "ok   $*"; }
flunk() { echo "FAIL $*"; fails=$((fails + 1)); }
on_my_subnet() { local a; for a in $CLUSTER_IPS; do [ "${a%.*}" = "${1%.*}" ] && return 0; done; return 1; }

# 1. reachability (peers may still be booting: wait up to 120 s for the first answer)
for k in $(seq 0 $((NNODES - 1))); do
  [ "$k" = "$NODE_RANK" ] && continue
  if ping -c 1 -w 120 -q "node$k" > /dev/null; then pass "ping node$k (mgmt)"; else flunk "ping node$k (mgmt)"; fi
done
unlinked=
for e in $CLUSTER_ALL_IPS; do
  k=${e%%:*} ip=${e#*:}
  [ "$k" = "$NODE_RANK" ] && continue
  if on_my_subnet "$ip"; then
    if ping -c 1 -w 120 -q "$ip" > /dev/null; then pass "ping node$k $ip (linked)"; else flunk "ping node$k $ip (linked)"; fi
  elif [ "$CLUSTER_FORWARD" = 1 ]; then
    if ping -c 1 -w 120 -q "$ip" > /dev/null; then pass "ping node$k $ip (routed: $(ip -o route get "$ip" | awk '{print $2, $3, $4, $5}'))"
    else flunk "ping node$k $ip (routed)"; fi
    case " $CLUSTER_PEERS $unlinked " in *":$k:"*|*" $k "*) ;; *) unlinked="$unlinked $k" ;; esac
  else
    if ping -c 1 -w 5 -q "$ip" > /dev/null 2>&1; then flunk "ping node$k $ip answered, but it is on no subnet of this node and nothing forwards"
    else pass "ping node$k $ip fails (not on a subnet of this node, no forwarding)"; fi
  fi
done
echo "pings done at ${SECONDS}s"

# 2. RDMA: an RC ping-pong per link (port from the link's subnet and the two ranks), each in the background
gid_of() {   # the GID index of rxe device $1
  local -a devs=($CLUSTER_RXE) gids=($CLUSTER_GID_INDEX); local i
  for i in "${!devs[@]}"; do [ "${devs[$i]}" = "$1" ] && echo "${gids[$i]}"; done
}
pingpong() {   # pingpong LABEL DEV PORT [SERVER_IP]: serve, or connect (retrying while the server is not up)
  local label=$1 dev=$2 port=$3 out
  out=$(mktemp)
  for _ in $(seq 60); do
    timeout 300 ibv_rc_pingpong -d "$dev" -g "$(gid_of "$dev")" -p "$port" -n 200 ${4:+"$4"} > "$out" 2>&1 && break
    [ -z "${4:-}" ] && break
    sleep 2
  done
  if grep -q 'iters in' "$out"; then echo "ok   rc_pingpong $label: $(grep 'iters in' "$out")"; rm -f "$out"; return 0; fi
  echo "FAIL rc_pingpong $label:"; sed 's/^/     /' "$out"; rm -f "$out"; return 1
}
jobs_=()
for e in $CLUSTER_PEERS; do
  IFS=: read -r dev k ip <<< "$e"
  lo=$((NODE_RANK < k ? NODE_RANK : k)) hi=$((NODE_RANK < k ? k : NODE_RANK))
  port=$((18000 + 100 * $(echo "$ip" | cut -d. -f3) + 10 * lo + hi))
  if [ "$NODE_RANK" -lt "$k" ]; then pingpong "$dev serves node$k (port $port)" "$dev" $port &
  else pingpong "$dev -> node$k $ip" "$dev" $port "$ip" & fi
  jobs_+=($!)
done
for k in $unlinked; do   # routed: the lower rank serves on its first device, at its first address
  lo=$((NODE_RANK < k ? NODE_RANK : k)) hi=$((NODE_RANK < k ? k : NODE_RANK))
  port=$((18900 + 10 * lo + hi))
  if [ "$NODE_RANK" -lt "$k" ]; then
    dev=${CLUSTER_RXE%% *}; pingpong "$dev serves node$k, routed (port $port)" "$dev" $port &
  else
    ip=$(for e in $CLUSTER_ALL_IPS; do [ "${e%%:*}" = "$lo" ] && echo "${e#*:}"; done | head -1)
    netdev=$(ip -o route get "$ip" | sed -n 's/.* dev \([^ ]*\).*/\1/p')
    dev=rxe${netdev#eth}; pingpong "$dev -> node$k $ip, routed via $netdev" "$dev" $port "$ip" &
  fi
  jobs_+=($!)
done
for j in "${jobs_[@]}"; do wait "$j" || fails=$((fails + 1)); done
echo "rdma done at ${SECONDS}s"

# 3. torchrun rendezvous + gloo all_reduce over mgmt0
py=$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')
cat > /tmp/allreduce.py <<'EOF'
import torch, torch.distributed as d
d.init_process_group("gloo")
t = torch.ones(1)
d.all_reduce(t)
print("sum", t.item(), "rank", d.get_rank(), "of", d.get_world_size(), flush=True)
assert t.item() == d.get_world_size()
EOF
if timeout 1200 "$py" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node 1 --node-rank "$NODE_RANK" \
     --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" /tmp/allreduce.py 2>&1 | grep -v '^$'; then
  pass "torchrun gloo all_reduce"
else
  flunk "torchrun gloo all_reduce"
fi
echo "node$NODE_RANK: $fails failed, $((SECONDS - t0))s"
[ "$fails" = 0 ]
