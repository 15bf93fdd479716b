#!/usr/bin/env bash
# ThreadSanitizer over the host code (tests/tsan/driver.cc's workload: ranks as threads over the TCP wire), as CI
# runs it. Builds the host sources and the driver with -fsanitize=thread into BUILD (default /tmp/rocenante-tsan),
# runs the driver, and fails on any report or failed scenario; then builds the driver with a planted race and
# fails unless TSan reports it (a job that cannot report would pass everything). Suppressions: suppressions.txt
# beside this file, each argued there.
#   tests/tsan/run.sh [BUILD]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../../csrc" && pwd)
build=${1:-/tmp/rocenante-tsan}
mkdir -p "$build"
cxx=${CXX:-g++}
# -Wno-tsan: GCC warns that TSan does not model atomic_thread_fence (the host loop's release fence before its
# pushes); what that leaves unchecked is said in tests/README.md.
flags=(-std=c++20 -O1 -g -fsanitize=thread -fno-omit-frame-pointer -pthread -Wno-tsan -I"$src")
sources=(communicator.cc errors.cc host_collective.cc watchdog.cc no_cuda.cc
         transport/proxy.cc transport/shm.cc transport/tcp.cc transport/no_ibverbs.cc)
objects=()
start=$(date +%s)
for s in "${sources[@]}"; do
  o="$build/$(echo "$s" | tr / _).o"
  objects+=("$o")
  "$cxx" "${flags[@]}" -c "$src/$s" -o "$o" &
done
wait
"$cxx" "${flags[@]}" "$here/driver.cc" "${objects[@]}" -o "$build/driver" -lrt -ldl
"$cxx" "${flags[@]}" -DROCENANTE_TSAN_PLANTED_RACE "$here/driver.cc" "${objects[@]}" -o "$build/driver-planted" -lrt -ldl
echo "tsan: built in $(( $(date +%s) - start )) s"
export TSAN_OPTIONS="suppressions=$here/suppressions.txt halt_on_error=0 exitcode=66 second_deadlock_stack=1"
status=0
start=$(date +%s)
"$build/driver" 2>&1 | tee "$build/driver.log" || status=$?
reports=$(grep -c "WARNING: ThreadSanitizer" "$build/driver.log" || true)
echo "tsan: the workload took $(( $(date +%s) - start )) s, exit $status, $reports report(s)"
"$build/driver-planted" > "$build/planted.log" 2>&1 || true
if ! grep -q "WARNING: ThreadSanitizer: data race" "$build/planted.log"; then
  echo "tsan: the planted race was NOT reported: this job cannot find races"; exit 1
fi
echo "tsan: the planted race was reported"
[[ $status == 0 && $reports == 0 ]]
