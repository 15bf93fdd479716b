"""The single-kernel all-reduce across the GPUs of one host (ROCENANTE_ALGO=auto: one-shot, and directly, at
worlds 3-8, two-shot from the modelled size; test_gpu_collectives forces two-shot), on both paths of a test that
takes `net`:
"" directly (CUDA IPC), "tcp" the network path over the loopback TCP software wire (the kernel stores into pinned
host memory, the proxy thread carries each call over TCP, the receiving side places segments in random order,
and the kernel reads a peer's data only after the peer's arrival word), held to one standard. Worlds 2 to 8 on
whatever GPUs there are (tests/support/gpus.py); the comparison with NCCL needs a GPU per rank."""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

import gpus
from multiproc import expect_ok, run_ranks
from nets import on_path
from reference import DTYPES, check_against_float64, digest, make_input, ops_for, poison, sequential_fp32

WORLD = 2
WORLDS = [2, 3, 4, 8]  # for the tests whose behaviour does not depend on the world size
CAPACITY = 1 << 20


def _comm(store, rank, world, **kw):
    import rocenante

    kw.setdefault("capacity_bytes", CAPACITY)
    kw.setdefault("timeout_s", 60)
    return rocenante.Communicator(store, rank, world, device=gpus.use(rank), **kw)


def _nccl(store, rank, world):
    import torch.distributed as dist

    dist.init_process_group("nccl", store=dist.PrefixStore("nccl", store), rank=rank, world_size=world,
                            device_id=gpus.device_of(rank))


def _every_dtype_op_size(store, rank, world, seed, net, nccl):
    """Every dtype and op at sizes around and beyond a piece, outputs poisoned first, inputs aligned or one element
    in, in place or not: exact against the rank-order fp32 result, within rounding of float64, and (`nccl`) close
    to NCCL's all-reduce of the same inputs; returns the results' digests (for comparing ranks). Where ranks
    share a GPU, each dtype and op takes a subset of the sizes, in turn, so that each dtype still meets sizes
    within, at and beyond a piece."""
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # every rank computes the host references
    comm = _comm(store, rank, world)
    on_path(comm, net)
    if nccl:
        _nccl(store, rank, world)
    dev = gpus.device_of(rank)
    digests, case, combination = [], 0, 0
    for dtype in DTYPES:
        esize = torch.empty((), dtype=dtype).element_size()
        # One piece holds CAPACITY bytes of float payload, half of that for int32 (csrc/layout.h); larger calls
        # go as several pieces.
        limit = (CAPACITY // 2 if dtype == torch.int32 else CAPACITY) // esize
        rng = random.Random(seed + case)
        for op in ops_for(dtype):
            sizes = [1, 3, 8, 9, 4097, limit - 1, limit, limit + 1, 2 * limit + 5] + [rng.randint(1, 3 * limit)]
            kept = gpus.calls(len(sizes), world, on_shared=len(sizes), least=3)
            chosen = {(combination * kept + j) % len(sizes) for j in range(kept)}
            combination += 1
            for i, numel in enumerate(sizes):
                case += 1
                if i not in chosen:
                    continue
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
                if nccl and op != "avg":  # NCCL agrees within the dtype's rounding (its reduction order may differ)
                    ref = inputs[rank].to(dev)
                    dist.all_reduce(ref, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                                             "min": dist.ReduceOp.MIN}[op])
                    check_against_float64(ref, inputs, op)
                    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.int32: 0}[dtype]
                    assert torch.allclose(got.double(), ref.double(), rtol=tol, atol=tol * 8)
                digests.append(digest(got))
    if nccl:
        dist.destroy_process_group()
    comm.close()
    return digests


@pytest.mark.parametrize("world", WORLDS)
def test_every_dtype_op_and_size_matches_the_references(net, world):
    results = expect_ok(run_ranks(world, _every_dtype_op_size, 31, net, False, timeout=300))
    assert all(r == results[0] for r in results[1:]), "ranks produced different bits"


@pytest.mark.parametrize("net", ["tcp"], indirect=True)
def test_the_completion_signal_matches_the_references(net, monkeypatch):
    # ROCENANTE_IB_SIGNAL=completion: the receiving proxy stores the mailbox's arrival word (layout.h, Mailbox).
    monkeypatch.setenv("ROCENANTE_IB_SIGNAL", "completion")
    results = expect_ok(run_ranks(WORLD, _every_dtype_op_size, 32, net, False, timeout=300))
    assert results[0] == results[1], "ranks produced different bits"


@pytest.mark.parametrize("net", ["tcp"], indirect=True)
def test_a_flag_placed_before_its_data_is_caught(net, monkeypatch):
    # The mutation check of the flag signal (Signal::kFlagFirst, transport.h): the TCP wire stores each flag
    # before its delivery's data, and the kernel, trusting the flag, must meet torn words: a wrong result or a
    # call word that matches nothing, never a pass.
    monkeypatch.setenv("ROCENANTE_TEST_FLAG_FIRST", "1")
    results = run_ranks(WORLD, _every_dtype_op_size, 33, net, False, timeout=300)
    caught = [r for r in results if isinstance(r, tuple) and r[:2] in (("error", "AssertionError"),
                                                                        ("error", "CallMismatchError"))]
    assert caught, f"a flag placed before its data went unnoticed: {[r[:3] if isinstance(r, tuple) else r for r in results]}"


