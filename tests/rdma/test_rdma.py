"""RDMA transport, end to end, with CPU tensors: every rank in one machine (the SoftRoCE VM), every peer reached
through the RDMA device (ROCENANTE_NET=ib). Ranks are forked from this process, which imported torch once
(in the VM that import takes a minute), and each set of ranks runs a table of cases."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import peer_exit
import rocenante
from multiproc import all_arrived, end_this_process_later, expect_ok, run_ranks
from probes import MAPS_TOLERANCE, host_probe
from reference import (DTYPES, bits, check_against_float64, digest, make_input, ops_for, poison, random_bits,
                       reduced, sequential_fp32, split_block, split_rows)
from rocenante import _env, _ib

# Emulated CPU in the VM: bounds are loose, and every wait has its own timeout.
CAPACITY = 64 << 10


def run(world, fn, *args, timeout=600):
    return run_ranks(world, fn, *args, timeout=timeout, context="fork")


def _table(store, rank, world, seed):
    comm = rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=120)
    rng = random.Random(seed)  # the same sizes on every rank
    digests, case = [], 0
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for numel in (rng.randint(1, 40), rng.randint(1, CAPACITY // dtype.itemsize)):
                inputs = [make_input(seed, case, r, numel, dtype) for r in range(world)]
                out = poison(torch.empty(numel, dtype=dtype))
                assert comm.all_reduce(inputs[rank], op=op, out=out) is out
                assert torch.equal(out, sequential_fp32(inputs, op)), f"case {case}: {dtype} {op} {numel}"
                check_against_float64(out, inputs, op)
                digests.append(digest(out))
                case += 1
    for i in range(30):  # back to back, in place, every slot reused many times
        x = torch.full((1000 + i,), float(rank + i))
        comm.all_reduce(x, out=x)
        assert torch.equal(x, torch.full_like(x, float(sum(r + i for r in range(world))))), f"back-to-back call {i}"
    # Every rank has finished the calls above before any makes the odd one: over the network a peer's abort
    # travels apart from the other peers' deliveries, so a rank still receiving the last call could otherwise
    # read the abort of a peer already past it and fail that call (docs/guarantees.md, Known limits).
    all_arrived(store, world, "calls-done")
    x = torch.ones(8 + (rank == world - 1))  # the last rank calls with one element more
    with pytest.raises(rocenante.CallMismatchError) as err:
        comm.all_reduce(x)
    comm.close()
    return digests, str(err.value)


# The flag signal (default) at every world, the completion signal (ROCENANTE_IB_SIGNAL=completion) at one.
@pytest.mark.parametrize("world, signal", [(2, "flag"), (3, "flag"), (4, "flag"), (3, "completion")],
                         ids=["2", "3", "4", "3-completion"])
def test_dtypes_ops_random_sizes_bitwise_identical_across_ranks(world, signal, monkeypatch):
    monkeypatch.setenv("ROCENANTE_IB_SIGNAL", signal)
    results = expect_ok(run(world, _table, 1000 + world))
    assert all(r[0] == results[0][0] for r in results), "ranks computed different bits"
    # Over a network a rank may hear of the mismatch from a peer's abort word before the odd call's delivery
    # arrives (the abort travels on its own, outside the proxy's delivery rounds): it then names the peer that
    # saw the mismatch and that peer's view of it. Either way every rank names a mismatch.
    last = world - 1
    for rank, (_, mismatch) in enumerate(results):
        seen = f"rank {last} called all_reduce with 9 x float32" if rank != last else "called all_reduce with 8 x float32"
        relayed = re.search(r"rank \d aborted the communicator: rank \d made a different call", mismatch)
        assert seen in mismatch or relayed, mismatch


def _gathers_and_scatters(store, rank, world, seed):
    """All-gathers and all-to-alls of any bits and reduce-scatters of every dtype and op (protocol v6), at a size
    within one piece and one across pieces, checked bit for bit."""
    comm = rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=120)
    rng = random.Random(seed)
    case = 0
    for dtype in DTYPES:
        for numel in (rng.randint(1, 40), rng.randint(1, CAPACITY // dtype.itemsize)):
            case += 1
            shards = [random_bits(seed, case, r, numel, dtype) for r in range(world)]
            out = comm.all_gather(shards[rank], out=poison(torch.empty(world * numel, dtype=dtype)))
            assert torch.equal(bits(out), bits(torch.cat(shards))), f"all_gather {dtype} {numel}"
            for op in ops_for(dtype):
                case += 1
                inputs = [make_input(seed, case, r, world * numel, dtype) for r in range(world)]
                out = comm.reduce_scatter(inputs[rank], op=op, out=poison(torch.empty(numel, dtype=dtype)))
                assert torch.equal(bits(out), bits(reduced(inputs, op)[rank * numel:(rank + 1) * numel])), \
                    f"reduce_scatter {dtype} {op} {numel}"
            case += 1
            blocks = [random_bits(seed, case, r, world * numel, dtype) for r in range(world)]
            out = comm.all_to_all(blocks[rank], out=poison(torch.empty(world * numel, dtype=dtype)))
            assert torch.equal(bits(out), bits(torch.cat([b[rank * numel:(rank + 1) * numel] for b in blocks]))), \
                f"all_to_all {dtype} {numel}"
            # A split all-to-all: each pair's block its own size, zeros and the largest included.
            case += 1
            rows = split_rows(seed, case, world, comm.largest_block(dtype) // 3)
            sent = torch.cat([split_block(seed, case, rank, t, world, rows[rank][t], 3, dtype) for t in range(world)])
            want = torch.cat([split_block(seed, case, s, rank, world, rows[s][rank], 3, dtype) for s in range(world)])
            out = comm.all_to_all(sent, out=poison(torch.empty_like(want)), input_split_sizes=rows[rank],
                                  output_split_sizes=[rows[s][rank] for s in range(world)])
            assert torch.equal(bits(out), bits(want)), f"split all_to_all {dtype} {rows}"
    comm.close()
    return case


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_reduce_scatter_and_all_to_all_match_references_bit_for_bit(world):
    cases = expect_ok(run(world, _gathers_and_scatters, 2000 + world))  # each rank checked its results
    # Per dtype and size one all-gather, one all-to-all and one split all-to-all, and a reduce-scatter per op (15
    # dtype-op pairs).
    assert cases == [cases[0]] * world and cases[0] == 3 * 4 * 2 + 2 * 15, cases


def _two_shot(store, rank, world, seed):
    """Two-shot all-reduces (ROCENANTE_ALGO=twoshot: over RDMA, a reduce-scatter and an all-gather per piece) of
    every dtype and op, at a size within one piece and one across pieces: one-shot's bits on every rank."""
    comm = rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=120)
    assert comm.two_shot(1)
    rng = random.Random(seed)
    case = 0
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for numel in (rng.randint(1, 40), rng.randint(CAPACITY // dtype.itemsize, 2 * CAPACITY // dtype.itemsize)):
                case += 1
                inputs = [make_input(seed, case, r, numel, dtype) for r in range(world)]
                out = comm.all_reduce(inputs[rank], op=op, out=poison(torch.empty(numel, dtype=dtype)))
                assert torch.equal(bits(out), bits(reduced(inputs, op))), f"two-shot {dtype} {op} {numel}"
    comm.close()
    return case


@pytest.mark.parametrize("world", [2, 3])
def test_two_shot_returns_one_shot_bits(world, monkeypatch):
    monkeypatch.setenv("ROCENANTE_ALGO", "twoshot")
    cases = expect_ok(run(world, _two_shot, 3000 + world))
    assert cases == [2 * 15] * world, cases


def _victim(store, rank, world, how, timeout_s):
    comm = rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=timeout_s)
    all_arrived(store, world, "victim")
    victim = world - 1
    if rank == victim:
        end_this_process_later(how, after_s=1.0, stopped_s=timeout_s + 6)
    calls = 0
    while True:
        x = torch.full((4096,), float(rank + 1))
        start = time.monotonic()
        try:
            comm.all_reduce(x, out=x)
        except rocenante.RocenanteError as err:
            want = float(sum(r + 1 for r in range(world)))
            assert bool(((x == want) | torch.isnan(x)).all()), "an element is neither exact nor NaN"
            return calls, type(err).__name__, str(err), time.monotonic() - start
        assert torch.equal(x, torch.full_like(x, float(sum(r + 1 for r in range(world))))), f"call {calls} wrong"
        calls += 1


def test_killed_peer_is_reported_within_the_bound():
    world = 3
    results = run(world, _victim, "kill", 60.0)
    assert results[-1] == ("died", -signal.SIGKILL), results[-1]
    for rank, (calls, kind, message, elapsed) in enumerate(expect_ok(results[:-1])):
        assert calls > 0, f"rank {rank} never completed a call before the kill"
        assert kind == "PeerAbortedError", message
        assert "rank 2" in message, message
        assert elapsed < 10.0, f"rank {rank} took {elapsed:.1f} s to notice (timeout 60 s)"


def test_stopped_peer_times_out_and_learns_of_it_when_continued():
    world, timeout_s = 2, 6.0
    results = expect_ok(run(world, _victim, "stop", timeout_s))
    calls, kind, message, elapsed = results[0]
    assert kind == "PeerTimeoutError" and "waiting for rank(s) 1" in message, message
    assert elapsed < timeout_s + 6.0, f"waited {elapsed:.1f} s with a {timeout_s} s timeout"
    _, kind, message, _ = results[1]
    assert kind == "PeerTimeoutError" and "aborted the communicator: a wait for rank(s) 1" in message, message


def _peer_vanishes(store, rank, world):
    """Rank 1 destroys its queue pairs without telling rank 0 (no goodbye; its process lives on, so no watchdog sees
    it): rank 0's next write gets no acknowledgement and must fail naming rank 1 and the verbs status."""
    comm = rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=120)
    comm.all_reduce(torch.ones(16))
    all_arrived(store, world, "first call done")
    if rank == 1:
        rocenante._C._test_skip_goodbyes(True)
        comm.close()
        all_arrived(store, world, "closed")
        all_arrived(store, world, "done")  # alive until rank 0 is done: its watchdog must not see us end
        return None
    all_arrived(store, world, "closed")
    start = time.monotonic()
    with pytest.raises(rocenante.RocenanteError) as err:
        comm.all_reduce(torch.ones(16))
    elapsed = time.monotonic() - start
    all_arrived(store, world, "done")
    return type(err.value).__name__, str(err.value), elapsed


