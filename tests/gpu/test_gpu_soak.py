"""Endurance, 2 ranks on this machine's GPUs, with figures printed: a million graph-replayed calls of random
size, dtype and op, each checked on the device; back-to-back replays with one rank held back on the GPU;
create/destroy cycles that must leave no fd, segment, mapping or device memory behind. Where the ranks share a GPU
(a call then takes milliseconds) the first two run a subset of their replays, still through every branch. Each
test prints its figures (stderr, in the log of benchmarks/gpu_machine.sh) and records them
($ROCENANTE_TEST_FIGURES; names suffixed _shared_gpu on a shared GPU)."""

from __future__ import annotations

import math
import random
import sys
import time

import torch

import gpus
from rocenante import _env
from multiproc import all_arrived, expect_ok, record_figure, run_ranks
from probes import figures, gpu_probe, leaks, summary
from reference import DTYPES, check_against_float64, ops_for, poison, sequential_fp32

WORLD = 2


def _comm(store, rank, world, capacity_bytes, name="default"):
    import rocenante

    return rocenante.Communicator(store, rank, world, device=gpus.use(rank), capacity_bytes=capacity_bytes,
                                  timeout_s=60, name=name)


def _rank_order_into(out: torch.Tensor, inputs: torch.Tensor, op: str) -> None:
    """out = reference.sequential_fp32(list(inputs), op) (rank order, fp32 accumulation, one rounding), computed
    where the inputs are, with torch operations only, so that it can be captured in a CUDA graph."""
    if op in ("max", "min"):
        combine = torch.maximum if op == "max" else torch.minimum  # exact in any dtype: it picks an input
        acc = inputs[0]
        for x in inputs[1:]:
            acc = combine(acc, x)
    else:
        acc = inputs[0].to(torch.int32 if inputs.dtype == torch.int32 else torch.float32)
        for x in inputs[1:]:
            acc = acc + x  # int32 wraps; float32 + a 16-bit input is computed in float32
        if op == "avg":
            acc = acc / len(inputs)
    out.copy_(acc)  # the one rounding to the output dtype (round to nearest even)


