"""The torch.distributed backend "rocenante" on CPU: one-shot all-reduce through dist.all_reduce, delegation
of every other collective to gloo, the startup self-test and its collective fallback, torch.compile."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import warnings

import pytest
import torch

from ddp import train
from multiproc import expect_ok, run_ranks
from reference import check_against_float64, make_input, sequential_fp32


def _init(store, rank, world, env=None):
    import torch.distributed as dist

    os.environ.update(env or {})
    import rocenante  # noqa: F401  (registers the backend)

    dist.init_process_group("rocenante", store=store, rank=rank, world_size=world)
    return dist.group.WORLD


def _spy(pg):
    """Counts the calls that the rocenante communicator serves."""
    comm = pg._comms["cpu"]
    calls = []
    original = comm._launch

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    comm._launch = counted
    return calls


def _every_collective(store, rank, world):
    import torch.distributed as dist

    import rocenante

    pg = _init(store, rank, world)
    assert dist.get_backend() == "rocenante"
    st = rocenante.status()
    assert st["cpu"]["active"], st
    threshold = st["cpu"]["threshold_bytes"]
    calls = _spy(pg)

    # Eligible all-reduces run the one-shot, with the exact rank-order result.
    for case, (dtype, op, numel) in enumerate([
        (torch.float32, dist.ReduceOp.SUM, 1), (torch.bfloat16, dist.ReduceOp.SUM, 4099),
        (torch.float16, dist.ReduceOp.AVG, 333), (torch.float32, dist.ReduceOp.MAX, threshold // 4),
        (torch.int32, dist.ReduceOp.MIN, 77),
    ]):
        name = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}[op]
        inputs = [make_input(5, case, r, numel, dtype) for r in range(world)]
        x = inputs[rank].clone()
        before = len(calls)
        dist.all_reduce(x, op=op)
        assert len(calls) == before + 1, f"{dtype} {name} n={numel} did not use rocenante"
        assert torch.equal(x, sequential_fp32(inputs, name)), f"{dtype} {name} n={numel}"

    # A non-contiguous tensor is served too (through a contiguous copy), so layout never splits the ranks.
    base = torch.arange(12.0).reshape(3, 4) + rank
    col = base[:, 1]
    dist.all_reduce(col)
    assert torch.equal(base[:, 1], torch.tensor([1.0, 5.0, 9.0]) * world + sum(range(world)))

    # Ineligible all-reduces go to gloo and are still right.
    before = len(calls)
    big = make_input(6, 0, rank, threshold // 4 + 1, torch.float32)
    dist.all_reduce(big)
    check_against_float64(big, [make_input(6, 0, r, threshold // 4 + 1, torch.float32) for r in range(world)], "sum")
    prod = torch.full((5,), 2.0)
    dist.all_reduce(prod, op=dist.ReduceOp.PRODUCT)
    assert torch.equal(prod, torch.full((5,), 2.0**world))
    f64 = torch.full((3,), float(rank))
    dist.all_reduce(f64.double())
    assert len(calls) == before, "ineligible all-reduces must not reach the communicator"

    # async_op returns a Work that waits and has a future.
    y = torch.ones(8)
    work = dist.all_reduce(y, async_op=True)
    work.wait()
    assert torch.equal(work.get_future().wait()[0], torch.full((8,), float(world)))

    # All-gathers and reduce-scatters of single tensors: rocenante's (protocol v3), strided ones through copies.
    before = len(calls)
    gathered = [torch.empty(2) for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank)))
    assert all(torch.equal(g, torch.full((2,), float(r))) for r, g in enumerate(gathered))
    flat = torch.empty(2 * world)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank)))
    assert torch.equal(flat, torch.arange(world).float().repeat_interleave(2))
    grid = torch.empty(3, 2 * world)
    dist.all_gather_into_tensor(grid.t(), torch.full((2, 3), float(rank)))  # a strided output
    assert torch.equal(grid.t(), torch.arange(world).float().repeat_interleave(2)[:, None].expand(-1, 3))
    out = torch.empty(2)
    dist.reduce_scatter_tensor(out, torch.arange(2.0 * world))
    assert torch.equal(out, torch.arange(2.0 * rank, 2.0 * rank + 2) * world)
    inputs = [make_input(7, 0, r, 5 * world, torch.bfloat16) for r in range(world)]
    out = torch.empty(5, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(out, inputs[rank].clone(), op=dist.ReduceOp.MAX)
    assert torch.equal(out, sequential_fp32(inputs, "max")[5 * rank:5 * rank + 5])
    assert len(calls) == before + 5, "all-gathers and reduce-scatters must reach the communicator"
    big = torch.empty(world * (threshold // 4 + 1))
    dist.all_gather_into_tensor(big, torch.full((threshold // 4 + 1,), float(rank)))  # past the threshold: gloo
    assert torch.equal(big, torch.arange(world).float().repeat_interleave(threshold // 4 + 1))
    assert len(calls) == before + 5, "a collective past the threshold must go to gloo"

    # all_to_all_single: without split lists, with equal ones and with unequal ones, on rocenante.
    before = len(calls)
    a2a_out = torch.empty(world)
    dist.all_to_all_single(a2a_out, torch.arange(world).float() + 10 * rank)
    assert torch.equal(a2a_out, torch.arange(world).float() * 10 + rank)
    a2a_out = torch.empty(2 * world, 3, dtype=torch.bfloat16)
    a2a_in = (torch.arange(6.0 * world).reshape(2 * world, 3) + 100 * rank).to(torch.bfloat16)
    dist.all_to_all_single(a2a_out, a2a_in, [2] * world, [2] * world)
    assert torch.equal(a2a_out, torch.cat([(torch.arange(6.0 * world).reshape(2 * world, 3) + 100 * s)[2 * rank:2 * rank + 2]
                                           for s in range(world)]).to(torch.bfloat16))
    # Split lists, equal or not, go as split all-to-alls, each after the ranks agree on the largest block (a max
    # all-reduce): two calls of the communicator.
    assert len(calls) == before + 3, "all_to_all_single of equal splits must reach the communicator"
    sizes = [1 + (rank + p) % 2 for p in range(world)]  # rank r sends 1 + (r + p) % 2 rows to p, and gets as many
    a2a_out = torch.empty(sum(sizes))
    dist.all_to_all_single(a2a_out, torch.cat([torch.full((n,), float(10 * rank + p)) for p, n in enumerate(sizes)]),
                           sizes, sizes)
    assert torch.equal(a2a_out, torch.cat([torch.full((n,), float(10 * s + rank)) for s, n in enumerate(sizes)]))
    sizes = [rank + 2 * p for p in range(world)]  # rank r sends r + 2p rows to p (rank 0 none to itself)
    got = [s + 2 * rank for s in range(world)]
    a2a_out = torch.empty(sum(got), 2)[:, :1]  # a strided output
    dist.all_to_all_single(a2a_out, torch.cat([torch.full((n, 1), float(10 * rank + p)) for p, n in enumerate(sizes)]),
                           got, sizes)
    assert torch.equal(a2a_out, torch.cat([torch.full((n, 1), float(10 * s + rank)) for s, n in enumerate(got)]))
    assert len(calls) == before + 7, "all_to_all_single of unequal splits must reach the communicator"
    # One rank's block past the largest: every rank delegates, rank 2 too, whose splits are all equal.
    largest = pg._comms["cpu"].largest_block(torch.float32)
    sizes = [largest + 1 if (rank, p) == (0, 1) else 1 for p in range(world)]
    got = [largest + 1 if (s, rank) == (0, 1) else 1 for s in range(world)]
    a2a_out = torch.empty(sum(got))
    dist.all_to_all_single(a2a_out, torch.cat([torch.full((n,), float(10 * rank + p)) for p, n in enumerate(sizes)]),
                           got, sizes)
    assert torch.equal(a2a_out, torch.cat([torch.full((n,), float(10 * s + rank)) for s, n in enumerate(got)]))
    assert len(calls) == before + 8, "a block past the largest must go to gloo on every rank, after the agreement"
    lists_out = [torch.empty(2, dtype=torch.int32) for _ in range(world)]
    dist.all_to_all(lists_out, [torch.tensor([rank * 10 + p, -1], dtype=torch.int32) for p in range(world)])
    assert [v.tolist() for v in lists_out] == [[s * 10 + rank, -1] for s in range(world)]
    assert len(calls) == before + 9, "all_to_all of equal-size lists must reach the communicator"

    # Every other collective, delegated.
    t = torch.full((4,), float(rank))
    dist.broadcast(t, src=world - 1)
    assert torch.equal(t, torch.full((4,), float(world - 1)))
    lists_out = [torch.empty(1, dtype=torch.float64) for _ in range(world)]  # a dtype rocenante lacks: the delegate's
    try:
        dist.all_to_all(lists_out, [torch.tensor([float(rank * 10 + r)], dtype=torch.float64) for r in range(world)])
    except RuntimeError as err:  # older torch's gloo has no list all_to_all: the delegate's own error surfaces
        assert "gloo does not support alltoall" in str(err), err
    else:
        assert [v.item() for v in lists_out] == [float(r * 10 + rank) for r in range(world)]
    dist.barrier()
    if rank == 0:
        dist.send(torch.tensor([42.0]), dst=1)
    elif rank == 1:
        got = torch.empty(1)
        dist.recv(got, src=0)
        assert got.item() == 42.0
    ring_in, ring_out = torch.full((2,), float(rank)), torch.empty(2)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, ring_in, (rank + 1) % world),
                                     dist.P2POp(dist.irecv, ring_out, (rank - 1) % world)]):
        w.wait()
    assert torch.equal(ring_out, torch.full((2,), float((rank - 1) % world)))
    pair = [torch.full((3,), float(rank)), torch.full((5,), float(rank + 1))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # all_reduce_coalesced is deprecated, not gone
        dist.all_reduce_coalesced(pair)
    assert torch.equal(pair[0], torch.full((3,), float(sum(range(world)))))
    assert torch.equal(pair[1], torch.full((5,), float(sum(range(1, world + 1)))))
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(world)]
    box = [f"from {rank}"]
    dist.broadcast_object_list(box, src=0)
    assert box == ["from 0"]
    red = torch.full((3,), float(rank + 1))
    dist.reduce(red, dst=0)
    if rank == 0:
        assert torch.equal(red, torch.full((3,), float(world * (world + 1) // 2)))
    dist.destroy_process_group()
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_all_gather_and_reduce_scatter_use_rocenante_and_every_other_collective_is_delegated(world):
    assert expect_ok(run_ranks(world, _every_collective, timeout=300)) == [True] * world


def _ddp_both(store, rank, world):
    return train(store, rank, world, "rocenante", "cpu"), train(store, rank, world, "gloo", "cpu")


def test_ddp_training_matches_gloo_bitwise():
    # With 2 ranks both backends add the same two fp32 gradients (a + b == b + a), so parameters are bitwise equal.
    for ours, theirs in expect_ok(run_ranks(2, _ddp_both, timeout=60)):
        assert ours == theirs


def _fallback(store, rank, world, env_by_rank, strict):
    import torch.distributed as dist

    import rocenante

    env = dict(env_by_rank.get(rank, {}))
    if strict:
        env["ROCENANTE_STRICT"] = "1"
    try:
        _init(store, rank, world, env)
    except RuntimeError as err:
        return ("raised", str(err))
    st = rocenante.status()["cpu"]
    x = torch.full((100,), float(rank + 1))
    dist.all_reduce(x)
    assert torch.equal(x, torch.full((100,), float(world * (world + 1) // 2)))
    dist.destroy_process_group()
    return ("fell back" if not st["active"] else "active", st["reason"])


def test_self_test_failure_on_one_rank_makes_every_rank_fall_back():
    results = expect_ok(run_ranks(3, _fallback, {1: {"ROCENANTE_TIMEOUT_S": "soon"}}, False, timeout=300))
    for state, reason in results:
        assert state == "fell back"
        assert "rank 1: ValueError: ROCENANTE_TIMEOUT_S='soon' is not a number" in reason, reason


def _wrong_self_test_result(store, rank, world):
    import torch.distributed as dist

    import rocenante

    if rank == 1:  # this rank's self-test all-reduce returns a wrong sum (a broken path, not a configuration)
        original = rocenante.Communicator.all_reduce
        rocenante.Communicator.all_reduce = lambda self, x, **kw: original(self, x, **kw) + 1
    dist.init_process_group("rocenante", store=store, rank=rank, world_size=world)
    st = rocenante.status()["cpu"]
    x = torch.full((100,), float(rank + 1))
    dist.all_reduce(x)  # through gloo now, on every rank
    assert torch.equal(x, torch.full((100,), float(world * (world + 1) // 2)))
    dist.destroy_process_group()
    return st["active"], st["reason"]


def test_a_wrong_self_test_result_on_one_rank_makes_every_rank_fall_back():
    for active, reason in expect_ok(run_ranks(3, _wrong_self_test_result, timeout=300)):
        assert not active and "rank 1: RuntimeError: cpu self-test all-reduce of torch.float32 gave a wrong result" in reason, reason


def test_disable_forces_fallback():
    results = expect_ok(run_ranks(2, _fallback, {0: {"ROCENANTE_DISABLE": "1"}, 1: {"ROCENANTE_DISABLE": "1"}}, False))
    assert all(state == "fell back" and "ROCENANTE_DISABLE=1" in reason for state, reason in results)


def test_strict_raises_on_every_rank_instead_of_falling_back():
    results = expect_ok(run_ranks(2, _fallback, {0: {"ROCENANTE_CAPACITY_BYTES": "-5"}}, True))
    for state, reason in results:
        assert state == "raised"
        assert "ROCENANTE_STRICT=1" in reason and "rank 0: ValueError: ROCENANTE_CAPACITY_BYTES='-5'" in reason


@pytest.mark.parametrize(
    "env_by_rank, outcome, words",
    [  # every setting that changes the outcome is read by every rank from what the ranks published
        ({0: {"ROCENANTE_STRICT": "1", "ROCENANTE_DISABLE": "1"}, 1: {"ROCENANTE_DISABLE": "1"}}, "raised",
         "ROCENANTE_STRICT=1 on rank(s) [0]"),
        ({0: {"ROCENANTE_STRICT": "2"}}, "fell back", "rank 0: ValueError: ROCENANTE_STRICT='2'"),
        ({0: {"ROCENANTE_NET": "tcp"}}, "fell back", "ranks disagree on net: ['tcp', '', '']"),
        ({2: {"ROCENANTE_IB_SIGNAL": "completion"}}, "fell back",
         "ranks disagree on signal: ['flag', 'flag', 'completion']"),
        ({1: {"ROCENANTE_IB_SIGNAL": "imm"}}, "fell back", "rank 1: ValueError: ROCENANTE_IB_SIGNAL='imm'"),
    ],
    ids=["strict-on-one-rank", "malformed-strict-on-one-rank", "net-on-one-rank", "signal-on-one-rank",
         "malformed-signal-on-one-rank"],
)
def test_settings_on_one_rank_give_every_rank_the_same_outcome(env_by_rank, outcome, words):
    start = time.monotonic()
    for rank, (state, reason) in enumerate(expect_ok(run_ranks(3, _fallback, env_by_rank, False, timeout=300))):
        assert state == outcome and words in reason, f"rank {rank}: {state}: {reason}"
    assert time.monotonic() - start < 60, "a rank waited for the others' verdict"


def _late_rank_with_the_group_timeout(store, rank, world):
    """init_process_group(timeout=2 s), ROCENANTE_TIMEOUT_S unset: rank 1 comes 4 s late to an all-reduce."""
    import datetime

    import torch.distributed as dist

    import rocenante

    dist.init_process_group("rocenante", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=2))
    dist.all_reduce(torch.ones(100))
    if rank == 1:
        time.sleep(4)
    outcomes = []
    for name, collective in (("all_reduce", lambda: dist.all_reduce(torch.ones(100))),
                             ("broadcast", lambda: dist.broadcast(torch.ones(4), src=0))):
        start = time.monotonic()
        try:
            collective()
            outcomes.append((name, "ran", time.monotonic() - start, ""))
        except rocenante.RocenanteError as err:
            outcomes.append((name, type(err).__name__, time.monotonic() - start, str(err)))
    dist.destroy_process_group()
    return outcomes


def test_the_group_timeout_bounds_the_waits_and_a_late_rank_meets_the_fault(monkeypatch):
    monkeypatch.delenv("ROCENANTE_TIMEOUT_S", raising=False)
    first, late = expect_ok(run_ranks(2, _late_rank_with_the_group_timeout, timeout=120))
    (_, kind, seconds, message), broadcast = first
    assert kind == "PeerTimeoutError" and "timed out after 2 s waiting for rank(s) 1" in message, first
    assert 1.5 < seconds < 3.5, f"rank 0 waited {seconds:.1f} s with a 2 s group timeout"
    assert broadcast[1] == "PeerTimeoutError" and broadcast[3] == message, broadcast
    # Rank 1's data had arrived, but rank 0's abort word says the group faulted: neither collective runs.
    for name, kind, seconds, words in late:
        assert kind == "PeerTimeoutError" and "rank 0 aborted the communicator: a wait for rank(s) 1 timed out" in words \
            and seconds < 1.0, (name, kind, seconds, words)


def _reinit_and_new_group(store, rank, world):
    import torch.distributed as dist

    import rocenante

    for round_ in range(2):  # a second init after destroy works
        dist.init_process_group("rocenante", store=dist.PrefixStore(f"round{round_}", store), rank=rank, world_size=world)
        x = torch.ones(4)
        dist.all_reduce(x)
        assert torch.equal(x, torch.full((4,), float(world)))
        sub = dist.new_group([0, 1], backend="rocenante")
        if rank in (0, 1):
            y = torch.full((4,), 5.0)
            dist.all_reduce(y, group=sub)
            assert torch.equal(y, torch.full((4,), 10.0))
            assert rocenante.status(sub)["cpu"]["active"]
        dist.destroy_process_group()
    return True


def test_second_init_after_destroy_and_new_group():
    assert expect_ok(run_ranks(3, _reinit_and_new_group, timeout=300)) == [True] * 3


def _layouts_and_faces(store, rank, world):
    """What gloo takes that a contiguous one-shot might not: strided tensors (served and delegated), an
    expanded one, a view of a leaf that requires grad; Work.result(); the custom op's names."""
    import torch.distributed as dist

    pg = _init(store, rank, world)
    calls = _spy(pg)
    # A strided float32 view: served by rocenante on a contiguous copy, its result written back in place.
    a = torch.ones(6)
    dist.all_reduce(a[::2])
    assert calls and a.tolist() == [world, 1, world, 1, world, 1], a
    # The same for a float64 view, which the delegate (gloo) serves: gloo alone mixes neighbours here.
    served = len(calls)
    b = torch.ones(6, dtype=torch.float64)
    dist.all_reduce(b[::2])
    assert len(calls) == served and b.tolist() == [world, 1, world, 1, world, 1], b
    # A view of a leaf that requires grad takes the result, as from gloo.
    w = torch.ones(6, requires_grad=True)
    dist.all_reduce(w[::2])
    assert w.detach().tolist() == [world, 1, world, 1, world, 1], w
    # An expanded tensor goes to gloo as it is (no copy could take the result back).
    e = torch.full((1,), float(rank + 1)).expand(4)
    dist.all_reduce(e)
    work = dist.all_reduce(torch.ones(3), async_op=True)
    work.wait()
    assert torch.equal(work.result()[0], torch.full((3,), float(world)))
    x = torch.full((5,), 2.0, dtype=torch.float64)  # not served: the delegate, under every name the op takes
    assert torch.equal(torch.ops.rocenante.all_reduce(x, "product", pg.group_name), torch.full_like(x, 2.0 ** world))
    try:
        torch.ops.rocenante.all_reduce(x, "cake", pg.group_name)
        refused = None
    except ValueError as err:
        refused = str(err)
    dist.destroy_process_group()
    return refused


