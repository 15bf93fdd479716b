"""Bad input on the GPU path (2 ranks on this machine's GPUs): NaN with max/min, CuPy arrays on another device
than the communicator's (a GPU per rank), a peer's CUDA IPC handle that maps too small an allocation, and
constructions that fail for want of device memory, which must leave nothing allocated behind."""

from __future__ import annotations

import ctypes
import re
import sys

import pytest
import torch

import gpus
from multiproc import expect_ok, record_figure, run_ranks
from probes import figures, gpu_probe, leaks, summary
from reference import digest, make_input, sequential_fp32

WORLD = 2


def _comm(store, rank, world, **kw):
    import rocenante

    kw.setdefault("capacity_bytes", 1 << 20)
    kw.setdefault("timeout_s", 60)
    return rocenante.Communicator(store, rank, world, device=gpus.use(rank), **kw)


def _nan_wins(store, rank, world, seed):
    """For each float dtype, max and min, each rank holding the NaNs in turn: NaN at ~10% of the positions (the
    first and last among them), where the other rank holds +inf for max and -inf for min (NaN must beat it);
    element 1 is NaN on every rank."""
    comm = _comm(store, rank, world)
    dev = gpus.device_of(rank)
    digests, case = [], 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for op in ("max", "min"):
            for holder in range(world):
                for numel in (3, 4099, 1 << 18):  # one CTA, a tail, many CTAs
                    case += 1
                    inputs = [make_input(seed, case, r, numel, dtype, dev) for r in range(world)]
                    g = torch.Generator(device=dev).manual_seed(seed * 1000 + case)
                    nan_at = torch.rand(numel, generator=g, device=dev) < 0.1
                    nan_at[0] = nan_at[-1] = True
                    for r in range(world):
                        if r == holder:
                            inputs[r][nan_at] = float("nan")
                        else:
                            inputs[r][nan_at] = float("inf") if op == "max" else float("-inf")
                        inputs[r][1] = float("nan")
                    nan_at[1] = True
                    out = torch.full_like(inputs[rank], 4096.0)  # no input is 4096: an unwritten element shows
                    comm.all_reduce(inputs[rank], op=op, out=out)
                    comm.synchronize()
                    where = f"{dtype} {op}, NaN on rank {holder}, {numel} elements"
                    assert torch.equal(torch.isnan(out), nan_at), f"{where}: NaN is not where a rank had one"
                    want = sequential_fp32(inputs, op)
                    assert torch.equal(out[~nan_at], want[~nan_at]), f"{where}: the other elements are not exact"
                    digests.append(digest(out))
    comm.close()
    return digests


def test_a_nan_on_any_rank_wins_max_and_min_on_every_rank():
    results = expect_ok(run_ranks(WORLD, _nan_wins, 13, timeout=300))
    assert results[0] == results[1], "the ranks' outputs differ (NaN bits included)"
    print(f"nan: {len(results[0])} max/min calls (float32, float16, bfloat16; NaN on rank 0, then rank 1, "
          "against +-inf, and on both): NaN exactly where a rank had one, the rest exact, identical bits on "
          "both ranks", file=sys.stderr)


def _cupy_on_another_device(store, rank, world, which):
    """Rank 1 passes an array that lives on the other GPU (`which`: the output, or the input); rank 0 makes
    the same call correctly. Rank 1's call must be refused before anything is written, and rank 0's must fail
    at once naming rank 1."""
    import cupy

    import rocenante

    comm = _comm(store, rank, world)
    mine, other = gpus.device_of(rank).index, gpus.device_of(1 - rank).index
    with cupy.cuda.Device(mine):
        x = cupy.ones(5000, dtype=cupy.float32)
        out = cupy.full(5000, 7.0, dtype=cupy.float32)
        good = comm.all_reduce(x)  # first a call that works
        cupy.cuda.get_current_stream().synchronize()
        assert (cupy.asnumpy(good) == world).all()
    if rank == 0:
        with cupy.cuda.Device(mine):
            try:
                comm.all_reduce(x, out=out)
                cupy.cuda.get_current_stream().synchronize()
                comm.synchronize()
            except rocenante.PeerAbortedError as err:
                return type(err).__name__, str(err)
        raise AssertionError("rank 0's call completed although rank 1 refused its side")
    with cupy.cuda.Device(other):
        elsewhere = cupy.full(5000, 7.0, dtype=cupy.float32)
    with cupy.cuda.Device(mine):
        try:
            if which == "out":
                comm.all_reduce(x, out=elsewhere)
            else:
                comm.all_reduce(elsewhere, out=out)
        except ValueError as err:
            untouched = bool((cupy.asnumpy(elsewhere) == 7.0).all() and (cupy.asnumpy(out) == 7.0).all())
            return type(err).__name__, str(err), untouched
    raise AssertionError(f"an {which} array on cuda:{other} was accepted by a communicator on cuda:{mine}")


