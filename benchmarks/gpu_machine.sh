#!/usr/bin/env bash
# Build, run the GPU tests and the benchmark on a machine with CUDA GPUs, in one go (one device lease).
#   benchmarks/gpu_machine.sh OUTDIR [tests [PART]|bench|fusion|breakdown [EARLIER_TREE [LABEL]]|all] [bench args...]
#   benchmarks/gpu_machine.sh OUTDIR stress [SECONDS]
# Writes OUTDIR/gpu-tests.log, OUTDIR/gpu-tests.xml (junit; gpu-tests-PART.* for a part), OUTDIR/test-figures.jsonl
# (detection times, soak and leak figures; every part appends), OUTDIR/bench.json, OUTDIR/bench.png,
# OUTDIR/bench.log, OUTDIR/fusion.json and OUTDIR/fusion.log (benchmarks/fusion_bench.py); breakdown [EARLIER_TREE
# [LABEL]] (not part of all): timeline builds (csrc/timeline.h) of this tree and of an earlier one, in /tmp, and
# OUTDIR/breakdown.{json,log} (benchmarks/net_breakdown.py). ROCENANTE_PYTEST_ARGS adds pytest arguments, split
# at spaces (e.g. '-k memcheck'; a -k there replaces a part's). The log shows what passed tests printed (-rP):
# the soak's count and time, the leak probes' values.
# The GPU tests (pytest -m gpu: tests/gpu) run on whatever GPUs there are: with fewer GPUs than a test's ranks,
# ranks share a GPU (a call then takes milliseconds, and tests make fewer calls) and tests that need a GPU per rank
# are skipped, saying so. The whole suite takes longer than one 600 s device call; `tests PART` runs a part of it.
# Estimates on one H200, ranks sharing it, from what ran there (a fresh machine's build: 52-71 s; back-to-back
# calls of 16 KiB: 2.3 ms x (world - 1); a test of the direct path 4-15 s at worlds 2-8, the every-dtype test
# 12-15 s, fault tests 6-11 s, a backend test 6-14 s), build included:
#   allreduce-direct  tests/gpu/test_gpu_allreduce.py on the direct path, worlds 2, 3, 4, 8     about 220 s
#   allreduce-tcp     the same over the TCP wire                                                about 230 s
#   sanitizer         compute-sanitizer memcheck, initcheck, synccheck (not yet timed there)    about 300 s
#   faults            tests/gpu/test_gpu_faults.py and test_gpu_hostile.py                      about 150 s
#   collectives       tests/gpu/test_gpu_collectives.py (all-gather, reduce-scatter, two-shot)  not yet timed
#   rest              every other file of tests/gpu (backend, plugins, soak, bench, ...)        about 220 s
# On 2 x H200 the suite before worlds 3-8 took about 10 minutes (4adb2a6: 585 s, and about 100 s more for the
# network-path tests): there too, run it in parts.
# ROCENANTE_PREBUILT=DIR skips the build and imports rocenante from DIR, a `pip install --target DIR` of this tree
# made elsewhere for that machine's Python (a device lease then spends no minute building; tests/README.md).
# stress: test_calls_on_two_streams_execute_in_issue_order[tcp-False] (ranks sharing a GPU: 30-40 s a run that
# passes, about 130 s one that times out) again and again until SECONDS (default 450) have passed; OUTDIR/stress.log
# has a line a run, the tail of each failed run's output, and the count. On a lent device machine, build once per
# warm machine into a folder outside the checkout (`pip install --target /tmp/site .`, about 50 s) and point
# ROCENANTE_PREBUILT there in every call: /tmp stays while the machine is warm, while an ignored folder inside the
# checkout was emptied of its files between two calls (2026-12-02).
set -uo pipefail
out=${1:?usage: gpu_machine.sh OUTDIR [tests [PART]|bench|fusion|breakdown [EARLIER_TREE [LABEL]]|all] [bench args...]}
what=${2:-all}
shift $(( $# >= 2 ? 2 : 1 ))
repo=$PWD
gpu=$repo/tests/gpu
part= suffix=
if [[ $what == tests && $# -ge 1 ]]; then part=$1 suffix=-$1; shift; fi
if [[ $what == stress ]]; then part=stress; fi
case $part in
  "") selection=("$repo/tests") ;;
  allreduce-direct) selection=("$gpu/test_gpu_allreduce.py" -k "not tcp and not sanitizer") ;;
  allreduce-tcp) selection=("$gpu/test_gpu_allreduce.py" -k "tcp and not sanitizer") ;;
  sanitizer) selection=("$gpu/test_gpu_allreduce.py" -k sanitizer) ;;
  faults) selection=("$gpu/test_gpu_faults.py" "$gpu/test_gpu_hostile.py") ;;
  collectives) selection=("$gpu/test_gpu_collectives.py") ;;
  rest) selection=("$gpu" --ignore="$gpu/test_gpu_allreduce.py" --ignore="$gpu/test_gpu_faults.py"
                   --ignore="$gpu/test_gpu_hostile.py" --ignore="$gpu/test_gpu_collectives.py") ;;
  stress) selection=("$gpu/test_gpu_faults.py" -k "two_streams and tcp") ;;
  *) echo "unknown part '$part': allreduce-direct, allreduce-tcp, sanitizer, faults, collectives or rest" >&2; exit 2 ;;