def test_strided_expanded_and_grad_views_work_as_with_gloo_and_work_result():
    for refused in expect_ok(run_ranks(2, _layouts_and_faces, timeout=240)):
        assert refused is not None and "unsupported op 'cake'" in refused, refused


def _gpu_job_groups(store, rank, world):
    """A GPU job's world group and three more, as the backend sees them: CUDA "available" (its self-test
    falls back here, without a GPU) and its delegate gloo (ROCENANTE_TEST_SHARED_GPU), beside the CPU path."""
    import torch.distributed as dist

    import rocenante

    os.environ["ROCENANTE_TEST_SHARED_GPU"] = "1"
    torch.cuda.is_available = lambda: True

    def regions():  # rocenante's shared-memory segments this process maps (csrc/transport/shm.cc names them)
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                           for line in maps if "/dev/shm/rocenante-" in line})

    dist.init_process_group("rocenante", store=store, rank=rank, world_size=world)
    groups = [dist.new_group(backend="rocenante") for _ in range(3)]
    before, unstarted = regions(), rocenante.status()["cpu"]
    x = torch.full((100,), float(rank + 1))
    dist.all_reduce(x)  # the world group's first CPU all-reduce starts its CPU path, on every rank
    assert torch.equal(x, torch.full((100,), float(world * (world + 1) // 2)))
    after, started, other = regions(), rocenante.status()["cpu"], rocenante.status(groups[0])["cpu"]
    dist.destroy_process_group()
    return before, unstarted, after, started["active"], other["active"]


def test_a_gpu_jobs_groups_hold_no_cpu_region_until_a_cpu_all_reduce():
    for before, unstarted, after, active, other in expect_ok(run_ranks(2, _gpu_job_groups, timeout=240)):
        assert before == [], f"shared memory held before any CPU all-reduce: {before}"
        assert not unstarted["active"] and "first CPU all-reduce starts it" in unstarted["reason"], unstarted
        assert len(after) == 2 and active, after  # the world group's: this rank's region and its peer's
        assert not other, "a group that made no CPU all-reduce started its CPU path"


def _reinit_on_one_store(store, rank, world):
    import torch.distributed as dist

    import rocenante

    states = []
    for round_, bad in enumerate([True, False, False]):  # rank 1's self-test fails in the first round only
        os.environ["ROCENANTE_TIMEOUT_S"] = "soon" if bad and rank == 1 else "60"
        dist.init_process_group("rocenante", store=store, rank=rank, world_size=world)  # the same store each time
        x = torch.full((4,), float(rank + round_))
        dist.all_reduce(x)
        assert torch.equal(x, torch.full((4,), float(sum(range(world)) + world * round_)))
        states.append(rocenante.status()["cpu"]["active"])
        dist.destroy_process_group()
    return states


def test_reinit_on_the_same_store_reads_no_stale_keys():
    assert expect_ok(run_ranks(3, _reinit_on_one_store, timeout=120)) == [[False, True, True]] * 3


def _compiled(store, rank, world):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    pg = _init(store, rank, world)
    calls = _spy(pg)

    @torch.compile(fullgraph=True)
    def step(a, b):
        dist.all_reduce(a)
        c = fc.all_reduce(b * 2, "sum", dist.group.WORLD)
        d = torch.ops.rocenante.all_reduce(b + 1, "max", dist.group.WORLD.group_name)
        return a + 1, c, d

    for i in range(3):  # fresh inputs on each call
        a, b = torch.full((8,), float(rank + i)), torch.full((8,), float(rank * 3 + i))
        ra, rc, rd = step(a, b)
        assert torch.equal(ra, torch.full((8,), float(sum(r + i for r in range(world)) + 1)))
        assert torch.equal(rc, torch.full((8,), float(sum(2 * (r * 3 + i) for r in range(world)))))
        assert torch.equal(rd, torch.full((8,), float((world - 1) * 3 + i + 1)))
    assert len(calls) == 9, f"{len(calls)} of 9 compiled all-reduces went through rocenante"
    dist.destroy_process_group()
    return True


def test_torch_compile_fullgraph_all_reduce_functional_and_custom_op():
    assert expect_ok(run_ranks(2, _compiled, timeout=600)) == [True, True]


def _used_on_one_rank_only(store, rank, world):
    """A compiled step whose custom all-reduce only rank 0 uses (code branching on the rank): the call must stay
    in every rank's graph, or the ranks' calls pair one off (rank 0's with rank 1's next all-reduce)."""
    import torch.distributed as dist

    _init(store, rank, world)
    group = dist.group.WORLD.group_name

    @torch.compile(fullgraph=True)
    def step(x):
        y = torch.ops.rocenante.all_reduce(x, "sum", group)
        return y * 2 if rank == 0 else x + 1

    out = step(torch.full((8,), float(rank + 1)))
    z = torch.full((8,), 100.0 + rank)
    dist.all_reduce(z)
    dist.destroy_process_group()
    return out.tolist(), z.tolist()


def test_torch_compile_keeps_a_custom_all_reduce_whose_output_is_unused(tmp_path, monkeypatch):
    # A fresh compile cache: a graph cached by a version that let the compiler drop the call would be reused.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    results = expect_ok(run_ranks(2, _used_on_one_rank_only, timeout=600))
    assert results[0] == ([6.0] * 8, [201.0] * 8), results[0]
    assert results[1] == ([3.0] * 8, [201.0] * 8), results[1]


def test_torchrun_launch():
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "torchrun_script.py")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port), script],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("rocenante torchrun OK") == 2, proc.stdout[-3000:]


def _init_method(store, rank, world, init_method):
    import torch.distributed as dist

    import rocenante  # noqa: F401

    dist.init_process_group("rocenante", init_method=init_method, rank=rank, world_size=world)
    x = torch.full((10,), float(rank + 1))
    dist.all_reduce(x)
    dist.destroy_process_group()
    return x.tolist()


def test_tcp_and_file_init_methods(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for init in (f"tcp://127.0.0.1:{port}", f"file://{tmp_path}/rendezvous"):
        assert expect_ok(run_ranks(2, _init_method, init, timeout=120)) == [[3.0] * 10] * 2, init
