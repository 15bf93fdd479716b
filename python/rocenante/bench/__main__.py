"""python -m rocenante.bench [--device cpu|cuda] [-n RANKS] ...: checks every arm's output, times the arms side by
side, interleaved and in rotated order, prints nccl-tests-style tables and writes JSON (and a PNG when matplotlib
is there). The method is described in runner.py and benchmarks/README.md ("Method"). Across hosts, one process per
node: torchrun --nnodes N --nproc-per-node 1 ... -m rocenante.bench (rank 0 reports)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from rocenante.bench import arms, runner


# Seconds a rank process gets to exit after its result, or to report after a peer's failure.
_GRACE_S = 60


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)


def _capacity_bytes(a) -> int:
    """The communicators' capacity: the largest size (an all-reduce's piece), or for unequal blocks what holds the
    largest block of the largest size in one slot of a power of two chunks (csrc/layout.h, largest_block())."""
    from rocenante import _C

    if a.collective != "all_to_all_unequal":
        return a.max_bytes
    most = max(max(runner.block_sizes(a.collective, a.ranks, a.max_bytes // esize)[0]) * esize for esize in (2, 4))
    chunks = 1 + (most + 15) // 16  # the header, then the block
    slot = 1 << (chunks - 1).bit_length()  # the power of two at or above
    granule = _C.capacity_granule_bytes
    return max(a.max_bytes, -(-2 * 16 * a.ranks * slot // granule) * granule)  # world slots of lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m rocenante.bench", description=__doc__)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--collective", choices=["all_reduce", "all_to_all", "all_to_all_unequal"], default="all_reduce",
                   help="all_reduce (sum), all_to_all of world_size equal blocks, or all_to_all_unequal: blocks of "
                        "1 to world_size parts, every rank sending and receiving one size (all_to_all_single for "
                        "the torch.distributed arms)")
    p.add_argument("-n", "--ranks", type=int, default=None, help="processes (default: every GPU, or 2 on CPU)")
    p.add_argument("--min-bytes", type=_size, default=None, help="default 256 on GPU, 1K on CPU")
    p.add_argument("--max-bytes", type=_size, default=None, help="default 64M on GPU, 1M on CPU")
    p.add_argument("--size-factor", type=int, default=2, help="ratio between successive sizes (default 2)")
    p.add_argument("--dtypes", default=None, help="comma-separated; default bfloat16,float16,float32 on GPU, float32 on CPU")
    p.add_argument("--modes", default=None, help="graph,eager on GPU (default); eager on CPU")
    p.add_argument("--arms", default="", help="comma-separated subset of arms (default: all but "
                   + ",".join(arms.ON_REQUEST) + "); on GPU "
                   + ",".join(arms.NAMES["cuda"]) + "; on CPU " + ",".join(arms.NAMES["cpu"]))
    p.add_argument("--rounds", type=int, default=25,
                   help=f"measurements (graph replays or eager loops) per arm, size and mode, at least "
                        f"{runner.MIN_ROUNDS} (default 25)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<device>-<ranks>r.json, "
                   "all_to_all: <device>-<ranks>r-all-to-all.json, all_to_all_unequal: ...-all-to-all-unequal.json)")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--calibration", default=None,
                   help="also write a scaling-model calibration file (python -m rocenante.model --calibration) "
                        "fitted to rocenante's one-shot times (graph mode if measured, first dtype)")
    a = p.parse_args(argv)
    gpu = a.device == "cuda"
    if "LOCAL_WORLD_SIZE" in os.environ:  # torchrun's ranks, one GPU each (_under_torchrun)
        a.ranks = int(os.environ["WORLD_SIZE"])
    a.ranks = a.ranks or (torch.cuda.device_count() if gpu else 2)
    a.min_bytes = a.min_bytes or (256 if gpu else 1024)
    a.max_bytes = a.max_bytes or ((64 << 20) if gpu else (1 << 20))
    a.dtypes = (a.dtypes or ("bfloat16,float16,float32" if gpu else "float32")).split(",")
    a.modes = (a.modes or ("graph,eager" if gpu else "eager")).split(",")
    if not gpu and "graph" in a.modes:
        p.error("graph mode needs --device cuda")
    if gpu and a.ranks > torch.cuda.device_count() and "LOCAL_WORLD_SIZE" not in os.environ:
        p.error(f"{a.ranks} ranks need {a.ranks} GPUs; this machine has {torch.cuda.device_count()}")
    if a.ranks < 2:
        p.error("a benchmark needs at least 2 ranks")
    if a.calibration and a.collective != "all_reduce":
        p.error("--calibration fits the all-reduce model: it needs --collective all_reduce")
    if a.rounds < runner.MIN_ROUNDS:
        p.error(f"--rounds {a.rounds}: p10 and p90 need at least {runner.MIN_ROUNDS} measurements")
    known = [x for x in arms.NAMES[a.device] if a.collective == "all_reduce" or x not in arms.ALL_REDUCE_ONLY]
    a.arms = [x for x in a.arms.split(",") if x]
    unknown = [x for x in a.arms if x not in known]
    if unknown:
        p.error(f"unknown arm(s) {','.join(unknown)} on {a.device}; known: {','.join(known)}")
    if not 1 <= a.min_bytes <= a.max_bytes or a.size_factor < 2:
        p.error("sizes need 1 <= --min-bytes <= --max-bytes and --size-factor >= 2")
    return a


def _write_calibration(result: dict, path: str) -> None:
    from rocenante.model import allreduce

    rows = [r for r in result["rows"] if r["arm"] == "rocenante"]
    mode = "graph" if any(r["mode"] == "graph" for r in rows) else rows[0]["mode"]
    rows = [r for r in rows if r["mode"] == mode and r["dtype"] == rows[0]["dtype"]]
    prov = result["provenance"]
    source = (f"python -m rocenante.bench, {result['world_size']} ranks, {prov.get('gpu') or prov.get('cpu')}, "
              f"{mode} mode, {rows[0]['dtype']}, revision {prov['git_revision']}, {prov['date_utc']}")
    name = f"measured-{result['config']['device']}-{result['world_size']}r"
    calibration = allreduce.calibrate(name, result["world_size"], [(r["bytes"], r["median_us"] * 1e-6) for r in rows], source)
    with open(path, "w") as f:
        json.dump(calibration, f, indent=1)
    print(f"wrote {path}")


def main(argv=None) -> int:
    import multiprocessing as mp
    import tempfile
    from queue import Empty

    import rocenante
    from rocenante import _C

    a = parse_args(argv)
    sizes, b = [], a.min_bytes
    while b <= a.max_bytes:
        sizes.append(b)
        b *= a.size_factor
    cfg = {
        "device": a.device, "collective": a.collective, "sizes": sizes, "dtypes": a.dtypes, "modes": a.modes,
        "rounds": a.rounds,
        "arms": a.arms, "max_bytes": a.max_bytes,
        "capacity_bytes": min(_capacity_bytes(a), _C.max_capacity_bytes),
    }
    load_before = os.getloadavg()
    if "LOCAL_WORLD_SIZE" in os.environ:
        return _under_torchrun(a, cfg, load_before)
    print(f"rocenante {rocenante.__version__}: {a.collective} benchmark, {a.ranks} ranks on {a.device}", flush=True)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=runner.run_rank, args=(store, r, a.ranks, cfg, queue)) for r in range(a.ranks)]
        for p in procs:
            p.start()
        results, give_up = {}, None
        while len(results) < a.ranks:
            try:
                rank, value = queue.get(timeout=5)
            except Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                late = [r for r in range(a.ranks) if r not in results]
                if (dead and queue.empty()) or (give_up is not None and time.monotonic() > give_up):
                    for p in procs:
                        p.kill()
                    why = "exited" if dead else f"did not report within {_GRACE_S} s of a peer's failure"
                    print(f"rank(s) {dead or late} {why} without a result", file=sys.stderr)
                    if not any("error" in v for v in results.values()):
                        return 1
                    break
                continue
            results[rank] = value
            if "error" in value and give_up is None:  # its peers may be stuck in a collective with it
                give_up = time.monotonic() + _GRACE_S
        for p in procs:  # results are in; teardown gets a bounded time
            p.join(timeout=_GRACE_S)
            if p.is_alive():
                print(f"rank process {p.pid} did not exit within {_GRACE_S} s of its result; killing it",
                      file=sys.stderr)
                p.kill()
    failed = {r: v for r, v in results.items() if "error" in v}
    if failed:
        for r, v in sorted(failed.items()):
            print(f"rank {r} failed:\n{v['error']}", file=sys.stderr)
        return 1
    return _report(a, cfg, results[0], a.ranks, load_before)


def _under_torchrun(a, cfg: dict, load_before: tuple) -> int:
    """One rank of a benchmark that torchrun launched (across hosts: one process per node), on the launcher's
    rendezvous; rank 0 reports. A communicator mixing peers of this host with peers elsewhere is refused (several
    GPUs per host across hosts is not served yet), so neither is such a launch."""
    import torch.distributed as dist

    import rocenante
    from rocenante.bench import runner

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if 1 < local_world < world:
        print(f"rank {rank}: torchrun started {local_world} processes on this node and {world} in all: rocenante "
              "does not mix peers of one host with peers on other hosts in one communicator yet; launch one process "
              "per node (--nproc-per-node 1), or run every rank on one host (python -m rocenante.bench -n N)",
              file=sys.stderr, flush=True)
        return 2
    if rank == 0:
        print(f"rocenante {rocenante.__version__}: {a.collective} benchmark, {world} ranks on {a.device} under "
              "torchrun", flush=True)
    store, _, _ = next(dist.rendezvous("env://"))
    published = {}
    runner.worker(store, rank, world, cfg, published.update, local_rank)
    return _report(a, cfg, published, world, load_before) if rank == 0 else 0


def _report(a, cfg: dict, out: dict, world: int, load_before: tuple) -> int:
    """Prints rank 0's tables and writes the JSON (and PNG)."""
    from rocenante.bench import provenance, report, runner

    prov = provenance.collect(a.device, runner.method(cfg, out["method"]), load_before)
    prov["ranks"] = out["ranks"]  # each rank's host, path and devices
    result = {
        "schema": report.SCHEMA,
        "provenance": prov,
        "world_size": world,
        "config": cfg,
        "rows": out["rows"],
        "skipped": out["skipped"],
    }
    print()
    print(report.format_tables(result))
    suffix = "" if a.collective == "all_reduce" else "-" + a.collective.replace("_", "-")
    path = a.out or os.path.join("benchmarks", "results", f"{a.device}-{world}r{suffix}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    report.write_json(result, path)
    if a.calibration:
        _write_calibration(result, a.calibration)
    print(f"wrote {path}")
    if not a.no_png:
        try:
            report.plot(result, path.removesuffix(".json") + ".png")
            print(f"wrote {path.removesuffix('.json')}.png")
        except ImportError:
            print("matplotlib is not installed: no PNG (pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
