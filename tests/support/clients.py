"""Real clients of the backend, run as a user's program would: torch's functional collectives, async work,
DTensor redistributions and tensor-parallel modules, each a cell of one matrix (tests/cpu/test_real_clients.py,
tests/gpu/test_gpu_real_clients.py), in eager mode, under torch.compile and (GPU) in a CUDA graph.

Every rank runs the cells of one mode in one process group, in order, and appends each cell's outcome to a file
as it ends, so that a cell that hangs is named by the ones before it. A cell computes outputs from fresh random
inputs (a seed the test draws) that every rank can rebuild for every other rank, checks them against a
single-process reference, and reports their digests, so that the test can also check that every rank holds the
same bits; it also counts the calls rocenante's communicator served, so a cell that should be served is shown to
be, and one that is delegated to be delegated."""

from __future__ import annotations

import gc
import json
import os
import traceback

import torch
import torch.nn as nn

from reference import digest, make_input, poison, sequential_fp32

SERVED, DELEGATED = "served", "delegated"

# Rows of the inputs (dim 0 a multiple of every world the tests run) and columns; 1 KiB to a few KiB a tensor.
ROWS, COLS = 8, 24


class Cell:
    """One client pattern: `run(ctx)` returns {name: (output, reference, exact, replicated)}; `path` says whether
    rocenante serves its collectives or the delegate does."""

    def __init__(self, name, run, path, graph_ok=True, compile_ok=True):
        self.name, self.run, self.path, self.graph_ok, self.compile_ok = name, run, path, graph_ok, compile_ok


