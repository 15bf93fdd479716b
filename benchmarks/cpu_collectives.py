"""The CPU host path against gloo for each collective, and one-shot against two-shot all-reduce, on one host:
  python benchmarks/cpu_collectives.py [-n RANKS] [--out JSON]
Ranks are processes (FileStore). Per collective and size, every arm's output is checked against gloo's once, then
the arms are timed interleaved, round after round, the arm order rotated every round (rocenante.bench's method,
eager, host clock): each measurement is a barrier, then `calls_per_measurement` back-to-back calls; the slower
rank's time per measurement counts. Rows (schema rocenante.bench/1): arm "<collective>/<implementation>", bytes the
all-reduce's tensor, the all-gather's output, the reduce-scatter's input."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from rocenante.bench import provenance
from rocenante.bench.runner import calls_per_measurement, round_order, summarize

SIZES = [1 << k for k in range(10, 23, 2)]  # 1 KiB .. 4 MiB
CAPACITY = 4 << 20


def _arms(comms, world):
    """{(collective, implementation): fn(x) -> output} for float32 tensors of `nbytes` (the row's bytes)."""
    one, two = comms

    def gloo_gather(x):
        out = torch.empty(world * x.numel())
        dist.all_gather_into_tensor(out, x)
        return out

    def gloo_scatter(x):
        out = torch.empty(x.numel() // world)
        dist.reduce_scatter_tensor(out, x)
        return out

    def gloo_reduce(x):
        y = x.clone()
        dist.all_reduce(y)
        return y

    return {
        ("all_reduce", "rocenante_oneshot"): one.all_reduce,
        ("all_reduce", "rocenante_twoshot"): two.all_reduce,
        ("all_reduce", "gloo"): gloo_reduce,
        ("all_gather", "rocenante"): one.all_gather,
        ("all_gather", "gloo"): gloo_gather,
        ("reduce_scatter", "rocenante"): one.reduce_scatter,
        ("reduce_scatter", "gloo"): gloo_scatter,
    }


def _input_numel(collective, nbytes, world):
    """Elements of a rank's input for a row of `nbytes` (rounded down to whole shards where the world divides)."""
    shard = nbytes // 4 // world
    return {"all_reduce": nbytes // 4, "all_gather": shard, "reduce_scatter": shard * world}[collective]


def _rank(store_path, rank, world, rounds, queue):
    try:
        import rocenante

        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        comms = []
        for algo in ("oneshot", "twoshot"):
            os.environ["ROCENANTE_ALGO"] = algo
            comms.append(rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, name=algo))
        arms = _arms(comms, world)
        assert comms[1].two_shot(1) and not comms[0].two_shot(1 << 30)
        times = {}
        for nbytes in SIZES:
            for collective in ("all_reduce", "all_gather", "reduce_scatter"):
                names = [k for k in arms if k[0] == collective]
                g = torch.Generator().manual_seed(nbytes + rank)
                # Integers k/8: every sum is exact, so every arm gives the same bits.
                x = (torch.randint(-16, 17, (_input_numel(collective, nbytes, world),), generator=g) / 8).float()
                want = arms[collective, "gloo"](x)
                for name in names:
                    got = arms[name](x)
                    if not torch.equal(got, want):
                        raise AssertionError(f"{name} {nbytes} B differs from gloo's result")
                calls = calls_per_measurement(nbytes)
                for rnd in range(rounds):
                    for name in round_order(names, rnd):
                        dist.barrier()
                        start = time.perf_counter()
                        for _ in range(calls):
                            arms[name](x)
                        times.setdefault((name, 4 * x.numel() * (world if collective == "all_gather" else 1)),
                                         []).append((time.perf_counter() - start) * 1e6 / calls)
        for c in comms:
            c.close()
        dist.destroy_process_group()
        queue.put((rank, {f"{c}|{i}|{b}": v for ((c, i), b), v in times.items()}))
    except BaseException as err:
        import traceback

        queue.put((rank, {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()}"}))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("-n", "--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    load_before = os.getloadavg()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(os.path.join(tmp, "store"), r, a.ranks, a.rounds, queue))
                 for r in range(a.ranks)]
        for proc in procs:
            proc.start()
        results = dict(queue.get(timeout=3600) for _ in procs)
        for proc in procs:
            proc.join(60)
    for r, res in results.items():
        if "error" in res:
            sys.exit(f"rank {r}: {res['error']}")
    rows = []
    for key in results[0]:
        collective, impl, nbytes = key.split("|")
        stats = summarize([results[r][key] for r in range(a.ranks)])
        rows.append({"arm": f"{collective}/{impl}", "mode": "eager", "dtype": "float32", "bytes": int(nbytes), **stats})
    method = {"script": "benchmarks/cpu_collectives.py", "ranks": f"{a.ranks} processes of one host",
              "rounds": a.rounds, "capacity_bytes": CAPACITY,
              "bytes": "all_reduce: the tensor; all_gather: the output; reduce_scatter: the input",
              "statistic": "per measurement the slower rank's mean time per call; median, p10, p90 over rounds"}
    result = {"schema": "rocenante.bench/1", "provenance": provenance.collect("cpu", method, load_before),
              "world_size": a.ranks, "rows": rows}
    out = a.out or f"benchmarks/results/cpu-collectives-{a.ranks}r.json"
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    for row in sorted(rows, key=lambda r: (r["arm"].split("/")[0], r["bytes"], r["arm"])):
        print(f"{row['arm']:>32} {row['bytes']:>9} B  median {row['median_us']:9.1f} us  "
              f"(p10 {row['p10_us']:.1f}, p90 {row['p90_us']:.1f})")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
