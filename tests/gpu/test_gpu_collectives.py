"""All-gather, reduce-scatter, all-to-all and two-shot all-reduce on GPUs (sharded_kernel,
csrc/device/collective_kernels.cu): every dtype and op at slot and piece edges, bit for bit against references every
rank computes, in CUDA graphs, with a mismatched collective; directly (CUDA IPC) and over the TCP wire (where a
two-shot piece is two calls of the protocol, a reduce-scatter and an all-gather, made by one launch). Worlds 2 to 8
on whatever GPUs there are (tests/support/gpus.py)."""

from __future__ import annotations

import random

import pytest
import torch

import gpus
from multiproc import expect_ok, run_ranks
from nets import on_path
from reference import DTYPES, bits, make_input, ops_for, poison, random_bits, reduced, split_block, split_rows

WORLDS = [2, 3, 4, 8]
CAPACITY = 64 << 10  # small, so that calls go as pieces


def _comm(store, rank, world, net):
    import rocenante

    return on_path(rocenante.Communicator(store, rank, world, device=gpus.use(rank), capacity_bytes=CAPACITY,
                                          timeout_s=60), net)


def _two_shot(monkeypatch):
    """Every all-reduce two-shot."""
    monkeypatch.setenv("ROCENANTE_ALGO", "twoshot")


def _sizes(seed, dtype, world) -> list[int]:
    """Elements per rank: tiny, around a slot (an all-gather's largest shard of one piece), beyond it."""
    esize = torch.empty((), dtype=dtype).element_size()
    slot = CAPACITY // world // 2 // esize
    sizes = [1, 5, slot - 1, slot + 1, 2 * slot + 3, random.Random(seed).randint(1, 3 * slot)]
    return sizes[::2] if gpus.shared(world) else sizes


def _every_collective(store, rank, world, seed, net):
    comm = _comm(store, rank, world, net)
    assert comm.two_shot(1), "ROCENANTE_ALGO=twoshot did not take"
    dev = gpus.device_of(rank)
    case, checked = 0, 0
    for dtype in DTYPES:
        for numel in _sizes(seed + case, dtype, world):
            case += 1
            shards = [random_bits(seed, case, r, numel, dtype) for r in range(world)]
            out = poison(torch.empty(world * numel, dtype=dtype, device=dev))
            if case % 3 == 0:  # in place: the input is this rank's part of the output
                out[rank * numel:(rank + 1) * numel] = shards[rank].to(dev)
                comm.all_gather(out[rank * numel:(rank + 1) * numel], out=out)
            else:
                comm.all_gather(shards[rank].to(dev), out=out)
            if not torch.equal(bits(out.cpu()), bits(torch.cat(shards))):
                raise AssertionError(f"all_gather {dtype} n={numel}")
            checked += 1
            case += 1
            blocks = [random_bits(seed, case, r, world * numel, dtype) for r in range(world)]
            x = blocks[rank].to(dev)
            got = comm.all_to_all(x, out=x if case % 3 == 0 else poison(torch.empty_like(x)))
            if not torch.equal(bits(got.cpu()), bits(torch.cat([b[rank * numel:(rank + 1) * numel] for b in blocks]))):
                raise AssertionError(f"all_to_all {dtype} n={numel}")
            for op in ops_for(dtype):
                case += 1
                inputs = [make_input(seed, case, r, world * numel, dtype) for r in range(world)]
                part = slice(rank * numel, (rank + 1) * numel)
                x = inputs[rank].to(dev)
                got = comm.reduce_scatter(x, op=op, out=x[part] if case % 4 == 0 else None)
                if not torch.equal(bits(got.cpu()), bits(reduced(inputs, op)[part])):
                    raise AssertionError(f"reduce_scatter {dtype} {op} n={numel}")
                x = inputs[rank].to(dev)
                got = comm.all_reduce(x, op=op, out=x if case % 5 == 0 else None)
                if not torch.equal(bits(got.cpu()), bits(reduced(inputs, op))):
                    raise AssertionError(f"two-shot all_reduce {dtype} {op} n={world * numel}")
                checked += 1
    comm.synchronize()
    comm.close()
    return checked


