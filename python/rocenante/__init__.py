"""rocenante: one-shot all-reduce for tensor-parallel inference on small GPU clusters."""

import torch  # noqa: F401  (first: a CUDA build of torch loads the CUDA runtime that rocenante._C shares)

from rocenante._C import (
    CallMismatchError,
    ClosedError,
    InvalidArgument,
    PeerTimeoutError,
    RocenanteError,
)
from rocenante.communicator import Communicator

__all__ = [
    "CallMismatchError",
    "ClosedError",
    "Communicator",
    "InvalidArgument",
    "PeerTimeoutError",
    "RocenanteError",
]
__version__ = "0.1.0"
