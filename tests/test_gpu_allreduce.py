"""The single-kernel one-shot all-reduce across the GPUs of one host (CUDA IPC), 2 ranks on 2 GPUs."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time

import pytest
import torch

from multiproc import expect_ok, run_ranks
from reference import DTYPES, check_against_float64, digest, make_input, ops_for, poison, sequential_fp32

pytestmark = pytest.mark.gpu
WORLD = 2
CAPACITY = 1 << 20


def _comm(store, rank, world, **kw):
    import rocenante

    torch.cuda.set_device(rank)
    kw.setdefault("capacity_bytes", CAPACITY)
    kw.setdefault("timeout_s", 60)
    return rocenante.Communicator(store, rank, world, device=f"cuda:{rank}", **kw)


def _nccl(store, rank, world):
    import torch.distributed as dist

    dist.init_process_group("nccl", store=dist.PrefixStore("nccl", store), rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))


def _every_dtype_op_size(store, rank, world, seed):
    import torch.distributed as dist

    comm = _comm(store, rank, world)
    _nccl(store, rank, world)
    dev = torch.device("cuda", rank)
    digests, case = [], 0
    for dtype in DTYPES:
        esize = torch.empty((), dtype=dtype).element_size()
        # One piece holds CAPACITY bytes of float payload, half of that for int32 (csrc/layout.h); larger calls
        # go as several pieces.
        limit = (CAPACITY // 2 if dtype == torch.int32 else CAPACITY) // esize
        rng = random.Random(seed + case)
        for op in ops_for(dtype):
            for numel in [1, 3, 8, 9, 4097, limit - 1, limit, limit + 1, 2 * limit + 5] + [rng.randint(1, 3 * limit)]:
                case += 1
                inputs = [make_input(seed, case, r, numel, dtype) for r in range(world)]
                offset = case % 3 == 0  # an input that is only element-aligned (a slice one element in)
                backing = torch.empty(numel + 1, dtype=dtype, device=dev)
                x = backing[1:] if offset else backing[:numel]
                x.copy_(inputs[rank])
                in_place = case % 4 == 0
                out = x if in_place else poison(torch.empty_like(x))
                got = comm.all_reduce(x, op=op, out=out)
                torch.cuda.synchronize()
                comm.synchronize()
                assert torch.equal(got.cpu(), sequential_fp32(inputs, op)), f"{dtype} {op} n={numel} offset={offset}"
                check_against_float64(got, inputs, op)
                if op != "avg":  # NCCL agrees within the dtype's rounding (its reduction order may differ)
                    ref = inputs[rank].to(dev)
                    dist.all_reduce(ref, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                                             "min": dist.ReduceOp.MIN}[op])
                    check_against_float64(ref, inputs, op)
                    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.int32: 0}[dtype]
                    assert torch.allclose(got.double(), ref.double(), rtol=tol, atol=tol * 8)
                digests.append(digest(got))
    dist.destroy_process_group()
    comm.close()
    return digests


def test_every_dtype_op_and_size_matches_reference_and_nccl():
    results = expect_ok(run_ranks(WORLD, _every_dtype_op_size, 31, timeout=600))
    assert results[0] == results[1], "ranks produced different bits"


def _varying_sizes_back_to_back(store, rank, world, calls):
    comm = _comm(store, rank, world)
    dev = torch.device("cuda", rank)
    rng = random.Random(5)
    outs, wants = [], []
    for i in range(calls):  # sizes jump between one CTA and many, so launch shapes change every call
        numel = rng.choice([rng.randint(1, 300), rng.randint(1, CAPACITY // 4)])
        gens = [torch.Generator(device=dev).manual_seed(i * 16 + r) for r in range(world)]
        xs = [torch.randint(-(2**20), 2**20, (numel,), dtype=torch.int32, device=dev, generator=g) for g in gens]
        outs.append(comm.all_reduce(xs[rank]))
        wants.append(sum(xs))
        if len(outs) == 64 or i == calls - 1:
            for j, (o, w) in enumerate(zip(outs, wants)):
                if not torch.equal(o, w):
                    raise AssertionError(f"call {i - len(outs) + 1 + j} gave a wrong sum")
            outs, wants = [], []
    comm.synchronize()
    comm.close()
    return calls


def test_two_thousand_calls_of_varying_size():
    assert expect_ok(run_ranks(WORLD, _varying_sizes_back_to_back, 2000, timeout=600)) == [2000, 2000]


def _graph_replays(store, rank, world, replays):
    comm = _comm(store, rank, world)
    dev = torch.device("cuda", rank)
    sizes = [4099, 1, 65536]  # three all-reduces in one graph: bf16, odd tail, one and many CTAs
    xs = [torch.empty(n, dtype=torch.bfloat16, device=dev) for n in sizes]
    ys = [torch.empty_like(x) for x in xs]
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):  # warm up off the capture
        for x, y in zip(xs, ys):
            x.normal_()
            comm.all_reduce(x, out=y)
    torch.cuda.current_stream(dev).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, y in zip(xs, ys):
            comm.all_reduce(x, out=y)
    for i in range(replays):
        inputs = [[make_input(i, k, r, n, torch.bfloat16, dev) for r in range(world)] for k, n in enumerate(sizes)]
        for x, y, per_rank in zip(xs, ys, inputs):
            x.copy_(per_rank[rank])
            poison(y)
        graph.replay()
        torch.cuda.synchronize()
        for y, per_rank in zip(ys, inputs):
            if not torch.equal(y, sequential_fp32(per_rank, "sum")):
                raise AssertionError(f"replay {i} gave a wrong result")
    comm.synchronize()
    comm.close()
    return replays


def test_thousand_graph_replays_with_new_inputs():
    assert expect_ok(run_ranks(WORLD, _graph_replays, 1000, timeout=600)) == [1000, 1000]


def _killed_peer(store, rank, world):
    import rocenante

    comm = _comm(store, rank, world, timeout_s=60.0)
    x = torch.randn(10000, device=f"cuda:{rank}")
    comm.all_reduce(x)
    comm.synchronize()
    if rank == 1:
        os._exit(0)  # dies without a word, as a killed process does
    time.sleep(1.0)
    start = time.monotonic()
    comm.all_reduce(x)
    try:
        comm.synchronize()
    except rocenante.PeerAbortedError as err:
        elapsed = time.monotonic() - start
        assert comm.closed
        comm.close()
        # The GPU is still usable: no sticky error, no reset.
        assert torch.ones(1000, device=f"cuda:{rank}").sum().item() == 1000
        return str(err), elapsed
    raise AssertionError("all_reduce completed without the killed peer")


def test_killed_peer_raises_at_once_naming_it():
    message, elapsed = run_ranks(WORLD, _killed_peer, timeout=120)[0]
    assert "rank 1's process ended" in message, message
    assert elapsed < 2.0, f"{elapsed:.2f} s with a 60 s timeout: the watchdog should have told the kernel"


def _mismatch(store, rank, world):
    import rocenante

    comm = _comm(store, rank, world, timeout_s=10)
    comm.all_reduce(torch.randn(1000 + 8 * rank, device=f"cuda:{rank}"))
    try:
        comm.synchronize()
    except rocenante.CallMismatchError as err:
        assert comm.closed
        comm.close()
        return str(err)
    raise AssertionError("a mismatched call succeeded")


def test_mismatched_sizes_fail_on_both_ranks():
    results = expect_ok(run_ranks(WORLD, _mismatch, timeout=120))
    assert "rank 1 called all_reduce with 1008 x float32" in results[0], results[0]
    assert "rank 0 called all_reduce with 1000 x float32" in results[1], results[1]


def _shared_refusal(store, rank, world):
    comm = _comm(store, rank, world, capacity_bytes=4096)
    x = torch.ones(1025, device=f"cuda:{rank}", dtype=torch.int32)
    with pytest.raises(ValueError, match="op avg is not defined for int32"):
        comm.all_reduce(x, op="avg")  # refused in C++: the error crosses the binding as a Python exception
    assert not comm.closed
    y = comm.all_reduce(x)  # 4100 bytes: more than one piece of a 4096-byte capacity
    comm.synchronize()
    assert torch.equal(y, torch.full_like(y, world))
    comm.close()
    return True


def test_refused_call_raises_and_leaves_the_communicator_usable():
    assert expect_ok(run_ranks(WORLD, _shared_refusal, timeout=120)) == [True, True]


def _cupy_arrays(store, rank, world):
    import cupy

    comm = _comm(store, rank, world)
    with cupy.cuda.Device(rank):
        inputs = [make_input(3, 0, r, 5000, torch.float32) for r in range(world)]
        x = cupy.asarray(inputs[rank].numpy())
        out = cupy.full_like(x, cupy.nan)
        got = comm.all_reduce(x, out=out)
        cupy.cuda.get_current_stream().synchronize()
        assert got is out
        assert torch.equal(torch.from_numpy(cupy.asnumpy(out)), sequential_fp32(inputs, "sum"))
        fresh = comm.all_reduce(x, op="max")
        assert isinstance(fresh, cupy.ndarray)
        assert torch.equal(torch.from_numpy(cupy.asnumpy(fresh)), sequential_fp32(inputs, "max"))
    comm.close()
    return True


def test_cupy_arrays():
    pytest.importorskip("cupy")
    assert expect_ok(run_ranks(WORLD, _cupy_arrays, timeout=120)) == [True, True]


# The kernel uses no shared memory, so racecheck would check nothing: memcheck (bad accesses), initcheck
# (reads of memory nothing wrote) and synccheck (barriers) do.
@pytest.mark.parametrize("tool", ["memcheck", "initcheck", "synccheck"])
def test_compute_sanitizer_is_clean(tool):
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        pytest.skip("compute-sanitizer is not on PATH (benchmarks/gpu_machine.sh fails instead)")
    workload = os.path.join(os.path.dirname(__file__), "sanitizer_workload.py")
    proc = subprocess.run(
        [exe, "--tool", tool, "--target-processes", "all", "--error-exitcode", "3", sys.executable, workload],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ERROR SUMMARY: 0 errors" in proc.stdout, proc.stdout[-4000:]
