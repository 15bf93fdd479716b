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
  - routes: every rank publishes its candidates' addresses (the IPv4 of each one's GID); a local candidate
    reaches a peer's address when the kernel's IPv4 routing table (/proc/net/route: connected subnets and
    gateway routes alike) would send to it through that candidate's interface: its most specific route there is
    as specific as the best route anywhere (so a route through an interface without RDMA, such as a management
    port's default route, wins and leaves the address unreached). A pair of ports serves two ranks only when
    each end reaches the other's address (a second exchange); ranks with no such pair are an error on every rank
    naming every such pair. Without routing facts (a GID with no IPv4 address, no interface in sysfs) every
    candidate is taken to reach every peer, as on one switch;
  - spreading: of the pairs of ports that serve ranks r and p, as many as share no port (in a canonical order
    both ends compute alike), rank r reaches p through pair (r + p) mod their number (the same rail at both ends).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

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
    netdevs: dict = field(default_factory=dict)  # GID index -> its network interface, where sysfs says

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
            netdevs = {g.index: _read(os.path.join(base, "gid_attrs", "ndevs", str(g.index))) for g in gids}
            ports.append(Port(device, int(port), state.split(":")[-1].strip(), _read(os.path.join(base, "link_layer")),
                              gids, {i: n for i, n in netdevs.items() if n}))
    return ports


@dataclass
class Route:
    iface: str
    network: int  # the destination, an IPv4 address as an integer (_address())
    prefix: int  # its length in bits


def routes(path: str = "/proc/net/route") -> list[Route]:
    """The kernel's IPv4 routes of the main table (policy routing is not read)."""
    table = []
    try:
        with open(path) as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return table
    for line in lines:
        fields = line.split()
        if len(fields) < 8 or not int(fields[3], 16) & 1:  # RTF_UP
            continue
        # The kernel prints each address's 32-bit word as the (little-endian) host holds it: read back, the bytes
        # come in network order.
        network = int.from_bytes(bytes.fromhex(fields[1]), "little")
        mask = int.from_bytes(bytes.fromhex(fields[7]), "little")
        table.append(Route(fields[0], network, bin(mask).count("1")))
    return table


def _address(text: str) -> int:
    a, b, c, d = (int(x) for x in text.split("."))
    return (a << 24) | (b << 16) | (c << 8) | d


def reaches(iface: str, address: str, table: list[Route]) -> bool:
    """Whether the kernel would send to `address` through `iface`: the most specific route matching it there is
    as specific as any."""
    target = _address(address)

    def matching(r: Route) -> bool:
        mask = ((1 << 32) - 1) ^ ((1 << (32 - r.prefix)) - 1)
        return (target & mask) == (r.network & mask)

    best = [r.prefix for r in table if matching(r)]
    here = [r.prefix for r in table if r.iface == iface and matching(r)]
    return bool(here) and max(here) == max(best)


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
    # Further rails to the same peer, each a path of its own (one queue pair each): a call's data to the peer is
    # striped over this path and them from a size on (csrc/transport/ibverbs.cc, kStripeFromBytes).
    rails: tuple = ()


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


# How ranks share what choose_paths() needs of each other: (round, this rank's value, JSON-able) -> every rank's
# value, by rank (communicator.py passes one over the rendezvous store).
Exchange = Callable[[str, object], list]

_MAX_PORTS = 64  # ports a peer may publish: more is hostile


def choose_paths(rank: int, world: int, ports: list[Port], hca: Optional[HcaSpec], gid_index: Optional[int],
                 gid_source: str = "ROCENANTE_IB_GID_INDEX", exchange: Optional[Exchange] = None,
                 table: Optional[list[Route]] = None, max_rails: int = _C.layout.max_rails) -> list[Optional[Path]]:
    """The path to each peer (None at this rank's own position), with up to `max_rails` rails, by the rules above.
    Without `exchange` every peer is taken to have this rank's ports (one host). Raises RdmaSetupError naming the
    device and the peers it would serve, or the ranks no route joins, when the configuration cannot work."""
    peers = [p for p in range(world) if p != rank]
    candidates, why = _candidates(ports, hca, peers)
    usable = []
    for port in candidates:
        if port.link_layer != "Ethernet":
            raise RdmaSetupError(f"{port.name} (for {_peers(peers)}, {why}) has link layer "
                                 f"{port.link_layer or 'unknown'}: rocenante speaks RoCE v2 only")
        if port.state != "ACTIVE":
            print(f"rocenante: rank {rank}: {port.name} ({why}) is {port.state or 'in an unknown state'}, not ACTIVE: "
                  "not used (is it cabled and its link up?)", file=sys.stderr, flush=True)
            continue
        usable.append((port, *_gid_for(port, gid_index, gid_source, _peers(peers))))
    if not usable:
        raise RdmaSetupError(f"no usable RDMA port for {_peers(peers)}: every port {why} is down: "
                             + ", ".join(f"{p.name} ({p.state})" for p in candidates))
    addresses = [_ipv4(gid) for _, _, gid, _ in usable]
    netdevs = [port.netdevs.get(index, "") for port, index, _, _ in usable]
    mine = [[port.device, port.port, address] for (port, _, _, _), address in zip(usable, addresses)]
    everyone = [_checked_ports(r, v) for r, v in enumerate(exchange("ports", mine))] if exchange else [mine] * world
    table = routes() if table is None else table
    routed = all(addresses) and all(netdevs) and all(a for ports_of in everyone for _, _, a in ports_of)
    pairs = {}  # peer -> [i, j]: our usable[i] reaches its port j
    for p in peers:
        pairs[p] = [[i, j] for i in range(len(usable)) for j, (_, _, a) in enumerate(everyone[p])
                    if not routed or reaches(netdevs[i], a, table)]
    if exchange:
        # A pair serves two ranks only if each end reaches the other: every rank's view, so that all decide alike.
        views = exchange("pairs", {str(p): pairs[p] for p in peers})

        def agreed(a: int, b: int) -> list:  # a's [i, j] toward b that b reaches back as [j, i]
            back = _pairs_of(views[b], a)
            return [pair for pair in _pairs_of(views[a], b) if [pair[1], pair[0]] in back]

        unreached = [(a, b) for a in range(world) for b in range(a + 1, world) if not agreed(a, b)]
        pairs = {p: agreed(rank, p) for p in peers}
    else:
        unreached = [(min(rank, p), max(rank, p)) for p in peers if not pairs[p]]
    if unreached:
        raise RdmaSetupError(
            "no RDMA route between " + "; ".join(f"ranks {a} and {b}" for a, b in unreached) + " (the ports each "
            "publishes: " + "; ".join(f"rank {r}: " + ", ".join(f"{d} port {n} ({a or 'no IPv4 GID'})" for d, n, a in
                                                               everyone[r]) for r in sorted({x for u in unreached for x in u}))
            + "): cable them, put them on one switch, or route between them (IP forwarding on a host between); "
            "ROCENANTE_IB_HCA/NCCL_IB_HCA limit the ports considered")
    paths: list[Optional[Path]] = [None] * world
    for p in peers:
        rails = _rails(sorted(pair if rank < p else pair[::-1] for pair in pairs[p]))
        first = (rank + p) % len(rails)  # both ends compute the same order
        chosen = []
        for rail in (rails[first:] + rails[:first])[:max_rails]:
            i = rail[0] if rank < p else rail[1]
            port, index, gid, gid_why = usable[i]
            how = (f"reaches rank {p}'s {everyone[p][rail[1] if rank < p else rail[0]][2]} through {netdevs[i]} by "
                   "the kernel's routes" if routed else "every port taken to reach every peer (no IPv4 routing facts)")
            chosen.append(Path(port.device, port.port, index, gid, f"{why}; {gid_why}; {how}"))
        if len(chosen) > 1:
            spread = f"; striped over {len(chosen)} rails"
        elif len(rails) > 1:
            spread = f"; rail {first + 1} of {len(rails)} by (rank + peer) mod {len(rails)}"
        else:
            spread = ""
        paths[p] = Path(chosen[0].device, chosen[0].port, chosen[0].gid_index, chosen[0].gid, chosen[0].why + spread,
                        tuple(chosen[1:]))
    return paths


def _candidates(ports: list[Port], hca: Optional[HcaSpec], peers: list) -> tuple[list[Port], str]:
    """The ports considered, and why."""
    present = ", ".join(f"{p.name} ({p.state}, {p.link_layer})" for p in ports) or "none"
    if hca is not None and not hca.exclude:
        candidates = []
        for entry in hca.entries:
            found = [p for p in ports if hca.matches(p, entry)]
            if not found:
                what = entry[0] + (f":{entry[1]}" if entry[1] is not None else "")
                raise RdmaSetupError(f"{hca.source} lists {what}, which matches no RDMA port here (present: {present})")
            candidates += [p for p in found if p not in candidates]
        return candidates, f"listed by {hca.source}"
    candidates = [p for p in ports if p.state == "ACTIVE" and p.link_layer == "Ethernet"]
    why = "ACTIVE RoCE port"
    if hca is not None:
        candidates = [p for p in candidates if not any(hca.matches(p, e) for e in hca.entries)]
        why += f", not excluded by {hca.source}"
    if not candidates:
        raise RdmaSetupError(f"no usable RDMA port for {_peers(peers)}: none is ACTIVE with an Ethernet (RoCE) link"
                             f"{' outside ' + hca.source if hca is not None else ''} (present: {present})")
    return candidates, why


def _ipv4(gid: str) -> Optional[str]:
    return Gid(0, gid, "").ipv4


def _checked_ports(rank: int, value) -> list:
    """Rank `rank`'s published ports, as read from the store: anything may have written them."""
    ok = isinstance(value, list) and len(value) <= _MAX_PORTS and all(
        isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and isinstance(e[1], int)
        and (e[2] is None or (isinstance(e[2], str) and _is_ipv4(e[2]))) for e in value)
    if not ok:
        raise RdmaSetupError(f"rank {rank} published RDMA ports that cannot be read: {str(value)[:200]!r}")
    return value


def _pairs_of(view, peer: int) -> list:
    """The pairs a rank's published view lists toward `peer`; what cannot be read counts as none (hostile input)."""
    pairs = view.get(str(peer), []) if isinstance(view, dict) else []
    return [p for p in pairs if isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) for x in p)] \
        if isinstance(pairs, list) else []


