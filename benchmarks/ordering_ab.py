"""Combines the alternated runs of benchmarks/ordering_ab.sh into one rocenante.bench/1 JSON: one row per variant
and size (median, p10 and p90 over the runs' medians) and, per size, the paired deltas of "ordered" against
each other variant."""

from __future__ import annotations

import argparse
import json
import re
import statistics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("runs", nargs="+", help="ab-<variant>-<i>.json files")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    runs: dict = {}  # (variant, i) -> {bytes: median_us}
    first = None
    for path in a.runs:
        variant, i = re.search(r"ab-(\w+)-(\d+)\.json$", path).groups()
        with open(path) as f:
            data = json.load(f)
        first = first or data
        runs[(variant, int(i))] = {r["bytes"]: r["median_us"] for r in data["rows"] if r["arm"] == "rocenante"}
    sizes = sorted({b for per in runs.values() for b in per})
    rounds = sorted({i for _, i in runs})
    variants = sorted({v for v, _ in runs}, key=lambda v: (v != "ordered", v))
    rows, ab = [], []
    for nbytes in sizes:
        for variant in variants:
            values = sorted(runs[(variant, i)][nbytes] for i in rounds)
            rows.append({"arm": f"rocenante_{variant}", "mode": "graph", "dtype": "bfloat16", "bytes": nbytes,
                         "median_us": statistics.median(values), "p10_us": values[0], "p90_us": values[-1],
                         "runs_us": values})
        for other in variants[1:]:
            deltas = [runs[("ordered", i)][nbytes] - runs[(other, i)][nbytes] for i in rounds]
            ab.append({"bytes": nbytes, "against": other, "median_delta_us": statistics.median(deltas),
                       "min_delta_us": min(deltas), "max_delta_us": max(deltas), "deltas_us": deltas})
    result = {
        "schema": first["schema"],
        "provenance": {**first["provenance"], "method": "benchmarks/ordering_ab.sh: builds of one tree, 'relaxed' "
                       "with every .acquire/.release of csrc/device/wire.cuh made .relaxed ('baseline': another "
                       f"tree, see the note); runs alternated {len(rounds)} times; p10/p90 here are the min/max "
                       "of the runs' medians",
                       "bench_method": first["provenance"].get("method")},  # each run's, as the bench recorded it
        "world_size": first["world_size"],
        "rows": rows,
        "ordering_ab": ab,
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in ab:
        print(f"{r['bytes']:>8} B: ordered - {r['against']} = {r['median_delta_us']:+.3f} us "
              f"(min {r['min_delta_us']:+.3f}, max {r['max_delta_us']:+.3f})")


if __name__ == "__main__":
    main()
