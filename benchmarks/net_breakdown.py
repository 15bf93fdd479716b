"""Where a small call's time goes, from the per-call timeline of a timeline build (csrc/timeline.h):

    pip install --no-build-isolation --no-deps . -Ccmake.define.ROCENANTE_TIMELINE=ON
    python benchmarks/net_breakdown.py [--out benchmarks/results/h200x2-net-breakdown.json] [--bytes 1024]

Two ranks, one GPU each, two communicators side by side: the network path over the TCP software wire
(ROCENANTE_NET=tcp: kernel -> pinned host memory -> proxy thread -> loopback TCP -> the peer's proxy -> its kernel)
and the direct path (CUDA IPC over NVLink). Each call is issued alone (a barrier before it, a synchronize after),
bf16 sum. Per call, from rank r's kernel and proxy and its peer q's:
  network path
    staging    r's kernel: start -> doorbell stored (its stores into the image visible)    GPU clock
    doorbell   r's doorbell stored -> r's proxy took it and posted the deliveries           GPU -> host clock
    wire       r's proxy posted -> q's proxy saw r's delivery arrive                        host clock
    arrival    q's proxy saw it -> q's kernel saw it (and the data)                         host -> GPU clock
    (q's proxy sees the delivery by r's flag, which q's kernel polls too, so with the default flag signal
    arrival is about zero and may be negative; with ROCENANTE_IB_SIGNAL=completion the proxy stores the arrival
    word the kernel waits for, and arrival is that hop)
    finish     q's kernel: saw every peer's data -> wrote its last output chunk            GPU clock
    kernel     r's kernel: start -> end                                                    GPU clock
  direct path: arrival (start -> every peer's first chunk seen) and finish, GPU clock; and, in CUDA graphs of
    50 calls replayed back to back, per call: interval (one kernel's start to the next one's), kernel (start to
    end of CTA 0's thread 0) and gap (end to the next start), which shows how much of a call's time in a graph
    is spent outside the kernel's own work.
The GPU and host clocks are related by the fastest of 200 GPU-host round trips through mapped memory
(clock_offset_ns), measured before and after each burst of calls (a single calibration for a whole run was off
by tens of microseconds by its end: the clocks drift apart); the two cross-clock pieces are good to about half
that round trip plus the drift within a burst.
Then the first call after the proxy went idle (it sleeps between polls after 2 ms without work), against calls
issued back to back, host-timed (issue to synchronize() returning), rows arm "rocenante_net_tcp", mode
"after_idle" / "warm".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

# Event indices of csrc/timeline.h.
K_START, K_RING, K_ARRIVED, K_END, P_RING, P_DELIVERED, P_ARRIVAL = range(7)
SLOTS = 4096

METHOD = {
    "script": "benchmarks/net_breakdown.py",
    "build": "timeline build (-DROCENANTE_TIMELINE=ON): kernel events on %globaltimer, proxy events on CLOCK_REALTIME",
    "calls": "network path: bursts of calls issued one at a time (all_reduce, eager, then synchronize), the clock "
             "offset calibrated before and after each burst; direct path: gloo barrier, all_reduce, synchronize",
    "statistic": "median, p10, p90 over calls of each piece (rank 0's and rank 1's calls pooled)",
}


def _stats(values):
    from rocenante.bench.runner import percentile

    values = sorted(values)
    return {"median_us": statistics.median(values), "p10_us": percentile(values, 0.1),
            "p90_us": percentile(values, 0.9), "measurements": len(values)}


def worker(store, rank, world, cfg):
    import rocenante
    from rocenante import _C

    if not _C.timeline_build:
        raise RuntimeError("not a timeline build: pip install . -Ccmake.define.ROCENANTE_TIMELINE=ON")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("gloo", store=dist.PrefixStore("ctl", store), rank=rank, world_size=world)
    comms = {"rocenante_net_tcp": rocenante.Communicator(store, rank, world, device=dev, name="net", net="tcp"),
             "rocenante": rocenante.Communicator(store, rank, world, device=dev, name="direct")}
    numel = cfg["bytes"] // 2
    x = torch.randn(numel, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    epochs, offsets = {}, {}
    for arm, comm in comms.items():
        for _ in range(20):  # warm-up
            comm.all_reduce(x, out=y)
        comm.synchronize()
        first = None
        burst = cfg["burst"] if arm == "rocenante_net_tcp" else 1
        for i in range(cfg["calls"] // burst):
            dist.barrier()
            before = comm._c.clock_offset_ns() if burst > 1 else 0
            called = []
            for _ in range(burst):  # back to back: the proxy keeps polling (it naps after 2 ms without work)
                called.append(comm._c.all_reduce(x.data_ptr(), y.data_ptr(), numel, _C.DType.bfloat16,
                                                 _C.ReduceOp.sum, comm.current_stream()))
                comm.synchronize()
            after = comm._c.clock_offset_ns() if burst > 1 else 0
            if burst > 1:
                offsets.update({e: (before + after) // 2 for e in called})
            first = called[0] if first is None else first
        epochs[arm] = (first, called[-1])
    # The direct path in CUDA graphs: consecutive calls' kernel events.
    comm = comms["rocenante"]
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(3):
            comm.all_reduce(x, out=y)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(cfg["graph_calls"]):
            comm.all_reduce(x, out=y)
    torch.cuda.synchronize()
    graph_epochs = []
    for _ in range(cfg["replays"]):
        dist.barrier()
        before = comm._c.timeline()  # the epoch counter lives on the device: find this replay's calls by time
        graph.replay()
        torch.cuda.synchronize()
        after = comm._c.timeline()
        graph_epochs.append(sorted(i for i in range(SLOTS) if after[i][K_START] != before[i][K_START]))
    del graph
    # The first call after the proxy went idle, against back-to-back calls (host-timed).
    comm = comms["rocenante_net_tcp"]
    timed = {"after_idle": [], "warm": []}
    for i in range(cfg["idle_calls"]):
        for mode in ("after_idle", "warm"):
            if mode == "after_idle":
                time.sleep(0.02)  # 10x the proxy's spin: it naps between polls by now
            dist.barrier()
            start = time.perf_counter()
            comm.all_reduce(x, out=y)
            comm.synchronize()
            timed[mode].append((time.perf_counter() - start) * 1e6)
    out = {"timelines": {arm: c._c.timeline() for arm, c in comms.items()},
           "offset_ns": offsets, "epochs": epochs, "timed": timed, "graph_slots": graph_epochs}
    dist.barrier()
    for c in comms.values():
        c.close()
    dist.destroy_process_group()
    return out


def breakdown(results, cfg):
    rows = []
    net, direct = "rocenante_net_tcp", "rocenante"
    pieces = {k: [] for k in ("staging", "doorbell", "wire", "arrival", "finish", "kernel")}
    first, last = results[0]["epochs"][net]
    for r in (0, 1):
        q = 1 - r
        t_r, t_q = results[r]["timelines"][net], results[q]["timelines"][net]
        for e in range(first, last + 1):
            off_r, off_q = results[r]["offset_ns"][e], results[q]["offset_ns"][e]
            a, b = t_r[e % SLOTS], t_q[e % SLOTS]
            if not all((a[K_START], a[K_RING], a[K_END], a[P_RING], b[P_ARRIVAL], b[K_ARRIVED], b[K_END])):
                continue
            pieces["staging"].append((a[K_RING] - a[K_START]) / 1e3)
            pieces["doorbell"].append((a[P_RING] - (a[K_RING] - off_r)) / 1e3)
            pieces["wire"].append((b[P_ARRIVAL] - a[P_RING]) / 1e3)
            pieces["arrival"].append(((b[K_ARRIVED] - off_q) - b[P_ARRIVAL]) / 1e3)
            pieces["finish"].append((b[K_END] - b[K_ARRIVED]) / 1e3)
            pieces["kernel"].append((a[K_END] - a[K_START]) / 1e3)
    for name, values in pieces.items():
        rows.append({"arm": net, "mode": f"piece:{name}", "dtype": "bfloat16", "bytes": cfg["bytes"], **_stats(values)})
    d_pieces = {"arrival": [], "finish": [], "kernel": []}
    first, last = results[0]["epochs"][direct]
    for r in (0, 1):
        t = results[r]["timelines"][direct]
        for e in range(first, last + 1):
            a = t[e % SLOTS]
            if not all((a[K_START], a[K_ARRIVED], a[K_END])):
                continue
            d_pieces["arrival"].append((a[K_ARRIVED] - a[K_START]) / 1e3)
            d_pieces["finish"].append((a[K_END] - a[K_ARRIVED]) / 1e3)
            d_pieces["kernel"].append((a[K_END] - a[K_START]) / 1e3)
    for name, values in d_pieces.items():
        rows.append({"arm": direct, "mode": f"piece:{name}", "dtype": "bfloat16", "bytes": cfg["bytes"], **_stats(values)})
    graph = {"interval": [], "kernel": [], "gap": []}
    t = results[0]["timelines"][direct]
    for slots in results[0]["graph_slots"]:
        events = sorted((t[i][K_START], t[i][K_END]) for i in slots)
        for (s0, e0), (s1, _) in zip(events, events[1:]):
            graph["interval"].append((s1 - s0) / 1e3)
            graph["kernel"].append((e0 - s0) / 1e3)
            graph["gap"].append((s1 - e0) / 1e3)
    for name, values in graph.items():
        if values:
            rows.append({"arm": direct, "mode": f"graph:{name}", "dtype": "bfloat16", "bytes": cfg["bytes"],
                         **_stats(values)})
    for mode in ("after_idle", "warm"):
        values = [max(a, b) for a, b in zip(results[0]["timed"][mode], results[1]["timed"][mode])]
        rows.append({"arm": net, "mode": mode, "dtype": "bfloat16", "bytes": cfg["bytes"], **_stats(values)})
    return rows


def main(argv=None) -> int:
    from rocenante.bench import provenance, report
    from rocenante.bench.runner import run_spawned

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/net-breakdown.json")
    p.add_argument("--bytes", type=int, default=1024)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--idle-calls", type=int, default=50)
    p.add_argument("--burst", type=int, default=100, help="network path: calls between clock calibrations")
    p.add_argument("--graph-calls", type=int, default=50)
    p.add_argument("--replays", type=int, default=20)
    a = p.parse_args(argv)
    if torch.cuda.device_count() < 2:
        p.error("needs 2 GPUs")
    cfg = {"bytes": a.bytes, "calls": a.calls, "idle_calls": a.idle_calls, "burst": a.burst, "graph_calls": a.graph_calls,
           "replays": a.replays}
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    load_before = os.getloadavg()
    results = run_spawned(worker, 2, cfg, timeout=1200)
    failed = {r: v["error"] for r, v in results.items() if "error" in v}
    if failed:
        for r, err in sorted(failed.items()):
            print(f"rank {r} failed:\n{err}", file=sys.stderr)
        return 1
    rows = breakdown(results, cfg)
    offsets = [list(results[r]["offset_ns"].values()) for r in (0, 1)]
    method = {**METHOD, "clock_offset_ns_first_last": [[o[0], o[-1]] for o in offsets]}
    result = {"schema": report.SCHEMA, "provenance": provenance.collect("cuda", method, load_before),
              "world_size": 2, "config": cfg, "rows": rows}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    report.write_json(result, a.out)
    for row in rows:
        print(f"{row['arm']:>18} {row['mode']:>16}: median {row['median_us']:8.2f} us  "
              f"(p10 {row['p10_us']:.2f}, p90 {row['p90_us']:.2f}, n {row['measurements']})")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