class Context:
    def __init__(self, rank, world, device, mode, seed, group):
        self.rank, self.world, self.device, self.mode, self.seed, self.group = rank, world, device, mode, seed, group

    def inputs(self, case, rows=ROWS, cols=COLS, dtype=torch.float32):
        """Every rank's input of this case (fresh random data any rank can rebuild), on this rank's device."""
        return [make_input(self.seed, case, r, rows * cols, dtype).view(rows, cols).to(self.device)
                for r in range(self.world)]

    def call(self, fn, *args):
        """fn(*args) as the mode runs it: directly, compiled, or captured in a CUDA graph and replayed with the
        arguments copied into the graph's static inputs (outputs poisoned before the replay)."""
        if self.mode == "eager":
            return fn(*args)
        if self.mode == "compile":
            torch._dynamo.reset()
            return torch.compile(fn)(*args)  # as a user would: graph breaks allowed (torch 2.11 breaks at
            # all_gather_tensor's chunk-cat for dims other than 0)
        static = [a.clone() for a in args]
        for a in static:  # the graph is captured on garbage, then replayed on the real inputs
            poison(a)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph, as torch asks for
            fn(*static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(*static)
        for o in (out if isinstance(out, (list, tuple)) else [out]):
            poison(o)
        for s, a in zip(static, args):
            s.copy_(a)
        graph.replay()
        torch.cuda.synchronize()
        return out


def _funcol():
    import torch.distributed._functional_collectives as funcol

    return funcol


def _wait(t):
    return _funcol().wait_tensor(t)


# ---- the functional collectives ----

def funcol_all_reduce(ctx):
    xs = ctx.inputs(1)
    out = ctx.call(lambda x: _wait(_funcol().all_reduce(x, "sum", ctx.group)), xs[ctx.rank])
    return {"sum": (out, sequential_fp32(xs, "sum"), True, True)}


def funcol_all_gather(dim):
    def run(ctx):
        xs = ctx.inputs(2 + dim % 3)
        out = ctx.call(lambda x: _wait(_funcol().all_gather_tensor(x, dim, ctx.group)), xs[ctx.rank])
        return {f"dim{dim}": (out, torch.cat(xs, dim), True, True)}

    return run


def funcol_reduce_scatter(ctx):
    xs = ctx.inputs(5)
    out = ctx.call(lambda x: _wait(_funcol().reduce_scatter_tensor(x, "sum", 0, ctx.group)), xs[ctx.rank])
    return {"shard": (out, sequential_fp32(xs, "sum").chunk(ctx.world)[ctx.rank], True, False)}


def funcol_all_to_all_single(ctx):
    xs = ctx.inputs(6)
    out = ctx.call(lambda x: _wait(_funcol().all_to_all_single(x, None, None, ctx.group)), xs[ctx.rank])
    want = torch.cat([x.chunk(ctx.world)[ctx.rank] for x in xs])
    return {"blocks": (out, want, True, False)}


def funcol_all_to_all_single_unequal(ctx):
    """Unequal splits (as MoE routing makes them): rank r sends base[(p + r) % world] rows to rank p."""
    xs, world = ctx.inputs(26), ctx.world
    base = [ROWS - (world - 1)] + [1] * (world - 1)
    send = [[base[(p + r) % world] for p in range(world)] for r in range(world)]
    recv = [send[s][ctx.rank] for s in range(world)]
    out = ctx.call(lambda x: _wait(_funcol().all_to_all_single(x, recv, send[ctx.rank], ctx.group)), xs[ctx.rank])
    want = torch.cat([xs[s][sum(send[s][:ctx.rank]):sum(send[s][:ctx.rank + 1])] for s in range(world)])
    return {"blocks": (out, want, True, False)}


def funcol_broadcast(ctx):
    xs = ctx.inputs(7)
    out = ctx.call(lambda x: _wait(_funcol().broadcast(x, 1, ctx.group)), xs[ctx.rank])
    return {"root1": (out, xs[1], True, True)}


def funcol_all_reduce_coalesced(ctx):
    xs, ys = ctx.inputs(8), ctx.inputs(9, rows=4)
    outs = ctx.call(lambda x, y: [_wait(t) for t in _funcol().all_reduce_coalesced([x, y], "sum", ctx.group)],
                    xs[ctx.rank], ys[ctx.rank])
    return {"x": (outs[0], _sum64(xs), False, True), "y": (outs[1], _sum64(ys), False, True)}


def funcol_all_gather_coalesced(ctx):
    xs, ys = ctx.inputs(10), ctx.inputs(11, rows=4)
    outs = ctx.call(lambda x, y: [_wait(t) for t in
                                  _funcol().all_gather_into_tensor_coalesced([x, y], ctx.group)],
                    xs[ctx.rank], ys[ctx.rank])
    return {"x": (outs[0], torch.cat(xs), True, True), "y": (outs[1], torch.cat(ys), True, True)}


def funcol_reduce_scatter_coalesced(ctx):
    xs, ys = ctx.inputs(12), ctx.inputs(13, rows=4)
    outs = ctx.call(lambda x, y: [_wait(t) for t in _funcol().reduce_scatter_tensor_coalesced(
        [x, y], "sum", [0, 0], ctx.group)], xs[ctx.rank], ys[ctx.rank])
    return {"x": (outs[0], sequential_fp32(xs, "sum").chunk(ctx.world)[ctx.rank], True, False),
            "y": (outs[1], sequential_fp32(ys, "sum").chunk(ctx.world)[ctx.rank], True, False)}


def funcol_coalesced_delegated(ctx):
    """Coalesced all-gathers and reduce-scatters of a dtype rocenante does not serve (float64): the delegate
    takes them tensor by tensor, as one Work."""
    xs, ys = ctx.inputs(24, dtype=torch.float64), ctx.inputs(25, rows=4, dtype=torch.float64)
    funcol = _funcol()
    gathered = ctx.call(lambda x, y: [_wait(t) for t in funcol.all_gather_into_tensor_coalesced([x, y], ctx.group)],
                        xs[ctx.rank], ys[ctx.rank])
    scattered = ctx.call(lambda x, y: [_wait(t) for t in funcol.reduce_scatter_tensor_coalesced(
        [x, y], "sum", [0, 0], ctx.group)], xs[ctx.rank], ys[ctx.rank])
    return {"gather_x": (gathered[0], torch.cat(xs), True, True), "gather_y": (gathered[1], torch.cat(ys), True, True),
            "scatter_x": (scattered[0], _sum64(xs).chunk(ctx.world)[ctx.rank], False, False),
            "scatter_y": (scattered[1], _sum64(ys).chunk(ctx.world)[ctx.rank], False, False)}


def funcol_unwaited_and_freed(ctx):
    """An AsyncCollectiveTensor nobody waits for, freed (its work stays in torch's registry until exit: the
    process must still end cleanly); the next collectives are right."""
    xs, ys = ctx.inputs(14), ctx.inputs(15)
    funcol = _funcol()
    unwaited = funcol.all_reduce(xs[ctx.rank], "sum", ctx.group)
    del unwaited
    gc.collect()
    out = _wait(funcol.all_reduce(ys[ctx.rank], "sum", ctx.group))
    gathered = _wait(funcol.all_gather_tensor(ys[ctx.rank], 0, ctx.group))
    return {"next": (out, sequential_fp32(ys, "sum"), True, True), "gather": (gathered, torch.cat(ys), True, True)}


# ---- torch.distributed with async_op=True, the work dropped ----

def async_work_dropped(ctx):
    """dist.all_reduce(async_op=True) whose Work is dropped unwaited, then a synchronous one: both right (on CUDA
    the call is ordered on the current stream, so the later call and the check see it)."""
    import torch.distributed as dist

    xs, ys = ctx.inputs(16), ctx.inputs(17)
    x, y = xs[ctx.rank].clone(), ys[ctx.rank].clone()
    work = dist.all_reduce(x, async_op=True)
    del work
    gc.collect()
    dist.all_reduce(y)
    return {"dropped": (x, sequential_fp32(xs, "sum"), True, True), "next": (y, sequential_fp32(ys, "sum"), True, True)}


def async_delegated_work_dropped(ctx):
    """The same for a delegated collective (broadcast): its Work dropped, then waited for by a barrier."""
    import torch.distributed as dist

    xs = ctx.inputs(18)
    x = xs[ctx.rank].clone()
    work = dist.broadcast(x, 0, async_op=True)
    del work
    dist.barrier()
    return {"root0": (x, xs[0], True, True)}


# ---- DTensor ----

def _mesh(ctx):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(ctx.device.type, (ctx.world,))


def _redistribute(ctx, case, src, dst, want, exact=True, replicated=True):
    from torch.distributed.tensor import DTensor

    mesh = _mesh(ctx)
    xs = ctx.inputs(case)
    out = ctx.call(lambda x: DTensor.from_local(x, mesh, [src]).redistribute(mesh, [dst]).to_local(), xs[ctx.rank])
    return {"local": (out, want(xs), exact, replicated)}


def dtensor_shard_to_replicate(ctx):
    from torch.distributed.tensor import Replicate, Shard

    return _redistribute(ctx, 19, Shard(0), Replicate(), torch.cat)


def dtensor_partial_to_replicate(ctx):
    from torch.distributed.tensor import Partial, Replicate

    return _redistribute(ctx, 20, Partial(), Replicate(), lambda xs: sequential_fp32(xs, "sum"))


def dtensor_partial_to_shard(ctx):
    from torch.distributed.tensor import Partial, Shard

    return _redistribute(ctx, 21, Partial(), Shard(0), lambda xs: sequential_fp32(xs, "sum").chunk(ctx.world)[ctx.rank],
                         replicated=False)


class _Block(nn.Module):
    """A transformer MLP block: norm, up projection, activation, down projection."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(COLS)
        self.up = nn.Linear(COLS, 4 * COLS)
        self.down = nn.Linear(4 * COLS, COLS)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.norm(x))))


def _parallel_block(ctx, plan, x_local, case):
    """The block with every rank's weights alike (seeded), parallelized by `plan`; returns its output on
    x_local and the single-process reference on `x_full`."""
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(ctx.seed * 7 + case)
    block = _Block()
    reference = _Block()
    reference.load_state_dict(block.state_dict())
    parallel = parallelize_module(block.to(ctx.device), _mesh(ctx), plan)
    with torch.no_grad():
        out = ctx.call(parallel, x_local)
    return out, reference


def tp_colwise_rowwise(ctx):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    x = ctx.inputs(22)[0]  # every rank the same input (replicated activations)
    out, reference = _parallel_block(ctx, {"up": ColwiseParallel(), "down": RowwiseParallel()}, x, 22)
    with torch.no_grad():
        want = reference.double()(x.double().cpu())
    return {"out": (out, want, False, True)}


def tp_sequence_parallel(ctx):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    xs = ctx.inputs(23)  # the sequence (dim 0) sharded: rank r holds rows r * ROWS .. of the whole
    plan = {"norm": SequenceParallel(sequence_dim=0), "up": ColwiseParallel(input_layouts=Shard(0)),
            "down": RowwiseParallel(output_layouts=Shard(0))}
    out, reference = _parallel_block(ctx, plan, xs[ctx.rank], 23)
    with torch.no_grad():
        want = reference.double()(torch.cat(xs).double().cpu()).chunk(ctx.world)[ctx.rank]
    return {"out": (out, want, False, False)}


def _sum64(xs):
    return torch.stack([x.double().cpu() for x in xs]).sum(0)


CELLS = [
    Cell("funcol_all_reduce", funcol_all_reduce, SERVED),
    Cell("funcol_all_gather_dim0", funcol_all_gather(0), SERVED),
    Cell("funcol_all_gather_dim1", funcol_all_gather(1), SERVED),
    Cell("funcol_all_gather_dim-1", funcol_all_gather(-1), SERVED),
    Cell("funcol_reduce_scatter", funcol_reduce_scatter, SERVED),
    Cell("funcol_all_gather_coalesced", funcol_all_gather_coalesced, SERVED),
    Cell("funcol_reduce_scatter_coalesced", funcol_reduce_scatter_coalesced, SERVED),
    Cell("funcol_all_to_all_single", funcol_all_to_all_single, SERVED),
    Cell("funcol_all_to_all_single_unequal", funcol_all_to_all_single_unequal, SERVED),
    Cell("funcol_broadcast", funcol_broadcast, DELEGATED, graph_ok=False),
    Cell("funcol_all_reduce_coalesced", funcol_all_reduce_coalesced, DELEGATED, graph_ok=False),
    Cell("funcol_coalesced_delegated", funcol_coalesced_delegated, DELEGATED, graph_ok=False),
    Cell("funcol_unwaited_and_freed", funcol_unwaited_and_freed, SERVED, graph_ok=False, compile_ok=False),
    Cell("async_work_dropped", async_work_dropped, SERVED, graph_ok=False, compile_ok=False),
    Cell("async_delegated_work_dropped", async_delegated_work_dropped, DELEGATED, graph_ok=False,
         compile_ok=False),
    Cell("dtensor_shard_to_replicate", dtensor_shard_to_replicate, SERVED),
    Cell("dtensor_partial_to_replicate", dtensor_partial_to_replicate, SERVED),
    Cell("dtensor_partial_to_shard", dtensor_partial_to_shard, SERVED),
    Cell("tp_colwise_rowwise", tp_colwise_rowwise, SERVED),
    Cell("tp_sequence_parallel", tp_sequence_parallel, SERVED),
]
BY_NAME = {c.name: c for c in CELLS}


def _check(name, out, want, exact):
    """Exact cells: the bits of the reference (rank order, fp32); others within fp32 rounding of float64."""
    got = out.detach().cpu()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if exact:
        assert torch.equal(got, want.cpu()), f"{name}: differs from the reference"
    else:
        err = (got.double() - want.double()).abs().max().item()
        scale = want.double().abs().max().item() + 1.0
        assert err <= 1e-5 * scale, f"{name}: error {err:.3g} against the float64 reference (scale {scale:.3g})"


def run_cells(store, rank, world, device_type, mode, names, seed, log_dir):
    """The cells `names` of `mode` on this rank, one process group "rocenante" for all; each cell's outcome
    ({"status", "served", "digests", "error"}) is appended to log_dir/rank<r>.jsonl as it ends."""
    import torch.distributed as dist

    import rocenante  # noqa: F401  (registers the backend)

    device = torch.device("cpu")
    if device_type == "cuda":
        from gpus import use

        device = use(rank)
    dist.init_process_group("rocenante", store=store, rank=rank, world_size=world)
    group = dist.group.WORLD
    dist.all_reduce(torch.zeros(1, device=device))  # starts the CPU path where the group also serves CUDA
    comm = group._comms.get(device_type)
    assert comm is not None, f"rocenante does not serve {device_type}: {rocenante.status()}"
    served = []
    launch = comm._launch
    comm._launch = lambda *a, **k: served.append(1) or launch(*a, **k)
    log = os.path.join(log_dir, f"rank{rank}.jsonl")
    ctx = Context(rank, world, device, mode, seed, group)
    for name in names:
        before = len(served)
        entry = {"cell": name, "status": "ok", "digests": {}, "error": None}
        try:
            for part, (out, want, exact, replicated) in BY_NAME[name].run(ctx).items():
                if device_type == "cuda":
                    torch.cuda.synchronize()
                _check(f"{name}/{part}", out, want, exact)
                if replicated:
                    entry["digests"][part] = digest(out)
        except Exception as err:  # recorded; the next cells still run (every rank makes the same calls)
            entry.update(status="failed", error=f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        entry["served"] = len(served) - before
        with open(log, "a") as f:
            f.write(json.dumps(entry) + "\n")
    dist.destroy_process_group()
    return True


def read_log(log_dir, rank):
    path = os.path.join(log_dir, f"rank{rank}.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {e["cell"]: e for e in map(json.loads, f)}


def run_matrix(device_type, mode, world, timeout):
    """Runs every cell of `mode` that runs on this device (not skipped()) on `world` ranks; returns
    (names run, each rank's outcomes by cell, each rank's process result)."""
    import random
    import tempfile

    from multiproc import run_ranks

    names = [c.name for c in CELLS if skipped(c, device_type, mode, world) is None]
    seed = random.randrange(1 << 30)
    with tempfile.TemporaryDirectory() as log_dir:
        results = run_ranks(world, run_cells, device_type, mode, names, seed, log_dir, timeout=timeout,
                            clean_exit=True)
        return names, [read_log(log_dir, r) for r in range(world)], results


def skipped(cell, device_type, mode, world):
    """Why `cell` does not run in `mode` on `device_type`, or None."""
    if mode == "graph" and device_type != "cuda":
        return "CUDA graphs need a GPU"
    if mode == "graph" and not cell.graph_ok:
        return "not capturable: its collective goes to the delegate, or it drops work a graph cannot hold"
    if mode == "compile" and not cell.compile_ok:
        return "drops a Work or an unwaited tensor on purpose: an eager pattern"
    if device_type == "cuda" and cell.path == DELEGATED and os.environ.get("ROCENANTE_TEST_SHARED_GPU") == "1":
        return ("ranks share a GPU, so the delegate is gloo, whose CUDA functional collectives crash torch 2.11 "
                "itself (benchmarks/logs/h200-gloo-cuda-funcol.log); with a GPU per rank the delegate is NCCL")
    return None


def matrix_test(device_type, world=2):
    """The test function of the matrix on `device_type` (a test file assigns it to test_cell): every cell in
    every mode, skipped with its reason where it does not run; the ranks run each mode's cells once."""
    import functools

    import pytest

    @functools.cache
    def outcome(mode):
        return run_matrix(device_type, mode, world, timeout=600)

    @pytest.mark.parametrize("mode", ["eager", "compile", "graph"])
    @pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.name)
    def test_cell(cell, mode):
        why = skipped(cell, device_type, mode, world)
        if why is not None:
            pytest.skip(why)
        check_cell(outcome(mode), cell)

    return test_cell


