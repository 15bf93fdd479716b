"""The serving-engine plugins, 2 ranks on this machine's GPUs, without FlashInfer or vLLM installed (the GPU
machine has neither): rocenante.flashinfer's workspace face and both fusion patterns against the float64
reference, the add and RMSNorm fused into the kernel (against the reference, against the all-reduce followed by
torch's ops, in place, and when a call fails), a CUDA graph around a transformer-like block that calls the plugin,
and vLLM's graph_capture() driving our communicator (through a stand-in of vLLM's modules; a GPU per rank). A
comparison with FlashInfer's own kernel runs only where FlashInfer is installed."""

from __future__ import annotations

import sys
import time
import types

import pytest
import torch

import gpus
from multiproc import expect_ok, run_ranks
from reference import add_rmsnorm_float64, check_within, digest, make_input, poison, sequential_fp32

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _init(store, rank, world):
    import torch.distributed as dist

    gpus.use(rank)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world)
    return dist.group.WORLD


def _patterns(store, rank, world):
    from rocenante.flashinfer import AllReduceFusionPattern as P
    from rocenante.flashinfer import PcieIpcAllReduceWorkspace, allreduce_fusion, create_allreduce_fusion_workspace

    group = _init(store, rank, world)
    dev = gpus.device_of(rank)
    digests = []
    # The PCIe-IPC face.
    with PcieIpcAllReduceWorkspace(group, max_numel=64 * 8192) as ws:
        inputs = [make_input(11, 0, r, 64 * 4096, torch.bfloat16, dev) for r in range(world)]
        assert ws.supports(inputs[rank])
        with pytest.raises(ValueError, match="workspace was built on"):
            ws.supports(inputs[rank].cpu())
        out = poison(torch.empty_like(inputs[rank]))
        ws.all_reduce(inputs[rank], out=out)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), sequential_fp32([x.cpu() for x in inputs], "sum"))
        digests.append(digest(out))
    # The unified pair, both patterns, decode shapes.
    ws = create_allreduce_fusion_workspace("rocenante", world, rank, 64, 8192, torch.float32, group=group)
    for case, (dtype, tokens, hidden, weight_bias) in enumerate(
            [(d, t, h, wb) for d in DTYPES for t, h, wb in ((1, 4096, 0.0), (7, 8192, 1.0), (64, 4096, 0.0))]):
        n = tokens * hidden
        xs = [make_input(12, case, r, n, dtype, dev).view(tokens, hidden) for r in range(world)]
        residual = make_input(13, case, 0, n, dtype, dev).view(tokens, hidden)
        gamma = make_input(14, case, 0, hidden, dtype, dev)
        out = poison(torch.empty_like(xs[rank]))
        allreduce_fusion(xs[rank], ws, P.kAllReduce, output=out, launch_with_pdl=True)
        summed = sequential_fp32([x.flatten().cpu() for x in xs], "sum").view(tokens, hidden)
        residual_out, norm_out = poison(torch.empty_like(out)), poison(torch.empty_like(out))
        allreduce_fusion(xs[rank], ws, P.kARResidualRMSNorm, residual_out=residual_out, norm_out=norm_out,
                         residual_in=residual, rms_gamma=gamma, rms_eps=1e-6, weight_bias=weight_bias)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), summed), f"kAllReduce {dtype} {tokens}x{hidden}"
        # FlashInfer's rounding points: the all-reduce rounded, the add in fp32 rounded once.
        assert torch.equal(residual_out.cpu(), (summed.float() + residual.cpu().float()).to(dtype))
        r64, r_scale, norm64, norm_scale = add_rmsnorm_float64(xs, residual, gamma, 1e-6, weight_bias)
        check_within(residual_out, r64, r_scale, f"residual_out {dtype} {tokens}x{hidden}")
        check_within(norm_out, norm64, norm_scale, f"norm_out {dtype} {tokens}x{hidden}")
        digests += [digest(residual_out), digest(norm_out)]
    ws.destroy()
    return digests


def test_workspace_face_and_both_patterns_against_float64():
    a, b = expect_ok(run_ranks(2, _patterns, timeout=300))
    assert a == b  # every output bitwise identical on both ranks


# Decode shapes; hidden 4098 has rows of 8196 bytes in bf16/fp16 and 16392 in fp32, not whole 16-byte chunks,
# so the plugin keeps the all-reduce followed by torch's ops there.
FUSED_SHAPES = [(tokens, hidden) for tokens in (1, 7, 64) for hidden in (4096, 8192, 4098)]


