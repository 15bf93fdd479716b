"""PyTorch's own torch.distributed test suite (torch/testing/_internal/distributed/distributed_test.py) with the
"rocenante" backend in gloo's place, on CPU processes. Not part of the default run (its name is no test_*.py):

    pip install expecttest
    WORLD_SIZE=2 python -m pytest -q tests/torch_suite.py     # 2, 4 or 8: 285 tests at world 2

The suite is set up as for gloo (its decorators pick gloo's tests), and every process group it asks gloo for,
init_process_group's and new_group's, is a rocenante one. Tests that check the backend's name fail by design."""

import functools
import os

os.environ["BACKEND"] = "gloo"
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), f"rocenante-torch-suite-{os.getpid()}"))
os.makedirs(os.environ["TEMP_DIR"], exist_ok=True)

import torch.distributed as dist  # noqa: E402

import rocenante  # noqa: E402,F401  (registers the backend, also in the processes the suite spawns)


def _in_gloos_place(create):
    @functools.wraps(create)
    def wrapper(*args, **kwargs):
        if kwargs.get("backend") in ("gloo", dist.Backend.GLOO):
            kwargs["backend"] = "rocenante"
        return create(*args, **kwargs)

    return wrapper


dist.init_process_group = _in_gloos_place(dist.init_process_group)
dist.new_group = _in_gloos_place(dist.new_group)

from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402


class TestRocenanteInGlooPlace(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()
