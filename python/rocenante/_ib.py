"""Which RDMA device, port and GID index a rank uses for each peer, and why.

Reads the kernel's view of the RDMA devices from sysfs (/sys/class/infiniband: port state, link layer, GIDs and
their types), so that it works, and can be tested, without libibverbs. The C++ transport checks the choice
again through verbs when it opens the device.

Rules (docs/rdma.md, "Choice of device, port and GID"):
  - candidates: the ports listed by ROCENANTE_IB_HCA (else NCCL_IB_HCA), in NCCL's syntax, or else every
    ACTIVE Ethernet (RoCE) port; a listed port that is not ACTIVE, or a listed device that does not exist, is an
    error naming it and the peers it would serve, never a silent fallback;
  - GID: ROCENANTE_IB_GID_INDEX (else NCCL_IB_GID_INDEX) when set, and it must be a RoCE v2 GID; else the
    lowest-index RoCE v2 GID holding an IPv4-mapped address (::ffff:a.b.c.d);
  - spreading: with n candidate ports, rank r reaches peer p through candidate (r + p) mod n, so both ends of
    a connection use the same candidate position (the same rail when hosts are cabled alike).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Optional

from rocenante import _C

SYSFS = "/sys/class/infiniband"


class RdmaSetupError(_C.RocenanteError):
    """The RDMA configuration cannot serve a communicator; the message names the device and the peers."""


@dataclass
class Gid:
    index: int
    gid: str  # as sysfs writes it: eight groups of four hex digits
    type: str  # "RoCE v2", "IB/RoCE v1"

    @property
    def ipv4(self) -> Optional[str]:
        """The IPv4 address of an IPv4-mapped GID (::ffff:a.b.c.d), else None."""
        groups = self.gid.split(":")
        if len(groups) != 8 or any(int(g, 16) for g in groups[:5]) or groups[5].lower() != "ffff":
            return None
        raw = bytes.fromhex(groups[6] + groups[7])
        return ".".join(str(b) for b in raw)


@dataclass
class Port:
    device: str
    port: int
    state: str  # "ACTIVE", "DOWN", ...
    link_layer: str  # "Ethernet" (RoCE) or "InfiniBand"
    gids: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.device} port {self.port}"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def scan(root: str = SYSFS) -> list[Port]:
    """Every port of every RDMA device, with its non-empty GIDs, sorted by device and port."""
    ports = []
    for device in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        pdir = os.path.join(root, device, "ports")
        for port in sorted(os.listdir(pdir), key=int) if os.path.isdir(pdir) else []:
            base = os.path.join(pdir, port)
            state = _read(os.path.join(base, "state"))  # "4: ACTIVE"
            gids = []
            gid_dir = os.path.join(base, "gids")
            for name in sorted(os.listdir(gid_dir), key=int) if os.path.isdir(gid_dir) else []:
                gid = _read(os.path.join(gid_dir, name))
                if gid and any(c not in "0:" for c in gid):
                    gids.append(Gid(int(name), gid, _read(os.path.join(base, "gid_attrs", "types", name))))
            ports.append(Port(device, int(port), state.split(":")[-1].strip(), _read(os.path.join(base, "link_layer")), gids))
    return ports


@dataclass
class HcaSpec:
    """NCCL_IB_HCA's syntax: "mlx5_0:1,mlx5_1" lists devices (optionally ":port"); names match as prefixes
    unless the list starts with "=" (exact); a list starting with "^" (or "^=") excludes instead."""

    entries: list  # (name, port or None)
    exclude: bool = False
    exact: bool = False
    source: str = ""  # the variable it came from

    def matches(self, port: Port, entry) -> bool:
        name, number = entry
        named = port.device == name if self.exact else port.device.startswith(name)
        return named and (number is None or number == port.port)


def parse_hca(raw: str, source: str) -> HcaSpec:
    text = raw.strip()
    exclude = text.startswith("^")
    text = text[1:] if exclude else text
    exact = text.startswith("=")
    text = text[1:] if exact else text
    entries = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, number = item.partition(":")
        if not name or (number and not number.isdigit()) or (number and int(number) < 1):
            raise RdmaSetupError(f"{source}={raw!r}: cannot read {item!r} (use device[:port], comma-separated)")
        entries.append((name, int(number) if number else None))
    if not entries:
        raise RdmaSetupError(f"{source}={raw!r} lists no device")
    return HcaSpec(entries, exclude, exact, source)


@dataclass
class Path:
    device: str
    port: int
    gid_index: int
    gid: str
    why: str


def _gid_for(port: Port, gid_index: Optional[int], gid_source: str, peers: str) -> tuple[int, str, str]:
    if gid_index is not None:
        found = [g for g in port.gids if g.index == gid_index]
        if not found:
            raise RdmaSetupError(f"{gid_source}={gid_index}: {port.name} (for {peers}) has no GID at that index; "
                                 f"its GIDs: {_gid_list(port)}")
        if found[0].type != "RoCE v2":
            raise RdmaSetupError(f"{gid_source}={gid_index}: GID {gid_index} of {port.name} (for {peers}) is of type "
                                 f"{found[0].type or 'unknown'}, not RoCE v2; its GIDs: {_gid_list(port)}")
        return gid_index, found[0].gid, f"GID index {gid_index} from {gid_source}"
    for g in port.gids:
        if g.type == "RoCE v2" and g.ipv4:
            return g.index, g.gid, f"GID {g.index}: the first RoCE v2 GID with an IPv4 address ({g.ipv4})"
    raise RdmaSetupError(f"{port.name} (for {peers}) has no RoCE v2 GID with an IPv4 address (GIDs: {_gid_list(port)}); "
                         "give its interface an IPv4 address, or pick a GID with ROCENANTE_IB_GID_INDEX")


def _gid_list(port: Port) -> str:
    return ", ".join(f"{g.index}={g.gid} ({g.type})" for g in port.gids) or "none"


def _peers(ranks) -> str:
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks) if ranks else "no peer at this world size"


def choose_paths(rank: int, world: int, ports: list[Port], hca: Optional[HcaSpec], gid_index: Optional[int],
                 gid_source: str = "ROCENANTE_IB_GID_INDEX") -> list[Optional[Path]]:
    """The path to each peer (None at this rank's own position). Raises RdmaSetupError naming the device and
    the peers it would serve when the configuration cannot work."""
    peers = [p for p in range(world) if p != rank]
    present = ", ".join(f"{p.name} ({p.state}, {p.link_layer})" for p in ports) or "none"
    if hca is not None and not hca.exclude:
        candidates = []
        for entry in hca.entries:
            found = [p for p in ports if hca.matches(p, entry)]
            if not found:
                what = entry[0] + (f":{entry[1]}" if entry[1] is not None else "")
                raise RdmaSetupError(f"{hca.source} lists {what}, which matches no RDMA port here (present: {present})")
            candidates += [p for p in found if p not in candidates]
        why = f"listed by {hca.source}"
    else:
        candidates = [p for p in ports if p.state == "ACTIVE" and p.link_layer == "Ethernet"]
        why = "ACTIVE RoCE port"
        if hca is not None:
            candidates = [p for p in candidates if not any(hca.matches(p, e) for e in hca.entries)]
            why += f", not excluded by {hca.source}"
        if not candidates:
            raise RdmaSetupError(f"no usable RDMA port for {_peers(peers)}: none is ACTIVE with an Ethernet (RoCE) link"
                                 f"{' outside ' + hca.source if hca is not None else ''} (present: {present})")
    # Which peers each candidate serves, so that a bad one is named with them.
    served = {i: [p for p in peers if (rank + p) % len(candidates) == i] for i in range(len(candidates))}
    gids = {}
    for i, port in enumerate(candidates):
        who = _peers(served[i])
        if port.state != "ACTIVE":
            raise RdmaSetupError(f"{port.name} (for {who}, {why}) is {port.state or 'in an unknown state'}, not ACTIVE: "
                                 "is it cabled and its link up? Remove it from the list or fix the link")
        if port.link_layer != "Ethernet":
            raise RdmaSetupError(f"{port.name} (for {who}, {why}) has link layer {port.link_layer or 'unknown'}: "
                                 "rocenante speaks RoCE v2 only")
        gids[i] = _gid_for(port, gid_index, gid_source, who)
    paths: list[Optional[Path]] = [None] * world
    for p in peers:
        i = (rank + p) % len(candidates)
        index, gid, gid_why = gids[i]
        spread = f"; peers spread over {len(candidates)} ports by (rank + peer) mod {len(candidates)}" if len(candidates) > 1 else ""
        paths[p] = Path(candidates[i].device, candidates[i].port, index, gid, f"{why}; {gid_why}{spread}")
    return paths


_logged: set = set()


def describe(rank: int, paths: list[Optional[Path]]) -> str:
    """One line per distinct path: what this rank uses and why."""
    lines = []
    for target in dict.fromkeys((p.device, p.port, p.gid_index, p.gid, p.why) for p in paths if p is not None):
        ranks = [r for r, p in enumerate(paths) if p is not None and (p.device, p.port, p.gid_index, p.gid, p.why) == target]
        device, port, gid_index, gid, why = target
        lines.append(f"rank {rank}: RDMA to {_peers(ranks)} over {device} port {port}, GID {gid_index} ({gid}): {why}")
    return "\n".join(lines)


def log_once(rank: int, paths: list[Optional[Path]]) -> None:
    """Each rank logs its choice once per process (and again only when it changes)."""
    text = describe(rank, paths)
    if text not in _logged:
        _logged.add(text)
        for line in text.splitlines():
            print(f"rocenante: {line}", file=sys.stderr, flush=True)