def _check_close_to_unfused(fused: torch.Tensor, unfused: torch.Tensor, what: str) -> None:
    """norm_out fused vs the all-reduce followed by torch's ops, within fused_norm_bound() (which says why)."""
    from rocenante.bench.runner import fused_norm_bound

    a, b = fused.double().cpu(), unfused.double().cpu()
    assert not torch.isnan(a).any(), f"{what}: fused norm_out has NaN (unwritten)"
    worst = ((a - b).abs() / fused_norm_bound(a, b, fused.dtype)).max().item()
    assert worst <= 1.0, f"{what}: fused norm_out is {worst:.2f}x the bound away from the unfused path's"


def _fused(store, rank, world):
    from rocenante.flashinfer import AllReduceFusionPattern as P
    from rocenante.flashinfer import add_rmsnorm, allreduce_fusion, create_allreduce_fusion_workspace

    group = _init(store, rank, world)
    dev = gpus.device_of(rank)
    ws = create_allreduce_fusion_workspace("rocenante", world, rank, 64, 8192, torch.float32, group=group)
    comm = ws.allreduce._alive()
    digests = []
    for case, (dtype, (tokens, hidden)) in enumerate((d, shape) for d in DTYPES for shape in FUSED_SHAPES):
        what, n, weight_bias = f"{dtype} {tokens}x{hidden}", tokens * hidden, float(case % 2)
        xs = [make_input(50, case, r, n, dtype, dev).view(tokens, hidden) for r in range(world)]
        residual = make_input(51, case, 0, n, dtype, dev).view(tokens, hidden)
        gamma = make_input(52, case, 0, hidden, dtype, dev)
        assert comm.fuses_add_rmsnorm(xs[rank], gamma) == (hidden != 4098), what
        residual_out, norm_out = poison(torch.empty_like(xs[rank])), poison(torch.empty_like(xs[rank]))
        allreduce_fusion(xs[rank], ws, P.kARResidualRMSNorm, residual_out=residual_out, norm_out=norm_out,
                         residual_in=residual, rms_gamma=gamma, rms_eps=1e-6, weight_bias=weight_bias)
        # The unfused path on the same inputs: rocenante's all-reduce, then torch's ops.
        unfused_r, unfused_n = poison(torch.empty_like(xs[rank])), poison(torch.empty_like(xs[rank]))
        add_rmsnorm(comm.all_reduce(xs[rank]), residual, gamma, 1e-6, weight_bias, unfused_r, unfused_n)
        torch.cuda.synchronize()
        r64, r_scale, norm64, norm_scale = add_rmsnorm_float64(xs, residual, gamma, 1e-6, weight_bias)
        check_within(residual_out, r64, r_scale, f"residual_out {what}")
        check_within(norm_out, norm64, norm_scale, f"norm_out {what}")
        assert torch.equal(residual_out, unfused_r), f"residual_out {what}: fused and unfused differ"
        _check_close_to_unfused(norm_out, unfused_n, f"norm_out {what}")
        digests += [digest(residual_out), digest(norm_out)]
        if tokens == 64:
            # In place, as serving engines call it: residual_out is residual_in, and here norm_out the input.
            res, x = residual.clone(), xs[rank].clone()
            allreduce_fusion(x, ws, P.kARResidualRMSNorm, residual_out=res, norm_out=x, residual_in=res,
                             rms_gamma=gamma, rms_eps=1e-6, weight_bias=weight_bias)
            torch.cuda.synchronize()
            assert torch.equal(res, residual_out) and torch.equal(x, norm_out), f"in place {what}"
    ws.destroy()
    return digests


def test_fused_add_rmsnorm_against_float64_and_the_unfused_path():
    a, b = expect_ok(run_ranks(2, _fused, timeout=300))
    assert a == b  # every output bitwise identical on both ranks


