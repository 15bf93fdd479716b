"""An independent peer written with pyverbs (rdma-core's own binding) joins a 2-rank communicator as rank 1:
it publishes its ports through rocenante's own exchange (communicator._exchange: the route choice is _ib's), a
handle in rocenante's format, RDMA-writes its call word and data into rank 0's region, signals
them, and reads what rank 0 wrote into its own region once rank 0's signal arrived. The signal, as
ROCENANTE_IB_SIGNAL says: "flag" (default), an 8-byte RDMA WRITE of the call's number into both rail words of
the receiver's flag for this buffer and sender (one rail: ROCENANTE_IB_HCA lists one device), after the data on the
same queue pair, which the receiver polls in its memory; "completion", a zero-length RDMA WRITE WITH IMMEDIATE carrying the sender's signal count. Every offset
and format of the region and the wire below is derived here from what csrc/layout.h and
csrc/transport/ibverbs.cc document (wire protocol v2, Lamport format for float32), not from rocenante's code
(protocol ROCB: abort words, the flags' two lines, then each buffer's call words on a 128-byte line of their own), so
this checks the wire layout and the signalling against rdma-core's binding; only the handle's framing (the
core's magics and header sizes) comes from rocenante._C.layout."""

from __future__ import annotations

import os
import re
import socket
import struct
import sys
import tempfile
import time

import pytest
import torch

import rocenante
from multiproc import expect_ok, run_ranks
from rocenante import _C, _env, _ib
from rocenante.communicator import _exchange

WORLD, CAPACITY, COUNT, NAME = 2, 1 << 12, 100, "pyverbs-peer"
HEADER, FLAGS, CALL_WORDS, LINE, BUFFERS, MAX_RANKS, RAILS = 1024, 128, 384, 128, 3, 8, 2
ENDPOINT = 40  # bytes: GID, queue pair, PSN, address, key, MTU (a handle holds RAILS per rank)
EMPTY, NO_EPOCH = 0x80000000, 0xFFFFFFFF
REGION = HEADER + BUFFERS * (WORLD - 1) * CAPACITY
EPOCH = 1  # the communicator's first call
BUFFER = EPOCH % BUFFERS


def call_word_offset(buffer: int, source: int) -> int:
    return CALL_WORDS + buffer * LINE + source * 4


def flag_offset(buffer: int, source: int) -> int:
    return FLAGS + (buffer * MAX_RANKS + source) * RAILS * 4


def area_offset(buffer: int, receiver: int, source: int) -> int:
    index = source if source < receiver else source - 1
    return HEADER + (buffer * (WORLD - 1) + index) * CAPACITY


def call_word() -> int:
    signature = ((COUNT - 1) << 5) | (0 << 3) | (0 << 1)  # count - 1, float32, sum, a one-shot all-reduce (csrc/layout.h)
    return (signature ^ (EPOCH << 1)) | 1


def values(rank: int) -> torch.Tensor:
    x = torch.arange(COUNT, dtype=torch.float32) * (rank + 1) + 0.25
    x[7] = -0.0 if rank == 1 else 0.0  # a -0.0 element: sent as +0.0 (layout.h), never the empty word
    return x


