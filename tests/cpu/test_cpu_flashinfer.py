"""rocenante.flashinfer on CPU processes: the PCIe-IPC-workspace face, FlashInfer's unified pair with
backend="rocenante" (both patterns, against the float64 reference and bitwise across ranks), the CommBackend
bootstrap, refusals; and, where flashinfer-python is installed, the signatures against FlashInfer's own and
install() leaving FlashInfer's backends untouched."""

from __future__ import annotations

import inspect

import pytest
import torch

from multiproc import expect_ok, run_ranks
from reference import add_rmsnorm_float64, check_within, digest, make_input, poison, sequential_fp32


def _init(store, rank, world):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world)
    return dist.group.WORLD


class DictCommBackend:
    """A FlashInfer CommBackend (structural: Get_rank, Get_size, allgather, bcast, barrier, Split) over
    torch.distributed, written here so that the bootstrap is tested without FlashInfer installed."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist

    def Get_rank(self):
        return self.dist.get_rank()

    def Get_size(self):
        return self.dist.get_world_size()

    def allgather(self, data):
        out = [None] * self.Get_size()
        self.dist.all_gather_object(out, data)
        return tuple(out)

    def bcast(self, data, root):
        box = [data]
        self.dist.broadcast_object_list(box, src=root)
        return box[0]

    def barrier(self):
        self.dist.barrier()

    def Split(self, color, key):
        raise NotImplementedError


def _workspace_face(store, rank, world):
    import rocenante
    from rocenante.flashinfer import ONESHOT, PcieIpcAllReduceWorkspace

    group = _init(store, rank, world)
    with PcieIpcAllReduceWorkspace(group=group, max_numel=4096, dtype=torch.bfloat16) as ws:
        inputs = [make_input(1, 0, r, 3000, torch.bfloat16) for r in range(world)]
        assert ws.supports(inputs[rank]) and not ws.supports(torch.zeros(4097, dtype=torch.bfloat16))
        assert ws.supports(torch.zeros(2048, dtype=torch.float32))  # bytes bind, as in FlashInfer
        assert not ws.supports(torch.zeros(2, 3, dtype=torch.bfloat16).t())  # not contiguous
        with pytest.raises(ValueError, match="workspace was built on cpu"):
            ws.supports(torch.zeros(8, device="meta"))
        out = poison(torch.empty(3000, dtype=torch.bfloat16))
        got = ws.all_reduce(inputs[rank], out=out, enable_pdl=True)
        assert got is out and torch.equal(out, sequential_fp32(inputs, "sum"))
        fresh = ws.all_reduce(inputs[rank])
        assert torch.equal(fresh, out)
        with pytest.raises(ValueError, match="config="):
            ws.all_reduce(inputs[rank], config=object())
        with pytest.raises(ValueError, match="check supports"):
            ws.all_reduce(torch.zeros(4097, dtype=torch.bfloat16))
        assert ws.prepare([(1, 4096), (2, 4096)]) == {(1, 4096): ONESHOT, (2, 4096): None}
        assert ws.tune([4096]) == {}
        ws.rebind_stream()
        digests = digest(out)
    with pytest.raises(RuntimeError, match="destroyed"):
        ws.all_reduce(inputs[rank])
    ws.destroy()  # idempotent
    # A bad argument on one rank only: every rank raises, naming it.
    try:
        PcieIpcAllReduceWorkspace(group, max_numel=4096 if rank == 0 else -1)
        raised = None
    except rocenante.RocenanteError as err:
        raised = str(err)
    return digests, raised


def test_workspace_face_on_a_process_group():
    results = expect_ok(run_ranks(2, _workspace_face, timeout=240))
    assert results[0][0] == results[1][0]  # bitwise identical on every rank
    for _, raised in results:
        assert raised is not None and "rank 1: max_numel=-1 (must be positive)" in raised, raised


def _fusion(store, rank, world, bootstrap):
    from rocenante.flashinfer import AllReduceFusionPattern as P
    from rocenante.flashinfer import allreduce_fusion, create_allreduce_fusion_workspace

    group = _init(store, rank, world)
    tokens, hidden = 5, 96
    kw = {"comm_backend": DictCommBackend()} if bootstrap == "comm_backend" else {"group": group}
    ws = create_allreduce_fusion_workspace("rocenante", world, rank, 8, hidden, torch.float32, **kw)
    assert ws.backend == "rocenante" and (ws.world_size, ws.rank) == (world, rank)
    assert ws.is_buffer_size_sufficient(world, 16, hidden, torch.bfloat16)
    assert not ws.is_buffer_size_sufficient(world, 9, hidden, torch.float32)
    digests = []
    for case, (dtype, weight_bias) in enumerate([(torch.float32, 0.0), (torch.bfloat16, 1.0), (torch.float16, 0.0)]):
        xs = [make_input(2, case, r, tokens * hidden, dtype).view(tokens, hidden) for r in range(world)]
        residual = make_input(3, case, 0, tokens * hidden, dtype).view(tokens, hidden)  # the same on every rank
        gamma = make_input(4, case, 0, hidden, dtype)
        out = poison(torch.empty_like(xs[rank]))
        assert allreduce_fusion(xs[rank], ws, P.kAllReduce, output=out) is out
        summed_exact = sequential_fp32([x.flatten() for x in xs], "sum").view(tokens, hidden)
        assert torch.equal(out, summed_exact)
        untouched, residual_out, norm_out = (poison(torch.empty_like(out)) for _ in range(3))
        got = allreduce_fusion(xs[rank], ws, P.kARResidualRMSNorm, output=untouched, residual_out=residual_out,
                               norm_out=norm_out, residual_in=residual, rms_gamma=gamma, rms_eps=1e-5,
                               weight_bias=weight_bias, launch_with_pdl=True, use_oneshot=False, fp32_acc=True)
        assert got is norm_out and torch.isnan(untouched).all(), "output is not written by kARResidualRMSNorm"
        # FlashInfer's rounding points, emulated: the all-reduce rounded, the add rounded, the norm in fp32.
        r_want = (summed_exact.float() + residual.float()).to(dtype)
        assert torch.equal(residual_out, r_want)
        r64, r_scale, norm64, norm_scale = add_rmsnorm_float64(xs, residual, gamma, 1e-5, weight_bias)
        check_within(residual_out, r64, r_scale, f"residual_out {dtype}")
        check_within(norm_out, norm64, norm_scale, f"norm_out {dtype}")
        # In place on the residual (residual_out is residual_in), outputs allocated when omitted.
        inplace = residual.clone()
        again = allreduce_fusion(xs[rank], ws, P.kARResidualRMSNorm, residual_out=inplace, residual_in=inplace,
                                 rms_gamma=gamma, rms_eps=1e-5, weight_bias=weight_bias)
        assert torch.equal(inplace, residual_out) and torch.equal(again, norm_out)
        digests += [digest(residual_out), digest(norm_out)]
    ws.destroy()
    return digests


@pytest.mark.parametrize("bootstrap", ["group", "comm_backend"])
def test_fusion_patterns_against_float64_and_bitwise_across_ranks(bootstrap):
    results = expect_ok(run_ranks(3, _fusion, bootstrap, timeout=240))
    assert results[0] == results[1] == results[2]


def _refusals(store, rank, world):
    import rocenante
    from rocenante.flashinfer import AllReduceFusionPattern as P
    from rocenante.flashinfer import allreduce_fusion, create_allreduce_fusion_workspace

    group = _init(store, rank, world)
    with pytest.raises(ValueError, match="does not take top_k, rms_eps"):
        create_allreduce_fusion_workspace("rocenante", world, rank, 8, 64, torch.float32, top_k=2, rms_eps=1e-5)
    ws = create_allreduce_fusion_workspace("rocenante", world, rank, 8, 64, torch.float32, group=group)
    x = torch.ones(2, 64)
    for kwargs, named in [({"pattern": 2}, "pattern 2"), ({"pattern": 0, "quant_out": x}, "quant_out"),
                          ({"pattern": 1, "scale_factor": 1.0}, "scale_factor"),
                          ({"pattern": 7, "moe_finalize_backend": "cake"}, "moe_finalize_backend"),
                          ({"pattern": 1}, "needs residual_in and rms_gamma")]:
        with pytest.raises(ValueError, match=named):
            allreduce_fusion(x, ws, **kwargs)
    # The fused kernel is for GPUs: on CPU the plugin runs the all-reduce and torch's ops (above), and asking
    # the communicator for the fused call directly is refused alike on every rank.
    comm = ws.allreduce._alive()
    assert not comm.fuses_add_rmsnorm(x, torch.ones(64))
    with pytest.raises(ValueError, match="all_reduce_add_rmsnorm does not serve"):
        comm.all_reduce_add_rmsnorm(x, x, torch.ones(64))
    # Every refusal above happens before the all-reduce: the communicator is still usable.
    assert torch.equal(allreduce_fusion(x, ws, P.kAllReduce), torch.full_like(x, world))
    ws.destroy()
    with pytest.raises(rocenante.ClosedError):
        comm.all_reduce_add_rmsnorm(x, x, torch.ones(64))
    # world_size= / rank= that are not the group's, on one rank: every rank raises, naming it.
    try:
        create_allreduce_fusion_workspace("rocenante", world, rank if rank == 0 else 5, 8, 64, torch.float32,
                                          group=group)
        mismatch = None
    except rocenante.RocenanteError as err:
        mismatch = str(err)
    return mismatch


def test_refusals_name_the_argument_and_rank_mismatch_is_agreed():
    for mismatch in expect_ok(run_ranks(2, _refusals, timeout=240)):
        assert mismatch is not None and "rank 1: rank=5, but the process group / comm_backend has rank 1" in mismatch


def test_other_backends_need_flashinfer():
    from rocenante.flashinfer import allreduce_fusion, create_allreduce_fusion_workspace

    try:
        import flashinfer.comm  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="create_allreduce_fusion_workspace: .*FlashInfer is not installed"):
            create_allreduce_fusion_workspace("trtllm", 2, 0, 8, 64, torch.bfloat16)
        with pytest.raises(ValueError, match="allreduce_fusion: .*FlashInfer is not installed"):
            allreduce_fusion(torch.ones(2), object(), 0)
    else:
        pytest.skip("FlashInfer is installed: test_install_leaves_flashinfer_backends_untouched covers this")


def test_rocenante_imports_without_flashinfer_or_vllm():
    import subprocess
    import sys

    code = ("import sys, rocenante, rocenante.flashinfer, rocenante.vllm; "
            "print(sorted(m for m in ('flashinfer', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---- against the real flashinfer-python (skipped where it is not installed) ----


def _params(fn):
    """(name, kind, default) of every parameter: annotations differ by design (backend adds "rocenante")."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_signatures_match_the_installed_flashinfer():
    fi_comm = pytest.importorskip("flashinfer.comm", reason="flashinfer-python is not installed")
    import rocenante.flashinfer as ours

    import flashinfer

    def same(mine, theirs, what):
        mine, theirs = _params(mine), _params(theirs)
        if flashinfer.__version__ == "0.7.4":  # the version rocenante.flashinfer follows: exactly its signatures
            assert mine == theirs, what
        else:  # an older 0.7.x lacks parameters 0.7.4 added at the end, with defaults
            extra = mine[len(theirs):]
            assert mine[:len(theirs)] == theirs and all(d is not inspect.Parameter.empty for _, _, d in extra), what

    same(ours.create_allreduce_fusion_workspace, fi_comm.create_allreduce_fusion_workspace, "create")
    same(ours.allreduce_fusion, fi_comm.allreduce_fusion, "allreduce_fusion")
    theirs = fi_comm.PcieIpcAllReduceWorkspace
    for method in ("__init__", "supports", "all_reduce", "prepare", "tune", "rebind_stream", "destroy",
                   "__enter__", "__exit__"):
        same(getattr(ours.PcieIpcAllReduceWorkspace, method), getattr(theirs, method), method)
    for name in ("kAllReduce", "kARResidualRMSNorm"):
        assert getattr(ours.AllReduceFusionPattern, name) == getattr(fi_comm.AllReduceFusionPattern, name)


