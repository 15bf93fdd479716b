"""All-reduce + residual add + RMSNorm (FlashInfer's kARResidualRMSNorm) at decode shapes: the add and the norm
fused into rocenante's kernel against the all-reduce followed by torch's ops (issue: fuse if that beats the
latter by 10% or more at tokens <= 64, hidden 4096-8192; benchmarks/results/h200x2-fusion-decision.json).

    python benchmarks/fusion_bench.py [--out benchmarks/results/h200x2-fusion.json] [-n RANKS]

Arms, interleaved round after round (as python -m rocenante.bench), each a CUDA graph of `ops` calls:
  rocenante_allreduce             the all-reduce alone (comm.all_reduce into a preallocated output)
  rocenante_allreduce_rmsnorm     rocenante's all-reduce, then the residual add and RMSNorm as torch ops
                                  (rocenante.flashinfer.add_rmsnorm: what the plugin runs where it cannot fuse)
  rocenante_fused                 rocenante.flashinfer.allreduce_fusion(kARResidualRMSNorm): one kernel (the run
                                  fails if the plugin would not fuse the shape)
  torch_add_rmsnorm               the torch ops alone, no communication: the most fusing can save
  nccl_allreduce_rmsnorm          NCCL's all-reduce, then the same torch ops
Before timing, each shape's fused outputs are checked against the unfused arm's: residual_out bitwise, norm_out
within one unit in the last place. Writes JSON of schema rocenante.bench/1 (rows: arm, mode, dtype, bytes,
median_us, p10_us, p90_us, tokens, hidden) with a summary per shape: the unfused and fused times, the most
fusing could gain (torch_add_rmsnorm / rocenante_allreduce_rmsnorm) and the gain measured (1 - fused / unfused).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

TOKENS = [1, 2, 4, 8, 16, 32, 64]
HIDDENS = [4096, 8192]
EPS = 1e-6


METHOD = {
    "script": "benchmarks/fusion_bench.py",
    "arm_order": "every arm interleaved in one run; round-robin order shifted by one arm every round",
    "before_each_measurement": "barrier across ranks (gloo), then (graphs) the runner's GPU sleep before replay",
    "measurement": "one CUDA graph of `ops` calls per arm and shape (CPU: eager), timed as a whole, per call",
    "statistic": "slower rank per measurement; median, p10 and p90 over rounds",
}


class FusionArm:
    """One way of computing (residual_out, norm_out) from this rank's partial sum, for runner.Measurement:
    prepare() builds the tensors of one (tokens, hidden), call() runs once."""

    def __init__(self, name, ctx):
        self.name, self.ctx = name, ctx
        self.hidden = None

    def prepare(self, numel, dtype):
        device = self.ctx["device"]
        shape = (numel // self.hidden, self.hidden)
        self.residual = torch.randn(shape, device=device).to(dtype)
        self.gamma = torch.randn(self.hidden, device=device).to(dtype)
        self.residual_out, self.norm_out = torch.empty_like(self.residual), torch.empty_like(self.residual)
        x = torch.randn(shape, device=device).to(dtype)
        return x, torch.empty_like(x)

    def call(self, x, y):
        from rocenante.flashinfer import AllReduceFusionPattern, add_rmsnorm, allreduce_fusion

        if self.name == "rocenante_allreduce":
            self.ctx["workspace"].allreduce.all_reduce(x, out=y)
        elif self.name == "rocenante_allreduce_rmsnorm":
            self.ctx["workspace"].allreduce.all_reduce(x, out=y)
            add_rmsnorm(y, self.residual, self.gamma, EPS, 0.0, self.residual_out, self.norm_out)
        elif self.name == "rocenante_fused":
            allreduce_fusion(x, self.ctx["workspace"], AllReduceFusionPattern.kARResidualRMSNorm,
                             residual_out=self.residual_out, norm_out=self.norm_out, residual_in=self.residual,
                             rms_gamma=self.gamma, rms_eps=EPS)
        elif self.name == "torch_add_rmsnorm":
            add_rmsnorm(x, self.residual, self.gamma, EPS, 0.0, self.residual_out, self.norm_out)
        else:  # nccl_allreduce_rmsnorm
            y.copy_(x)  # out of place, as the fused pattern (the copy is part of what NCCL's arm costs)
            dist.all_reduce(y, group=self.ctx["nccl"])
            add_rmsnorm(y, self.residual, self.gamma, EPS, 0.0, self.residual_out, self.norm_out)

    def supports(self, nbytes, dtype):
        return None


def check_fused(ctx, tokens, hidden, dtype):
    """The fused call against the all-reduce followed by torch's ops on the same inputs: residual_out bitwise,
    norm_out within fused_norm_bound() (one unit in the last place; fp32: 2^-16 relative); and on a GPU the
    plugin must fuse."""
    from rocenante.bench.runner import fused_norm_bound
    from rocenante.flashinfer import AllReduceFusionPattern, add_rmsnorm, allreduce_fusion

    comm = ctx["workspace"].allreduce._alive()
    g = torch.Generator(device=ctx["device"]).manual_seed(tokens * 100_003 + hidden)
    x, residual = (torch.randn(tokens, hidden, generator=g, device=ctx["device"]).to(dtype) for _ in range(2))
    gamma = torch.randn(hidden, generator=g, device=ctx["device"]).to(dtype)
    if ctx["device"].type == "cuda" and not comm.fuses_add_rmsnorm(x, gamma):
        raise RuntimeError(f"the plugin does not fuse tokens {tokens} hidden {hidden} {dtype}")
    fused_r, fused_n, r, n = (torch.empty_like(x) for _ in range(4))
    allreduce_fusion(x, ctx["workspace"], AllReduceFusionPattern.kARResidualRMSNorm, residual_out=fused_r,
                     norm_out=fused_n, residual_in=residual, rms_gamma=gamma, rms_eps=EPS)
    add_rmsnorm(comm.all_reduce(x), residual, gamma, EPS, 0.0, r, n)
    if ctx["device"].type == "cuda":
        torch.cuda.synchronize()
    a, b = fused_n.double(), n.double()
    if not torch.equal(fused_r, r) or not bool(((a - b).abs() <= fused_norm_bound(a, b, dtype)).all()):
        raise RuntimeError(f"fused and unfused outputs differ at tokens {tokens} hidden {hidden} {dtype}")


def worker(store, rank, world, cfg):
    from rocenante.bench.runner import SLEEP_BEFORE_REPLAY_US, Measurement, percentile, sleep_cycles_per_us
    from rocenante.flashinfer import create_allreduce_fusion_workspace

    cuda = cfg["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    mode = "graph" if cuda else "eager"
    dist.init_process_group("gloo", store=dist.PrefixStore("ctl", store), rank=rank, world_size=world)
    control = dist.group.WORLD
    nccl = dist.new_group(backend="nccl") if cuda else control  # CPU (a smoke test of this script): gloo
    dtype = getattr(torch, cfg["dtype"])
    workspace = create_allreduce_fusion_workspace("rocenante", world, rank, max(cfg["tokens"]), max(cfg["hiddens"]),
                                                  dtype, group=control)
    ctx = {"device": device, "workspace": workspace, "nccl": nccl}
    arms = [FusionArm(name, ctx) for name in cfg["arms"]]
    sleep_cycles = int(sleep_cycles_per_us() * SLEEP_BEFORE_REPLAY_US) if cuda else 0
    rows = []
    for hidden in cfg["hiddens"]:
        for tokens in cfg["tokens"]:
            if "rocenante_fused" in cfg["arms"]:
                check_fused(ctx, tokens, hidden, dtype)
            live = []
            for arm in arms:
                arm.hidden = hidden
                x, y = arm.prepare(tokens * hidden, dtype)  # graphs keep the arm's tensors
                live.append(Measurement(arm, x, y, mode, cfg["ops"], sleep_cycles))
            samples = {m.arm.name: [] for m in live}
            for rep in range(cfg["rounds"]):
                for m in live[rep % len(live):] + live[: rep % len(live)]:
                    dist.barrier(group=control)
                    samples[m.arm.name].append(m.run())
            gathered = [None] * world
            dist.all_gather_object(gathered, samples, group=control)
            for m in live:
                per_round = [max(g[m.arm.name][i] for g in gathered) for i in range(cfg["rounds"])]
                rows.append({"arm": m.arm.name, "mode": mode, "dtype": cfg["dtype"],
                             "bytes": tokens * hidden * torch.empty((), dtype=dtype).element_size(),
                             "count": tokens * hidden, "tokens": tokens, "hidden": hidden,
                             "median_us": statistics.median(per_round), "p10_us": percentile(per_round, 0.1),
                             "p90_us": percentile(per_round, 0.9), "ops_per_measurement": cfg["ops"],
                             "measurements": len(per_round)})
            for m in live:
                m.close()
            del live
            if cuda:
                torch.cuda.synchronize()
            if rank == 0:
                print(f"  tokens {tokens:>3} hidden {hidden}: " + ", ".join(
                    f"{r['arm']} {r['median_us']:.2f}" for r in rows[-len(arms):]) + " us", flush=True)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier(group=control)  # no rank frees what a peer may still be writing into
    workspace.destroy()
    dist.destroy_process_group()
    return rows


def summarize(rows):
    """Per (hidden, tokens): the most fusing could gain, torch_add_rmsnorm / rocenante_allreduce_rmsnorm, and
    the gain the fused kernel measured, 1 - rocenante_fused / rocenante_allreduce_rmsnorm."""
    by = {(r["hidden"], r["tokens"], r["arm"]): r["median_us"] for r in rows}
    out = []
    for hidden, tokens in sorted({(r["hidden"], r["tokens"]) for r in rows}):
        unfused = by.get((hidden, tokens, "rocenante_allreduce_rmsnorm"))
        ops = by.get((hidden, tokens, "torch_add_rmsnorm"))
        fused = by.get((hidden, tokens, "rocenante_fused"))
        if unfused:
            out.append({"hidden": hidden, "tokens": tokens, "unfused_us": unfused, "torch_ops_us": ops,
                        "allreduce_us": by.get((hidden, tokens, "rocenante_allreduce")), "fused_us": fused,
                        "max_fusion_gain": ops / unfused if ops else None,
                        "fusion_gain": 1 - fused / unfused if fused else None})
    return out


def main(argv=None) -> int:
    from rocenante.bench import provenance, report
    from rocenante.bench.runner import run_spawned

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--ranks", type=int, default=None, help="processes (default: every GPU)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: eager calls on CPU processes, a smoke test of this script (not a measurement)")
    p.add_argument("--out", default="benchmarks/results/fusion.json")
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--ops", type=int, default=50, help="calls per CUDA graph")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--hiddens", default=",".join(map(str, HIDDENS)))
    p.add_argument("--arms", default="rocenante_allreduce,rocenante_allreduce_rmsnorm,rocenante_fused,"
                                      "torch_add_rmsnorm,nccl_allreduce_rmsnorm")
    a = p.parse_args(argv)
    world = a.ranks or (torch.cuda.device_count() if a.device == "cuda" else 2)
    if world < 2 or (a.device == "cuda" and world > torch.cuda.device_count()):
        p.error(f"needs 2..{torch.cuda.device_count()} ranks, one GPU each")
    cfg = {"device": a.device, "rounds": a.rounds, "ops": a.ops, "dtype": a.dtype, "arms": a.arms.split(","),
           "tokens": [int(t) for t in a.tokens.split(",")], "hiddens": [int(h) for h in a.hiddens.split(",")]}
    load_before = os.getloadavg()
    results = run_spawned(worker, world, cfg, timeout=1800)
    failed = {r: v["error"] for r, v in results.items() if isinstance(v, dict)}
    if failed:
        for r, err in sorted(failed.items()):
            print(f"rank {r} failed:\n{err}", file=sys.stderr)
        return 1
    result = {"schema": report.SCHEMA, "provenance": provenance.collect(a.device, METHOD, load_before), "world_size": world,
              "config": cfg, "rows": results[0], "summary": summarize(results[0])}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    report.write_json(result, a.out)
    nan = float("nan")
    print(f"\n{'hidden':>6} {'tokens':>6} {'allreduce':>10} {'unfused':>9} {'fused':>9} {'torch ops':>10} "
          f"{'max gain':>9} {'gain':>7}")
    for s in result["summary"]:
        print(f"{s['hidden']:>6} {s['tokens']:>6} {s['allreduce_us'] or nan:>10.2f} {s['unfused_us']:>9.2f} "
              f"{s['fused_us'] or nan:>9.2f} {s['torch_ops_us'] or nan:>10.2f} {s['max_fusion_gain'] or nan:>8.1%} "
              f"{s['fusion_gain'] if s['fusion_gain'] is not None else nan:>6.1%}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
