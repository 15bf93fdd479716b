"""A rendezvous through a FlashInfer CommBackend (flashinfer.comm.CommBackend: Get_rank, Get_size, allgather,
bcast, barrier, Split; MPI or torch.distributed underneath): rank 0 opens a TCPStore, the backend broadcasts its
address, and the ranks exchange their verdicts with the backend's allgather."""

from __future__ import annotations

import socket
from typing import Optional

import torch.distributed as dist

from rocenante import startup


def rendezvous_on_comm_backend(comm_backend) -> startup.Rendezvous:
    """Collective over the backend's ranks. The store lives as long as the returned rendezvous (rank 0 serves
    it); ranks on rank 0's host reach it at 127.0.0.1, others by rank 0's host name (rocenante then refuses, in
    agreement, because the ranks span hosts)."""
    rank, size = int(comm_backend.Get_rank()), int(comm_backend.Get_size())
    timeout = startup._exchange_timeout()
    host = socket.gethostname()
    server = None
    if rank == 0:
        # Port 0: the system picks a free one; world_size None: the constructor does not wait for the clients,
        # which learn the port only from the broadcast below.
        server = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
        address = (host, server.port)
    else:
        address = None
    server_host, port = comm_backend.bcast(address, 0)
    if rank == 0:
        store = server
    else:
        store = dist.TCPStore("127.0.0.1" if server_host == host else server_host, port, None, False, timeout)

    def exchange(step: str, mine: dict) -> list:
        return list(comm_backend.allgather(mine))

    return startup.Rendezvous(store, rank, size, exchange, keep=server)


def rank_mismatch(rendezvous: startup.Rendezvous, world_size, rank) -> Optional[str]:
    """Why FlashInfer's world_size= and rank= (when given) are not the group's, or None. Reported as a refusal
    through the agreement: it may be wrong on one rank only."""
    for given, actual, what in ((world_size, rendezvous.size, "world_size"), (rank, rendezvous.rank, "rank")):
        if given is not None and int(given) != actual:
            return f"{what}={given}, but the process group / comm_backend has {what} {actual}"
    return None

