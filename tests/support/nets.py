"""Parametrizations over the paths a test runs on, through the `net` fixture of tests/conftest.py (which sets
ROCENANTE_NET for the ranks): "" peers on this host directly, "tcp" the TCP software wire."""

from __future__ import annotations

import pytest


def label(net: str) -> str:
    return net or "direct"


def cases(names: str, *rows):
    """@pytest.mark.parametrize(names, rows) where each row's first value is a net, given to the `net` fixture;
    ids name the path and the other values ("direct-2", "tcp-3")."""
    params = [pytest.param(*row, id="-".join([label(row[0])] + [str(v) for v in row[1:]])) for row in rows]
    return pytest.mark.parametrize(names, params, indirect=["net"])


def on_path(comm, net: str):
    """comm, once checked to be on the path `net` asked for (ROCENANTE_NET reached the rank and was taken)."""
    assert comm.net == (net or "shm"), f"ROCENANTE_NET={net!r} built a {comm.net!r} communicator"
    return comm
