"""Real clients on CPU tensors (tests/support/clients.py): torch's functional collectives, async work, DTensor
redistributions and tensor-parallel modules through a "rocenante" process group, in eager mode and under
torch.compile; and transformers' tensor-parallel decode. Every cell of the matrix is listed, run or skipped with
its reason."""

from __future__ import annotations

import pytest
import torch

import clients

WORLD = 2

test_cell = clients.matrix_test("cpu", WORLD)


def _sum(xs):
    return sum(xs[1:], xs[0])


# Collectives a functional-collective user makes, each with its reference from every rank's input.
_PROBES = {
    "all_reduce": (lambda x, g: clients._funcol().all_reduce(x, "sum", g).wait(), lambda xs, r: _sum(xs)),
    "all_gather": (lambda x, g: clients._funcol().all_gather_tensor(x, 0, g).wait(), lambda xs, r: torch.cat(xs)),
    "reduce_scatter": (lambda x, g: clients._funcol().reduce_scatter_tensor(x, "sum", 0, g).wait(),
                       lambda xs, r: _sum(xs).chunk(len(xs))[r]),
    "all_gather_coalesced": (lambda x, g: clients._funcol().all_gather_into_tensor_coalesced([x], g)[0].wait(),
                             lambda xs, r: torch.cat(xs)),
    "reduce_scatter_coalesced": (
        lambda x, g: clients._funcol().reduce_scatter_tensor_coalesced([x], "sum", [0], g)[0].wait(),
        lambda xs, r: _sum(xs).chunk(len(xs))[r]),
    "all_reduce_coalesced": (lambda x, g: clients._funcol().all_reduce_coalesced([x], "sum", g)[0].wait(),
                             lambda xs, r: _sum(xs)),
    "broadcast": (lambda x, g: clients._funcol().broadcast(x, 0, g).wait(), lambda xs, r: xs[0]),
    "all_to_all_single": (lambda x, g: clients._funcol().all_to_all_single(x, None, None, g).wait(),
                          lambda xs, r: torch.cat([x.chunk(len(xs))[r] for x in xs])),
}


def _gloo_frees_a_tensor_while(store, rank, world, ops):
    """For each op: a delegated (gloo) broadcast is left in flight with no Python reference to its tensor or Work;
    the peer joins it 0.3 s later, so that gloo's worker frees the Work, holding gloo's queue lock, and needs the
    GIL to free the tensor's Python object; rank 0 holds the GIL meanwhile (a switch interval of 10 s, a busy
    loop) and then calls the op. An op that enters gloo holding the GIL (as torch's ProcessGroup trampoline does
    for a collective the Python class does not override) deadlocks there: the hang seen with funcol."""
    import sys
    import time

    import torch
    import torch.distributed as dist

    import rocenante  # noqa: F401

    dist.init_process_group("rocenante", store=store, rank=rank, world_size=world)
    for name in ops:
        dist.barrier()
        t = torch.full((1024,), float(rank))
        if rank == 0:
            sys.setswitchinterval(10.0)
            dist.broadcast(t, 1, async_op=True)
            del t
            start = time.monotonic()
            while time.monotonic() - start < 1.0:
                pass
        else:
            time.sleep(0.3)
            dist.broadcast(t, 1)
        call, reference = _PROBES[name]
        xs = [torch.arange(8.0 * world) + r for r in range(world)]
        out = call(xs[rank], dist.group.WORLD)
        sys.setswitchinterval(0.005)
        assert torch.equal(out, reference(xs, rank)), name
    dist.destroy_process_group()
    return True


def test_collectives_proceed_while_gloo_waits_for_the_gil():
    from multiproc import expect_ok, run_ranks

    expect_ok(run_ranks(WORLD, _gloo_frees_a_tensor_while, list(_PROBES), timeout=120))


@pytest.mark.parametrize("world", [2, 4])
def test_transformers_tensor_parallel_decode(world, tmp_path):
    clients.check_tp_decode("cpu", world, tmp_path)


def test_profiler_trace_names_each_collective_and_its_size(tmp_path):
    """A profiler trace of a step shows rocenante's calls as NCCL's show theirs: one event per call, labelled with
    the collective, the input's bytes and dtype."""
    clients.check_profiled_step("cpu", WORLD, tmp_path)
