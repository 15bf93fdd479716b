"""Never a silent wrong answer, on the CPU path: call ordering across threads, a peer killed or stopped in the
middle of a loop of calls of each collective (over shared memory and over the TCP software wire: `net`), a call
one rank refuses alone, Ctrl-C during a wait, and a broken backend group."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time

import pytest
import torch

import rocenante
from multiproc import all_arrived, end_this_process_later, expect_ok, record_figure, run_ranks
from nets import on_path
from reference import make_input, sequential_fp32

CAPACITY = 64 << 10


def _comm(store, rank, world, timeout_s=60.0):
    return rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=timeout_s)


def _wait_inside_the_core(thread, bound_s=30.0):
    """Returns once `thread` runs the communicator's call into the core (its innermost Python frame is
    _call_core, which holds no GIL while the core waits), and 10 ms more: by then it has issued its call. A fixed
    sleep after start() was not enough under emulation (qemu-user, a loaded host): B issued first."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(thread.ident)
        if frame is not None and frame.f_code.co_name == "_call_core":
            time.sleep(0.01)
            return
        time.sleep(0.001)
    raise AssertionError(f"thread {thread.name} did not reach its call within {bound_s} s")


def _two_threads(store, rank, world, rounds):
    """Rank 0 issues thread A's call, then thread B's while A's is still waiting for rank 1 (late on purpose);
    rank 1 issues A's, then B's. Issue order is matching order, so both calls must pair and be exact."""
    comm = _comm(store, rank, world)
    sizes = {"A": 1000, "B": 3000}  # a mispairing would be a CallMismatchError, never a sum
    results: dict = {}

    def call(name, i):
        inputs = [make_input(i, len(name) + ord(name), r, sizes[name], torch.float32) for r in range(world)]
        try:
            got = comm.all_reduce(inputs[rank])
            results[(name, i)] = torch.equal(got, sequential_fp32(inputs, "sum"))
        except Exception as err:  # reported below, with the call it came from
            results[(name, i)] = f"{type(err).__name__}: {err}"

    for i in range(rounds):
        if rank == 0:
            a = threading.Thread(target=call, args=("A", i))
            a.start()
            _wait_inside_the_core(a)  # A is now inside its call, waiting for rank 1
            b = threading.Thread(target=call, args=("B", i))
            b.start()
            a.join()
            b.join()
        else:
            time.sleep(0.05)
            for name in "AB":
                t = threading.Thread(target=call, args=(name, i))
                t.start()
                t.join()
    comm.close()
    return results


def test_calls_from_two_threads_execute_in_issue_order():
    for results in expect_ok(run_ranks(2, _two_threads, 10, timeout=120)):
        bad = {k: v for k, v in results.items() if v is not True}
        assert not bad and len(results) == 20, bad


