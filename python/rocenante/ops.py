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


# A collective is a side effect whether or not its output is used: every rank must make it, in program order.
# Ordered effects thread a token through the op in the compiled graph, so the compiler neither removes it (where
# only some ranks use the result, the ranks' calls would pair one off) nor moves it across another ordered op.
torch.library._register_effectful_op(all_reduce._opoverload, torch.library.EffectType.ORDERED)
