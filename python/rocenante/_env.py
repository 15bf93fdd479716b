"""Every ROCENANTE_* environment variable, read in one place."""

from __future__ import annotations

import os

# How long one wait on a peer may last before the call fails naming the peer (seconds). Generous by default:
# a peer may legitimately be late by a long compilation or a checkpoint load.
DEFAULT_TIMEOUT_S = 300.0
# Largest message of one call (bytes). Each rank's receive region holds 2 slots x world x 2 x capacity.
# 4 MiB: where NCCL overtakes the one-shot on 2 x H200 (bf16, CUDA graph: 35.6 us vs 36.8 us at 4 MiB,
# 68.3 us vs 50.3 us at 8 MiB; benchmarks/results/h200x2-bf16.json).
DEFAULT_CAPACITY_BYTES = 4 << 20


def _positive(name: str, parse, default):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = parse(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if not value > 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return value


def timeout_s() -> float:
    """ROCENANTE_TIMEOUT_S: bound on every wait for a peer, in seconds."""
    return _positive("ROCENANTE_TIMEOUT_S", float, DEFAULT_TIMEOUT_S)


def capacity_bytes() -> int:
    """ROCENANTE_CAPACITY_BYTES: largest all-reduce a communicator serves, in bytes."""
    return _positive("ROCENANTE_CAPACITY_BYTES", int, DEFAULT_CAPACITY_BYTES)
