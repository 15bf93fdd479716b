"""One benchmark rank: builds every arm, then for each (dtype, size, mode) measures the arms interleaved,
round after round, so that drift on the machine touches every arm alike. Rank 0 publishes the rows."""

from __future__ import annotations

import statistics
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rocenante.bench import arms as arms_mod

DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Context:
    rank: int
    world: int
    device: torch.device
    comm: object


def _ops_per_measurement(nbytes: int) -> int:
    return 50 if nbytes <= (1 << 20) else 20


class Measurement:
    """`ops` all-reduces of one arm at one (dtype, size), timed as a whole and reported per op."""

    def __init__(self, arm, numel, dtype, mode, ops):
        self.arm, self.mode, self.ops = arm, mode, ops
        self.x, self.y = arm.prepare(numel, dtype)
        self.cuda = self.x.is_cuda
        self.graph = None
        if mode == "graph":
            stream = torch.cuda.Stream(self.x.device)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside the capture, as graph capture requires
                for _ in range(3):
                    arm.call(self.x, self.y)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                for _ in range(ops):
                    arm.call(self.x, self.y)
        else:
            for _ in range(3):
                arm.call(self.x, self.y)
        self._sync()

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def run(self) -> float:
        """Microseconds per op for one measurement (the caller has just passed a barrier)."""
        if not self.cuda:
            start = time.perf_counter()
            for _ in range(self.ops):
                self.arm.call(self.x, self.y)
            return (time.perf_counter() - start) * 1e6 / self.ops
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        if self.graph is not None:
            self.graph.replay()
        else:
            for _ in range(self.ops):
                self.arm.call(self.x, self.y)
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) * 1e3 / self.ops


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def worker(store, rank, world, cfg, publish) -> None:
    """Measures every arm; calls publish(result) once the measurements are done (rank 0's holds the rows)."""
    import rocenante

    cuda = cfg["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("gloo", store=dist.PrefixStore("ctl", store), rank=rank, world_size=world)
    control = dist.group.WORLD
    comm = rocenante.Communicator(store, rank, world, device=device, capacity_bytes=cfg["capacity_bytes"])
    ctx = Context(rank, world, device, comm)
    # dist.all_reduce through the "rocenante" torch.distributed backend: the communicator plus dispatch.
    backend_group = dist.new_group(backend="rocenante")
    arms: list = [arms_mod.Rocenante(ctx), arms_mod.Collective(ctx, "rocenante_backend", backend_group)]
    skipped: dict = {}
    if cuda:
        nccl = dist.new_group(backend="nccl")
        arms.append(arms_mod.Collective(ctx, "nccl", nccl))
        for name in arms_mod.available_symm_mem_arms():
            try:
                arms.append(arms_mod.SymmMem(ctx, name, nccl, cfg["max_bytes"]))
            except Exception as err:  # recorded, not fatal: this torch may lack the backend for it
                skipped[name] = f"setup failed: {type(err).__name__}: {err}"
    else:
        arms.append(arms_mod.Collective(ctx, "gloo", control))
    arms = [a for a in arms if not cfg["arms"] or a.name in cfg["arms"]]

    rows = []
    for dtype_name in cfg["dtypes"]:
        dtype = DTYPE_NAMES[dtype_name]
        esize = torch.empty((), dtype=dtype).element_size()
        for nbytes in cfg["sizes"]:
            numel = max(1, nbytes // esize)
            for mode in cfg["modes"]:
                ops = _ops_per_measurement(nbytes)
                live = []
                for arm in arms:
                    why = arm.supports(numel * esize, dtype)
                    if why is None:
                        try:
                            live.append(Measurement(arm, numel, dtype, mode, ops))
                        except Exception as err:
                            why = f"{type(err).__name__}: {err}".splitlines()[0]
                    if why is not None:
                        skipped.setdefault(f"{arm.name}/{mode}/{dtype_name}", {})[numel * esize] = why
                # Every rank must measure the same arms: agree on the intersection.
                names = [m.arm.name for m in live]
                agreed = [None] * world
                dist.all_gather_object(agreed, names, group=control)
                common = set.intersection(*(set(a) for a in agreed))
                live = [m for m in live if m.arm.name in common]
                samples = {m.arm.name: [] for m in live}
                for rep in range(cfg["rounds"]):
                    order = live[rep % len(live):] + live[: rep % len(live)] if live else []
                    for m in order:
                        dist.barrier(group=control)
                        samples[m.arm.name].append(m.run())
                gathered = [None] * world
                dist.all_gather_object(gathered, samples, group=control)
                for m in live:
                    # Per round, the slower rank's time: the collective is done only when every rank is.
                    per_round = [max(g[m.arm.name][i] for g in gathered) for i in range(cfg["rounds"])]
                    rows.append({
                        "arm": m.arm.name, "mode": mode, "dtype": dtype_name, "bytes": numel * esize, "count": numel,
                        "median_us": statistics.median(per_round), "p10_us": _percentile(per_round, 0.1),
                        "p90_us": _percentile(per_round, 0.9), "ops_per_measurement": m.ops,
                        "measurements": len(per_round),
                    })
                del live
                if cuda:
                    torch.cuda.synchronize()
                if rank == 0:
                    done = [r for r in rows if r["bytes"] == numel * esize and r["mode"] == mode and r["dtype"] == dtype_name]
                    print(f"  {dtype_name} {numel * esize} B {mode}: " +
                          ", ".join(f"{r['arm']} {r['median_us']:.2f} us" for r in done), flush=True)
    publish({"rows": rows, "skipped": skipped} if rank == 0 else {})  # before teardown, which may be slow
    del arms
    dist.barrier(group=control)  # no rank frees what a peer may still be writing into
    comm.close()
    dist.destroy_process_group()


def run_rank(store_path: str, rank: int, world: int, cfg: dict, queue) -> None:
    """Process entry: joins the FileStore at store_path, runs worker() and puts (rank, result) on the queue."""
    try:
        worker(dist.FileStore(store_path, world), rank, world, cfg, lambda result: queue.put((rank, result)))
    except BaseException:
        queue.put((rank, {"error": traceback.format_exc()}))
