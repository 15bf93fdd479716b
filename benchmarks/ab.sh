#!/usr/bin/env bash
# A/B of source trees on a GPU machine: each tree is built into its own directory (in parallel), then
# `python -m rocenante.bench` runs each build in turn, the turns alternated ROUNDS times in an order rotated by one
# variant every round, so that drift of the machine, and whatever favours the first or last run of a round,
# spreads over every variant alike; benchmarks/ab.py combines the runs into one rocenante.bench/1 JSON
# with the paired deltas of the first variant against each other.
#   benchmarks/ab.sh OUTDIR ROUNDS NAME=SOURCE_DIR [NAME=SOURCE_DIR ...]   ->  OUTDIR/ab.json
# AB_BENCH_ARGS replaces the benchmark's arguments (default: rocenante alone, bf16, CUDA graphs, 1 KiB-4 MiB in
# steps of 4, 15 rounds); AB_METHOD says in the JSON what the variants are.
set -euo pipefail
out=${1:?usage: ab.sh OUTDIR ROUNDS NAME=SOURCE_DIR...}
rounds=${2:?usage: ab.sh OUTDIR ROUNDS NAME=SOURCE_DIR...}
shift 2
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bench_args=${AB_BENCH_ARGS:---arms rocenante --modes graph --dtypes bfloat16 --min-bytes 1K --max-bytes 4M --size-factor 4 --rounds 15}
names=()
for variant in "$@"; do
  name=${variant%%=*} src=${variant#*=}
  [[ $name =~ ^[a-z0-9]+$ ]] || { echo "variant name '$name': lower-case letters and digits only" >&2; exit 1; }
  names+=("$name")
  python3 -m pip install --no-build-isolation --no-deps -q --target "/tmp/ab-$name" "$src" \
    -Ccmake.define.CMAKE_CUDA_ARCHITECTURES="${CMAKE_CUDA_ARCHITECTURES:-90}" -Cbuild-dir="/tmp/ab-$name.build" \
    > "$out/build-$name.log" 2>&1 &
done
for name in "${names[@]}"; do
  wait -n || { tail -30 "$out"/build-*.log; exit 1; }
done
for i in $(seq "$rounds"); do
  for k in "${!names[@]}"; do
    name=${names[$(( (k + i) % ${#names[@]} ))]}  # each round starts one variant later: no variant always first
    # shellcheck disable=SC2086  # the arguments are words
    PYTHONPATH="/tmp/ab-$name" python3 -m rocenante.bench $bench_args --no-png --out "$out/ab-$name-$i.json" \
      > "$out/ab-$name-$i.log" 2>&1 || { tail -30 "$out/ab-$name-$i.log"; exit 1; }
  done
done
runs=()
for name in "${names[@]}"; do runs+=("$out"/ab-"$name"-*.json); done
python3 "$(dirname "$0")/ab.py" "${runs[@]}" --method "${AB_METHOD:-variants: ${names[*]}}" --out "$out/ab.json"
