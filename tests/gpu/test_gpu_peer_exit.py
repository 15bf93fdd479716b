"""A peer that ends fails only the waits for it, on the GPU paths: tests/support/peer_exit.py."""

from __future__ import annotations

import pytest

import peer_exit
from multiproc import run_ranks


@pytest.mark.parametrize("rank_zero", ["fails", "closes"])
@pytest.mark.parametrize("world", [peer_exit.WORLD])  # for the conftest: three ranks, on shared GPUs if need be
def test_a_peer_that_ends_fails_only_the_waits_for_it(net, world, rank_zero):
    peer_exit.check(run_ranks(world, peer_exit.rank_two_ends_mid_call, "cuda", rank_zero, timeout=180), rank_zero)