def _one_call(comm, collective, rank, world, i):
    """A call of `collective` ("two_shot": an all-reduce, the communicator built to go two-shot) on small
    integers, so that every sum is exact: its output, what the output must hold, and the call itself."""
    n = 4096

    def value(r):
        return float(r + 1 + i % 7)

    if collective == "all_gather":
        out = torch.empty(world * n)
        return out, torch.cat([torch.full((n,), value(r)) for r in range(world)]), \
            lambda: comm.all_gather(torch.full((n,), value(rank)), out=out)
    if collective == "all_to_all":  # block p of rank r: value(r) + 100 p
        out = torch.empty(world * n)
        return out, torch.cat([torch.full((n,), value(s) + 100 * rank) for s in range(world)]), \
            lambda: comm.all_to_all(torch.cat([torch.full((n,), value(rank) + 100 * p) for p in range(world)]), out=out)
    if collective == "all_to_all_v":  # rank r sends n / 4 + r + p elements of value(r) + 100 p to rank p
        send, recv = [n // 4 + rank + p for p in range(world)], [n // 4 + s + rank for s in range(world)]
        out = torch.empty(sum(recv))
        return out, torch.cat([torch.full((m,), value(s) + 100 * rank) for s, m in enumerate(recv)]), \
            lambda: comm.all_to_all(torch.cat([torch.full((m,), value(rank) + 100 * p) for p, m in enumerate(send)]),
                                    out=out, input_split_sizes=send, output_split_sizes=recv)
    total = torch.full((n,), sum(value(r) for r in range(world)))
    if collective == "reduce_scatter":
        out = torch.empty(n)
        return out, total, lambda: comm.reduce_scatter(torch.full((world * n,), value(rank)), out=out)
    x = torch.full((n,), value(rank))
    return x, total, lambda: comm.all_reduce(x, out=x)


def _victim_loop(store, rank, world, net, how, timeout_s, collective):
    """Every rank loops on calls of `collective` on finite data; the last rank is SIGKILLed, or SIGSTOPped for
    4 s, at a moment its own timer picks (mostly inside a call). Returns each call's outcome."""
    all_arrived(store, world, "victim")
    if collective == "two_shot":
        os.environ["ROCENANTE_ALGO"] = "twoshot"
    comm = _comm(store, rank, world, timeout_s=timeout_s)
    on_path(comm, net)
    victim = world - 1
    if rank == victim:
        end_this_process_later(how, after_s=0.5)
    outcomes = []  # the calls that returned; the error ends the list
    for i in range(1_000_000):
        out, want, call = _one_call(comm, collective, rank, world, i)
        start = time.monotonic()
        try:
            call()
        except rocenante.RocenanteError as err:
            exact, nan = (out == want), torch.isnan(out)
            assert bool((exact | nan).all()), f"call {i}: an element is neither exact nor NaN"
            elapsed = time.monotonic() - start
            with pytest.raises(type(err)) as again:
                comm.all_reduce(torch.ones(4))
            assert str(again.value) == str(err), "a later call must raise the original fault"
            return outcomes, type(err).__name__, str(err), elapsed
        assert torch.equal(out, want), f"call {i} returned a wrong result without an error"
        outcomes.append(i)
    raise AssertionError("the loop never faulted")


# One-shot all-reduces at worlds 2 and 3; the sharded collectives at world 3.
VICTIM_CASES = [(2, "all_reduce"), (3, "all_reduce"), (3, "two_shot"), (3, "reduce_scatter"), (3, "all_gather"),
                (3, "all_to_all"), (3, "all_to_all_v")]


def _victim_case(collective):
    """The suffix of the case's figures' names."""
    return "" if collective == "all_reduce" else f"_{collective}"


def _figure(net: str, name: str) -> str:
    return f"cpu_{net}_{name}" if net else f"cpu_{name}"


@pytest.mark.parametrize("world, collective", VICTIM_CASES)
def test_killed_peer_is_noticed_within_two_seconds_whatever_the_timeout(net, world, collective):
    suffix = _victim_case(collective)
    results = run_ranks(world, _victim_loop, net, "kill", 60.0, collective, timeout=120)
    assert results[-1] == ("died", -signal.SIGKILL), results[-1]
    for rank, (outcomes, kind, message, elapsed) in enumerate(expect_ok(results[:-1])):
        assert outcomes, f"rank {rank} never completed a call before the kill"
        assert kind == "PeerAbortedError", message
        if net:  # its connection closing (the wire) or its process ending (the watchdog), seen here or told
            assert f"rank {world - 1}" in message, message
        else:  # seen itself, or told by a peer
            assert f"rank {world - 1}'s process ended" in message, message
        record_figure(_figure(net, f"killed_peer_detect_s_world{world}_rank{rank}{suffix}"), elapsed)
        assert elapsed < 2.0, f"rank {rank} took {elapsed:.2f} s to notice (timeout 60 s)"


def _names_among_waited_for(message: str, rank: int) -> bool:
    return re.search(rf"rank\(s\)( \d)* {rank}\b", message) is not None


@pytest.mark.parametrize("world, collective", VICTIM_CASES)
def test_stopped_peer_times_out_and_learns_of_it_when_continued(net, world, collective):
    suffix = _victim_case(collective)
    results = expect_ok(run_ranks(world, _victim_loop, net, "stop", 2.0, collective, timeout=120))
    for rank, (outcomes, kind, message, elapsed) in enumerate(results[:-1]):
        assert outcomes, f"rank {rank} never completed a call before the stop"
        # The first survivor to time out tells the others, who may hear it before their own timeout.
        assert kind == "PeerTimeoutError", message
        if net:
            # The victim among the ranks waited for: a survivor whose peer did not get the victim's last delivery
            # before it stopped waits for that peer too.
            assert _names_among_waited_for(message, world - 1), message
        else:
            assert f"rank(s) {world - 1}" in message or "timed out waiting for rank(s)" in message, message
        record_figure(_figure(net, f"stopped_peer_detect_s_timeout_2s_world{world}_rank{rank}{suffix}"), elapsed)
        assert elapsed < 2.0 + 1.0, f"rank {rank} waited {elapsed:.2f} s with a 2 s timeout"
    _, kind, message, _ = results[-1]
    if not net:
        assert kind == "PeerTimeoutError", message
        assert f"aborted the communicator: a wait for rank(s) {world - 1}" in message, message
        return
    # Continued, the victim learns that the call failed: from a survivor's abort word, or its own wait (stopped
    # longer than the timeout) expires first, or the survivors have ended and it sees their processes or
    # connections gone. Which comes first is a race among its threads once continued; shared memory, where the
    # abort word is already in place, has none.
    told = "aborted the communicator: a wait for rank(s)" in message and _names_among_waited_for(message, world - 1)
    gone = kind == "PeerAbortedError" and ("process ended" in message or "connection closed" in message)
    assert told or gone or "timed out after 2 s waiting for rank(s)" in message, message


def _abort_policy(store, rank, world):
    os.environ["ROCENANTE_ON_FAULT"] = "abort"
    comm = _comm(store, rank, world)
    comm.all_reduce(torch.ones(8))
    if rank == 1:
        os._exit(0)
    comm.all_reduce(torch.ones(8))  # meets the exit: logged, then SIGABRT
    raise AssertionError("the call returned")


def test_abort_policy_ends_the_survivor_with_sigabrt_after_logging(capfd):
    start = time.monotonic()
    results = run_ranks(2, _abort_policy, timeout=60)
    assert results == [("died", -signal.SIGABRT), ("died", 0)], results
    assert time.monotonic() - start < 30
    err = capfd.readouterr().err
    assert "rocenante: rank 0: call 2: rank 1's process ended" in err and "ROCENANTE_ON_FAULT=abort" in err, err


def _refused_on_one_rank(store, rank, world, net, rounds):
    outcomes = []
    for i in range(rounds):
        comm = on_path(_comm(store, rank, world), net)
        x = torch.ones(4, 4)
        start = time.monotonic()
        try:
            comm.all_reduce(x.t() if rank == 1 else x)  # rank 1 alone passes a non-contiguous tensor
        except (ValueError, rocenante.RocenanteError) as err:
            outcomes.append((type(err).__name__, str(err), time.monotonic() - start))
        else:
            raise AssertionError("the call returned although rank 1 refused it")
        all_arrived(store, world, f"round {i}")  # rank 1 closes (and its connections end) after rank 0 heard it
        comm.close()
    return outcomes


@pytest.mark.parametrize("net, rounds", [("", 1), ("tcp", 6)], indirect=["net"], ids=["direct", "tcp"])
def test_a_call_one_rank_refuses_fails_on_every_rank_at_once(net, rounds):
    # Over the TCP wire an abort slot lands in quarters, in random order, 2 ms apart (csrc/transport/tcp.cc): a
    # rank that decoded the word before its slot was whole (layout.h, Abort words) would name no refusal in about
    # half of the rounds.
    outcomes0, outcomes1 = expect_ok(run_ranks(2, _refused_on_one_rank, net, rounds))
    for (kind0, message0, elapsed0), (kind1, message1, _) in zip(outcomes0, outcomes1):
        assert kind1 == "InvalidArgument" and "non-contiguous" in message1, message1
        assert kind0 == "PeerAbortedError" and "rank 1 aborted" in message0 and "rank 1 refused a call" in message0, message0
        assert elapsed0 < 2.0, f"rank 0 waited {elapsed0:.2f} s (timeout 60 s) for a call rank 1 had refused"


def _interrupted(store, rank, world):
    comm = _comm(store, rank, world)
    if rank == 0:
        # Python's own Ctrl-C handling, whatever the process that started this one had set or blocked.
        inherited = signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, [])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        try:
            comm.all_reduce(torch.ones(100))  # rank 1 is late: this waits until Ctrl-C
        except KeyboardInterrupt as err:
            return type(err).__name__, time.monotonic() - start
        finally:
            store.set("rank 0 is done", "1")
        raise AssertionError(f"the call returned after {time.monotonic() - start:.2f} s, not interrupted "
                             f"(SIGINT handler and blocked signals as inherited: {inherited})")
    store.wait(["rank 0 is done"])  # late by construction, however slowly rank 0 got to its call
    # Rank 0 pushed its input before it was interrupted, but its abort word is here too: the group has faulted,
    # so this call raises before it starts, its output poisoned, instead of completing with rank 0's data.
    start = time.monotonic()
    out = torch.empty(100)
    try:
        comm.all_reduce(torch.ones(100), out=out)
    except rocenante.RocenanteError as err:
        assert torch.isnan(out).all(), "the refused call's output is not poisoned"
        return type(err).__name__, str(err), time.monotonic() - start
    raise AssertionError("a call after rank 0 was interrupted returned")


