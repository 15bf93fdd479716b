#!/bin/bash
# (The project's copy of ../shared/softroce/install-deps.sh.)
# Installs what run-in-rxe-vm.sh needs on a Debian 12 machine (about 2 minutes, about 510 MB), ping for
# cluster_smoke.sh, and nftables, with which tests/cpu/test_cpu_remote_death.py drops a peer's traffic.
# The kernel package is installed only for its image and its rdma_rxe module; nothing boots from it here.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends \
  qemu-system-x86 qemu-utils busybox-static kmod iproute2 cpio linux-image-amd64 \
  rdma-core ibverbs-providers ibverbs-utils libibverbs-dev librdmacm-dev rdmacm-utils \
  python3-pyverbs perftest nftables iputils-ping >/dev/null
find /lib/modules -name 'rdma_rxe.ko*' | head -1 | grep -q . || { echo "no rdma_rxe module found" >&2; exit 1; }
echo "softroce dependencies installed"