def check_cell(outcome, cell):
    """Fails unless every rank finished `cell` correctly, with the same bits where the result is replicated, and
    served it through rocenante exactly when it should be. outcome is run_matrix()'s."""
    names, logs, results = outcome
    for rank, log in enumerate(logs):
        if cell.name not in log:
            reached = [n for n in names if n in log]
            raise AssertionError(f"rank {rank} never finished {cell.name} (finished: {reached}; process: "
                                 f"{results[rank]!r:.2000})")
        entry = log[cell.name]
        assert entry["status"] == "ok", f"rank {rank}: {entry['error']}"
        if cell.path == SERVED:
            assert entry["served"] > 0, f"rank {rank}: rocenante served none of {cell.name}'s collectives"
        else:
            assert entry["served"] == 0, f"rank {rank}: rocenante served {entry['served']} call(s) of a delegated cell"
    digests = [log[cell.name]["digests"] for log in logs]
    assert all(d == digests[0] for d in digests), f"ranks returned different bits: {digests}"
    for rank, res in enumerate(results):  # the process itself ended cleanly (unwaited works are freed at exit)
        assert res is True, f"rank {rank}: {res!r:.2000}"


# ---- transformers' tensor parallelism ----

TRANSFORMERS_VERSION = "5.17.0"  # the version the GPU machine has; tp_plan="auto" is that version's API
ACCELERATE_VERSION = "1.15.0"  # likewise; transformers' tp_plan refuses to load without it


