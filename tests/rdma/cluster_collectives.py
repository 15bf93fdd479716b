"""Runs on every node of the emulated cluster (tests/rdma/cluster.sh), one rank per node, under torchrun over the
management network: builds a rocenante communicator with nothing forced (every peer on a host of its own, so
RDMA, each by the route that reaches it), checks that each peer went through a device on a link that reaches it
(CLUSTER_PEERS) or, without a link, through a forwarded route, and that every collective is exact in every dtype
and op, within a piece and across pieces: all-reduces and reduce-scatters against the rank-order fp32 result (and
float64), all-gathers and all-to-alls bit for bit on any bits, every rank's results bitwise equal (all-to-alls differ
by rank: each checks its own). `unrouted`: the setup must fail on every rank naming
the pairs no route joins. Prints `cluster_collectives: ok` and exits 0 when all held.

  torchrun --nnodes $NNODES --nproc-per-node 1 --node-rank $NODE_RANK --master-addr $MASTER_ADDR \\
      --master-port $MASTER_PORT tests/rdma/cluster_collectives.py [ok|unrouted]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import rocenante  # noqa: E402
from reference import (DTYPES, bits, check_against_float64, digest, make_input, ops_for, poison, random_bits,  # noqa: E402
                       reduced, sequential_fp32, split_block, split_rows)


def linked_devices(peer: int) -> set:
    """This node's rxe devices on a link to `peer` (CLUSTER_PEERS: "rxeI:rank:ip ...")."""
    return {dev for dev, rank, _ in (e.split(":") for e in os.environ["CLUSTER_PEERS"].split()) if int(rank) == peer}


def main() -> int:
    expect = sys.argv[1] if len(sys.argv) > 1 else "ok"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    capacity = 64 << 10
    try:
        comm = rocenante.Communicator(store, rank, world, capacity_bytes=capacity, timeout_s=120, name="cluster")
    except rocenante.RocenanteError as err:
        print(f"rank {rank}: setup failed: {err}", flush=True)
        # ring4 without forwarding: the diagonals, on every rank alike.
        ok = expect == "unrouted" and str(err).startswith("no RDMA route between ranks 0 and 2; ranks 1 and 3")
        print(f"cluster_collectives: {'ok' if ok else 'FAILED'}", flush=True)
        return 0 if ok else 1
    if expect == "unrouted":
        print("cluster_collectives: FAILED: the setup succeeded without routes", flush=True)
        return 1
    wrong = []
    if comm.net != "ib":
        wrong.append(f"net {comm.net!r}, not ib")
    for peer, path in enumerate(comm.ib_paths):
        for rail in (path, *path.rails) if path is not None else ():
            if linked_devices(peer) and rail.device not in linked_devices(peer):
                wrong.append(f"reaches rank {peer} over {rail.device}, not its link {sorted(linked_devices(peer))}")
            else:
                print(f"rank {rank}: rank {peer} over {rail.device}: {rail.why}", flush=True)
    seed = 11
    digests, case = [], 0
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for numel in (7, 3000, capacity // dtype.itemsize + 13):  # small, mid, two pieces
                inputs = [make_input(seed, case, r, numel, dtype) for r in range(world)]
                out = poison(torch.empty(numel, dtype=dtype))
                comm.all_reduce(inputs[rank], op=op, out=out)
                if not torch.equal(out, sequential_fp32(inputs, op)):
                    wrong.append(f"case {case}: {dtype} {op} {numel}: not the rank-order result")
                check_against_float64(out, inputs, op)
                digests.append(digest(out))
                case += 1
        for numel in (5, 3000, capacity // dtype.itemsize + 13):  # a shard's elements
            shards = [random_bits(seed, case, r, numel, dtype) for r in range(world)]
            out = comm.all_gather(shards[rank], out=poison(torch.empty(world * numel, dtype=dtype)))
            if not torch.equal(bits(out), bits(torch.cat(shards))):
                wrong.append(f"case {case}: all_gather {dtype} {numel}: not every bit")
            digests.append(digest(out))
            case += 1
            for op in ops_for(dtype):
                inputs = [make_input(seed, case, r, world * numel, dtype) for r in range(world)]
                out = comm.reduce_scatter(inputs[rank], op=op, out=poison(torch.empty(numel, dtype=dtype)))
                if not torch.equal(bits(out), bits(reduced(inputs, op)[rank * numel:(rank + 1) * numel])):
                    wrong.append(f"case {case}: reduce_scatter {dtype} {op} {numel}: not the rank-order result")
                case += 1
            blocks = [random_bits(seed, case, r, world * numel, dtype) for r in range(world)]
            out = comm.all_to_all(blocks[rank], out=poison(torch.empty(world * numel, dtype=dtype)))
            if not torch.equal(bits(out), bits(torch.cat([b[rank * numel:(rank + 1) * numel] for b in blocks]))):
                wrong.append(f"case {case}: all_to_all {dtype} {numel}: not every peer's block, bit for bit")
            case += 1
        rows = split_rows(seed, case, world, comm.largest_block(dtype) // 3)  # each pair's block its own size
        sent = torch.cat([split_block(seed, case, rank, t, world, rows[rank][t], 3, dtype) for t in range(world)])
        want = torch.cat([split_block(seed, case, s, rank, world, rows[s][rank], 3, dtype) for s in range(world)])
        out = comm.all_to_all(sent, out=poison(torch.empty_like(want)), input_split_sizes=rows[rank],
                              output_split_sizes=[rows[s][rank] for s in range(world)])
        if not torch.equal(bits(out), bits(want)):
            wrong.append(f"case {case}: split all_to_all {dtype} {rows}: not every peer's block, bit for bit")
        case += 1
    everyone = [None] * world
    dist.all_gather_object(everyone, digests)
    if any(d != everyone[0] for d in everyone):
        wrong.append("results differ between ranks")
    comm.close()
    dist.destroy_process_group()
    for line in wrong:
        print(f"rank {rank}: {line}", flush=True)
    print(f"cluster_collectives: {'ok' if not wrong else 'FAILED'} ({case} cases)", flush=True)
    return 0 if not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
