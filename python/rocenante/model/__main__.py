"""python -m rocenante.model [--calibration FILE] [--out PREFIX]: tables of the scaling model; with --out, also
PREFIX.json (schema rocenante.model/1) and PREFIX.png (when matplotlib is installed)."""

from __future__ import annotations

import argparse
import json
import subprocess

from . import allreduce, decode, published

SCHEMA = "rocenante.model/1"
NODES = (2, 4, 8)
SIZES = [2**k for k in range(10, 25)]  # 1 KiB .. 16 MiB


def _revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _bytes(x):
    return None if x is None else round(x)


def _latencies(arms) -> list[dict]:
    """Each arm's modelled time in us, {name: (algorithm, profile)}, for every node count and size."""
    return [{"nodes": n, "bytes": s, **{a: round(f(p, n, s) * 1e6, 2) for a, (f, p) in arms.items()}}
            for n in NODES for s in SIZES]


def build(profiles) -> dict:
    fixed, per_token = decode.fit(profiles=profiles)
    roce = profiles["dgx-spark-roce"]
    arms = {name: (algo, roce) for name, algo in allreduce.ALGORITHMS.items()}
    arms["nccl (ring fit)"] = (allreduce.ring, profiles["dgx-spark-nccl"])
    shard_arms = {name: (algo, roce) for name, algo in allreduce.SHARD_ALGORITHMS.items()}
    shard_arms["nccl (ring fit)"] = (allreduce.shard_ring, profiles["dgx-spark-nccl"])
    a2a_arms = {name: (algo, roce) for name, algo in allreduce.ALL_TO_ALL_ALGORITHMS.items()}
    a2a_arms["nccl (one step, ring fit)"] = (allreduce.shard_one_shot, profiles["dgx-spark-nccl"])
    base = published.DECODE_ROWS[0][3]
    check = decode.check(fixed, per_token, profiles)
    return {
        "schema": SCHEMA,
        "note": "a model, not a measurement: nothing here ran on several nodes",
        "revision": _revision(),
        "profiles": {p.name: {"alpha_us": p.alpha_s * 1e6, "bandwidth_GBps": p.bandwidth_Bps / 1e9,
                              "overhead_us": p.overhead_s * 1e6, "source": p.source} for p in profiles.values()},
        "latency_us": _latencies(arms),
        "all_gather_reduce_scatter_latency_us": _latencies(shard_arms),
        "all_to_all_latency_us": _latencies(a2a_arms),
        "rails_latency_us": _latencies({f"one-shot {k} rail{'s' if k > 1 else ''}": (allreduce.one_shot,
                                                                                   allreduce.rails(roce, k))
                                        for k in (1, 2)}),
        "crossover_bytes": [{"nodes": n, **{f"one-shot/{b}": _bytes(allreduce.crossover(roce, n, allreduce.one_shot,
                                                                                           allreduce.ALGORITHMS[b]))
                                            for b in ("two-shot", "ring")}} for n in NODES],
        "decode": {
            "model": {"layers": decode.LAYERS, "hidden": decode.HIDDEN, "message_bytes": decode.MESSAGE_BYTES,
                      "weight_bytes": decode.WEIGHT_BYTES, "source": "Qwen3.5-27B sizes, NVFP4 at 4.5 bits"},
            "fitted": {"fixed_ms": fixed * 1e3, "per_token_ms": per_token * 1e3,
                       "on": [f"{n} nodes {t} {a}" for n, t, a, *_ in decode.FIT_ROWS]},
            "memory_floor_per_token_ms": decode.WEIGHT_BYTES / decode.MEMORY_BPS * 1e3,
            "baseline": f"2-node row, {base} tok/s (52.58 / 11.86 = 4.43, the published one-shot scaling)",
            "check": check,
            "largest_heldout_error_pct": max((abs(r["error_pct"]) for r in check if not r["fitted"])),
            "predicted_tok_s": [{"nodes": n, **{arm: 1 / decode.step_s(fixed, per_token, arm, n, profiles)
                                                for arm in decode.ARMS}} for n in range(1, 9)],
        },
    }


