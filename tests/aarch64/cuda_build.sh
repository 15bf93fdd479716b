#!/usr/bin/env bash
# The CUDA build for a DGX Spark (an aarch64 host, a GB10: sm_121), compiled and linked on this x86 machine: its
# nvcc with Debian's aarch64 g++ as the host compiler (tests/aarch64/toolchain.cmake), NVIDIA's aarch64 CUDA
# runtime (PyPI's nvidia-cuda-runtime of nvcc's version) as the toolkit's sbsa-linux target, the arm64 root of
# make_root.sh as the sysroot. Then it checks what came out: an aarch64 module with sm_121 code (cuobjdump, from
# PyPI's nvidia-cuda-cuobjdump), which imports under emulation (python of the root; no GPU, so no CUDA call runs).
#   tests/aarch64/cuda_build.sh [BUILD]   (default /var/tmp/rocenante-cuda-aarch64; ROOT: $ROCENANTE_ARM64_ROOT)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
build=${1:-/var/tmp/rocenante-cuda-aarch64}
export ROCENANTE_ARM64_ROOT=${ROCENANTE_ARM64_ROOT:-/var/tmp/rocenante-arm64}
root=$ROCENANTE_ARM64_ROOT
# The toolkit: CUDA_HOME's, else /usr/local/cuda (not the nvcc on PATH, which may be a wrapper elsewhere).
toolkit=$(realpath "${CUDA_HOME:-/usr/local/cuda}")
version=$("$toolkit/bin/nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
echo "cuda_build: nvcc $version from $toolkit"
rm -rf "$build" && mkdir -p "$build/wheels"
# A copy of the toolkit with an sbsa-linux target: its headers (the same for both), NVIDIA's aarch64 runtime.
cp -a "$toolkit" "$build/cuda"
target=$build/cuda/targets/sbsa-linux
mkdir -p "$target/lib"
cp -a "$build/cuda/targets/x86_64-linux/include" "$target/include"
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_aarch64 --dest "$build/wheels" \
  "nvidia-cuda-runtime==$version.*"
python3 -m pip download -q --no-deps --only-binary=:all: --dest "$build/wheels" "nvidia-cuda-cuobjdump>=$version"
for w in "$build"/wheels/*.whl; do python3 -m zipfile -e "$w" "$build/unpacked"; done
rt=$build/unpacked/nvidia/cu${version%%.*}
cp -a "$rt/include/." "$target/include/"
cp -a "$rt/lib/." "$target/lib/"
ln -sf libcudart.so."${version%%.*}" "$target/lib/libcudart.so"
cuobjdump=$(find "$build/unpacked" -name cuobjdump -type f | head -1)
chmod +x "$cuobjdump"
python=$root/usr/bin/python3.11
export QEMU_LD_PREFIX=$root  # the root's python runs under qemu-user (binfmt) when CMake asks it for its version
start=$(date +%s)
cmake -S "$repo" -B "$build/cmake" -G Ninja -DCMAKE_TOOLCHAIN_FILE="$here/toolchain.cmake" \
  -DCMAKE_CUDA_COMPILER="$build/cuda/bin/nvcc" -DCUDAToolkit_ROOT="$build/cuda" \
  -Dpybind11_DIR="$(python3 -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
  -DPython_EXECUTABLE="$python" -DPython_INCLUDE_DIR="$root/usr/include/python3.11" | grep -E "rocenante|Found CUDA"
ninja -C "$build/cmake" | tail -2
echo "cuda_build: configured and built in $(( $(date +%s) - start )) s"
module=$(ls "$build"/cmake/_C.*.so)
file "$module"
"$cuobjdump" --list-elf "$module"
aarch64-linux-gnu-readelf -d "$module" | grep NEEDED
file "$module" | grep -q "ARM aarch64" && "$cuobjdump" --list-elf "$module" | grep -q "sm_121" ||
  { echo "cuda_build: not an aarch64 module with sm_121 code"; exit 1; }
(cd "$build/cmake" && LD_LIBRARY_PATH=$target/lib "$python" -c 'import platform, _C
print("cuda_build: imported on", platform.machine(), "with CUDA" if _C.with_cuda else "without CUDA",
      "and RDMA" if _C.with_ibverbs else "without RDMA")')
