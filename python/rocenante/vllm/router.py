"""AllReduceRouter: which of a vLLM group's all-reduces rocenante serves. vLLM-free, so that it is tested where
vLLM is not installed (tests/cpu/test_cpu_vllm.py, tests/gpu/test_gpu_plugins.py)."""

from __future__ import annotations

from typing import Optional

import torch

from rocenante import startup
from rocenante.communicator import Communicator, serves


class AllReduceRouter:
    """Serves the sum all-reduces, all-gathers and sum reduce-scatters of a vLLM tensor-parallel group ("tp", as
    vLLM's own one-shot backends) that rocenante.serves() accepts up to the threshold (ROCENANTE_THRESHOLD_BYTES,
    as the torch.distributed backend's: beyond it NCCL is faster); returns None for the others, which the caller
    sends to vLLM's backends. Whether rocenante runs at all, and the threshold, are agreed by every rank at start()."""

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
        what every rank shares (rocenante.serves: dtype, size, layout; the same for all_gather and reduce_scatter)
        decides; a tensor on another device than the communicator's is refused by the communicator, which faults
        every rank naming it (never a different path on one rank)."""
        comm = self.comm
        if comm is None or not self._serves(x, 1):
            return None
        return comm.all_reduce(x if x.is_contiguous() else x.contiguous())

    def all_gather(self, x: torch.Tensor, dim: int) -> Optional[torch.Tensor]:
        """vLLM's all_gather: every rank's ``x`` concatenated along ``dim`` in rank order, as a new tensor; None
        when rocenante does not serve it (the gathered bytes above the threshold, or what serves() refuses).
        Along dim 0 directly; along another, gathered along dim 0 and moved there with one copy, as vLLM's own."""
        comm = self.comm
        if comm is None or x.dim() == 0 or not self._serves(x, comm.world_size):
            return None
        d = dim % x.dim()
        gathered = comm.all_gather(x.contiguous())
        if d == 0:
            return gathered
        shape = (*x.shape[:d], comm.world_size * x.shape[d], *x.shape[d + 1:])
        return gathered.view(comm.world_size, *x.shape).movedim(0, d).reshape(shape)

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> Optional[torch.Tensor]:
        """vLLM's reduce_scatter: the sum over the group's ranks, of which this rank keeps its part along ``dim``,
        as a new tensor; None when rocenante does not serve it (as all_gather, by the input's bytes; or a ``dim``
        that does not split evenly). Served along dim 0, and along either dim of a 2-D tensor, where vLLM's own
        (which moves dim 0 to ``dim``) and a scatter along ``dim`` agree; other layouts go to vLLM's own."""
        comm = self.comm
        if comm is None or x.dim() == 0 or not self._serves(x, 1):
            return None
        d = dim % x.dim()
        if (d != 0 and x.dim() != 2) or x.shape[d] % comm.world_size != 0:
            return None
        if d == 0:
            return comm.reduce_scatter(x.contiguous())
        return comm.reduce_scatter(x.t().contiguous()).t().contiguous()

    def _serves(self, x: torch.Tensor, copies: int) -> bool:
        """serves() for a sum over ``copies`` times ``x``'s bytes (an all-gather's output), up to the threshold."""
        return serves(x, "sum") and copies * x.numel() * x.element_size() <= self.threshold_bytes

    def describe(self) -> str:
        """What rocenante serves, for the log line."""
        return (f"sum all-reduces, all-gathers and sum reduce-scatters of float32, float16, bfloat16 and int32 up to "
                f"{self.threshold_bytes} bytes ({self.why})")

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()
            self.comm = None
