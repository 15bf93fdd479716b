"""Faults between hosts, on the emulated cluster's triangle (tests/rdma/cluster.sh --topology mesh3), one rank per
node under torchrun over the management network. Four cases, each on a communicator of its own, in this order:

  lossy   netem on both ends of link 0-1, 1% loss, 2 ms delay, 1% duplicated: the queue pairs retransmit,
          every call of every collective exact and bitwise equal on every rank; its calls' tail is reported.
  reorder the same with 1 ms of jitter and 25% reordered: every call exact, or an error naming a peer (a reliable
          connection counts each out-of-order arrival's NAK against its retry budget: SoftRoCE gives up).
  closed  rank 0 closes its communicator after its warm calls and lives on: ranks 1 and 2 fail their next call at
          once, naming rank 0's goodbye.
  link    node 2 takes its link to node 0 down in the middle of a run of calls: every call a rank completed is
          exact, and every rank ends in an error naming a peer, within the bound.
  gone    node 2 powers itself off (sysrq: no FIN, no goodbye, the host gone) in the middle of a run of calls:
          ranks 0 and 1 end in an error naming rank 2, within the bound, every call they completed exact.

Each rank prints one `cluster_faults {json}` line per case (what happened, the time to the error) and
`cluster_faults: ok` or `cluster_faults: FAILED ...`. Node 2 leaves its verdict in $CLUSTER_RC before it powers
off. Guest clocks are emulated (TCG): the bounds are loose; the figures are for the log.

  cluster.sh --topology mesh3 --grace 180 'torchrun --nnodes $NNODES --nproc-per-node 1 --node-rank $NODE_RANK \\
      --master-addr $MASTER_ADDR --master-port $MASTER_PORT tests/rdma/cluster_faults.py'
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

os.environ.setdefault("ROCENANTE_PROXY_SPIN_S", "0")  # one vCPU per guest: the proxy naps when idle
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import rocenante  # noqa: E402
from reference import digest, make_input, poison, sequential_fp32  # noqa: E402

TIMEOUT_S = 30.0  # each communicator's: the bound on every wait
BOUND_S = TIMEOUT_S + 15.0  # an error must come within it (emulated clocks: loose)
CAPACITY = 64 << 10
# No jitter in "lossy": netem's jitter alone reorders packets (its first run, with 2 ms +- 1 ms, failed as "reorder").
NETEM = {"lossy": "loss 1% delay 2ms duplicate 1%", "reorder": "loss 1% delay 2ms 1ms reorder 25% 50% duplicate 1%"}
VICTIM = 2


def link_to(peer: int) -> str:
    """This node's interface on its link to `peer` (CLUSTER_PEERS "rxeI:rank:ip", CLUSTER_RXE/CLUSTER_IFS parallel)."""
    by_rxe = dict(zip(os.environ["CLUSTER_RXE"].split(), os.environ["CLUSTER_IFS"].split()))
    for dev, rank, _ in (e.split(":") for e in os.environ["CLUSTER_PEERS"].split()):
        if int(rank) == peer:
            return by_rxe[dev]
    raise RuntimeError(f"no link to rank {peer}")


def communicator(store, rank, world, name):
    return rocenante.Communicator(store, rank, world, capacity_bytes=CAPACITY, timeout_s=TIMEOUT_S, name=name)


def one_call(comm, rank, world, seed, case, collective, numel):
    """One call on fresh inputs into a poisoned output: (whether it is exact, its digest)."""
    inputs = [make_input(seed, case, r, numel, torch.float32) for r in range(world)]
    if collective == "all_gather":
        out = poison(torch.empty(world * numel))
        comm.all_gather(inputs[rank], out=out)
        return torch.equal(out, torch.cat(inputs)), digest(out)
    out = poison(torch.empty(numel))
    comm.all_reduce(inputs[rank], out=out)
    return torch.equal(out, sequential_fp32(inputs, "sum")), digest(out)