def make_tiny_llama(path, seed):
    """A Llama of random weights (seeded), saved under `path`: 2 layers, heads divisible by worlds 2 and 4."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def _greedy(model, prompt, new_tokens):
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        return tokens, model(tokens).logits


def tp_decode(store, rank, world, device_type, path, new_tokens):
    """transformers' tp_plan="auto" on a "rocenante" group: a greedy decode under torch.profiler, and the same
    model in this process alone (no tensor parallelism). Returns the tokens of both, the largest difference of
    their logits over the decoded sequence, the reference's smallest top-2 margin, and the profiler's count of
    collective events by name."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    import rocenante  # noqa: F401

    device = torch.device("cpu")
    if device_type == "cuda":
        from gpus import use

        device = use(rank)
    # What torchrun sets, which transformers reads: without WORLD_SIZE it loads the model whole on every rank
    # (no collective at all); it places the shards on cuda:LOCAL_RANK (ranks sharing a GPU: that GPU's index).
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(device.index or 0))
    dist.init_process_group("rocenante", store=store, rank=rank, world_size=world)
    mesh = init_device_mesh(device_type, (world,))
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", device_mesh=mesh, dtype=torch.float32)
    prompt = torch.tensor([[1, 17, 42, 99, 7, 128]], device=device)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        tokens, logits = _greedy(model, prompt, new_tokens)
    counts = {}
    for event in prof.events():
        if event.name.startswith(("rocenante:", "gloo:", "nccl:")):
            key = event.name.split(" ")[0]
            counts[key] = counts.get(key, 0) + 1
    dist.destroy_process_group()
    alone = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    ref_tokens, _ = _greedy(alone, prompt, new_tokens)
    with torch.no_grad():
        ref_logits = alone(tokens).logits  # the reference's logits on the sequence tensor parallelism decoded
    top2 = ref_logits[0].topk(2, dim=-1).values
    return {"tokens": tokens.tolist(), "ref_tokens": ref_tokens.tolist(),
            "logit_diff": (logits - ref_logits).abs().max().item(), "logit_scale": ref_logits.abs().max().item(),
            "min_margin": (top2[:, 0] - top2[:, 1]).min().item(), "events": counts}