@pytest.mark.separate_gpus  # rank 1 passes an array on rank 0's GPU
@pytest.mark.parametrize("which", ["out", "input"])
def test_cupy_array_on_another_device_is_refused(which):
    pytest.importorskip("cupy")
    (kind0, message0), (kind1, message1, untouched) = expect_ok(run_ranks(WORLD, _cupy_on_another_device, which,
                                                                           timeout=120))
    assert kind1 == "InvalidArgument", (kind1, message1)
    if which == "out":
        assert "an out that does not match the input" in message1 and "on cuda:0" in message1, message1
    else:
        assert "a tensor on cuda:0, this communicator is on cuda:1" in message1, message1
    assert untouched, "an array was written although the call was refused"
    assert kind0 == "PeerAbortedError" and "rank 1 refused a call" in message0, message0
    print(f"cupy {which} on another device: rank 1: {kind1}: {message1}", file=sys.stderr)


def _cudart():
    """The CUDA runtime this process has loaded (torch's, or the one rocenante links), through ctypes, for raw
    allocations whose IPC handles are handed to a communicator as a peer's."""
    with open("/proc/self/maps") as f:
        paths = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
    assert paths, "no CUDA runtime is loaded"
    rt = ctypes.CDLL(paths[0])
    rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    rt.cudaFree.argtypes = [ctypes.c_void_p]
    rt.cudaIpcGetMemHandle.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return rt


IPC_CAPACITY = 4 << 20  # a region holds several times the capacity (protocol v2, world 2: 3 x 4 MiB + 512 B)
SMALL_ALLOCATION = 1 << 20  # smaller than a region of that capacity (and than the 2 MiB the driver may round to)
LARGE_ALLOCATION = 64 << 20  # larger than one


def _small_peer_allocation(store, rank, world):
    """Rank 1 exports two raw allocations, one smaller and one larger than a region; rank 0 hands each to a
    communicator as rank 1's handle, behind rank 0's own configuration (the CUDA IPC handle is the last 64
    bytes of a handle, whatever the core puts in front of it)."""
    from rocenante import _C

    device = gpus.use(rank)
    torch.zeros(1, device=device)  # a context on this rank's device
    if rank == 1:
        rt = _cudart()
        assert rt.cudaSetDevice(device.index) == 0
        pointers = []
        for size in (SMALL_ALLOCATION, LARGE_ALLOCATION):
            ptr = ctypes.c_void_p()
            assert rt.cudaMalloc(ctypes.byref(ptr), size) == 0
            pointers.append(ptr)
            handle = (ctypes.c_char * 64)()
            assert rt.cudaIpcGetMemHandle(ctypes.addressof(handle), ptr) == 0
            store.set(f"allocation/{size}", bytes(handle))
        store.wait(["done"])  # rank 0 has closed every mapping
        for ptr in pointers:
            assert rt.cudaFree(ptr) == 0
        return None
    verdicts = {}
    for size in (SMALL_ALLOCATION, LARGE_ALLOCATION):
        comm = _C.Communicator(0, world, device.index, IPC_CAPACITY, 60.0, _C.OnFault.raise_)
        own = comm.local_handle()
        try:
            comm.connect([own, own[:-64] + store.get(f"allocation/{size}")])
            verdicts[size] = "accepted"
        except _C.RocenanteError as err:
            verdicts[size] = str(err)
        comm.close()
    store.set("done", "1")
    torch.cuda.synchronize()
    assert torch.ones(8, device=device).sum().item() == 8  # no CUDA error left behind for torch to trip on
    return verdicts