def test_write_to_a_vanished_queue_pair_fails_naming_the_peer_and_verbs_status():
    kind, message, elapsed = expect_ok(run(2, _peer_vanishes))[0]
    assert kind == "PeerAbortedError", message
    assert re.search(r"the network path to rank 1 failed: .*retry.*\(verbs status 12\)", message), message
    assert elapsed < 15.0, f"took {elapsed:.1f} s (retransmission budget about 1.9 s)"


def _peer_vanishes_while_waited_for(store, rank, world):
    """Rank 1 destroys its queue pairs without telling rank 0 while rank 0 only waits for its data, having nothing
    left to send it: only the proxy's probes (transport.h) can find out, as they would for a host gone down.
    (SoftRoCE cannot have its packets dropped here: a device's traffic to itself loops back inside rxe, and a
    second device's address is reached through lo.) Rank 1's process lives on, so no watchdog sees anything."""
    comm = rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=120)
    comm.all_reduce(torch.ones(16))
    all_arrived(store, world, "first call done")
    if rank == 1:
        time.sleep(2.0)  # rank 0 is waiting by now, its data to us acknowledged
        rocenante._C._test_skip_goodbyes(True)  # as a host that went down
        comm.close()
        store.set("gone_at", repr(time.monotonic()))  # CLOCK_MONOTONIC: one clock for every process of the VM
        all_arrived(store, world, "done")
        return None
    x = torch.ones(16)
    with pytest.raises(rocenante.RocenanteError) as err:
        comm.all_reduce(x, out=x)
    elapsed = time.monotonic() - float(store.get("gone_at"))
    poisoned = bool(torch.isnan(x).all())
    all_arrived(store, world, "done")
    return type(err.value).__name__, str(err.value), elapsed, poisoned


