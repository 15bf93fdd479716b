"""A peer that ends fails only the waits for it, on the CPU paths: tests/support/peer_exit.py."""

from __future__ import annotations

import pytest

import peer_exit
from multiproc import run_ranks


@pytest.mark.parametrize("rank_zero", ["fails", "closes"])
def test_a_peer_that_ends_fails_only_the_waits_for_it(net, rank_zero):
    peer_exit.check(run_ranks(peer_exit.WORLD, peer_exit.rank_two_ends_mid_call, "cpu", rank_zero, timeout=120),
                    rank_zero)
