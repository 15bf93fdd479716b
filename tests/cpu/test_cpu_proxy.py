"""The proxy thread of a network communicator between calls (csrc/transport/proxy.cc): it polls hot for
ROCENANTE_PROXY_SPIN_S after its last work, a core while it does, then naps."""

from __future__ import annotations

import os
import time

import pytest
import torch

from multiproc import expect_ok, run_ranks


def _idle_cpu(store, rank, world, spin_s):
    import rocenante

    os.environ["ROCENANTE_PROXY_SPIN_S"] = spin_s
    with rocenante.Communicator(store, rank, world, net="tcp", timeout_s=60) as comm:
        assert torch.equal(comm.all_reduce(torch.ones(4)), torch.full((4,), 2.0))
        before = time.process_time(), _sleeps()  # every thread of this process: the proxy's polls
        time.sleep(0.6)
        used = time.process_time() - before[0], _sleeps() - before[1]
        assert torch.equal(comm.all_reduce(torch.ones(4)), torch.full((4,), 2.0))
    return used


def _sleeps() -> int:
    """Voluntary context switches of every thread of this process: one per nap of a napping proxy, none while it
    polls hot (the other threads block in a handful of waits)."""
    total = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/status") as f:
                total += int(next(line for line in f if line.startswith("voluntary_ctxt_switches")).split()[1])
        except (OSError, StopIteration):  # a thread that ended meanwhile
            pass
    return total


def test_spin_setting_out_of_range_is_refused_naming_it(monkeypatch):
    from rocenante import _env

    for raw in ("-1", "3601", "nan", "soon"):
        monkeypatch.setenv("ROCENANTE_PROXY_SPIN_S", raw)
        with pytest.raises(ValueError, match=f"ROCENANTE_PROXY_SPIN_S='{raw}': use 0..3600 seconds"):
            _env.proxy_spin_s()
    monkeypatch.setenv("ROCENANTE_PROXY_SPIN_S", "0")
    assert _env.proxy_spin_s() == 0


@pytest.mark.parametrize("spin_s, hot", [("30", True), ("0.002", False)])
def test_the_proxy_polls_hot_for_the_spin_time_then_naps(spin_s, hot):
    used = expect_ok(run_ranks(2, _idle_cpu, spin_s, timeout=120))
    where = f"(CPU seconds, voluntary switches) in 0.6 s idle, spin {spin_s} s: {used}"
    if hot:  # about a core each (less where the two ranks share fewer cores), without sleeping
        assert all(cpu > 0.25 and sleeps < 1000 for cpu, sleeps in used), where
    else:  # a 50 us nap between polls: about 10,000 naps; what each costs depends on the machine (about 1/3 of a
        # core on the 2-core CI VM), well below a core
        assert all(cpu < 0.45 and sleeps > 2000 for cpu, sleeps in used), where
