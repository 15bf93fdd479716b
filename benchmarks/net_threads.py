"""Small calls over the network path with one GPU: two ranks as threads of one process, each on its own stream,
over the TCP software wire (ROCENANTE_NET=tcp: kernel -> pinned host memory -> proxy thread -> loopback TCP ->
the peer's placement of the data and then its flag -> the peer's kernel).

    python benchmarks/net_threads.py [--out benchmarks/results/h200-net-threads.json] [--bytes 1024 65536]

Arms, all interleaved round by round:
  rocenante_net_tcp_flag        the defaults: the reducer polls the flag written after the data; the proxy polls
                                hot for ROCENANTE_PROXY_SPIN_S (5 s) after its last work
  rocenante_net_tcp_completion  ROCENANTE_IB_SIGNAL=completion: the receiving proxy turns the delivery's
                                completion into the arrival word the reducer waits for (one more host hop)
  rocenante_net_tcp_napping     the flag signal with ROCENANTE_PROXY_SPIN_S=0: the proxy naps 50 us between
                                polls whenever it has no work
Modes (bf16 sum, the slower rank of each measurement):
  eager       issue -> synchronize() returning, one call at a time, both ranks released together
  graph       one replay of a CUDA graph of --graph-calls calls, divided by that count
  after_idle  as eager, for the first call after both ranks slept 100 ms
  after_idle_gpu_busy  the same while another stream keeps one multiprocessor busy through the 100 ms: what
              after_idle pays beyond it comes from the GPU's idle state, not from the proxy or the wire
What this can and cannot show: both ranks' kernels co-reside on one GPU (up to about 1 MiB at world 2), so a call
is never serialized behind the peer's kernel; the two rank threads share Python's GIL, which adds to the eager
figures; the TCP wire is a test vehicle whose copies and placement are not a NIC's. The figures compare the
signals and the proxy's idling on one machine; they are not the product's latency over RoCE.
--device cpu runs the same arms with CPU tensors (host loop, no graph mode): a dry run of the script.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

WORLD = 2
ARMS = {
    "rocenante_net_tcp_flag": {},
    "rocenante_net_tcp_completion": {"ROCENANTE_IB_SIGNAL": "completion"},
    "rocenante_net_tcp_napping": {"ROCENANTE_PROXY_SPIN_S": "0"},
}
IDLE_S = 0.1

METHOD = {
    "script": "benchmarks/net_threads.py",
    "ranks": "2 ranks as threads of one process sharing one GPU, each on its own stream; kernels co-reside "
             "(both ranks' CTAs fit at these sizes); the rank threads share the GIL",
    "wire": "ROCENANTE_NET=tcp (loopback TCP test wire), for every arm",
    "calls": "eager: barrier, all_reduce, synchronize, host-timed per call; graph: barrier, one replay of a graph "
             "of graph_calls calls, synchronize, divided by graph_calls; after_idle: both ranks sleep 100 ms, "
             "barrier, one eager call; after_idle_gpu_busy: the same with a torch.cuda._sleep of 110 ms on a third "
             "stream, enqueued just before the idle time",
    "order": "arms round-robin, shifted by one every round (rocenante.bench.runner.round_order)",
    "statistic": "the slower rank per measurement, then median, p10, p90 over measurements",
}


def on_ranks(fn, streams, barrier=None):
    """fn(rank) on one thread per rank, each with its stream current (streams None: CPU); returns the results,
    raising the first error with its rank. A rank that fails breaks `barrier`, so that the other stops waiting."""
    results, errors = [None] * WORLD, []

    def run(rank):
        try:
            if streams is None:
                results[rank] = fn(rank)
                return
            torch.cuda.set_device(streams[rank].device)
            with torch.cuda.stream(streams[rank]):
                results[rank] = fn(rank)
        except BaseException as err:  # noqa: B036 - raised below with the rank
            errors.append((rank, err))
            if barrier is not None:
                barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if any(t.is_alive() for t in threads):
        raise RuntimeError("a rank thread hung")
    if errors:
        rank, err = errors[0]
        raise RuntimeError(f"rank {rank}: {type(err).__name__}: {err}") from err
    return results


def build(device, streams):
    """A pair of communicators per arm, each arm's settings in the environment while its pair is built."""
    import rocenante

    store = dist.HashStore()
    comms = {}
    for arm, env in ARMS.items():
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            comms[arm] = on_ranks(lambda rank, arm=arm: rocenante.Communicator(
                store, rank, WORLD, device=device, name=arm, net="tcp"), streams)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
    return comms


