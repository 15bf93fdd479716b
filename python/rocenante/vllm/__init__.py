"""The vLLM plugin: entry point ``vllm.general_plugins`` ``rocenante = rocenante.vllm:register`` (pyproject.toml).

With ``ROCENANTE_VLLM=1``, register() makes the current platform's get_device_communicator_cls() name
RocenanteCudaCommunicator (communicator.py), a subclass of vLLM's CudaCommunicator, so vLLM builds it for its
groups; it sends the tensor-, data-, expert- and context-parallel groups' eligible calls to rocenante and
everything else to vLLM's own backends (router.py); vLLM's stateless groups, which build CudaCommunicator by name,
build it too.
Without the variable, or on a platform that does not build vLLM's CudaCommunicator, or on a vLLM without that
hook, it does nothing (and says why, in the last two cases). Nothing here imports
vLLM before register() runs with the variable set.
"""

from __future__ import annotations

import logging

from rocenante import _env

# Under "vllm.", so that vLLM's logging configuration shows these lines as it shows its own.
logger = logging.getLogger("vllm.rocenante")

COMMUNICATOR = "rocenante.vllm.communicator.RocenanteCudaCommunicator"
CUDA_COMMUNICATOR = "vllm.distributed.device_communicators.cuda_communicator.CudaCommunicator"


def register() -> None:
    """vLLM calls it in every process it starts (possibly more than once): idempotent."""
    if not _env.vllm():
        return
    try:
        from vllm.platforms import current_platform

        platform = type(current_platform)
        built = platform.get_device_communicator_cls()
    except (ImportError, AttributeError) as err:
        logger.warning("rocenante: ROCENANTE_VLLM=1, but this vLLM has no platform get_device_communicator_cls "
                       "(%s: %s); the rocenante plugin does nothing", type(err).__name__, err)
        return
    if built == COMMUNICATOR:
        return
    if built != CUDA_COMMUNICATOR or not current_platform.is_cuda():
        logger.warning("rocenante: ROCENANTE_VLLM=1, but platform %s builds %s, not vLLM's CudaCommunicator; the "
                       "rocenante plugin does nothing", platform.__name__, built)
        return
    platform.get_device_communicator_cls = classmethod(lambda cls: COMMUNICATOR)
    _stateless_groups_build_ours()
    logger.info("rocenante: ROCENANTE_VLLM=1: vLLM builds %s for its groups", COMMUNICATOR)


def _stateless_groups_build_ours() -> None:
    """vLLM's StatelessGroupCoordinator (the DP/EP/EPLB groups of --enable-elastic-ep, vLLM 0.33) asserts that the
    platform's class is CudaCommunicator itself and then builds that name: it is given ours under that name, so
    the assertion holds and those groups get a CudaCommunicator in every respect (ours serves nothing in a
    stateless group: router.py). A vLLM without that module has nothing to adapt."""
    try:
        from vllm.distributed import stateless_coordinator
    except ImportError:
        return
    from rocenante.vllm.communicator import RocenanteCudaCommunicator

    stateless_coordinator.CudaCommunicator = RocenanteCudaCommunicator
