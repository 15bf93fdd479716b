"""torch.ops.rocenante.all_reduce: an out-of-place all-reduce that torch.compile can trace (fullgraph=True),
with a fake implementation for shape propagation."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rocenante.backend import RocenanteProcessGroup


@torch.library.custom_op("rocenante::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    """Returns the all-reduce of x over the process group named group_name (a "rocenante" group)."""
    group = dist.distributed_c10d._resolve_process_group(group_name)
    if not isinstance(group, RocenanteProcessGroup):
        raise ValueError(f"group {group_name!r} uses backend {dist.get_backend(group)!r}, not 'rocenante'")
    return group.all_reduce_out_of_place(x, op)


@all_reduce.register_fake
def _(x: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)
