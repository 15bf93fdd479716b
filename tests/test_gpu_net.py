"""GPU tensors through the network path (RDMA part 2/2), on one host with the TCP software wire
(ROCENANTE_NET=tcp): the kernel stores into pinned host memory, the proxy thread carries each call over loopback
TCP (the receiving side places segments in random order), and the kernel reads a peer's data only after the
peer's arrival word. The entry functions are the direct path's own (test_gpu_allreduce.py, test_gpu_faults.py),
so both paths are held to one standard; only what differs is asserted here."""

from __future__ import annotations

import pytest
import torch

import test_gpu_allreduce as direct
import test_gpu_faults as faults
from multiproc import expect_ok, record_figure, run_ranks
from reference import check_against_float64, make_input, poison

pytestmark = pytest.mark.gpu
WORLD = 2


@pytest.fixture(autouse=True)
def _tcp_wire(monkeypatch):
    monkeypatch.setenv("ROCENANTE_NET", "tcp")  # inherited by the ranks' processes


def _uses_the_network(store, rank, world):
    comm = direct._comm(store, rank, world)
    x = make_input(11, 0, rank, 4099, torch.bfloat16).cuda(rank)
    inputs = [make_input(11, 0, r, 4099, torch.bfloat16) for r in range(world)]
    out = poison(torch.empty_like(x))
    comm.all_reduce(x, out=out)
    comm.synchronize()
    check_against_float64(out.cpu(), inputs, "sum")
    net = comm.net
    comm.close()
    return net


def test_the_communicator_takes_the_network_path():
    assert expect_ok(run_ranks(WORLD, _uses_the_network, timeout=120)) == ["tcp", "tcp"]


def test_every_dtype_op_and_size_matches_reference_and_nccl():
    direct.test_every_dtype_op_and_size_matches_reference_and_nccl()


def test_two_thousand_calls_of_varying_size():
    direct.test_two_thousand_calls_of_varying_size()


def test_thousand_graph_replays_with_new_inputs():
    direct.test_thousand_graph_replays_with_new_inputs()


def test_mismatched_sizes_fail_on_both_ranks():
    # A rank may hear of the mismatch from its peer's abort word before the peer's call arrives: it then names
    # the mismatch as the peer saw it (tests/rdma/test_rdma.py says why).
    results = expect_ok(run_ranks(WORLD, direct._mismatch, timeout=120))
    for rank, message in enumerate(results):
        other = f"rank {1 - rank} called all_reduce with {1000 + 8 * (1 - rank)} x float32"
        assert other in message or f"rank {1 - rank} aborted the communicator: rank" in message, message


def test_calls_on_two_streams_execute_in_issue_order():
    assert expect_ok(run_ranks(WORLD, faults._two_streams, 200, False, timeout=300)) == [200, 200]


def test_killed_peer_during_graph_replays_poisons_outputs_within_two_seconds():
    # The survivor learns of it from its watchdog (the peer's process ended) or from its proxy (the peer's
    # connection closed while this rank waits for its data): either names rank 1.
    results = run_ranks(WORLD, faults._graph_victim, "kill", 60.0, timeout=300)
    good, kind, message, detect_s = expect_ok(results[:1])[0]
    assert good > 0, "no replay completed before the kill"
    assert kind == "PeerAbortedError", message
    assert "rank 1's process ended" in message or "network path to rank 1 failed: the connection closed" in message, message
    record_figure("gpu_net_tcp_killed_peer_detect_s", detect_s)
    assert detect_s < 2.0, f"noticed after {detect_s:.2f} s (timeout 60 s)"


def test_stopped_peer_during_graph_replays_poisons_outputs_on_both_ranks():
    (good0, kind0, message0, detect0), (good1, kind1, message1, _) = expect_ok(
        run_ranks(WORLD, faults._graph_victim, "stop", 2.0, timeout=300))
    assert good0 > 0 and good1 > 0
    assert kind0 == "PeerTimeoutError" and "waiting for rank(s) 1" in message0, message0
    record_figure("gpu_net_tcp_stopped_peer_detect_s_timeout_2s", detect0)
    assert detect0 < 2.0 + 1.5, f"rank 0 noticed after {detect0:.2f} s with a 2 s timeout"
    # Rank 1's own proxy thread stops with its process, so the kernels it had already launched wait for data
    # only that proxy could take in: they time out too, naming rank 0 (README, Known problems).
    assert kind1 == "PeerTimeoutError", message1
    assert "rank 0 aborted the communicator: a wait for rank(s) 1" in message1 or "waiting for rank(s) 0" in message1, message1
