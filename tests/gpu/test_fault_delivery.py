"""No stale delivery and no half-issued call after a fault, on one GPU. Two ranks are two threads of this process,
each with its own communicator on cuda:0 and its own stream, over the TCP wire (the network path, where a
rank's image of its peers' regions is never reset): what a peer receives under a call's signal must be that
call's data, or nothing, and a rank that numbered a call it could not launch must fault, not pair its next call
with the peers' call of that number."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

import rocenante
from reference import make_input, poison, sequential_fp32

WORLD = 2


def _pair(timeout_s: float, capacity_bytes: int = 1 << 20):
    """Two communicators on cuda:0, rank 0 and rank 1, over the TCP wire, built side by side."""
    store = dist.HashStore()
    comms, errors = [None] * WORLD, []

    def build(rank):
        try:
            torch.cuda.set_device(0)
            comms[rank] = rocenante.Communicator(store, rank, WORLD, device="cuda:0", net="tcp",
                                                 timeout_s=timeout_s, capacity_bytes=capacity_bytes)
        except Exception as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return comms


def _run_ranks(body, *args):
    """body(rank, *args) on one thread per rank; returns their results, raising the first error."""
    results, errors = [None] * WORLD, []

    def run(rank):
        try:
            torch.cuda.set_device(0)
            with torch.cuda.stream(torch.cuda.Stream()):
                results[rank] = body(rank, *args)
        except BaseException as err:  # noqa: B036 - reported to the test
            errors.append((rank, err))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        rank, err = errors[0]
        raise AssertionError(f"rank {rank}: {type(err).__name__}: {err}") from err
    return results


def _inputs(calls, numel):
    """Every rank's input of each call {call: dtype}, ready before any rank's stream reads them."""
    inputs = {c: [make_input(7, c, r, numel, d, "cuda:0") for r in range(WORLD)] for c, d in calls.items()}
    torch.cuda.synchronize()
    return inputs


def _outcome(comm, x, op):
    """Issues one call and synchronizes: ("ok", out) or (error class name, message, out)."""
    out = poison(torch.empty_like(x))
    try:
        comm.all_reduce(x, op=op, out=out)
        comm.synchronize()
    except Exception as err:
        torch.cuda.current_stream().synchronize()
        return type(err).__name__, str(err), out
    return "ok", "", out


def _assert_all_poisoned(out, what):
    assert torch.isnan(out.float()).all(), f"{what}: {int((~torch.isnan(out.float())).sum())} elements written"


@pytest.mark.parametrize("call4", ["colliding", "alike"])
def test_late_peer_never_receives_a_faulted_ranks_old_call(call4):
    """Rank 1 is 2.5 s late for call 3 with a 1 s timeout: rank 0's call 3 times out, and its call 4, enqueued
    behind it, finds the communicator faulted and sends nothing. Rank 0's image of buffer 1 still holds call 1.
    "colliding": call 4 is float16 avg where call 1 was float32 sum of the same count, so call 1's call word
    equals call 4's (make_flag: (1 ^ 4) << 1 flips exactly the dtype's and the op's low bits); "alike": call 4
    repeats call 1's signature, so call 1's call word names another call. Rank 1's call 4 must fail naming the
    root cause (rank 0's wait for rank 1 timed out), every element poisoned: never stale data (colliding: it
    returned [1.0, 1.9375, ...] where 3.0 was due, with no error), never a mismatch rank 0 did not make."""
    numel = 4096
    comms = _pair(timeout_s=1.0)
    calls = {1: (torch.float32, "sum"), 2: (torch.float32, "sum"), 3: (torch.float32, "sum"),
             4: (torch.float16, "avg") if call4 == "colliding" else (torch.float32, "sum")}
    inputs = _inputs({c: d for c, (d, _) in calls.items()}, numel)

    def body(rank):
        comm = comms[rank]
        for c in (1, 2):
            got = _outcome(comm, inputs[c][rank], calls[c][1])
            assert got[0] == "ok" and torch.equal(got[2], sequential_fp32(inputs[c], calls[c][1])), got[:2]
        if rank == 0:  # calls 3 and 4 back to back: call 4's kernel starts after call 3 faulted
            out3 = poison(torch.empty_like(inputs[3][0]))
            comm.all_reduce(inputs[3][0], out=out3)
            out4 = poison(torch.empty_like(inputs[4][0]))
            comm.all_reduce(inputs[4][0], op=calls[4][1], out=out4)
            with pytest.raises(rocenante.PeerTimeoutError, match="timed out after 1 s waiting for rank"):
                comm.synchronize()
            _assert_all_poisoned(out4, "rank 0, call 4")
            return None
        time.sleep(2.5)
        third = _outcome(comm, inputs[3][1], "sum")
        fourth = _outcome(comm, inputs[4][1], calls[4][1])
        return third, fourth

    try:
        _, (third, fourth) = _run_ranks(body)
    finally:
        for comm in comms:
            comm.close()
    # Call 3: rank 0's data of call 3 went out before it timed out, so rank 1 may complete it, rightly.
    if third[0] == "ok":
        assert torch.equal(third[2], sequential_fp32(inputs[3], "sum")), "rank 1, call 3: a wrong sum"
    kind, message, out = fourth
    assert kind == "PeerTimeoutError", f"rank 1, call 4 ({call4}): {kind} {message}"
    assert "rank 0 aborted the communicator: a wait for rank(s) 1 timed out" in message, message
    _assert_all_poisoned(out, f"rank 1, call 4 ({call4})")


_HOG = r"""
extern "C" __global__ void hog(unsigned long long control) {
  // control[0]: the release level (CTA 0 leaves at 1, the others at 2); control[1 + b]: CTA b is resident.
  volatile int* words = reinterpret_cast<volatile int*>(control);
  if (threadIdx.x == 0) words[1 + blockIdx.x] = 1;
  const int level = blockIdx.x == 0 ? 1 : 2;
  while (words[0] < level) __nanosleep(2000);
}
"""


def test_launch_whose_ctas_diverge_delivers_nothing():
    """Rank 0's call 4 (16 CTAs) starts while a hog kernel fills every multiprocessor but one slot: its first
    CTAs send (call word included) and time out waiting for rank 1; the hog then leaves, and the late CTAs find
    the communicator faulted and send nothing. Their chunks in rank 0's image still hold call 1's data (same
    buffer, same signature): a delivery of call 4 would hand rank 1 call 1's data as call 4's. Rank 1's call 4
    must fail naming the root cause, every element poisoned."""
    cupy = pytest.importorskip("cupy")
    numel = 16 * 256 * 4  # fp32: 16 CTAs of 256 threads, one 16-byte chunk each
    comms = _pair(timeout_s=0.5)
    inputs = _inputs({c: torch.float32 for c in (1, 2, 3, 4)}, numel)
    hogs = 2 * torch.cuda.get_device_properties(0).multi_processor_count  # 1024 threads each: every SM full
    control = torch.zeros(1 + hogs, dtype=torch.int32).pin_memory()  # mapped: the GPU reads and writes it in place
    hog = cupy.RawKernel(_HOG, "hog")
    released = threading.Event()

    def body(rank):
        comm = comms[rank]
        for c in (1, 2, 3):
            got = _outcome(comm, inputs[c][rank], "sum")
            assert got[0] == "ok" and torch.equal(got[2], sequential_fp32(inputs[c], "sum")), got[:2]
        if rank == 1:
            released.wait(60)
            return _outcome(comm, inputs[4][1], "sum")
        try:
            out = poison(torch.empty_like(inputs[4][0]))
            torch.cuda.current_stream().synchronize()
            with cupy.cuda.Stream(non_blocking=True):
                hog((hogs,), (1024,), (control.data_ptr(),))
            deadline = time.monotonic() + 20
            while int(control[1:].sum()) < hogs:
                assert time.monotonic() < deadline, f"only {int(control[1:].sum())} of {hogs} hog CTAs resident"
                time.sleep(0.001)
            comm.all_reduce(inputs[4][0], out=out)
            time.sleep(0.05)
            control[0] = 1  # one multiprocessor's worth of threads for call 4's first CTAs
            deadline = time.monotonic() + 20
            while not comm.closed:  # the first CTAs timed out (the watchdog read their fault record)
                assert time.monotonic() < deadline, "call 4's first CTAs never timed out"
                time.sleep(0.01)
            control[0] = 2  # the late CTAs start, find the fault, send nothing
            with pytest.raises(rocenante.PeerTimeoutError):
                comm.synchronize()
            _assert_all_poisoned(out, "rank 0, call 4")
        finally:
            control[0] = 2
            released.set()
        return None

    try:
        _, fourth = _run_ranks(body)
    finally:
        for comm in comms:
            comm.close()
    kind, message, out = fourth
    assert kind == "PeerTimeoutError", f"rank 1, call 4: {kind} {message}"
    assert "rank 0 aborted the communicator: a wait for rank(s) 1 timed out" in message, message
    _assert_all_poisoned(out, "rank 1, call 4")


def test_call_that_fails_to_launch_faults_the_communicator():
    """Rank 0's call 2 cannot be launched after it was numbered: it goes to the legacy default stream while a
    blocking stream of this process captures a graph (CUDA refuses the implicit dependency), while rank 1 makes
    calls 2 and 3 as usual. Rank 0 must fault and tell rank 1: else rank 0's next call goes out as call 2, and
    rank 1 sums it with its own call 2 (same signature), silently."""
    cupy = pytest.importorskip("cupy")
    numel = 5000
    comms = _pair(timeout_s=20.0)
    inputs = _inputs({c: torch.float32 for c in (1, 2, 3)}, numel)

    def on_legacy_stream(comm, call, blocking=None):
        """Call `call` on the legacy default stream (handle 0), inside a capture of `blocking` if given."""
        out = poison(torch.empty_like(inputs[call][0]))
        torch.cuda.current_stream().synchronize()  # not the device: rank 1's kernels may be waiting for rank 0
        try:
            if blocking is not None:
                blocking.begin_capture(cupy.cuda.runtime.streamCaptureModeRelaxed)
            try:
                comm._c.all_reduce(inputs[call][0].data_ptr(), out.data_ptr(), numel, rocenante._C.DType.float32,
                                   rocenante._C.ReduceOp.sum, 0)
            finally:
                if blocking is not None:
                    try:
                        blocking.end_capture()
                    except Exception:  # the refused launch invalidated the capture
                        pass
            torch.cuda.default_stream().synchronize()
            comm.synchronize()
        except Exception as err:
            torch.cuda.default_stream().synchronize()
            return type(err).__name__, str(err), out
        return "ok", "", out

    def body(rank):
        comm = comms[rank]
        if rank == 1:
            first = _outcome(comm, inputs[1][1], "sum")
            assert first[0] == "ok" and torch.equal(first[2], sequential_fp32(inputs[1], "sum")), first[:2]
            return _outcome(comm, inputs[2][1], "sum"), _outcome(comm, inputs[3][1], "sum")
        first = on_legacy_stream(comm, 1)
        assert first[0] == "ok" and torch.equal(first[2], sequential_fp32(inputs[1], "sum")), first[:2]
        second = on_legacy_stream(comm, 2, cupy.cuda.Stream(non_blocking=False))
        return second, on_legacy_stream(comm, 3)  # checked once both ranks are done

    try:
        (second0, third0), (second1, third1) = _run_ranks(body)
    finally:
        for comm in comms:
            comm.close()
    assert second0[0] != "ok", "rank 0's call 2 launched on the legacy stream during a blocking capture"
    # Before the fix rank 1's call 2 returned rank 0's call 3 plus its own call 2, with no error.
    for call, (kind, message, out) in ((2, second1), (3, third1)):
        assert kind == "PeerAbortedError", f"rank 1, call {call}: {kind} {message}"
        assert "rank 0 aborted the communicator: rank 0 could not launch a call" in message, message
        _assert_all_poisoned(out, f"rank 1, call {call}")
    for call, (kind, message, out) in ((2, second0), (3, third0)):
        assert kind == "RocenanteError" and "rank 0: call 2: could not launch all_reduce with 5000 x float32" in message, message
        _assert_all_poisoned(out, f"rank 0, call {call}")
