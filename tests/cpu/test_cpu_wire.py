"""The CPU path against a peer that the test plays by writing the wire format (csrc/layout.h) into the region by
hand, word by word in random order, as an RDMA NIC may place them: a rank must reduce an element only once it
has arrived whole, and write no output before the peer's call word says it makes this very call."""

from __future__ import annotations

import mmap
import os
import random
import threading
import time

import numpy as np
import pytest
import torch

import rocenante
from rocenante import _C

CAPACITY = 64 << 10
HANDLE_HEADER = _C.layout.handle_header_bytes  # the core's Config and Identity, in front of the shared-memory name
EPOCH = 1  # the first call
_CODES = {torch.float32: _C.DType.float32, torch.bfloat16: _C.DType.bfloat16, torch.int32: _C.DType.int32}


class PlayedPeer:
    """Rank 0 is a real communicator; rank 1 exists only so that rank 0 can push to it, and the test writes
    rank 1's part of every call straight into rank 0's region."""

    def __init__(self):
        self.me = _C.Communicator(0, 2, -1, CAPACITY, 10.0, _C.OnFault.raise_)
        self.puppet = _C.Communicator(1, 2, -1, CAPACITY, 10.0, _C.OnFault.raise_)
        handles = [self.me.local_handle(), self.puppet.local_handle()]
        fd = os.open("/dev/shm" + handles[0][HANDLE_HEADER:].decode(), os.O_RDWR)  # before the name is unlinked
        try:
            self.region = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self.me.connect(handles)
        self.puppet.connect(handles)
        self.me.all_connected()
        self.puppet.all_connected()
        self.words = np.frombuffer(self.region, dtype=np.uint32)  # one aligned 4-byte store per element write
        self.halves = np.frombuffer(self.region, dtype=np.uint64)  # one aligned 8-byte store per line half

    def store(self, half: bool, index: int, value: int) -> None:
        (self.halves if half else self.words)[index] = value

    def close(self):
        del self.words, self.halves
        self.me.close()
        self.puppet.close()
        self.region.close()

    def start_call(self, x: torch.Tensor, out: torch.Tensor, op):
        """Runs rank 0's all-reduce on a thread (it releases the GIL); returns the thread and its outcome."""
        outcome = {}

        def run():
            try:
                self.me.all_reduce(x.data_ptr(), out.data_ptr(), x.numel(), _CODES[x.dtype], op, 0)
                outcome["ok"] = True
            except Exception as err:  # reported to the test
                outcome["error"] = err

        thread = threading.Thread(target=run)
        thread.start()
        return thread, outcome

    def call_word_index(self) -> int:
        return _C.layout.call_word_offset(_C.layout.buffer_of(EPOCH), 1) // 4

    def area_index(self) -> int:
        return _C.layout.area_offset(CAPACITY, 2, _C.layout.buffer_of(EPOCH), 0, 1) // 4


