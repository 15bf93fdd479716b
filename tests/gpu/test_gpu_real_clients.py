"""Real clients on CUDA tensors (tests/support/clients.py): the matrix of tests/cpu/test_real_clients.py in eager
mode, under torch.compile and captured in CUDA graphs; transformers' tensor-parallel decode; the profiler's labels.
Ranks share the GPU where there are fewer GPUs than ranks (the delegate is then gloo: the cells it would serve
are skipped, saying why; with a GPU per rank it is NCCL)."""

from __future__ import annotations

import pytest

import clients

WORLD = 2

test_cell = clients.matrix_test("cuda", WORLD)


@pytest.mark.parametrize("world", [2, 4])
def test_transformers_tensor_parallel_decode(world, tmp_path):
    clients.check_tp_decode("cuda", world, tmp_path)


def test_profiler_trace_names_each_collective_and_its_size(tmp_path):
    clients.check_profiled_step("cuda", WORLD, tmp_path)
