"""The one-shot all-reduce between processes of one host with CPU tensors: over shared memory, and where a test
takes `net`, also over the TCP software wire (ROCENANTE_NET=tcp, csrc/transport/tcp.cc: every peer through the
proxy and a loopback TCP connection, each delivery placed in random order word by word), held to one standard."""

from __future__ import annotations

import glob
import os
import random
import re
import time

import pytest
import torch

import rocenante
from multiproc import all_arrived, expect_ok, run_ranks
from nets import cases, on_path
from probes import host_probe
from reference import DTYPES, check_against_float64, digest, make_input, ops_for, poison, sequential_fp32

CAPACITY = 64 << 10  # small, so that random sizes often go as several pieces


def _sizes(seed: int, dtype, count: int) -> list[int]:
    # One piece holds CAPACITY bytes of float payload, half of that for int32 (csrc/layout.h); sizes around a
    # piece's edge and beyond it cross piece boundaries.
    esize = torch.empty((), dtype=dtype).element_size()
    piece = (CAPACITY // 2 if dtype == torch.int32 else CAPACITY) // esize
    rng = random.Random(seed)
    return [1, 7, 9, piece - 1, piece, piece + 1, 2 * piece + 3] + [rng.randint(1, 3 * piece) for _ in range(count)]


def _every_dtype_op_size(store, rank, world, seed, net, random_sizes):
    with on_path(rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=60), net) as comm:
        return every_dtype_op_size(comm, rank, world, seed, random_sizes)


def every_dtype_op_size(comm, rank, world, seed, random_sizes) -> list[str]:
    """Every dtype and op at sizes around and beyond a piece (comm's capacity must be CAPACITY) and
    `random_sizes` random ones, outputs poisoned first, checked against the rank-order fp32 result and float64;
    returns the results' digests (for comparing ranks)."""
    digests = []
    case = 0
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for numel in _sizes(seed + case, dtype, random_sizes):
                case += 1
                inputs = [make_input(seed, case, r, numel, dtype) for r in range(world)]
                x = inputs[rank].clone()
                in_place = case % 5 == 0
                out = x if in_place else poison(torch.empty_like(x))
                got = comm.all_reduce(x, op=op, out=out)
                assert got is out
                expected = sequential_fp32(inputs, op)
                assert torch.equal(got, expected), f"{dtype} {op} n={numel} differs from the rank-order fp32 result"
                check_against_float64(got, inputs, op)
                if not in_place:
                    assert torch.equal(x, inputs[rank]), "the input was modified"
                digests.append(digest(got))
    return digests


@cases("net, world", ("", 2), ("", 3), ("", 4), ("tcp", 2), ("tcp", 3))
def test_every_dtype_op_and_size_matches_reference_on_every_rank(net, world):
    # Over the wire the edges of a piece and one random size more; over shared memory four more.
    seed, random_sizes = (2000 + world, 1) if net else (1000 + world, 4)
    results = expect_ok(run_ranks(world, _every_dtype_op_size, seed, net, random_sizes, timeout=180))
    assert all(r == results[0] for r in results[1:]), "ranks produced different bits"


@cases("net, world", ("tcp", 3))
def test_the_completion_signal_matches_reference_on_every_rank(net, world, monkeypatch):
    # ROCENANTE_IB_SIGNAL=completion: the receiving proxy stores the mailbox's arrival word (csrc/layout.h).
    monkeypatch.setenv("ROCENANTE_IB_SIGNAL", "completion")
    results = expect_ok(run_ranks(world, _every_dtype_op_size, 3000 + world, net, 1, timeout=180))
    assert all(r == results[0] for r in results[1:]), "ranks produced different bits"


def _flag_placed_first(store, rank, world, seed):
    os.environ["ROCENANTE_TEST_FLAG_FIRST"] = "1"  # the TCP wire stores each flag before its delivery's data
    return _every_dtype_op_size(store, rank, world, seed, "tcp", 1)


