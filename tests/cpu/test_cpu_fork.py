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


def _forked_ranks_of_a_parent_that_built_one(store_dir, timeout_s, kill_after_s):
    """A parent that built a world-2 communicator (its ranks as two threads, so its watchdog runs) forks two
    children, which build their own over a FileStore, as docs/guarantees.md tells users to. After call 1, child 1
    is SIGKILLed; child 0's call 2 must fail once its watchdog sees child 1's process end, not at the timeout.
    Returns (child 0's error, seconds its call 2 took, how child 1 ended). Runs in a process of its own."""
    import signal
    import threading

    import torch.distributed as dist

    import rocenante

    parents = [None, None]
    parent_store = dist.HashStore()

    def parent_rank(rank):
        parents[rank] = rocenante.Communicator(parent_store, rank, 2, timeout_s=timeout_s, name="parent")
        parents[rank].all_reduce(torch.ones(256))

    threads = [threading.Thread(target=parent_rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    read, write = os.pipe()
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:  # a child: builds its own communicator and calls
            code = 1
            try:
                os.close(read)
                store = dist.FileStore(os.path.join(store_dir, "store"), 2)
                with rocenante.Communicator(store, rank, 2, timeout_s=timeout_s, name="child") as comm:
                    comm.all_reduce(torch.ones(1 << 16))
                    if rank == 1:
                        time.sleep(kill_after_s)
                        os.kill(os.getpid(), signal.SIGKILL)
                    start = time.monotonic()
                    try:
                        comm.all_reduce(torch.ones(1 << 16))
                        message = "call 2 returned"
                    except rocenante.RocenanteError as err:
                        message = str(err)
                    os.write(write, f"{time.monotonic() - start:.3f} {message}".encode()[:4000])
                    code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(write)
    ends = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    report = os.read(read, 4096).decode()
    for comm in parents:
        comm.close()
    seconds, _, message = report.partition(" ")
    return message, float(seconds or "nan"), ends


def _in_a_process(fn, *args):
    """fn(*args) in a spawned process of its own (a fork's parent must not be pytest's process)."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply_async(fn, args).get(timeout=120)


def test_a_forked_childs_communicator_is_watched(tmp_path):
    """A child's watchdog runs though its parent's did (a fresh registry in the child): a peer child that is
    killed fails the survivor's call within the watchdog's reach, naming it, not after the 10 s timeout."""
    message, seconds, ends = _in_a_process(_forked_ranks_of_a_parent_that_built_one, str(tmp_path), 10.0, 0.3)
    assert ends[1] == -9 and ends[0] == 0, ends
    assert "rank 1" in message and "ended" in message, message
    assert seconds < 4.0, f"child 0 waited {seconds:.1f} s for its killed peer (the timeout is 10 s): unwatched"
