"""RocenanteCudaCommunicator: what vLLM builds for its groups once the plugin is registered (ROCENANTE_VLLM=1).

A CudaCommunicator in every respect (vLLM's graph_capture() requires one, and enters its backends' capture
contexts), with the eligible all-reduces, all-gathers and reduce-scatters (and the all2all manager's all_gatherv and
reduce_scatterv of equal sizes) of the tensor-, data-, expert- and context-parallel groups on rocenante (router.py).
rocenante needs no capture context: its kernel reads the caller's tensor in place and keeps its call numbers on
the GPU, so captured calls replay correctly on any tensor, and calls from the capture stream are ordered after
earlier ones on other streams by rocenante itself. Imports vLLM: only loaded through the plugin.
"""

from __future__ import annotations

import torch
from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
from vllm.logger import init_logger

from rocenante.vllm.router import GROUPS, AllReduceRouter

logger = init_logger("vllm.rocenante")


class RocenanteCudaCommunicator(CudaCommunicator):
    def __init__(self, cpu_group, device=None, device_group=None, unique_name: str = "", *args, **kwargs):
        super().__init__(cpu_group, device, device_group, unique_name, *args, **kwargs)
        self.rocenante = AllReduceRouter(None, "the group has one rank")
        if self.world_size > 1:
            self.rocenante = AllReduceRouter.start(self.cpu_group, self.device, unique_name)
            # Beside vLLM's own line ("Using [...] all-reduce backends (in dispatch order) for group ..."), which
            # super().__init__ has just logged: when active, rocenante comes first in that order.
            if self.rocenante.active:
                logger.info_once("Using rocenante all-reduce ahead of those backends for group '%s': %s.",
                                 unique_name, self.rocenante.describe(), scope="global")
            elif unique_name.split(":")[0] in GROUPS:
                logger.warning_once("Not using rocenante all-reduce for group '%s' (ROCENANTE_VLLM=1): %s.",
                                    unique_name, self.rocenante.why, scope="global")

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        out = self.rocenante.all_reduce(input_)
        return out if out is not None else super().all_reduce(input_)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        out = self.rocenante.all_gather(input_, dim)
        return out if out is not None else super().all_gather(input_, dim)

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        out = self.rocenante.reduce_scatter(input_, dim)
        return out if out is not None else super().reduce_scatter(input_, dim)

    def all_gatherv(self, input_, dim: int = 0, sizes=None):
        out = self.rocenante.all_gatherv(input_, dim, sizes)
        return out if out is not None else super().all_gatherv(input_, dim, sizes)

    def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes=None):
        out = self.rocenante.reduce_scatterv(input_, dim, sizes)
        return out if out is not None else super().reduce_scatterv(input_, dim, sizes)

    def reduce_scatterv_into_output(self, input_: torch.Tensor, output: torch.Tensor, dim: int = -1, sizes=None):
        out = self.rocenante.reduce_scatterv(input_, dim, sizes, output)
        return out if out is not None else super().reduce_scatterv_into_output(input_, output, dim, sizes)

    def destroy(self) -> None:
        self.rocenante.close()
        super().destroy()
