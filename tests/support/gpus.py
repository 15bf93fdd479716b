"""Where a GPU test's ranks run, on whatever GPUs the machine has: rank r on cuda:{r % count()}. With fewer GPUs
than ranks, ranks share a GPU (tests/conftest.py sets ROCENANTE_TEST_SHARED_GPU=1 for them): their contexts take
turns on it, and a call takes milliseconds (about 6 ms at world 2, more at larger worlds) instead of
microseconds, so calls() gives such a test a subset of its calls."""

from __future__ import annotations

import torch


def count() -> int:
    """The CUDA GPUs this process sees (0 without CUDA)."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a CUDA build without a driver
        return 0


def device_of(rank: int) -> torch.device:
    return torch.device("cuda", rank % count())


def use(rank: int) -> torch.device:
    """device_of(rank), made the current device of the calling thread."""
    device = device_of(rank)
    torch.cuda.set_device(device)
    return device


def shared(world: int) -> bool:
    """Whether `world` ranks share GPUs here (fewer GPUs than ranks)."""
    return count() < world


def calls(full: int, world: int, on_shared: int, least: int) -> int:
    """How many calls (or replays, iterations) a test of `world` ranks makes: `full` where every rank has a GPU of
    its own; on a shared GPU `on_shared` at world 2 and proportionally fewer at larger worlds (more contexts take
    turns), but at least `least`, the count that still reaches every branch of the test."""
    if not shared(world):
        return full
    return max(least, on_shared * 2 // world)


def figure(name: str, world: int) -> str:
    """A figure's name for record_figure: on a shared GPU suffixed, since its times are not comparable."""
    return name + "_shared_gpu" if shared(world) else name
