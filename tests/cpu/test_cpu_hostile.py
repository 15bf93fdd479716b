"""Hostile or malformed values in the rendezvous store, and out-of-range timeouts: every one is a clear error
naming the rank that published it (or the variable), never a crash, a hang or a wrong mapping."""

from __future__ import annotations

import itertools
import math
import os
import struct
import time
from multiprocessing import shared_memory

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rocenante
from rocenante import _C, _env
from multiproc import expect_ok, run_ranks

CAPACITY = 4096
# A handle: the core's Config (magic, world, capacity, on_gpu, first call, network signal, two-shot size), its
# Identity (pid as an int64, the process's start time), then the transport's handle.
CONFIG = _C.layout.config_bytes
DEVICE, FIRST_CALL, SIGNAL, TWOSHOT, PID = CONFIG - 16, CONFIG - 12, CONFIG - 8, CONFIG - 4, CONFIG
HEADER = _C.layout.handle_header_bytes
OURS = _C.layout.config_magic.to_bytes(4, "big").decode()  # e.g. "ROCB"
_names = itertools.count()


def _core(rank: int, world: int = 2):
    return _C.Communicator(rank, world, -1, CAPACITY, 5.0, _C.OnFault.raise_)


@pytest.fixture
def pair():
    """Rank 0 and rank 1 of one world in this process: rank 1's handle is the well-formed one to tamper with."""
    me, peer = _core(0), _core(1)
    yield me, peer.local_handle()
    me.close()
    peer.close()


def _with_magic(handle: bytes, magic: bytes) -> bytes:
    assert handle[:4] == struct.pack("<I", _C.layout.config_magic)
    return magic[::-1] + handle[4:]  # the magic is a little-endian word: "ROC9" travels as b"9COR"


def _refused(me, theirs: bytes, words: str = "") -> str:
    with pytest.raises((rocenante.RocenanteError, ValueError)) as err:
        me.connect([me.local_handle(), theirs])
    assert "rank 1" in str(err.value), str(err.value)
    assert words in str(err.value), str(err.value)
    assert len(str(err.value)) < 1000, "a hostile value must not flood the message"
    return str(err.value)


def test_another_version_is_named_as_such(pair):
    me, theirs = pair
    _refused(me, _with_magic(theirs, b"ROC1"), f"rank 1 runs another rocenante version (protocol ROC1, this rank {OURS})")


@pytest.mark.parametrize(
    "tamper, words",
    [
        (lambda h: b"", "0 bytes"),
        (lambda h: h[:3], "3 bytes"),
        (lambda h: b"\xff" * 64, "not a rocenante handle"),
        (lambda h: h[:HEADER - 1], "truncated"),
        (lambda h: h[:FIRST_CALL] + struct.pack("<I", _C.layout.epoch_period) + h[FIRST_CALL + 4:],
         "malformed configuration"),  # a first call number past the period
        (lambda h: h[:FIRST_CALL] + struct.pack("<I", 7) + h[FIRST_CALL + 4:],
         "first call 7, network signal flag, two-shot never; this rank"),
        (lambda h: h[:DEVICE] + b"\x07" + h[DEVICE + 1:], "malformed configuration"),  # on_gpu
        (lambda h: h[:SIGNAL] + struct.pack("<I", 9) + h[SIGNAL + 4:], "malformed configuration"),
        (lambda h: h[:TWOSHOT] + struct.pack("<I", 1) + h[TWOSHOT + 4:], "two-shot from 1 bytes; this rank"),
        (lambda h: h[:SIGNAL] + struct.pack("<I", 1) + h[SIGNAL + 4:], "network signal completion, two-shot never; this rank"),
        (lambda h: h[:PID] + struct.pack("<q", -1) + h[PID + 8:], "process id -1"),
        (lambda h: h[:PID] + struct.pack("<q", 2**40) + h[PID + 8:], "process id"),
        (lambda h: h[:HEADER], "shared-memory name"),
        (lambda h: h[:HEADER] + b"/dev/shm/x", "shared-memory name"),
        (lambda h: h + b"/../../etc/passwd", "shared-memory name"),
        (lambda h: h + b"\x00junk", "shared-memory name"),
        (lambda h: h + b"\xff", "shared-memory name"),
        (lambda h: h + b"x" * 300, "shared-memory name"),
        (lambda h: h[:HEADER] + b"/rocenante-gone-r1", "cannot be opened"),
    ],
)
def test_malformed_peer_handle_is_refused_naming_the_rank(pair, tamper, words):
    me, theirs = pair
    _refused(me, tamper(theirs), words)


def test_peer_handle_naming_this_ranks_own_segment_is_refused(pair):
    me, theirs = pair
    own = me.local_handle()
    _refused(me, theirs[:HEADER] + own[HEADER:], "same region")
    _refused(me, theirs[:HEADER] + own[HEADER:] + b"\x00", "shared-memory name")  # what shm_open would truncate


def test_foreign_segment_of_the_right_size_is_refused(pair):
    me, theirs = pair
    size = os.stat("/dev/shm" + theirs[HEADER:].decode()).st_size
    foreign = shared_memory.SharedMemory(name=f"hostile-{os.getpid()}", create=True, size=size)
    try:
        _refused(me, theirs[:HEADER] + b"/" + foreign.name.lstrip("/").encode(), "shared-memory name")
    finally:
        foreign.close()
        foreign.unlink()