esac
mkdir -p "$out" && out=$(cd "$out" && pwd)  # the tests run in /tmp
# NVLink multicast stays off everywhere (NCCL NVLS, torch SymmetricMemory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# The GPU tests run compute-sanitizer: here a missing one fails the run instead of skipping those tests.
for bin in /usr/local/cuda/bin /usr/local/cuda-*/bin; do [[ -d $bin ]] && PATH=$PATH:$bin; done
command -v compute-sanitizer > /dev/null || { echo "compute-sanitizer not found" >&2; exit 1; }
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpus.txt"
nvidia-smi topo -m >> "$out/gpus.txt" 2>&1
arch=${CMAKE_CUDA_ARCHITECTURES:-90}
if [[ -n ${ROCENANTE_PREBUILT:-} ]]; then
  export PYTHONPATH=$(cd "$ROCENANTE_PREBUILT" && pwd)${PYTHONPATH:+:$PYTHONPATH}
elif [[ $what != breakdown ]]; then  # breakdown makes builds of its own
  python3 -m pip install --no-build-isolation --no-deps -q . -Ccmake.define.CMAKE_CUDA_ARCHITECTURES="$arch" \
    > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
fi
if [[ $what != breakdown ]]; then
  python3 -c 'import rocenante, sys; print("rocenante from", rocenante.__file__, "python", sys.version.split()[0])' |
    tee -a "$out/gpus.txt" || exit 1
fi
status=0
if [[ $what == tests || $what == all ]]; then
  (cd /tmp && ROCENANTE_TEST_FIGURES="$out/test-figures.jsonl" python3 -m pytest -v -rsP -m gpu "${selection[@]}" \
     --junitxml="$out/gpu-tests$suffix.xml" ${ROCENANTE_PYTEST_ARGS:-}) 2>&1 | tee "$out/gpu-tests$suffix.log" |
    tail -25
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
  # Timeline builds of this tree and, given, of an earlier one (EARLIER_TREE, e.g. `git archive fbf215f` unpacked
  # into an untracked folder of the checkout), built side by side, then run in alternate processes (earlier,
  # this, this, earlier) and merged; the host loop's pieces from this tree's build with CPU tensors.
  earlier=${1:+$(cd "$1" && pwd)} label_earlier=${2:-earlier}
  label=${ROCENANTE_GIT_REVISION:-$(git rev-parse --short HEAD 2>/dev/null || echo this-tree)}  # the device copy's git may be stale
  label=${label:0:7}
  build_timeline() {  # SOURCE TARGET LOG
    python3 -m pip install --no-build-isolation --no-deps -q --target "$2" "$1" \
      -Ccmake.define.CMAKE_CUDA_ARCHITECTURES="$arch" -Ccmake.define.ROCENANTE_TIMELINE=ON -Cbuild-dir="$2-build" \
      > "$3" 2>&1
  }
  build_timeline "$repo" /tmp/rocenante-timeline "$out/build-timeline.log" & this_build=$!
  if [[ -n $earlier ]]; then
    build_timeline "$earlier" /tmp/rocenante-timeline-earlier "$out/build-timeline-earlier.log" ||
      { tail -40 "$out/build-timeline-earlier.log"; exit 1; }
  fi
  wait $this_build || { tail -40 "$out/build-timeline.log"; exit 1; }
  # BREAKDOWN_EARLIER_ENV: settings for the earlier tree's runs only (e.g. ROCENANTE_PROXY_SPIN_S=0.002, the 2 ms spin
  # before a 50 us nap that fbf215f's proxy had). Waits are bounded at 60 s, so that a run that hangs costs little.
  export ROCENANTE_TIMEOUT_S=${ROCENANTE_TIMEOUT_S:-60}
  runs=(this:cuda:0 this:cuda:0 this:cpu)
  [[ -n $earlier ]] && runs=(earlier:cuda:0 this:cuda:0 this:cuda:0 earlier:cuda:0 this:cpu)
  parts=() i=0
  for run in "${runs[@]}"; do
    which=${run%%:*} device=${run#*:} i=$((i + 1))
    site=/tmp/rocenante-timeline name=$label settings=()
    [[ $which == earlier ]] && site=/tmp/rocenante-timeline-earlier name=$label_earlier settings=(${BREAKDOWN_EARLIER_ENV:-})
    (cd /tmp && env "${settings[@]}" PYTHONPATH=$site python3 "$repo/benchmarks/net_breakdown.py" --label "$name" --device "$device" \
       --part "/tmp/breakdown-part-$i.json") 2>&1 | grep -v "every peer is reached" >> "$out/breakdown.log"
    rc=${PIPESTATUS[0]}
    status=$(( status || rc ))
    (( rc == 0 )) && parts+=("/tmp/breakdown-part-$i.json")
  done
  (( ${#parts[@]} )) || { tail -40 "$out/breakdown.log"; exit 1; }
  (cd /tmp && PYTHONPATH=/tmp/rocenante-timeline python3 "$repo/benchmarks/net_breakdown.py" --merge "${parts[@]}" \
     --out "$out/breakdown.json") 2>&1 | tee -a "$out/breakdown.log" | tail -40
  status=$(( status || PIPESTATUS[0] ))
fi
if [[ $what == stress ]]; then
  runs=0 fails=0 start=$SECONDS
  while (( SECONDS - start < ${1:-450} )); do
    runs=$((runs + 1)) began=$SECONDS
    (cd /tmp && python3 -m pytest -q -x -m gpu -p no:cacheprovider "${selection[@]}") > "$out/stress-run.log" 2>&1
    rc=$?
    echo "stress run $runs rc=$rc $((SECONDS - began)) s" >> "$out/stress.log"
    if (( rc )); then fails=$((fails + 1)); tail -40 "$out/stress-run.log" >> "$out/stress.log"; fi
  done
  rm -f "$out/stress-run.log"
  echo "stress: $fails of $runs runs failed" | tee -a "$out/stress.log"
  status=$(( fails > 0 ))
fi
exit $status