def test_a_peer_allocation_smaller_than_a_region_is_refused_naming_the_peer_and_sizes():
    verdicts = expect_ok(run_ranks(WORLD, _small_peer_allocation, timeout=120))[0]
    assert verdicts[LARGE_ALLOCATION] == "accepted", verdicts[LARGE_ALLOCATION]
    message = verdicts[SMALL_ALLOCATION]
    found = re.search(r"rank 1's CUDA IPC handle maps an allocation of (\d+) bytes, smaller than the (\d+) bytes",
                      message)
    assert found, message
    mapped, needed = int(found.group(1)), int(found.group(2))
    assert SMALL_ALLOCATION <= mapped < needed, message
    record_figure("gpu_small_ipc_allocation_mapped_bytes", mapped)
    record_figure("gpu_region_bytes_capacity_4MiB_world2", needed)
    print(f"ipc size check: a {SMALL_ALLOCATION} B allocation: {message}; a {LARGE_ALLOCATION} B one: accepted",
          file=sys.stderr)


FAILED_BUILDS = 20
FAILURE_CAPACITY = 32 << 20  # the largest: at world 8 a region of 21 times that (protocol v3: 672 MiB)
FAILURE_WORLD = 8
LEFT_FREE = 96 << 20  # device memory left free (up to 62 MiB more): enough for the kernel's state, not a region


def _builds_without_memory(store, rank, world, attempts):
    """Fills the GPU so that a communicator's kernel state fits but its region does not, then builds one
    `attempts` times: each must fail with out of memory, and together leave no fd, mapping or device memory."""
    from rocenante import _C

    dev = gpus.use(rank)
    _C.Communicator(0, FAILURE_WORLD, dev.index, FAILURE_CAPACITY, 60.0, _C.OnFault.raise_).close()  # what the first build loads
    before = gpu_probe(dev)
    hog = None
    for slack in range(0, 64 << 20, 2 << 20):  # the driver may keep a little of what it reports free
        try:
            hog = torch.empty(before["free_bytes"] - LEFT_FREE - slack, dtype=torch.uint8, device=dev)
            break
        except torch.OutOfMemoryError:
            continue
    assert hog is not None, "could not fill the GPU"
    messages = []
    for _ in range(attempts):
        try:
            _C.Communicator(0, FAILURE_WORLD, dev.index, FAILURE_CAPACITY, 60.0, _C.OnFault.raise_).close()
        except _C.RocenanteError as err:
            messages.append(str(err))
    del hog
    torch.cuda.empty_cache()
    after = gpu_probe(dev)
    # The failed cudaMalloc must not stay behind as the runtime's last error, which torch's next launch reads.
    assert torch.ones(8, device=dev).sum().item() == 8
    return before, after, messages


def test_builds_that_run_out_of_device_memory_leave_nothing_behind():
    before, after, messages = expect_ok(run_ranks(1, _builds_without_memory, FAILED_BUILDS, timeout=120))[0]
    print(f"failed builds: {len(messages)} of {FAILED_BUILDS} builds with {LEFT_FREE >> 20} MiB free failed, the "
          f"first with: {messages[:1]}; {summary(before, after)}", file=sys.stderr)
    for when, probe in (("before", before), ("after", after)):
        for k, v in figures(probe).items():
            record_figure(f"gpu_failed_builds_{FAILED_BUILDS}_{k}_{when}", v)
    assert len(messages) == FAILED_BUILDS, f"only {len(messages)} of {FAILED_BUILDS} builds failed"
    assert "cudaMalloc" in messages[0] and "out of memory" in messages[0], messages[0]
    found = leaks(before, after)
    assert not found, f"{FAILED_BUILDS} failed builds leaked: " + "; ".join(found)
