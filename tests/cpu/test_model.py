"""The scaling model (python/rocenante/model): its arithmetic on hand-computed cases, the published figures it is
checked against, and the committed results. Loaded by path: the model does not need rocenante._C."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
PKG = os.path.join(ROOT, "python", "rocenante", "model")
spec = importlib.util.spec_from_file_location("rocenante_model", os.path.join(PKG, "__init__.py"),
                                              submodule_search_locations=[PKG])
model = importlib.util.module_from_spec(spec)
sys.modules["rocenante_model"] = model
spec.loader.exec_module(model)

from rocenante_model import __main__ as cli, allreduce, decode, published  # noqa: E402

KIB = 1024
# alpha 1 us, 1 GB/s, overhead 2 us: a step costs 3 us + bytes / 1000 us.
HAND = allreduce.Profile("hand", 1e-6, 1e9, 2e-6, "test")


def test_calibration_written_from_measured_times_loads_back(tmp_path):
    # One-shot at 3 ranks with the hand profile: t = 3 us + 2 * size / 1 GB/s.
    points = [(s, allreduce.one_shot(HAND, 3, s)) for s in (1024, 65536, 1 << 20)]
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(allreduce.calibrate("measured", 3, points, "test")))
    p = allreduce.load_calibration(str(path))
    assert p.alpha_s == 0 and p.overhead_s == pytest.approx(3e-6) and p.bandwidth_Bps == pytest.approx(1e9)
    with pytest.raises(ValueError, match="do not grow"):
        allreduce.calibrate("shrinking", 3, [(1024, 6e-6), (2048, 5e-6)], "test")


def test_published_figures_are_the_issue_s():
    assert published.DECODE_ROWS == [
        (2, "direct cable", "nccl", 11.86, 2635),
        (4, "physical ring", "nccl", 32.82, 4446),
        (4, "switch", "one-shot", 36.34, 4556),
        (8, "physical ring", "nccl", 40.11, 4962),
        (8, "switch", "one-shot", 52.58, 5105),
    ]
    assert published.SCALING_8 == {"one-shot": 4.43, "nccl switch": 3.05}
    assert published.ALLREDUCE_4 == {8 * KIB: (15.5, 51.3), 48 * KIB: (23.0, 59.0), 1536 * KIB: (277.0, 877.0)}
    assert published.NCCL_2 == {8 * KIB: 35.2, 16 * KIB: 31.7, 32 * KIB: 39.6, 64 * KIB: 67.9}
    assert published.IB_WRITE_LAT_48K_US == 8.8
    # The stated baseline: the one-shot scaling is relative to the 2-node row.
    assert round(52.58 / 11.86, 2) == published.SCALING_8["one-shot"]


def test_algorithms_hand_computed():
    us = 1e6
    assert allreduce.one_shot(HAND, 4, 4000) * us == pytest.approx(3 + 3 * 4)  # 1 step, 3 x 4000 B
    assert allreduce.two_shot(HAND, 4, 4000) * us == pytest.approx(2 * (3 + 3 * 1))  # 2 steps, 3 x 1000 B
    assert allreduce.ring(HAND, 4, 4000) * us == pytest.approx(6 * (3 + 1))  # 6 steps, 1000 B
    assert allreduce.ring(HAND, 2, 4000) * us == pytest.approx(2 * (3 + 2))
    for algo in allreduce.ALGORITHMS.values():
        assert algo(HAND, 1, 4000) == 0
    # one-shot 3 + 0.003 S, ring 18 + 0.0015 S (us): equal at S = 10,000 B.
    assert allreduce.crossover(HAND, 4, allreduce.one_shot, allreduce.ring) == pytest.approx(10_000)
    # 2 nodes: two-shot and ring cost one more step for the same bytes: one-shot always wins.
    assert allreduce.crossover(HAND, 2, allreduce.one_shot, allreduce.ring) is None
    # All-gather (4000 B out, 1000 B shards) or reduce-scatter (4000 B in): one step of 3 shards, or 3 of one.
    assert allreduce.shard_one_shot(HAND, 4, 4000) * us == pytest.approx(3 + 3 * 1)
    assert allreduce.shard_ring(HAND, 4, 4000) * us == pytest.approx(3 * (3 + 1))
    for algo in allreduce.SHARD_ALGORITHMS.values():
        assert algo(HAND, 1, 4000) == 0
    # The same bytes either way: one-shot is ahead at every size.
    assert allreduce.crossover(HAND, 8, allreduce.shard_one_shot, allreduce.shard_ring) is None
    # All-to-all of 4000 B a rank: 3 blocks of 1000 B, one a peer, in one step.
    assert allreduce.ALL_TO_ALL_ALGORITHMS["one-shot"](HAND, 4, 4000) * us == pytest.approx(3 + 3 * 1)
    for algo in allreduce.ALL_TO_ALL_ALGORITHMS.values():
        assert algo(HAND, 1, 4000) == 0


def test_profiles_follow_the_published_microbenchmarks():
    p = allreduce.PROFILES["dgx-spark-roce"]
    for size, (one_shot_us, _) in published.ALLREDUCE_4.items():
        assert allreduce.one_shot(p, 4, size) * 1e6 == pytest.approx(one_shot_us, rel=0.03)
    # alpha: 8.8 us less 48 KiB at 95 Gb/s (4.14 us).
    assert p.alpha_s * 1e6 == pytest.approx(8.8 - 49152 * 8 / 95e3, rel=1e-9)
    assert p.bandwidth_Bps < 2 * published.FUNCTION_BPS  # below the port's two PCIe functions


def test_decode_step_hand_computed():
    profiles = {"dgx-spark-roce": HAND, "dgx-spark-nccl": HAND}
    ar = 3e-6 + 3 * decode.MESSAGE_BYTES / 1e9  # one-shot, 4 nodes, 10 KiB
    assert decode.MESSAGE_BYTES == 10240
    assert decode.step_s(0.01, 0.08, "one-shot", 4, profiles) == pytest.approx(0.01 + 0.02 + 128 * ar)
    assert decode.step_s(0.01, 0.08, "nccl", 1, profiles) == pytest.approx(0.09)


def test_fit_uses_only_one_shot_rows_and_reproduces_them():
    fixed, per_token = decode.fit()
    assert fixed > 0 and per_token > 0
    # Per-token work above the memory floor (15.2 GB of NVFP4 weights at 273 GB/s): a physical fit.
    assert per_token > decode.WEIGHT_BYTES / decode.MEMORY_BPS
    rows = decode.check(fixed, per_token)
    fitted = [r for r in rows if r["fitted"]]
    assert [(r["nodes"], r["all_reduce"]) for r in fitted] == [(4, "one-shot"), (8, "one-shot")]
    assert all(abs(r["error_pct"]) < 0.1 for r in fitted)
    assert len(rows) - len(fitted) == 4  # held out: 2-node, both physical-ring rows, NCCL on the switch at 8


def test_calibration_file(tmp_path):
    good = {"schema": allreduce.CALIBRATION_SCHEMA, "name": "lab", "alpha_us": 5, "bandwidth_GBps": 20,
            "overhead_us": 9, "source": "test"}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(good))
    p = allreduce.load_calibration(str(path))
    assert (p.name, p.source) == ("lab", "test")
    assert (p.alpha_s, p.bandwidth_Bps, p.overhead_s) == pytest.approx((5e-6, 20e9, 9e-6))
    for bad in ({"schema": "other/1"}, {"bandwidth_GBps": 0}, {"alpha_us": -1}, {"overhead_us": float("nan")}):
        path.write_text(json.dumps({**good, **bad}))
        with pytest.raises(ValueError):
            allreduce.load_calibration(str(path))


def _to_12_digits(value):
    """`value` with every float rounded to 12 significant digits: least-squares fits differ in the last bits
    between numpy versions."""
    if isinstance(value, float):
        return float(f"{value:.12g}")
    if isinstance(value, dict):
        return {k: _to_12_digits(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_12_digits(v) for v in value]
    return value


def test_committed_results_are_what_the_model_computes(tmp_path):
    cli.main(["--out", str(tmp_path / "m")])
    fresh = json.loads((tmp_path / "m.json").read_text())
    with open(os.path.join(ROOT, "benchmarks", "results", "scaling-model.json")) as f:
        committed = json.load(f)
    for key in ("profiles", "latency_us", "all_gather_reduce_scatter_latency_us", "all_to_all_latency_us",
                "rails_latency_us",
                "crossover_bytes", "decode"):
        assert _to_12_digits(fresh[key]) == _to_12_digits(committed[key]), key


def test_rails_halve_the_bandwidth_term_and_nothing_else():
    roce = allreduce.PROFILES["dgx-spark-roce"]
    one, two = allreduce.rails(roce, 1), allreduce.rails(roce, 2)
    assert two.bandwidth_Bps == roce.bandwidth_Bps and one.bandwidth_Bps == roce.bandwidth_Bps / 2
    for n in (2, 4, 8):
        fixed = allreduce.one_shot(roce, n, 0.0)
        for size in (1024, 1 << 20, 16 << 20):
            t1, t2 = allreduce.one_shot(one, n, size), allreduce.one_shot(two, n, size)
            assert t1 - fixed == pytest.approx(2 * (t2 - fixed))  # the bytes' time doubles, the fixed costs stay
    assert allreduce.one_shot(one, 4, 16 << 20) / allreduce.one_shot(two, 4, 16 << 20) > 1.9
    assert allreduce.one_shot(one, 4, 1024) / allreduce.one_shot(two, 4, 1024) < 1.02
    with pytest.raises(ValueError):
        allreduce.rails(roce, 3)