def check_tp_decode(device_type, world, tmp_path):
    """tp_decode() on `world` ranks against the single-process model: the same greedy tokens (unless the reference
    itself has a near tie), logits within fp32 rounding, the all-reduces and all-gathers served by rocenante
    (profiler labels) and none by the delegate."""
    import pytest

    for module in ("transformers", "accelerate"):  # tp_plan needs accelerate
        pytest.importorskip(module, reason=f"needs transformers and accelerate (the tests target transformers "
                                           f"{TRANSFORMERS_VERSION} and accelerate {ACCELERATE_VERSION})")
    from multiproc import expect_ok, run_ranks

    path = str(tmp_path / "tiny-llama")
    make_tiny_llama(path, seed=int.from_bytes(os.urandom(4), "little"))
    results = expect_ok(run_ranks(world, tp_decode, device_type, path, 8, timeout=300, clean_exit=True))
    for rank, res in enumerate(results):
        assert res["tokens"] == results[0]["tokens"], f"rank {rank} decoded other tokens"
        if res["min_margin"] > 1e-3:
            assert res["tokens"] == res["ref_tokens"], f"rank {rank}: {res['tokens']} != {res['ref_tokens']}"
        assert res["logit_diff"] <= 1e-5 * (1 + res["logit_scale"]), f"rank {rank}: logits differ by {res['logit_diff']}"
        events = res["events"]
        assert events.get("rocenante:all_reduce", 0) > 0 and events.get("rocenante:all_gather", 0) > 0, events
        delegated = {k: n for k, n in events.items() if k.split(":")[1] in ("all_reduce", "allreduce", "all_gather",
                                                                            "_allgather_base", "allgather")
                     and not k.startswith("rocenante:")}
        assert not delegated, f"rank {rank}: the delegate served {delegated}"
    return results


