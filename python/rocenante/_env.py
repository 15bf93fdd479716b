"""Every ROCENANTE_* environment variable, read in one place, and which host this process runs on."""

from __future__ import annotations

import os
import socket

from rocenante import _C

# How long one wait on a peer may last before the call fails naming the peer (seconds). Generous by default:
# a peer may legitimately be late by a long compilation or a checkpoint load.
DEFAULT_TIMEOUT_S = 300.0
# Bytes of one area (csrc/layout.h): the largest float piece of one call (int32: half). Each rank's receive
# region holds 3 buffers x (world - 1) areas: 12 MiB at world 2, 84 MiB at world 8. Larger calls go as pieces.
DEFAULT_CAPACITY_BYTES = 4 << 20
# Largest all-reduce the backend sends to rocenante; larger ones go to NCCL. World 2 (2 x H200, bf16, CUDA
# graph, benchmarks/results/h200x2-v2-bf16-large.json): rocenante is ahead of NCCL at 32 MiB (132 us against
# 139) and behind at 64 MiB (261 against 255). Worlds 3-8 are NOT YET MEASURED: a one-shot moves world/2 times
# a ring's bytes, so the crossover is taken to shrink in proportion, 64 MiB / world (16 MiB at 4, 8 MiB at 8).
# CPU: gloo is not measured past 1 MiB; 4 MiB.
GPU_THRESHOLD_AT_WORLD_2 = 32 << 20
CPU_THRESHOLD_BYTES = 4 << 20


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


def timeout_s(given=None, group=None) -> float:
    """The bound on every wait for a peer, in seconds: `given` (timeout_s=), else ROCENANTE_TIMEOUT_S, else
    `group` (a process group's timeout=, seconds), else DEFAULT_TIMEOUT_S. Longer values, inf included, are
    clamped to _C.max_timeout_s (1e9 s, about 31.7 years), the most the core counts."""
    if given is None:
        value = _from_env("ROCENANTE_TIMEOUT_S", float, DEFAULT_TIMEOUT_S if group is None else float(group))
    else:
        value = _positive(f"timeout_s={given!r}", float(given))
    return min(value, _C.max_timeout_s)


def proxy_spin_s() -> float:
    """ROCENANTE_PROXY_SPIN_S: how long a network communicator's proxy thread polls hot after its last work
    (one core per rank while it does), before it naps 50 us between polls; at most _C.max_proxy_spin_s (an hour)."""
    raw = os.environ.get("ROCENANTE_PROXY_SPIN_S", "").strip()
    if not raw:
        return _C.default_proxy_spin_s
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= _C.max_proxy_spin_s:
        raise ValueError(f"ROCENANTE_PROXY_SPIN_S={raw!r}: use 0..{_C.max_proxy_spin_s:g} seconds")
    return value


def capacity_bytes() -> int:
    """ROCENANTE_CAPACITY_BYTES: bytes of one area of a communicator's receive region, the largest float piece
    of one call (int32: half); larger calls go as several pieces."""
    return _from_env("ROCENANTE_CAPACITY_BYTES", int, DEFAULT_CAPACITY_BYTES)


def threshold_bytes(device_type: str, world: int) -> int:
    """ROCENANTE_THRESHOLD_BYTES: the largest all-reduce the backend runs on rocenante; larger ones go to the
    fallback (NCCL or gloo). Default: measured at world 2 on GPUs, derived for other worlds (see above)."""
    if device_type == "cpu":
        default = CPU_THRESHOLD_BYTES
    else:
        default = GPU_THRESHOLD_AT_WORLD_2 if world <= 2 else (64 << 20) // world
    return _from_env("ROCENANTE_THRESHOLD_BYTES", int, default)