def netem(store, rank, world, name):
    """Link 0-1 under NETEM[name], both ways, once the communicator is connected (its setup resolves addresses,
    which the emulated link made time out once): every call exact and every rank's digests equal, or (reorder
    only) an error naming a peer, every call before it exact."""
    comm = communicator(store, rank, world, name)
    if rank in (0, 1):
        subprocess.run(f"tc qdisc add dev {link_to(1 - rank)} root netem {NETEM[name]}", shell=True, check=True)
    dist.barrier()
    calls = [(c, n) for _ in range(4) for c in ("all_reduce", "all_gather") for n in (7, 3000, CAPACITY // 4 + 13)]
    wrong, digests, seconds, error = [], [], [], None
    for case, (collective, numel) in enumerate(calls):
        began = time.monotonic()
        try:
            exact, d = one_call(comm, rank, world, 21, case, collective, numel)
        except rocenante.RocenanteError as err:
            error = f"{time.monotonic() - began:.2f} s into call {case}: {err}"
            if name != "reorder" or not re.search(r"rank \d", str(err)):
                wrong.append(f"call {case}: {err}")
            break
        seconds.append(time.monotonic() - began)
        digests.append(d)
        if not exact:
            wrong.append(f"call {case}: {collective} of {numel}: not exact")
    comm.close()
    if rank in (0, 1):
        subprocess.run(f"tc qdisc del dev {link_to(1 - rank)} root", shell=True, check=True)
    everyone = [None] * world
    dist.all_gather_object(everyone, (digests, error))
    if not any(e for _, e in everyone) and any(d != everyone[0][0] for d, _ in everyone):
        wrong.append("results differ between ranks")
    result = {"calls_done": len(seconds), "of": len(calls), "error": error}
    if len(seconds) >= 2:
        result.update(median_ms=round(1e3 * statistics.median(seconds), 1), max_ms=round(1e3 * max(seconds), 1))
    return result, wrong


def closed(store, rank, world):
    """Rank 0 closes after its warm calls and lives on; ranks 1 and 2 fail their next call naming it."""
    comm = communicator(store, rank, world, "closed")
    warm = 3
    wrong = [f"warm call {i}: not exact" for i in range(warm) if not one_call(comm, rank, world, 22, i, "all_reduce", 3000)[0]]
    result = {}
    if rank == 0:
        comm.close()
        store.set("closed/0", "1")
    else:
        store.wait(["closed/0"])
        time.sleep(1.0)  # the goodbye has crossed the link
        began = time.monotonic()
        try:
            one_call(comm, rank, world, 22, warm, "all_reduce", 3000)
            wrong.append("the call after rank 0 closed returned")
        except rocenante.RocenanteError as err:
            result = {"error": str(err), "seconds": round(time.monotonic() - began, 2)}
            if f"rank 0 closed its communicator after its call {warm}" not in str(err):
                wrong.append(f"the error does not name rank 0's goodbye: {err}")
            if result["seconds"] > 10.0:
                wrong.append(f"the error took {result['seconds']} s (timeout {TIMEOUT_S} s)")
        comm.close()
    dist.barrier()
    return result, wrong


def until_error(comm, rank, world, seed, victim_action=None):
    """Calls until one fails (at most 400), `victim_action` started after the 5th: (calls done, error, seconds from
    the start of the failing call to its error, seconds from the action to the error, whether every done call was
    exact)."""
    done, exact, acted_at = 0, True, None
    for case in range(400):
        if case == 5 and victim_action is not None:
            acted_at = time.monotonic() + 0.3
            threading.Timer(0.3, victim_action).start()  # lands inside a call
        began = time.monotonic()
        try:
            ok, _ = one_call(comm, rank, world, seed, case, "all_reduce", 3000 if case % 2 else CAPACITY // 4 + 13)
        except rocenante.RocenanteError as err:
            now = time.monotonic()
            return done, str(err), now - began, None if acted_at is None else now - acted_at, exact
        exact = exact and ok
        done += 1
    return done, None, 0.0, None, exact


def link_down(store, rank, world):
    """Node 2 takes its link to node 0 down mid-run; every rank errs naming a peer, within the bound."""
    comm = communicator(store, rank, world, "link")
    dist.barrier()
    iface = link_to(0) if rank == VICTIM else None
    action = (lambda: subprocess.run(["ip", "link", "set", iface, "down"], check=True)) if rank == VICTIM else None
    done, error, seconds, after_action, exact = until_error(comm, rank, world, 23, action)
    comm.close()
    if rank == VICTIM:
        subprocess.run(["ip", "link", "set", iface, "up"], check=True)
        time.sleep(3.0)  # its rxe port active again, and its route back, before the next communicator
    wrong = [] if exact else ["a completed call was not exact"]
    if error is None:
        wrong.append(f"{done} calls and no error after the link went down")
    elif "rank" not in error or seconds > BOUND_S:
        wrong.append(f"error after {seconds:.1f} s (bound {BOUND_S} s): {error}")
    dist.barrier()
    return {"calls": done, "error": error, "seconds_in_failing_call": round(seconds, 2),
            "seconds_after_link_down": None if after_action is None else round(after_action, 2)}, wrong


def gone(store, rank, world, report):
    """Node 2 powers off mid-run; ranks 0 and 1 err naming rank 2, within the bound."""
    comm = communicator(store, rank, world, "gone")
    dist.barrier()

    def power_off():
        report(rank, {"case": "gone", "powering_off": True}, [])
        with open(os.environ["CLUSTER_RC"], "w") as f:  # this node's verdict, before it vanishes
            f.write("0\n")
        os.sync()
        with open("/proc/sysrq-trigger", "w") as f:
            f.write("o")

    done, error, seconds, _, exact = until_error(comm, rank, world, 24, power_off if rank == VICTIM else None)
    wrong = [] if exact else ["a completed call was not exact"]
    if error is None:
        wrong.append(f"{done} calls and no error after node {VICTIM} powered off")
    elif not re.search(r"rank(?:\(s\))?[ 0-9]* 2\b", error) or seconds > BOUND_S:
        wrong.append(f"error after {seconds:.1f} s (bound {BOUND_S} s), naming rank 2? {error}")
    comm.close()
    return {"calls": done, "error": error, "seconds_in_failing_call": round(seconds, 2)}, wrong


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 3, "the triangle: tests/rdma/cluster.sh --topology mesh3"
    store = dist.distributed_c10d._get_default_store()
    failures = []

    def report(r, result, wrong):
        print(f"cluster_faults {json.dumps(dict(rank=r, **result, wrong=wrong))}", flush=True)
        failures.extend(f"{result.get('case')}: {w}" for w in wrong)

    cases = (("lossy", lambda *a: netem(*a, "lossy")), ("reorder", lambda *a: netem(*a, "reorder")),
             ("closed", closed), ("link", link_down))
    for name, case in cases:
        began = time.monotonic()
        result, wrong = case(store, rank, world)
        report(rank, {"case": name, "wall_s": round(time.monotonic() - began, 1), **result}, wrong)
    result, wrong = gone(store, rank, world, report)
    report(rank, {"case": "gone", **result}, wrong)
    print(f"cluster_faults: {'ok' if not failures else 'FAILED ' + '; '.join(failures)}", flush=True)
    os._exit(0 if not failures else 1)  # no teardown: the process group's peer on node 2 is gone


if __name__ == "__main__":
    main()
