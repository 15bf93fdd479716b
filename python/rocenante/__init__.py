"""rocenante: one-shot all-reduce for tensor-parallel inference on small GPU clusters."""

import torch  # noqa: F401  (first: a CUDA build of torch loads the CUDA runtime that rocenante._C shares)

from rocenante._C import (
    CallMismatchError,
    ClosedError,
    InvalidArgument,
    Interrupted,
    PeerAbortedError,
    PeerTimeoutError,
    RocenanteError,
)
from rocenante.backend import register as _register_backend
from rocenante.backend import status
from rocenante.communicator import Communicator, serves
from rocenante import ops  # noqa: F401  (defines torch.ops.rocenante.all_reduce)

_register_backend()

__all__ = [
    "CallMismatchError",
    "ClosedError",
    "Communicator",
    "InvalidArgument",
    "Interrupted",
    "PeerAbortedError",
    "PeerTimeoutError",
    "RocenanteError",
    "serves",
    "status",
]
__version__ = "0.1.0"
