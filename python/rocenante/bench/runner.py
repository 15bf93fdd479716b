"""One benchmark rank. For each (dtype, size): every arm's output is checked bitwise against the reference once,
then for each mode the arms are timed interleaved, round after round, with the arm order rotated every round,
so that drift on the machine touches every arm alike. Rank 0 publishes the rows.

Graph mode (the method of issue 11's table): per arm, one CUDA graph of `calls_per_measurement(size)` back-to-back
all-reduces. Each round, before each replay, every rank passes a barrier and queues a ~50 us GPU sleep, then the
begin event, the replay and the end event: the replay starts when the sleep ends, with its launch already queued,
so neither the host nor the launch latency is timed. Per replay the slower rank's time counts (the collective is
done only when every rank is); a row gives the median, p10 and p90 of those per replay, divided by the calls.
Eager mode: the same barrier, then the host issues the calls one by one between the two events (no sleep), so
the host's dispatch is part of the time, as it is for an eager caller. CPU: the same loop, timed by the host
clock."""

from __future__ import annotations

import gc
import os
import random
import statistics
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rocenante.bench import arms as arms_mod

DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Graph replays (eager loops) per arm, size and mode: p10 and p90 need a few; issue 11's table used 7.
MIN_ROUNDS = 7
# Longer than the host takes to queue the begin event, the graph launch and the end event (a few us), so each
# replay starts from a full launch queue; the value issue 11's table was measured with.
SLEEP_BEFORE_REPLAY_US = 50
# Cycles of the calibration sleep: about 1 ms at H200 clocks, where the events' ~0.5 us resolution is noise.
_CALIBRATION_CYCLES = 2_000_000
# Check data: integers k/8 with |k| <= 16. A sum over at most 8 ranks is K/8 with |K| <= 128, exact in bf16
# (8 significant bits), fp16 and fp32 in any order of summation, so every correct arm gives the same bits.
_CHECK_MAX_K = 16
_CHECK_MAX_WORLD = 8


def calls_per_measurement(nbytes: int) -> int:
    """All-reduces per graph replay (or eager loop): 50, 20 above 1 MiB (keeps a 64 MiB replay near 12 ms)."""
    return 50 if nbytes <= (1 << 20) else 20


def round_order(items: list, rnd: int) -> list:
    """The order of round `rnd`: round-robin, shifted by one every round, so each item goes first in turn."""
    if not items:
        return []
    k = rnd % len(items)
    return items[k:] + items[:k]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 1]."""
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(per_rank: list[list[float]]) -> dict:
    """per_rank[r][i]: rank r's time of measurement i. Takes the slower rank per measurement, then the median,
    p10 and p90 over measurements."""
    counts = {len(s) for s in per_rank}
    if len(counts) != 1:
        raise ValueError(f"ranks have different numbers of measurements: {[len(s) for s in per_rank]}")
    slower = [max(times) for times in zip(*per_rank)]
    return {"median_us": statistics.median(slower), "p10_us": percentile(slower, 0.1),
            "p90_us": percentile(slower, 0.9), "measurements": len(slower)}


def check_input(seed: int, rank: int, numel: int, dtype, device) -> torch.Tensor:
    """Rank `rank`'s input for the correctness check (any rank can build every rank's)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed * 1_000_003 + rank)
    k = torch.randint(-_CHECK_MAX_K, _CHECK_MAX_K + 1, (numel,), generator=g, device=device, dtype=torch.int32)
    return (k.to(torch.float32) / 8).to(dtype)