@cases("net", ("tcp",))
def test_a_flag_placed_before_its_data_is_caught(net):
    # The mutation check of the flag signal (csrc/transport/transport.h, Signal::kFlagFirst): a reducer that read
    # words placed after the flag saw torn ones, and the test above fails (a wrong result, or a call word that
    # matched nothing). Caught in 5 of 5 runs on CPU when it was written.
    results = run_ranks(2, _flag_placed_first, 2002, timeout=180)
    caught = [r for r in results if isinstance(r, tuple) and r[:2] in (("error", "AssertionError"),
                                                                        ("error", "CallMismatchError"))]
    assert caught, f"a flag placed before its data went unnoticed: {[r[:3] if isinstance(r, tuple) else r for r in results]}"


def _nan_max_min(store, rank, world, seed):
    comm = rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=60)
    numel, digests = 1000, []
    holder = torch.arange(numel) % (world + 1)  # element i is NaN on rank holder[i] (on none where it is world)
    for case, (dtype, op) in enumerate((d, o) for d in (torch.float32, torch.float16, torch.bfloat16) for o in ("max", "min")):
        inputs = [make_input(seed, case, r, numel, dtype).masked_fill(holder == r, float("nan")) for r in range(world)]
        got = comm.all_reduce(inputs[rank], op=op)
        nan = torch.isnan(got)
        assert torch.equal(nan, holder < world), f"{dtype} {op}: a NaN on some rank must win, wherever it is"
        assert torch.equal(got[~nan], sequential_fp32(inputs, op)[~nan]), f"{dtype} {op}"
        digests.append(digest(got))
    comm.close()
    return digests


def test_max_and_min_with_nan_follow_torch_maximum_whichever_rank_holds_it():
    results = expect_ok(run_ranks(3, _nan_max_min, 77))
    assert all(r == results[0] for r in results[1:]), "ranks produced different bits"


# Bit patterns that look like the empty word (0x80000000) or half of it: -0.0 in every float dtype, and for
# int32 (which travels in lines and must arrive untouched) INT32_MIN and words with 0x8000 in either half.
_SENTINEL_LIKE = {torch.float32: [0x80000000], torch.float16: [0x8000], torch.bfloat16: [0x8000],
                  torch.int32: [0x80000000, 0x00008000, 0xFFFF8000, 0x80008000]}


def _sentinel_input(seed, rank, numel, dtype):
    x = make_input(seed, 0, rank, numel, dtype)
    bits = x.view({2: torch.int16, 4: torch.int32}[x.element_size()])
    g = torch.Generator().manual_seed(seed * 10 + rank)
    for pattern in _SENTINEL_LIKE[dtype]:
        where = torch.randperm(numel, generator=g)[: numel // 8]
        bits[where] = pattern - (1 << 8 * x.element_size()) if pattern >> (8 * x.element_size() - 1) else pattern
    if dtype.is_floating_point:
        x[torch.randperm(numel, generator=g)[: numel // 8]] = 0.0
    return x


def _sentinel_like_values(store, rank, world, seed):
    comm = rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=60)
    for case, (dtype, op) in enumerate((d, o) for d in DTYPES for o in ops_for(d)):
        numel = 4099  # several blocks and a partial last chunk
        inputs = [_sentinel_input(seed + case, r, numel, dtype) for r in range(world)]
        got = comm.all_reduce(inputs[rank], op=op)
        # Senders and reducers turn -0.0 into +0.0 (layout.h); then the rank-order fp32 result, bit for bit.
        sent = [x + 0 if dtype.is_floating_point else x for x in inputs]  # x + 0 turns -0.0 into +0.0 only
        want = sequential_fp32(sent, op)
        bits = {2: torch.int16, 4: torch.int32}[got.element_size()]
        assert torch.equal(got.view(bits), want.view(bits)), f"{dtype} {op}: not the bits of the sanitized inputs"
    comm.close()
    return True


def test_values_like_the_empty_word_arrive_as_the_format_says():
    expect_ok(run_ranks(3, _sentinel_like_values, 31))


def _back_to_back(store, rank, world, net, calls):
    comm = on_path(rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=60), net)
    rng = random.Random(7)  # same sizes on every rank
    for i in range(calls):
        numel = rng.randint(1, 512)
        x = torch.randint(-(2**20), 2**20, (numel,), dtype=torch.int32, generator=torch.Generator().manual_seed(i * 8 + rank))
        want = sum(
            torch.randint(-(2**20), 2**20, (numel,), dtype=torch.int32, generator=torch.Generator().manual_seed(i * 8 + r))
            for r in range(world)
        )
        got = comm.all_reduce(x)
        if not torch.equal(got, want):
            raise AssertionError(f"call {i} (n={numel}) gave a wrong sum")
    comm.close()
    return calls


@cases("net, calls", ("", 10_000), ("tcp", 3000))
def test_back_to_back_calls(net, calls):
    assert expect_ok(run_ranks(2, _back_to_back, net, calls)) == [calls, calls]


def _one_rank_absent(store, rank, world):
    all_arrived(store, world, "absent")
    comm = rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=1.0)
    if rank == world - 1:
        time.sleep(4.0)  # present at setup, never calls all_reduce
        return "absent"
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(100))
    except rocenante.PeerTimeoutError as err:
        elapsed = time.monotonic() - start
        assert comm.closed, "the communicator must be closed after a timeout"
        with pytest.raises(rocenante.PeerTimeoutError) as again:
            comm.all_reduce(torch.ones(100))
        assert str(again.value) == str(err), "a later call raises the original fault, word for word"
        return str(err), elapsed
    raise AssertionError("all_reduce returned without the absent peer")


