#!/usr/bin/env bash
# A/B of the kernel's memory ordering on a GPU machine (benchmarks/ab.sh): the product (acquire/release for the
# epoch at GPU scope, for the fault record and abort words at system scope) against the same tree with every such
# access relaxed, bf16, CUDA graph, 1 KiB, 32 KiB, 1 MiB. With BASELINE_SRC set to another source tree (e.g. an
# earlier release, `git archive`d), it is a third variant.
#   benchmarks/ordering_ab.sh OUTDIR [alternations, default 5]    ->  OUTDIR/ab.json
set -euo pipefail
out=${1:?usage: ordering_ab.sh OUTDIR [alternations]}
relaxed_src=$(mktemp -d)
cp -r CMakeLists.txt pyproject.toml README.md LICENSE csrc python "$relaxed_src"
sed -i -E 's/\.(acquire|release)\.(gpu|sys)/.relaxed.\2/g' "$relaxed_src/csrc/device/memory_order.cuh"
grep -q -E '\.(acquire|release)\.' "$relaxed_src/csrc/device/memory_order.cuh" && { echo "sed left an ordered access" >&2; exit 1; }
AB_BENCH_ARGS="--arms rocenante --modes graph --dtypes bfloat16 --min-bytes 1K --max-bytes 1M --size-factor 32 --rounds 15" \
AB_METHOD="'relaxed': every .acquire/.release of csrc/device/memory_order.cuh made .relaxed${BASELINE_SRC:+; 'baseline': another tree}" \
  exec "$(dirname "$0")/ab.sh" "$out" "${2:-5}" ordered=. relaxed="$relaxed_src" ${BASELINE_SRC:+baseline="$BASELINE_SRC"}
