"""Where a small call's time goes on the network path, from the per-call timeline of a timeline build
(csrc/timeline.h), over the TCP software wire (ROCENANTE_NET=tcp), two ranks as threads of one process, each on
its own stream (sharing one GPU: their kernels co-reside at these sizes), or both on the CPU (the host loop):

    benchmarks/gpu_machine.sh OUTDIR breakdown [EARLIER_TREE [LABEL]]   builds this tree (and an earlier one),
                                                                        alternates them, merges the parts
    python benchmarks/net_breakdown.py --label L --part PART.json [--device cuda:0|cpu]   one build, one process
    python benchmarks/net_breakdown.py --merge --out OUT.json PART.json ...               the rows of every part

Each call is issued alone and waited for (all_reduce, then synchronize), bf16 sum. Pieces of a call from rank r
to its peer q, each between two timestamps of the timeline:
  staging   r's reducer began (kernel: CTA 0 started) -> r stored its doorbell (its data in pinned memory)
  doorbell  r's doorbell stored -> r's proxy posted the call's last send                     (reducer -> host clock)
            = take (doorbell stored -> r's proxy saw it) + post (saw it -> posted: the wire's part), for builds
            that record when the proxy saw it (later than e65b666)
  wire      posted -> q's proxy saw r's delivery whole: with the flag signal, its polling saw the flag (the
            reducer polls the same flag, so this is when the flag was visible, as near as a hot poll sees it);
            with the completion signal or before the flag signal, it stored the arrival word   (host clock)
  arrival   q's proxy saw it -> q's reducer had every peer's call (kernel: every peer's first chunk)
            (host -> reducer clock; with the flag signal about zero, and negative where the reducer saw the flag
            before the proxy's poll did)
  finish    q's reducer had every peer's call -> it wrote its last output                 (reducer clock)
  sum       staging + doorbell + arrival + finish: what the path adds beyond the wire
and host-timed, the slower rank's issue -> synchronize() returning (piece "timed").
Modes: warm (bursts of calls back to back), after_idle (the first call after both ranks slept 100 ms).
A kernel's events are on the GPU's %globaltimer, the proxy's and the host loop's on CLOCK_REALTIME; the two are
related by the fastest of 200 GPU-host round trips through mapped memory (clock_offset_ns), measured before and
after each burst and after each idle call (the clocks drift apart by tens of microseconds over a run), so a
cross-clock piece is good to about half that round trip plus the drift within a burst.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist
from net_threads import WORLD, bf16_inputs, check, on_ranks

# Event indices of csrc/timeline.h.
K_START, K_RING, K_ARRIVED, K_END, P_RING, P_DELIVERED, P_ARRIVAL, P_TOOK = range(8)
SLOTS = 4096
IDLE_S = 0.1
PIECES = ("staging", "doorbell", "take", "post", "wire", "arrival", "finish", "sum", "timed")

METHOD = {
    "script": "benchmarks/net_breakdown.py",
    "build": "timeline builds (-DROCENANTE_TIMELINE=ON): kernel events on %globaltimer, proxy and host-loop "
             "events on CLOCK_REALTIME",
    "ranks": "2 ranks as threads of one process over the TCP wire, each on its own stream; GPU arms share one GPU "
             "(their kernels co-reside); cpu arms run the host loop",
    "calls": "warm: bursts of calls issued one at a time (all_reduce, then synchronize), the clock offset "
             "calibrated before and after each burst; after_idle: both ranks sleep 100 ms, then one call, the "
             "offset calibrated after it",
    "order": "earlier and later builds in alternate processes (gpu_machine.sh breakdown)",
    "statistic": "pieces: median, p10, p90 over calls, both directions pooled; timed: the slower rank per call",
}


def _stats(values):
    from rocenante.bench.runner import percentile

    return {"median_us": statistics.median(values), "p10_us": percentile(values, 0.1),
            "p90_us": percentile(values, 0.9), "measurements": len(values)}


def _rank(rank, comm, xs, ys, cfg, barrier):
    """One rank's calls; per size, its records {(mode, call): (clock offset ns, host-timed us)} and its
    timeline after them."""
    from rocenante import _C

    snapshots = []
    for nbytes in cfg["bytes"]:
        x, y = xs[nbytes][rank], ys[nbytes][rank]

        def call():
            start = time.perf_counter()
            epoch = comm._c.all_reduce(x.data_ptr(), y.data_ptr(), x.numel(), _C.DType.bfloat16, _C.ReduceOp.sum,
                                       comm.current_stream())
            comm.synchronize()
            return epoch, (time.perf_counter() - start) * 1e6

        for _ in range(20):  # warm-up
            call()
        records = {}
        for _ in range(cfg["bursts"]):
            # A calibration frees host memory, which waits for the whole device to idle: no rank may start its
            # burst (a kernel that waits for the peer) before the peer's calibration is over, or both wait out
            # the timeout (2026-12-03 on one H200: both builds timed out at the first call after the warm-up).
            barrier.wait()
            before = comm._c.clock_offset_ns()
            barrier.wait()
            burst = [call() for _ in range(cfg["burst"])]
            after = comm._c.clock_offset_ns()
            records.update({("warm", e): ((before + after) // 2, us) for e, us in burst})
        for _ in range(cfg["idle_calls"]):
            time.sleep(IDLE_S)
            barrier.wait()
            e, us = call()
            records["after_idle", e] = (comm._c.clock_offset_ns(), us)
        snapshots.append((nbytes, records, comm._c.timeline()))
    return snapshots


def measure(cfg, device):
    """Two ranks as threads; returns {"bytes|mode|piece": [values]}."""
    import rocenante

    store = dist.HashStore()
    streams = [torch.cuda.Stream(device) for _ in range(WORLD)] if device.type == "cuda" else None
    barrier = threading.Barrier(WORLD)
    xs, ys, wants = {}, {}, {}
    for nbytes in cfg["bytes"]:
        xs[nbytes], wants[nbytes] = bf16_inputs(nbytes, device)
        ys[nbytes] = [torch.empty_like(x) for x in xs[nbytes]]

    def run(rank):
        comm = rocenante.Communicator(store, rank, WORLD, device=device, name="breakdown", net="tcp")
        try:
            return _rank(rank, comm, xs, ys, cfg, barrier)
        finally:
            comm.close()

    results = on_ranks(run, streams, barrier)
    for nbytes in cfg["bytes"]:
        check(ys[nbytes], wants[nbytes], f"{nbytes} B")
    return pieces(results)


def pieces(results):
    """The pieces of every call both ranks recorded, r -> q for both directions."""
    out = {}
    for i, (nbytes, _, _) in enumerate(results[0]):
        recs = [results[r][i][1] for r in range(WORLD)]
        tls = [results[r][i][2] for r in range(WORLD)]
        for key in recs[0].keys() & recs[1].keys():
            mode, e = key
            into = lambda piece: out.setdefault(f"{nbytes}|{mode}|{piece}", [])  # noqa: E731
            into("timed").append(max(recs[0][key][1], recs[1][key][1]))
            for r in range(WORLD):
                q = 1 - r
                a, b = tls[r][e % SLOTS], tls[q][e % SLOTS]
                if not all((a[K_START], a[K_RING], a[P_RING], b[P_ARRIVAL], b[K_ARRIVED], b[K_END])):
                    continue
                off_r, off_q = recs[r][key][0], recs[q][key][0]
                got = {"staging": (a[K_RING] - a[K_START]) / 1e3,
                       "doorbell": (a[P_RING] - (a[K_RING] - off_r)) / 1e3,
                       "wire": (b[P_ARRIVAL] - a[P_RING]) / 1e3,
                       "arrival": ((b[K_ARRIVED] - off_q) - b[P_ARRIVAL]) / 1e3,
                       "finish": (b[K_END] - b[K_ARRIVED]) / 1e3}
                if len(a) > P_TOOK and a[P_TOOK]:  # an earlier build records no P_TOOK
                    got["take"] = (a[P_TOOK] - (a[K_RING] - off_r)) / 1e3
                    got["post"] = (a[P_RING] - a[P_TOOK]) / 1e3
                got["sum"] = got["staging"] + got["doorbell"] + got["arrival"] + got["finish"]
                for piece, value in got.items():
                    into(piece).append(value)
    return out


def merge(parts):
    """Rows of every part, pooled by arm (label and device), size, mode and piece."""
    pooled = {}
    for part in parts:
        arm = "rocenante_net_tcp" + ("_cpu" if part["device"] == "cpu" else "") + "@" + part["label"]
        for key, values in part["pieces"].items():
            pooled.setdefault((arm,) + tuple(key.split("|")), []).extend(values)
    return [{"arm": arm, "mode": f"{mode}:{piece}", "dtype": "bfloat16", "bytes": int(nbytes), **_stats(values)}
            for (arm, nbytes, mode, piece), values in sorted(pooled.items(), key=lambda kv: (
                kv[0][0], int(kv[0][1]), kv[0][2], PIECES.index(kv[0][3])))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", help="the build's name in the arm (e.g. its revision)")
    p.add_argument("--part", help="where one process's pieces go")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--bytes", type=int, nargs="+", default=[1024, 65536])
    p.add_argument("--bursts", type=int, default=10)
    p.add_argument("--burst", type=int, default=100, help="calls between clock calibrations")
    p.add_argument("--idle-calls", type=int, default=100, help="calls after 100 ms idle, per size")
    p.add_argument("--merge", nargs="+", metavar="PART", help="merge these parts into --out")
    p.add_argument("--out", default="benchmarks/results/net-breakdown.json")
    a = p.parse_args(argv)
    if a.merge:
        from rocenante.bench import provenance, report

        parts = []
        for path in a.merge:
            with open(path) as f:
                parts.append(json.load(f))
        rows = merge(parts)
        method = {**METHOD, "parts": [{k: v for k, v in part.items() if k != "pieces"} for part in parts]}
        info = provenance.collect("cuda" if any(pt["device"] != "cpu" for pt in parts) else "cpu", method,
                                  tuple(parts[0]["load_before"]))
        info["command"] = "benchmarks/gpu_machine.sh OUTDIR breakdown (benchmarks/net_breakdown.py --merge)"
        report.write_json({"schema": report.SCHEMA, "provenance": info, "world_size": WORLD, "rows": rows}, a.out)
        for row in rows:
            print(f"{row['arm']:>30} {row['bytes']:>6} B {row['mode']:>20}: median {row['median_us']:9.2f} us "
                  f"(p10 {row['p10_us']:.2f}, p90 {row['p90_us']:.2f}, n {row['measurements']})")
        print(f"wrote {a.out}")
        return 0
    if not a.label or not a.part:
        p.error("--label and --part (or --merge)")
    import rocenante
    from rocenante import _C

    if not _C.timeline_build:
        p.error("not a timeline build: pip install . -Ccmake.define.ROCENANTE_TIMELINE=ON")
    if 20 + a.bursts * a.burst + a.idle_calls > SLOTS:
        p.error(f"more calls per size than the timeline keeps ({SLOTS})")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    cfg = {"bytes": a.bytes, "bursts": a.bursts, "burst": a.burst, "idle_calls": a.idle_calls}
    load_before = os.getloadavg()
    got = measure(cfg, torch.device(a.device))
    part = {"label": a.label, "device": a.device, "rocenante": rocenante.__file__, "config": cfg,
            "load_before": load_before, "signal": os.environ.get("ROCENANTE_IB_SIGNAL", "flag"), "pieces": got}
    os.makedirs(os.path.dirname(a.part) or ".", exist_ok=True)
    with open(a.part, "w") as f:
        json.dump(part, f)
    for key in sorted(got):
        if key.split("|")[2] in ("sum", "timed", "doorbell", "take", "post", "arrival"):
            print(f"{a.label} {a.device} {key:>28}: median {statistics.median(got[key]):9.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