# Where two-shot all-reduce takes over from one-shot (bytes), for ROCENANTE_ALGO=auto. CPU, shared memory, float32,
# on a 2-core VM (benchmarks/results/cpu-collectives-{2,3,4}r.json): two-shot ahead from 256 KiB at worlds 2, 3
# and 4 (at 64 KiB ahead at worlds 2 and 3 within the spread, behind at 4); worlds 5-8 NOT MEASURED, taken alike.
TWOSHOT_FROM_CPU = 256 << 10
# GPUs of one host (CUDA IPC): MODELLED, NOT MEASURED (timing two-shot needs a GPU per rank): rocenante.model's
# crossover of one-shot and two-shot with a profile fitted to one-shot on 2 x H200 in CUDA graphs
# (benchmarks/results/h200x2-bf16-eager-graph-99aaa0c.json, 1 KiB to 32 MiB: 2.72 us a step, 256 GB/s injected by
# each rank, taken alike at every world, as behind a switch), rounded down to a multiple of 4 KiB. None at world 2,
# where both inject the same bytes and two-shot pays two steps. tests/cpu/test_cpu_collectives.py recomputes them.
TWOSHOT_FROM_GPU_MODELLED = {3: 1020 << 10, 4: 452 << 10, 5: 280 << 10, 6: 204 << 10, 7: 156 << 10, 8: 128 << 10}
# DGX Sparks over RoCE (GPU tensors on the ib path): MODELLED, NOT MEASURED (no machine here has a GPU and an RDMA
# NIC): the same crossover with rocenante.model's dgx-spark-roce profile (fitted to the real RoCEnante's one-shot on
# 4 Sparks and ib_write_lat), rounded down to 4 KiB; recomputed by the same test. Over the network a two-shot piece
# is two calls of the protocol made by one launch (csrc/layout.h): the model does not charge the second's doorbell.
# CPU tensors over the network and the TCP test wire stay one-shot under auto (neither is modelled);
# ROCENANTE_ALGO=twoshot runs them.
TWOSHOT_FROM_ROCE_MODELLED = {3: 380 << 10, 4: 168 << 10, 5: 104 << 10, 6: 76 << 10, 7: 56 << 10, 8: 48 << 10}


def algo() -> str:
    """ROCENANTE_ALGO: "auto" (default), "oneshot" or "twoshot": how every all-reduce moves its data. Every rank
    must set it alike (the communicator's startup compares it and names the rank that differs)."""
    raw = os.environ.get("ROCENANTE_ALGO", "").strip().lower() or "auto"
    if raw not in ("auto", "oneshot", "twoshot"):
        raise ValueError(f"ROCENANTE_ALGO={raw!r}: use auto, oneshot or twoshot")
    return raw


def twoshot_from(device_type: str, world: int, net: str) -> tuple[int, str]:
    """The size (bytes) from which all-reduces go two-shot (ROCENANTE_ALGO; _C.layout.never: none), and where it
    comes from, for the startup log: the setting, a measurement or the model."""
    choice = algo()
    if choice == "oneshot" or world == 1:
        return _C.layout.never, f"ROCENANTE_ALGO={choice}" if choice == "oneshot" else "one rank"
    if choice == "twoshot":
        return 0, "ROCENANTE_ALGO=twoshot"
    if device_type == "cpu":
        if net == "shm":
            return TWOSHOT_FROM_CPU, "measured on CPUs at worlds 2-4"
        return _C.layout.never, "CPU tensors over the network: one-shot unless ROCENANTE_ALGO=twoshot"
    if net == "shm":
        return TWOSHOT_FROM_GPU_MODELLED.get(world, _C.layout.never), "modelled for GPUs of one host, not measured"
    if net == "ib":
        return TWOSHOT_FROM_ROCE_MODELLED.get(world, _C.layout.never), "modelled for DGX Sparks over RoCE, not measured"
    return _C.layout.never, "the TCP test wire: one-shot unless ROCENANTE_ALGO=twoshot"


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
    """ROCENANTE_DISABLE=1: the torch.distributed backend delegates every collective (NCCL / gloo); the plugins
    start no communicator (startup.local_check)."""
    return _flag("ROCENANTE_DISABLE")


def strict() -> bool:
    """ROCENANTE_STRICT=1: the backend (and the vLLM plugin) raises instead of falling back when its startup
    self-test fails."""
    return _flag("ROCENANTE_STRICT")


def test_shared_gpu() -> bool:
    """ROCENANTE_TEST_SHARED_GPU=1, for tests on a machine with fewer GPUs than ranks: the startup agreement lets
    ranks of separate processes share a GPU (CUDA IPC works between processes of one device, and their contexts
    take turns on it, so a call takes milliseconds: correctness, never timing), and the backend delegates CUDA
    collectives to gloo, since NCCL refuses two ranks on one device. Never for production."""
    return _flag("ROCENANTE_TEST_SHARED_GPU")


def test_first_call() -> int:
    """ROCENANTE_TEST_FIRST_CALL, for tests of the call numbers' wrap: the number of every communicator's first
    call (default 1; calls count modulo _C.layout.epoch_period, about 3.2e9, which serving reaches in days).
    Every rank must set it alike (the communicators' configurations are compared)."""
    raw = os.environ.get("ROCENANTE_TEST_FIRST_CALL", "").strip()
    if not raw:
        return 1
    if not raw.isdigit() or int(raw) >= _C.layout.epoch_period:
        raise ValueError(f"ROCENANTE_TEST_FIRST_CALL={raw!r}: use a call number below {_C.layout.epoch_period}")
    return int(raw)


