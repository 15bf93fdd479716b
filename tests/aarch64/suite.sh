#!/usr/bin/env bash
# rocenante on aarch64 under emulation, by hand (CI runs the smaller tests/aarch64/run.sh): in the arm64 root of
# make_root.sh, this tree built as a user builds it (pip, under emulation; CPU-only, as the root has no CUDA) and
# the README's test command run with ROCENANTE_TEST_MACHINE=aarch64 (tests/conftest.py: the run stops unless Python
# and the extension are aarch64's); then the CUDA build for a Spark (tests/aarch64/cuda_build.sh). Everything goes
# to LOG: commit it whenever the build or the host code changes.
#   tests/aarch64/suite.sh [LOG] [PYTEST ARGS...]   (ROOT: $ROCENANTE_ARM64_ROOT, default /var/tmp/rocenante-arm64)
# qemu-user before 8.2 shows the host's /proc/cpuinfo, on which torch's cpuinfo crashes `import torch`: an aarch64
# one (tests/aarch64/cpuinfo, a Neoverse N1's, the CPU emulated) is bound over it inside the root.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
log=$(realpath -m "${1:-$repo/benchmarks/logs/aarch64-suite.log}")
shift $(( $# > 0 ? 1 : 0 ))
root=${ROCENANTE_ARM64_ROOT:-/var/tmp/rocenante-arm64}
[ -x "$root/opt/venv/bin/python" ] ||
  { echo "no arm64 root at $root: run tests/aarch64/make_root.sh first" >&2; exit 2; }
mounts=()
cleanup() { for (( i=${#mounts[@]} - 1; i >= 0; i-- )); do umount -l "${mounts[i]}" || true; done; }
trap cleanup EXIT
mount_in() { mount "$@"; mounts+=("${*: -1}"); }
mount_in -t proc proc "$root/proc"
mount_in --bind "$here/cpuinfo" "$root/proc/cpuinfo"
mount_in -t sysfs sys "$root/sys"
mount_in --bind /dev "$root/dev"
mount_in -t tmpfs -o size=4g shm "$root/dev/shm"
mount_in -t tmpfs -o size=8g tmp "$root/tmp"
# Names as on any host (mmdebstrap leaves no /etc/hosts): torchrun's store at localhost, gloo at the hostname.
printf '127.0.0.1 localhost %s\n::1 localhost ip6-localhost\n' "$(hostname)" > "$root/etc/hosts"
# The tree as git sees it (tracked and untracked, not ignored), copied in: the build writes beside its sources.
rm -rf "$root/src" && mkdir -p "$root/src"
(cd "$repo" && git ls-files -z -co --exclude-standard | tar --null -T - -cf -) | tar -C "$root/src" -xf -
# QEMU_CPU: qemu's default CPU ("max") offers SVE, torch's inductor then emits SVE code, and bookworm's GCC 12 crashes
# compiling it (an internal compiler error in aarch64_sve::gimple_folder); a Neoverse N1 has no SVE.
# ROCENANTE_TEST_EMULATED: tests/support/probes.py.
in_root() {
  chroot "$root" /usr/bin/env -i QEMU_CPU=neoverse-n1 ROCENANTE_TEST_EMULATED=qemu-user HOME=/root \
    PATH=/opt/venv/bin:/usr/bin:/bin LANG=C.UTF-8 "$@"
}
{
  echo "# tests/aarch64/suite.sh on $(uname -m) ($(nproc) cores), $(qemu-aarch64-static --version | head -1)"
  echo "# tree: $(cd "$repo" && git describe --always --dirty), $(date -u +%FT%TZ)"
  start=$(date +%s)
  in_root sh -c 'cd /src && pip install -q --no-build-isolation --no-deps . 2>&1 | tail -5'
  in_root python -c 'import platform, rocenante._C as C; print("rocenante:", C.__file__, "on", platform.machine())'
  echo "# build under emulation: $(( $(date +%s) - start )) s"
  start=$(date +%s)
  status=0
  in_root sh -c "cd /tmp && ROCENANTE_TEST_MACHINE=aarch64 python -m pytest -q -rs --durations=25 /src/tests $*" ||
    status=$?
  echo "# the suite under emulation: $(( $(date +%s) - start )) s, exit $status"
  ROCENANTE_ARM64_ROOT=$root "$here/cuda_build.sh" || status=$?
  exit $status
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