def test_a_peer_that_vanishes_while_waited_for_fails_the_wait_naming_it():
    kind, message, elapsed, poisoned = expect_ok(run(2, _peer_vanishes_while_waited_for))[0]
    print(f"vanished peer seen after {elapsed:.2f} s (emulated VM; retransmission budget about 1.9 s): {message}")
    assert kind == "PeerAbortedError", message
    # The probe's retries run out (status 12), or rxe flushes it as the queue pair goes to error (5); 1.86 s once.
    assert re.search(r"the network path to rank 1 failed: .*\(verbs status (5|12)\)", message), message
    assert poisoned
    assert elapsed < 10.0, f"took {elapsed:.1f} s (retransmission budget about 1.9 s; the timeout is 120 s)"


def test_a_peer_that_closed_fails_the_waits_for_it_at_once():
    peer_exit.check_closed(run(2, peer_exit.rank_zero_closes_and_lives_on, "cpu"))


def test_a_goodbye_fails_no_call_the_closed_peer_made():
    peer_exit.check_goodbyes(run(2, peer_exit.closes_right_after_its_calls, "cpu", 3, 3))


# (environment, what happens): setup errors name the device (and the peer), never a silent fallback.
_SETUPS = [
    ({"ROCENANTE_IB_GID_INDEX": "7"}, "ROCENANTE_IB_GID_INDEX=7: rxe0 port 1 (for"),
    ({"ROCENANTE_IB_HCA": "mlx5_0"}, "ROCENANTE_IB_HCA lists mlx5_0, which matches no RDMA port here"),
    ({"NCCL_IB_HCA": "^rxe"}, "no usable RDMA port for rank"),
    ({"NCCL_IB_HCA": "=rxe0:1", "NCCL_IB_GID_INDEX": os.environ.get("RXE_GID_INDEX", "1")}, "ok"),
    ({"ROCENANTE_IB_HCA": "rxe0", "NCCL_IB_HCA": "mlx5_0"}, "ok"),  # ours wins over NCCL's
    ({"ROCENANTE_IB_TC": "106", "NCCL_IB_SL": "3"}, "ok"),  # set on the queue pairs (DSCP 26, priority 3)
]


