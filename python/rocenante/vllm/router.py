"""AllReduceRouter: which of a vLLM group's all-reduces rocenante serves. vLLM-free, so that it is tested where
vLLM is not installed (tests/cpu/test_cpu_vllm.py, tests/gpu/test_gpu_plugins.py)."""

from __future__ import annotations

from typing import Optional

import torch

from rocenante import startup
from rocenante.communicator import Communicator, serves


class AllReduceRouter:
    """Serves the sum all-reduces of a vLLM tensor-parallel group ("tp", as vLLM's own one-shot backends) that
    rocenante.serves() accepts up to the threshold (ROCENANTE_THRESHOLD_BYTES, as the
    torch.distributed backend's: beyond it NCCL is faster); returns None for the others, which the caller sends
    to vLLM's backends. Whether rocenante runs at all, and the threshold, are agreed by every rank at start()."""

    def __init__(self, comm: Optional[Communicator], why: str, threshold_bytes: int = 0):
        self.comm = comm
        self.why = why
        self.threshold_bytes = threshold_bytes

    @classmethod
    def start(cls, cpu_group, device: torch.device, unique_name: str) -> "AllReduceRouter":
        """Collective over `cpu_group` (vLLM's gloo group of the communicator's ranks) for a tensor-parallel
        group; for any other group nothing happens and no rank waits."""
        if unique_name.split(":")[0] != "tp":
            return cls(None, f"group {unique_name!r} is not tensor-parallel")
        rendezvous = startup.rendezvous_on_group(cpu_group, "vllm")
        started = startup.open_agreed(rendezvous.exchange, rendezvous.store, rendezvous.rank, rendezvous.size,
                                      device, f"vllm-{unique_name}", f"vLLM group {unique_name!r}")
        return cls(started.comm, started.why, started.threshold_bytes)

    @property
    def active(self) -> bool:
        return self.comm is not None

    def all_reduce(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The sum over the group's ranks, as a new tensor; None when rocenante does not serve this call. Only
        what every rank shares (rocenante.serves: dtype, size, layout) decides; a tensor on another device than the communicator's is
        refused by the communicator, which faults every rank naming it (never a different path on one rank)."""
        comm = self.comm
        if comm is None or not serves(x, "sum", self.threshold_bytes):
            return None
        return comm.all_reduce(x if x.is_contiguous() else x.contiguous())

    def describe(self) -> str:
        """What rocenante serves, for the log line."""
        return (f"sum all-reduces of float32, float16, bfloat16 and int32 up to {self.threshold_bytes} bytes "
                f"({self.why})")

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()
            self.comm = None
