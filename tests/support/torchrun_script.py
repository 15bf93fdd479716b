"""Launched by tests/cpu/test_backend.py under torchrun: the script a user writes, with backend="rocenante"."""

import torch
import torch.distributed as dist

import rocenante

dist.init_process_group(backend="rocenante")
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.full((1000,), float(rank + 1))
dist.all_reduce(x)
assert torch.equal(x, torch.full((1000,), float(world * (world + 1) // 2)))
assert dist.get_backend() == "rocenante" and rocenante.status()["cpu"]["active"]
dist.destroy_process_group()
print("rocenante torchrun OK", flush=True)
