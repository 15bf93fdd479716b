"""A peer whose host goes down while rank 0 waits for it, over the TCP wire (2 CPU ranks), run in a network
namespace of its own: `unshare -n python remote_death.py MODE` (root). "Down" is every TCP packet of the namespace
dropped (nftables; the ranks meet through a FileStore, so the wire is the only TCP traffic); "stopped" is rank 1
stopping itself (SIGSTOP), its host still up. Prints one JSON line: each rank's result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from multiproc import run_ranks  # noqa: E402

WORLD = 2
WARM_CALLS = 3
TIMEOUT_S = 6.0  # the communicators' timeout: what a stopped peer costs
LATE_S = 0.3  # rank 1's pause after rank 0 entered the call, before it goes down or stops
NFT_DROP_ALL_TCP = ["nft", "add table inet rd ; add chain inet rd in { type filter hook input priority 0 ; } ; "
                    "add rule inet rd in meta l4proto tcp drop"]


def _rank(store, rank, world, mode):
    import torch

    import rocenante

    comm = rocenante.Communicator(store, rank, world, device="cpu", timeout_s=TIMEOUT_S)
    assert comm.net == "tcp", comm.net
    x = torch.full((1024,), float(rank + 1))
    for _ in range(WARM_CALLS):
        assert torch.equal(comm.all_reduce(x), torch.full((1024,), 3.0))
    store.set(f"warm{rank}", "1")
    store.wait([f"warm{1 - rank}"])
    if rank == 1:
        time.sleep(LATE_S)  # rank 0 is in its call by now, waiting for ours
        if mode == "down":
            subprocess.run(NFT_DROP_ALL_TCP, check=True)
            store.set("down_at", repr(time.time()))
            time.sleep(TIMEOUT_S + 2)  # long past the moment rank 0 gives up
        else:
            store.set("pid1", str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 resumes us once it has given up
        return "gone"
    out = torch.empty(1024)
    began = time.time()
    try:
        comm.all_reduce(x, out=out)
        failure = None
    except rocenante.RocenanteError as err:
        failure = f"{type(err).__name__}: {err}"
    ended = time.time()
    if mode == "stopped":
        os.kill(int(store.get("pid1")), signal.SIGCONT)
    down_at = float(store.get("down_at")) if mode == "down" else None
    return {"failure": failure, "waited_s": ended - began, "after_down_s": None if down_at is None else ended - down_at,
            "poisoned": bool(torch.isnan(out).all())}


def main(mode: str) -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    os.environ["ROCENANTE_NET"] = "tcp"
    print(json.dumps(run_ranks(WORLD, _rank, mode, timeout=60)))


if __name__ == "__main__":
    main(sys.argv[1])
