"""A peer that ends fails only the waits for it, and a peer that closed its communicator and lives on fails, at
once, the waits for it in a later call (its goodbye) and no other, on the CPU paths: tests/support/peer_exit.py."""

from __future__ import annotations

import pytest

import peer_exit
from multiproc import run_ranks


@pytest.mark.parametrize("rank_zero", ["fails", "closes"])
def test_a_peer_that_ends_fails_only_the_waits_for_it(net, rank_zero):
    peer_exit.check(run_ranks(peer_exit.WORLD, peer_exit.rank_two_ends_mid_call, "cpu", rank_zero, timeout=120),
                    rank_zero)


def test_a_peer_that_closed_fails_the_waits_for_it_at_once(net):
    peer_exit.check_closed(run_ranks(2, peer_exit.rank_zero_closes_and_lives_on, "cpu", timeout=90))


def test_a_goodbye_fails_no_call_the_closed_peer_made(net):
    peer_exit.check_goodbyes(run_ranks(2, peer_exit.closes_right_after_its_calls, "cpu", 12, 3, timeout=240))