def format_tables(r: dict) -> str:
    d = r["decode"]
    lines = [f"# {r['note']}"]
    for name, p in r["profiles"].items():
        lines.append(f"profile {name}: alpha {p['alpha_us']:.2f} us, bandwidth {p['bandwidth_GBps']:.2f} GB/s, "
                     f"overhead {p['overhead_us']:.2f} us ({p['source']})")
    for title, key in (("all-reduce", "latency_us"),
                       ("all-gather (bytes: the output) or reduce-scatter (the input)",
                        "all_gather_reduce_scatter_latency_us"),
                       ("all-to-all (bytes: each rank's input)", "all_to_all_latency_us")):
        arms = [k for k in r[key][0] if k not in ("nodes", "bytes")]
        lines.append(f"\n{title}\n{'nodes':>5} {'bytes':>9} " + " ".join(f"{a:>15}" for a in arms) + "   (us)")
        for row in r[key]:
            lines.append(f"{row['nodes']:>5} {row['bytes']:>9} " + " ".join(f"{row[a]:>15.1f}" for a in arms))
    lines.append("\nall-reduce one-shot over one rail or striped over a cable's two (modelled: "
                 "python/rocenante/model/allreduce.py, Rails)")
    lines.append(f"{'nodes':>5} {'bytes':>9} {'1 rail':>10} {'2 rails':>10} {'speed-up':>9}   (us)")
    for row in r["rails_latency_us"]:
        one, two = row["one-shot 1 rail"], row["one-shot 2 rails"]
        lines.append(f"{row['nodes']:>5} {row['bytes']:>9} {one:>10.1f} {two:>10.1f} {one / two:>9.2f}")
    lines.append("\ncrossover (bytes above which the other is faster, dgx-spark-roce):")
    for c in r["crossover_bytes"]:
        kib = {k: "never" if v is None else f"{v / 1024:.0f} KiB" for k, v in c.items() if k != "nodes"}
        lines.append(f"  {c['nodes']} nodes: " + ", ".join(f"{k} {v}" for k, v in kib.items()))
    f = d["fitted"]
    lines.append(f"\ndecode: fitted fixed {f['fixed_ms']:.2f} ms, per_token {f['per_token_ms']:.2f} ms on {f['on']};"
                 f" memory floor {d['memory_floor_per_token_ms']:.2f} ms")
    lines.append(f"{'nodes':>5} {'topology':>14} {'all-reduce':>10} {'published':>9} {'predicted':>9} {'error%':>7}")
    for c in d["check"]:
        lines.append(f"{c['nodes']:>5} {c['topology']:>14} {c['all_reduce']:>10} {c['published_tok_s']:>9.2f} "
                     f"{c['predicted_tok_s']:>9.2f} {c['error_pct']:>7.1f}" + ("  (fitted)" if c["fitted"] else ""))
    lines.append(f"largest held-out error: {d['largest_heldout_error_pct']}%")
    lines.append("predicted tok/s: " + ", ".join(f"{p['nodes']}: {p['one-shot']:.1f}/{p['nccl']:.1f}"
                                                 for p in d["predicted_tok_s"]) + " (one-shot/nccl)")
    return "\n".join(lines)


def write_png(r: dict, path: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    arms = [k for k in r["latency_us"][0] if k not in ("nodes", "bytes")]
    for n, color in zip(NODES, ("C0", "C1", "C2")):
        rows = [x for x in r["latency_us"] if x["nodes"] == n]
        for a, style in zip(arms, ("-", "--", ":", "-.")):
            ax1.plot([x["bytes"] for x in rows], [x[a] for x in rows], style, color=color, label=f"{n} nodes {a}")
    ax1.set(xscale="log", yscale="log", xlabel="bytes", ylabel="µs", title="All-reduce latency (model)")
    ax1.legend(fontsize=7)
    d = r["decode"]
    base = published.DECODE_ROWS[0][3]
    pred = d["predicted_tok_s"]
    for arm, color in (("one-shot", "C0"), ("nccl", "C3")):
        ax2.plot([p["nodes"] for p in pred], [p[arm] / base for p in pred], "-", color=color, label=f"model {arm}")
        pts = [c for c in d["check"] if c["all_reduce"] == arm]
        ax2.plot([c["nodes"] for c in pts], [c["published_tok_s"] / base for c in pts], "o", color=color,
                 label=f"published {arm}")
    ax2.set(xlabel="nodes", ylabel=f"decode speed-up over the 2-node row ({base} tok/s)",
            title="Decode scaling: model (lines) vs published (dots)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rocenante.model", description=__doc__)
    ap.add_argument("--calibration", help="calibration JSON replacing the profile of the same name")
    ap.add_argument("--out", help="write OUT.json and OUT.png")
    args = ap.parse_args(argv)
    profiles = dict(allreduce.PROFILES)
    if args.calibration:
        p = allreduce.load_calibration(args.calibration)
        profiles[p.name] = p
    r = build(profiles)
    print(format_tables(r))
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(r, f, indent=1)
        if not write_png(r, args.out + ".png"):
            print("matplotlib not installed: no PNG")


if __name__ == "__main__":
    main()