def _is_ipv4(text: str) -> bool:
    parts = text.split(".")
    return len(parts) == 4 and all(p.isdigit() and int(p) < 256 for p in parts)


def _rails(pairs: list) -> list:
    """Of `pairs` (in order), each one that shares no port with one taken before it: ports used once per peer."""
    rails, left, right = [], set(), set()
    for a, b in pairs:
        if a not in left and b not in right:
            rails.append((a, b))
            left.add(a)
            right.add(b)
    return rails


_logged: set = set()


def describe(rank: int, paths: list[Optional[Path]]) -> str:
    """One line per distinct path: what this rank uses and why."""
    lines = []
    for target in dict.fromkeys(_text(p) for p in paths if p is not None):
        ranks = [r for r, p in enumerate(paths) if p is not None and _text(p) == target]
        lines.append(f"rank {rank}: RDMA to {_peers(ranks)} over {target}")
    return "\n".join(lines)


def _text(path: Path) -> str:
    rails = "".join(f"; and rail {k + 2}, {r.device} port {r.port}, GID {r.gid_index} ({r.gid}): {r.why}"
                    for k, r in enumerate(path.rails))
    return f"{path.device} port {path.port}, GID {path.gid_index} ({path.gid}): {path.why}{rails}"


def log_once(rank: int, paths: list[Optional[Path]]) -> None:
    """Each rank logs its choice once per process (and again only when it changes)."""
    text = describe(rank, paths)
    if text not in _logged:
        _logged.add(text)
        for line in text.splitlines():
            print(f"rocenante: {line}", file=sys.stderr, flush=True)
