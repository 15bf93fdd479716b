"""Where a benchmark ran: git revision, command, host, CPU, GPU, driver, library versions, topology."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time

import torch


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def collect(device_type: str, method: dict, load_before: tuple) -> dict:
    """`method`: how the run measured (runner.method), kept beside where it ran; `load_before`: the host's
    os.getloadavg() when the run started (other work on the host slows every arm, the CPU ones most)."""
    import rocenante

    here = os.path.dirname(os.path.abspath(__file__))
    revision = _run(["git", "-C", here, "rev-parse", "HEAD"]) or os.environ.get("ROCENANTE_GIT_REVISION", "unknown")
    dirty = bool(_run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"]))
    info = {
        "git_revision": revision + ("-dirty" if dirty else ""),
        "command": " ".join([os.path.basename(sys.executable), "-m", "rocenante.bench"] + sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "rocenante": rocenante.__version__,
        "gpu": None,
        "driver": None,
        "cuda": torch.version.cuda,
        "nccl": None,
        "topology": None,
        "method": method,
        "load_average": {"before": list(load_before), "after": list(os.getloadavg()),
                         "note": "the host's 1-, 5- and 15-minute load averages when the run started and ended"},
    }
    if device_type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        drivers = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()
        info["driver"] = drivers[0] if drivers else None
        info["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        info["topology"] = _run(["nvidia-smi", "topo", "-m"]) or None
        info["env"] = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_SYMM_MEM", "ROCENANTE_"))}
    return info
