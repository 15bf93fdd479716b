"""What a process holds, for the leak checks of tests/cpu/test_cpu_soak.py, tests/gpu/test_gpu_soak.py and
tests/gpu/test_gpu_hostile.py."""

from __future__ import annotations

import os
import re

import torch

# Free device memory may drop by this much without counting as a leak: cudaMalloc serves small allocations (a
# kernel's 1 KiB of state) from pools that the driver grows in 2 MiB pages and may keep. A leaked region holds
# several times the capacity (protocol v2 at world 2 and the 4 MiB default: 3 x 4 MiB).
FREE_BYTES_TOLERANCE = 4 << 20
# Memory mappings may grow by this many over any number of create/destroy cycles without counting as a leak:
# glibc maps a new malloc arena (two mappings) for a thread that starts while the previous thread's arena is still
# attached, and keeps freed thread stacks (a stack and its guard page) mapped for reuse. Both are bounded, while a
# leak grows with the cycles; device mappings (nvidia, uverbs) and fds are counted exactly.
MAPS_TOLERANCE = 4
# Set by tests/aarch64/suite.sh, which runs the suite under qemu-user: there a process's RSS also holds the code
# qemu translated, which grows as new code runs (create/destroy cycles of plain gloo grow it too), so RSS bounds
# say nothing about leaks.
EMULATED = bool(os.environ.get("ROCENANTE_TEST_EMULATED"))


def host_probe() -> dict:
    """Open fds, memory maps (and those of nvidia or uverbs devices) and RSS of this process."""
    with open("/proc/self/maps") as f:
        maps = f.read().splitlines()
    with open("/proc/self/status") as f:
        rss_kib = int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "device_maps": sum("nvidia" in line or "uverbs" in line for line in maps),
        "maps": len(maps),
        "rss_kib": rss_kib,
    }


def gpu_probe(device) -> dict:
    """host_probe(), /dev/shm entries and the device's free memory, once the device is idle."""
    torch.cuda.synchronize(device)
    return {**host_probe(), "shm": sorted(os.listdir("/dev/shm")), "free_bytes": torch.cuda.mem_get_info(device)[0]}


def leaks(before: dict, after: dict) -> list[str]:
    """What grew from `before` to `after` beyond the tolerances, in words (empty: nothing)."""
    found = []
    if after["fds"] > before["fds"]:
        found.append(f"open fds {before['fds']} -> {after['fds']}")
    new = sorted(set(after["shm"]) - set(before["shm"]))
    if new:
        found.append(f"new /dev/shm entries {new}")
    if after["device_maps"] > before["device_maps"]:
        found.append(f"nvidia/uverbs mappings {before['device_maps']} -> {after['device_maps']}")
    lost = before["free_bytes"] - after["free_bytes"]
    if lost > FREE_BYTES_TOLERANCE:
        found.append(f"free device memory fell by {lost} bytes (tolerance {FREE_BYTES_TOLERANCE})")
    return found


def figures(probe: dict) -> dict:
    """The probe as numbers (the /dev/shm entries counted), for the log and $ROCENANTE_TEST_FIGURES."""
    return {k: len(v) if k == "shm" else v for k, v in probe.items()}


def summary(before: dict, after: dict) -> str:
    """The probes' values before -> after, for the log."""
    b, a = figures(before), figures(after)
    return ", ".join(f"{k} {b[k]} -> {a[k]}" for k in b)
