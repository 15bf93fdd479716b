#!/usr/bin/env bash
# An arm64 Debian 12 root in which tests/aarch64/suite.sh runs rocenante's build and CPU suite as aarch64 programs
# under qemu-user, on an x86 host: made from Debian's packages (mmdebstrap) and PyPI's aarch64 wheels, nothing else.
# The wheels are fetched natively on the host (pip download --platform) into ROOT/var/cache/wheels and installed
# inside, into the venv /opt/venv (the same packages as .ci/run's venv; PyPI's aarch64 torch is a CUDA build, and
# its nvidia-* wheels come with it: about 2.9 GB). Needs root, apt-get and binfmt_misc (it registers qemu-aarch64
# when absent). Measured on the 2-core x86 machine: see tests/README.md, "aarch64".
#   tests/aarch64/make_root.sh [ROOT]   (default /var/tmp/rocenante-arm64)
set -euo pipefail
root=${1:-/var/tmp/rocenante-arm64}
DEBIAN_FRONTEND=noninteractive apt-get install -y -q mmdebstrap qemu-user-static > /dev/null
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
  mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  cat /usr/lib/binfmt.d/qemu-aarch64.conf > /proc/sys/fs/binfmt_misc/register  # flag F: usable inside a chroot
fi
start=$(date +%s)
if [ ! -x "$root/usr/bin/python3" ]; then
  rm -rf "$root"
  mmdebstrap --arch=arm64 --variant=apt --include=python3,python3-venv,python3-dev,g++,make,libibverbs-dev,procps \
    bookworm "$root" http://deb.debian.org/debian
fi
echo "aarch64 root: debootstrapped in $(( $(date +%s) - start )) s"
start=$(date +%s)
wheels=$root/var/cache/wheels
mkdir -p "$wheels"
# What .ci/run installs, for the same tests, and the build's own (the CMake and Ninja wheels: bookworm's CMake 3.25.1
# is older than the 3.25.2 the build asks for).
packages=(torch==2.13.0 numpy pytest hypothesis "apache-tvm-ffi>=0.1.11,<0.2" cuda-python nvidia-ml-py requests tqdm
          transformers==5.17.0 accelerate==1.15.0 scikit-build-core pybind11 "cmake>=3.25.2" ninja)
platforms=(--platform manylinux2014_aarch64)  # pip download takes only the tags named: every glibc bookworm runs
for minor in $(seq 17 36); do platforms+=(--platform "manylinux_2_${minor}_aarch64"); done
python3 -m pip download -q --dest "$wheels" "${platforms[@]}" --python-version 3.11 --implementation cp --abi cp311 \
  --only-binary=:all: "${packages[@]}"
python3 -m pip download -q --dest "$wheels" --no-deps --only-binary=:all: flashinfer-python==0.7.4
echo "aarch64 root: wheels fetched in $(( $(date +%s) - start )) s ($(du -sh "$wheels" | cut -f1))"
start=$(date +%s)
chroot "$root" /bin/sh -c "python3 -m venv /opt/venv && /opt/venv/bin/pip install -q --no-index \
  --find-links /var/cache/wheels ${packages[*]@Q} && /opt/venv/bin/pip install -q --no-index --no-deps \
  --find-links /var/cache/wheels flashinfer-python==0.7.4"
echo "aarch64 root: venv installed under emulation in $(( $(date +%s) - start )) s"
