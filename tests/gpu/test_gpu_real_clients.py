"""Real clients on CUDA tensors (tests/support/clients.py): the matrix of tests/cpu/test_real_clients.py in eager
mode, under torch.compile and captured in CUDA graphs; transformers' tensor-parallel decode; the profiler's labels.
Ranks share the GPU where there are fewer GPUs than ranks (the delegate is then gloo: the cells it would serve
are skipped, saying why; with a GPU per rank it is NCCL)."""

from __future__ import annotations

import functools

import pytest

import clients

WORLD = 2
MODES = ["eager", "compile", "graph"]


@functools.cache
def _outcome(mode):
    return clients.run_matrix("cuda", mode, WORLD, timeout=600)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cell", clients.CELLS, ids=lambda c: c.name)
def test_cell(cell, mode):
    why = clients.skipped(cell, "cuda", mode, WORLD)
    if why is not None:
        pytest.skip(why)
    clients.check_cell(_outcome(mode), cell)


@pytest.mark.parametrize("world", [2, 4])
def test_transformers_tensor_parallel_decode(world, tmp_path):
    clients.check_tp_decode("cuda", world, tmp_path)


def test_profiler_trace_names_each_collective_and_its_size(tmp_path):
    clients.check_profiled_step("cuda", WORLD, tmp_path)
