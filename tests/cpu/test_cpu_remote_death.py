"""A peer on another host that goes down while this rank only waits for it fails the wait within 2.5 s (the
wire's probes, transport.h), while a stopped peer whose host is up stays a timeout: the TCP wire, 2 CPU ranks in a
network namespace of their own (tests/support/remote_death.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from multiproc import record_figure

HELPER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "remote_death.py")
MISSING = [tool for tool in ("unshare", "ip", "nft") if shutil.which(tool) is None]

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or bool(MISSING),
    reason="needs root and unshare, ip and nft (a network namespace whose TCP traffic it drops; "
           f"missing: {', '.join(MISSING) or 'root'}; Debian: apt-get install nftables)")


def _run(mode: str) -> list:
    done = subprocess.run(["unshare", "-n", sys.executable, HELPER, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_peer_whose_host_goes_down_fails_the_wait_within_2_5_s():
    results = _run("down")
    assert results[1] == "gone", results
    survivor = results[0]
    assert isinstance(survivor, dict), results
    record_figure("tcp_remote_death_s", survivor["after_down_s"])
    print(f"remote death seen {survivor['after_down_s']:.2f} s after the peer's host went down: {survivor['failure']}")
    assert survivor["failure"] is not None and "rank 1" in survivor["failure"], survivor
    assert "acknowledged nothing" in survivor["failure"], survivor
    assert survivor["after_down_s"] < 2.5, survivor
    assert survivor["poisoned"], survivor


def test_a_stopped_peer_whose_host_is_up_stays_a_timeout():
    from remote_death import TIMEOUT_S

    results = _run("stopped")
    assert results[1] == "gone", results
    survivor = results[0]
    assert isinstance(survivor, dict), results
    assert survivor["failure"] is not None and survivor["failure"].startswith("PeerTimeoutError"), survivor
    assert survivor["waited_s"] >= TIMEOUT_S - 0.5, survivor
    assert survivor["poisoned"], survivor
