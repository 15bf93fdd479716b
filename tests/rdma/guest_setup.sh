#!/bin/bash
# Runs inside the SoftRoCE VM (rxe_vm.sh), as root, before the RDMA tests: adds a second SoftRoCE device, rxe1
# on dummy1 (10.77.1.1), so that the tests exercise spreading peers over two devices. Waits until its port is
# ACTIVE with its IPv4-mapped RoCE v2 GID.
set -euo pipefail
ip link add dummy1 type dummy
ip addr add 10.77.1.1/24 dev dummy1
ip link set dummy1 up
rdma link add rxe1 type rxe netdev dummy1
port=/sys/class/infiniband/rxe1/ports/1
for _ in $(seq 200); do
  if grep -q ACTIVE $port/state && grep -qs '0000:0000:0000:0000:0000:ffff:0a4d:0101' $port/gids/*; then
    exit 0
  fi
  sleep 0.1
done
echo "guest_setup: rxe1 did not come up" >&2
exit 1