def _setups(store, rank, world):
    outcomes = []
    for i, (env, _) in enumerate(_SETUPS):
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            with rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=60, name=f"s{i}") as c:
                assert torch.equal(c.all_reduce(torch.ones(4)), torch.full((4,), 2.0))
            outcomes.append("ok")
        except rocenante.RocenanteError as err:
            outcomes.append(str(err))
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        all_arrived(store, world, f"setup {i}")
    return outcomes


def test_device_and_gid_settings_give_the_documented_outcome():
    for rank, outcomes in enumerate(expect_ok(run(2, _setups))):
        for (env, want), got in zip(_SETUPS, outcomes):
            assert want in got, f"rank {rank}, {env}: {got}"


def test_two_devices_stripe_every_peer_starting_by_rank_plus_peer():
    ports = [p for p in _ib.scan() if p.state == "ACTIVE" and p.link_layer == "Ethernet"]
    if len(ports) < 2:
        pytest.skip("needs two ACTIVE RoCE ports (run_in_vm.sh adds rxe1 on dummy1)")
    gid_index, source = _env.ib_gid_index()
    paths = _ib.choose_paths(0, 3, ports, None, gid_index, source)
    assert [[r.device for r in (p, *p.rails)] for p in paths[1:]] == [[ports[1].device, ports[0].device],
                                                                    [ports[0].device, ports[1].device]]
    assert "striped over 2 rails" in paths[1].why


def _sent_packets() -> dict:
    """Packets each ACTIVE RDMA device has sent (SoftRoCE's hw_counters), by device."""
    counts = {}
    for p in _ib.scan():
        if p.state == "ACTIVE":
            with open(f"/sys/class/infiniband/{p.device}/ports/{p.port}/hw_counters/sent_pkts") as f:
                counts[p.device] = int(f.read())
    return counts