def _fused_fault(store, rank, world, how):
    """Rank 0 makes a fused call that fails: rank 1 never calls (a timeout) or makes the plain all-reduce of the
    same size instead (a mismatch the call word reveals). Rank 0's residual_out and norm_out must come back
    poisoned (NaN), and so must a replay of a graph captured around a fused call before the fault."""
    import rocenante

    dev = gpus.use(rank)
    comm = rocenante.Communicator(store, rank, world, device=dev, capacity_bytes=1 << 20, timeout_s=2.0)
    tokens, hidden, dtype = 7, 4096, torch.bfloat16
    x = make_input(60, 0, rank, tokens * hidden, dtype, dev).view(tokens, hidden)
    residual = make_input(61, 0, 0, tokens * hidden, dtype, dev).view(tokens, hidden)
    gamma = make_input(62, 0, 0, hidden, dtype, dev)
    assert comm.fuses_add_rmsnorm(x, gamma)
    good_r, good_n = comm.all_reduce_add_rmsnorm(x, residual, gamma)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up outside the capture
        comm.all_reduce_add_rmsnorm(x, residual, gamma)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_r, graph_n = comm.all_reduce_add_rmsnorm(x, residual, gamma)
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.isnan(good_r).any() and not torch.isnan(good_n).any()
    assert torch.equal(graph_r, good_r) and torch.equal(graph_n, good_n), "the replay differs from the eager call"
    if rank == 1:
        outcome = None
        if how == "plain":
            out = comm.all_reduce(x)
            try:
                comm.synchronize()
            except rocenante.RocenanteError as err:
                outcome = (type(err).__name__, str(err), bool(torch.isnan(out).all()))
        store.wait(["rank0-done"])
        del graph
        comm.close()
        return outcome
    residual_out, norm_out = torch.zeros_like(x), torch.zeros_like(x)
    start = time.monotonic()
    comm.all_reduce_add_rmsnorm(x, residual, gamma, residual_out=residual_out, norm_out=norm_out)
    try:
        comm.synchronize()
        raise AssertionError("the fused call completed")
    except rocenante.RocenanteError as err:
        outcome = (type(err).__name__, str(err), time.monotonic() - start)
    assert torch.isnan(residual_out).all() and torch.isnan(norm_out).all(), "an output of the failed call is not poisoned"
    graph_r.zero_()
    graph_n.zero_()
    graph.replay()  # the kernel finds the fault recorded: it computes nothing and poisons both outputs
    torch.cuda.synchronize()
    assert torch.isnan(graph_r).all() and torch.isnan(graph_n).all(), "a replay after the fault is not poisoned"
    with pytest.raises(rocenante.RocenanteError):
        comm.all_reduce_add_rmsnorm(x, residual, gamma)
    store.set("rank0-done", "1")
    del graph
    comm.close()
    return outcome


@pytest.mark.parametrize("how", ["absent", "plain"])
def test_a_failed_fused_call_poisons_residual_out_and_norm_out(how):
    rank0, rank1 = expect_ok(run_ranks(2, _fused_fault, how, timeout=300))
    kind, message, seconds = rank0
    count = 7 * 4096
    if how == "absent":
        assert kind == "PeerTimeoutError" and "timed out after 2 s waiting for rank(s) 1" in message, message
        assert seconds < 2.0 + 1.5, f"the timeout took {seconds:.2f} s"
        assert rank1 is None
    else:
        assert kind == "CallMismatchError", message
        assert f"rank 1 called all_reduce with {count} x bfloat16 (op sum);" in message, message
        kind1, message1, poisoned1 = rank1
        assert kind1 == "CallMismatchError" and poisoned1, rank1
        assert f"rank 0 called all_reduce with {count} x bfloat16 (op sum, fused with the residual add and " \
               "RMSNorm)" in message1, message1


