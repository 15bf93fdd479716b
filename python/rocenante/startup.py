"""Agreement before action: every rank of a group gets a working communicator, or every rank goes without one,
for the same reason, which every rank knows.

Shared by the torch.distributed backend and the serving-engine plugins (rocenante.flashinfer, rocenante.vllm).
Each passes its own way of exchanging a small dict among the ranks: a store (the one the backend is built on,
or a process group's) or a FlashInfer CommBackend's allgather. Only what every rank publishes
decides, so no rank takes another path than its peers.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from rocenante import _env, _store
from rocenante.communicator import Communicator

# exchange(step, entry) publishes this rank's entry for `step` and returns every rank's entry, in rank order.
Exchange = Callable[[str, dict], "list[dict]"]


def store_exchange(store, prefix: str, rank: int, size: int, timeout: datetime.timedelta) -> Exchange:
    """An Exchange through a store: each step's entries live under prefix/step/rank, so each step name is used
    once per prefix."""

    def exchange(step: str, mine: dict) -> list:
        key = f"{prefix}/{step}"
        store.set(f"{key}/{rank}", json.dumps(mine))
        keys = [f"{key}/{r}" for r in range(size)]
        store.wait(keys, timeout)
        return [json.loads(store.get(k)) for k in keys]

    return exchange


def local_check(device, size: int, capacity_at_most: Optional[int] = None,
                group_timeout: Optional[datetime.timedelta] = None) -> dict:
    """What this rank can tell alone: its configuration, or why it cannot take part. `device` is "cpu" or a
    CUDA device ("cuda" alone: the current one); `size` the number of ranks; `capacity_at_most` caps
    ROCENANTE_CAPACITY_BYTES (a workspace that never serves more needs no larger region); `group_timeout`, the
    process group's timeout=, bounds every wait unless ROCENANTE_TIMEOUT_S is set."""
    entry = {"ok": True, "host": _env.host_id(), "pid": os.getpid()}
    try:
        # Every setting that can change the outcome is published, so that every rank decides from the same entries.
        entry["strict"] = _env.strict()
        if _env.disabled():
            return {**entry, "ok": False, "why": "disabled by ROCENANTE_DISABLE=1"}
        device = torch.device(device)
        capacity = _env.capacity_bytes()
        if capacity_at_most is not None:
            capacity = min(capacity, int(capacity_at_most))
        group_s = None if group_timeout is None else group_timeout.total_seconds()
        entry.update(capacity_bytes=capacity, timeout_s=_env.timeout_s(group=group_s),
                     threshold_bytes=_env.threshold_bytes(device.type, size), net=_env.net(),
                     signal=_env.ib_signal(), algo=_env.algo())
        if device.type == "cpu":
            entry["device"] = "cpu"
        elif device.type == "cuda":
            index = torch.cuda.current_device() if device.index is None else device.index
            entry["device"] = f"cuda:{index}"
            entry["gpu"] = str(torch.cuda.get_device_properties(index).uuid)
        else:
            return {**entry, "ok": False, "why": f"device {device} is neither the CPU nor a CUDA GPU"}
    except Exception as err:
        return {**entry, "ok": False, "why": f"{type(err).__name__}: {err}"}
    return entry


def disagreement(checks: list) -> Optional[str]:
    """Why the ranks whose local checks these are cannot form a communicator, or None."""
    failed = [f"rank {r}: {c['why']}" for r, c in enumerate(checks) if not c["ok"]]
    if failed:
        return "; ".join(failed)
    hosts = [c["host"] for c in checks]
    if len(set(hosts)) > 1:
        span = f"ranks span {len(set(hosts))} hosts ({', '.join(sorted(h.split('/')[0] for h in set(hosts)))})"
        if len(set(hosts)) < len(hosts) and not _env.net():
            return f"{span}, some with several ranks: mixing shared memory and RDMA is not supported yet (ROCENANTE_NET=ib)"
    gpus = [c.get("gpu") for c in checks]
    if gpus[0] is not None and len(set(gpus)) < len(gpus):
        shared = sorted({g for g in gpus if gpus.count(g) > 1})
        ranks = [r for r, g in enumerate(gpus) if g in shared]
        processes = [(c["host"], c.get("pid")) for r, c in enumerate(checks) if r in ranks]
        # Each rank's kernel spins until every peer's data arrives. Ranks of one process on one GPU would wait
        # forever once their kernels cannot all be resident; ranks of separate processes take turns on the GPU
        # (time-sliced contexts), milliseconds a call: fit for tests (ROCENANTE_TEST_SHARED_GPU=1), not for use.
        if not _env.test_shared_gpu() or len(set(processes)) < len(processes):
            return (f"ranks {ranks} share a GPU: their kernels would take turns on it, milliseconds a call, or wait "
                    "for each other forever within one process (call torch.cuda.set_device(local_rank) before "
                    "init_process_group)")
    for field in ("capacity_bytes", "threshold_bytes", "timeout_s", "net", "signal", "algo", "strict"):
        values = [c[field] for c in checks]
        if len(set(values)) > 1:
            return f"ranks disagree on {field}: {values}"
    return None


