"""Resources and endurance on the CPU path: create/destroy cycles leave nothing behind, and a long run of random
calls stays exact and identical on every rank. Each test prints its figures (stderr) and records them."""

from __future__ import annotations

import glob
import hashlib
import math
import os
import random
import sys
import time

import torch

import rocenante
from multiproc import expect_ok, record_figure, run_ranks
from probes import EMULATED, MAPS_TOLERANCE, host_probe
from reference import DTYPES, check_against_float64, make_input, ops_for, sequential_fp32

COMMUNICATOR_CYCLES = 1000
BACKEND_CYCLES = 100
WARMUP_CYCLES = 5  # first builds load libraries, start threads and fill allocator pools: not leaks
# Growth allowed over all the cycles of one kind: none for fds, segments and device mappings; MAPS_TOLERANCE
# mappings; RSS within the allocator's noise.
RSS_TOLERANCE_KIB = 2 << 10


def _probe() -> dict:
    # This process's segments (their names carry its pid); other processes on the host may hold theirs.
    return {**host_probe(), "shm": len(glob.glob(f"/dev/shm/rocenante-*-{os.getpid()}-*"))}


def _cycles(store, rank, world, communicator_cycles, backend_cycles):
    import torch.distributed as dist

    def communicator_cycle():
        with rocenante.Communicator(store, rank, world, capacity_bytes=4096, timeout_s=60, name="cycles") as comm:
            assert comm.all_reduce(torch.ones(4)).tolist() == [float(world)] * 4

    def backend_cycle():
        dist.init_process_group("rocenante", store=store, rank=rank, world_size=world)
        x = torch.ones(4)
        dist.all_reduce(x)
        assert x.tolist() == [float(world)] * 4
        dist.destroy_process_group()

    figures = {}
    for kind, cycle, count in (("communicator", communicator_cycle, communicator_cycles),
                               ("backend", backend_cycle, backend_cycles)):
        for _ in range(WARMUP_CYCLES):
            cycle()
        before, start = _probe(), time.monotonic()
        for _ in range(count):
            cycle()
        figures[kind] = (before, _probe(), (time.monotonic() - start) / count)
    return figures


def test_create_destroy_cycles_leak_nothing():
    results = expect_ok(run_ranks(2, _cycles, COMMUNICATOR_CYCLES, BACKEND_CYCLES, timeout=280))
    summary = []
    for rank, figures in enumerate(results):
        for kind, (before, after, seconds) in figures.items():
            count = COMMUNICATOR_CYCLES if kind == "communicator" else BACKEND_CYCLES
            growth = {k: after[k] - before[k] for k in before}
            for k, v in after.items():
                record_figure(f"cpu_{kind}_cycles_{count}_rank{rank}_{k}_after", v)
                record_figure(f"cpu_{kind}_cycles_{count}_rank{rank}_{k}_growth", growth[k])
            record_figure(f"cpu_{kind}_cycle_s_rank{rank}", seconds)
            summary.append(f"rank {rank} {count} {kind} cycles ({seconds * 1e3:.1f} ms each): "
                           + ", ".join(f"{k} {before[k]} -> {after[k]}" for k in before))
            where = f"rank {rank}, {count} {kind} cycles: {before} -> {after}"
            assert after["shm"] == 0 and growth["fds"] <= 0 and growth["device_maps"] <= 0, where
            assert growth["maps"] <= MAPS_TOLERANCE and (growth["rss_kib"] <= RSS_TOLERANCE_KIB or EMULATED), where
    print("cycles: " + "; ".join(summary), file=sys.stderr)


SOAK_CALLS = 100_000
SOAK_BYTES = 64 << 10
CHECK_EVERY = 500  # calls checked against the rank-order and the float64 references


def _soak(store, rank, world, seed, calls):
    comm = rocenante.Communicator(store, rank, world, capacity_bytes=SOAK_BYTES, timeout_s=60)
    # Every rank holds every rank's inputs: calls read a random window of them, so any rank can check any call.
    pools = {d: [make_input(seed, i, r, 2 * SOAK_BYTES // d.itemsize, d) for r in range(world)] for i, d in enumerate(DTYPES)}
    outs = {d: torch.empty(SOAK_BYTES // d.itemsize, dtype=d) for d in DTYPES}
    rng = random.Random(seed)  # the same calls on every rank
    outputs = hashlib.sha256()
    checked = 0
    start = time.monotonic()
    for i in range(calls):
        dtype = rng.choice(DTYPES)
        op = rng.choice(ops_for(dtype))
        limit = SOAK_BYTES // dtype.itemsize
        # Half the sizes uniform in elements, half log-uniform (as many small calls as large ones).
        numel = rng.randint(1, limit) if rng.random() < 0.5 else min(limit, int(2 ** rng.uniform(0, math.log2(limit + 1))))
        offset = rng.randrange(limit)
        out = outs[dtype][:numel]
        comm.all_reduce(pools[dtype][rank][offset : offset + numel], op=op, out=out)
        outputs.update(out.view(torch.uint8).numpy())
        if i % CHECK_EVERY == 0:
            inputs = [pools[dtype][r][offset : offset + numel] for r in range(world)]
            assert torch.equal(out, sequential_fp32(inputs, op)), f"call {i}: {numel} x {dtype} {op} is not exact"
            check_against_float64(out, inputs, op)
            checked += 1
    elapsed = time.monotonic() - start
    comm.close()
    return outputs.hexdigest(), checked, elapsed


def test_soak_of_random_calls_is_exact_and_identical_on_every_rank():
    results = expect_ok(run_ranks(2, _soak, 2024, SOAK_CALLS, timeout=300))
    digests = {digest for digest, _, _ in results}
    assert len(digests) == 1, f"ranks' outputs differ over {SOAK_CALLS} calls: {digests}"
    elapsed = max(seconds for _, _, seconds in results)
    checked = results[0][1]
    assert checked == -(-SOAK_CALLS // CHECK_EVERY)
    record_figure("cpu_soak_calls", SOAK_CALLS)
    record_figure("cpu_soak_s", elapsed)
    print(f"soak: {SOAK_CALLS} calls (random dtype, op, 1 B..64 KiB) on 2 ranks in {elapsed:.1f} s "
          f"({elapsed / SOAK_CALLS * 1e6:.0f} us per call), outputs identical (sha256), {checked} checked "
          "against rank order and float64", file=sys.stderr)
