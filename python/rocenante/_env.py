"""Every ROCENANTE_* environment variable, read in one place."""

from __future__ import annotations

import os

from rocenante import _C

# How long one wait on a peer may last before the call fails naming the peer (seconds). Generous by default:
# a peer may legitimately be late by a long compilation or a checkpoint load.
DEFAULT_TIMEOUT_S = 300.0
# Largest message of one call (bytes). Each rank's receive region holds 2 slots x world x 2 x capacity.
# 4 MiB: where NCCL overtakes the one-shot on 2 x H200 (bf16, CUDA graph: 34.5 us vs 37.4 us at 4 MiB,
# 66.8 us vs 49.8 us at 8 MiB; benchmarks/results/h200x2-bf16.json).
DEFAULT_CAPACITY_BYTES = 4 << 20


def _positive(what: str, value):
    if value != value:
        raise ValueError(f"{what} is not a number")
    if not value > 0:
        raise ValueError(f"{what} must be positive")
    return value


def _from_env(name: str, parse, default):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = parse(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    return _positive(f"{name}={raw!r}", value)


def timeout_s(given=None) -> float:
    """The bound on every wait for a peer, in seconds: `given` (timeout_s=), else ROCENANTE_TIMEOUT_S. Longer
    values, inf included, are clamped to _C.max_timeout_s (1e9 s, about 31.7 years), the most the core counts."""
    if given is None:
        value = _from_env("ROCENANTE_TIMEOUT_S", float, DEFAULT_TIMEOUT_S)
    else:
        value = _positive(f"timeout_s={given!r}", float(given))
    return min(value, _C.max_timeout_s)


def capacity_bytes() -> int:
    """ROCENANTE_CAPACITY_BYTES: largest all-reduce a communicator serves, in bytes."""
    return _from_env("ROCENANTE_CAPACITY_BYTES", int, DEFAULT_CAPACITY_BYTES)


def on_fault() -> str:
    """ROCENANTE_ON_FAULT: what a rank does once a communicator faults. "raise" (default): the fault is logged
    once and every later call, synchronize(), Work.wait() and collective of the group raises it (outputs the
    kernel could not compute are NaN, so graph replays are covered too). "abort": logged, then SIGABRT, for
    serving engines whose supervisor restarts the process."""
    raw = os.environ.get("ROCENANTE_ON_FAULT", "").strip().lower() or "raise"
    if raw not in ("raise", "abort"):
        raise ValueError(f"ROCENANTE_ON_FAULT={raw!r}: use raise or abort")
    return raw


def _flag(name: str) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={raw!r}: use 1 or 0")


def disabled() -> bool:
    """ROCENANTE_DISABLE=1: the torch.distributed backend delegates every collective (NCCL / gloo)."""
    return _flag("ROCENANTE_DISABLE")


def strict() -> bool:
    """ROCENANTE_STRICT=1: the backend raises instead of falling back when its startup self-test fails."""
    return _flag("ROCENANTE_STRICT")
