"""Dense tensor-parallel decode on n nodes: one token's step is
    t(n) = fixed + per_token / n + 2 * layers * all_reduce(n, hidden * 2 bytes)
(two bf16 all-reduces of one token's hidden state per layer; weights and work split n ways; `fixed` is what
does not split: sampling, launch, host). fixed and per_token are what the model cannot know: they are fitted."""

from __future__ import annotations

import numpy as np

from . import allreduce, published

# The published model's sizes are not public; the closest public 27B dense model is Qwen3.5-27B
# (https://huggingface.co/Qwen/Qwen3.5-27B): 64 layers, hidden size 5120, 27B parameters.
LAYERS = 64
HIDDEN = 5120
PARAMS = 27e9
MESSAGE_BYTES = HIDDEN * 2  # one token, bf16
# NVFP4: 4-bit values plus one 8-bit scale per 16 values = 4.5 bits per weight.
WEIGHT_BYTES = PARAMS * 4.5 / 8
# GB10: 273 GB/s LPDDR5x, 128 GB (shared with the CPU). 15.2 GB of weights fit on one node: nothing spills.
MEMORY_BPS = 273e9
MEMORY_BYTES = 128e9

# Published all-reduce label -> (algorithm, profile) used for it.
ARMS = {"one-shot": (allreduce.one_shot, "dgx-spark-roce"), "nccl": (allreduce.ring, "dgx-spark-nccl")}


def comm_s(arm: str, n: int, profiles=allreduce.PROFILES) -> float:
    algo, prof = ARMS[arm]
    return 2 * LAYERS * algo(profiles[prof], n, MESSAGE_BYTES)


def step_s(fixed_s: float, per_token_s: float, arm: str, n: int, profiles=allreduce.PROFILES) -> float:
    return fixed_s + per_token_s / n + comm_s(arm, n, profiles)


# Fit on the product's own rows (one-shot on the switch, 4 and 8 nodes); every other published row is held out.
FIT_ROWS = [r for r in published.DECODE_ROWS if r[2] == "one-shot"]


def fit(rows=FIT_ROWS, profiles=allreduce.PROFILES) -> tuple[float, float]:
    """(fixed_s, per_token_s) solving t = fixed + per_token / n for the rows' step times less their all-reduces."""
    a = np.array([[1.0, 1.0 / n] for n, *_ in rows])
    t = np.array([1 / tok - comm_s(arm, n, profiles) for n, _, arm, tok, _ in rows])
    fixed, per_token = np.linalg.lstsq(a, t, rcond=None)[0]
    return float(fixed), float(per_token)


def check(fixed_s: float, per_token_s: float, profiles=allreduce.PROFILES) -> list[dict]:
    """Predicted against published decode tokens/s for every row, and the NCCL-on-switch 8-node ratio."""
    rows = [(n, topo, arm, tok) for n, topo, arm, tok, _ in published.DECODE_ROWS]
    base = published.DECODE_ROWS[0][3]
    rows.append((8, "switch", "nccl", published.SCALING_8["nccl switch"] * base))
    out = []
    for n, topo, arm, tok in rows:
        pred = 1 / step_s(fixed_s, per_token_s, arm, n, profiles)
        out.append({"nodes": n, "topology": topo, "all_reduce": arm, "published_tok_s": round(tok, 2),
                    "predicted_tok_s": round(pred, 2), "error_pct": round(100 * (pred / tok - 1), 1),
                    "fitted": (n, topo, arm) in {(r[0], r[1], r[2]) for r in FIT_ROWS}})
    return out
