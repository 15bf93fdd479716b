"""fork() after a communicator was built: the child can neither use it nor break it for its creator."""

from __future__ import annotations

import os
import time

import torch

from multiproc import all_arrived, expect_ok, run_ranks
from reference import make_input, poison, sequential_fp32


def _child(comm, x) -> int:
    """What a forked child of rank 0 does with its parent's communicator; its exit code says how that went."""
    import rocenante

    start = time.monotonic()
    try:
        comm.all_reduce(x)
        return 3  # a call from the child must never run: its data would land in the peers' regions
    except rocenante.RocenanteError as err:
        if "belongs to process" not in str(err) or time.monotonic() - start > 1.0:
            return 4
    except BaseException:
        return 5
    try:
        with comm:  # leaving the block closes it, as a child's code would
            pass
        del comm  # and its destruction, later
    except BaseException:
        return 6
    return 0


def _fork_then_calls(store, rank, world, calls):
    import rocenante

    comm = rocenante.Communicator(store, rank, world, timeout_s=30)
    outcomes = []

    def call(i):
        inputs = [make_input(17, i, r, 3000, torch.float32) for r in range(world)]
        out = poison(torch.empty(3000))
        comm.all_reduce(inputs[rank], out=out)
        outcomes.append(torch.equal(out, sequential_fp32(inputs, "sum")))

    call(0)
    child = None
    if rank == 0:
        pid = os.fork()
        if pid == 0:
            os._exit(_child(comm, make_input(17, 99, rank, 3000, torch.float32)))
        child = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    all_arrived(store, world, "child-done")
    for i in range(1, calls):  # the parent's communicator works as before, on both ranks
        call(i)
    comm.close()
    return child, outcomes


def test_forked_child_cannot_use_or_break_its_parents_communicator(net):
    results = expect_ok(run_ranks(2, _fork_then_calls, 20, timeout=120))
    assert results[0][0] == 0, f"the child exited with {results[0][0]} (3: its call ran, 4: not refused at once " \
                               "naming the parent, 5: another error, 6: close() raised)"
    for rank, (_, outcomes) in enumerate(results):
        assert outcomes == [True] * 20, f"rank {rank}: wrong results at calls {[i for i, ok in enumerate(outcomes) if not ok]}"
