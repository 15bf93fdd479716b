"""The implementations of a collective (all-reduce, or all-to-all of equal or unequal blocks) a benchmark compares. Each arm
allocates the buffers of one (dtype, size) and runs one call on them; the runner times back-to-back calls,
captured in a CUDA graph or called eagerly."""

from __future__ import annotations

import ctypes

import torch
import torch.distributed as dist

# Every arm the benchmark knows, per device type, in the order they run in round 0 (--arms picks a subset).
NAMES = {
    "cuda": ["rocenante", "rocenante_backend", "nccl", "symm_mem_one_shot", "symm_mem_two_shot", "rocenante_net_tcp"],
    "cpu": ["rocenante", "rocenante_backend", "gloo", "memcpy", "rocenante_net_tcp"],
}
# Run only when --arms names them (not part of the default "all"): rocenante_net_tcp's proxy thread polls
# beside the other arms.
ON_REQUEST = ["rocenante_net_tcp"]
# The arms that serve only all-reduces.
ALL_REDUCE_ONLY = ["symm_mem_one_shot", "symm_mem_two_shot"]


class Arm:
    name = ""
    all_reduce = True  # False: a yardstick, timed beside the all-reduces but neither checked nor one of them

    def __init__(self, ctx):
        self.ctx = ctx  # rank, world, device, communicator

    def call(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One call of the benchmark's collective (an all-reduce: a sum) on x; returns the tensor that holds the
        result (x, y or a new one)."""
        raise NotImplementedError

    def prepare(self, numel: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Input and output buffers of one (dtype, size); the runner fills the input."""
        x = torch.empty(numel, dtype=dtype, device=self.ctx.device)
        return x, torch.empty_like(x)

    def supports(self, nbytes: int, dtype) -> str | None:
        """None, or why this arm does not run at this size (recorded beside the results)."""
        return None


class Rocenante(Arm):
    """A communicator's all_reduce or all_to_all: "rocenante" (direct: CUDA IPC or shared memory), or
    "rocenante_net_tcp" (the network path through the TCP software wire)."""

    def __init__(self, ctx, name="rocenante"):
        super().__init__(ctx)
        self.name = name

    def call(self, x, y):
        if self.ctx.collective == "all_to_all":
            return self.ctx.comm.all_to_all(x, out=y)
        if self.ctx.collective == "all_to_all_unequal":
            send, recv = self.ctx.splits(x.numel())
            return self.ctx.comm.all_to_all(x, out=y, input_split_sizes=send, output_split_sizes=recv)
        self.ctx.comm.all_reduce(x, out=y)
        return y

    def supports(self, nbytes, dtype):
        if nbytes > self.ctx.comm.capacity_bytes:
            return f"over the communicator's capacity ({self.ctx.comm.capacity_bytes} bytes)"
        esize = torch.empty((), dtype=dtype).element_size()
        largest = self.ctx.comm.largest_block(dtype)
        if self.ctx.collective == "all_to_all_unequal" and max(self.ctx.splits(nbytes // esize)[0]) > largest:
            return f"a block above the largest a split all-to-all holds ({largest} elements)"
        return None


class Collective(Arm):
    """torch.distributed on a process group (NCCL for CUDA tensors, gloo for CPU ones): all_reduce in place, or
    all_to_all_single of equal splits into y."""

    def __init__(self, ctx, name, group):
        super().__init__(ctx)
        self.name = name
        self.group = group

    def call(self, x, y):
        if self.ctx.collective != "all_reduce":
            send, recv = self.ctx.splits(x.numel())
            dist.all_to_all_single(y, x, recv, send, group=self.group)
            return y
        dist.all_reduce(x, group=self.group)
        return x


class SymmMem(Arm):
    """torch SymmetricMemory one-shot (out of place) or two-shot (in place) all-reduce, on an input that lives
    in a symmetric buffer (the op's requirement); multicast stays off."""

    def __init__(self, ctx, name, group, max_bytes):
        super().__init__(ctx)
        import torch.distributed._symmetric_memory as symm_mem

        self.name = name
        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.symm_mem = symm_mem
        self.max_bytes = max_bytes
        self.buffers: dict = {}
        self.one_shot = name == "symm_mem_one_shot"

    def prepare(self, numel, dtype):
        if dtype not in self.buffers:
            buf = self.symm_mem.empty(self.max_bytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype,
                                      device=self.ctx.device)
            self.symm_mem.rendezvous(buf, self.group_name)
            self.buffers[dtype] = buf
        x = self.buffers[dtype][:numel]
        return x, x

    def call(self, x, y):
        if self.one_shot:
            return torch.ops.symm_mem.one_shot_all_reduce(x, "sum", self.group_name)
        torch.ops.symm_mem.two_shot_all_reduce_(x, "sum", self.group_name)
        return x


class Memcpy(Arm):
    """The yardstick of the CPU path: one core copying the same bytes (libc memcpy of x into y), on every rank
    at once, as the all-reduces run."""

    name = "memcpy"
    all_reduce = False

    def call(self, x, y):
        ctypes.memmove(y.data_ptr(), x.data_ptr(), x.numel() * x.element_size())
        return y


def available_symm_mem_arms() -> list[str]:
    ops = getattr(torch.ops, "symm_mem", None)
    names = []
    for arm, op in (("symm_mem_one_shot", "one_shot_all_reduce"), ("symm_mem_two_shot", "two_shot_all_reduce_")):
        try:
            getattr(ops, op)
            names.append(arm)
        except (AttributeError, RuntimeError):
            pass
    return names