def self_test(comm: Communicator, rank: int, size: int) -> None:
    """A real all-reduce of known data (float32 and bfloat16, a tail that is not a whole chunk). Values stay
    small integers (every sum <= 16 * 8 + 28 < 256), exact in bfloat16 for up to 8 ranks."""
    device = comm.device
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.arange(1000, dtype=torch.float32, device=device) % 17 + rank).to(dtype)
        want = torch.arange(1000, dtype=torch.float32, device=device) % 17 * size + size * (size - 1) // 2
        got = comm.all_reduce(x)
        comm.synchronize()
        if not torch.equal(got.float(), want):
            raise RuntimeError(f"{device.type} self-test all-reduce of {dtype} gave a wrong result")


@dataclass
class Started:
    """What open_agreed gives every rank alike: the communicator (None: going without it), why, and the agreed
    ROCENANTE_THRESHOLD_BYTES (0 without a communicator)."""

    comm: Optional[Communicator]
    why: str
    threshold_bytes: int = 0


def open_agreed(exchange: Exchange, store, rank: int, size: int, device, name: str, what: str,
                capacity_at_most: Optional[int] = None, refusal: Optional[str] = None,
                group_timeout: Optional[datetime.timedelta] = None) -> Started:
    """Builds a communicator named `name` on `store` and self-tests it, with the verdict agreed through
    `exchange`: every rank gets one, or none does. With ROCENANTE_STRICT=1 on any rank a failure raises
    RuntimeError on every rank instead. `what` names the user in that message ("cuda", "vLLM group 'tp:0'"). `refusal`: why this
    rank cannot take part where local_check does not see it (a bad argument), told to every rank."""
    local = local_check(device, size, capacity_at_most, group_timeout)
    threshold = local.get("threshold_bytes", 0)
    if refusal is not None:
        local = {**local, "ok": False, "why": refusal}
    checks = exchange("config", local)
    reason = disagreement(checks)
    strict = any(c.get("strict") for c in checks)  # a rank whose setting could not be read asked for nothing
    comm = None
    if reason is None:
        try:
            comm = Communicator(store, rank, size, device=local["device"], name=name,
                                capacity_bytes=local["capacity_bytes"], timeout_s=local["timeout_s"],
                                net=local["net"])
            self_test(comm, rank, size)
            local = {"ok": True}
        except Exception as err:  # any failure means going without, for every rank
            local = {"ok": False, "why": f"{type(err).__name__}: {err}"}
            if comm is not None and not comm.closed:
                try:  # the peers may be inside a self-test call this rank will not make: tell them
                    comm.refuse(f"the startup self-test ({local['why']})")
                except ValueError:
                    pass
        failed = [f"rank {r}: {x['why']}" for r, x in enumerate(exchange("result", local)) if not x["ok"]]
        if failed:
            reason = "self-test failed: " + "; ".join(failed)
            if comm is not None:
                comm.close()
                comm = None
    if reason is None:
        return Started(comm, "self-test passed on every rank", threshold)
    if strict:
        raise RuntimeError(f"rocenante ({what}): {reason} (ROCENANTE_STRICT=1 on rank(s) "
                           f"{[r for r, c in enumerate(checks) if c.get('strict')]})")
    return Started(None, reason)


@dataclass
class Rendezvous:
    """Where the ranks of one group meet to build a communicator: a store private to this opening (so openings
    in sequence, on any rank, never read each other's keys), this rank's place, and how the ranks exchange
    verdicts. `keep` holds what must outlive the rendezvous (a store server rank 0 opened)."""

    store: object
    rank: int
    size: int
    exchange: Exchange
    keep: object = None


def _exchange_timeout() -> datetime.timedelta:
    """The bound on a verdict exchange. A malformed ROCENANTE_TIMEOUT_S is reported by local_check, through the
    exchange: so that every rank hears of it, the exchange itself waits the default then."""
    try:
        return datetime.timedelta(seconds=_env.timeout_s())
    except ValueError:
        return datetime.timedelta(seconds=_env.DEFAULT_TIMEOUT_S)


def rendezvous_on_group(group, label: str) -> Rendezvous:
    """A rendezvous on a process group's store, for an opening named `label`. Every rank of the group must open
    the same sequence of labels."""
    import torch.distributed as dist

    store = dist.distributed_c10d._world.pg_map[group][1]
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    store = dist.PrefixStore(_store.generation(store, f"rocenante/{label}/{size}", "opened", size) + "/", store)
    return Rendezvous(store, rank, size, store_exchange(store, "agree", rank, size, _exchange_timeout()))
