"""rocenante.serves(): the one rule by which the backend and the plugins decide that rocenante serves a call."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import rocenante
from rocenante.vllm.router import AllReduceRouter


@pytest.mark.parametrize("x, op, max_bytes, want", [
    (torch.ones(4), "sum", None, True),
    (torch.ones(4, dtype=torch.bfloat16), dist.ReduceOp.MAX, None, True),
    (torch.ones(4, dtype=torch.int32), "min", None, True),
    (torch.ones(4, dtype=torch.int32), "avg", None, False),  # int32 has no avg
    (torch.ones(4, dtype=torch.int32), dist.ReduceOp.AVG, None, False),
    (torch.ones(4, dtype=torch.float64), "sum", None, False),
    (torch.ones(4), "product", None, False),
    (torch.ones(4), dist.ReduceOp.PRODUCT, None, False),
    (torch.ones(4), ["sum"], None, False),  # unhashable: not an op
    (torch.ones(0), "sum", None, False),
    (torch.ones(4), "sum", 16, True),
    (torch.ones(4), "sum", 15, False),
    (torch.ones(8)[::2], "avg", 16, True),  # layout in memory is the caller's: the backend copies
    (torch.ones(4).to_sparse(), "sum", None, False),
    (torch.ones(4, device="meta"), "sum", None, True),  # where a tensor is is not asked
    ([1.0, 2.0], "sum", None, False),
])
def test_serves(x, op, max_bytes, want):
    assert rocenante.serves(x, op, max_bytes) is want


class _Comm:
    def __init__(self):
        self.calls = []

    def all_reduce(self, x):
        self.calls.append(x)
        return x


def test_the_vllm_router_serves_by_the_same_rule():
    comm = _Comm()
    router = AllReduceRouter(comm, "test", threshold_bytes=64)
    for x in (torch.ones(16), torch.ones(32)[::2], torch.ones(17), torch.ones(4, dtype=torch.float64),
              torch.ones(4).to_sparse(), torch.ones(0)):
        served = router.all_reduce(x) is not None
        assert served == rocenante.serves(x, "sum", 64), x
    assert len(comm.calls) == 2 and all(t.is_contiguous() for t in comm.calls)
