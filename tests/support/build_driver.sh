# Sourced by tests/tsan/run.sh and tests/aarch64/run.sh. build_driver BUILD CXX FLAGS... compiles the host code
# (csrc without CUDA or libibverbs: the host loop, shared memory, the TCP wire, the proxy, the watchdog) with CXX
# and FLAGS, in parallel, and links tests/tsan/driver.cc against it as BUILD/driver; the objects stay in
# driver_objects for further links.
build_driver() {
  local build=$1 cxx=$2
  shift 2
  local here src s o
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  src=$(cd "$here/../csrc" && pwd)
  mkdir -p "$build"
  driver_objects=()
  for s in communicator.cc errors.cc host_collective.cc watchdog.cc no_cuda.cc \
           transport/proxy.cc transport/shm.cc transport/tcp.cc transport/no_ibverbs.cc; do
    o="$build/$(echo "$s" | tr / _).o"
    driver_objects+=("$o")
    "$cxx" "$@" -I"$src" -c "$src/$s" -o "$o" &
  done
  wait
  "$cxx" "$@" -I"$src" "$here/tsan/driver.cc" "${driver_objects[@]}" -o "$build/driver" -lrt -ldl
}
