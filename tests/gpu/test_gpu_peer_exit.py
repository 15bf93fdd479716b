"""Peers that leave fail only the waits for them, on the GPU paths: tests/support/peer_exit.py."""

from __future__ import annotations

import pytest

import peer_exit
from multiproc import run_ranks


@pytest.mark.parametrize("rank_zero", ["fails", "closes"])
@pytest.mark.parametrize("world", [peer_exit.WORLD])  # for the conftest: three ranks, on shared GPUs if need be
def test_a_peer_that_ends_fails_only_the_waits_for_it(net, world, rank_zero):
    peer_exit.check(run_ranks(world, peer_exit.rank_two_ends_mid_call, "cuda", rank_zero, timeout=180), rank_zero)


@pytest.mark.parametrize("world", [2])
def test_a_peer_that_closed_fails_the_waits_for_it_at_once(net, world):
    peer_exit.check_closed(run_ranks(world, peer_exit.rank_zero_closes_and_lives_on, "cuda", timeout=180))


@pytest.mark.parametrize("world", [2])
def test_a_goodbye_fails_no_call_the_closed_peer_made(net, world):
    peer_exit.check_goodbyes(run_ranks(world, peer_exit.closes_right_after_its_calls, "cuda", 6, 3, timeout=300))
