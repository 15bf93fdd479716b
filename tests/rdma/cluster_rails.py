"""Striping over rails, on the emulated cluster's direct cable (tests/rdma/cluster.sh --topology direct: two
nodes, two links between them, as the two PCIe functions of a DGX Spark's port), one rank per node under torchrun:

  1. each rank reaches its peer over both devices, the same two in the same order at both ends;
  2. every collective exact and bitwise equal on both ranks at sizes around the stripe size and across pieces;
  3. striping happened: over calls of 64 KiB both devices' sent-packet counters (rxe hw_counters) grow by at
     least 40% of the packets the calls' data needs, and over calls of 400 bytes the second rail carries fewer
     than half the first's packets (probes, which go over every rail while a call waits);
  4. a rail taken down mid-run (node 1 downs its second rail's interface): every call either exact or an error
     naming the peer, within the bound, the failing call's output never part data (all poison).

Prints `cluster_rails: ok` or `cluster_rails: FAILED ...` and one `cluster_rails {json}` line of figures.

  cluster.sh --topology direct 'torchrun --nnodes 2 --nproc-per-node 1 --node-rank $NODE_RANK \\
      --master-addr $MASTER_ADDR --master-port $MASTER_PORT tests/rdma/cluster_rails.py'
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

os.environ.setdefault("ROCENANTE_PROXY_SPIN_S", "0")  # one vCPU per guest: the proxy naps when idle
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import rocenante  # noqa: E402
from reference import digest, make_input, poison, reduced, sequential_fp32  # noqa: E402

CAPACITY = 128 << 10
TIMEOUT_S = 30.0
BOUND_S = TIMEOUT_S + 15.0  # emulated clocks: loose
MTU = 1024  # SoftRoCE's active MTU: bytes of payload per packet


def sent_packets(device: str) -> int:
    with open(f"/sys/class/infiniband/{device}/ports/1/hw_counters/sent_pkts") as f:
        return int(f.read())


def interface_of(device: str) -> str:
    return dict(zip(os.environ["CLUSTER_RXE"].split(), os.environ["CLUSTER_IFS"].split()))[device]


def exact_calls(comm, rank, world, wrong, seed):
    """All-reduce, all-gather, reduce-scatter and all-to-all around the stripe size (32 KiB a span) and across
    pieces."""
    digests, case = [], 0
    for numel in (7, 8188, 8192, 8195, 16411, CAPACITY // 4 + 13, 3 * CAPACITY // 4 + 1):
        for collective in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            n = numel - numel % world if collective in ("reduce_scatter", "all_to_all") else numel
            inputs = [make_input(seed, case, r, n, torch.float32) for r in range(world)]
            if collective == "all_reduce":
                out, want = poison(torch.empty(n)), sequential_fp32(inputs, "sum")
                comm.all_reduce(inputs[rank], out=out)
            elif collective == "all_gather":
                out, want = poison(torch.empty(world * n)), torch.cat(inputs)
                comm.all_gather(inputs[rank], out=out)
            elif collective == "reduce_scatter":
                out, want = poison(torch.empty(n // world)), reduced(inputs, "sum")[rank * (n // world):(rank + 1) * (n // world)]
                comm.reduce_scatter(inputs[rank], out=out)
            else:
                out, want = poison(torch.empty(n)), torch.cat([x.chunk(world)[rank] for x in inputs])
                comm.all_to_all(inputs[rank], out=out)
            if not torch.equal(out, want):
                wrong.append(f"{collective} of {n} floats: not exact")
            if collective in ("all_reduce", "all_gather"):  # the others' outputs differ by rank
                digests.append(digest(out))
            case += 1
    return digests


def counted(comm, rank, world, numel, rails):
    """Each rail's sent packets over 20 all-reduces of `numel` floats (both ranks' calls inside the window)."""
    dist.barrier()
    before = [sent_packets(d) for d in rails]
    for i in range(20):
        inputs = [make_input(31, i, r, numel, torch.float32) for r in range(world)]
        comm.all_reduce(inputs[rank], out=poison(torch.empty(numel)))
    dist.barrier()
    return [sent_packets(d) - b for d, b in zip(rails, before)]


def rail_down(comm, rank, world, rails):
    """Node 1 downs its second rail's interface 0.3 s into a run of striped calls."""
    victim = interface_of(rails[1])
    if rank == 1:
        threading.Timer(0.3, lambda: subprocess.run(["ip", "link", "set", victim, "down"], check=True)).start()
    done, exact = 0, True
    for case in range(300):
        inputs = [make_input(41, case, r, CAPACITY // 4, torch.float32) for r in range(world)]
        out = poison(torch.empty(CAPACITY // 4))
        began = time.monotonic()
        try:
            comm.all_reduce(inputs[rank], out=out)
        except rocenante.RocenanteError as err:
            return {"calls": done, "exact": exact, "error": str(err), "seconds": round(time.monotonic() - began, 2),
                    "failing_output_all_poison": bool(torch.isnan(out).all())}
        exact = exact and torch.equal(out, sequential_fp32(inputs, "sum"))
        done += 1
    return {"calls": done, "exact": exact, "error": None}


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "the direct cable: tests/rdma/cluster.sh --topology direct"
    store = dist.distributed_c10d._get_default_store()
    wrong, figures = [], {"rank": rank}
    comm = rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=TIMEOUT_S, name="rails")
    path = comm.ib_paths[1 - rank]
    rails = [r.device for r in (path, *path.rails)]
    figures["rails"] = rails
    everyone = [None] * world
    dist.all_gather_object(everyone, rails)
    if len(rails) != 2 or everyone[0] != everyone[1]:
        wrong.append(f"rails {everyone}: want the two devices, in one order at both ends")
    digests = exact_calls(comm, rank, world, wrong, 5)
    dist.all_gather_object(everyone, digests)
    if everyone[0] != everyone[1]:
        wrong.append("results differ between ranks")
    if len(rails) == 2:
        large = counted(comm, rank, world, 16 << 10, rails)  # 64 KiB a call: striped
        small = counted(comm, rank, world, 100, rails)  # 400 bytes: the first rail
        figures.update(large_call_packets=large, small_call_packets=small)
        need = 20 * (16 << 10) * 4 // MTU  # this rank's packets of data over the 20 calls
        if min(large) < 0.4 * need:
            wrong.append(f"64 KiB calls: packets per rail {large}, want each at least {0.4 * need:.0f} of {need}")
        if small[1] >= small[0] // 2:  # probes go over every rail while a call waits (rdma.md, Faults)
            wrong.append(f"400-byte calls: packets per rail {small}: the second rail carried data")
        down = rail_down(comm, rank, world, rails)
        figures["rail_down"] = down
        if down["error"] is None:
            wrong.append(f"{down['calls']} calls and no error after the second rail went down")
        elif not down["exact"] or not down["failing_output_all_poison"] or down["seconds"] > BOUND_S or \
                f"rank {1 - rank}" not in down["error"]:
            wrong.append(f"rail down: {down}")
        if rank == 1:
            subprocess.run(["ip", "link", "set", interface_of(rails[1]), "up"], check=True)
    comm.close()
    print(f"cluster_rails {json.dumps(dict(figures, wrong=wrong))}", flush=True)
    print(f"cluster_rails: {'ok' if not wrong else 'FAILED ' + '; '.join(wrong)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