@pytest.mark.parametrize("world", WORLDS)
def test_every_collective_dtype_and_op_bit_for_bit(net, world, monkeypatch):
    _two_shot(monkeypatch)
    results = expect_ok(run_ranks(world, _every_collective, 6000 + world, net, timeout=600))
    assert results == [results[0]] * world and results[0] > 0, results


def _graph(store, rank, world, net, replays):
    comm = _comm(store, rank, world, net)
    assert comm.two_shot(1), "ROCENANTE_ALGO=twoshot did not take"
    dev = gpus.device_of(rank)
    n = 4099  # per rank: a tail that is not a whole chunk
    x = torch.empty(world * n, dtype=torch.bfloat16, device=dev)
    shard = torch.empty(n, dtype=torch.bfloat16, device=dev)
    gathered, scattered, summed = torch.empty_like(x), torch.empty_like(shard), torch.empty_like(x)
    exchanged = torch.empty_like(x)

    def calls():
        comm.all_gather(shard, out=gathered)
        comm.reduce_scatter(x, out=scattered)
        comm.all_reduce(x, out=summed)
        comm.all_to_all(x, out=exchanged)

    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):  # warm up off the capture
        calls()
    torch.cuda.current_stream(dev).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    for i in range(replays):
        inputs = [make_input(i, 0, r, world * n, torch.bfloat16) for r in range(world)]
        shards = [random_bits(i, 1, r, n, torch.bfloat16) for r in range(world)]
        x.copy_(inputs[rank])
        shard.copy_(shards[rank])
        for t in (gathered, scattered, summed, exchanged):
            poison(t)
        graph.replay()
        torch.cuda.synchronize()
        want = reduced(inputs, "sum")
        if not torch.equal(bits(gathered.cpu()), bits(torch.cat(shards))) \
                or not torch.equal(bits(scattered.cpu()), bits(want[rank * n:(rank + 1) * n])) \
                or not torch.equal(bits(summed.cpu()), bits(want)) \
                or not torch.equal(bits(exchanged.cpu()), bits(torch.cat([t[rank * n:(rank + 1) * n] for t in inputs]))):
            raise AssertionError(f"replay {i} gave a wrong result")
    comm.synchronize()
    comm.close()
    return replays


@pytest.mark.parametrize("world", WORLDS)
def test_graph_replays_with_new_inputs(net, world, monkeypatch):
    _two_shot(monkeypatch)
    replays = gpus.calls(200, world, on_shared=20, least=5)
    assert expect_ok(run_ranks(world, _graph, net, replays, timeout=300)) == [replays] * world


def _launches(store, rank, world, net):
    """Kernel launches and call numbers of one two-shot all-reduce of three pieces."""
    from torch.profiler import ProfilerActivity, profile

    comm = _comm(store, rank, world, net)
    assert comm.two_shot(1), "ROCENANTE_ALGO=twoshot did not take"
    dev = gpus.device_of(rank)
    # float32 elements of a piece: world slots, as many chunks each as the area holds
    piece = CAPACITY // (world * 16) * 4 * world
    inputs = [make_input(7, 0, r, 3 * piece, torch.float32) for r in range(world)]
    x = inputs[rank].to(dev)
    before = comm.issue(torch.zeros(world, device=dev))  # one piece, warming the kernel up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        after = comm.issue(x)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA" and "kernel" in e.name]
    ok = torch.equal(bits(x.cpu()), bits(reduced(inputs, "sum")))
    comm.synchronize()
    comm.close()
    return after - before, kernels, ok


