# CMake's toolchain for building rocenante for aarch64 on x86 (tests/aarch64/cuda_build.sh): Debian's aarch64 g++
# as the C++ compiler and as nvcc's host compiler, the arm64 root of make_root.sh as the sysroot (its libc, Python
# headers and rdma-core's verbs.h). nvcc and the CUDA toolkit are given on the command line.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_SYSROOT "$ENV{ROCENANTE_ARM64_ROOT}")
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_CUDA_HOST_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
