"""The call numbers' wrap on the GPU paths (CUDA IPC, the TCP wire), and the backend's Work objects across it:
a Work raises a fault that struck at or before its own call, and only such a fault."""

from __future__ import annotations

import pytest
import torch

import gpus
import wrap
from multiproc import expect_ok, run_ranks


@pytest.mark.parametrize("before", [5, 0], ids=["wrap-5-calls-in", "first-call-0"])
def test_calls_and_a_fault_across_the_wrap(net, before, monkeypatch):
    monkeypatch.setenv("ROCENANTE_TEST_FIRST_CALL", str(wrap.near_the_wrap(before)))
    wrap.assert_named_the_mismatch(expect_ok(run_ranks(2, wrap.calls_across, "cuda", 12, 43, timeout=180)))


def _work_across_the_wrap(store, rank, world):
    import torch.distributed as dist

    import rocenante

    device = gpus.use(rank)
    dist.init_process_group("rocenante", store=store, rank=rank, world_size=world)
    # The self-test made the CUDA communicator's calls P - 3 and P - 2 (wrap.near_the_wrap(3)).
    assert rocenante.status()["cuda"]["active"], rocenante.status()
    x = torch.ones(1000, device=device)
    before = dist.all_reduce(x, async_op=True)  # call P - 1
    y = torch.ones(1000 + 8 * rank, device=device)
    at_zero = dist.all_reduce(y, async_op=True)  # call 0: the sizes differ, both ranks fault
    torch.cuda.synchronize(device)
    before.wait()  # the fault struck after this call: it does not raise
    ok_before = torch.equal(x, torch.full_like(x, world))
    try:
        at_zero.wait()
    except rocenante.CallMismatchError as err:
        raised = str(err)
    else:
        raised = ""
    dist.destroy_process_group()
    return ok_before, raised


def test_work_objects_across_the_wrap(monkeypatch):
    monkeypatch.setenv("ROCENANTE_TEST_FIRST_CALL", str(wrap.near_the_wrap(3)))
    for rank, (ok_before, raised) in enumerate(expect_ok(run_ranks(2, _work_across_the_wrap, timeout=180))):
        assert ok_before, f"rank {rank}: the call before the wrap gave a wrong sum"
        assert ": call 0: " in raised and "called all_reduce with" in raised, f"rank {rank}: {raised!r}"
