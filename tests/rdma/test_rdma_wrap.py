"""The call numbers' wrap over RDMA (the SoftRoCE VM): tests/support/wrap.py."""

from __future__ import annotations

import pytest

import wrap
from multiproc import expect_ok, run_ranks


@pytest.mark.parametrize("before", [5, 0], ids=["wrap-5-calls-in", "first-call-0"])
def test_calls_and_a_fault_across_the_wrap(before, monkeypatch):
    monkeypatch.setenv("ROCENANTE_TEST_FIRST_CALL", str(wrap.near_the_wrap(before)))
    results = run_ranks(2, wrap.calls_across, "cpu", 12, 47, timeout=600, context="fork")
    wrap.assert_named_the_mismatch(expect_ok(results))