def _wait(store, keys, what):
    deadline = time.monotonic() + 120
    while not store.check(keys):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _pyverbs_rank(store, mtu_drop, signal):
    sys.path.append("/usr/lib/python3/dist-packages")  # the system's pyverbs, matching its rdma-core
    import pyverbs.enums as e
    from pyverbs.addr import AHAttr, GID, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.device import Context
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import RecvWR, SGE, SendWR

    prefix = f"rocenante/{NAME}/{WORLD}/{(store.add(f'rocenante/{NAME}/{WORLD}/tickets', 1) - 1) // WORLD}"
    store.set(f"{prefix}/host/1", f"{socket.gethostname()}|ib|pyverbs")
    # The ports and routes, exchanged through the store as a rank does (communicator._exchange).
    gid_index, source = _env.ib_gid_index()
    path = _ib.choose_paths(1, WORLD, _ib.scan(), _env.ib_hca(), gid_index, source or "ROCENANTE_IB_GID_INDEX",
                            _exchange(store, prefix, 1, WORLD, 120.0))[0]
    ctx = Context(name=path.device)
    pd = PD(ctx)
    scq, rcq = CQ(ctx, 8), CQ(ctx, 8)
    qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=scq, rcq=rcq, cap=QPCap(max_send_wr=4, max_recv_wr=4)))
    region = MR(pd, REGION, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
    region.write(bytes(FLAGS) + struct.pack(f"<{(CALL_WORDS - FLAGS) // 4}I", *[NO_EPOCH] * ((CALL_WORDS - FLAGS) // 4)) +
                 struct.pack(f"<{(REGION - CALL_WORDS) // 4}I", *[EMPTY] * ((REGION - CALL_WORDS) // 4)), REGION, 0)
    send = MR(pd, REGION, e.IBV_ACCESS_LOCAL_WRITE)
    port = ctx.query_port(path.port)
    mtu_code = port.active_mtu - mtu_drop  # a crafted value: a port with a smaller MTU than ours
    psn = 0x123456

    # world, capacity, CPU, first call, signal (0 flag, 1 completion), two-shot size (never: the network path)
    config = struct.pack("<IIQiIII", _C.layout.config_magic, WORLD, CAPACITY, 0, 1, ("flag", "completion").index(signal),
                         _C.layout.never)
    identity = struct.pack("<qQ", os.getpid(), 0)  # start time 0: rank 0 does not watch this process
    assert (len(config), len(config + identity)) == (_C.layout.config_bytes, _C.layout.handle_header_bytes)
    gid = bytes.fromhex(path.gid.replace(":", ""))
    endpoint = gid + struct.pack("<IIQII", qp.qp_num, psn, region.buf, region.rkey, mtu_code)
    # Entries [q][k] of a handle are what rank q needs for rail k: ours for rank 0's first rail, the rest unused.
    rdma = struct.pack("<IIQ", _C.layout.rdma_handle_magic, WORLD, REGION)
    assert len(endpoint) == ENDPOINT and _C.layout.max_rails == RAILS
    handle = config + identity + rdma + endpoint + bytes((WORLD * RAILS - 1) * ENDPOINT)
    store.set(f"{prefix}/handle/1", handle)
    _wait(store, [f"{prefix}/handle/0"], "rank 0's handle")
    theirs = store.get(f"{prefix}/handle/0")[_C.layout.handle_header_bytes:]
    assert struct.unpack_from("<IIQ", theirs) == (_C.layout.rdma_handle_magic, WORLD, REGION), \
        "rank 0's RDMA handle header"
    ours = 16 + RAILS * ENDPOINT  # entry [1][0]: rank 0's first rail to us
    dgid, (qpn, their_psn, addr, rkey, mtu) = theirs[ours:ours + 16], struct.unpack_from("<IIQII", theirs, ours + 16)
    assert not any(theirs[ours + ENDPOINT:ours + RAILS * ENDPOINT]), "rank 0 offers a second rail to us"

    attr = QPAttr(qp_state=e.IBV_QPS_INIT)
    attr.qp_access_flags = e.IBV_ACCESS_REMOTE_WRITE
    attr.port_num = path.port
    attr.path_mtu = min(mtu, mtu_code)
    attr.dest_qp_num = qpn
    attr.rq_psn = their_psn
    attr.sq_psn = psn
    attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
    attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.min_rnr_timer = 16, 7, 7, 12
    dest = GID()
    dest.gid = ":".join(dgid.hex()[i:i + 4] for i in range(0, 32, 4))
    attr.ah_attr = AHAttr(gr=GlobalRoute(dgid=dest, sgid_index=path.gid_index, hop_limit=64), is_global=1,
                          port_num=path.port)
    qp.to_init(attr)
    if signal == "completion":  # for rank 0's signal; it places nothing through it (pyverbs wants one SGE anyway)
        qp.post_recv(RecvWR(wr_id=1, num_sge=1, sg=[SGE(send.buf, 0, send.lkey)]))
    qp.to_rts(attr)
    store.set(f"{prefix}/connected/1", "1")
    _wait(store, [f"{prefix}/connected/0"], "rank 0 to connect")

    deadline = time.monotonic() + 60

    def post_and_complete(wr):
        qp.post_send(wr)
        while True:
            n, wcs = scq.poll()
            if n:
                assert wcs[0].status == e.IBV_WC_SUCCESS, f"our RDMA write failed: status {wcs[0].status}"
                return
            assert time.monotonic() < deadline, "no completion for our RDMA write"

    def write(offset, length):
        wr = SendWR(opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[SGE(send.buf + offset, length, send.lkey)],
                    send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(rkey, addr + offset)
        post_and_complete(wr)

    # Our call word, then our data (float32 as is, -0.0 sent as +0.0, padded to 16 bytes), then our signal.
    payload = values(1).numpy().tobytes().replace(struct.pack("<I", EMPTY), bytes(4))
    payload += bytes(-len(payload) % 16)
    send.write(struct.pack("<I", call_word()), 4, call_word_offset(BUFFER, 1))
    send.write(payload, len(payload), area_offset(BUFFER, 0, 1))
    write(call_word_offset(BUFFER, 1), 4)
    write(area_offset(BUFFER, 0, 1), len(payload))
    if signal == "flag":  # after the data, on the same queue pair: every rail's word, as one rail carried it all
        send.write(struct.pack(f"<{RAILS}I", *[EPOCH] * RAILS), 4 * RAILS, flag_offset(BUFFER, 1))
        write(flag_offset(BUFFER, 1), 4 * RAILS)
    else:
        imm = SendWR(opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM, num_sge=1, sg=[SGE(send.buf, 0, send.lkey)],
                     imm_data=socket.htonl(0), send_flags=e.IBV_SEND_SIGNALED)  # zero bytes; our first signal
        imm.set_wr_rdma(rkey, addr)
        post_and_complete(imm)

    # Rank 0's signal, then its call word and data in our region.
    while True:
        if signal == "flag":
            if struct.unpack(f"<{RAILS}I", region.read(4 * RAILS, flag_offset(BUFFER, 0))) == (EPOCH,) * RAILS:
                break
        else:
            n, wcs = rcq.poll()
            if n:
                assert wcs[0].status == e.IBV_WC_SUCCESS and wcs[0].opcode == e.IBV_WC_RECV_RDMA_WITH_IMM, wcs[0].status
                assert socket.ntohl(wcs[0].imm_data) == 0, f"rank 0's first signal carries {socket.ntohl(wcs[0].imm_data)}"
                break
        assert time.monotonic() < deadline, "rank 0's signal never arrived"
    got_call = struct.unpack("<I", region.read(4, call_word_offset(BUFFER, 0)))[0]
    got = region.read(COUNT * 4, area_offset(BUFFER, 1, 0))
    store.set("peer/done", "1")
    _wait(store, ["rank0/done"], "rank 0 to finish")
    for obj in (region, send, qp, scq, rcq, pd, ctx):
        obj.close()
    return got_call == call_word(), got == values(0).numpy().tobytes()


def _rank(store, rank, world, mtu_drop, signal):
    if rank == 1:
        return _pyverbs_rank(store, mtu_drop, signal)
    os.environ["ROCENANTE_IB_SIGNAL"] = signal
    # What the transport prints while connecting (the MTU warning) goes to a file rank 0 reads afterwards.
    log = tempfile.TemporaryFile(mode="w+")
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        with rocenante.Communicator(store, 0, WORLD, capacity_bytes=CAPACITY, timeout_s=120, name=NAME) as comm:
            out = comm.all_reduce(values(0))
            _wait(store, ["peer/done"], "the pyverbs peer")
            store.set("rank0/done", "1")
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    log.seek(0)
    want = values(0) + values(1)
    want[7] = 0.0
    return torch.equal(out, want) and not torch.signbit(out[7]), log.read()


@pytest.mark.parametrize("mtu_drop, signal", [(0, "flag"), (1, "flag"), (0, "completion")],
                         ids=["same-mtu", "peer-mtu-smaller", "completion-signal"])
def test_an_independent_pyverbs_peer_agrees_on_the_wire_layout(mtu_drop, signal, monkeypatch):
    if not os.path.isdir("/usr/lib/python3/dist-packages/pyverbs"):
        pytest.skip("needs the system's pyverbs (apt install python3-pyverbs)")
    monkeypatch.setenv("ROCENANTE_IB_HCA", "rxe0")  # one rail: this peer does not stripe (inherited at the fork)
    (ours, log), (call_ok, data_ok) = expect_ok(run_ranks(WORLD, _rank, mtu_drop, signal, timeout=300, context="fork"))
    assert ours, "rank 0's result is not its input plus the pyverbs peer's"
    assert call_ok, "the call word rank 0 wrote into the pyverbs peer's region is not the one layout.h defines"
    assert data_ok, "the pyverbs peer read other data than rank 0's input from its region"
    if mtu_drop == 0:
        assert "MTU" not in log, log
    else:  # ibv_mtu codes: 128 << code bytes, so one code down is half the bytes
        found = re.search(r"rank 1's port MTU is (\d+) bytes, this rank's \(\S+ port \d+\) (\d+): the path uses (\d+)", log)
        assert found, f"no MTU warning naming rank 1 in: {log!r}"
        theirs, mine, used = map(int, found.groups())
        assert theirs * 2 == mine and used == theirs, log
