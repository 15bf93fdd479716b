"""RocenanteAllReduceWorkspace: rocenante's one-shot all-reduce behind the interface of FlashInfer's
PcieIpcAllReduceWorkspace (flashinfer-python 0.7.4): supports, all_reduce, prepare, tune, rebind_stream,
destroy, context manager. Built on a process group (that face) or on a FlashInfer CommBackend (bootstrap.py)."""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

from rocenante import _C, startup
from rocenante.communicator import serves

# FlashInfer's defaults for the arguments that shape its own kernels (flashinfer/comm/pcie_ipc_collectives/
# _constants.py AR_MAX_BLOCKS, pcie_ipc_tuning.py TUNE_WARMUP / TUNE_REPEAT), repeated so that the signatures
# match (tests/cpu/test_cpu_flashinfer.py compares them with the installed FlashInfer's).
_FLASHINFER_AR_MAX_BLOCKS = 128
_FLASHINFER_TUNE_WARMUP = 10
_FLASHINFER_TUNE_REPEAT = 50

# What prepare() says serves a supported shape (FlashInfer names one of its launch configurations there).
ONESHOT = "rocenante-oneshot"


def _serves_shape(shape, dtype, max_bytes) -> bool:
    """rocenante.serves() for a sum all-reduce of this shape and dtype, asked of a tensor without memory."""
    return isinstance(dtype, torch.dtype) and serves(torch.empty(shape, dtype=dtype, device="meta"), "sum", max_bytes)