def _payload_stores(peer: PlayedPeer, y: torch.Tensor, call: int) -> list:
    """Every store rank 1 makes for its input y, as PlayedPeer.store's arguments: Lamport formats one per 32-bit
    word (the last 16-byte chunk zero-padded), int32 one per 8-byte line half {data, call word}."""
    data = y.contiguous().view(torch.uint8).numpy().tobytes()
    data += bytes(-len(data) % 16)
    words = np.frombuffer(data, dtype=np.uint32)
    base = peer.area_index()
    if y.dtype != torch.int32:
        return [(False, base + i, int(w)) for i, w in enumerate(words)]
    stores = []
    for c in range(len(words) // 4):
        for h in range(2):
            line = base + _C.layout.chunk_line(c, h) * 4  # in 32-bit words: {data0, flag, data1, flag}
            for k in range(2):
                stores.append((True, (line + 2 * k) // 2, int(words[4 * c + 2 * h + k]) | call << 32))
    return stores


def _inputs(dtype, numel, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int32:
        return [torch.randint(-(2**31), 2**31 - 1, (numel,), generator=g, dtype=torch.int32) for _ in range(2)]
    xs = [torch.randn(numel, generator=g).to(dtype) for _ in range(2)]
    for x in xs:
        x[x == 0] = 1.0  # no zero of either sign: the played peer sends its words as they are (no sanitizing)
    return xs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_words_placed_in_random_order_are_reduced_only_once_all_arrived(dtype):
    numel = 3001 if dtype != torch.bfloat16 else 6001  # several pull blocks and a partial last chunk
    x, y = _inputs(dtype, numel, seed=dtype.itemsize * 7 + numel)
    peer = PlayedPeer()
    try:
        call = _C.layout.call_word(numel, _CODES[dtype], _C.ReduceOp.sum, EPOCH)
        stores = _payload_stores(peer, y, call)
        random.Random(numel).shuffle(stores)
        out = torch.full_like(x, 7)
        thread, outcome = peer.start_call(x, out, _C.ReduceOp.sum)
        peer.words[peer.call_word_index()] = call
        for i, store in enumerate(stores):
            peer.store(*store)
            if i % 64 == 0:
                time.sleep(0)  # let rank 0 look at the partly written region
        thread.join(timeout=30)
        assert not thread.is_alive(), "rank 0 did not finish after every word had arrived"
        assert outcome.get("ok"), outcome
        if dtype == torch.int32:  # wraps
            want = ((x.to(torch.int64) + y.to(torch.int64) + 2**31) % 2**32 - 2**31).to(torch.int32)
        else:
            want = (x.float() + y.float()).to(dtype)
        assert torch.equal(out, want), f"{(out != want).sum().item()} of {numel} elements differ"
    finally:
        peer.close()


@pytest.mark.parametrize("theirs, words", [
    (dict(op=_C.ReduceOp.max), "op max"),
    # A call fused with the residual add and RMSNorm exchanges the same data as a plain sum: only the call word
    # tells them apart (csrc/layout.h), and it must.
    (dict(op=_C.ReduceOp.sum, collective=_C.layout.Collective.fused_all_reduce), "op sum, fused with the residual add and RMSNorm"),
], ids=["op-max", "fused"])
def test_data_before_a_different_call_word_is_never_reduced(theirs, words):
    # The peer's words all arrive first, then its call word says it makes another call of the same byte count:
    # rank 0 must report the mismatch and leave every output element poisoned (NaN), none summed.
    numel = 3001
    x, y = _inputs(torch.float32, numel, seed=11)
    peer = PlayedPeer()
    try:
        stores = _payload_stores(peer, y, 0)
        random.Random(5).shuffle(stores)
        out = torch.zeros_like(x)
        thread, outcome = peer.start_call(x, out, _C.ReduceOp.sum)
        for store in stores:
            peer.store(*store)
        time.sleep(0.05)
        peer.words[peer.call_word_index()] = _C.layout.call_word(numel, _C.DType.float32, epoch=EPOCH, **theirs)
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert isinstance(outcome.get("error"), rocenante.CallMismatchError), outcome
        assert f"rank 1 called all_reduce with {numel} x float32 ({words})" in str(outcome["error"]), \
            str(outcome["error"])
        assert torch.isnan(out).all(), "an output element was written for a call the peer did not make"
    finally:
        peer.close()


@pytest.mark.parametrize("page", [4096, 65536])  # 64 KiB: some aarch64 kernels (a DGX Spark's may be one)
def test_a_wires_memory_is_whole_pages_of_the_page_size(page):
    for region, extra in [(4, 0), (65536, 0), (100_004, 8192), (1 << 20, 65 * 64)]:
        got = _C._test_wire_block_bytes(region, extra, page)
        assert got % page == 0 and 2 * region + extra <= got < 2 * region + extra + page, (region, extra, got)


def test_a_wires_memory_takes_the_hosts_page_size():
    page = os.sysconf("SC_PAGE_SIZE")
    assert _C._test_wire_block_bytes(4, 0, 0) == page
    assert _C._test_wire_block_bytes(page // 2, 0, 0) == page
    assert _C._test_wire_block_bytes(page // 2, 1, 0) == 2 * page
