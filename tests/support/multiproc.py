"""Runs a function on several real processes, one per rank, joined by a FileStore."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import subprocess
import tempfile
import threading
import time
import traceback
from multiprocessing import reduction


class _ParentFd:
    """The parent's fd, sent with a rank's start: a forkserver's children otherwise write to what the server's
    stdout and stderr were when it started (an earlier test's capture), not to this test's."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return (_detach, (reduction.DupFd(self.fd),))


def _detach(dup) -> int:
    return dup.detach()


def _entry(fn, rank, world, store_path, args, queue, env, stdio):
    import faulthandler

    os.environ.clear()  # the parent's environment now (a forkserver's is from when it started)
    os.environ.update(env)
    for fd, parents in zip((1, 2), stdio):
        if parents != fd:
            os.dup2(parents, fd)
            os.close(parents)

    faulthandler.enable(all_threads=True)  # a crash in native code still says where it happened
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # and a hung rank, when the parent asks
    try:
        import torch.distributed as dist

        store = dist.FileStore(store_path, world)
        queue.put((rank, "ok", fn(store, rank, world, *args)))
    except BaseException as err:  # report every failure, with its type, to the parent
        queue.put((rank, "error", (type(err).__name__, str(err), traceback.format_exc())))


def _context(name: str):
    """A forkserver imports torch once per test session and forks each rank from that: a spawned rank spent
    2.5-5 s importing torch on CI's 2 cores, most of the CPU suite's time. The server starts no threads and
    initialises no CUDA by importing torch, so its children begin as a spawned rank would."""
    ctx = mp.get_context(name)
    if name == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def run_ranks(world: int, fn, *args, timeout: float = 300.0, context: str = "forkserver",
              clean_exit: bool = False) -> list:
    """Calls fn(store, rank, world, *args) on `world` processes; returns their results in rank order.
    Each rank gets the parent's environment as it is at the call. context="fork" skips even the forkserver's start
    (in the SoftRoCE VM, importing torch takes a minute); only for a parent that has started no threads and opened
    no RDMA device.

    An exception on any rank is returned as ("error", type name, message, traceback) in that rank's place;
    processes still running after `timeout` seconds are killed and reported as ("hung",), and those that
    exited without reporting as ("died", exit code). With clean_exit, a process that reported but then did not
    exit with 0 (a crash or hang in the interpreter's shutdown) is reported as ("died at exit", exit code).
    """
    ctx = _context(context)
    stdio = (_ParentFd(1), _ParentFd(2)) if context == "forkserver" else (1, 2)
    queue = ctx.Queue()
    results: list = [("hung",)] * world
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(fn, r, world, store_path, args, queue, dict(os.environ), stdio))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        pending = set(range(world))
        while pending and time.monotonic() < deadline:
            try:
                rank, status, value = queue.get(timeout=0.2)
            except queue_mod.Empty:
                # A process that died without reporting (killed, os._exit) will never report.
                for r in [r for r in pending if not procs[r].is_alive() and queue.empty()]:
                    results[r] = ("died", procs[r].exitcode)
                    pending.discard(r)
                continue
            results[rank] = value if status == "ok" else ("error",) + value
            pending.discard(rank)
        for r in pending:
            if procs[r].is_alive():
                os.kill(procs[r].pid, signal.SIGUSR1)  # print where it hangs before it is killed
                time.sleep(0.5)
        for r, p in enumerate(procs):
            p.join(timeout=max(1.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
            failed = isinstance(results[r], tuple) and results[r][:1] in (("hung",), ("died",), ("error",))
            if clean_exit and p.exitcode != 0 and not failed:
                results[r] = ("died at exit", p.exitcode)
    return results


def end_this_process_later(how: str, after_s: float, stopped_s: float = 4.0) -> None:
    """A fault test's victim: after `after_s` seconds this process is SIGKILLed (how == "kill"), or SIGSTOPped
    and continued `stopped_s` seconds later (how == "stop"), whatever it is doing then."""
    pid = os.getpid()
    if how == "kill":
        threading.Timer(after_s, os.kill, (pid, signal.SIGKILL)).start()
    else:
        subprocess.Popen(["sh", "-c", f"sleep {after_s}; kill -STOP {pid}; sleep {stopped_s}; kill -CONT {pid}"])


def all_arrived(store, world: int, name: str) -> None:
    """Returns once every rank has called it with this name: a test with a short timeout then does not count
    the time spawned ranks take to import torch."""
    store.add(f"arrived/{name}", 1)
    while store.add(f"arrived/{name}", 0) < world:
        time.sleep(0.01)


def record_figure(name: str, value: float) -> None:
    """Appends a measured figure (a detection time, a count) to $ROCENANTE_TEST_FIGURES, when it is set, as one
    JSON line: benchmarks/gpu_machine.sh keeps them beside the test log."""
    path = os.environ.get("ROCENANTE_TEST_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"figure": name, "value": value}) + "\n")


def expect_ok(results: list) -> list:
    """Fails the test with every rank's traceback if any rank raised or hung."""
    bad = [(r, res) for r, res in enumerate(results) if isinstance(res, tuple) and res and res[0] in ("error", "hung", "died", "died at exit")]
    if bad:
        lines = [f"rank {r}: {res[0]} {res[1:]}" for r, res in bad]
        raise AssertionError("\n".join(lines))
    return results
