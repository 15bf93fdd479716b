#!/bin/bash
# Runs the RDMA tests (tests/rdma) inside a throw-away SoftRoCE VM: two rxe devices (RoCE v2), every rank a
# process of the VM. Needs root, qemu and a kernel with rdma_rxe (tests/rdma/install_vm_deps.sh installs them
# on Debian 12). The guest CPU is emulated (about 15x slower): correctness only, never speed.
#   tests/rdma/run_in_vm.sh [pytest arguments]      PYTHON=... picks the interpreter (default: python3)
# The interpreter, its packages and rocenante are the host's (the guest sees the host's files read-only).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
# The interpreter's real path: a pyenv shim costs seconds per start in the guest.
python=$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')
cd "$repo"
args=
if [ $# -gt 0 ]; then args=$(printf ' %q' "$@"); fi
exec "$here/rxe_vm.sh" "bash tests/rdma/guest_setup.sh && $python -m pytest -q -rs -p no:cacheprovider tests/rdma$args"