@pytest.mark.parametrize("world", [2, 3])
def test_absent_peer_raises_within_timeout_naming_it(world):
    results = expect_ok(run_ranks(world, _one_rank_absent))
    for message, elapsed in results[:-1]:
        assert f"rank(s) {world - 1}" in message, message
        assert 0.9 <= elapsed < 3.0, elapsed


def _mismatch(store, rank, world, kind):
    comm = rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=10)
    odd = rank == 1
    x = torch.randn(1000 + (24 if odd and kind == "size" else 0))
    if kind == "dtype" and odd:
        x = x.to(torch.bfloat16)
    op = "max" if kind == "op" and odd else "sum"
    try:
        comm.all_reduce(x, op=op)
    except rocenante.CallMismatchError as err:
        assert comm.closed
        with pytest.raises(rocenante.CallMismatchError) as again:
            comm.all_reduce(x, op=op)
        assert str(again.value) == str(err), "a later call raises the original fault, word for word"
        return str(err)
    raise AssertionError("a mismatched call returned a result")


@pytest.mark.parametrize("kind", ["size", "dtype", "op"])
def test_mismatched_calls_fail_on_every_rank(kind):
    results = expect_ok(run_ranks(3, _mismatch, kind, timeout=60))
    # A rank names the call it saw differ (rank 1: whichever of ranks 0 and 2 it saw first), or, if a peer's abort
    # word reached it before its own call (it reads them before each call), the mismatch that peer saw.
    relayed = re.compile(r"rank \d aborted the communicator: rank \d made a different call")
    for rank, message in enumerate(results):
        direct = re.compile(r"rank [02] called all_reduce with" if rank == 1 else r"rank 1 called all_reduce with")
        assert direct.search(message) or relayed.search(message), f"rank {rank}: {message}"
    if kind == "size":
        assert "1024 x float32" in results[0] or relayed.search(results[0]), results[0]
        assert "1000 x float32" in results[1] or relayed.search(results[1]), results[1]