def block_sizes(collective: str, world: int, numel: int) -> list[list[int]]:
    """sizes[s][t]: elements rank s sends rank t in an all-to-all of `numel` elements a rank: equal blocks, or
    ("all_to_all_unequal") a block of (k + 1) parts of world (world + 1) / 2 from s to rank (s + k) % world, so
    that every rank sends and receives `numel` elements in blocks of every size, as MoE routing makes them."""
    if collective == "all_to_all":
        return [[numel // world] * world for _ in range(world)]
    total = world * (world + 1) // 2
    by_distance = [numel * (k + 1) // total for k in range(world - 1)]
    by_distance.append(numel - sum(by_distance))
    return [[by_distance[(t - s) % world] for t in range(world)] for s in range(world)]


def expected_blocks(seed: int, rank: int, world: int, numel: int, dtype, device, collective: str) -> torch.Tensor:
    """What an all-to-all of every rank's check input returns to `rank`: the block each rank sends it, in rank
    order."""
    sizes = block_sizes(collective, world, numel)
    return torch.cat([check_input(seed, s, numel, dtype, device)[sum(sizes[s][:rank]):sum(sizes[s][:rank + 1])]
                      for s in range(world)])


def expected_sum(seed: int, world: int, numel: int, dtype, device) -> torch.Tensor:
    """The float64 sum of every rank's check input, in the dtype (exact, see _CHECK_MAX_K)."""
    if world > _CHECK_MAX_WORLD:
        raise ValueError(f"the check data is exact up to {_CHECK_MAX_WORLD} ranks, not {world}")
    acc = torch.zeros(numel, dtype=torch.float64, device=device)
    for r in range(world):
        acc += check_input(seed, r, numel, dtype, device).to(torch.float64)
    return acc.to(dtype)


def bitwise_mismatch(what: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when got and want hold the same bits, else a message with the first differing element."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{what}: {got.dtype} {tuple(got.shape)} where {want.dtype} {tuple(want.shape)} was expected"
    bits = {2: torch.int16, 4: torch.int32}[got.element_size()]
    differ = (got.reshape(-1).view(bits) != want.reshape(-1).view(bits)).nonzero()
    if differ.numel() == 0:
        return None
    i = int(differ[0])
    return (f"{what}: {differ.numel()} of {got.numel()} elements differ bitwise; first at index {i}: "
            f"{got.reshape(-1)[i].item()!r} where {want.reshape(-1)[i].item()!r} was expected")


_MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7}


def fused_norm_bound(a: torch.Tensor, b: torch.Tensor, dtype) -> torch.Tensor:
    """Per element, how far apart (a, b: float64 copies) the fused add + RMSNorm's norm_out of `dtype` and the
    all-reduce followed by torch's ops may be. Both compute the same fp32 expression from the same rounded
    residual_out, except that they add the row's squares in another order: the sums differ by less than ~50
    roundings of 2^-24 relative (at most 32 sequential adds per thread, then 13 tree levels; torch's reduction is
    of the same depth), so the fp32 norms differ by < 2^-16 relative, and a 16-bit type rounds two values that
    close to the same or adjacent values: at most 1 unit in the last place apart."""
    magnitude = torch.maximum(a.abs(), b.abs())
    if dtype == torch.float32:
        return magnitude * 2.0**-16
    exponent = torch.floor(torch.log2(magnitude.clamp_min(2.0**-14)))  # fp16's smallest normal exponent
    return torch.exp2(exponent - _MANTISSA_BITS[dtype])  # one unit in the last place


def sleep_cycles_per_us() -> float:
    """How many cycles torch.cuda._sleep spins per microsecond on the current device: the most of 10 tries, the
    clock once it has ramped up, so that a sleep of SLEEP_BEFORE_REPLAY_US lasts at least that long."""
    torch.cuda._sleep(1000)  # loads the kernel
    torch.cuda.synchronize()
    rates = []
    for _ in range(10):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        torch.cuda._sleep(_CALIBRATION_CYCLES)
        end.record()
        end.synchronize()
        rates.append(_CALIBRATION_CYCLES / (begin.elapsed_time(end) * 1e3))
    return max(rates)


def method(cfg: dict, measured: dict) -> dict:
    """The method of a run, as recorded in the JSON's provenance; `measured` is rank 0's sleep calibration."""
    m = {
        "modes": cfg["modes"],
        "calls_per_measurement": {"up_to_1MiB": calls_per_measurement(1 << 20),
                                  "above_1MiB": calls_per_measurement((1 << 20) + 1)},
        "measurements_per_arm_size_mode": cfg["rounds"],
        "before_each_measurement": "barrier across ranks (gloo)",
        "warm_up": "per arm, 3 calls before capture (or the eager loop), then one untimed measurement",
        "arm_order": "every arm interleaved in one run; round-robin order shifted by one arm every round",
        "statistic": "slower rank per measurement; median, p10 and p90 over measurements, per call",
        "timer": "CUDA events" if cfg["device"] == "cuda" else "host clock (time.perf_counter)",
        "check": "every arm's output bitwise equal to " + ("NCCL's (itself equal to the float64 sum, or to every "
                 "rank's block for this rank)" if cfg["device"] == "cuda" else "the float64 sum (all-to-all: every "
                 "rank's block for this rank)") + " once per dtype and size, before timing"
                 + ("" if cfg["device"] == "cuda" else "; memcpy, a single-core copy of the same bytes on every "
                    "rank at once, is a yardstick, timed like an arm and not checked"),
    }
    if "graph" in cfg["modes"]:
        m["graph"] = (f"one CUDA graph per arm and size; before each replay, after the barrier, a "
                      f"{SLEEP_BEFORE_REPLAY_US} us GPU sleep (torch.cuda._sleep) ahead of the begin event")
        m["sleep_before_replay_us"] = SLEEP_BEFORE_REPLAY_US
    if "eager" in cfg["modes"]:
        m["eager"] = "the host issues the calls one by one between the two timer reads (no sleep: dispatch is timed)"
    return {**m, **measured}


@dataclass
class Context:
    rank: int
    world: int
    device: torch.device
    comm: object
    collective: str = "all_reduce"  # or "all_to_all" (of equal blocks), "all_to_all_unequal" (block_sizes())

    def splits(self, numel: int):
        """An all-to-all's input and output split sizes (all_to_all_single's) at `numel` elements a rank."""
        sizes = block_sizes(self.collective, self.world, numel)
        return sizes[self.rank], [sizes[s][self.rank] for s in range(self.world)]


class Measurement:
    """`calls` calls of one arm on its buffers, in one mode, timed as a whole and reported per call."""

    def __init__(self, arm, x, y, mode, calls, sleep_cycles):
        self.arm, self.x, self.y, self.mode, self.calls = arm, x, y, mode, calls
        self.cuda = x.is_cuda
        self.sleep_cycles = sleep_cycles
        self.graph = None
        if mode == "graph":
            stream = torch.cuda.Stream(x.device)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside the capture, as graph capture requires
                for _ in range(3):
                    arm.call(x, y)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                for _ in range(calls):
                    arm.call(x, y)
        else:
            for _ in range(3):
                arm.call(x, y)
        if self.cuda:
            torch.cuda.synchronize()
            self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def run(self) -> float:
        """Microseconds per call for one measurement (the caller has just passed a barrier)."""
        if not self.cuda:
            start = time.perf_counter()
            for _ in range(self.calls):
                self.arm.call(self.x, self.y)
            return (time.perf_counter() - start) * 1e6 / self.calls
        if self.graph is not None:
            torch.cuda._sleep(self.sleep_cycles)
            self.begin.record()
            self.graph.replay()
        else:
            self.begin.record()
            for _ in range(self.calls):
                self.arm.call(self.x, self.y)
        self.end.record()
        self.end.synchronize()
        return self.begin.elapsed_time(self.end) * 1e3 / self.calls

    def close(self) -> None:
        """Drops the graph. Every graph must go before the process groups: NCCL's communicator destroy waits
        until each graph that captured one of its calls is destroyed (NCCL 2.28 commDestroySync)."""
        self.graph = None


def _agree_names(names: list[str], world: int, control) -> list[str]:
    """The names every rank has, in this rank's order (all ranks must run the same collectives)."""
    everyone = [None] * world
    dist.all_gather_object(everyone, names, group=control)
    common = set.intersection(*(set(n) for n in everyone))
    return [n for n in names if n in common]


def _check(ctx, arms, buffers, reference, seed, numel, dtype, control) -> dict:
    """One call of every arm on the check data. Raises on every rank if any rank saw an output that is not
    bitwise equal to the reference arm's (NCCL's), or to the float64 sum (all-to-all: the blocks every rank sends
    this one) where there is no reference arm. Returns {arm name: why} for the arms whose call raised on some rank
    (e.g. a dtype they lack)."""
    device, problems, failed = ctx.device, [], {}
    mine = check_input(seed, ctx.rank, numel, dtype, device)
    want = expected_blocks(seed, ctx.rank, ctx.world, numel, dtype, device, ctx.collective) \
        if ctx.collective != "all_reduce" else expected_sum(seed, ctx.world, numel, dtype, device)
    if reference is not None:
        x, y = reference.prepare(numel, dtype)
        x.copy_(mine)
        out = reference.call(x, y)
        torch.cuda.synchronize()
        problems.append(bitwise_mismatch(f"{reference.name} (the reference) against the float64 reference", out, want))
        want = out.clone()
    against = reference.name if reference is not None else "the float64 sum"
    for arm in (a for a in arms if a.all_reduce):
        x, y = buffers[arm.name]
        x.copy_(mine)
        try:
            out = arm.call(x, y)
            if device.type == "cuda":
                torch.cuda.synchronize()
        except Exception as err:  # not a wrong answer: this arm does not run here; it is left out, on every rank
            failed[arm.name] = f"rank {ctx.rank}: {type(err).__name__}: {err}".splitlines()[0]
            continue
        problems.append(bitwise_mismatch(f"{arm.name} against {against}", out, want))
    problems = [f"rank {ctx.rank}: {p}" for p in problems if p is not None]
    everyone = [None] * ctx.world
    dist.all_gather_object(everyone, (problems, failed), group=control)
    wrong = [p for per_rank, _ in everyone for p in per_rank]
    if wrong:
        raise RuntimeError(f"wrong {ctx.collective} output, {dtype} {numel} elements, before timing:\n  "
                           + "\n  ".join(wrong))
    return {name: why for _, per_rank in everyone for name, why in per_rank.items()}


def _measure_mode(ctx, arms, buffers, mode, nbytes, cfg, sleep_cycles, control, skipped, label) -> dict:
    """Times every arm in one mode; returns {arm name: per-rank lists of per-call microseconds}. The graphs
    live only inside this call."""
    calls = calls_per_measurement(nbytes)
    live = []
    for arm in arms:
        try:
            live.append(Measurement(arm, *buffers[arm.name], mode, calls, sleep_cycles))
        except Exception as err:  # recorded, not fatal: e.g. an op this torch cannot capture
            skipped.setdefault(f"{arm.name}/{label}", {})[nbytes] = f"{type(err).__name__}: {err}".splitlines()[0]
    common = _agree_names([m.arm.name for m in live], ctx.world, control)
    live = [m for m in live if m.arm.name in common]
    samples = {m.arm.name: [] for m in live}
    try:
        for m in live:  # one untimed measurement each: a graph's first replay also uploads it
            dist.barrier(group=control)
            m.run()
        for rnd in range(cfg["rounds"]):
            for m in round_order(live, rnd):
                dist.barrier(group=control)
                samples[m.arm.name].append(m.run())
    finally:
        for m in live:
            m.close()
    everyone = [None] * ctx.world
    dist.all_gather_object(everyone, samples, group=control)
    return {name: [per_rank[name] for per_rank in everyone] for name in samples}


def _measure(ctx, arms, reference, cfg, sleep_cycles, control, skipped) -> list[dict]:
    rows = []
    seed = [random.getrandbits(32)]  # fresh check data every run, the same on every rank
    dist.broadcast_object_list(seed, src=0, group=control)
    combo = 0
    for dtype_name in cfg["dtypes"]:
        dtype = DTYPE_NAMES[dtype_name]
        esize = torch.empty((), dtype=dtype).element_size()
        for size in cfg["sizes"]:
            numel = max(1, size // esize)
            if ctx.collective != "all_reduce":  # world blocks (equal: of one size)
                numel = max(ctx.world, numel - numel % ctx.world)
            nbytes = numel * esize
            supported = []
            for arm in arms:
                why = arm.supports(nbytes, dtype)
                if why is None:
                    supported.append(arm.name)
                else:
                    for mode in cfg["modes"]:
                        skipped.setdefault(f"{arm.name}/{mode}/{dtype_name}", {})[nbytes] = why
            common = _agree_names(supported, ctx.world, control)
            here = [a for a in arms if a.name in common]
            buffers = {a.name: a.prepare(numel, dtype) for a in here}
            failed = _check(ctx, here, buffers, reference, seed[0] + combo, numel, dtype, control)
            combo += 1
            for name, why in failed.items():
                for mode in cfg["modes"]:
                    skipped.setdefault(f"{name}/{mode}/{dtype_name}", {})[nbytes] = why
            here = [a for a in here if a.name not in failed]
            for mode in cfg["modes"]:
                times = _measure_mode(ctx, here, buffers, mode, nbytes, cfg, sleep_cycles, control, skipped,
                                      f"{mode}/{dtype_name}")
                done = []
                for name, per_rank in times.items():
                    rows.append({"arm": name, "mode": mode, "dtype": dtype_name, "bytes": nbytes, "count": numel,
                                 **summarize(per_rank), "ops_per_measurement": calls_per_measurement(nbytes)})
                    done.append(rows[-1])
                if ctx.rank == 0:
                    print(f"  {dtype_name} {nbytes} B {mode}: " +
                          ", ".join(f"{r['arm']} {r['median_us']:.2f} us" for r in done), flush=True)
            del buffers
    return rows


def _live_cuda_graphs() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.cuda.CUDAGraph))


def worker(store, rank, world, cfg, publish, local_rank=None) -> None:
    """Measures every arm; calls publish(result) once the measurements are done (rank 0's holds the rows and where
    every rank ran). `local_rank`: the GPU index (default: the rank; under torchrun, LOCAL_RANK)."""
    import socket

    import rocenante
    from rocenante import _ib

    cuda = cfg["device"] == "cuda"
    index = rank if local_rank is None else local_rank
    if cuda:
        torch.cuda.set_device(index)
    device = torch.device("cuda", index) if cuda else torch.device("cpu")
    dist.init_process_group("gloo", store=dist.PrefixStore("ctl", store), rank=rank, world_size=world)
    control = dist.group.WORLD
    comm = rocenante.Communicator(store, rank, world, device=device, capacity_bytes=cfg["capacity_bytes"])
    ctx = Context(rank, world, device, comm, cfg.get("collective", "all_reduce"))
    # dist.all_reduce through the "rocenante" torch.distributed backend: the communicator plus dispatch.
    backend_group = dist.new_group(backend="rocenante")
    arms: list = [arms_mod.Rocenante(ctx), arms_mod.Collective(ctx, "rocenante_backend", backend_group)]
    net_comm = None
    if "rocenante_net_tcp" in cfg["arms"]:  # only on request (arms.ON_REQUEST)
        net_comm = rocenante.Communicator(store, rank, world, device=device, capacity_bytes=cfg["capacity_bytes"],
                                          name="bench_net_tcp", net="tcp")
        arms.append(arms_mod.Rocenante(Context(rank, world, device, net_comm, ctx.collective), "rocenante_net_tcp"))
    skipped: dict = {}
    method: dict = {}
    if cuda:
        nccl = dist.new_group(backend="nccl")
        reference = arms_mod.Collective(ctx, "nccl", nccl)
        arms.append(reference)
        for name in arms_mod.available_symm_mem_arms() if ctx.collective == "all_reduce" else []:
            try:
                arms.append(arms_mod.SymmMem(ctx, name, nccl, cfg["max_bytes"]))
            except Exception as err:  # recorded, not fatal: this torch may lack the backend for it
                skipped[name] = f"setup failed: {type(err).__name__}: {err}"
        rate = sleep_cycles_per_us()
        sleep_cycles = round(SLEEP_BEFORE_REPLAY_US * rate)
        method.update(sleep_cycles_per_us=round(rate, 3), sleep_cycles=sleep_cycles)
    else:
        reference, sleep_cycles = None, 0
        arms.append(arms_mod.Collective(ctx, "gloo", control))
        arms.append(arms_mod.Memcpy(ctx))
    arms = [a for a in arms if not cfg["arms"] or a.name in cfg["arms"]]

    rows = _measure(ctx, arms, reference, cfg, sleep_cycles, control, skipped)
    where = [None] * world  # each rank's host and, over RDMA, the devices that reach its peers
    dist.all_gather_object(where, {"host": socket.gethostname(), "net": comm.net,
                                   "paths": _ib.describe(rank, comm.ib_paths).splitlines()}, group=control)
    gc.collect()
    if cuda and _live_cuda_graphs():  # would make destroy_process_group below wait forever (Measurement.close)
        raise RuntimeError(f"rank {rank}: {_live_cuda_graphs()} CUDA graph(s) still alive before teardown")
    publish({"rows": rows, "skipped": skipped, "method": method, "ranks": where} if rank == 0 else {})  # before teardown
    del arms, reference
    if cuda:
        torch.cuda.synchronize()
    dist.barrier(group=control)  # no rank frees what a peer may still be writing into
    comm.close()
    if net_comm is not None:
        net_comm.close()
    dist.destroy_process_group()


def _run_spawned(fn, store_path: str, rank: int, world: int, cfg: dict, queue) -> None:
    try:
        queue.put((rank, fn(dist.FileStore(store_path, world), rank, world, cfg)))
    except BaseException:
        queue.put((rank, {"error": traceback.format_exc()}))


def run_spawned(fn, world: int, cfg: dict, timeout: float) -> dict:
    """Runs fn(store, rank, world, cfg) in `world` spawned processes sharing a FileStore (for the scripts in
    benchmarks/); returns {rank: what fn returned, or {"error": its traceback}}."""
    import multiprocessing as mp
    import tempfile

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_run_spawned, args=(fn, store, r, world, cfg, queue)) for r in range(world)]
        for proc in procs:
            proc.start()
        results = dict(queue.get(timeout=timeout) for _ in procs)
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    return results


def run_rank(store_path: str, rank: int, world: int, cfg: dict, queue) -> None:
    """Process entry: joins the FileStore at store_path, runs worker() and puts (rank, result) on the queue."""
    try:
        worker(dist.FileStore(store_path, world), rank, world, cfg, lambda result: queue.put((rank, result)))
    except BaseException:
        queue.put((rank, {"error": traceback.format_exc()}))