def test_ctrl_c_interrupts_a_wait_and_the_peer_is_told():
    (kind0, elapsed0), (kind1, message1, elapsed1) = expect_ok(run_ranks(2, _interrupted))
    assert kind0 == "Interrupted" and 0.4 < elapsed0 < 1.5, (kind0, elapsed0)  # a KeyboardInterrupt
    assert kind1 == "PeerAbortedError" and "rank 0 was interrupted by a signal" in message1, message1
    assert elapsed1 < 1.0, elapsed1


def _broken_group(store, rank, world):
    import torch.distributed as dist

    dist.init_process_group("rocenante", store=store, rank=rank, world_size=world)
    x = torch.ones(8)
    dist.all_reduce(x)
    if rank == 1:
        dist.barrier()
        os._exit(0)  # leaves without a word
    dist.barrier()
    time.sleep(0.5)
    errors = []
    for collective in (
        lambda: dist.all_reduce(torch.ones(8)),         # rocenante's own path: meets the fault
        lambda: dist.all_reduce(torch.ones(8)),         # the same fault again, not ClosedError
        lambda: dist.broadcast(torch.ones(8), src=0),   # delegated to gloo: raises it too
        lambda: dist.all_reduce(torch.ones(8), async_op=True).wait(),
    ):
        try:
            collective()
            errors.append(None)
        except rocenante.RocenanteError as err:
            errors.append(str(err))
    return errors


