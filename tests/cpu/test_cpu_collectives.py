"""All-gather, reduce-scatter, all-to-all and two-shot all-reduce between processes of one host with CPU tensors
(protocol v5, csrc/layout.h: Shards): over shared memory, and where a test takes `net`, over the TCP software wire
too. Each result is checked bit for bit against a reference every rank can compute, and across ranks."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

import rocenante
from multiproc import expect_ok, run_ranks
from nets import cases, on_path
from reference import (DTYPES, bits, check_against_float64, digest, make_input, ops_for, poison, random_bits, reduced,
                       split_block, split_rows)

CAPACITY = 64 << 10  # small, so that sizes often go as several pieces

def _per_rank_sizes(seed: int, dtype, world: int) -> list[int]:
    """Elements per rank around a slot's edge (the largest shard of one piece: CAPACITY / world, half of it in
    lines) and beyond it, and random ones."""
    esize = torch.empty((), dtype=dtype).element_size()
    slot = CAPACITY // world // 2 // esize  # all-gather (lines); reduce-scatter of floats has twice the room
    rng = random.Random(seed)
    return [1, 3, 8, slot - 1, slot, slot + 1, 2 * slot + 5, 4 * slot + 1] + [rng.randint(1, 3 * slot)]


def _all_gather_and_reduce_scatter(store, rank, world, seed, net):
    digests = []
    case = 0
    with on_path(rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=60), net) as comm:
        for dtype in DTYPES:
            for numel in _per_rank_sizes(seed, dtype, world):
                case += 1
                # All-gather: arbitrary bit patterns, -0.0 and NaN payloads among them, come back exactly.
                shards = [random_bits(seed, case, r, numel, dtype) for r in range(world)]
                rows = shards[rank].reshape(numel, 1)
                in_place = case % 3 == 0
                out = poison(torch.empty(world * numel, 1, dtype=dtype))
                if in_place:
                    out[rank * numel:(rank + 1) * numel] = rows
                    got = comm.all_gather(out[rank * numel:(rank + 1) * numel], out=out)
                else:
                    got = comm.all_gather(rows, out=out)
                assert got is out and got.shape == (world * numel, 1)
                assert torch.equal(bits(got).flatten(), bits(torch.cat(shards))), f"all_gather {dtype} n={numel}"
                digests.append(digest(got))
                for op in ops_for(dtype):
                    case += 1
                    inputs = [make_input(seed, case, r, world * numel, dtype) for r in range(world)]
                    x = inputs[rank].clone()
                    part = slice(rank * numel, (rank + 1) * numel)
                    if case % 4 == 0:  # in place: the output is this rank's part of the input
                        got = comm.reduce_scatter(x, op=op, out=x[part])
                    else:
                        got = comm.reduce_scatter(x, op=op, out=poison(torch.empty(numel, dtype=dtype)))
                        assert torch.equal(x, inputs[rank]), "the input was modified"
                    want = reduced([t[part] for t in inputs], op)
                    assert torch.equal(bits(got), bits(want)), f"reduce_scatter {dtype} {op} n={numel}"
                    check_against_float64(got, [t[part] for t in inputs], op)
    return digests


@cases("net, world", ("", 2), ("", 3), ("", 4), ("tcp", 2), ("tcp", 3))
def test_all_gather_and_reduce_scatter_match_references_bit_for_bit(net, world):
    results = expect_ok(run_ranks(world, _all_gather_and_reduce_scatter, 4000 + world, net, timeout=240))
    assert all(r == results[0] for r in results[1:]), "ranks gathered different bits"


def _blocks(seed: int, case: int, rank: int, world: int, numel: int, dtype) -> torch.Tensor:
    """Rank `rank`'s all-to-all input: `world` blocks of `numel` elements of any bits, each block starting with
    -0.0 or a NaN (random_bits())."""
    return torch.cat([random_bits(seed, case, rank * world + b, numel, dtype) for b in range(world)])


def _all_to_all(store, rank, world, seed, net):
    digests = []
    case = 0
    with on_path(rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=60), net) as comm:
        for dtype in DTYPES:
            for numel in _per_rank_sizes(seed, dtype, world):  # elements of a block
                case += 1
                inputs = [_blocks(seed, case, r, world, numel, dtype).reshape(world * numel, 1) for r in range(world)]
                x = inputs[rank].clone()
                if case % 3 == 0:  # in place
                    got = comm.all_to_all(x, out=x)
                else:
                    got = comm.all_to_all(x, out=poison(torch.empty_like(x)))
                    assert torch.equal(bits(x), bits(inputs[rank])), "the input was modified"
                want = torch.cat([t[rank * numel:(rank + 1) * numel] for t in inputs])
                assert got.shape == x.shape and torch.equal(bits(got), bits(want)), f"all_to_all {dtype} n={numel}"
                digests.append(digest(got))
        # A dim 0 the blocks do not divide is refused alike on every rank: the communicator stays usable.
        with pytest.raises(ValueError, match="multiple of the world size"):
            comm.all_to_all(torch.ones(world + 1))
        assert torch.equal(comm.all_to_all(torch.full((world,), float(rank))), torch.arange(world, dtype=torch.float32))
    return digests


@cases("net, world", ("", 2), ("", 3), ("", 4), ("tcp", 2), ("tcp", 3))
def test_all_to_all_returns_every_peers_block_bit_for_bit(net, world):
    seed = 4100 + world
    results = expect_ok(run_ranks(world, _all_to_all, seed, net, timeout=240))
    # Each rank checked its output; here, from the inputs alone, what each rank's output must have been.
    for rank, got in enumerate(results):
        want, case = [], 0
        for dtype in DTYPES:
            for numel in _per_rank_sizes(seed, dtype, world):
                case += 1
                blocks = [_blocks(seed, case, s, world, numel, dtype)[rank * numel:(rank + 1) * numel]
                          for s in range(world)]
                want.append(digest(torch.cat(blocks).reshape(world * numel, 1)))
        assert got == want, f"rank {rank} received other blocks than its peers sent it"


ROW = 3  # elements per row of a split all-to-all's blocks


def _split_all_to_all(store, rank, world, seed, net):
    """Split all-to-alls in both forms: split lists (all_to_all_single's) and counts in a tensor with a fixed
    capacity per block, blocks of any bits, zeros and the largest block included."""
    digests = []
    with on_path(rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=60), net) as comm:
        for case, dtype in enumerate(DTYPES * 2):
            most = comm.largest_block(dtype) // ROW
            rows = split_rows(seed, case, world, most)
            sent = [split_block(seed, case, rank, t, world, rows[rank][t], ROW, dtype) for t in range(world)]
            want = [split_block(seed, case, s, rank, world, rows[s][rank], ROW, dtype) for s in range(world)]
            out = poison(torch.empty(sum(rows[s][rank] for s in range(world)), ROW, dtype=dtype))
            got = comm.all_to_all(torch.cat(sent), out=out, input_split_sizes=rows[rank],
                                  output_split_sizes=[rows[s][rank] for s in range(world)])
            assert got is out and torch.equal(bits(got), bits(torch.cat(want))), f"lists {dtype} {rows}"
            digests.append(digest(got))
            # The counts form: at most `capacity` rows a block, the counts in a tensor.
            capacity = max(max(r) for r in rows) or 1
            out = poison(torch.empty(world * capacity, ROW, dtype=dtype))
            counts = torch.full((world,), 99, dtype=torch.int64)
            comm.all_to_all_v(torch.cat(sent), torch.tensor(rows[rank]), out, counts)
            assert counts.tolist() == [rows[s][rank] for s in range(world)]
            for s in range(world):
                block = out[s * capacity:(s + 1) * capacity]
                assert torch.equal(bits(block[:rows[s][rank]]), bits(want[s])), f"counts {dtype} from {s}"
                assert bits(poison(block[rows[s][rank]:].clone())).equal(bits(block[rows[s][rank]:])), \
                    "rows past a block were written"
            digests.append(digest(out[:0]))
    return digests


@cases("net, world", ("", 2), ("", 3), ("", 4), ("tcp", 2), ("tcp", 3))
def test_split_all_to_all_returns_every_block_bit_for_bit(net, world):
    expect_ok(run_ranks(world, _split_all_to_all, 4200 + world, net, timeout=240))


def _split_faults(store, rank, world, fault):
    """A split all-to-all whose blocks rank 1 gets wrong: `fault` says how."""
    with rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=30) as comm:
        rows = [[2 + s + t for t in range(world)] for s in range(world)]
        x = torch.arange(sum(rows[rank]) * ROW, dtype=torch.float32).reshape(-1, ROW)
        recv = [rows[s][rank] for s in range(world)]
        if fault == "mismatch" and rank == 1:
            recv[0] += 1  # expects one row more from rank 0 than rank 0 sends
        out = poison(torch.zeros(sum(recv), ROW))
        counts = None
        try:
            if fault == "too large":
                big = comm.largest_block(torch.float32) // ROW + (1 if rank == 1 else 0)
                comm.all_to_all(torch.zeros(world * big, ROW), input_split_sizes=[big] * world,
                                output_split_sizes=[big] * world)
            elif fault == "bad count":
                send = torch.tensor(rows[rank])
                if rank == 1:
                    send[0] = 1000  # above the capacity
                out = poison(torch.zeros(world * 10, ROW))
                counts = comm.all_to_all_v(x, send, out)
            else:
                comm.all_to_all(x, out=out, input_split_sizes=rows[rank], output_split_sizes=recv)
                # The ranks whose blocks all arrived as expected complete the call; the next one fails.
                out = poison(torch.zeros(4))
                comm.all_reduce(torch.ones(4), out=out)
        except (rocenante.RocenanteError, ValueError) as err:  # a refusal is a ValueError
            poisoned = bool(torch.isnan(out).all()) and (counts is None or counts.tolist() == [-1] * world)
            return type(err).__name__, str(err), poisoned
        return "no error", "", False


@pytest.mark.parametrize("fault", ["mismatch", "too large", "bad count"])
def test_split_all_to_all_faults_name_the_rank_and_cause(fault):
    world = 3
    results = expect_ok(run_ranks(world, _split_faults, fault, timeout=120))
    for rank, (kind, message, poisoned) in enumerate(results):
        if fault == "mismatch":  # a disagreement on a block's size names both ranks, on every rank
            assert kind == "CallMismatchError", (rank, message)
            assert ("rank 0 sent this rank a block of 36 bytes" in message if rank == 1
                    else "rank 1 received from rank 0 a block of a size it did not expect" in message), (rank, message)
            assert poisoned, f"rank {rank}: the outputs are not all poison"
        elif rank == 1:  # the rank with the bad block says why
            assert kind == "InvalidArgument", (kind, message)
            assert ("larger than a block can be" if fault == "too large" else "the split counts say 1000 rows for rank 0") \
                in message, message
        else:
            assert ("rank 1 refused a call" if fault == "too large" else "rank 1's split counts for rank 0 could not "
                    "be sent") in message, (rank, message)
            assert poisoned or fault == "too large", f"rank {rank}: the outputs are not all poison"


def _two_shot(store, rank, world, seed, net):
    digests = []
    case = 0
    with on_path(rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=60), net) as comm:
        assert comm.two_shot(1) and comm.two_shot(1 << 30)
        for dtype in DTYPES:
            esize = torch.empty((), dtype=dtype).element_size()
            piece = CAPACITY // (2 if dtype == torch.int32 else 1) // esize
            rng = random.Random(seed + case)
            for numel in [1, 5, world, 4 * world + 1, piece - 1, piece + 1, 2 * piece + 3, rng.randint(1, 3 * piece)]:
                for op in ops_for(dtype):
                    case += 1
                    inputs = [make_input(seed, case, r, numel, dtype) for r in range(world)]
                    # Tiny negative values, whose average or rounding is -0.0: it comes back as +0.0 on every rank.
                    if dtype != torch.int32:
                        for t in inputs:
                            t[0] = -1e-30 if dtype == torch.float32 else -1e-8
                    x = inputs[rank].clone()
                    in_place = case % 5 == 0
                    got = comm.all_reduce(x, op=op, out=x if in_place else poison(torch.empty_like(x)))
                    assert torch.equal(bits(got), bits(reduced(inputs, op))), f"two-shot {dtype} {op} n={numel}"
                    digests.append(digest(got))
    return digests


@pytest.mark.parametrize("world", [2, 3, 4])
def test_two_shot_returns_the_bits_of_one_shot_on_every_rank(net, world, monkeypatch):
    # The reference is one-shot's (rank order, fp32 accumulation): equal bits, whatever exchange moved them. Over
    # the network each piece goes as a reduce-scatter and an all-gather (csrc/layout.h).
    monkeypatch.setenv("ROCENANTE_ALGO", "twoshot")
    results = expect_ok(run_ranks(world, _two_shot, 5000 + world, net, timeout=240))
    assert all(r == results[0] for r in results[1:]), "ranks produced different bits"


def _mismatch(store, rank, world, calls):
    with rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=30) as comm:
        with pytest.raises(ValueError, match="multiple of the world size"):  # alike on every rank: still usable
            comm.reduce_scatter(torch.ones(2 * world + 1))
        x = torch.ones(8 * world)
        out = poison(torch.empty(8 * world * (world if calls[rank] == "all_gather" else 1)))
        try:
            if calls[rank] == "all_gather":
                comm.all_gather(x, out=out)
            elif calls[rank] == "all_to_all":
                comm.all_to_all(x, out=out)
            elif calls[rank] == "reduce_scatter":
                out = poison(torch.empty(8))
                comm.reduce_scatter(x, out=out)
            else:
                comm.all_reduce(x, out=out)
        except rocenante.CallMismatchError as err:
            return str(err), bool(torch.isnan(out).all())
        return "no error", False


@pytest.mark.parametrize("calls", [("all_gather", "all_reduce"), ("reduce_scatter", "all_reduce"),
                                   ("reduce_scatter", "all_gather"), ("all_to_all", "all_reduce"),
                                   ("all_to_all", "reduce_scatter")], ids="-vs-".join)
def test_a_different_collective_is_named_on_every_rank(calls):
    world = 2
    results = expect_ok(run_ranks(world, _mismatch, calls, timeout=120))
    for rank, (message, poisoned) in enumerate(results):
        other = 1 - rank
        assert f"rank {other} called {calls[other]} with" in message, message
        assert poisoned, f"rank {rank}: the output of the mismatched call is not all poison"


def _algo(store, rank, world, settings):
    os.environ["ROCENANTE_ALGO"] = settings[rank]
    try:
        rocenante.Communicator(store, rank, world, timeout_s=30).close()
    except rocenante.RocenanteError as err:
        return str(err)
    return "built"


def test_ranks_that_set_rocenante_algo_differently_are_told_at_startup():
    results = expect_ok(run_ranks(2, _algo, ("twoshot", "oneshot"), timeout=120))
    for message in results:
        assert "configured differently" in message and "two-shot from 0 bytes" in message \
            and "two-shot never" in message, message


def _timeout(store, rank, world):
    with rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=1) as comm:
        if rank == 1:  # alive, never calling
            time.sleep(3)
            return "absent"
        out = torch.zeros(3 * 1000)
        try:
            comm.all_gather(torch.ones(1000), out=out)
        except rocenante.PeerTimeoutError as err:
            return str(err), bool(torch.isnan(out).all())
        return "no error", False


def test_an_all_gather_whose_peer_never_comes_times_out_naming_it_with_its_output_poisoned():
    results = run_ranks(3, _timeout, timeout=120)
    for rank in (0, 2):  # the first to time out names rank 1; the other hears it from that rank's abort word
        assert isinstance(results[rank], tuple) and len(results[rank]) == 2, results
        message, poisoned = results[rank]
        assert "waiting for rank(s) 1" in message or "a wait for rank(s) 1 timed out" in message, message
        assert poisoned, f"rank {rank}: the all-gather's output is not all poison"


def test_world_1_and_a_scalar():
    store = torch.distributed.HashStore()
    with rocenante.Communicator(store, 0, 1) as comm:
        with pytest.raises(TypeError, match="at least one dimension"):
            comm.all_gather(torch.tensor(1.0))
        assert torch.equal(comm.all_gather(torch.arange(4.0)), torch.arange(4.0))
        assert torch.equal(comm.reduce_scatter(torch.arange(4.0), op="max"), torch.arange(4.0))
        with pytest.raises(TypeError, match="at least one dimension"):
            comm.all_to_all(torch.tensor(1.0))
        assert torch.equal(comm.all_to_all(torch.arange(4.0)), torch.arange(4.0))


def _issue_checks(store, rank, world):
    """issue() refuses alike, on every rank, a reduce-scatter or all-to-all whose elements the world does not
    divide (a floor would drop the tail silently); the communicator stays usable."""
    with rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=30) as comm:
        for collective in ("reduce_scatter", "all_to_all"):
            with pytest.raises(ValueError, match="multiple of the world size"):
                comm.issue(torch.ones(2 * world + 1), out=torch.empty(2 * world + 1), collective=collective)
        x = torch.arange(2.0 * world) + 10 * rank
        out = torch.empty_like(x)
        comm.issue(x, out=out, collective="all_to_all")
        return out.tolist()


def test_issue_refuses_a_tail_the_world_does_not_divide():
    world = 2
    for rank, got in enumerate(expect_ok(run_ranks(world, _issue_checks, timeout=120))):
        assert got == [float(10 * s + 2 * rank + i) for s in range(world) for i in range(2)], got


def test_gpu_two_shot_sizes_are_the_models_crossovers():
    """_env's modelled GPU sizes are what rocenante.model computes, rounded down to 4 KiB: GPUs of one host from the
    committed one-shot figures they cite, DGX Sparks over RoCE from the model's own profile; the rest as documented."""
    import json

    from rocenante import _C, _env
    from rocenante.model import allreduce

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "benchmarks", "results", "h200x2-bf16-eager-graph-99aaa0c.json")) as f:
        rows = json.load(f)["rows"]
    points = sorted((r["bytes"], r["median_us"] * 1e-6) for r in rows
                    if r["arm"] == "rocenante" and r["mode"] == "graph" and r["bytes"] <= 32 << 20)
    fit = allreduce.calibrate("h200x2", 2, points, "one-shot in CUDA graphs")
    one_host = allreduce.Profile("h200x2", 0.0, fit["bandwidth_GBps"] * 1e9, fit["overhead_us"] * 1e-6, "")
    roce = allreduce.PROFILES["dgx-spark-roce"]

    def modelled(profile, world):
        size = allreduce.crossover(profile, world, allreduce.one_shot, allreduce.two_shot)
        return _C.layout.never if size is None else int(size) // 4096 * 4096

    for world in range(2, 9):
        assert _env.twoshot_from("cuda", world, "shm")[0] == modelled(one_host, world), world
        assert _env.twoshot_from("cuda", world, "ib")[0] == modelled(roce, world), world
        assert _env.twoshot_from("cuda", world, "tcp")[0] == _C.layout.never
        assert _env.twoshot_from("cpu", world, "shm")[0] == _env.TWOSHOT_FROM_CPU
        assert _env.twoshot_from("cpu", world, "ib")[0] == _C.layout.never
    assert "modelled" in _env.twoshot_from("cuda", 4, "shm")[1]
    assert "modelled for DGX Sparks" in _env.twoshot_from("cuda", 4, "ib")[1]