@pytest.mark.parametrize("world", [2, 3])
def test_a_two_shot_piece_is_one_launch(net, world, monkeypatch):
    """Over the network too: one launch a piece, which makes two calls of the protocol there (numbers advance by two
    a piece) and one directly."""
    _two_shot(monkeypatch)
    for rank, (advance, kernels, ok) in enumerate(expect_ok(run_ranks(world, _launches, net, timeout=300))):
        assert ok, f"rank {rank}: wrong sum"
        assert len(kernels) == 3 and all("sharded_kernel" in k for k in kernels), f"rank {rank}: {kernels}"
        assert advance == 3 * (2 if net else 1), f"rank {rank}: call numbers advanced by {advance}"


def _mismatch(store, rank, world, net, first):
    import rocenante

    comm = _comm(store, rank, world, net)
    dev = gpus.device_of(rank)
    out = torch.empty(world * 64, device=dev)
    try:
        if rank == 0 and first == "all_gather":
            comm.all_gather(torch.ones(64, device=dev), out=out)
        elif rank == 0:  # an all-to-all of as many elements as the all-reduce: only the call word tells them apart
            comm.all_to_all(torch.ones(world * 64, device=dev), out=out)
        else:
            comm.all_reduce(torch.ones(world * 64, device=dev), out=out)
        comm.synchronize()
    except rocenante.CallMismatchError as err:
        # Every element the call could not compute is poison: all of an all-reduce's; all of an all-gather's or
        # all-to-all's but this rank's own part, which it copied without any peer's data.
        if rank == 0:
            out[:64] = float("nan")
        return str(err), bool(torch.isnan(out).all())
    return "no error", False


@pytest.mark.parametrize("first", ["all_gather", "all_to_all"])
@pytest.mark.parametrize("world", [2, 3])
def test_a_different_collective_is_named_and_poisons(net, world, first):
    results = expect_ok(run_ranks(world, _mismatch, net, first, timeout=300))
    for rank, (message, poisoned) in enumerate(results):
        assert "made a different call" in message or f"called {first} with" in message \
            or "called all_reduce with" in message, f"rank {rank}: {message}"
        assert poisoned, f"rank {rank}: the output of the mismatched call is not all poison"


ROW = 5  # elements per row of a split all-to-all's blocks


def _split_all_to_all(store, rank, world, net, replays):
    """Split all-to-alls (blocks_kernel): the lists form and the counts form of every dtype, blocks of any bits from
    none to the largest, then the counts form captured in a CUDA graph and replayed with new splits and data."""
    comm = _comm(store, rank, world, net)
    dev = gpus.device_of(rank)
    checked = 0
    for case, dtype in enumerate(DTYPES):
        rows = split_rows(17, case, world, comm.largest_block(dtype) // ROW)
        sent = torch.cat([split_block(17, case, rank, t, world, rows[rank][t], ROW, dtype) for t in range(world)])
        want = [split_block(17, case, s, rank, world, rows[s][rank], ROW, dtype) for s in range(world)]
        out = poison(torch.empty(sum(rows[s][rank] for s in range(world)), ROW, dtype=dtype, device=dev))
        comm.all_to_all(sent.to(dev), out=out, input_split_sizes=rows[rank],
                        output_split_sizes=[rows[s][rank] for s in range(world)])
        if not torch.equal(bits(out.cpu()), bits(torch.cat(want))):
            raise AssertionError(f"split lists {dtype} {rows}")
        capacity = max(max(r) for r in rows) or 1
        out = poison(torch.empty(world * capacity, ROW, dtype=dtype, device=dev))
        counts = comm.all_to_all_v(sent.to(dev), torch.tensor(rows[rank], device=dev), out)
        got = out.cpu()
        if counts.tolist() != [rows[s][rank] for s in range(world)] or not all(
                torch.equal(bits(got[s * capacity:s * capacity + rows[s][rank]]), bits(want[s])) for s in range(world)):
            raise AssertionError(f"split counts {dtype} {rows}")
        checked += 2
    # The counts form in a graph: each replay reads the splits the routing wrote into the captured tensors.
    capacity = 40
    x = torch.empty(world * capacity, ROW, dtype=torch.bfloat16, device=dev)
    splits = torch.zeros(world, dtype=torch.int64, device=dev)
    out = torch.empty(world * capacity, ROW, dtype=torch.bfloat16, device=dev)
    counts = torch.empty(world, dtype=torch.int64, device=dev)
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):  # warm up off the capture
        comm.all_to_all_v(x, splits, out, counts)
    torch.cuda.current_stream(dev).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        comm.all_to_all_v(x, splits, out, counts)
    for i in range(replays):
        rows = split_rows(i, 99, world, capacity)
        blocks = [split_block(i, 99, rank, t, world, rows[rank][t], ROW, torch.bfloat16) for t in range(world)]
        x.zero_()[:sum(rows[rank])] = torch.cat(blocks).to(dev)
        splits.copy_(torch.tensor(rows[rank]))
        poison(out)
        counts.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        got = out.cpu()
        for s in range(world):
            block = split_block(i, 99, s, rank, world, rows[s][rank], ROW, torch.bfloat16)
            if counts[s].item() != rows[s][rank] or not torch.equal(bits(got[s * capacity:s * capacity + len(block)]),
                                                                    bits(block)):
                raise AssertionError(f"replay {i}: the block from rank {s} is wrong")
        checked += 1
    comm.synchronize()
    comm.close()
    return checked


