"""Benchmark output: nccl-tests-style tables, the JSON every result shares (schema rocenante.bench/1), and a PNG."""

from __future__ import annotations

import json

SCHEMA = "rocenante.bench/1"


def bus_bandwidth(algbw: float, world: int, collective: str = "all_reduce") -> float:
    """nccl-tests' bus bandwidth: what each link carries in a bandwidth-optimal ring (all-reduce), or the part of
    the data that leaves each rank (all-to-all)."""
    return algbw * (2 if collective == "all_reduce" else 1) * (world - 1) / world


def _table_keys(rows):
    return sorted({(r["dtype"], r["mode"]) for r in rows})


def format_tables(result: dict) -> str:
    rows, world = result["rows"], result["world_size"]
    collective = result["config"].get("collective", "all_reduce")
    redop = "sum" if collective == "all_reduce" else "none"
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    lines = []
    for dtype, mode in _table_keys(rows):
        sel = {(r["bytes"], r["arm"]): r for r in rows if r["dtype"] == dtype and r["mode"] == mode}
        sizes = sorted({b for b, _ in sel})
        present = [a for a in arms if any((b, a) in sel for b in sizes)]
        lines.append(f"# {collective} {'sum, ' if redop == 'sum' else ''}{dtype}, {mode} mode, {world} ranks; "
                     "time = median us per op (slowest rank)")
        head = f"{'size(B)':>12} {'count':>11} {'type':>9} {'redop':>6}"
        for a in present:
            head += f" | {a[:18]:>18} {'algbw':>7} {'busbw':>7}"
        lines.append(head)
        for b in sizes:
            any_row = next(sel[(b, a)] for a in present if (b, a) in sel)
            line = f"{b:>12} {any_row['count']:>11} {dtype:>9} {redop:>6}"
            for a in present:
                r = sel.get((b, a))
                if r is None:
                    line += f" | {'-':>18} {'-':>7} {'-':>7}"
                    continue
                algbw = b / r["median_us"] / 1e3  # GB/s
                line += f" | {r['median_us']:>18.2f} {algbw:>7.2f} {bus_bandwidth(algbw, world, collective):>7.2f}"
            lines.append(line)
        lines.append("")
    return "\n".join(lines)


def write_json(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


def plot(result: dict, path: str) -> None:
    """Latency against size for every arm, and speedup over the reference arm (nccl, or gloo on CPU)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    keys = _table_keys(rows)
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    base = "nccl" if "nccl" in arms else "gloo"
    fig, axes = plt.subplots(2, len(keys), figsize=(5 * len(keys), 8), squeeze=False)
    for col, (dtype, mode) in enumerate(keys):
        sel = [r for r in rows if r["dtype"] == dtype and r["mode"] == mode]
        ref = {r["bytes"]: r["median_us"] for r in sel if r["arm"] == base}
        for arm in arms:
            pts = sorted((r["bytes"], r["median_us"]) for r in sel if r["arm"] == arm)
            if not pts:
                continue
            xs, ys = zip(*pts)
            axes[0][col].plot(xs, ys, marker="o", ms=3, label=arm)
            sp = [(b, ref[b] / t) for b, t in pts if b in ref]
            if sp and arm != base:
                axes[1][col].plot(*zip(*sp), marker="o", ms=3, label=arm)
        axes[0][col].set(xscale="log", yscale="log", title=f"{dtype}, {mode}", xlabel="bytes", ylabel="us per op")
        axes[1][col].axhline(1.0, color="gray", lw=0.8)
        axes[1][col].set(xscale="log", xlabel="bytes", ylabel=f"speedup over {base}")
        for ax in axes[:, col]:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    prov = result["provenance"]
    fig.suptitle(f"{result['config'].get('collective', 'all_reduce')}, {result['world_size']} ranks, {prov.get('gpu') or prov.get('cpu')}; "
                 f"rocenante {prov['git_revision'][:12]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