def _install(store, rank, world):
    import flashinfer.comm as fi_comm
    from flashinfer.comm import allreduce as defining
    from flashinfer.comm.comm_backend import TorchDistBackend

    import rocenante.flashinfer

    x = torch.ones(4, 64)
    # FlashInfer's own answers before install(), for another backend's workspace and for a backend name.
    before = []
    for call in (lambda: fi_comm.allreduce_fusion(x, object(), 0),
                 lambda: fi_comm.create_allreduce_fusion_workspace("no-such-backend", world, rank, 8, 64, x.dtype)):
        try:
            call()
        except Exception as err:
            before.append((type(err), str(err)))
    seen = []
    spies = {}
    for name in ("create_allreduce_fusion_workspace", "allreduce_fusion"):
        real = getattr(defining, name)
        spies[name] = lambda *a, _n=name, _real=real, **k: (seen.append((_n, a, k)), _real(*a, **k))[1]
        setattr(defining, name, spies[name])
    rocenante.flashinfer.install()
    rocenante.flashinfer.install()  # idempotent: FlashInfer's functions stay the ones kept the first time
    assert fi_comm.allreduce_fusion is defining.allreduce_fusion is rocenante.flashinfer.allreduce_fusion
    assert fi_comm.create_allreduce_fusion_workspace is rocenante.flashinfer.create_allreduce_fusion_workspace
    after = []
    for call in (lambda: fi_comm.allreduce_fusion(x, object(), 0),
                 lambda: fi_comm.create_allreduce_fusion_workspace("no-such-backend", world, rank, 8, 64, x.dtype)):
        try:
            call()
        except Exception as err:
            after.append((type(err), str(err)))
    assert after == before and len(before) == 2, (before, after)
    # FlashInfer's functions got the caller's arguments, every one at its place.
    (name1, args1, kw1), (name2, args2, kw2) = seen
    assert name1 == "allreduce_fusion" and args1[:3] == (x, args1[1], 0) and kw1 == {"moe_finalize_backend": "trtllm"}
    assert name2 == "create_allreduce_fusion_workspace" and args2[:6] == ("no-such-backend", world, rank, 8, 64,
                                                                            x.dtype)
    # The patched names serve rocenante, through FlashInfer's own CommBackend.
    group = _init(store, rank, world)
    ws = fi_comm.create_allreduce_fusion_workspace(backend="rocenante", world_size=world, rank=rank,
                                                   max_token_num=8, hidden_dim=64, dtype=torch.float32,
                                                   comm_backend=TorchDistBackend(group=group))
    out = fi_comm.allreduce_fusion(input=torch.full((4, 64), float(rank + 1)), workspace=ws,
                                   pattern=fi_comm.AllReduceFusionPattern.kAllReduce)
    ws.destroy()
    return torch.equal(out, torch.full((4, 64), float(world * (world + 1) // 2)))


def test_install_leaves_flashinfer_backends_untouched():
    pytest.importorskip("flashinfer.comm", reason="flashinfer-python is not installed")
    assert expect_ok(run_ranks(2, _install, timeout=240)) == [True, True]


def _wrong_device_on_one_rank(store, rank, world):
    import time

    import rocenante
    from rocenante.flashinfer import PcieIpcAllReduceWorkspace

    group = _init(store, rank, world)
    ws = PcieIpcAllReduceWorkspace(group, max_numel=1024, dtype=torch.float32)
    x = torch.ones(1000, device="meta" if rank == 1 else "cpu")  # a bug only rank 1 can see
    start = time.monotonic()
    try:
        ws.all_reduce(x)
        raised = None
    except (ValueError, rocenante.RocenanteError) as err:  # InvalidArgument is a ValueError
        raised = (type(err).__name__, str(err))
    return raised, time.monotonic() - start


def _fusion_refused_on_one_rank(store, rank, world, wrong):
    """kARResidualRMSNorm where rank 1's tensors do not fit (`wrong`), a bug only rank 1 can see."""
    import time

    import rocenante
    from rocenante.flashinfer import AllReduceFusionPattern as P
    from rocenante.flashinfer import allreduce_fusion, create_allreduce_fusion_workspace

    group = _init(store, rank, world)
    ws = create_allreduce_fusion_workspace("rocenante", world, rank, 8, 64, torch.float32, group=group)
    x, residual, gamma = torch.ones(2, 64), torch.zeros(2, 64), torch.ones(64)
    if rank == 1:
        if wrong == "meta input":
            x = torch.ones(2, 64, device="meta")
        elif wrong == "strided input":
            x = torch.ones(64, 2).t()
        elif wrong == "residual shape":
            residual = torch.zeros(3, 64)
        else:
            gamma = torch.ones(63)
    start = time.monotonic()
    try:
        allreduce_fusion(x, ws, P.kARResidualRMSNorm, residual_in=residual, rms_gamma=gamma)
        raised = None
    except (ValueError, rocenante.RocenanteError) as err:
        raised = (type(err).__name__, str(err))
    return raised, time.monotonic() - start


@pytest.mark.parametrize("wrong, named", [("meta input", "input is on meta"), ("strided input", "contiguous"),
                                          ("residual shape", "residual_in must be"), ("gamma", "rms_gamma must")])
def test_a_fused_call_that_does_not_fit_on_one_rank_fails_every_rank_at_once(wrong, named):
    (err0, t0), (err1, t1) = expect_ok(run_ranks(2, _fusion_refused_on_one_rank, wrong, timeout=240))
    assert err1 is not None and err1[0] == "InvalidArgument" and named in err1[1], err1
    assert err0 is not None and "rank 1" in err0[1], err0
    assert t0 < 30, f"rank 0 learned of it after {t0:.1f} s (its timeout is 300 s)"


def test_a_tensor_on_the_wrong_device_on_one_rank_fails_every_rank_at_once():
    (err0, t0), (err1, t1) = expect_ok(run_ranks(2, _wrong_device_on_one_rank, timeout=240))
    assert err1[0] == "InvalidArgument" and "input is on meta but the workspace was built on cpu" in err1[1], err1
    assert err0 is not None and "rank 1" in err0[1], err0
    assert t0 < 30, f"rank 0 learned of it after {t0:.1f} s (its timeout is 300 s)"
