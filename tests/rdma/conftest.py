"""RDMA tests need an ACTIVE RoCE port: inside the SoftRoCE VM (tests/rdma/run_in_vm.sh) or on RDMA hosts.
Elsewhere they are skipped, saying why."""

import pytest


def pytest_collection_modifyitems(config, items):
    from rocenante import _C, _ib

    if not _C.with_ibverbs:
        reason = "rocenante was built without rdma-core's headers (install libibverbs-dev and rebuild)"
    elif not any(p.state == "ACTIVE" and p.link_layer == "Ethernet" for p in _ib.scan()):
        reason = "no ACTIVE RoCE port on this machine: run them in the SoftRoCE VM (tests/rdma/run_in_vm.sh)"
    else:
        return
    for item in items:
        if "/rdma/" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def over_rdma(monkeypatch):
    """Every rank of these tests runs on this machine: reach every peer through the RDMA device all the same."""
    monkeypatch.setenv("ROCENANTE_NET", "ib")
