"""A peer's process that ends fails only the waits for that peer: a rank still receiving from others completes
the call whose data the ended peer had already delivered, and its next call, which needs the ended peer, fails
naming it. World 3: rank 2 is killed while it waits for rank 1, which is late; ranks 0 and 1 survive. Rank 0 then
either makes call 2 too, fails it and closes ("fails"), or closes after call 1, its last call ("closes"); rank 1
makes call 2 once rank 0 closed, and must name rank 2 either way."""

from __future__ import annotations

import time

import torch

from multiproc import all_arrived, end_this_process_later, expect_ok
from reference import make_input, poison, sequential_fp32

WORLD = 3


def rank_two_ends_mid_call(store, rank, world, device, rank_zero="fails"):
    """`device`: "cpu", or "cuda" for the rank's GPU (tests/support/gpus.py); `rank_zero`: "fails" or "closes"."""
    import rocenante

    if device == "cuda":
        import gpus

        device = gpus.use(rank)
    comm = rocenante.Communicator(store, rank, world, device=device, timeout_s=30)
    inputs = [[make_input(23, c, r, 5000, torch.float32, device) for r in range(world)] for c in range(2)]
    out = poison(torch.empty(5000, device=device))
    all_arrived(store, world, "start")
    # Rank 2's data of call 1 must be out before it ends (over the TCP wire its proxy thread sends it): 0.3 s left
    # little room on a loaded 2-core machine, where the tcp case failed once (cause not recorded).
    if rank == 2:
        end_this_process_later("kill", 1.0)  # its data of call 1 is out by then; it waits for rank 1
    if rank == 1:
        time.sleep(3.0)  # late: rank 0 is still receiving from rank 1 when rank 2 ends
    comm.all_reduce(inputs[0][rank], out=out)
    comm.synchronize()
    first = torch.equal(out, sequential_fp32(inputs[0], "sum"))
    # Both survivors are done with call 1 before either makes call 2, whose fault (rank 2 is gone) would reach
    # the other as an abort word, which over a network may overtake the call-1 data still on its way.
    store.set(f"call-1-done/{rank}", "1")
    store.wait([f"call-1-done/{1 - rank}"])
    if rank == 0 and rank_zero == "closes":  # its process stays up: rank 1 sees a closed connection, no ended process
        comm.close()
        store.set("closed/0", "1")
        store.wait(["closed/1"])
        return ("closed",)
    # Rank 1 makes call 2 only once rank 0 closed, so two of its peers are gone while that call waits for both: it
    # must still name rank 2, whose end came first (over the TCP wire its proxy saw both connections close, and
    # named the lower rank until it named the first to close). With "fails", rank 0 must fail call 2 at once
    # although rank 1 is late (the CPU host loop, waiting for one peer at a time, timed out).
    if rank == 1:
        store.wait(["closed/0"])
    start = time.monotonic()
    try:
        comm.all_reduce(inputs[1][rank], out=poison(out))
        comm.synchronize()
    except rocenante.PeerAbortedError as err:
        return first, str(err), time.monotonic() - start, bool(torch.isnan(out).all())
    finally:
        comm.close()
        store.set(f"closed/{rank}", "1")
    return first, "no error", 0.0, False


def check(results, rank_zero="fails") -> None:
    assert results[2][0] == "died", results[2]
    survivors = expect_ok(results[:2])
    if rank_zero == "closes":
        assert survivors[0] == ("closed",), survivors[0]
        survivors[0] = None
    for rank, outcome in enumerate(survivors):
        if outcome is None:
            continue
        first, message, seconds, poisoned = outcome
        assert first, f"rank {rank}: call 1, whose data every peer had delivered, did not return the right sum"
        # Directly, the watchdog saw rank 2 end; over the TCP wire a proxy may see its connection close first (and
        # the other survivor hear it from that proxy's abort word).
        assert "rank 2's process ended" in message or "network path to rank 2 failed" in message, \
            f"rank {rank}: {message}"
        assert seconds < 2.0 and poisoned, f"rank {rank}: call 2 failed after {seconds:.2f} s, poisoned: {poisoned}"
