"""A few DDP training steps, for comparing backends on the same model and data."""

from __future__ import annotations

import time

import torch

import gpus


def train(store, rank: int, world: int, backend: str, device: str) -> list[bytes]:
    """Five SGD steps of a small MLP under DDP on "cpu" or "cuda" (this rank's GPU, tests/support/gpus.py); returns
    the parameters' exact bits."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import rocenante  # noqa: F401  (registers the "rocenante" backend)

    on_gpu = device == "cuda"
    device = gpus.use(rank) if on_gpu else torch.device("cpu")
    dist.init_process_group(backend, store=dist.PrefixStore(backend, store), rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).to(device)
    ddp = DDP(model, device_ids=[device] if on_gpu else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator(device=device).manual_seed(7 + rank)
    for _ in range(5):
        opt.zero_grad()
        ddp(torch.randn(32, 64, device=device, generator=g)).square().mean().backward()
        opt.step()
    params = [p.detach().cpu().numpy().tobytes() for p in model.parameters()]
    # torch's gloo workers drop finished work items under the GIL; freeing a gloo group (here with the DDP
    # reducer, when this frame ends) joins those workers while holding the GIL. Let them finish first.
    time.sleep(0.1)
    dist.destroy_process_group()
    return params
