"""install(): FlashInfer's own names serve rocenante workspaces.

After it, flashinfer.comm.create_allreduce_fusion_workspace(backend="rocenante", ...) builds a rocenante
workspace and flashinfer.comm.allreduce_fusion(...) runs on it; every other backend and workspace reaches
FlashInfer's own functions with the same arguments. Both flashinfer.comm and the module that defines the
names (flashinfer.comm.allreduce) are patched. Callers that look the names up at call time
(``flashinfer.comm.allreduce_fusion(...)``, as vLLM does) see the patch whenever install() ran; a
``from flashinfer.comm import allreduce_fusion`` made before install() keeps FlashInfer's function: call
install() first.
"""

from __future__ import annotations

from rocenante.flashinfer import fusion

_NAMES = ("create_allreduce_fusion_workspace", "allreduce_fusion")
# FlashInfer's own functions, kept on the defining module, so that a second install() (or a reload of this
# module) never takes rocenante's for FlashInfer's.
_ORIGINALS = "_rocenante_originals"


def install() -> None:
    """Patches flashinfer.comm (FlashInfer must be installed). Idempotent."""
    import flashinfer.comm as comm
    from flashinfer.comm import allreduce as defining

    originals = defining.__dict__.setdefault(_ORIGINALS, {})
    for name in _NAMES:
        originals.setdefault(name, getattr(defining, name))
        ours = getattr(fusion, name)
        setattr(defining, name, ours)
        setattr(comm, name, ours)


def original(defining, name: str):
    """FlashInfer's own function `name` from its defining module, patched or not."""
    return defining.__dict__.get(_ORIGINALS, {}).get(name) or getattr(defining, name)