class RocenanteAllReduceWorkspace:
    """An all-reduce workspace for every rank of ``group``, served by a rocenante communicator.

    Collective, as FlashInfer's: every rank builds it with the same arguments, and it either works on every
    rank or raises the same error on every rank (the verdict is agreed, see rocenante.startup). It serves sum
    all-reduces of float32, float16, bfloat16 and int32 contiguous tensors of up to ``max_numel`` elements of
    ``dtype`` (in bytes: any dtype fits as long as the bytes do).

    Unlike FlashInfer's, it is not bound to one stream: rocenante orders calls from any stream itself (docs/guarantees.md,
    "Ordering"), so rebind_stream() has nothing to do; and it has one kernel, so ``max_blocks``, ``profile``,
    ``tune_batches``, ``tune_cache`` and ``ce_slow_hops`` (which size and tune FlashInfer's kernels) are
    accepted and unused, and tune() measures nothing.
    """

    def __init__(
        self,
        group,
        max_numel: int,
        dtype: torch.dtype = torch.bfloat16,
        max_blocks: int = _FLASHINFER_AR_MAX_BLOCKS,
        profile: Optional[str] = None,
        tune_batches: Optional[Sequence[int]] = None,
        tune_cache: Optional[str] = None,
        ce_slow_hops: Optional[int] = None,
    ) -> None:
        self.group = group
        self._open(startup.rendezvous_on_group(group, "flashinfer"), max_numel, dtype)

    @classmethod
    def _on(cls, rendezvous: startup.Rendezvous, max_numel: int, dtype: torch.dtype, refusal=None
            ) -> "RocenanteAllReduceWorkspace":
        """A workspace on a rendezvous made some other way (a FlashInfer CommBackend); `refusal` as in
        startup.open_agreed."""
        self = cls.__new__(cls)
        self.group = None
        self._open(rendezvous, max_numel, dtype, refusal)
        return self

    def _open(self, rendezvous: startup.Rendezvous, max_numel: int, dtype: torch.dtype, refusal=None) -> None:
        self._comm = None
        self._rendezvous = rendezvous
        self.rank, self.world_size = rendezvous.rank, rendezvous.size
        self.max_numel = int(max_numel)
        self.dtype = dtype
        if torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:  # CPU processes (rocenante's shared-memory path): what the CPU tests run
            self.device = torch.device("cpu")
        # Bad arguments are reported through the agreement, so that every rank raises.
        if refusal is None and not _serves_shape((1,), dtype, None):
            refusal = f"dtype {dtype} (rocenante supports float32, float16, bfloat16 and int32)"
        if refusal is None and self.max_numel <= 0:
            refusal = f"max_numel={max_numel} (must be positive)"
        self.max_bytes = 0 if refusal else self.max_numel * torch.empty((), dtype=dtype).element_size()
        # The region need not hold more than the workspace serves; larger calls would go as pieces.
        started = startup.open_agreed(rendezvous.exchange, rendezvous.store, self.rank, self.world_size,
                                      self.device, "flashinfer", "flashinfer workspace", self.max_bytes, refusal)
        self._comm = started.comm
        if self._comm is None:
            raise _C.RocenanteError(f"rank {self.rank}: rocenante workspace not built: {started.why}")

    def _alive(self):
        if self._comm is None:
            raise RuntimeError("workspace has been destroyed")
        return self._comm

    def supports(self, inp: torch.Tensor) -> bool:
        """Whether rocenante can all-reduce ``inp``: rocenante.serves() up to the workspace's size, and as
        FlashInfer's, contiguous with at least one dimension (rank-shared facts only). A tensor on another device
        raises ValueError: that is a caller's bug, and answering False would send this rank alone to another
        backend."""
        if inp.device != self.device:
            raise ValueError(f"input is on {inp.device} but the workspace was built on {self.device}")
        return self._comm is not None and serves(inp, "sum", self.max_bytes) and inp.is_contiguous() and inp.dim() > 0

    def all_reduce(self, inp: torch.Tensor, *, out: Optional[torch.Tensor] = None, config=None,
                   enable_pdl: bool = False) -> torch.Tensor:
        """Out-of-place sum over the ranks (``out`` may be ``inp``). ``config`` picks one of FlashInfer's
        kernels and must be None; ``enable_pdl`` is accepted either way (rocenante's kernel always uses
        programmatic dependent launch, and is safe to: it waits for the previous kernel's writes)."""
        if config is not None:
            raise ValueError("config= selects one of FlashInfer's PCIe IPC kernels; a rocenante workspace has one "
                             "kernel: pass config=None")
        comm = self._alive()
        if inp.device != self.device:  # only this rank can see it: its peers learn of it at once (they fault too)
            comm.refuse(f"input is on {inp.device} but the workspace was built on {self.device}")
        if not self.supports(inp):  # this rank's shape: refused on every rank too
            comm.refuse(f"unsupported shape {tuple(inp.shape)} dtype {inp.dtype} at {self.world_size} ranks "
                         f"(capacity {self.max_bytes} bytes); check supports() first")
        return comm.all_reduce(inp, out=out)  # an `out` that does not match is refused the same way

    def prepare(self, shapes: Sequence[Tuple[int, int]], *, dtype: torch.dtype = torch.bfloat16
                ) -> Dict[Tuple[int, int], Optional[str]]:
        """{(batch, hidden): ONESHOT, or None where the shape does not fit}. Nothing needs resolving before a
        graph capture: every supported shape can be captured at any time."""
        return {(int(b), int(h)): ONESHOT if _serves_shape((int(b), int(h)), dtype, self.max_bytes) else None
                for b, h in shapes}

    def tune(self, hiddens: Sequence[int], *, dtype: torch.dtype = torch.bfloat16, cache: Optional[str] = None,
             tune_group=None, warmup: int = _FLASHINFER_TUNE_WARMUP, repeat: int = _FLASHINFER_TUNE_REPEAT
             ) -> Dict[Tuple[int, int], str]:
        """Nothing to tune (one kernel); returns {}."""
        return {}

    def rebind_stream(self) -> None:
        """Nothing to do: calls from any stream are ordered by rocenante itself."""

    def destroy(self) -> None:
        """Collective, as FlashInfer's: waits for this rank's calls, then for every rank to get here, so no rank
        frees memory a peer may still be writing into, then releases the communicator. Idempotent."""
        if self._comm is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        try:
            self._rendezvous.exchange("destroy", {})
        finally:
            self._comm.close()
            self._comm = None
            self._rendezvous = None

    def __enter__(self) -> "RocenanteAllReduceWorkspace":
        return self

    def __exit__(self, *exc_info) -> None:
        self.destroy()