def _open_close(store, rank, world, net, cycles):
    """This rank's shared-memory segments left after `cycles` communicators were built, used and closed (their
    names carry the pid), and its (fds, threads) after the first cycle (which loads what stays loaded) and after
    the last."""

    def cycle(i):
        with on_path(rocenante.Communicator(store, rank, world, capacity_bytes=4096, timeout_s=30), net) as comm:
            assert torch.equal(comm.all_reduce(torch.full((3,), float(i))), torch.full((3,), float(i * world)))

    def held():
        return host_probe()["fds"], len(os.listdir("/proc/self/task"))

    cycle(0)
    before = held()
    for i in range(1, cycles):
        cycle(i)
    return sorted(glob.glob(f"/dev/shm/rocenante-*-{os.getpid()}-*")), before, held()


@cases("net, world, cycles", ("", 2, 100), ("tcp", 3, 20))
def test_open_close_cycles_leave_no_shared_memory_fd_or_thread(net, world, cycles):
    for segments, before, after in expect_ok(run_ranks(world, _open_close, net, cycles, timeout=180)):
        assert segments == [], segments
        assert after == before, f"(fds, threads) {before} -> {after}"


def _capacity_differs(store, rank, world):
    try:
        rocenante.Communicator(store, rank, world, capacity_bytes=4096 * (rank + 1), timeout_s=10)
    except rocenante.RocenanteError as err:
        return str(err)
    raise AssertionError("ranks with different capacities connected")


def test_different_configuration_is_refused():
    results = expect_ok(run_ranks(2, _capacity_differs))
    assert "rank 1 is configured differently" in results[0]
    assert "rank 0 is configured differently" in results[1]


def _from_group(store, rank, world):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        with rocenante.Communicator(group=dist.group.WORLD, capacity_bytes=4096) as comm:
            assert comm.name == dist.group.WORLD.group_name
            return comm.all_reduce(torch.tensor([rank + 1.0]), op=dist.ReduceOp.SUM).item()
    finally:
        dist.destroy_process_group()


def test_built_from_a_process_group():
    assert expect_ok(run_ranks(2, _from_group)) == [3.0, 3.0]


# Sub-communicators of four processes: name -> the process ranks in it, in sub-rank order.
_SUBGROUPS = {"all": [0, 1, 2, 3], "left": [0, 1], "right": [2, 3], "trio": [1, 2, 3]}