def profiled_step(store, rank, world, device_type, trace_path):
    """A step of the collectives rocenante serves under torch.profiler: the label of each event, and whether
    each label is in the exported Chrome trace (what a user opens)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import rocenante  # noqa: F401

    device = torch.device("cpu")
    activities = [ProfilerActivity.CPU]
    if device_type == "cuda":
        from gpus import use

        device = use(rank)
        activities.append(ProfilerActivity.CUDA)
    dist.init_process_group("rocenante", store=store, rank=rank, world_size=world)
    x = torch.ones(1024, dtype=torch.bfloat16, device=device)
    dist.all_reduce(x)  # outside the trace: the first CPU all-reduce of a group that serves CUDA starts the CPU path
    with profile(activities=activities) as prof:
        dist.all_reduce(x)
        dist.all_gather_into_tensor(torch.empty(world * 1024, dtype=x.dtype, device=device), x)
        dist.reduce_scatter_tensor(torch.empty(1024 // world, dtype=x.dtype, device=device), x)
        _funcol().all_reduce(x, "sum", dist.group.WORLD).wait()
        if device_type == "cuda":
            torch.cuda.synchronize()
    prof.export_chrome_trace(f"{trace_path}.{rank}.json")
    with open(f"{trace_path}.{rank}.json") as f:
        trace = f.read()
    labels = [e.name for e in prof.events() if e.name.startswith("rocenante:")
              and e.device_type == torch.autograd.DeviceType.CPU]
    # On CUDA a label also spans its kernel on the GPU's timeline (a user annotation beside the CPU range).
    on_gpu = [e.name for e in prof.events() if e.name.startswith("rocenante:")
              and e.device_type == torch.autograd.DeviceType.CUDA]
    dist.destroy_process_group()
    return labels, on_gpu, {label: label in trace for label in labels}


def check_profiled_step(device_type, world, tmp_path):
    from multiproc import expect_ok, run_ranks

    step = ["rocenante:all_reduce 2048 B torch.bfloat16", "rocenante:all_gather 2048 B torch.bfloat16",
            "rocenante:reduce_scatter 2048 B torch.bfloat16", "rocenante:all_reduce 2048 B torch.bfloat16"]
    for labels, on_gpu, in_trace in expect_ok(run_ranks(world, profiled_step, device_type, str(tmp_path / "trace"))):
        assert labels == step, labels
        assert sorted(on_gpu) == (sorted(step) if device_type == "cuda" else []), on_gpu
        assert all(in_trace.values()), in_trace
