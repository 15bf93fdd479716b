"""The network path with CPU tensors, over the TCP software wire (ROCENANTE_NET=tcp, csrc/transport/tcp.cc):
every peer through the proxy and a loopback TCP connection, each delivery placed in random order word by word.
The bodies are those of the shared-memory tests (test_cpu_allreduce.py, test_cpu_faults.py), run over the wire."""

from __future__ import annotations

import os
import re
import signal
import socket
import struct
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rocenante
from rocenante import _C
from multiproc import expect_ok, record_figure, run_ranks
from probes import host_probe
from test_cpu_allreduce import CAPACITY, _back_to_back, every_dtype_op_size
from test_cpu_faults import _victim_loop
from test_cpu_hostile import HEADER


@pytest.fixture(autouse=True)
def _tcp_wire(monkeypatch):
    monkeypatch.setenv("ROCENANTE_NET", "tcp")  # inherited by the ranks' processes


def _every_dtype_op_size(store, rank, world, seed):
    with rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=60) as comm:
        assert comm.net == "tcp", f"ROCENANTE_NET=tcp built a {comm.net!r} communicator"
        return every_dtype_op_size(comm, rank, world, seed, random_sizes=1)  # the edges of a piece, and one more


@pytest.mark.parametrize("world", [2, 3])
def test_every_dtype_op_and_size_over_tcp_matches_reference_on_every_rank(world):
    results = expect_ok(run_ranks(world, _every_dtype_op_size, 2000 + world, timeout=180))
    assert all(r == results[0] for r in results[1:]), "ranks produced different bits"


def test_back_to_back_calls_over_tcp():
    assert expect_ok(run_ranks(2, _back_to_back, 3000, timeout=180)) == [3000, 3000]


def _open_close(store, rank, world, cycles):
    """Fds and threads of this process after `cycles` communicators were built, used and closed, against after
    the first one (which loads what stays loaded)."""

    def cycle(i):
        with rocenante.Communicator(store, rank, world, capacity_bytes=4096, timeout_s=30) as comm:
            assert torch.equal(comm.all_reduce(torch.full((3,), float(i))), torch.full((3,), float(i * world)))

    def held():
        return host_probe()["fds"], len(os.listdir("/proc/self/task"))

    cycle(0)
    before = held()
    for i in range(1, cycles):
        cycle(i)
    return before, held()


def test_open_close_cycles_over_tcp_leave_no_fd_or_thread():
    for before, after in expect_ok(run_ranks(3, _open_close, 20, timeout=180)):
        assert after == before, f"(fds, threads) {before} -> {after}"


@pytest.mark.parametrize("world", [2, 3])
def test_killed_peer_over_tcp_fails_every_survivor_naming_it(world):
    results = run_ranks(world, _victim_loop, "kill", 60.0, timeout=120)
    assert results[-1] == ("died", -signal.SIGKILL), results[-1]
    for rank, (outcomes, kind, message, elapsed) in enumerate(expect_ok(results[:-1])):
        assert outcomes, f"rank {rank} never completed a call before the kill"
        assert kind == "PeerAbortedError", message
        # Its connection closing (the wire) or its process ending (the watchdog), seen here or told by a peer.
        assert f"rank {world - 1}" in message, message
        record_figure(f"cpu_tcp_killed_peer_detect_s_world{world}_rank{rank}", elapsed)
        assert elapsed < 2.0, f"rank {rank} took {elapsed:.2f} s to notice (timeout 60 s)"


def _names_among_waited_for(message: str, rank: int) -> bool:
    return re.search(rf"rank\(s\)( \d)* {rank}\b", message) is not None


@pytest.mark.parametrize("world", [2, 3])
def test_stopped_peer_over_tcp_times_out_naming_it(world):
    results = expect_ok(run_ranks(world, _victim_loop, "stop", 2.0, timeout=120))
    for rank, (outcomes, kind, message, elapsed) in enumerate(results[:-1]):
        assert outcomes, f"rank {rank} never completed a call before the stop"
        assert kind == "PeerTimeoutError", message
        # The victim among the ranks waited for: a survivor whose peer did not get the victim's last delivery
        # before it stopped waits for that peer too.
        assert _names_among_waited_for(message, world - 1), message
        record_figure(f"cpu_tcp_stopped_peer_detect_s_timeout_2s_world{world}_rank{rank}", elapsed)
        assert elapsed < 2.0 + 1.0, f"rank {rank} waited {elapsed:.2f} s with a 2 s timeout"
    # Continued, the victim learns that the call failed: from a survivor's abort word, or its own wait (stopped
    # longer than the timeout) expires first, or the survivors have ended and it sees their processes or
    # connections gone. Which comes first is a race among its threads once continued; shared memory, where the
    # abort word is already in place, has none.
    _, kind, message, _ = results[-1]
    told = "aborted the communicator: a wait for rank(s)" in message and _names_among_waited_for(message, world - 1)
    gone = kind == "PeerAbortedError" and ("process ended" in message or "connection closed" in message)
    assert told or gone or "timed out after 2 s waiting for rank(s)" in message, message