def _striped(store, rank, world):
    """Each rail's packets over 10 all-reduces of 64 KiB (striped), then of 400 bytes (the first rail), both
    ranks' calls inside each window: (the rails to the peer, [large deltas, small deltas])."""
    comm = rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=120)
    path = comm.ib_paths[1 - rank]
    rails = [r.device for r in (path, *path.rails)]
    deltas = []
    for numel in (CAPACITY // 4, 100):
        all_arrived(store, world, f"before {numel}")
        before = _sent_packets()
        for i in range(10):
            inputs = [make_input(3, i, r, numel, torch.float32) for r in range(world)]
            out = poison(torch.empty(numel))
            comm.all_reduce(inputs[rank], out=out)
            assert torch.equal(out, sequential_fp32(inputs, "sum")), f"call {i} of {numel} floats"
        all_arrived(store, world, f"after {numel}")
        after = _sent_packets()
        deltas.append([after[d] - before[d] for d in rails])
    comm.close()
    return rails, deltas


def test_large_calls_are_striped_over_both_devices_and_small_ones_take_the_first():
    if len([p for p in _ib.scan() if p.state == "ACTIVE" and p.link_layer == "Ethernet"]) < 2:
        pytest.skip("needs two ACTIVE RoCE ports (run_in_vm.sh adds rxe1 on dummy1)")
    (rails, (large, small)), (other, _) = expect_ok(run(2, _striped))
    assert len(rails) == 2 and rails == other, (rails, other)
    # Both ranks share the machine's devices: 10 calls x 2 ranks x 64 KiB, half on each rail, 1 KiB a packet.
    half = 10 * 2 * CAPACITY // 2 // 1024
    assert min(large) >= 0.8 * half, f"64 KiB calls: packets per rail {large}, want about {half} each"
    # The second rail carries probes (every 100 ms a call waits, on every rail: in this emulated guest 56 packets
    # over the 10 calls against 176 on the first, in one run), not the calls' data.
    assert small[1] < small[0] // 2, f"400-byte calls: packets per rail {small}: the second carried data"


def _rdma_resources() -> dict:
    """Counts of queue pairs, memory regions, ... across the machine, from iproute2's rdma tool."""
    out = subprocess.run(["rdma", "resource", "show"], capture_output=True, text=True, check=True).stdout
    counts: dict = {}
    for line in out.splitlines():
        for key, value in re.findall(r"\b(pd|cq|qp|mr|ctx) (\d+)", line):
            counts[key] = counts.get(key, 0) + int(value)
    return counts


def _cycles(store, rank, world, n):
    def cycle(name):
        with rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=60, name=name) as c:
            c.all_reduce(torch.ones(64))
        all_arrived(store, world, name)

    cycle("warm-up")  # loads libibverbs and its providers, once per process
    before = _rdma_resources(), host_probe()
    for i in range(n):
        cycle(f"cycle {i}")
    return before, (_rdma_resources(), host_probe())


def test_create_destroy_cycles_leak_no_queue_pair_or_registration():
    results = expect_ok(run(2, _cycles, 10))
    for rank, ((res0, probe0), (res1, probe1)) in enumerate(results):
        assert res1 == res0, f"rank {rank}: RDMA resources before {res0}, after 10 cycles {res1}"
        where = f"rank {rank}, before -> after 10 cycles: {probe0} -> {probe1}"
        assert probe1["fds"] <= probe0["fds"] and probe1["device_maps"] <= probe0["device_maps"], where
        assert probe1["maps"] - probe0["maps"] <= MAPS_TOLERANCE, where


def test_doctor_lists_the_devices_and_the_choice():
    run = subprocess.run([sys.executable, "-m", "rocenante.doctor"], capture_output=True, text=True, timeout=300)
    assert run.returncode in (0, 1), run.stdout + run.stderr  # 1: warnings (SoftRoCE's MTU is 1024)
    out = run.stdout
    assert "pyverbs could not query" not in out and "pyverbs is missing" not in out, out
    for device in [p.device for p in _ib.scan() if p.state == "ACTIVE"]:
        assert f"{device}: 1 port(s)" in out and "GID 1: 0000:0000:0000:0000:0000:ffff:" in out, out
    assert re.search(r"rank 0: RDMA to rank 1 over \S+ port 1, GID \d+ \(", out), out
    if "active MTU 1024" in out:
        assert "active MTU 1024 below 4096" in out, out
