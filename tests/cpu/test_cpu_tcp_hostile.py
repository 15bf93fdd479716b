"""The TCP software wire (ROCENANTE_NET=tcp, csrc/transport/tcp.cc) against hostile peers: tampered wire handles
and stray connections to its port are refused at once, naming the ranks, and leave no fd behind. Its calls,
faults and cycles are the shared-memory tests' own, run over the wire (the `net` parameter of
test_cpu_allreduce.py and test_cpu_faults.py)."""

from __future__ import annotations

import socket
import struct
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rocenante
from rocenante import _C
from probes import host_probe

HEADER = _C.layout.handle_header_bytes  # the communicator's configuration and identity, in front of the wire's handle


# Hostile handles: rank 0 and rank 1 of one world in this process, rank 1's wire handle tampered with. The wire's
# handle (csrc/transport/tcp.cc, TcpHandle) follows the communicator's HEADER bytes: magic "RTC1", world,
# region bytes, nonce, port, rank.
_WIRE = struct.Struct("<IIQQII")


@pytest.fixture
def tcp_pair():
    me, peer = (_C.Communicator(r, 2, -1, 4096, 5.0, _C.OnFault.raise_, _C.Net.tcp) for r in (0, 1))
    theirs = peer.local_handle()
    assert len(theirs) == HEADER + _WIRE.size and _WIRE.unpack(theirs[HEADER:])[0] == _C.layout.tcp_handle_magic, \
        "the wire's handle is not the one this test tampers with"
    yield me, theirs
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
        (lambda h: h[:HEADER], f"TCP wire handle of 0 bytes, expected {_WIRE.size}"),
        (lambda h: h[:HEADER] + b"garbage", "TCP wire handle of 7 bytes"),
        (lambda h: h + b"\x00", f"TCP wire handle of {_WIRE.size + 1} bytes"),
        (lambda h: _tampered(h, magic=_C.layout.rdma_handle_magic), "not a TCP wire's"),  # an RDMA handle's magic
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
        (lambda nonce: struct.pack("<IIQ", _C.layout.tcp_hello_magic, 1, nonce ^ 1), "from rank 1 carries another nonce"),
        (lambda nonce: struct.pack("<IIQ", _C.layout.tcp_hello_magic, 5, nonce), "claims rank 5"),
        (lambda nonce: struct.pack("<IIQ", _C.layout.tcp_hello_magic, 0, nonce), "claims rank 0"),
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
        st.builds(lambda cut, tail: theirs[HEADER:HEADER + cut] + tail, st.integers(0, _WIRE.size),
                  st.binary(max_size=40)),
    ))
    if wire == theirs[HEADER:]:
        return
    with pytest.raises(rocenante.RocenanteError) as err:
        me.connect([me.local_handle(), theirs[:HEADER] + wire])
    assert "rank 1" in str(err.value) and len(str(err.value)) < 1000, str(err.value)
