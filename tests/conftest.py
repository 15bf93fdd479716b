"""The one place that decides, for every test, what it needs and whether this machine has it: tests under
tests/gpu get the marker `gpu`, those under tests/rdma the marker `rdma`; a test that cannot run here is skipped
with the reason (`pytest -rs` shows it). Also: the helpers of tests/support on the path, the environment of GPU
tests whose ranks share a GPU, and the `net` fixture (the path a test runs on)."""

import os
import platform
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "support"))

import gpus  # noqa: E402

# Network communicators' proxies poll hot for 5 s after their last work by default (a core each); the tests
# run several ranks on few cores, so theirs nap after 2 ms (inherited by every rank they start).
os.environ.setdefault("ROCENANTE_PROXY_SPIN_S", "0.002")

FOLDER_MARKERS = {"gpu": pytest.mark.gpu, "rdma": pytest.mark.rdma}
SHARED_GPU_ENV = "ROCENANTE_TEST_SHARED_GPU"
# ELF e_machine of the extension, as its header says (an emulated run must not quietly test a build for the host).
ELF_MACHINES = {0x3E: "x86_64", 0xB7: "aarch64"}


def _extension_machine() -> str:
    from rocenante import _C

    with open(_C.__file__, "rb") as f:
        code = int.from_bytes(f.read(20)[18:20], "little")
    return ELF_MACHINES.get(code, f"ELF machine {code:#x}")


def pytest_report_header(config):
    from rocenante import _C

    return f"rocenante._C: {_C.__file__}, built for {_extension_machine()}; running on {platform.machine()}"


def pytest_sessionstart(session):
    """ROCENANTE_TEST_MACHINE=aarch64 (tests/aarch64/suite.sh): the run stops unless both this Python and the
    extension are aarch64's."""
    want = os.environ.get("ROCENANTE_TEST_MACHINE")
    if want and (platform.machine(), _extension_machine()) != (want, want):
        raise pytest.UsageError(f"ROCENANTE_TEST_MACHINE={want}, but Python runs on {platform.machine()} and the "
                                f"extension is built for {_extension_machine()}")


def world_of(item) -> int:
    """The number of ranks a test runs: its `world` parameter, else separate_gpus(world=N), else 2."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "world" in callspec.params:
        return int(callspec.params["world"])
    marker = item.get_closest_marker("separate_gpus")
    if marker is not None and "world" in marker.kwargs:
        return int(marker.kwargs["world"])
    return 2


def _rdma_skip_reason():
    """Why RDMA tests cannot run here, or None."""
    from rocenante import _C, _ib

    if not _C.with_ibverbs:
        return "rocenante was built without rdma-core's headers (install libibverbs-dev and rebuild)"
    if not any(p.state == "ACTIVE" and p.link_layer == "Ethernet" for p in _ib.scan()):
        return "no ACTIVE RoCE port on this machine: run them in the SoftRoCE VM (tests/rdma/run_in_vm.sh)"
    return None


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker, so that `-m gpu` finds tests/gpu
def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = os.path.relpath(str(item.path), HERE).split(os.sep)[0]
        if folder in FOLDER_MARKERS:
            item.add_marker(FOLDER_MARKERS[folder])
    count = gpus.count()
    rdma_reason = _rdma_skip_reason() if any(item.get_closest_marker("rdma") for item in items) else None
    for item in items:
        separate = item.get_closest_marker("separate_gpus") is not None
        if item.get_closest_marker("gpu") is not None or separate:
            world = world_of(item)
            if count == 0:
                why = "needs a CUDA GPU, this machine has none: GPU tests run on a GPU machine (tests/README.md)"
                item.add_marker(pytest.mark.skip(reason=why))
            elif separate and count < world:
                item.add_marker(pytest.mark.skip(
                    reason=f"needs {world} GPUs, one per rank; this machine has {count}"))
        if rdma_reason is not None and item.get_closest_marker("rdma") is not None:
            item.add_marker(pytest.mark.skip(reason=rdma_reason))


@pytest.fixture(autouse=True)
def _ranks_share_a_gpu(request, monkeypatch):
    """A GPU test with more ranks than this machine has GPUs runs them on shared GPUs (tests/support/gpus.py):
    ROCENANTE_TEST_SHARED_GPU=1 for its ranks (run_ranks passes it on) lets startup's agreement accept that and makes
    the backend's CUDA delegate gloo, since NCCL refuses two ranks on one device."""
    if request.node.get_closest_marker("gpu") is None:
        return
    if gpus.shared(world_of(request.node)):
        monkeypatch.setenv(SHARED_GPU_ENV, "1")
    else:
        monkeypatch.delenv(SHARED_GPU_ENV, raising=False)


@pytest.fixture(params=["", "tcp"], ids=["direct", "tcp"])
def net(request, monkeypatch):
    """The path a test's ranks take, as ROCENANTE_NET (run_ranks passes it on): "" peers on this host directly (shared
    memory with CPU tensors, CUDA IPC with GPU tensors), "tcp" every peer through the TCP software wire on loopback
    (the network path). A test asking for `net` runs on both; @pytest.mark.parametrize("net", ..., indirect=True)
    picks its own."""
    if request.param:
        monkeypatch.setenv("ROCENANTE_NET", request.param)
    else:
        monkeypatch.delenv("ROCENANTE_NET", raising=False)
    return request.param