class CheckedCalls:
    """A fixed list of all-reduce calls whose inputs are drawn afresh at every run(), on the device, by the
    default generator, which every rank seeds alike and advances alike. Every rank draws every rank's inputs, so
    it computes the exact result of each call itself and counts the output elements that differ: run() never
    reads anything back to the host, so a CUDA graph of it checks every call of every replay, and since the
    inputs are new each time, a stale, partial or poisoned output is counted. A checksum of every output (the sum
    of its bits as integers, in wrapping int64, so any summation order gives the same value) lets the ranks
    compare their outputs bit for bit, beyond what the value check sees (the sign of a zero, NaN payloads).

    Inputs and outputs of one dtype share one buffer, the calls of one op side by side, so that the expected
    results take a few operations per dtype and op. Most calls start on a 16-byte boundary; every fourth starts
    one element past one (the kernel's element-wise path). `sleeps[i]` GPU clock cycles are spun
    (torch.cuda._sleep) before call i."""

    def __init__(self, comm, calls, device, sleeps=None):
        self.comm, self.calls, self.world = comm, calls, comm.world_size
        self.sleeps = sleeps or [0] * len(calls)
        self.windows = [None] * len(calls)
        self.buffers = {}
        for dtype in DTYPES:
            align = 16 // dtype.itemsize
            groups, cursor = [], 0
            for op in ops_for(dtype):
                start = cursor
                for i, (numel, d, o) in enumerate(calls):
                    if (d, o) == (dtype, op):
                        begin = -(-cursor // align) * align + (1 if i % 4 == 3 else 0)
                        self.windows[i] = (begin, begin + numel)
                        cursor = begin + numel
                if cursor > start:
                    groups.append((op, start, cursor))
            if cursor == 0:
                continue
            valid = torch.zeros(cursor, dtype=torch.bool)
            for i, (_, d, _) in enumerate(calls):
                if d == dtype:
                    valid[self.windows[i][0] : self.windows[i][1]] = True
            row = -(-cursor // align) * align  # every rank's row of inputs starts on a 16-byte boundary too
            self.buffers[dtype] = {
                "groups": groups,
                "inputs": torch.empty((self.world, row), dtype=dtype, device=device),
                "out": torch.empty(cursor, dtype=dtype, device=device),
                "want": torch.empty(cursor, dtype=dtype, device=device),
                "valid": valid.to(device),  # the gaps between windows are no call's output
            }
        self.mismatches = torch.zeros((), dtype=torch.int64, device=device)
        self.checksum = torch.zeros((), dtype=torch.int64, device=device)

    def run(self) -> None:
        rank = self.comm.rank
        for dtype, b in self.buffers.items():
            if dtype == torch.int32:
                b["inputs"].random_(-1000, 1000)
            else:
                b["inputs"].normal_()
            poison(b["out"])
            for op, begin, end in b["groups"]:
                _rank_order_into(b["want"][begin:end], b["inputs"][:, begin:end], op)
        for i, (_, dtype, op) in enumerate(self.calls):
            if self.sleeps[i]:
                torch.cuda._sleep(self.sleeps[i])
            begin, end = self.windows[i]
            b = self.buffers[dtype]
            self.comm.all_reduce(b["inputs"][rank, begin:end], op=op, out=b["out"][begin:end])
        for dtype, b in self.buffers.items():
            self.mismatches.add_(((b["out"] != b["want"]) & b["valid"]).sum())
            bits = b["out"].view(torch.int16 if dtype.itemsize == 2 else torch.int32)
            self.checksum.add_(bits.sum(dtype=torch.int64))

    def check_on_host(self, i: int) -> None:
        """Call i's output of the last run against the rank-order and the float64 references (tests/reference.py)."""
        _, dtype, op = self.calls[i]
        begin, end = self.windows[i]
        b = self.buffers[dtype]
        inputs = [b["inputs"][r, begin:end] for r in range(self.world)]
        out = b["out"][begin:end]
        assert torch.equal(out, sequential_fp32(inputs, op)), f"call {i}: {end - begin} x {dtype} {op} is not exact"
        check_against_float64(out, inputs, op)

    def capture(self, device) -> torch.cuda.CUDAGraph:
        """Runs once eagerly on a side stream (warm-up; its results must be exact too), then captures run()."""
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self.run()
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        assert self.mismatches.item() == 0, f"{self.mismatches.item()} wrong elements in the eager warm-up run"
        self.mismatches.zero_()
        self.checksum.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.run()
        return graph


def _random_calls(rng: random.Random, count: int, max_bytes: int) -> list:
    """`count` calls of random dtype, op and size up to `max_bytes`: three in four log-uniform in elements (as
    many small calls as large ones), one in four uniform."""
    calls = []
    for _ in range(count):
        dtype = rng.choice(DTYPES)
        limit = max_bytes // dtype.itemsize
        if rng.random() < 0.25:
            numel = rng.randint(1, limit)
        else:
            numel = min(limit, int(2 ** rng.uniform(0, math.log2(limit + 1))))
        calls.append((numel, dtype, rng.choice(ops_for(dtype))))
    return calls


def _where() -> str:
    return "1 GPU, shared by both ranks" if gpus.shared(WORLD) else f"{WORLD} GPUs"


SOAK_GRAPHS = 8
SOAK_CALLS_PER_GRAPH = 125
SOAK_ROUNDS = 1000  # each graph replayed this often: 8 x 125 x 1000 = 1,000,000 calls
SOAK_CAPACITY = _env.DEFAULT_CAPACITY_BYTES
# Sizes reach the backend's threshold at world 2 (8 MiB when measured): above the capacity, calls go as pieces.
SOAK_MAX_BYTES = _env.threshold_bytes("cuda", WORLD)
SOAK_SAMPLE_EVERY = 100  # rounds between host checks of two calls per graph against float64


def _soak(store, rank, world, seed, rounds, sample_every):
    comm = _comm(store, rank, world, SOAK_CAPACITY)
    dev = gpus.device_of(rank)
    torch.cuda.manual_seed(seed)  # the in-graph inputs: the same draws on every rank
    rng = random.Random(seed)  # the same calls on every rank
    setup_start = time.monotonic()
    soaks = []
    for g in range(SOAK_GRAPHS):
        calls = _random_calls(rng, SOAK_CALLS_PER_GRAPH, SOAK_MAX_BYTES)
        if g == 0:  # the extremes, for every dtype: one element and the most the backend sends
            calls[: 2 * len(DTYPES)] = [(n, d, ops_for(d)[k]) for d in DTYPES for k, n in
                                        ((0, 1), (-1, SOAK_MAX_BYTES // d.itemsize))]
        checked = CheckedCalls(comm, calls, dev)
        soaks.append((checked, checked.capture(dev)))
    setup_s = time.monotonic() - setup_start
    sampled, sample_s = 0, 0.0
    start = time.monotonic()
    for r in range(rounds):
        for _, graph in soaks:
            graph.replay()
        if (r + 1) % sample_every == 0:
            sample_start = time.monotonic()
            torch.cuda.synchronize(dev)
            c = r // sample_every
            for g, (checked, _) in enumerate(soaks):
                sample = [(17 * (2 * c + j) + g) % SOAK_CALLS_PER_GRAPH for j in range(2)]
                if c == 0 and g == 0:
                    sample += range(2 * len(DTYPES))  # the extremes
                for i in sample:
                    checked.check_on_host(i)
                sampled += len(sample)
            sample_s += time.monotonic() - sample_start
    torch.cuda.synchronize(dev)
    comm.synchronize()
    elapsed = time.monotonic() - start
    calls = SOAK_GRAPHS * SOAK_CALLS_PER_GRAPH * rounds
    mean_bytes = sum(n * d.itemsize for c, _ in soaks for n, d, _ in c.calls) / (SOAK_GRAPHS * SOAK_CALLS_PER_GRAPH)
    result = {
        "calls": calls,
        "mismatches": [c.mismatches.item() for c, _ in soaks],
        "checksums": [c.checksum.item() for c, _ in soaks],
        "seconds": elapsed,
        "setup_s": setup_s,
        "sampled": sampled,
        "sample_s": sample_s,
        "mean_bytes": mean_bytes,
    }
    soaks.clear()  # graphs go before the communicator whose calls they captured
    comm.close()
    return result


def test_soak_of_graph_replayed_calls_exact_and_identical_on_both_ranks():
    rounds = gpus.calls(SOAK_ROUNDS, WORLD, on_shared=2, least=2)  # the host samples at least twice
    sample_every = SOAK_SAMPLE_EVERY if rounds == SOAK_ROUNDS else 1
    start = time.monotonic()
    results = expect_ok(run_ranks(WORLD, _soak, 2024, rounds, sample_every, timeout=300))
    wall = time.monotonic() - start
    for rank, res in enumerate(results):
        assert res["mismatches"] == [0] * SOAK_GRAPHS, f"rank {rank}: wrong elements per graph {res['mismatches']}"
    assert results[0]["checksums"] == results[1]["checksums"], "the ranks' outputs differ"
    calls = results[0]["calls"]
    seconds = max(res["seconds"] for res in results)
    sample_s = max(res["sample_s"] for res in results)
    record_figure(gpus.figure("gpu_soak_calls", WORLD), calls)
    record_figure(gpus.figure("gpu_soak_s", WORLD), seconds)
    record_figure(gpus.figure("gpu_soak_us_per_call", WORLD), seconds / calls * 1e6)
    record_figure(gpus.figure("gpu_soak_test_wall_s", WORLD), wall)
    print(f"gpu soak: {calls} all-reduce calls ({SOAK_GRAPHS} CUDA graphs x {SOAK_CALLS_PER_GRAPH} calls x "
          f"{rounds} replays; random dtype and op, 1 element..{SOAK_MAX_BYTES >> 20} MiB with a "
          f"{SOAK_CAPACITY >> 20} MiB capacity, mean "
          f"{results[0]['mean_bytes'] / 1024:.0f} KiB) on {_where()} in {seconds:.1f} s, "
          f"{seconds / calls * 1e6:.2f} us "
          f"per call with the on-device checks and {sample_s:.1f} s of host samples; setup (build, warm-up, "
          f"capture) {max(r['setup_s'] for r in results):.1f} s; whole test {wall:.1f} s. Every output element "
          f"checked on the device against the rank-order result: 0 wrong; outputs identical on both ranks "
          f"(checksums {results[0]['checksums'][:2]}...); {results[0]['sampled']} calls per rank checked on the "
          "host against float64", file=sys.stderr)


SKEW_CALLS = 16
SKEW_REPLAYS = 10000
SKEW_CAPACITY = 1 << 20
SKEW_HOLD_EVERY = 250  # replays between two ~1 ms holds of one rank (alternating) before a replay
CYCLES_PER_US = 2000  # torch.cuda._sleep spins GPU clock cycles; H200 SMs run at about 2 GHz


def _skewed_replays(store, rank, world, seed, replays, hold_every):
    """Each rank replays one graph back to back, with no synchronisation at all between replays. Before some
    calls one rank (a different one per call) spins 1-20 us on the GPU, inside the graph, and every 250 replays
    one rank spins 1 ms before the replay: the other rank finishes its call and starts the next, pushing into
    the held rank's region before that rank has started it. Every call of every replay is checked on the device."""
    comm = _comm(store, rank, world, SKEW_CAPACITY)
    dev = gpus.device_of(rank)
    torch.cuda.manual_seed(seed)
    rng = random.Random(seed)
    calls, sleeps, held = [], [], 0
    for k in range(SKEW_CALLS):
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.int32])
        limit = SKEW_CAPACITY // dtype.itemsize
        numel = rng.randint(1, 256) if k % 2 else rng.randint(limit // 2, limit)  # one CTA, then many
        calls.append((numel, dtype, rng.choice(ops_for(dtype))))
        late = rng.randrange(world + 1)  # the rank that starts this call late; world: none
        cycles = rng.randint(1 * CYCLES_PER_US, 20 * CYCLES_PER_US)
        sleeps.append(cycles if late == rank else 0)
        held += late < world
    checked = CheckedCalls(comm, calls, dev, sleeps)
    graph = checked.capture(dev)
    start = time.monotonic()
    for i in range(replays):
        if i % hold_every == 0 and (i // hold_every) % world == rank:
            torch.cuda._sleep(1000 * CYCLES_PER_US)
        graph.replay()
    torch.cuda.synchronize(dev)
    comm.synchronize()
    elapsed = time.monotonic() - start
    result = (checked.mismatches.item(), checked.checksum.item(), elapsed, held)
    del graph  # before the communicator whose calls it captured
    comm.close()
    return result


def test_back_to_back_replays_with_one_rank_held_back_are_exact():
    replays = gpus.calls(SKEW_REPLAYS, WORLD, on_shared=40, least=40)
    hold_every = SKEW_HOLD_EVERY if replays == SKEW_REPLAYS else 10  # each rank held twice
    results = expect_ok(run_ranks(WORLD, _skewed_replays, 77, replays, hold_every, timeout=300))
    for rank, (mismatches, _, _, _) in enumerate(results):
        assert mismatches == 0, f"rank {rank}: {mismatches} wrong elements"
    assert results[0][1] == results[1][1], "the ranks' outputs differ"
    calls = SKEW_CALLS * replays
    seconds = max(r[2] for r in results)
    held = results[0][3]
    record_figure(gpus.figure("gpu_skewed_replay_calls", WORLD), calls)
    record_figure(gpus.figure("gpu_skewed_replay_s", WORLD), seconds)
    print(f"skewed replays: {replays} back-to-back replays of {SKEW_CALLS} calls ({calls} calls; {held} of "
          f"the {SKEW_CALLS} calls start 1-20 us late on one rank, and one rank is held 1 ms every "
          f"{hold_every} replays) on {_where()} in {seconds:.2f} s; every output element checked on the device: 0 wrong; "
          "outputs identical on both ranks (checksum)", file=sys.stderr)


GPU_CYCLES = 100
GPU_WARMUP_CYCLES = 5  # the first builds load libraries, open the driver's devices and enable peer access


def _gpu_cycles(store, rank, world, cycles):
    dev = gpus.use(rank)
    x = torch.ones(4096, device=dev)
    y = torch.empty_like(x)

    def cycle():
        with _comm(store, rank, world, 4 << 20, name="cycles") as comm:
            comm.all_reduce(x, out=poison(y))
            comm.synchronize()
            assert torch.equal(y, torch.full_like(y, float(world)))

    for _ in range(GPU_WARMUP_CYCLES):
        cycle()
    all_arrived(store, world, "probe before")  # no communicator of either rank is alive while probing
    before = gpu_probe(dev)
    start = time.monotonic()
    for _ in range(cycles):
        cycle()
    seconds = (time.monotonic() - start) / cycles
    all_arrived(store, world, "probe after")
    return before, gpu_probe(dev), seconds


def test_gpu_communicator_create_destroy_cycles_leak_nothing():
    results = expect_ok(run_ranks(WORLD, _gpu_cycles, GPU_CYCLES, timeout=300))
    lines, found = [], []
    for rank, (before, after, seconds) in enumerate(results):
        for when, probe in (("before", before), ("after", after)):
            for k, v in figures(probe).items():
                record_figure(gpus.figure(f"gpu_communicator_cycles_{GPU_CYCLES}_rank{rank}_{k}_{when}", WORLD), v)
        record_figure(gpus.figure(f"gpu_communicator_cycle_s_rank{rank}", WORLD), seconds)
        lines.append(f"rank {rank}, {GPU_CYCLES} cycles ({seconds * 1e3:.0f} ms each): {summary(before, after)}")
        found += [f"rank {rank}: {leak}" for leak in leaks(before, after)]
    print("gpu cycles: " + "; ".join(lines), file=sys.stderr)
    assert not found, f"{GPU_CYCLES} GPU communicator create/destroy cycles leaked: " + "; ".join(found)