@pytest.mark.parametrize("world", WORLDS)
def test_split_all_to_all_every_dtype_and_graph_replays(net, world):
    replays = gpus.calls(50, world, on_shared=8, least=3)
    assert expect_ok(run_ranks(world, _split_all_to_all, net, replays, timeout=300)) == [2 * len(DTYPES) + replays] * world


def _split_fault(store, rank, world, net, fault):
    """Rank 1 expects one row more from rank 0 than rank 0 sends (lists form), or gives a count above the capacity
    (counts form, found by the kernel)."""
    comm = _comm(store, rank, world, net)
    dev = gpus.device_of(rank)
    rows = [[2 + s + t for t in range(world)] for s in range(world)]
    x = torch.arange(sum(rows[rank]) * ROW, dtype=torch.float32, device=dev).reshape(-1, ROW)
    counts = None
    try:
        if fault == "mismatch":
            recv = [rows[s][rank] + (1 if (rank, s) == (1, 0) else 0) for s in range(world)]
            out = poison(torch.zeros(sum(recv), ROW, device=dev))
            comm.all_to_all(x, out=out, input_split_sizes=rows[rank], output_split_sizes=recv)
        else:
            send = torch.tensor(rows[rank], device=dev)
            if rank == 1:
                send[0] = 1000
            out = poison(torch.zeros(world * 10, ROW, device=dev))
            counts = comm.all_to_all_v(x, send, out)
        comm.synchronize()
        comm.all_reduce(torch.ones(4, device=dev))  # ranks that met no fault in the call meet the abort here
        comm.synchronize()
    except Exception as err:  # noqa: BLE001 - the class is checked by the test
        poisoned = bool(torch.isnan(out).all()) and (counts is None or counts.tolist() == [-1] * world)
        return type(err).__name__, str(err), poisoned
    return "no error", "", False


@pytest.mark.parametrize("fault", ["mismatch", "bad count"])
def test_split_all_to_all_faults_name_both_ranks(net, fault):
    world = 3
    results = expect_ok(run_ranks(world, _split_fault, net, fault, timeout=300))
    for rank, (kind, message, poisoned) in enumerate(results):
        if fault == "mismatch":
            assert kind == "CallMismatchError", (rank, kind, message)
            assert ("rank 0 sent this rank a block of 60 bytes" if rank == 1
                    else "rank 1 received from rank 0 a block of a size it did not expect") in message, (rank, message)
            if rank == 1:
                assert poisoned, "the output of the mismatched call is not all poison"
        else:
            assert ("the split counts say 1000 rows for rank 0" if rank == 1
                    else "rank 1's split counts for rank 0 could not be sent") in message, (rank, message)
            assert poisoned, f"rank {rank}: the outputs and counts of the faulted call are not all poison"
