"""The benchmark (python -m rocenante.bench) on 2 GPUs: graph and eager modes, the method it records, its teardown,
and picking arms (its CPU side: tests/cpu/test_bench.py). Its arms include NCCL's and SymmetricMemory's, which
need a GPU per rank."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _bench(tmp_path, *args):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "rocenante.bench", "--out", str(out), "--no-png", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc


@pytest.mark.separate_gpus
def test_gpu_graph_method_and_teardown(tmp_path):
    # Graph mode last: the run that used to leave CUDA graphs alive across destroy_process_group, where NCCL's
    # communicator destroy waits for them (rank processes then did not exit). fp16 too: SymmetricMemory may lack
    # it, and an arm whose call raises is left out with the reason, not a failed run.
    result, proc = _bench(tmp_path, "-n", "2", "--min-bytes", "1K", "--max-bytes", "2M", "--size-factor", "2048",
                          "--dtypes", "bfloat16,float16", "--modes", "eager,graph", "--rounds", "7")
    assert "did not exit" not in proc.stderr, proc.stderr
    method = result["provenance"]["method"]
    assert method["sleep_before_replay_us"] == 50 and method["sleep_cycles_per_us"] > 100  # >100 MHz
    assert method["sleep_cycles"] == pytest.approx(50 * method["sleep_cycles_per_us"], abs=1)
    rows, skipped = result["rows"], result["skipped"]
    for dtype in ("bfloat16", "float16"):
        for mode in ("graph", "eager"):
            for size in (1024, 2 << 20):
                arms = {r["arm"] for r in rows if r["dtype"] == dtype and r["mode"] == mode and r["bytes"] == size}
                assert {"rocenante_backend", "nccl"} <= arms and (size > 1024 or "rocenante" in arms), arms
                for arm in ("rocenante", "symm_mem_one_shot", "symm_mem_two_shot"):  # a row, or why not
                    why = skipped.get(f"{arm}/{mode}/{dtype}", {}).get(str(size)) or skipped.get(arm)
                    assert arm in arms or why, (arm, dtype, mode, size, skipped)
    for r in rows:
        assert r["ops_per_measurement"] == (50 if r["bytes"] <= 1 << 20 else 20) and r["measurements"] == 7
        assert 0 < r["p10_us"] <= r["median_us"] <= r["p90_us"]


@pytest.mark.separate_gpus
def test_gpu_arms_pick_a_subset(tmp_path):
    result, _ = _bench(tmp_path, "-n", "2", "--min-bytes", "4K", "--max-bytes", "4K", "--dtypes", "bfloat16",
                       "--modes", "graph", "--arms", "rocenante,nccl", "--rounds", "7")
    assert sorted(r["arm"] for r in result["rows"]) == ["nccl", "rocenante"]