# Hostile handles: rank 0 and rank 1 of one world in this process, rank 1's wire handle tampered with. The wire's
# handle (csrc/transport/tcp.cc, TcpHandle) follows the communicator's HEADER bytes: magic "RTC1", world,
# region bytes, nonce, port, rank.
_WIRE = struct.Struct("<IIQQII")


@pytest.fixture
def tcp_pair():
    me, peer = (_C.Communicator(r, 2, -1, 4096, 5.0, _C.OnFault.raise_, _C.Net.tcp) for r in (0, 1))
    yield me, peer.local_handle()
    me.close()
    peer.close()


def _tampered(handle: bytes, **fields) -> bytes:
    names = ["magic", "world", "region_bytes", "nonce", "port", "rank"]
    values = dict(zip(names, _WIRE.unpack(handle[HEADER:])))
    values.update(fields)
    return handle[:HEADER] + _WIRE.pack(*(values[n] for n in names))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "tamper, words",
    [
        (lambda h: h[:HEADER], "TCP wire handle of 0 bytes, expected 32"),
        (lambda h: h[:HEADER] + b"garbage", "TCP wire handle of 7 bytes"),
        (lambda h: h + b"\x00", "TCP wire handle of 33 bytes"),
        (lambda h: _tampered(h, magic=0x52494231), "not a TCP wire's"),  # an RDMA handle's magic
        (lambda h: _tampered(h, world=3), "configurations differ"),
        (lambda h: _tampered(h, region_bytes=1 << 40), "configurations differ"),
        (lambda h: _tampered(h, rank=0), "for rank 0"),
        (lambda h: _tampered(h, port=0), "port 0, not a listening port"),
        (lambda h: _tampered(h, port=70000), "port 70000"),
        (lambda h: _tampered(h, port=_closed_port()), "Connection refused"),
    ],
)
def test_hostile_tcp_handle_is_refused_at_once_naming_both_ranks(tcp_pair, tamper, words):
    me, theirs = tcp_pair
    start = time.monotonic()
    with pytest.raises(rocenante.RocenanteError) as err:
        me.connect([me.local_handle(), tamper(theirs)])
    assert "rank 0: rank 1" in str(err.value) and words in str(err.value), str(err.value)
    assert time.monotonic() - start < 1.0, "a hostile handle must fail at once, not at the connection timeout"


@pytest.mark.parametrize(
    "hello, words",
    [
        (lambda nonce: struct.pack("<IIQ", 0x52544348, 1, nonce ^ 1), "from rank 1 carries another nonce"),
        (lambda nonce: struct.pack("<IIQ", 0x52544348, 5, nonce), "claims rank 5"),
        (lambda nonce: struct.pack("<IIQ", 0x52544348, 0, nonce), "claims rank 0"),
        (lambda nonce: b"GET / HTTP/1.0\r\n\r\n", "is not from rocenante's TCP wire"),
    ],
)
def test_stray_connection_to_the_wire_is_refused(tcp_pair, hello, words):
    """Someone else connects to rank 0's port first; connect() refuses it, and a retry leaves no fd behind."""
    me, theirs = tcp_pair
    mine = me.local_handle()
    port, nonce = _WIRE.unpack(mine[HEADER:])[4], _WIRE.unpack(mine[HEADER:])[3]
    fds = host_probe()["fds"]
    with socket.create_connection(("127.0.0.1", port)) as stray:
        stray.sendall(hello(nonce))  # queued before rank 0 accepts: connect() holds the GIL
        with pytest.raises(rocenante.RocenanteError, match=words) as err:
            me.connect([mine, theirs])
    assert str(err.value).startswith("rank 0: a connection to its TCP wire"), str(err.value)
    assert host_probe()["fds"] == fds, "a refused connect() left an fd open"


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_tcp_handle_never_crashes(tcp_pair, data):
    me, theirs = tcp_pair
    wire = data.draw(st.one_of(
        st.binary(max_size=64),
        st.builds(lambda cut, tail: theirs[HEADER:HEADER + cut] + tail, st.integers(0, 32), st.binary(max_size=40)),
    ))
    if wire == theirs[HEADER:]:
        return
    with pytest.raises(rocenante.RocenanteError) as err:
        me.connect([me.local_handle(), theirs[:HEADER] + wire])
    assert "rank 1" in str(err.value) and len(str(err.value)) < 1000, str(err.value)
