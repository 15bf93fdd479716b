"""A peer that ends fails only the waits for it, on the CPU paths: tests/support/peer_exit.py."""

from __future__ import annotations

import peer_exit
from multiproc import run_ranks


def test_a_peer_that_ends_fails_only_the_waits_for_it(net):
    peer_exit.check(run_ranks(peer_exit.WORLD, peer_exit.rank_two_ends_mid_call, "cpu", timeout=120))