def _block(store, rank, world):
    """A transformer-like block, tensor-parallel over the ranks (column- then row-parallel linear layers; the
    all-reduce fused with the residual add and RMSNorm, as vLLM's fusion pass emits it, in rocenante's kernel; a
    plain all-reduce at the end), captured in a CUDA graph and replayed with new inputs. After each replay, every captured plugin
    call is checked against the same call made eagerly on the replay's own inputs (bitwise) and against the
    float64 reference computed from every rank's inputs."""
    import torch.distributed as dist

    from rocenante.flashinfer import AllReduceFusionPattern as P
    from rocenante.flashinfer import allreduce_fusion, create_allreduce_fusion_workspace

    group = _init(store, rank, world)
    dev = gpus.device_of(rank)
    tokens, hidden, ffn, layers, dtype = 8, 4096, 2 * 4096 // world, 2, torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(100 + rank)  # each rank's weight shards differ
    w_up = [torch.randn(hidden, ffn, generator=g, device=dev, dtype=dtype) / hidden**0.5 for _ in range(layers)]
    w_down = [torch.randn(ffn, hidden, generator=g, device=dev, dtype=dtype) / ffn**0.5 for _ in range(layers)]
    gamma = [make_input(20, i, 0, hidden, dtype, dev).abs() + 0.5 for i in range(layers)]  # replicated
    ws = create_allreduce_fusion_workspace("rocenante", world, rank, tokens, hidden, dtype, group=group)
    static_h = torch.empty(tokens, hidden, device=dev, dtype=dtype)
    static_res = torch.empty_like(static_h)
    assert ws.allreduce._alive().fuses_add_rmsnorm(static_h, gamma[0])  # the graph replays the fused kernel

    def block(h, residual):
        """Returns every plugin call's (input, residual_in, residual_out, norm_out), then the last call's."""
        steps = []
        for i in range(layers):
            partial = torch.relu(h @ w_up[i]) @ w_down[i]  # this rank's share of the layer's output
            residual_out, norm_out = torch.empty_like(h), torch.empty_like(h)
            allreduce_fusion(partial, ws, P.kARResidualRMSNorm, residual_out=residual_out, norm_out=norm_out,
                             residual_in=residual, rms_gamma=gamma[i], rms_eps=1e-6, launch_with_pdl=True)
            steps.append((partial, residual, residual_out, norm_out))
            h, residual = norm_out, residual_out
        last_in = h * (rank + 1)
        return steps, (last_in, allreduce_fusion(last_in, ws, P.kAllReduce))

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up outside the capture
        block(static_h.normal_(), static_res.normal_())
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        steps, (last_in, last_out) = block(static_h, static_res)
    for replay in range(20):
        static_h.copy_(make_input(21, replay, 0, tokens * hidden, dtype, dev).view(tokens, hidden))  # same on
        static_res.copy_(make_input(22, replay, 0, tokens * hidden, dtype, dev).view(tokens, hidden))  # every rank
        graph.replay()
        torch.cuda.synchronize()
        for i, (partial, residual_in, residual_out, norm_out) in enumerate(steps):
            again_r, again_n = torch.empty_like(partial), torch.empty_like(partial)
            allreduce_fusion(partial, ws, P.kARResidualRMSNorm, residual_out=again_r, norm_out=again_n,
                             residual_in=residual_in, rms_gamma=gamma[i], rms_eps=1e-6)
            torch.cuda.synchronize()
            what = f"replay {replay} layer {i}"
            assert torch.equal(again_r, residual_out) and torch.equal(again_n, norm_out), what
            everyone = [None] * world
            dist.all_gather_object(everyone, partial.cpu(), group=group)
            r64, r_scale, norm64, norm_scale = add_rmsnorm_float64(everyone, residual_in, gamma[i], 1e-6, 0.0)
            check_within(residual_out, r64, r_scale, f"{what} residual_out")
            check_within(norm_out, norm64, norm_scale, f"{what} norm_out")
        everyone = [None] * world
        dist.all_gather_object(everyone, last_in.cpu(), group=group)
        assert torch.equal(last_out.cpu(), sequential_fp32(everyone, "sum")), f"replay {replay} kAllReduce"
    torch.cuda.synchronize()
    result = digest(last_out)
    del graph
    dist.barrier(group=group)
    ws.destroy()
    return result


def test_cuda_graph_of_a_transformer_like_block_replays_correctly():
    a, b = expect_ok(run_ranks(2, _block, timeout=300))
    assert a == b


def _fake_vllm(module_names):
    """Stand-ins for the vLLM modules rocenante.vllm.communicator imports (vLLM cannot be installed on the GPU
    machine): a CudaCommunicator that all-reduces on its NCCL device group and has no backends of its own to
    capture, and init_logger."""
    import logging

    import torch.distributed as dist

    class CudaCommunicator:
        def __init__(self, cpu_group, device=None, device_group=None, unique_name="", **kw):
            self.cpu_group, self.device, self.device_group, self.unique_name = cpu_group, device, device_group, unique_name
            self.world_size, self.rank = dist.get_world_size(cpu_group), dist.get_rank(cpu_group)
            self.ca_comm = self.fi_pcie_ipc_ar_comm = None
            self.parent_calls = 0

        def all_reduce(self, input_):
            self.parent_calls += 1
            out = input_.clone()
            dist.all_reduce(out, group=self.device_group)
            return out

        def destroy(self):
            pass

    def init_logger(name):
        logger = logging.getLogger(name)
        logger.info_once = lambda msg, *a, scope=None: logger.info(msg, *a)
        logger.warning_once = lambda msg, *a, scope=None: logger.warning(msg, *a)
        return logger

    for name in module_names:
        sys.modules[name] = types.ModuleType(name)
    sys.modules["vllm.distributed.device_communicators.cuda_communicator"].CudaCommunicator = CudaCommunicator
    sys.modules["vllm.logger"].init_logger = init_logger