def vllm() -> bool:
    """ROCENANTE_VLLM=1: the vLLM plugin (rocenante.vllm) makes vLLM build rocenante's communicator."""
    return _flag("ROCENANTE_VLLM")


def net() -> str:
    """ROCENANTE_NET: "" (default: peers on this host through shared memory / CUDA IPC, peers on other hosts
    through RDMA), "ib": every peer through RDMA, also on this host (tests in one VM, checking a node's NIC), or
    "tcp": every peer through the TCP software wire on loopback, a test vehicle for the network path (one host)."""
    return parse_net(os.environ.get("ROCENANTE_NET", ""), "ROCENANTE_NET")


# The values of ROCENANTE_NET: unset (""), the path chosen from where the ranks are (Communicator._choose_net), or
# every peer through RDMA or the TCP wire.
NETS = ("", "ib", "tcp")


def parse_net(raw: str, source: str) -> str:
    """A value of ROCENANTE_NET (or of Communicator's net=, named by `source`), checked."""
    value = str(raw).strip().lower()
    if value not in NETS:
        raise ValueError(f"{source}={raw!r}: use ib or tcp, or leave it unset")
    return value


def _ib_setting(suffix: str):
    """(value, variable) of ROCENANTE_IB_<suffix>, else NCCL_IB_<suffix>, the first one set; else ("", "")."""
    for name in (f"ROCENANTE_IB_{suffix}", f"NCCL_IB_{suffix}"):
        raw = os.environ.get(name, "").strip()
        if raw:
            return raw, name
    return "", ""


def ib_hca():
    """ROCENANTE_IB_HCA, else NCCL_IB_HCA: the RDMA devices (and ports) to use, in NCCL's syntax
    ("mlx5_0:1,mlx5_1", "=exact", "^excluded"). None when neither is set."""
    from rocenante import _ib

    raw, name = _ib_setting("HCA")
    return _ib.parse_hca(raw, name) if raw else None


def ib_qos():
    """(traffic class, service level) of the queue pairs: ROCENANTE_IB_TC, else NCCL_IB_TC (0..255, the IP header's
    DSCP and ECN bits on RoCE v2), and ROCENANTE_IB_SL, else NCCL_IB_SL (0..15); 0 where neither is set. On a fabric
    whose lossless class is a DSCP (or a priority), traffic in class 0 rides the lossy one."""
    values = []
    for suffix, top in (("TC", 255), ("SL", 15)):
        raw, name = _ib_setting(suffix)
        if raw and (not raw.isdigit() or int(raw) > top):
            raise ValueError(f"{name}={raw!r}: use 0..{top}")
        values.append(int(raw) if raw else 0)
    return tuple(values)


def ib_signal() -> str:
    """ROCENANTE_IB_SIGNAL: how a network peer's delivery tells this rank's reducer it is whole. "flag" (default):
    the peer writes a flag after the data over the same queue pair, which the reducer (the kernel, or the host
    loop) polls, so no host thread takes part on the receive side; it relies on the fabric placing one queue
    pair's writes in order. "completion": a WRITE WITH IMMEDIATE, whose receive completion this rank's proxy
    thread turns into the reducer's arrival word, for fabrics that place writes out of order (adaptive routing).
    Every rank must set it alike; the TCP test wire follows it too. ROCENANTE_TEST_FLAG_FIRST=1 (tests of the
    test vehicle only, TCP wire only) makes the TCP wire place the flag before the data, which the network tests
    must catch."""
    raw = os.environ.get("ROCENANTE_IB_SIGNAL", "").strip().lower() or "flag"
    if raw not in ("flag", "completion"):
        raise ValueError(f"ROCENANTE_IB_SIGNAL={raw!r}: use flag or completion")
    if _flag("ROCENANTE_TEST_FLAG_FIRST"):
        if raw != "flag":
            raise ValueError("ROCENANTE_TEST_FLAG_FIRST=1 mutates the flag signal: leave ROCENANTE_IB_SIGNAL unset")
        return "flag_first"
    return raw


def ib_gid_index():
    """ROCENANTE_IB_GID_INDEX, else NCCL_IB_GID_INDEX: (index, variable) when one is set, else (None, "")."""
    raw, name = _ib_setting("GID_INDEX")
    if not raw:
        return None, ""
    if not raw.isdigit() or int(raw) > 255:
        raise ValueError(f"{name}={raw!r}: use a GID table index, 0..255")
    return int(raw), name


def host_id() -> str:
    """Which machine this process runs on, for every decision that asks whether ranks share a host: the host
    name and the kernel's boot id, so that two machines sharing a host name are told apart."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
