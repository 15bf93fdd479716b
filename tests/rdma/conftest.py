"""RDMA tests need an ACTIVE RoCE port: inside the SoftRoCE VM (tests/rdma/run_in_vm.sh) or on RDMA hosts.
tests/conftest.py marks them `rdma` and skips them elsewhere, saying why."""

import pytest


@pytest.fixture(autouse=True)
def over_rdma(monkeypatch):
    """Every rank of these tests runs on this machine: reach every peer through the RDMA device all the same."""
    monkeypatch.setenv("ROCENANTE_NET", "ib")
