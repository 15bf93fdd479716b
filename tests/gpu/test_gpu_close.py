"""close() on a GPU communicator: it waits for this communicator's own calls only, with peer-death detection
live until they ended, and nothing that reads the communicator from another thread meanwhile touches freed
state."""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

import gpus
from multiproc import all_arrived, end_this_process_later, expect_ok, record_figure, run_ranks


def _close_while_the_peer_dies(store, rank, world):
    import rocenante

    device = gpus.use(rank)
    comm = rocenante.Communicator(store, rank, world, device=device, timeout_s=20)
    x = torch.ones(4096, device=device)
    comm.all_reduce(x)
    comm.synchronize()
    if rank == 1:
        end_this_process_later("kill", 0.5)
        time.sleep(60)
    comm.all_reduce(x)  # rank 1 never makes this call: the kernel waits for it
    start = time.monotonic()
    comm.close()
    return time.monotonic() - start


def test_close_returns_soon_after_a_peer_dies_during_it(net):
    results = run_ranks(2, _close_while_the_peer_dies, timeout=120)
    assert results[1][0] == "died", results[1]
    seconds = expect_ok(results[:1])[0]
    record_figure(gpus.figure(f"gpu_close_beside_dying_peer_{net or 'direct'}_s", 2), seconds)
    assert seconds < 5.0, f"close() took {seconds:.1f} s (timeout 20 s): the kernel waited for the dead peer"


def _one_rank(name):
    import rocenante

    comm = rocenante.Communicator(dist.HashStore(), 0, 1, device=gpus.use(0), name=name)
    x = torch.ones(1000, device="cuda")
    comm.all_reduce(x, out=x)
    comm.synchronize()
    return comm


def test_close_does_not_wait_for_other_work_on_the_device():
    comm = _one_rank("alone")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**8)
    end.record()
    end.synchronize()
    cycles = int(3000 * 10**8 / start.elapsed_time(end))  # about 3 s
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles)  # someone else's long kernel
    start = time.monotonic()
    comm.close()
    seconds = time.monotonic() - start
    busy = not side.query()
    side.synchronize()
    assert busy, "the other kernel ended before close() returned: nothing was shown"
    assert seconds < 1.5, f"close() took {seconds:.1f} s: it waited for a kernel that is not this communicator's"


def test_readers_on_other_threads_beside_close():
    """check(), faulted_by() and stream_done() from another thread while close() releases the communicator (as
    Work.wait() and is_completed() may run during destroy_process_group()): never a crash, never an error other
    than the answers a closed communicator gives."""
    stream = torch.cuda.current_stream().cuda_stream
    for cycle in range(30):
        comm = _one_rank(f"cycle-{cycle}")
        done, errors = threading.Event(), []

        def read():
            while not done.is_set():
                try:
                    comm._c.check()
                    comm._c.faulted_by(1)
                    comm._c.stream_done(stream)
                except Exception as err:  # noqa: BLE001 - reported below
                    errors.append(f"{type(err).__name__}: {err}")
                    return

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.002 * (cycle % 5))
        comm.close()
        time.sleep(0.005)
        done.set()
        reader.join()
        assert not errors, f"cycle {cycle}: {errors[0]}"


def _timeout_beside_another_communicator(store, rank, world):
    import rocenante

    device = gpus.use(rank)
    # The 1 s timeout bounds the set-up's waits too: both ranks start it with their CUDA context made (making one
    # took rank 1 more than a second once, on one H200 shared by the ranks).
    torch.empty(1, device=device)
    all_arrived(store, world, "cuda-ready")
    first = rocenante.Communicator(store, rank, world, device=device, timeout_s=1.0, name="first")
    second = rocenante.Communicator(store, rank, world, device=device, timeout_s=1.0, name="second")
    message = ""
    if rank == 0:  # rank 1 never makes this call
        first.all_reduce(torch.ones(100, device=device))
        try:
            first.synchronize()
        except rocenante.PeerTimeoutError as err:
            message = str(err)
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{r}" for r in range(world)])
    first.close()
    second.close()
    return message


def test_a_timeout_beside_another_communicator_of_the_device_names_the_likely_cause():
    message = expect_ok(run_ranks(2, _timeout_beside_another_communicator, timeout=120))[0]
    assert "timed out after 1 s waiting for rank(s) 1" in message, message
    assert "another communicator of this process is open on cuda:0" in message, message
