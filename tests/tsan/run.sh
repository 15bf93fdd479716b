#!/usr/bin/env bash
# ThreadSanitizer over the host code (tests/tsan/driver.cc's workload: ranks as threads over shared memory and the
# TCP wire), as CI runs it. Builds the host sources and the driver with -fsanitize=thread into BUILD (default
# /tmp/rocenante-tsan), runs the driver, and fails on any report or failed scenario; then builds the driver with a
# planted race and fails unless TSan reports it (a job that cannot report would pass everything). Suppressions:
# suppressions.txt beside this file, each argued there.
#   tests/tsan/run.sh [BUILD]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-/tmp/rocenante-tsan}
. "$here/../support/build_driver.sh"
# -Wno-tsan: GCC warns that TSan does not model atomic_thread_fence (the host loop's release fence before its
# pushes); what that leaves unchecked is said in tests/README.md.
flags=(-std=c++20 -O1 -g -fsanitize=thread -fno-omit-frame-pointer -pthread -Wno-tsan)
start=$(date +%s)
build_driver "$build" "${CXX:-g++}" "${flags[@]}"
"${CXX:-g++}" "${flags[@]}" -I"$here/../../csrc" -DROCENANTE_TSAN_PLANTED_RACE "$here/driver.cc" \
  "${driver_objects[@]}" -o "$build/driver-planted" -lrt -ldl
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
