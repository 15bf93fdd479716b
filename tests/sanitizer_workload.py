"""A small 2-GPU run of every dtype and op, for compute-sanitizer (tests/test_gpu_allreduce.py)."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from multiproc import expect_ok, run_ranks  # noqa: E402
from reference import DTYPES, make_input, ops_for, sequential_fp32  # noqa: E402


def _work(store, rank, world):
    import rocenante

    torch.cuda.set_device(rank)
    comm = rocenante.Communicator(store, rank, world, device=f"cuda:{rank}", capacity_bytes=1 << 16, timeout_s=120)
    case = 0
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for numel in (5, 3000):
                case += 1
                inputs = [make_input(9, case, r, numel, dtype) for r in range(world)]
                got = comm.all_reduce(inputs[rank].cuda(), op=op)
                comm.synchronize()
                assert torch.equal(got.cpu(), sequential_fp32(inputs, op)), f"{dtype} {op} n={numel}"
    comm.close()
    return case


if __name__ == "__main__":
    print(expect_ok(run_ranks(2, _work, timeout=500)))
