#!/usr/bin/env bash
# Build, run the GPU tests and the benchmark on a machine with CUDA GPUs, in one go (one device lease).
#   benchmarks/gpu_machine.sh OUTDIR [tests|bench|fusion|breakdown|all] [extra benchmark arguments...]
# Writes OUTDIR/gpu-tests.log, OUTDIR/gpu-tests.xml (junit), OUTDIR/test-figures.jsonl (detection times, soak
# and leak figures), OUTDIR/bench.json, OUTDIR/bench.png, OUTDIR/bench.log, OUTDIR/fusion.json and
# OUTDIR/fusion.log (benchmarks/fusion_bench.py); breakdown (not part of all): a second, timeline build
# (csrc/timeline.h) in /tmp/rocenante-timeline and OUTDIR/breakdown.{json,log} (benchmarks/net_breakdown.py). ROCENANTE_PYTEST_ARGS adds pytest arguments, split at spaces
# (e.g. '-k (gpu_soak)or(gpu_hostile)' for tests/test_gpu_{soak,hostile}.py alone).
# The log shows what passed tests printed (-rP): the soak's count and time, the leak probes' values.
# On 2 x H200 the whole suite takes about 10 minutes (at 4adb2a6: 585 s without the network-path tests, which
# take about 100 s more), more than one 600 s device call: split it with ROCENANTE_PYTEST_ARGS, e.g.
# '-k not((gpu_soak)or(test_gpu_net))' and then '-k (gpu_soak)or(test_gpu_net)'.
set -uo pipefail
out=${1:?usage: gpu_machine.sh OUTDIR [tests|bench|fusion|all] [bench args...]}
what=${2:-all}
shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p "$out"
# NVLink multicast stays off everywhere (NCCL NVLS, torch SymmetricMemory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# The GPU tests run compute-sanitizer: here a missing one fails the run instead of skipping those tests.
for bin in /usr/local/cuda/bin /usr/local/cuda-*/bin; do [[ -d $bin ]] && PATH=$PATH:$bin; done
command -v compute-sanitizer > /dev/null || { echo "compute-sanitizer not found" >&2; exit 1; }
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpus.txt"
nvidia-smi topo -m >> "$out/gpus.txt" 2>&1
arch=${CMAKE_CUDA_ARCHITECTURES:-90}
python3 -m pip install --no-build-isolation --no-deps -q . -Ccmake.define.CMAKE_CUDA_ARCHITECTURES="$arch" \
  > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
status=0
if [[ $what == tests || $what == all ]]; then
  (cd /tmp && ROCENANTE_TEST_FIGURES="$out/test-figures.jsonl" python3 -m pytest -v -rsP -m gpu "$OLDPWD/tests" \
     --junitxml="$out/gpu-tests.xml" ${ROCENANTE_PYTEST_ARGS:-}) 2>&1 | tee "$out/gpu-tests.log" | tail -25
  status=${PIPESTATUS[0]}
fi
if [[ $what == bench || $what == all ]]; then
  (cd /tmp && python3 -m rocenante.bench --out "$out/bench.json" "$@") 2>&1 | tee "$out/bench.log" | tail -60
  status=$(( status || PIPESTATUS[0] ))
fi
if [[ $what == fusion || $what == all ]]; then
  (cd /tmp && python3 "$OLDPWD/benchmarks/fusion_bench.py" --out "$out/fusion.json") 2>&1 | tee "$out/fusion.log" | tail -20
  status=$(( status || PIPESTATUS[0] ))
fi
if [[ $what == breakdown ]]; then
  python3 -m pip install --no-build-isolation --no-deps -q --target /tmp/rocenante-timeline . \
    -Ccmake.define.CMAKE_CUDA_ARCHITECTURES="$arch" -Ccmake.define.ROCENANTE_TIMELINE=ON -Cbuild-dir=/tmp/build-timeline \
    > "$out/build-timeline.log" 2>&1 || { tail -40 "$out/build-timeline.log"; exit 1; }
  (cd /tmp && PYTHONPATH=/tmp/rocenante-timeline python3 "$OLDPWD/benchmarks/net_breakdown.py" --out "$out/breakdown.json") \
    2>&1 | tee "$out/breakdown.log" | tail -20
  status=$(( status || PIPESTATUS[0] ))
fi
exit $status