@pytest.mark.separate_gpus
def test_every_dtype_op_and_size_matches_nccl(net):
    results = expect_ok(run_ranks(WORLD, _every_dtype_op_size, 31, net, True, timeout=300))
    assert results[0] == results[1], "ranks produced different bits"


def _varying_sizes_back_to_back(store, rank, world, calls):
    comm = _comm(store, rank, world)
    dev = gpus.device_of(rank)
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


@pytest.mark.parametrize("world", WORLDS)
def test_calls_of_varying_size_back_to_back(net, world):
    calls = gpus.calls(2000, world, on_shared=400, least=65)  # checked 64 at a time, then the rest
    assert expect_ok(run_ranks(world, _varying_sizes_back_to_back, calls, timeout=300)) == [calls] * world


def _graph_replays(store, rank, world, replays):
    comm = _comm(store, rank, world)
    dev = gpus.device_of(rank)
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


@pytest.mark.parametrize("world", WORLDS)
def test_graph_replays_with_new_inputs(net, world):
    replays = gpus.calls(1000, world, on_shared=100, least=10)
    assert expect_ok(run_ranks(world, _graph_replays, replays, timeout=300)) == [replays] * world


def _killed_peer(store, rank, world):
    import rocenante

    comm = _comm(store, rank, world, timeout_s=60.0)
    x = torch.randn(10000, device=gpus.device_of(rank))
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
        assert torch.ones(1000, device=gpus.device_of(rank)).sum().item() == 1000
        return str(err), elapsed
    raise AssertionError("all_reduce completed without the killed peer")


def test_killed_peer_raises_at_once_naming_it():
    message, elapsed = run_ranks(WORLD, _killed_peer, timeout=120)[0]
    assert "rank 1's process ended" in message, message
    assert elapsed < 2.0, f"{elapsed:.2f} s with a 60 s timeout: the watchdog should have told the kernel"


def _mismatch(store, rank, world):
    import rocenante

    comm = _comm(store, rank, world, timeout_s=10)
    comm.all_reduce(torch.randn(1000 + 8 * (rank == 1), device=gpus.device_of(rank)))  # rank 1 alone differs
    try:
        comm.synchronize()
    except rocenante.CallMismatchError as err:
        assert comm.closed
        comm.close()
        return str(err)
    raise AssertionError("a mismatched call succeeded")


def _names_a_peer(message: str, rank: int, pattern: str) -> bool:
    """Whether `pattern` (with a group for a rank) matches the message, naming another rank than `rank`."""
    found = re.search(pattern, message)
    return found is not None and int(found.group(1)) != rank


@pytest.mark.parametrize("world", WORLDS)
def test_mismatched_sizes_fail_on_every_rank(net, world):
    results = expect_ok(run_ranks(world, _mismatch, timeout=120))
    for rank, message in enumerate(results):
        if rank == 1:  # every other rank made the 1000-element call
            named = _names_a_peer(message, rank, r"rank (\d+) called all_reduce with 1000 x float32")
        else:
            named = "rank 1 called all_reduce with 1008 x float32" in message
        # Over the network a rank may hear of the mismatch from a peer's abort word before the odd call arrives:
        # it then names the mismatch as that peer saw it (tests/rdma/test_rdma.py says why).
        relayed = net and _names_a_peer(message, rank, r"rank (\d+) aborted the communicator: rank")
        assert named or relayed, f"rank {rank}: {message}"


def _shared_refusal(store, rank, world):
    comm = _comm(store, rank, world, capacity_bytes=4096)
    x = torch.ones(1025, device=gpus.device_of(rank), dtype=torch.int32)
    with pytest.raises(ValueError, match="op avg is not defined for int32"):
        comm.all_reduce(x, op="avg")  # refused in C++: the error crosses the binding as a Python exception
    assert not comm.closed
    y = comm.all_reduce(x)  # 4100 bytes: more than one piece of a 4096-byte capacity
    comm.synchronize()
    assert torch.equal(y, torch.full_like(y, world))
    comm.close()
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_refused_call_raises_and_leaves_the_communicator_usable(net, world):
    assert expect_ok(run_ranks(world, _shared_refusal, timeout=120)) == [True] * world


def _cupy_arrays(store, rank, world):
    import cupy

    comm = _comm(store, rank, world)
    with cupy.cuda.Device(gpus.device_of(rank).index):
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
    workload = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support",
                            "sanitizer_workload.py")
    proc = subprocess.run(
        [exe, "--tool", tool, "--target-processes", "all", "--error-exitcode", "3", sys.executable, workload],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ERROR SUMMARY: 0 errors" in proc.stdout, proc.stdout[-4000:]
