"""AllReduceRouter: which of a vLLM group's all-reduces rocenante serves. vLLM-free, so that it is tested where
vLLM is not installed (tests/cpu/test_cpu_vllm.py, tests/gpu/test_gpu_plugins.py)."""

from __future__ import annotations

from typing import Optional

import torch

from rocenante import startup
from rocenante.communicator import Communicator, serves


# The groups a router serves: tensor parallelism's (as vLLM's own one-shot backends), and the groups vLLM's
# default all2all manager (allgather_reducescatter, AgRsAll2AllManager: its dispatch and combine call all_gatherv
# and reduce_scatterv) exchanges experts' tokens over: data parallelism's, expert parallelism's (sequence-parallel
# MoE) and prefill context parallelism's (when DP is 1).
GROUPS = ("tp", "dp", "ep", "pcp")


class AllReduceRouter:
    """Serves the sum all-reduces, all-gathers and sum reduce-scatters (and all_gatherv and reduce_scatterv of
    equal sizes) of a vLLM group of GROUPS that rocenante.serves() accepts up to the threshold
    (ROCENANTE_THRESHOLD_BYTES, as the torch.distributed backend's: beyond it NCCL is faster); returns None for the
    others, which the caller sends to vLLM's backends. Whether rocenante runs at all, and the threshold, are agreed
    by every rank at start()."""

    def __init__(self, comm: Optional[Communicator], why: str, threshold_bytes: int = 0):
        self.comm = comm
        self.why = why
        self.threshold_bytes = threshold_bytes

    @classmethod
    def start(cls, cpu_group, device: torch.device, unique_name: str) -> "AllReduceRouter":
        """Collective over `cpu_group` (vLLM's gloo group of the communicator's ranks) for a group of GROUPS; for
        any other group, and for elastic EP's stateless groups (whose gloo group torch.distributed does not know,
        so that it has no store to meet on), nothing happens and no rank waits."""
        import torch.distributed as dist

        if unique_name.split(":")[0] not in GROUPS:
            return cls(None, f"group {unique_name!r} is not one rocenante serves ({', '.join(GROUPS)})")
        if cpu_group not in dist.distributed_c10d._world.pg_map:
            return cls(None, f"group {unique_name!r} is a stateless group (elastic EP), which rocenante does not "
                             "serve")
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

    def all_gatherv(self, input_, dim: int, sizes) -> Optional[torch.Tensor | list[torch.Tensor]]:
        """vLLM's all_gatherv (AgRsAll2AllManager's dispatch: a tensor or a list of them, along dim 0): served where
        the sizes are equal (or None), as vLLM's own then runs a plain all-gather, every tensor along dim 0 (a
        list: all of them or none); else None. vLLM pads data-parallel ranks to equal sizes in CUDA-graph steps."""
        tensors = [input_] if isinstance(input_, torch.Tensor) else list(input_)
        comm = self.comm
        if comm is None or dim != 0 or (sizes is not None and any(s != sizes[0] for s in sizes)) \
                or any(x.dim() == 0 or not self._serves(x, comm.world_size) for x in tensors):
            return None
        gathered = [comm.all_gather(x.contiguous()) for x in tensors]
        return gathered[0] if isinstance(input_, torch.Tensor) else gathered

    def reduce_scatterv(self, x: torch.Tensor, dim: int, sizes, output: Optional[torch.Tensor] = None):
        """vLLM's reduce_scatterv and reduce_scatterv_into_output (AgRsAll2AllManager's combine): served where the
        sizes are equal (or None), as reduce_scatter(); into `output` when given (vLLM's own asks dim 0 then);
        else None."""
        if sizes is not None and any(s != sizes[0] for s in sizes):
            return None
        if output is None:
            return self.reduce_scatter(x, dim)
        comm = self.comm
        if comm is None or dim % max(x.dim(), 1) != 0 or not self._serves(x, 1) or x.shape[0] % comm.world_size != 0 \
                or output.dtype != x.dtype or output.numel() * comm.world_size != x.numel() \
                or not output.is_contiguous():
            return None
        comm.reduce_scatter(x.contiguous(), out=output.view(x.shape[0] // comm.world_size, *x.shape[1:]))
        return output

    def _serves(self, x: torch.Tensor, copies: int) -> bool:
        """serves() for a sum over ``copies`` times ``x``'s bytes (an all-gather's output), up to the threshold."""
        return serves(x, "sum") and copies * x.numel() * x.element_size() <= self.threshold_bytes

    def describe(self) -> str:
        """What rocenante serves, for the log line."""
        return (f"sum all-reduces, all-gathers and sum reduce-scatters (all_gatherv and reduce_scatterv of equal "
                f"sizes) of float32, float16, bfloat16 and int32 up to {self.threshold_bytes} bytes ({self.why})")

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()
            self.comm = None
