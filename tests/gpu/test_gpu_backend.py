"""The "rocenante" torch.distributed backend, 2 ranks on this machine's GPUs: CUDA all-reduce through the kernel,
its delegate for the rest (NCCL; gloo where the ranks share a GPU, which NCCL refuses), CUDA graphs,
torch.compile, DDP against the delegate's backend, and the collective fallback."""

from __future__ import annotations

import os

import torch

import gpus
from ddp import train
from multiproc import expect_ok, run_ranks
from reference import bits, make_input, poison, random_bits, reduced, sequential_fp32

WORLD = 2


def _delegate() -> str:
    """The backend the rocenante backend delegates CUDA collectives to here (rocenante/backend.py)."""
    return "gloo" if gpus.shared(WORLD) else "nccl"


def _init(store, rank, world, backend="rocenante", env=None, **kw):
    import torch.distributed as dist

    os.environ.update(env or {})
    import rocenante  # noqa: F401

    gpus.use(rank)
    dist.init_process_group(backend, store=dist.PrefixStore(backend, store), rank=rank, world_size=world, **kw)
    return dist.group.WORLD


def _cuda_paths(store, rank, world, delegate):
    import torch.distributed as dist

    import rocenante

    pg = _init(store, rank, world, device_id=gpus.device_of(rank))  # the other tests init without device_id
    assert dist.get_backend() == "rocenante"
    st = rocenante.status()
    assert st["cuda"]["active"] and "first CPU all-reduce starts it" in st["cpu"]["reason"], st  # started when used
    assert st["cuda"]["fallback"] == delegate, st
    dev = gpus.device_of(rank)
    calls = []
    comm = pg._comms["cuda"]
    original = comm._launch
    comm._launch = lambda *a, **k: (calls.append(1), original(*a, **k))[1]

    inputs = [make_input(8, 0, r, 5000, torch.bfloat16) for r in range(world)]
    x = inputs[rank].to(dev)
    dist.all_reduce(x)
    assert len(calls) == 1 and torch.equal(x.cpu(), sequential_fp32(inputs, "sum"))
    big = torch.ones(st["cuda"]["threshold_bytes"] // 4 + 1, device=dev)
    dist.all_reduce(big)  # over the threshold: the delegate
    assert len(calls) == 1 and torch.equal(big, torch.full_like(big, float(world)))

    # async_op: wait() on another stream orders that stream after the all-reduce.
    z = torch.full((1 << 18,), float(rank + 1), device=dev)
    work = dist.all_reduce(z, async_op=True)
    other = torch.cuda.Stream(dev)
    with torch.cuda.stream(other):
        work.wait()
        doubled = z * 2
    torch.cuda.synchronize()
    want = 2.0 * world * (world + 1) / 2
    assert torch.equal(doubled, torch.full_like(z, want)), (
        f"async: doubled holds {doubled.unique().tolist()[:8]}, z {z.unique().tolist()[:8]}, want {want}; "
        f"{z.numel() * 4} bytes, threshold {st['cuda']['threshold_bytes']}, kernel calls {len(calls)}")

    # The same for the Work's future, read on another stream (the call was made on the default stream, handle 0).
    z = torch.full((1 << 18,), float(rank + 1), device=dev)
    future = dist.all_reduce(z, async_op=True).get_future()
    with torch.cuda.stream(other):
        doubled = future.wait()[0] * 2
    torch.cuda.synchronize()
    assert torch.equal(doubled, torch.full_like(z, want)), f"future: doubled holds {doubled.unique().tolist()[:8]}"

    # CUDA graph capture of dist.all_reduce, replayed with new inputs.
    g_in = torch.empty(4099, dtype=torch.bfloat16, device=dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        dist.all_reduce(g_in)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(g_in)
    for i in range(100):
        per_rank = [make_input(i, 1, r, 4099, torch.bfloat16) for r in range(world)]
        g_in.copy_(per_rank[rank])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(g_in.cpu(), sequential_fp32(per_rank, "sum")), f"replay {i}"

    # torch.compile, fullgraph: dist.all_reduce and the custom op.
    @torch.compile(fullgraph=True)
    def step(a):
        dist.all_reduce(a)
        return torch.ops.rocenante.all_reduce(a * 2, "max", dist.group.WORLD.group_name)

    got = step(torch.full((64,), float(rank + 1), device=dev))
    assert torch.equal(got, torch.full((64,), 2.0 * world * (world + 1) / 2, device=dev))

    # barrier() returns after the work queued on this rank's current stream, as NCCL's does: a copy queued behind
    # about 0.1 s of GPU sleep has landed in pinned memory when it returns (gloo's barrier alone takes milliseconds).
    landed = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    torch.cuda._sleep(200_000_000)
    landed.copy_(torch.ones(1, dtype=torch.int32, device=dev), non_blocking=True)
    dist.barrier()
    assert landed.item() == 1, "barrier() returned before the work queued on this rank's current stream completed"
    dist.destroy_process_group()
    return True


def test_cuda_all_reduce_graphs_and_compile_through_the_backend():
    assert expect_ok(run_ranks(WORLD, _cuda_paths, _delegate(), timeout=300)) == [True, True]


def _ddp_both(store, rank, world, reference):
    return train(store, rank, world, "rocenante", "cuda"), train(store, rank, world, reference, "cuda")


def test_ddp_matches_the_delegates_backend_bitwise():
    # 2 ranks: both backends add the same two fp32 gradients once (a + b == b + a): bitwise equal parameters.
    # Against NCCL; on a shared GPU against gloo (NCCL refuses two ranks on one device).
    for ours, theirs in expect_ok(run_ranks(WORLD, _ddp_both, _delegate(), timeout=300)):
        assert ours == theirs


def _injected(store, rank, world):
    import torch.distributed as dist

    import rocenante

    _init(store, rank, world, env={"ROCENANTE_TIMEOUT_S": "never"} if rank == 1 else None)
    st = rocenante.status()["cuda"]
    x = torch.full((1000,), float(rank + 1), device=gpus.device_of(rank))
    dist.all_reduce(x)
    assert torch.equal(x, torch.full_like(x, 3.0))
    dist.destroy_process_group()
    return st


def test_fallback_injected_on_one_rank_moves_every_rank_to_the_delegate():
    for st in expect_ok(run_ranks(WORLD, _injected, timeout=300)):
        assert not st["active"] and st["fallback"] == _delegate(), st
        assert "rank 1: ValueError: ROCENANTE_TIMEOUT_S='never'" in st["reason"], st


def _gathers_and_scatters(store, rank, world):
    """all_gather_into_tensor, reduce_scatter_tensor and a list all_gather of CUDA tensors through the kernel (one
    launch each), bit for bit; one in a CUDA graph replayed with new inputs."""
    import torch.distributed as dist

    pg = _init(store, rank, world)
    dev = gpus.device_of(rank)
    x = torch.ones(1, device=dev)
    dist.all_reduce(x)  # starts the CUDA path
    calls = []
    comm = pg._comms["cuda"]
    original = comm._launch
    comm._launch = lambda *a, **k: (calls.append(a[-1] if len(a) > 4 else k.get("collective")), original(*a, **k))[1]
    n = 4099
    shards = [random_bits(9, 0, r, n, torch.bfloat16) for r in range(world)]
    out = poison(torch.empty(world * n, dtype=torch.bfloat16, device=dev))
    dist.all_gather_into_tensor(out, shards[rank].to(dev))
    assert torch.equal(bits(out.cpu()), bits(torch.cat(shards))), "all_gather_into_tensor"
    parts = [poison(torch.empty(n, dtype=torch.bfloat16, device=dev)) for _ in range(world)]
    dist.all_gather(parts, shards[rank].to(dev))
    assert all(torch.equal(bits(p.cpu()), bits(s)) for p, s in zip(parts, shards)), "all_gather"
    inputs = [make_input(9, 1, r, world * n, torch.float16) for r in range(world)]
    mine = poison(torch.empty(n, dtype=torch.float16, device=dev))
    dist.reduce_scatter_tensor(mine, inputs[rank].to(dev), op=dist.ReduceOp.MAX)
    assert torch.equal(bits(mine.cpu()), bits(reduced(inputs, "max")[rank * n:(rank + 1) * n])), "reduce_scatter"
    assert calls == ["all_gather", "all_gather", "reduce_scatter"], calls

    x = torch.empty(world * n, dtype=torch.float16, device=dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up off the capture
        dist.reduce_scatter_tensor(mine, x)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.reduce_scatter_tensor(mine, x)
    for i in range(3):
        inputs = [make_input(10 + i, 0, r, world * n, torch.float16) for r in range(world)]
        x.copy_(inputs[rank])
        poison(mine)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(mine.cpu()), bits(reduced(inputs, "sum")[rank * n:(rank + 1) * n])), f"replay {i}"
    dist.destroy_process_group()
    return len(calls)


def test_cuda_all_gather_and_reduce_scatter_through_the_backend():
    assert expect_ok(run_ranks(WORLD, _gathers_and_scatters, timeout=300)) == [5, 5]
