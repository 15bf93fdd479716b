"""Combines the alternated runs of benchmarks/ab.sh into one rocenante.bench/1 JSON: one row per variant, arm,
dtype and size (median, p10 and p90 over the runs' medians) and, per size, the paired deltas (same alternation)
of the first variant named against each other one."""

from __future__ import annotations

import argparse
import json
import re
import statistics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("runs", nargs="+", help="ab-<variant>-<i>.json files, the first variant's first")
    p.add_argument("--method", required=True, help="what the variants are, for the provenance")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    runs: dict = {}  # (variant, i) -> {(arm, mode, dtype, bytes): median_us}
    variants: list = []
    first = None
    for path in a.runs:
        variant, i = re.search(r"ab-(\w+)-(\d+)\.json$", path).groups()
        with open(path) as f:
            data = json.load(f)
        first = first or data
        if variant not in variants:
            variants.append(variant)
        runs[(variant, int(i))] = {(r["arm"], r["mode"], r["dtype"], r["bytes"]): r["median_us"] for r in data["rows"]}
    keys = sorted({k for per in runs.values() for k in per})
    rounds = sorted({i for _, i in runs})
    rows, ab = [], []
    for key in keys:
        arm, mode, dtype, nbytes = key
        for variant in variants:
            values = sorted(runs[(variant, i)][key] for i in rounds)
            rows.append({"arm": f"{arm}_{variant}", "mode": mode, "dtype": dtype, "bytes": nbytes,
                         "median_us": statistics.median(values), "p10_us": values[0], "p90_us": values[-1],
                         "runs_us": values})
        for other in variants[1:]:
            deltas = [runs[(variants[0], i)][key] - runs[(other, i)][key] for i in rounds]
            ab.append({"arm": arm, "mode": mode, "dtype": dtype, "bytes": nbytes, "variant": variants[0],
                       "against": other, "median_delta_us": statistics.median(deltas),
                       "min_delta_us": min(deltas), "max_delta_us": max(deltas), "deltas_us": deltas})
    result = {
        "schema": first["schema"],
        "provenance": {**first["provenance"], "method": f"benchmarks/ab.sh ({a.method}): one build per variant, "
                       f"runs alternated {len(rounds)} times, in an order rotated every round; "
                       "p10/p90 here are the min/max of the runs' medians",
                       "bench_method": first["provenance"].get("method")},  # each run's, as the bench recorded it
        "world_size": first["world_size"],
        "rows": rows,
        "ab": ab,
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in ab:
        print(f"{r['arm']} {r['dtype']} {r['bytes']:>9} B: {r['variant']} - {r['against']} = "
              f"{r['median_delta_us']:+.3f} us (min {r['min_delta_us']:+.3f}, max {r['max_delta_us']:+.3f})")


if __name__ == "__main__":
    main()
