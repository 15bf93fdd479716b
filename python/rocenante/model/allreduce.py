"""Collective latency on n switch-connected nodes: all-reduce one-shot, two-shot and ring; all-gather and
reduce-scatter one-shot and ring; all-to-all one-shot.

A profile is (alpha: per-message latency, bandwidth: per-node injection bandwidth, overhead: per-step cost of
the algorithm: kernel, flags, reduction). A step costs overhead + alpha + bytes each rank injects / bandwidth:
  all-reduce of `size` bytes
    one-shot: 1 step, each rank sends its full message to n-1 peers;
    two-shot: 2 steps (a one-shot reduce-scatter, then a one-shot all-gather), each sends (n-1) chunks of size/n;
    ring:     2(n-1) steps, each sends one chunk of size/n;
  all-gather of `size` bytes (the output; each rank's shard is size/n) and reduce-scatter of `size` bytes (the
  input), which cost the same here
    one-shot: 1 step, each rank sends (n-1) shards of size/n (its own to every peer, or each peer's part of it);
    ring:     n-1 steps, each sends one shard of size/n.
  The model counts injected bytes only: one-shot and ring all-gathers inject the same bytes, so one-shot, with one
  step's fixed cost instead of n-1, is ahead at every size (no crossover), where a real switch's incast may not be.
  all-to-all of `size` bytes (each rank's input, n blocks of size/n)
    one-shot: 1 step, each rank sends each peer its block, (n-1) blocks of size/n in all (an all-gather's bytes;
      NCCL's pairwise exchange sends the same, modelled as one step of its own).

Rails (rails()): a Spark's cable is two PCIe functions, each about half the port's bandwidth, and a peer's data
striped over both (one queue pair per function) injects at the sum. The fitted one-shot profile ran the reference
implementation, which stripes over both, so one rail is modelled as that profile at half its bandwidth, the same
fixed costs; what a second stripe's post and flag cost beyond that is not known (modelled as nothing).

Every rank must use the same parameters: if the model ever picks the algorithm at dispatch, the ranks agree on
the profile at init (through the store), or they would run different protocols. Dispatch from the model waits
for the RDMA transport; today it only predicts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from . import published

CALIBRATION_SCHEMA = "rocenante.model.calibration/1"


@dataclass(frozen=True)
class Profile:
    name: str
    alpha_s: float
    bandwidth_Bps: float
    overhead_s: float
    source: str


def _step(p: Profile, injected_bytes: float) -> float:
    return p.overhead_s + p.alpha_s + injected_bytes / p.bandwidth_Bps


def one_shot(p: Profile, n: int, size: float) -> float:
    return 0.0 if n == 1 else _step(p, (n - 1) * size)


def shard_one_shot(p: Profile, n: int, size: float) -> float:
    """All-gather or reduce-scatter of `size` bytes in one step."""
    return 0.0 if n == 1 else _step(p, (n - 1) * size / n)


def shard_ring(p: Profile, n: int, size: float) -> float:
    """All-gather or reduce-scatter of `size` bytes as a ring."""
    return (n - 1) * _step(p, size / n)


def two_shot(p: Profile, n: int, size: float) -> float:
    return 2 * shard_one_shot(p, n, size)


def ring(p: Profile, n: int, size: float) -> float:
    return 2 * shard_ring(p, n, size)


def rails(p: Profile, used: int, of: int = 2) -> Profile:
    """Profile `p`, measured striping over `of` rails, with `used` of them (module docstring, Rails)."""
    if not 1 <= used <= of:
        raise ValueError(f"{used} rails of {of}")
    return Profile(f"{p.name}, {used} of {of} rails", p.alpha_s, p.bandwidth_Bps * used / of, p.overhead_s,
                   f"{p.source}; bandwidth scaled by {used}/{of} (modelled)")


ALGORITHMS = {"one-shot": one_shot, "two-shot": two_shot, "ring": ring}
# All-gather and reduce-scatter alike.
SHARD_ALGORITHMS = {"one-shot": shard_one_shot, "ring": shard_ring}
ALL_TO_ALL_ALGORITHMS = {"one-shot": shard_one_shot}


def crossover(p: Profile, n: int, a, b) -> float | None:
    """Size in bytes above which algorithm b is faster than a (both are linear in size); None if never."""
    ca, cb = a(p, n, 0.0), b(p, n, 0.0)
    sa, sb = a(p, n, 1.0) - ca, b(p, n, 1.0) - cb
    if sa <= sb * (1 + 1e-9) or cb <= ca:  # equal slopes up to rounding: never
        return None
    return (cb - ca) / (sa - sb)


def _fit_line(points):
    """Least squares t = c + k * x; returns (c, k)."""
    x, t = np.array([q[0] for q in points], float), np.array([q[1] for q in points], float)
    k, c = np.polyfit(x, t, 1)
    return float(c), float(k)


def _one_shot_dgx_spark() -> Profile:
    # One-shot on 4 nodes: t = overhead + alpha + 3 * size / bandwidth, fitted to the 3 published sizes.
    c, k = _fit_line([(s, us * 1e-6) for s, (us, _) in published.ALLREDUCE_4.items()])
    # alpha: ib_write_lat at 48 KiB less the time one PCIe function takes to serialize 48 KiB.
    alpha = published.IB_WRITE_LAT_48K_US * 1e-6 - 48 * published.KIB / published.FUNCTION_BPS
    return Profile("dgx-spark-roce", alpha, 3 / k, c - alpha,
                   "one-shot on 4 DGX Sparks (8 KiB, 48 KiB, 1.5 MiB) and ib_write_lat 48 KiB")


def _nccl_dgx_spark() -> Profile:
    # NCCL modelled as a ring: t = 2(n-1) * step + 2(n-1)/n * size / bandwidth, fitted to all 7 published points
    # (2 and 4 Sparks) in relative error. Its alpha and overhead are not separable: all of it goes into overhead.
    rows = [(2, s, us) for s, us in published.NCCL_2.items()]
    rows += [(4, s, nccl) for s, (_, nccl) in published.ALLREDUCE_4.items()]
    a = np.array([[2 * (n - 1) / us, 2 * (n - 1) / n * s / us] for n, s, us in rows], float)
    step, inv_bw = np.linalg.lstsq(a * 1e6, np.ones(len(rows)), rcond=None)[0]
    return Profile("dgx-spark-nccl", 0.0, float(1 / inv_bw), float(step),
                   "NCCL on 2 and 4 DGX Sparks (7 points), fitted as a ring")


PROFILES = {p.name: p for p in (_one_shot_dgx_spark(), _nccl_dgx_spark())}


def calibrate(name: str, world: int, points, source: str) -> dict:
    """A calibration file's contents from measured one-shot times [(bytes, seconds)] at `world` ranks (what
    `python -m rocenante.bench --calibration PATH` writes). Alpha and overhead are not separable from one-shot
    times alone: all of the constant goes into overhead, as for the NCCL profile."""
    c, k = _fit_line(points)
    if not (k > 0 and c >= 0):
        raise ValueError(f"one-shot times {points} do not grow with size from a non-negative constant")
    return {"schema": CALIBRATION_SCHEMA, "name": name, "alpha_us": 0.0, "bandwidth_GBps": (world - 1) / k / 1e9,
            "overhead_us": c * 1e6, "source": source}


def load_calibration(path: str) -> Profile:
    """A calibration file, as the benchmark writes it on real hardware (calibrate()):
    {"schema": "rocenante.model.calibration/1", "name": str, "alpha_us": float, "bandwidth_GBps": float,
     "overhead_us": float, "source": str (hardware, revision, date)}. All numbers finite and >= 0, bandwidth > 0."""
    with open(path) as f:
        d = json.load(f)
    if d.get("schema") != CALIBRATION_SCHEMA:
        raise ValueError(f"{path}: schema is {d.get('schema')!r}, expected {CALIBRATION_SCHEMA!r}")
    vals = [d["alpha_us"], d["bandwidth_GBps"], d["overhead_us"]]
    if not all(isinstance(v, (int, float)) and np.isfinite(v) and v >= 0 for v in vals) or vals[1] == 0:
        raise ValueError(f"{path}: alpha_us, overhead_us must be finite and >= 0, bandwidth_GBps > 0")
    return Profile(str(d["name"]), vals[0] * 1e-6, vals[1] * 1e9, vals[2] * 1e-6, str(d["source"]))
