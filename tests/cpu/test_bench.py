"""The benchmark (python -m rocenante.bench): its arm rotation and statistics on synthetic timings, its output
check on real processes, its argument checks, and a tiny end-to-end CPU run of the README command (its GPU runs:
tests/gpu/test_gpu_bench.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from multiproc import run_ranks
from rocenante.bench import __main__ as cli
from rocenante.bench import report, runner


def test_round_order_rotates_by_one_and_each_arm_leads_in_turn():
    arms = ["a", "b", "c"]
    orders = [runner.round_order(arms, r) for r in range(6)]
    assert orders[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert orders[3:] == orders[:3]
    for rnd, order in enumerate(orders):
        assert sorted(order) == arms, "every arm runs once per round"
        assert order[0] == arms[rnd % 3]
    assert runner.round_order([], 4) == []


def test_summarize_takes_the_slower_rank_of_each_measurement():
    # The slower rank differs between measurements: neither rank's own median is the answer.
    rank0 = [10.0, 1.0, 10.0, 1.0, 10.0, 1.0, 1.0]
    rank1 = [1.0, 20.0, 1.0, 20.0, 1.0, 20.0, 2.0]
    s = runner.summarize([rank0, rank1])
    slower = [10.0, 20.0, 10.0, 20.0, 10.0, 20.0, 2.0]
    assert s["measurements"] == 7
    assert s["median_us"] == 10.0  # sorted: 2 10 10 10 20 20 20
    assert s["median_us"] != max(sorted(rank0)[3], sorted(rank1)[3])
    # numpy's default (linear) percentiles of the slower times: positions 0.6 and 5.4 of the sorted list.
    assert s["p10_us"] == pytest.approx(2.0 + 0.6 * 8.0)
    assert s["p90_us"] == pytest.approx(20.0)
    assert s["p10_us"] <= s["median_us"] <= s["p90_us"]
    assert runner.summarize([slower])["median_us"] == s["median_us"]


def test_percentile_interpolates_like_numpy():
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 9.0, 7.0, 8.0, 6.0, 10.0, 0.0]  # 0..10 shuffled
    for q in (0.0, 0.1, 0.25, 0.5, 0.9, 1.0):
        assert runner.percentile(values, q) == pytest.approx(10 * q)
    assert runner.percentile([1.0, 2.0], 0.1) == pytest.approx(1.1)


def test_summarize_refuses_ranks_with_different_counts():
    with pytest.raises(ValueError, match="different numbers"):
        runner.summarize([[1.0] * 7, [1.0] * 6])


def test_calls_per_measurement_match_issue_11s_table():
    assert runner.calls_per_measurement(256) == 50
    assert runner.calls_per_measurement(1 << 20) == 50
    assert runner.calls_per_measurement((1 << 20) + 2) == 20
    assert runner.calls_per_measurement(64 << 20) == 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_check_data_sums_exactly_in_any_order(dtype):
    # Sums in the dtype, in two orders, equal the float64 sum: any correct arm gives these bits.
    world, numel, seed = 8, 4096, 1234
    inputs = [runner.check_input(seed, r, numel, dtype, "cpu") for r in range(world)]
    assert len({bytes(x.view(torch.uint8).numpy()) for x in inputs}) == world, "ranks' inputs differ"
    want = runner.expected_sum(seed, world, numel, dtype, "cpu")
    forward, backward = torch.zeros_like(inputs[0]), torch.zeros_like(inputs[0])
    for x in inputs:
        forward += x
    for x in reversed(inputs):
        backward += x
    assert runner.bitwise_mismatch("forward", forward, want) is None
    assert runner.bitwise_mismatch("backward", backward, want) is None
    assert not torch.signbit(want[want == 0]).any(), "no -0.0 (a sentinel for some formats) in the data"


def test_bitwise_mismatch_names_the_first_difference():
    want = torch.tensor([1.0, 2.0, 3.0, 0.0], dtype=torch.bfloat16)
    got = want.clone()
    got[3] = -0.0  # equal as numbers, not as bits
    got[2] = 3.5
    msg = runner.bitwise_mismatch("arm x", got, want)
    assert "arm x: 2 of 4 elements differ bitwise; first at index 2" in msg
    assert runner.bitwise_mismatch("arm x", want.clone(), want) is None
    assert "expected" in runner.bitwise_mismatch("arm x", want.float(), want)


class _WrongOnRank1:
    """A gloo all-reduce that adds one ulp-sized error on rank 1 only."""

    name = "wrong"
    all_reduce = True  # checked like every all-reduce arm (arms.Arm)

    def __init__(self, ctx, group):
        self.ctx, self.group = ctx, group

    def call(self, x, y):
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        if self.ctx.rank == 1:
            x[7] = x[7] + 0.125
        return x


class _Unsupported:
    """An arm whose call raises before communicating, on every rank (as an op lacking a dtype does)."""

    name = "unsupported"
    all_reduce = True  # checked like every all-reduce arm (arms.Arm)

    def call(self, x, y):
        raise TypeError("no float32 kernel")


def _check_on_ranks(store, rank, world, wrong):
    import torch.distributed as dist

    from rocenante.bench import arms as arms_mod

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        ctx = runner.Context(rank, world, torch.device("cpu"), None)
        group = dist.group.WORLD
        arm = _WrongOnRank1(ctx, group) if wrong else arms_mod.Collective(ctx, "gloo", group)
        arms = [_Unsupported(), arm]
        buffers = {a.name: (torch.full((64,), float("nan")), torch.full((64,), float("nan"))) for a in arms}
        return runner._check(ctx, arms, buffers, None, 99, 64, torch.float32, group)
    finally:
        dist.destroy_process_group()


def test_check_passes_a_correct_arm_and_fails_a_wrong_one_on_every_rank():
    left_out = {"unsupported": "rank 1: TypeError: no float32 kernel"}  # the same verdict on every rank
    assert run_ranks(2, _check_on_ranks, False, timeout=120) == [left_out, left_out]
    results = run_ranks(2, _check_on_ranks, True, timeout=120)
    for res in results:  # both ranks raise, so neither is left waiting in the next collective
        assert res[0] == "error" and res[1] == "RuntimeError", res
        assert "rank 1: wrong against the float64 sum: 1 of 64 elements differ bitwise; first at index 7" in res[2]


def test_method_recorded_for_a_gpu_run():
    cfg = {"device": "cuda", "modes": ["graph", "eager"], "rounds": 9}
    m = runner.method(cfg, {"sleep_cycles": 98765, "sleep_cycles_per_us": 1975.321})
    assert m["sleep_before_replay_us"] == 50 and m["sleep_cycles"] == 98765
    assert m["measurements_per_arm_size_mode"] == 9 and m["timer"] == "CUDA events"
    assert "NCCL" in m["check"] and "torch.cuda._sleep" in m["graph"] and "no sleep" in m["eager"]


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        cli.parse_args(["--device", "cpu", "--arms", "rocenante,nccl"])  # no NCCL arm on CPU
    with pytest.raises(SystemExit):
        cli.parse_args(["--device", "cpu", "--rounds", "6"])
    with pytest.raises(SystemExit):
        cli.parse_args(["--device", "cpu", "--modes", "graph"])
    a = cli.parse_args(["--device", "cpu", "--arms", "gloo,rocenante", "--rounds", "7"])
    assert a.arms == ["gloo", "rocenante"] and a.rounds == 7
    assert cli.parse_args(["--device", "cpu"]).arms == []


def test_cpu_run_end_to_end(tmp_path):
    # README's benchmark command on CPU, with tiny sizes and two of the three arms.
    out = tmp_path / "cpu.json"
    cmd = [sys.executable, "-m", "rocenante.bench", "--device", "cpu", "-n", "2", "--min-bytes", "1K",
           "--max-bytes", "4K", "--size-factor", "4", "--rounds", "7", "--arms", "rocenante,gloo",
           "--out", str(out), "--no-png"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "did not exit" not in proc.stderr, proc.stderr
    result = json.loads(out.read_text())
    assert result["schema"] == report.SCHEMA == "rocenante.bench/1"
    assert result["world_size"] == 2
    rows = result["rows"]
    assert sorted((r["arm"], r["bytes"]) for r in rows) == [("gloo", 1024), ("gloo", 4096),
                                                           ("rocenante", 1024), ("rocenante", 4096)]
    for r in rows:
        assert r["mode"] == "eager" and r["dtype"] == "float32" and r["measurements"] == 7
        assert 0 < r["p10_us"] <= r["median_us"] <= r["p90_us"]
    method = result["provenance"]["method"]
    assert method["measurements_per_arm_size_mode"] == 7
    assert method["calls_per_measurement"] == {"up_to_1MiB": 50, "above_1MiB": 20}
    assert "float64 sum" in method["check"] and "graph" not in method  # CPU: no NCCL, no graphs
    assert "# all_reduce sum, float32, eager mode, 2 ranks" in proc.stdout
    assert [r["net"] for r in result["provenance"]["ranks"]] == ["shm", "shm"]


@pytest.mark.parametrize("world", [2, 3, 8])
def test_unequal_blocks_send_and_receive_one_size_on_every_rank(world):
    from rocenante.bench.runner import block_sizes

    sizes = block_sizes("all_to_all_unequal", world, 1000 * world)
    assert all(sum(row) == 1000 * world for row in sizes)  # sent
    assert all(sum(sizes[s][t] for s in range(world)) == 1000 * world for t in range(world))  # received
    assert all(len(set(row)) == world for row in sizes)  # every size once


def test_cpu_unequal_all_to_all_end_to_end(tmp_path):
    # Unequal blocks, checked bit for bit against every rank's input before timing, on every arm that moves them.
    out = tmp_path / "a2a.json"
    cmd = [sys.executable, "-m", "rocenante.bench", "--device", "cpu", "-n", "3", "--collective", "all_to_all_unequal",
           "--min-bytes", "1K", "--max-bytes", "64K", "--size-factor", "64", "--rounds", "7",
           "--arms", "rocenante,rocenante_backend,gloo", "--out", str(out), "--no-png"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["arm"], r["bytes"]) for r in rows) == sorted(
        (arm, n) for arm in ("gloo", "rocenante", "rocenante_backend") for n in (1020, 65532)), rows
    assert "# all_to_all_unequal float32, eager mode, 3 ranks" in proc.stdout, proc.stdout


def test_under_torchrun_one_rank_per_process_and_several_per_node_across_hosts_refused(tmp_path):
    out = tmp_path / "torchrun.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "rocenante.bench",
           "--device", "cpu", "--min-bytes", "1K", "--max-bytes", "1K", "--rounds", "7", "--arms", "rocenante,gloo",
           "--out", str(out), "--no-png"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and "under torchrun" in proc.stdout
    assert sorted(r["arm"] for r in result["rows"]) == ["gloo", "rocenante"]
    assert [r["net"] for r in result["provenance"]["ranks"]] == ["shm", "shm"]
    # Two nodes of two processes each: refused before anything is built (rank 0 of node 0, as torchrun sets it).
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    proc = subprocess.run([sys.executable, "-m", "rocenante.bench", "--device", "cpu"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={**os.environ, **env})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "launch one process per node (--nproc-per-node 1)" in proc.stderr, proc.stderr