def _vllm_graph_capture(store, rank, world):
    """vLLM 0.33.0's GroupCoordinator.graph_capture(), step by step: a new stream that waits for the current
    one, the communicator's backends' capture() contexts (none here: rocenante needs none), then the model's
    warm-up and capture on that stream; vLLM's all_reduce is out of place."""
    import torch.distributed as dist

    _fake_vllm(["vllm", "vllm.distributed", "vllm.distributed.device_communicators",
                "vllm.distributed.device_communicators.cuda_communicator", "vllm.logger"])
    from rocenante.vllm.communicator import RocenanteCudaCommunicator

    cpu_group = _init(store, rank, world)
    device_group = dist.new_group(backend="nccl")
    dev = gpus.device_of(rank)
    comm = RocenanteCudaCommunicator(cpu_group, dev, device_group, "tp:0")
    assert comm.rocenante.active, comm.rocenante.why
    small = torch.empty(16, 4096, device=dev, dtype=torch.bfloat16)
    big = torch.empty(comm.rocenante.threshold_bytes // 4 + 1024, device=dev, dtype=torch.float32)

    def model():
        return comm.all_reduce(small * 2), comm.all_reduce(big)

    small.copy_(make_input(30, 0, rank, small.numel(), small.dtype, dev).view_as(small))
    big.fill_(rank + 1)
    model()  # eager, on the default stream, as vLLM's profiling run
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        model()  # vLLM's warm-up runs on the capture stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out_small, out_big = model()
    for replay in range(20):
        per_rank = [make_input(31, replay, r, small.numel(), small.dtype) for r in range(world)]
        small.copy_(per_rank[rank].view_as(small))
        big.fill_(replay + rank)
        graph.replay()
        torch.cuda.synchronize()
        want = sequential_fp32([(x.view_as(small) * 2) for x in per_rank], "sum")
        assert torch.equal(out_small.cpu(), want), f"replay {replay}: rocenante's all-reduce"
        assert torch.equal(out_big, torch.full_like(big, world * replay + world * (world - 1) / 2)), f"replay {replay}"
    calls = comm.parent_calls
    del graph
    torch.cuda.synchronize()
    dist.barrier(group=cpu_group)
    comm.destroy()
    dist.destroy_process_group()
    return calls


@pytest.mark.separate_gpus  # the call over the capacity goes to the device group inside the capture: NCCL's
def test_vllm_graph_capture_stand_in_drives_our_communicator():
    # 3 parent calls per rank (eager, warm-up, capture), all for the tensor over rocenante's capacity.
    assert expect_ok(run_ranks(2, _vllm_graph_capture, timeout=300)) == [3, 3]


def _against_flashinfer(store, rank, world):
    import flashinfer.comm as fi_comm

    from rocenante.flashinfer import AllReduceFusionPattern as P
    from rocenante.flashinfer import allreduce_fusion, create_allreduce_fusion_workspace

    group = _init(store, rank, world)
    dev = gpus.device_of(rank)
    tokens, hidden, dtype = 16, 4096, torch.bfloat16
    ours = create_allreduce_fusion_workspace("rocenante", world, rank, tokens, hidden, dtype, group=group)
    # Never "auto": it picks the multicast path, which must not be used on the GPU machine.
    theirs = fi_comm.create_allreduce_fusion_workspace("trtllm", world, rank, tokens, hidden, dtype, group=group)
    x = make_input(40, 0, rank, tokens * hidden, dtype, dev).view(tokens, hidden)
    res = make_input(41, 0, 0, tokens * hidden, dtype, dev).view(tokens, hidden)
    gamma = make_input(42, 0, 0, hidden, dtype, dev)
    outs = []
    for ws, fn in ((ours, allreduce_fusion), (theirs, fi_comm.allreduce_fusion)):
        r, n = torch.empty_like(x), torch.empty_like(x)
        fn(x, ws, P.kARResidualRMSNorm, residual_out=r, norm_out=n, residual_in=res, rms_gamma=gamma, rms_eps=1e-6,
           fp32_acc=True)
        outs.append((r, n))
    torch.cuda.synchronize()
    ours.destroy()
    theirs.destroy()
    (r0, n0), (r1, n1) = outs
    return (r0.float() - r1.float()).abs().max().item(), (n0.float() - n1.float()).abs().max().item()


@pytest.mark.separate_gpus  # FlashInfer's kernel: one rank per GPU
def test_same_results_as_flashinfers_trtllm_kernel():
    pytest.importorskip("flashinfer.comm", reason="FlashInfer is not installed (it is not on the GPU machine)")
    for residual_diff, norm_diff in expect_ok(run_ranks(2, _against_flashinfer, timeout=300)):
        # bf16: one rounding step of values of order 10 is 2^-4; the sums may round differently (rank order).
        assert residual_diff <= 0.125 and norm_diff <= 0.125, (residual_diff, norm_diff)
