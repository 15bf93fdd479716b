"""The shared-memory segments behind CPU communicators: a /dev/shm too small for them, who may map them, and
what a crash leaves behind."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import rocenante
from rocenante import _C
from rocenante import communicator as rendezvous
from multiproc import expect_ok, run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
SUPPORT = os.path.join(os.path.dirname(HERE), "support")
SMALL_SHM = "8m"
# World 2: each region is 3 x (2 - 1) x capacity (+ the header, _C.layout.header_bytes): 6 MiB for 2 MiB, so that
# one fits in 8 MiB and two do not; 9 MiB for 3 MiB, so that none fits.
ONE_FITS, NONE_FITS = 2 << 20, 3 << 20


def _in_small_shm(script: str) -> subprocess.CompletedProcess:
    """Runs `python -c script` in a private mount namespace whose /dev/shm is a tmpfs of SMALL_SHM."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to give the test a small /dev/shm")
    mount = f"mount -t tmpfs -o size={SMALL_SHM} tmpfs /dev/shm"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", mount], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a small /dev/shm in a private mount namespace (needs root): {probe.stderr.strip()}")
    command = f'{mount} && exec "$0" -c "$1"'
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", command, sys.executable, script],
        capture_output=True, text=True, timeout=120, cwd=HERE,
    )


def _full_shm(store, rank, world, capacity):
    if rank == 1:  # regions are reserved after the ranks' host round: rank 1 reserves 1 s after it
        wait_for_ranks = rendezvous._wait_for_ranks

        def late(*args):
            wait_for_ranks(*args)
            if args[-1] == "publish its host":
                time.sleep(1.0)  # rank 0 has tried to reserve its region by now

        rendezvous._wait_for_ranks = late
    start = time.monotonic()
    try:
        comm = rocenante.Communicator(store, rank, world, capacity_bytes=capacity, timeout_s=60)
    except rocenante.RocenanteError as err:
        return type(err).__name__, str(err), time.monotonic() - start
    for _ in range(4):  # every buffer of both regions: where an unreserved segment runs out (SIGBUS)
        comm.all_reduce(torch.ones(capacity // 4))
    comm.close()
    return "built", "", 0.0


@pytest.mark.parametrize("capacity", [ONE_FITS, NONE_FITS])
def test_a_full_dev_shm_fails_setup_on_every_rank_with_a_clear_error(capacity):
    script = (
        "import json, os, sys\n"
        f"sys.path[:0] = [os.getcwd(), {SUPPORT!r}]\n"
        "import multiproc, test_cpu_shm\n"
        f"results = multiproc.run_ranks(2, test_cpu_shm._full_shm, {capacity}, timeout=60)\n"
        "left = sorted(n for n in os.listdir('/dev/shm') if n.startswith('rocenante-'))\n"
        "print(json.dumps({'results': results, 'left': left}))\n"
    )
    done = _in_small_shm(script)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    results = expect_ok([tuple(r) for r in out["results"]])
    # Rank 0 fails on its own when its region does not fit either, else it hears of rank 1's failure at once.
    failing = [0, 1] if capacity == NONE_FITS else [1]
    for rank, (kind, message, elapsed) in enumerate(results):
        assert kind == "RocenanteError", (rank, kind, message)
        assert "ROCENANTE_CAPACITY_BYTES" in message, message
        if rank not in failing:
            assert "rank 1 failed to set up the communicator" in message, message
            assert elapsed < 10, f"rank {rank} waited {elapsed:.1f} s for a rank that had already failed"
            continue
        region = _C.layout.header_bytes + 3 * capacity
        for words in (f"rank {rank}: cannot reserve {region} bytes", "No space left on device", "bytes free",
                      "3 x (world - 1) x capacity", "ROCENANTE_CAPACITY_BYTES"):
            assert words in message, message
    assert out["left"] == [], out["left"]


def _dies_before_connecting(store, rank, world):
    wait_for_ranks = rendezvous._wait_for_ranks
    if rank == 0:

        def announce(*args):
            if args[-1] == "publish its handle":  # its segment exists from here on (the host round comes first)
                store.set("rank 0 built", "1")
            return wait_for_ranks(*args)

        rendezvous._wait_for_ranks = announce
    else:
        store.set("victim pid", str(os.getpid()))

        def die(*args):
            if args[-1] == "publish its host":
                wait_for_ranks(*args)
                # Building a segment removes dead ranks' segments: rank 0's comes first.
                store.wait(["rank 0 built"])
                return None
            os._exit(0)  # its handle is published: its segment is in /dev/shm

        rendezvous._wait_for_ranks = die
    try:
        rocenante.Communicator(store, rank, world, capacity_bytes=4096, timeout_s=2)
    except rocenante.RocenanteError:
        return int(store.get("victim pid"))
    raise AssertionError("built a communicator without rank 1")


def test_a_rank_dead_before_connecting_leaves_no_segment_once_the_next_communicator_is_built(tmp_path):
    victim = expect_ok(run_ranks(2, _dies_before_connecting, timeout=60)[:1])[0]
    leftovers = [n for n in glob.glob("/dev/shm/rocenante-*") if f"-{victim}-" in os.path.basename(n)]
    assert leftovers, "the dead rank created no segment: the test no longer tests anything"
    rocenante.Communicator(dist.FileStore(str(tmp_path / "store"), 1), 0, 1, capacity_bytes=4096).close()
    assert [n for n in leftovers if os.path.exists(n)] == [], "the dead rank's segment is still in /dev/shm"


HANDLE_PREFIX = _C.layout.handle_header_bytes  # the core's Config and Identity in front of the transport's handle


@pytest.mark.parametrize("fault", ["mode", "owner"])
def test_a_peer_segment_of_another_owner_or_mode_is_refused_naming_the_peer(fault):
    if fault == "owner" and os.geteuid() != 0:
        pytest.skip("needs root to give a segment to another user")
    comm = _C.Communicator(0, 2, -1, 4096, 5.0, _C.OnFault.raise_)
    handle = comm.local_handle()
    own = "/dev/shm" + handle[HANDLE_PREFIX:].decode()
    fake = own[: own.rindex("-r")] + "-fake-r1"
    fd = os.open(fake, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, os.stat(own).st_size)
        if fault == "mode":
            os.fchmod(fd, 0o644)
        else:
            os.fchown(fd, 65534, -1)
        with pytest.raises(rocenante.RocenanteError) as err:
            comm.connect([handle, handle[:HANDLE_PREFIX] + fake[len("/dev/shm"):].encode()])
        words = "mode 0644, not 0600" if fault == "mode" else f"owned by uid 65534, not {os.geteuid()}"
        assert "rank 1's shared memory" in str(err.value) and words in str(err.value), str(err.value)
    finally:
        os.close(fd)
        os.unlink(fake)
        comm.close()
