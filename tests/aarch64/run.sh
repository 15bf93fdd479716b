#!/usr/bin/env bash
# The host code on aarch64 (a DGX Spark's CPU), as CI runs it: cross-compiled with Debian's aarch64 g++ and run
# under qemu-user, tests/tsan/driver.cc's workload (ranks as threads of one process over shared memory and over the
# TCP wire in both signal modes: every collective within and over the capacity, a call mismatch, a rank that closed,
# a refusal). Fails unless the driver says it was built for aarch64 and ran on aarch64. Emulation runs the guest's
# loads and stores on x86, which orders memory more strongly than Armv8: this shows that the code builds and works
# there, not that its memory ordering is right (docs/design.md argues that). The whole CPU suite and the CUDA build
# for sm_121 on aarch64: tests/aarch64/suite.sh.
#   tests/aarch64/run.sh [BUILD]   (Debian packages g++-aarch64-linux-gnu and qemu-user-static)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-/tmp/rocenante-aarch64}
. "$here/../support/build_driver.sh"
start=$(date +%s)
build_driver "$build" aarch64-linux-gnu-g++ -std=c++20 -O2 -g -pthread
echo "aarch64: cross-compiled in $(( $(date +%s) - start )) s"
start=$(date +%s)
status=0
QEMU_LD_PREFIX=/usr/aarch64-linux-gnu qemu-aarch64-static "$build/driver" 2>&1 | tee "$build/driver.log" ||
  status=$?
echo "aarch64: the workload took $(( $(date +%s) - start )) s under emulation, exit $status"
grep -q "^driver: built for aarch64, running on aarch64$" "$build/driver.log" ||
  { echo "aarch64: the driver did not run as an aarch64 program"; exit 1; }
exit "$status"