def _concurrent_names(store, rank, world, seed, rounds):
    import threading

    rng = random.Random(seed * 100 + rank)
    failures = []

    def build_and_reduce(name, case, pause):
        ranks = _SUBGROUPS[name]
        me = ranks.index(rank)  # the rank within the sub-communicator
        try:
            time.sleep(pause)
            with rocenante.Communicator(store, me, len(ranks), name=name, capacity_bytes=CAPACITY, timeout_s=30) as c:
                inputs = [make_input(seed, case, r, 1000 + case, torch.float32) for r in range(len(ranks))]
                if not torch.equal(c.all_reduce(inputs[me]), sequential_fp32(inputs, "sum")):
                    failures.append(f"{name}, rank {me} of {len(ranks)}, case {case}: wrong sum")
        except Exception as err:
            failures.append(f"{name}, rank {me} of {len(ranks)}, case {case}: {type(err).__name__}: {err}")

    for round_ in range(rounds):  # each round re-creates every name, the threads started in a new order
        mine = [name for name, ranks in _SUBGROUPS.items() if rank in ranks]
        rng.shuffle(mine)
        cases = [round_ * 10 + list(_SUBGROUPS).index(name) for name in mine]  # fresh data for each
        threads = [
            threading.Thread(target=build_and_reduce, args=(name, case, rng.uniform(0, 0.05)))
            for name, case in zip(mine, cases)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return failures


def test_communicators_of_different_sizes_built_concurrently_on_one_store():
    results = expect_ok(run_ranks(4, _concurrent_names, 11, 5, timeout=120))
    assert results == [[]] * 4, results


def _same_name_twice(store, rank, world):
    # Processes 0 and 1 both claim rank 0 of "twin"; process 2 is its rank 2, and nobody its rank 1.
    start = time.monotonic()
    try:
        rocenante.Communicator(store, [0, 0, 2][rank], 3, name="twin", timeout_s=10)
    except rocenante.RocenanteError as err:
        return str(err), time.monotonic() - start
    raise AssertionError("built a communicator although two processes claimed one rank of it")


def test_same_name_built_concurrently_raises_on_every_rank():
    for message, elapsed in expect_ok(run_ranks(3, _same_name_twice, timeout=60)):
        assert "another communicator named 'twin' is being built on this store" in message, message
        assert elapsed < 5, f"took {elapsed:.1f} s to notice"


@pytest.mark.parametrize("name", ["", 7])
def test_bad_name_is_refused(tmp_path, name):
    import torch.distributed as dist

    with pytest.raises(ValueError, match="name must be a non-empty string"):
        rocenante.Communicator(dist.FileStore(str(tmp_path / "s"), 1), 0, 1, name=name)


@pytest.fixture
def solo(tmp_path):
    import torch.distributed as dist

    comm = rocenante.Communicator(dist.FileStore(str(tmp_path / "store"), 1), 0, 1, capacity_bytes=1024, timeout_s=5)
    yield comm
    comm.close()


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda c: c.all_reduce(torch.ones(4, dtype=torch.float64)), TypeError, "unsupported dtype torch.float64"),
        (lambda c: c.all_reduce(torch.ones(4), op="prod"), ValueError, "unsupported op 'prod'"),
        (lambda c: c.all_reduce(torch.ones(4, dtype=torch.int32), op="avg"), ValueError, "avg is not defined for int32"),
        (lambda c: c.all_reduce([1.0, 2.0]), TypeError, "takes a torch.Tensor"),
    ],
)
def test_bad_input_every_rank_shares_is_refused_and_leaves_it_usable(solo, call, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        call(solo)
    assert not solo.closed, "a refused argument must not close the communicator"
    assert torch.equal(solo.all_reduce(torch.arange(5.0)), torch.arange(5.0))


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda c: c.all_reduce(torch.ones(4, 4).t()), "non-contiguous tensor"),
        (lambda c: c.all_reduce(torch.ones(4), out=torch.empty(5)), "out must match the input"),
        (lambda c: c.all_reduce(torch.ones(4), out=torch.ones(8)[::2]), "non-contiguous out"),
        (lambda c: c.all_reduce(torch.ones(4, device="meta")), "tensor on meta"),
        (lambda c: (lambda b: c.all_reduce(b[1:], out=b[:7]))(torch.ones(8)), "overlap"),
    ],
)
def test_bad_input_only_this_rank_sees_closes_it_and_every_later_call_raises(solo, call, words):
    with pytest.raises(ValueError, match=words) as first:
        call(solo)
    assert solo.closed, "the peers have started the call: the communicator must not be usable"
    for later in (lambda: solo.all_reduce(torch.arange(5.0)), solo.synchronize):
        with pytest.raises(ValueError) as again:
            later()
        assert str(again.value) == str(first.value), "later calls raise the original refusal"


def test_gpu_communicator_refused_without_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    import torch.distributed as dist

    with pytest.raises(Exception, match="CUDA|cuda"):
        rocenante.Communicator(dist.FileStore(str(tmp_path / "s"), 1), 0, 1, device="cuda:0")


def _setup_fails_on_one_rank(store, rank, world):
    start = time.monotonic()
    try:
        # Rank 1 asks for a GPU this machine cannot give (or, on a GPU machine, a configuration that differs).
        rocenante.Communicator(store, rank, world, device="cuda:0" if rank == 1 else "cpu", timeout_s=60)
    except rocenante.RocenanteError as err:
        return str(err), time.monotonic() - start
    except Exception as err:  # the failing rank's own error may be of another type
        return str(err), time.monotonic() - start
    raise AssertionError("setup succeeded although a rank failed")


def test_a_rank_failing_setup_makes_the_others_fail_at_once_naming_it():
    (message, elapsed), _ = expect_ok(run_ranks(2, _setup_fails_on_one_rank))
    assert "rank 1" in message, message
    assert elapsed < 10, f"rank 0 waited {elapsed:.1f} s for a peer that had already failed"