def test_own_key_overwritten_is_refused(pair):
    me, theirs = pair
    with pytest.raises(rocenante.RocenanteError, match="rank 0"):
        me.connect([theirs, theirs])


# Fuzzing: arbitrary bytes, and well-formed headers in front of arbitrary or nearly-right names.
_names_like_ours = st.builds(
    lambda head, tail: head + tail,
    st.sampled_from([b"", b"/", b"/rocenante-", b"/rocenante-1-2-r1"]),
    st.binary(max_size=300),
)


@settings(max_examples=3000, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_connect_never_crashes(pair, data):
    me, theirs = pair
    hostile = data.draw(
        st.one_of(
            st.binary(max_size=200),
            st.builds(lambda cut, tail: theirs[:cut] + tail, st.integers(0, HEADER), st.binary(max_size=64)),
            st.builds(lambda name: theirs[:HEADER] + name, _names_like_ours),
            st.builds(lambda name: theirs[:HEADER] + name, st.sampled_from([theirs[HEADER:], me.local_handle()[HEADER:]])
                      .flatmap(lambda own: st.builds(lambda extra: own + extra, st.binary(min_size=1, max_size=8)))),
        )
    )
    _refused(me, hostile)


# The same through the rendezvous: hostile bytes published under the peer's keys of a real store.
def _build(store, name: str, timeout_s: float = 2.0):
    return rocenante.Communicator(store, 0, 2, capacity_bytes=CAPACITY, timeout_s=timeout_s, name=name)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return dist.FileStore(str(tmp_path_factory.mktemp("hostile") / "store"), 2)


@settings(max_examples=1000, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(["handle", "failed", "host"]), value=st.binary(max_size=20000))
def test_fuzz_rendezvous_never_crashes(store, key, value):
    name = f"fuzz{next(_names)}"
    if key != "host":  # the peer's host record comes first: a well-formed one, this host's
        store.set(f"rocenante/{name}/2/0/host/1", f"{_env.host_id()}||peer")
    store.set(f"rocenante/{name}/2/0/{key}/1", value)
    start = time.monotonic()
    with pytest.raises(rocenante.RocenanteError) as err:
        _build(store, name)
    assert time.monotonic() - start < 1.5, "a hostile value must fail at once, not at the timeout"
    assert "rank 1" in str(err.value), str(err.value)
    assert len(str(err.value)) < 3000, "a hostile failure message must be cut short"


def test_failure_message_is_decoded_safely_and_cut(store):
    name = f"msg{next(_names)}"
    store.set(f"rocenante/{name}/2/0/failed/1", b"bad \xff\x1b[2J" + b"x" * 100000)
    with pytest.raises(rocenante.RocenanteError, match=r"rank 1 failed to set up the communicator: bad \\xff\\x1b") as err:
        _build(store, name)
    assert "100009 bytes" in str(err.value) and len(str(err.value)) < 3000


def test_corrupt_ticket_counter_is_a_clear_error(store):
    name = f"ticket{next(_names)}"
    store.set(f"rocenante/{name}/2/tickets", b"many")
    with pytest.raises(rocenante.RocenanteError, match=f"rocenante/{name}/2/tickets"):
        _build(store, name)
    store.set(f"rocenante/{name}/2/tickets", b"-7")
    with pytest.raises(rocenante.RocenanteError, match="ticket -6"):
        _build(store, name)


# Timeouts: larger than nanoseconds can count (clamped), NaN (refused before anything is published).
def _long_timeout(store, rank, world, timeout_s, env):
    if env is not None:
        os.environ["ROCENANTE_TIMEOUT_S"] = env
    with rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=timeout_s) as comm:
        got = [comm.all_reduce(torch.full((100,), float(rank + i))) for i in range(20)]
        return comm.timeout_s, [t[0].item() for t in got]


@pytest.mark.parametrize("timeout_s, env", [(1e10, None), (math.inf, None), (None, "1e10"), (None, "inf")])
def test_huge_timeout_is_clamped_and_calls_work(timeout_s, env):
    results = expect_ok(run_ranks(2, _long_timeout, timeout_s, env, timeout=120))
    for effective, sums in results:
        assert effective == _C.max_timeout_s
        assert sums == [float(1 + 2 * i) for i in range(20)]


def test_nan_timeout_is_refused_before_touching_the_store(store, monkeypatch):
    name = f"nan{next(_names)}"
    with pytest.raises(ValueError, match="timeout_s=nan is not a number"):
        _build(store, name, timeout_s=math.nan)
    monkeypatch.setenv("ROCENANTE_TIMEOUT_S", "nan")
    with pytest.raises(ValueError, match="ROCENANTE_TIMEOUT_S='nan' is not a number"):
        rocenante.Communicator(store, 0, 2, capacity_bytes=CAPACITY, name=name)
    assert not store.check([f"rocenante/{name}/2/tickets"]), "a refused timeout must not draw a ticket"
    with pytest.raises(ValueError, match="timeout is NaN"):
        _C.Communicator(0, 1, -1, CAPACITY, math.nan, _C.OnFault.raise_)
