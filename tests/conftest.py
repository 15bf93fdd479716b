import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def pytest_collection_modifyitems(config, items):
    count = gpu_count()
    if count >= 2:
        return
    reason = f"needs 2 CUDA GPUs, this machine has {count}: GPU tests run on the GPU machine (see README)"
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
