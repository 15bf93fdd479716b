"""A small 2-rank run of every dtype and op on this machine's GPUs (shared where there is one), and split all-to-alls
of every dtype, directly and then two-shot over the TCP wire, for compute-sanitizer (tests/gpu/test_gpu_allreduce.py)."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import gpus  # noqa: E402
from multiproc import expect_ok, run_ranks  # noqa: E402
from reference import DTYPES, bits, make_input, ops_for, sequential_fp32, split_block, split_rows  # noqa: E402


def _work(store, rank, world):
    import rocenante

    device = gpus.use(rank)
    comm = rocenante.Communicator(store, rank, world, device=device, capacity_bytes=1 << 16, timeout_s=120)
    case = 0
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for numel in (5, 3000):
                case += 1
                inputs = [make_input(9, case, r, numel, dtype) for r in range(world)]
                got = comm.all_reduce(inputs[rank].to(device), op=op)
                comm.synchronize()
                assert torch.equal(got.cpu(), sequential_fp32(inputs, op)), f"{dtype} {op} n={numel}"
        # Split all-to-alls (blocks_kernel), both forms: blocks from none to the largest.
        case += 1
        rows = split_rows(9, case, world, comm.largest_block(dtype) // 3)
        sent = torch.cat([split_block(9, case, rank, t, world, rows[rank][t], 3, dtype) for t in range(world)])
        want = [split_block(9, case, s, rank, world, rows[s][rank], 3, dtype) for s in range(world)]
        got = comm.all_to_all(sent.to(device), input_split_sizes=rows[rank],
                              output_split_sizes=[rows[s][rank] for s in range(world)])
        capacity = max(max(r) for r in rows) or 1
        out = torch.zeros(world * capacity, 3, dtype=dtype, device=device)
        counts = comm.all_to_all_v(sent.to(device), torch.tensor(rows[rank], device=device), out)
        comm.synchronize()
        assert torch.equal(bits(got.cpu()), bits(torch.cat(want))), f"split lists {dtype}"
        assert counts.tolist() == [rows[s][rank] for s in range(world)], f"split counts {dtype}"
    comm.close()
    return case


if __name__ == "__main__":
    print(expect_ok(run_ranks(2, _work, timeout=500)))
    # The sharded kernel over the network, where one launch makes a two-shot piece's two calls (csrc/layout.h).
    os.environ.update(ROCENANTE_NET="tcp", ROCENANTE_ALGO="twoshot")
    print(expect_ok(run_ranks(2, _work, timeout=500)))
