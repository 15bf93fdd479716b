"""rocenante for FlashInfer users (flashinfer-python 0.7.x), in two faces, without FlashInfer installed:

- ``RocenanteAllReduceWorkspace`` (also under FlashInfer's name ``PcieIpcAllReduceWorkspace``): the interface
  of FlashInfer's PCIe IPC all-reduce workspace, built on a process group;
- ``create_allreduce_fusion_workspace(backend="rocenante", ...)`` and ``allreduce_fusion(...)``: FlashInfer's
  unified pair, patterns kAllReduce and kARResidualRMSNorm, bootstrapped by a process group or FlashInfer's
  CommBackend; other backends go to FlashInfer when it is installed.

``install()`` makes FlashInfer's own ``flashinfer.comm`` names serve rocenante too (see patch.py: call it
before any ``from flashinfer.comm import ...``).
"""

from rocenante.flashinfer.fusion import (
    AllReduceFusionPattern,
    RocenanteFusionWorkspace,
    add_rmsnorm,
    allreduce_fusion,
    create_allreduce_fusion_workspace,
)
from rocenante.flashinfer.patch import install
from rocenante.flashinfer.workspace import ONESHOT, RocenanteAllReduceWorkspace

PcieIpcAllReduceWorkspace = RocenanteAllReduceWorkspace

__all__ = [
    "AllReduceFusionPattern",
    "ONESHOT",
    "PcieIpcAllReduceWorkspace",
    "RocenanteAllReduceWorkspace",
    "RocenanteFusionWorkspace",
    "add_rmsnorm",
    "allreduce_fusion",
    "create_allreduce_fusion_workspace",
    "install",
]
