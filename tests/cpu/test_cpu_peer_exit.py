"""A peer that ends fails only the waits for it, on the CPU paths: tests/support/peer_exit.py. A peer that closed
its communicator and lives on fails the waits for it as docs/guarantees.md says."""

from __future__ import annotations

import time

import pytest
import torch

import peer_exit
from multiproc import all_arrived, expect_ok, run_ranks


@pytest.mark.parametrize("rank_zero", ["fails", "closes"])
def test_a_peer_that_ends_fails_only_the_waits_for_it(net, rank_zero):
    peer_exit.check(run_ranks(peer_exit.WORLD, peer_exit.rank_two_ends_mid_call, "cpu", rank_zero, timeout=120),
                    rank_zero)


def _rank_zero_closes_and_lives_on(store, rank, world):
    import rocenante

    comm = rocenante.Communicator(store, rank, world, device="cpu", timeout_s=1.0)
    x = torch.randn(1000)
    all_arrived(store, world, "start")
    comm.all_reduce(x.clone())
    if rank == 0:
        comm.close()
        store.set("closed/0", "1")
        store.wait(["done/1"])
        return None
    store.wait(["closed/0"])
    start = time.monotonic()
    try:
        comm.all_reduce(x.clone())
        outcome = ("none", "no error")
    except rocenante.RocenanteError as err:
        outcome = (type(err).__name__, str(err))
    finally:
        comm.close()
        store.set("done/1", "1")
    return outcome + (time.monotonic() - start,)


def test_a_peer_that_closed_fails_the_waits_for_it_as_documented(net):
    kind, message, seconds = expect_ok(run_ranks(2, _rank_zero_closes_and_lives_on, timeout=60))[1]
    if net == "tcp":  # its connection closed: at once
        assert kind == "PeerAbortedError" and "network path to rank 0 failed: the connection closed" in message, \
            message
        assert seconds < 0.9, seconds
    else:  # nothing tells of a close on one host: the timeout, naming it
        assert kind == "PeerTimeoutError" and "waiting for rank(s) 0" in message, message
        assert 0.9 <= seconds < 3.0, seconds