def bf16_inputs(nbytes, device):
    """Every rank's bf16 input of `nbytes` (seeded by the size), and their rank-order fp32 sum in bf16."""
    g = torch.Generator().manual_seed(nbytes)
    xs = [torch.randn(nbytes // 2, generator=g).to(torch.bfloat16).to(device) for _ in range(WORLD)]
    return xs, (xs[0].float() + xs[1].float()).to(torch.bfloat16)


def check(outs, want, what):
    for rank, y in enumerate(outs):
        if not torch.equal(y, want):
            raise AssertionError(f"{what}: rank {rank}'s result differs from the rank-order fp32 sum")


def main(argv=None) -> int:
    from rocenante.bench import provenance, report
    from rocenante.bench.runner import round_order, sleep_cycles_per_us, summarize

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/net-threads.json")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--bytes", type=int, nargs="+", default=[1024, 65536])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--eager-calls", type=int, default=30, help="timed eager calls per arm, size and round")
    p.add_argument("--replays", type=int, default=5, help="timed graph replays per arm, size and round")
    p.add_argument("--graph-calls", type=int, default=50)
    p.add_argument("--idle-calls", type=int, default=30, help="calls after 100 ms idle per arm and size")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    load_before = os.getloadavg()
    streams = [torch.cuda.Stream(device) for _ in range(WORLD)] if cuda else None
    comms = build(device, streams)
    arms = list(ARMS)
    inputs, wants, outs = {}, {}, {}
    for nbytes in a.bytes:
        inputs[nbytes], wants[nbytes] = bf16_inputs(nbytes, device)
        for arm in arms:
            outs[arm, nbytes] = [torch.full_like(x, float("nan")) for x in inputs[nbytes]]

    def warm(rank):
        for arm in arms:
            for nbytes in a.bytes:
                for _ in range(20):
                    comms[arm][rank].all_reduce(inputs[nbytes][rank], out=outs[arm, nbytes][rank])
                comms[arm][rank].synchronize()

    on_ranks(warm, streams)
    for key, pair in outs.items():
        check(pair, wants[key[1]], f"{key[0]}, {key[1]} B, eager")
    graphs = {}
    if cuda:  # captured one rank at a time from this thread: capture only records, nothing runs
        for arm in arms:
            for nbytes in a.bytes:
                for rank in range(WORLD):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, stream=streams[rank], capture_error_mode="thread_local"):
                        for _ in range(a.graph_calls):
                            comms[arm][rank].all_reduce(inputs[nbytes][rank], out=outs[arm, nbytes][rank])
                    graphs[arm, nbytes, rank] = graph
    barrier = threading.Barrier(WORLD)  # on_ranks breaks it if a rank fails
    # after_idle_gpu_busy: a third stream keeps one multiprocessor spinning through the idle time, so the GPU
    # never idles: what after_idle pays beyond it is the GPU's own idle state, not the proxy's or the wire's.
    idle_modes = ["after_idle"] + (["after_idle_gpu_busy"] if cuda else [])
    keeper = torch.cuda.Stream(device) if cuda else None
    cycles_per_us = sleep_cycles_per_us() if cuda else 0.0

    def measure(rank):
        times = {}
        for rnd in range(a.rounds):
            for arm in round_order(arms, rnd):
                comm = comms[arm][rank]
                for nbytes in a.bytes:
                    x, y = inputs[nbytes][rank], outs[arm, nbytes][rank]
                    eager = times.setdefault((arm, "eager", nbytes), [])
                    for _ in range(a.eager_calls):
                        barrier.wait()
                        start = time.perf_counter()
                        comm.all_reduce(x, out=y)
                        comm.synchronize()
                        eager.append((time.perf_counter() - start) * 1e6)
                    if not cuda:
                        continue
                    graph = graphs[arm, nbytes, rank]
                    replayed = times.setdefault((arm, "graph", nbytes), [])
                    y.fill_(float("nan"))
                    for _ in range(a.replays):
                        barrier.wait()
                        start = time.perf_counter()
                        graph.replay()
                        comm.synchronize()
                        replayed.append((time.perf_counter() - start) * 1e6 / a.graph_calls)
                    if not torch.equal(y, wants[nbytes]):
                        raise AssertionError(f"{arm}, {nbytes} B: rank {rank}'s graph replays gave other than the "
                                             "rank-order fp32 sum")
        for i in range(a.idle_calls):
            for arm in round_order(arms, i):
                for nbytes, mode in [(n, m) for n in a.bytes for m in idle_modes]:
                    if mode == "after_idle_gpu_busy" and rank == 0:
                        with torch.cuda.stream(keeper):
                            torch.cuda._sleep(int(IDLE_S * 1.1e6 * cycles_per_us))
                    time.sleep(IDLE_S)  # 20 x a napping proxy's 5 ms of polls; well within the default hot spin
                    barrier.wait()
                    start = time.perf_counter()
                    comms[arm][rank].all_reduce(inputs[nbytes][rank], out=outs[arm, nbytes][rank])
                    comms[arm][rank].synchronize()
                    times.setdefault((arm, mode, nbytes), []).append((time.perf_counter() - start) * 1e6)
        if cuda:
            keeper.synchronize()
        return times

    per_rank = on_ranks(measure, streams, barrier)
    for key, pair in outs.items():
        check(pair, wants[key[1]], f"{key[0]}, {key[1]} B, after the timed calls")
    rows = [{"arm": arm, "mode": mode, "dtype": "bfloat16", "bytes": nbytes,
             **summarize([per_rank[r][arm, mode, nbytes] for r in range(WORLD)])}
            for (arm, mode, nbytes) in per_rank[0]]
    on_ranks(lambda rank: [comms[arm][rank].close() for arm in arms], streams)
    method = {**METHOD, "config": vars(a), "idle_s": IDLE_S}
    info = provenance.collect(device.type, method, load_before)
    info["command"] = " ".join([os.path.basename(sys.executable), "benchmarks/net_threads.py"] + sys.argv[1:])
    result = {"schema": report.SCHEMA, "provenance": info, "world_size": WORLD, "rows": rows}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    report.write_json(result, a.out)
    for row in sorted(rows, key=lambda r: (r["mode"], r["bytes"], r["arm"])):
        print(f"{row['mode']:>10} {row['bytes']:>7} B {row['arm']:>28}: median {row['median_us']:9.2f} us  "
              f"(p10 {row['p10_us']:.2f}, p90 {row['p90_us']:.2f}, n {row['measurements']})")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
