"""The vLLM plugin on CPU processes: the router (vLLM-free) against the reference; and, where vLLM is installed
(it is not in CI: see tests/README.md), its plugin loader finding the entry point, register() patching the platform's
communicator factory (or saying why not), and RocenanteCudaCommunicator routing within vLLM's real class."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from multiproc import expect_ok, run_ranks
from reference import bits, make_input, random_bits, reduced, sequential_fp32

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _init(store, rank, world):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world)
    return dist.group.WORLD


def _router(store, rank, world, disable_on):
    import torch.distributed as dist

    from rocenante.vllm.router import AllReduceRouter

    if rank == disable_on:
        os.environ["ROCENANTE_DISABLE"] = "1"
    group = _init(store, rank, world)
    other = AllReduceRouter.start(group, torch.device("cpu"), "pp:0")  # no collective: a rank may skip it
    assert not other.active and "is not one rocenante serves" in other.why
    stateless = dist.new_group(backend="gloo")  # as elastic EP's, a group torch.distributed does not know
    dist.distributed_c10d._world.pg_map.pop(stateless)
    other = AllReduceRouter.start(stateless, torch.device("cpu"), "ep:0")
    assert not other.active and "stateless group" in other.why
    router = AllReduceRouter.start(group, torch.device("cpu"), "dp:0")  # the all2all manager's group
    if not router.active:
        return router.why
    inputs = [make_input(5, 0, r, 4 * 1000, torch.bfloat16).view(4, 1000) for r in range(world)]
    got = router.all_reduce(inputs[rank])
    assert torch.equal(got, sequential_fp32([x.flatten() for x in inputs], "sum").view(4, 1000))
    strided = inputs[rank].t()  # not contiguous: served, on a contiguous copy
    assert torch.equal(router.all_reduce(strided), got.t())
    assert router.all_reduce(torch.ones(3, dtype=torch.float64)) is None  # dtype: vLLM's backends
    assert router.all_reduce(torch.ones(router.threshold_bytes // 4 + 1)) is None  # over the threshold: vLLM's backends
    _gathers_and_scatters(router, rank, world)
    router.close()
    return router.why


def _gathers_and_scatters(router, rank, world):
    """vLLM's all_gather and reduce_scatter along a dim, bit for bit against concatenations of every rank's input
    and the rank-order reduction; what the router does not serve comes back None (vLLM's own then)."""
    shards = [random_bits(6, 0, r, 3 * 5 * 7, torch.float16).view(3, 5, 7) for r in range(world)]
    for dim in (0, 1, -1):
        got = router.all_gather(shards[rank].transpose(0, 2).contiguous().transpose(0, 2), dim)  # strided, same values
        assert torch.equal(bits(got), bits(torch.cat(shards, dim=dim))), f"all_gather along {dim}"
    inputs = [make_input(7, 0, r, 6 * world * 5, torch.bfloat16).view(6 * world, 5) for r in range(world)]
    whole = reduced([x.flatten() for x in inputs], "sum").view(6 * world, 5)
    assert torch.equal(bits(router.reduce_scatter(inputs[rank], 0)), bits(whole.chunk(world, 0)[rank]))
    wide = [x.t() for x in inputs]  # along dim 1 (= -1) of a 2-D tensor, as vLLM's own moves it
    assert torch.equal(bits(router.reduce_scatter(wide[rank], -1)), bits(whole.t().chunk(world, 1)[rank]))
    assert router.reduce_scatter(torch.ones(2, world, 3), 1) is None  # 3-D along dim 1: vLLM's own
    assert router.reduce_scatter(torch.ones(world + 1, 4), 0) is None  # does not split evenly
    assert router.all_gather(torch.ones(3, dtype=torch.float64), 0) is None  # dtype
    assert router.all_gather(torch.ones(router.threshold_bytes // 4 // world + 1), 0) is None  # gathered: too big
    # vLLM's all2all manager (AgRsAll2AllManager): all_gatherv of a tensor or a list, reduce_scatterv(_into_output),
    # served for equal sizes; unequal ones (and a dim other than 0) go to vLLM's own.
    tokens = [random_bits(8, 0, r, 4 * 6, torch.bfloat16).view(4, 6) for r in range(world)]
    logits = [random_bits(8, 1, r, 4 * 3, torch.float32).view(4, 3) for r in range(world)]
    got = router.all_gatherv([tokens[rank], logits[rank]], 0, [4] * world)
    assert torch.equal(bits(got[0]), bits(torch.cat(tokens))) and torch.equal(bits(got[1]), bits(torch.cat(logits)))
    assert torch.equal(bits(router.all_gatherv(tokens[rank], 0, None)), bits(torch.cat(tokens)))
    assert router.all_gatherv(tokens[rank], 0, [4] * (world - 1) + [3]) is None
    assert router.all_gatherv(tokens[rank], 1, None) is None
    assert torch.equal(bits(router.reduce_scatterv(inputs[rank], 0, [6] * world)), bits(whole.chunk(world, 0)[rank]))
    output = torch.full((6, 5), float("nan"), dtype=torch.bfloat16)
    assert router.reduce_scatterv(inputs[rank], 0, None, output) is output
    assert torch.equal(bits(output), bits(whole.chunk(world, 0)[rank]))
    assert router.reduce_scatterv(inputs[rank], 0, [5] + [6] * (world - 2) + [7]) is None


def test_router_serves_eligible_all_reduces():
    for why in expect_ok(run_ranks(2, _router, None, timeout=240)):
        assert why == "self-test passed on every rank"


def test_router_off_on_every_rank_when_one_rank_is_disabled():
    for why in expect_ok(run_ranks(2, _router, 1, timeout=240)):
        assert why == "rank 1: disabled by ROCENANTE_DISABLE=1"


def _python(env: dict, *parts: str) -> subprocess.CompletedProcess:
    """Runs the parts (each dedented) as one program in a fresh interpreter that imports what this one does
    (an installed rocenante, or the source tree with its built extension)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **env}
    code = "\n".join(textwrap.dedent(p) for p in parts)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_register_without_the_variable_imports_nothing():
    out = _python({"ROCENANTE_VLLM": "0"}, """
        import sys, rocenante.vllm
        rocenante.vllm.register()
        print('vllm' in sys.modules)
    """)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_pyproject_declares_the_entry_point():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"rocenante": "rocenante.vllm:register"}


# ---- against vLLM's own modules (skipped where vLLM is not installed) ----

vllm_needed = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import vllm.plugins"], capture_output=True).returncode != 0,
    reason="vLLM is not installed (its wheel needs a CUDA torch; see tests/README.md, 'The vLLM tests', for the venv the tests ran in)")

# A platform that builds vLLM's CudaCommunicator, as CudaPlatform does (which needs libcuda to import).
FAKE_CUDA_PLATFORM = """
    import vllm.platforms
    from vllm.platforms.interface import Platform, PlatformEnum

    class FakeCudaPlatform(Platform):
        _enum = PlatformEnum.CUDA
        device_name = device_type = "cuda"

        @classmethod
        def get_device_communicator_cls(cls):
            return "vllm.distributed.device_communicators.cuda_communicator.CudaCommunicator"

    vllm.platforms._current_platform = FakeCudaPlatform()
"""


@vllm_needed
def test_vllm_plugin_loader_finds_the_entry_point_and_the_factory_returns_ours(tmp_path):
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        points = tomllib.load(f)["project"]["entry-points"]["vllm.general_plugins"]
    # The entry point as an installed rocenante declares it (pip install . writes the same file).
    info = tmp_path / "rocenante-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rocenante\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()))
    out = _python({"PYTHONPATH": str(tmp_path), "ROCENANTE_VLLM": "1"}, FAKE_CUDA_PLATFORM, """
        import logging, vllm.plugins
        from vllm.platforms import current_platform
        from vllm.utils.import_utils import resolve_obj_by_qualname
        from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
        found = vllm.plugins.load_plugins_by_group(vllm.plugins.DEFAULT_PLUGINS_GROUP)
        print("found", "rocenante" in found, found["rocenante"].__module__, found["rocenante"].__name__)
        vllm.plugins.load_general_plugins()
        name = current_platform.get_device_communicator_cls()
        cls = resolve_obj_by_qualname(name)
        print("factory", name, issubclass(cls, CudaCommunicator))
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "found True rocenante.vllm register" in out.stdout, out.stdout
    assert "factory rocenante.vllm.communicator.RocenanteCudaCommunicator True" in out.stdout, out.stdout


@vllm_needed
@pytest.mark.parametrize("case", ["not cuda", "no hook"])
def test_register_says_why_it_does_nothing(case):
    setup = [] if case == "not cuda" else [  # "no hook": another vLLM, whose platforms lack the method
        FAKE_CUDA_PLATFORM, "del FakeCudaPlatform.get_device_communicator_cls, Platform.get_device_communicator_cls"]
    env = {"ROCENANTE_VLLM": "1", "VLLM_TARGET_DEVICE": "cpu" if case == "not cuda" else ""}
    out = _python(env, *setup, """
        import logging
        logging.basicConfig(level=logging.INFO)
        import rocenante.vllm
        rocenante.vllm.register()
        from vllm.platforms import current_platform
        print("patched", getattr(type(current_platform), "get_device_communicator_cls", lambda: None)()
              == rocenante.vllm.COMMUNICATOR)
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "patched False" in out.stdout
    want = "has no platform get_device_communicator_cls" if case == "no hook" else "not vLLM's CudaCommunicator"
    assert want in out.stderr and "the rocenante plugin does nothing" in out.stderr, out.stderr[-3000:]


def _subclass(store, rank, world):
    """RocenanteCudaCommunicator in vLLM's real class hierarchy, with CudaCommunicator's constructor and
    all_reduce (which need CUDA and NCCL) replaced by CPU stand-ins."""
    import logging

    import torch.distributed as dist
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    records = []
    logging.getLogger("vllm.rocenante").addHandler(logging.Handler())
    logging.getLogger("vllm.rocenante").handlers[-1].emit = lambda r: records.append(r.getMessage())
    logging.getLogger("vllm.rocenante").setLevel(logging.INFO)

    def init(self, cpu_group, device=None, device_group=None, unique_name="", **kw):
        self.cpu_group, self.device, self.unique_name = cpu_group, device, unique_name
        self.world_size, self.rank = dist.get_world_size(cpu_group), dist.get_rank(cpu_group)
        self.parent_calls = 0

    def parent_all_reduce(self, x):
        self.parent_calls += 1
        out = x.clone()
        dist.all_reduce(out, group=self.cpu_group)
        return out

    def parent_all_gatherv(self, input_, dim=0, sizes=None):  # vLLM's own, as gloo would do it; counted only for
        self.parent_calls += 1                                  # unequal sizes
        if sizes is not None and len(set(sizes)) > 1:
            return input_
        outs = []
        for x in [input_] if isinstance(input_, torch.Tensor) else input_:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x, group=self.cpu_group)
            outs.append(torch.cat(parts))
        return outs[0] if isinstance(input_, torch.Tensor) else outs

    CudaCommunicator.__init__, CudaCommunicator.all_reduce = init, parent_all_reduce
    CudaCommunicator.all_gatherv = parent_all_gatherv
    CudaCommunicator.destroy = lambda self: None
    from rocenante.vllm.communicator import RocenanteCudaCommunicator

    group = _init(store, rank, world)
    comm = RocenanteCudaCommunicator(cpu_group=group, device=torch.device("cpu"), device_group=group,
                                     unique_name="tp:0", use_all2all=False)
    x = torch.full((8, 64), float(rank + 1), dtype=torch.bfloat16)
    small = comm.all_reduce(x)
    calls_after_small = comm.parent_calls
    big = comm.all_reduce(torch.ones(comm.rocenante.threshold_bytes // 4 + 1))
    comm.destroy()
    assert torch.equal(small, torch.full_like(x, world * (world + 1) / 2)) and torch.equal(big, torch.full_like(big, world))
    # The data-parallel group, as vLLM's AgRsAll2AllManager uses it: dispatch (all_gatherv of the hidden states and
    # the router logits) and combine (reduce_scatterv_into_output), equal sizes on rocenante, unequal on vLLM's.
    dp = RocenanteCudaCommunicator(cpu_group=group, device=torch.device("cpu"), device_group=group,
                                   unique_name="dp:0", use_all2all=True)
    hidden, logits = torch.full((3, 16), float(rank), dtype=torch.bfloat16), torch.full((3, 4), float(rank))
    gathered = dp.all_gatherv([hidden, logits], dim=0, sizes=[3] * world)
    combined = torch.empty(3, 16, dtype=torch.bfloat16)
    dp.reduce_scatterv_into_output(gathered[0], combined, dim=0, sizes=[3] * world)
    served = dp.parent_calls
    dp.all_gatherv(torch.ones(rank + 1, 2), dim=0, sizes=list(range(1, world + 1)))  # unequal: vLLM's own
    dp.destroy()
    ranks = torch.arange(world, dtype=torch.float32).repeat_interleave(3)[:, None]
    assert torch.equal(gathered[0], ranks.expand(-1, 16).to(torch.bfloat16)) and torch.equal(gathered[1], ranks.expand(-1, 4))
    assert torch.equal(combined, torch.full_like(combined, world * rank))  # rank r's rows of the sum: world x r
    assert (served, dp.parent_calls) == (0, 1), (served, dp.parent_calls)
    return calls_after_small, comm.parent_calls, records


def _stateless_group(store, rank, world):
    """vLLM's StatelessGroupCoordinator (elastic EP's DP/EP/EPLB groups) on a CUDA platform with the plugin
    registered, CudaCommunicator's constructor replaced by a CPU stand-in as in _subclass."""
    import vllm.platforms  # noqa: F401
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    os.environ["ROCENANTE_VLLM"] = "1"
    exec(textwrap.dedent(FAKE_CUDA_PLATFORM), {})
    import rocenante.vllm

    rocenante.vllm.register()

    def init(self, cpu_group, device=None, device_group=None, unique_name="", **kw):
        self.cpu_group, self.device, self.unique_name, self.extra = cpu_group, device, unique_name, sorted(kw)
        self.world_size = world

    CudaCommunicator.__init__, CudaCommunicator.destroy = init, lambda self: None
    from vllm.distributed.stateless_coordinator import StatelessGroupCoordinator

    coordinator = StatelessGroupCoordinator([list(range(world))], rank, "gloo", True, store, group_name="ep",
                                            global_rank=rank, global_world_size=world)
    comm = coordinator.device_communicator
    described = (type(comm).__name__, isinstance(comm, CudaCommunicator), comm.rocenante.active, comm.rocenante.why,
                 comm.extra)
    coordinator.destroy()
    return described


@vllm_needed
def test_elastic_ep_stateless_groups_build_with_the_plugin():
    for name, is_cuda_communicator, active, why, extra in expect_ok(run_ranks(2, _stateless_group, timeout=240)):
        assert name == "RocenanteCudaCommunicator" and is_cuda_communicator
        assert not active and "stateless group" in why, why  # serves nothing there: vLLM's backends do
        assert extra == ["global_ranks", "global_world_size", "tcp_store_group", "use_all2all"], extra  # passed on


@vllm_needed
def test_our_communicator_routes_within_vllms_class():
    results = expect_ok(run_ranks(2, _subclass, timeout=240))
    for small_calls, all_calls, _ in results:
        assert (small_calls, all_calls) == (0, 1)  # the small one on rocenante, the big one on vLLM's backends
    records = results[0][2]  # vLLM logs "global" lines once, on the first rank
    assert any("Using rocenante all-reduce ahead of those backends for group 'tp:0': sum all-reduces" in r
               for r in records), records
