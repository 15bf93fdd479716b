"""Calls across the wrap of the call numbers (an epoch counts calls modulo _C.layout.epoch_period, about 3.2e9:
days of serving), on whatever path and device a test runs: every communicator of the ranks starts at the call
number ROCENANTE_TEST_FIRST_CALL, which the test sets just before the wrap (or at 0)."""

from __future__ import annotations

import random

import torch

from reference import DTYPES, make_input, ops_for, poison, sequential_fp32

# 4 KiB areas: a call of more than 1024 float32 elements goes as several pieces, each a call number of its own.
CAPACITY = 4096


def near_the_wrap(calls_before: int) -> int:
    """The first call number that puts the wrap `calls_before` calls in."""
    from rocenante import _C

    return (_C.layout.epoch_period - calls_before) % _C.layout.epoch_period


def calls_across(store, rank, world, device, calls, seed):
    """`calls` all-reduces of every dtype and op, of one piece and of several, each checked bit for bit against
    the rank-order reference; then a call whose sizes differ between ranks, which must fail naming it, and be
    told apart from every call before it by faulted_by() (what Work.wait() asks), across the wrap. Returns the
    mismatch's message. `device`: "cpu", or "cuda" for the rank's GPU (tests/support/gpus.py)."""
    import rocenante

    if device == "cuda":
        import gpus

        device = gpus.use(rank)
    comm = rocenante.Communicator(store, rank, world, device=device, capacity_bytes=CAPACITY, timeout_s=30)
    rng = random.Random(seed)
    numbers = []  # each call's number (of its last piece), as the backend's Work keeps it
    for i in range(calls):
        dtype = DTYPES[i % len(DTYPES)]
        op = ops_for(dtype)[i % len(ops_for(dtype))]
        numel = rng.choice([1, 7, 1024, 2500])  # 2500 float32 elements: 3 pieces; int32 pieces hold half
        inputs = [make_input(seed, i, r, numel, dtype, device) for r in range(world)]
        out = inputs[rank].clone()  # in place, as the backend calls it
        numbers.append(comm.issue(out, op))
        comm.synchronize()
        if not torch.equal(out, sequential_fp32(inputs, op)):
            raise AssertionError(f"call {i} ({dtype} {op}, {numel} elements): a wrong result")
    try:
        comm.all_reduce(torch.ones(100 + 8 * rank, device=device))
        comm.synchronize()
    except rocenante.CallMismatchError as err:
        period = rocenante._C.layout.epoch_period
        early = [n for n in numbers if comm.faulted_by(n)]
        assert not early, f"calls {early}, made before the fault, count as faulted"
        assert comm.faulted_by((numbers[-1] + 1) % period), "the faulted call does not count as faulted"
        return str(err)
    finally:
        comm.close()
    raise AssertionError("a mismatched call succeeded")


def assert_named_the_mismatch(messages) -> None:
    """Each rank's message from calls_across names the other rank's call (over a network a rank may hear of it
    from the peer's abort word first, naming the mismatch as that peer saw it)."""
    for rank, message in enumerate(messages):
        other = 1 - rank
        assert f"rank {other} called all_reduce with {100 + 8 * other} x float32" in message \
            or f"rank {other} aborted the communicator: rank" in message, message
