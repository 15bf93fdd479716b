"""Diagnosis (issue 43): torch's functional collectives on CUDA tensors through a plain gloo group (no rocenante),
two ranks sharing one GPU, as the backend's CUDA delegate is when the tests share a GPU. Each rank runs ITERS rounds
of all_reduce, all_gather_tensor (dims 0 and 1) and reduce_scatter_tensor, each waited for; the parent reports how
every rank ended (a signal is a crash). `--backend rocenante` runs the same rounds on a rocenante group, which
serves them itself. Prints one line per rank and a summary; exits 0 whatever the outcome (it reports, not tests).

    python benchmarks/gloo_cuda_funcol.py [--backend gloo|rocenante] [--iters N] [--runs R]
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile


def rank_main(backend, iters):
    import faulthandler

    faulthandler.enable(all_threads=True)
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import rocenante  # noqa: F401

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{os.environ['STORE']}", rank=rank, world_size=world)
    group = dist.group.WORLD
    x = torch.arange(64.0, device="cuda").view(8, 8) + rank
    for _ in range(iters):
        funcol.wait_tensor(funcol.all_reduce(x, "sum", group))
        funcol.wait_tensor(funcol.all_gather_tensor(x, 0, group))
        funcol.wait_tensor(funcol.all_gather_tensor(x, 1, group))
        funcol.wait_tensor(funcol.reduce_scatter_tensor(x, "sum", 0, group))
    torch.cuda.synchronize()
    dist.destroy_process_group()
    print(f"rank {rank}: {iters} rounds done", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        return rank_main(args.backend, args.iters)
    env = dict(os.environ, WORLD_SIZE="2", ROCENANTE_TEST_SHARED_GPU="1")
    outcomes = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            procs = [subprocess.Popen([sys.executable, __file__, "--rank-main", "--backend", args.backend,
                                       "--iters", str(args.iters)], env=dict(env, RANK=str(r), STORE=f"{tmp}/store"))
                     for r in range(2)]
            codes = []
            for p in procs:
                try:
                    codes.append(p.wait(timeout=120))
                except subprocess.TimeoutExpired:
                    p.kill()
                    codes.append("hung")
        ends = [f"signal {signal.Signals(-c).name}" if isinstance(c, int) and c < 0 else str(c) for c in codes]
        print(f"run {run}: {args.backend}, rank exits {ends}", flush=True)
        outcomes.append(all(c == 0 for c in codes))
    print(f"{args.backend}: {sum(outcomes)} of {len(outcomes)} runs clean")


if __name__ == "__main__":
    main()
