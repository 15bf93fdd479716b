#!/usr/bin/env bash
# A/B of the kernel's memory ordering on a GPU machine: the product (acquire/release for the epoch at GPU scope,
# for the fault record and abort words at system scope) against the same tree with every such access relaxed,
# built side by side and benchmarked in alternation (bf16, CUDA graph, 1 KiB, 32 KiB, 1 MiB). With
# BASELINE_SRC set to another source tree (e.g. an earlier release, `git archive`d), it is a third variant.
#   benchmarks/ordering_ab.sh OUTDIR [alternations, default 5]    ->  OUTDIR/ordering-ab.json
set -euo pipefail
out=${1:?usage: ordering_ab.sh OUTDIR [alternations]}
rounds=${2:-5}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
build() {  # build SOURCE_DIR TARGET_DIR
  python3 -m pip install --no-build-isolation --no-deps -q --target "$2" "$1" \
    -Ccmake.define.CMAKE_CUDA_ARCHITECTURES="${CMAKE_CUDA_ARCHITECTURES:-90}" -Cbuild-dir="$2.build" > "$2.log" 2>&1 \
    || { tail -30 "$2.log"; exit 1; }
}
relaxed_src=$(mktemp -d)
cp -r CMakeLists.txt pyproject.toml README.md LICENSE csrc python "$relaxed_src"
sed -i -E 's/\.(acquire|release)\.(gpu|sys)/.relaxed.\2/g' "$relaxed_src/csrc/device/wire.cuh"
grep -q -E '\.(acquire|release)\.' "$relaxed_src/csrc/device/wire.cuh" && { echo "sed left an ordered access" >&2; exit 1; }
variants="ordered relaxed"
build . /tmp/ab-ordered
build "$relaxed_src" /tmp/ab-relaxed
if [[ -n ${BASELINE_SRC:-} ]]; then
  build "$BASELINE_SRC" /tmp/ab-baseline
  variants="$variants baseline"
fi
for i in $(seq "$rounds"); do
  for variant in $variants; do
    PYTHONPATH=/tmp/ab-$variant python3 -m rocenante.bench --arms rocenante --modes graph --dtypes bfloat16 \
      --min-bytes 1K --max-bytes 1M --size-factor 32 --rounds 15 --no-png --out "$out/ab-$variant-$i.json" \
      > "$out/ab-$variant-$i.log" 2>&1 || { tail -30 "$out/ab-$variant-$i.log"; exit 1; }
  done
done
python3 "$(dirname "$0")/ordering_ab.py" "$out"/ab-*-*.json --out "$out/ordering-ab.json"