def test_a_broken_backend_group_raises_the_original_fault_for_every_collective():
    errors = run_ranks(2, _broken_group, timeout=120)[0]
    assert isinstance(errors, list), errors
    assert errors[0] is not None and "rank 1's process ended" in errors[0], errors
    assert all(e == errors[0] for e in errors), errors


def _every_collective_after_a_mismatch(store, rank, world):
    """Both ranks fault alike (a call mismatch), then try every collective: each must raise that fault."""
    import torch.distributed as dist

    dist.init_process_group("rocenante", store=store, rank=rank, world_size=world)
    try:
        dist.all_reduce(torch.ones(8 + rank))
    except rocenante.CallMismatchError as err:
        fault = str(err)
    x, flat = torch.ones(4), torch.ones(4 * world)
    parts = [torch.ones(4) for _ in range(world)]
    collectives = {
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(4 * world), x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(x, flat),
        "reduce": lambda: dist.reduce(x, dst=0),
        "gather": lambda: dist.gather(x, parts if rank == 0 else None, dst=0),
        "scatter": lambda: dist.scatter(x, parts if rank == 0 else None, src=0),
        "all_to_all": lambda: dist.all_to_all([torch.empty(4) for _ in range(world)], parts),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(4 * world), flat),
        "all_gather": lambda: dist.all_gather([torch.empty(4) for _ in range(world)], x),
        "reduce_scatter": lambda: dist.reduce_scatter(x, parts),
        "broadcast": lambda: dist.broadcast(x, src=0),
        "float64 all_reduce": lambda: dist.all_reduce(torch.ones(4, dtype=torch.float64)),
        "barrier": lambda: dist.barrier(),
        "send or recv": lambda: dist.send(x, 1) if rank == 0 else dist.recv(x, 0),
    }
    wrong = []
    for name, collective in collectives.items():
        try:
            collective()
            wrong.append(f"{name} ran")
        except rocenante.RocenanteError as err:
            if str(err) != fault:
                wrong.append(f"{name}: {err}")
    dist.destroy_process_group()
    return wrong


def test_a_faulted_group_raises_its_fault_for_every_collective():
    for rank, wrong in enumerate(expect_ok(run_ranks(2, _every_collective_after_a_mismatch, timeout=120))):
        assert wrong == [], f"rank {rank}: {wrong}"


def _ended_and_late_before_forwarding(store, rank, world):
    """World 3, two-shot over shared memory: after the pushes of call 2, rank 2 ends and rank 1 stops (continued
    6 s later), neither having forwarded its reduced shard; rank 0 has reduced its own and gathers. It must fail at
    once naming rank 2, whose process ended, not wait for rank 1 first (a gather that waited peer by peer did,
    until rank 1 came back). Returns (the error, seconds the call took). Over a network wire the same stop may land
    before the proxy delivered rank 1's push, and the call then needs only rank 1, alive: a timeout by design."""
    import subprocess

    os.environ["ROCENANTE_ALGO"] = "twoshot"
    comm = on_path(_comm(store, rank, world, timeout_s=20.0), "")
    inputs = [make_input(31, 0, r, 8192, torch.float32) for r in range(world)]
    comm.all_reduce(inputs[rank])  # call 1: everyone is there
    if rank == 2:
        rocenante._C._test_stop_after_push(1, kill=True)
    elif rank == 1:
        subprocess.Popen(["sh", "-c", f"sleep 6; kill -CONT {os.getpid()}"])
        rocenante._C._test_stop_after_push(1, kill=False)
    start = time.monotonic()
    try:
        comm.all_reduce(inputs[rank])
        return "returned", time.monotonic() - start
    except rocenante.RocenanteError as err:
        return str(err), time.monotonic() - start


def test_a_peer_that_ended_fails_the_gather_though_another_is_late():
    results = run_ranks(3, _ended_and_late_before_forwarding, timeout=60)
    message, seconds = results[0]
    assert "rank 2" in message and "ended" in message, message
    assert seconds < 3.0, f"rank 0 took {seconds:.1f} s (rank 1 came back after 6 s): it waited for the late peer"
    assert results[2] == ("died", -9), results[2]
