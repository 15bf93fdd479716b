"""Device, port and GID choice for RDMA (rocenante._ib) against fake sysfs trees: no RDMA device needed."""

from __future__ import annotations

import os

import pytest

from rocenante import _env, _ib

V4 = "0000:0000:0000:0000:0000:ffff:0a00:00{:02x}"  # ::ffff:10.0.0.x
LINK_LOCAL = "fe80:0000:0000:0000:d081:5eff:feca:8ef4"


def fake_port(root, device, port, state="4: ACTIVE", link="Ethernet", gids=(), netdev=""):
    base = os.path.join(root, device, "ports", str(port))
    for d in ("gids", "gid_attrs/types", "gid_attrs/ndevs"):
        os.makedirs(os.path.join(base, d))
    for name, text in (("state", state), ("link_layer", link)):
        with open(os.path.join(base, name), "w") as f:
            f.write(text + "\n")
    for index in range(8):  # sysfs lists every index; unused ones read as zeros
        gid, kind = gids[index] if index < len(gids) else ("0000:0000:0000:0000:0000:0000:0000:0000", "")
        with open(os.path.join(base, "gids", str(index)), "w") as f:
            f.write(gid + "\n")
        with open(os.path.join(base, "gid_attrs", "types", str(index)), "w") as f:
            f.write(kind + "\n")
        if netdev and index < len(gids):
            with open(os.path.join(base, "gid_attrs", "ndevs", str(index)), "w") as f:
                f.write(netdev + "\n")


def spark(root, second_state="4: ACTIVE"):
    """A DGX Spark as seen by rdma-core: two RoCE devices, GID 0/1 RoCE v1/v2 link-local, 2/3 v1/v2 IPv4."""
    for i, (device, state) in enumerate((("rocep1s0f0", "4: ACTIVE"), ("roceP2p1s0f0", second_state))):
        gids = [(LINK_LOCAL, "IB/RoCE v1"), (LINK_LOCAL, "RoCE v2"), (V4.format(i + 1), "IB/RoCE v1"),
                (V4.format(i + 1), "RoCE v2")]
        fake_port(root, device, 1, state=state, gids=gids)
    return _ib.scan(root)


def test_scan_reads_state_link_layer_and_gids(tmp_path):
    ports = spark(str(tmp_path))
    assert [(p.device, p.port, p.state, p.link_layer) for p in ports] == [
        ("roceP2p1s0f0", 1, "ACTIVE", "Ethernet"), ("rocep1s0f0", 1, "ACTIVE", "Ethernet")]
    assert [(g.index, g.type, g.ipv4) for g in ports[1].gids] == [
        (0, "IB/RoCE v1", None), (1, "RoCE v2", None), (2, "IB/RoCE v1", "10.0.0.1"), (3, "RoCE v2", "10.0.0.1")]


def test_default_picks_the_ipv4_roce_v2_gid_and_spreads_peers(tmp_path):
    ports = spark(str(tmp_path))
    paths = _ib.choose_paths(1, 4, ports, None, None)
    assert paths[1] is None
    # rank 1: peer p uses candidate (1 + p) mod 2; both ends of a pair agree.
    assert [(p.device, p.gid_index) for p in (paths[0], paths[2], paths[3])] == [
        ("rocep1s0f0", 3), ("rocep1s0f0", 3), ("roceP2p1s0f0", 3)]
    for p in range(4):
        if p != 1:
            other = _ib.choose_paths(p, 4, ports, None, None)[1]
            assert other.device == paths[p].device
    # Each peer's data is striped over both functions, the first rail as above, the other second.
    assert [p.rails[0].device for p in (paths[0], paths[2], paths[3])] == ["roceP2p1s0f0", "roceP2p1s0f0", "rocep1s0f0"]
    assert "first RoCE v2 GID with an IPv4 address (10.0.0." in paths[0].why and "striped over 2 rails" in paths[0].why
    assert "RDMA to ranks 0, 2 over rocep1s0f0 port 1, GID 3" in _ib.describe(1, paths)
    assert "; and rail 2, roceP2p1s0f0 port 1, GID 3" in _ib.describe(1, paths)
    # The completion signal takes one rail: the peers spread over the functions by (rank + peer) mod 2.
    one = _ib.choose_paths(1, 4, ports, None, None, max_rails=1)
    assert [(p.device, p.rails) for p in (one[0], one[2], one[3])] == [
        ("rocep1s0f0", ()), ("rocep1s0f0", ()), ("roceP2p1s0f0", ())]
    assert "rail 2 of 2 by (rank + peer) mod 2" in one[0].why


def test_a_port_that_is_down_is_skipped_with_a_warning_even_when_listed(tmp_path, capfd):
    ports = spark(str(tmp_path), second_state="1: DOWN")
    paths = _ib.choose_paths(0, 3, ports, None, None)
    assert {p.device for p in paths if p} == {"rocep1s0f0"}
    paths = _ib.choose_paths(0, 3, ports, _ib.parse_hca("rocep1s0f0,roceP2p1s0f0", "NCCL_IB_HCA"), None)
    assert {p.device for p in paths if p} == {"rocep1s0f0"}
    assert "rank 0: roceP2p1s0f0 port 1 (listed by NCCL_IB_HCA) is DOWN, not ACTIVE: not used" in capfd.readouterr().err
    with pytest.raises(_ib.RdmaSetupError, match=r"no usable RDMA port for ranks 1, 2: every port listed by "
                                                 r"NCCL_IB_HCA is down: roceP2p1s0f0 port 1 \(DOWN\)"):
        _ib.choose_paths(0, 3, ports, _ib.parse_hca("roceP2p1s0f0", "NCCL_IB_HCA"), None)


@pytest.mark.parametrize("raw, want", [
    ("rocep", ["rocep1s0f0"]),                             # prefix match, case-sensitive
    ("roce", ["roceP2p1s0f0", "rocep1s0f0"]),              # order: the list's, then the scan's
    ("=rocep1s0f0:1", ["rocep1s0f0"]),
    ("^rocep1", ["roceP2p1s0f0"]),
    ("^=rocep1s0f0", ["roceP2p1s0f0"]),
    ("roceP2p1s0f0:1,rocep1s0f0", ["roceP2p1s0f0", "rocep1s0f0"]),
])
def test_nccl_ib_hca_forms(tmp_path, raw, want):
    ports = spark(str(tmp_path))
    paths = _ib.choose_paths(0, 1 + len(want), ports, _ib.parse_hca(raw, "NCCL_IB_HCA"), None)
    used = sorted({p.device for p in paths if p})
    assert used == sorted(want), (raw, used)


@pytest.mark.parametrize("raw, words", [
    ("=roce", "NCCL_IB_HCA lists roce, which matches no RDMA port here"),
    ("mlx5_0", "NCCL_IB_HCA lists mlx5_0, which matches no RDMA port here (present: roceP2p1s0f0 port 1"),
    ("rocep1s0f0:2", "NCCL_IB_HCA lists rocep1s0f0:2, which matches no RDMA port"),
    ("^roce", "no usable RDMA port for rank 1: none is ACTIVE with an Ethernet (RoCE) link outside NCCL_IB_HCA"),
    ("rocep1s0f0:x", "cannot read 'rocep1s0f0:x'"),
    (",", "lists no device"),
])
def test_bad_hca_lists_are_errors_naming_the_device(tmp_path, raw, words):
    ports = spark(str(tmp_path))
    with pytest.raises(_ib.RdmaSetupError) as err:
        _ib.choose_paths(0, 2, ports, _ib.parse_hca(raw, "NCCL_IB_HCA"), None)
    assert words in str(err.value), str(err.value)


# Hosts as cabled (tests/rdma/cluster.sh builds the same ones as emulated hosts): per host, its RDMA devices as
# (device, netdev, address) and its routes as (iface, network, prefix). Every host also has a management port
# (mgmt0, no RDMA) holding the default route, which RDMA must never take.
def _host(links, extra_routes=()):
    devices = [(f"rxe{i}", f"eth{i}", address) for i, (address, _) in enumerate(links)]
    table = [_ib.Route(f"eth{i}", _ib._address(network), 24) for i, (_, network) in enumerate(links)]
    table += [_ib.Route(iface, _ib._address(network), 24) for iface, network in extra_routes]
    table += [_ib.Route("mgmt0", _ib._address("10.90.0.0"), 24), _ib.Route("mgmt0", 0, 0)]
    return devices, table


def _v4(address):
    a, b, c, d = (int(x) for x in address.split("."))
    return f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"


TOPOLOGIES = {
    # One switch, one subnet; each host has two devices on it (two ports of one NIC).
    "switch": [_host([(f"10.80.0.{10 * h + i + 1}", "10.80.0.0") for i in range(2)]) for h in range(3)],
    # Two hosts, one cable: two PCIe functions, each link its own subnet.
    "direct": [_host([(f"10.81.{i}.{h + 1}", f"10.81.{i}.0") for i in range(2)]) for h in range(2)],
    # Three hosts, a cable between each pair: link {a, b} is subnet 10.82.(a + b).0.
    "mesh3": [_host([(f"10.82.{h + o}.{h + 1}", f"10.82.{h + o}.0") for o in (q for q in range(3) if q != h)])
              for h in range(3)],
    # Four hosts in a ring, links h - (h + 1) % 4 on subnet 10.83.h.0: no diagonal.
    "ring4": [_host([(f"10.83.{(h - 1) % 4}.{h + 1}", f"10.83.{(h - 1) % 4}.0"),
                     (f"10.83.{h}.{h + 1}", f"10.83.{h}.0")]) for h in range(4)],
}
# ring4 with IP forwarding: the subnets a host is not on, through its first link's neighbour.
TOPOLOGIES["ring4-forwarded"] = [
    _host([(f"10.83.{(h - 1) % 4}.{h + 1}", f"10.83.{(h - 1) % 4}.0"), (f"10.83.{h}.{h + 1}", f"10.83.{h}.0")],
          [("eth0", f"10.83.{(h + 1) % 4}.0"), ("eth0", f"10.83.{(h + 2) % 4}.0")]) for h in range(4)]


def _choose_everywhere(tmp_path, hosts, hca=None):
    """choose_paths on every host at once (ranks as threads), sharing through a fake store: each rank's result
    (paths, or the error's text)."""
    import threading

    world = len(hosts)
    published: dict = {}
    barrier = threading.Barrier(world)
    results: list = [None] * world

    def rank_main(rank):
        devices, table = hosts[rank]
        root = str(tmp_path / f"host{rank}")
        for device, netdev, address in devices:
            fake_port(root, device, 1, gids=[(LINK_LOCAL, "RoCE v2"), (_v4(address), "RoCE v2")], netdev=netdev)

        def exchange(round_, value):
            published[(round_, rank)] = value
            barrier.wait()
            return [published[(round_, r)] for r in range(world)]

        try:
            results[rank] = _ib.choose_paths(rank, world, _ib.scan(root), hca, None, exchange=exchange, table=table)
        except _ib.RdmaSetupError as err:
            results[rank] = str(err)
        except Exception as err:  # noqa: BLE001 - the test reports it
            results[rank] = f"{type(err).__name__}: {err}"

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _rails(results):
    """Each rank's rails to each peer, as device names joined by '+' (the first rail first)."""
    return [["+".join(r.device for r in (p, *p.rails)) if p else None for p in paths] for paths in results]


@pytest.mark.parametrize("topology, want", [
    # Two rails to every peer, striped, the first spread by (rank + peer) mod 2.
    ("switch", [[None, "rxe1+rxe0", "rxe0+rxe1"], ["rxe1+rxe0", None, "rxe1+rxe0"], ["rxe0+rxe1", "rxe1+rxe0", None]]),
    ("direct", [[None, "rxe1+rxe0"], ["rxe1+rxe0", None]]),  # the two functions of the cable, striped
    ("mesh3", [[None, "rxe0", "rxe1"], ["rxe0", None, "rxe1"], ["rxe0", "rxe1", None]]),  # the cable to each peer
    ("ring4-forwarded", [[None, "rxe1", "rxe0", "rxe0"], ["rxe0", None, "rxe1", "rxe0"],
                         ["rxe0", "rxe0", None, "rxe1"], ["rxe1", "rxe0", "rxe0", None]]),
])
def test_each_peer_goes_by_the_route_that_reaches_it(tmp_path, topology, want):
    results = _choose_everywhere(tmp_path, TOPOLOGIES[topology])
    assert _rails(results) == want, results
    for rank, paths in enumerate(results):
        for p, path in enumerate(paths):
            for rail in (path, *path.rails) if path is not None else ():
                assert "by the kernel's routes" in rail.why and rail.gid_index == 1, rail.why


def test_ring4_unrouted_fails_on_every_rank_naming_the_diagonals(tmp_path):
    for rank, got in enumerate(_choose_everywhere(tmp_path, TOPOLOGIES["ring4"])):
        assert isinstance(got, str) and got.startswith("no RDMA route between ranks 0 and 2; ranks 1 and 3 (the ports"), \
            f"rank {rank}: {got}"
        assert "rank 2: rxe0 port 1 (10.83.1.3), rxe1 port 1 (10.83.2.3)" in got, got


def test_the_hca_list_limits_the_routes(tmp_path):
    # direct, only the second function listed: both ends take it.
    hca = _ib.parse_hca("rxe1", "ROCENANTE_IB_HCA")
    assert _rails(_choose_everywhere(tmp_path, TOPOLOGIES["direct"], hca)) == [[None, "rxe1"], ["rxe1", None]]
    # mesh3 with one device listed reaches one peer only.
    got = _choose_everywhere(tmp_path / "mesh", TOPOLOGIES["mesh3"], hca)
    assert all(isinstance(g, str) and g.startswith("no RDMA route between ranks 0 and 1") for g in got), got


def test_a_route_through_a_port_without_rdma_is_not_taken():
    table = [_ib.Route("eth0", _ib._address("10.83.0.0"), 24), _ib.Route("mgmt0", 0, 0),
             _ib.Route("mgmt0", _ib._address("10.83.2.0"), 24)]
    assert _ib.reaches("eth0", "10.83.0.7", table)
    assert not _ib.reaches("eth0", "10.83.2.7", table)  # the kernel sends it out of mgmt0
    assert not _ib.reaches("eth0", "10.99.0.1", table)  # only the management port's default route matches
    assert _ib.reaches("mgmt0", "10.99.0.1", table)


def test_proc_net_route_is_read(tmp_path):
    text = ("Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
            "mgmt0\t00000000\t01005A0A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"
            "eth1\t0000530A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"
            "eth2\t0001530A\t00000000\t0000\t0\t0\t0\t00FFFFFF\t0\t0\t0\n")  # not up: ignored
    (tmp_path / "route").write_text(text)
    assert _ib.routes(str(tmp_path / "route")) == [_ib.Route("mgmt0", 0, 0), _ib.Route("eth1", _ib._address("10.83.0.0"), 24)]


def test_gid_index_override_must_be_roce_v2(tmp_path):
    ports = spark(str(tmp_path))
    assert _ib.choose_paths(0, 2, ports, None, 1)[1].gid_index == 1  # link-local v2: allowed when asked
    with pytest.raises(_ib.RdmaSetupError, match=r"NCCL_IB_GID_INDEX=2: GID 2 of roceP2p1s0f0 port 1 \(for ranks 1, 2\) is "
                                                 r"of type IB/RoCE v1, not RoCE v2"):
        _ib.choose_paths(0, 3, ports, None, 2, "NCCL_IB_GID_INDEX")
    with pytest.raises(_ib.RdmaSetupError, match="has no GID at that index"):
        _ib.choose_paths(0, 2, ports, None, 6)


def test_no_ipv4_gid_is_an_error_saying_what_to_do(tmp_path):
    fake_port(str(tmp_path), "mlx5_0", 1, gids=[(LINK_LOCAL, "IB/RoCE v1"), (LINK_LOCAL, "RoCE v2")])
    with pytest.raises(_ib.RdmaSetupError, match="no RoCE v2 GID with an IPv4 address .* ROCENANTE_IB_GID_INDEX"):
        _ib.choose_paths(0, 2, _ib.scan(str(tmp_path)), None, None)


def test_infiniband_ports_are_not_used(tmp_path):
    fake_port(str(tmp_path), "mlx5_0", 1, link="InfiniBand", gids=[(LINK_LOCAL, "IB/RoCE v1")])
    with pytest.raises(_ib.RdmaSetupError, match="no usable RDMA port"):
        _ib.choose_paths(0, 2, _ib.scan(str(tmp_path)), None, None)
    with pytest.raises(_ib.RdmaSetupError, match="link layer InfiniBand: rocenante speaks RoCE v2 only"):
        _ib.choose_paths(0, 2, _ib.scan(str(tmp_path)), _ib.parse_hca("mlx5_0", "ROCENANTE_IB_HCA"), None)


def test_no_devices_at_all(tmp_path):
    with pytest.raises(_ib.RdmaSetupError, match=r"no usable RDMA port for rank 1.*\(present: none\)"):
        _ib.choose_paths(0, 2, _ib.scan(str(tmp_path / "absent")), None, None)


def test_environment_ours_wins_over_nccls(monkeypatch):
    monkeypatch.setenv("NCCL_IB_HCA", "mlx5_1")
    monkeypatch.setenv("NCCL_IB_GID_INDEX", "3")
    assert _env.ib_hca().entries == [("mlx5_1", None)] and _env.ib_hca().source == "NCCL_IB_HCA"
    assert _env.ib_gid_index() == (3, "NCCL_IB_GID_INDEX")
    monkeypatch.setenv("ROCENANTE_IB_HCA", "^=mlx5_0:1")
    monkeypatch.setenv("ROCENANTE_IB_GID_INDEX", "1")
    spec = _env.ib_hca()
    assert (spec.entries, spec.exclude, spec.exact, spec.source) == ([("mlx5_0", 1)], True, True, "ROCENANTE_IB_HCA")
    assert _env.ib_gid_index() == (1, "ROCENANTE_IB_GID_INDEX")
    monkeypatch.setenv("ROCENANTE_IB_GID_INDEX", "-1")
    with pytest.raises(ValueError, match="ROCENANTE_IB_GID_INDEX='-1'"):
        _env.ib_gid_index()
    monkeypatch.setenv("ROCENANTE_NET", "roce")
    with pytest.raises(ValueError, match="ROCENANTE_NET='roce'"):
        _env.net()


def test_traffic_class_and_service_level_ours_win_over_nccls(monkeypatch):
    for name in ("ROCENANTE_IB_TC", "NCCL_IB_TC", "ROCENANTE_IB_SL", "NCCL_IB_SL"):
        monkeypatch.delenv(name, raising=False)
    assert _env.ib_qos() == (0, 0)
    monkeypatch.setenv("NCCL_IB_TC", "106")
    monkeypatch.setenv("NCCL_IB_SL", "3")
    assert _env.ib_qos() == (106, 3)
    monkeypatch.setenv("ROCENANTE_IB_TC", "96")
    monkeypatch.setenv("ROCENANTE_IB_SL", "0")
    assert _env.ib_qos() == (96, 0)
    for name, raw, top in (("ROCENANTE_IB_TC", "256", 255), ("ROCENANTE_IB_SL", "16", 15), ("ROCENANTE_IB_SL", "x", 15)):
        monkeypatch.setenv(name, raw)
        with pytest.raises(ValueError, match=f"{name}='{raw}': use 0..{top}"):
            _env.ib_qos()
        monkeypatch.setenv(name, "1")


def _build_with_host(store, rank, world, hosts, nets):
    import rocenante
    from rocenante import _env

    _env.host_id = lambda: hosts[rank]
    if nets[rank]:
        os.environ["ROCENANTE_NET"] = nets[rank]
    try:
        rocenante.Communicator(store, rank, world, capacity_bytes=1024, timeout_s=20).close()
        return "built"
    except rocenante.RocenanteError as err:
        return str(err)


@pytest.mark.parametrize("hosts, nets, words", [
    (["a", "a", "b"], ["", "", ""], "ranks [0, 1] share a host while other ranks are elsewhere: mixing shared-memory "
                                    "and RDMA peers in one communicator is not supported yet"),
    (["a", "a", "a"], ["ib", "", "ib"], "ranks disagree on ROCENANTE_NET: rank 0 'ib', rank 1 '', rank 2 'ib'"),
    (["a", "b", "c"], ["", "", ""], "no usable RDMA port"),  # each on a host of its own: RDMA, which is absent here
    (["a", "a", "a"], ["", "", ""], "built"),
])
def test_transport_choice_from_the_ranks_hosts(hosts, nets, words):
    from multiproc import run_ranks

    for rank, got in enumerate(run_ranks(3, _build_with_host, hosts, nets, timeout=120, context="fork")):
        assert isinstance(got, str) and (words in got), f"rank {rank}: {got}"


def test_doctor_on_a_machine_without_rdma_says_so_and_exits_2():
    import subprocess
    import sys

    if _ib.scan():
        pytest.skip("this machine has RDMA devices")
    run = subprocess.run([sys.executable, "-m", "rocenante.doctor"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "rocenante could not use RDMA here: no usable RDMA port" in run.stdout, run.stdout


def test_doctor_names_what_ranks_disagree_on():
    from rocenante import doctor

    same = {"ports": ["rxe0 port 1"], "mtus": [1024], "gid_types": ["RoCE v2"], "rocenante": "0.1.0",
            "with_ibverbs": True, "env": {"NCCL_IB_HCA": None}}
    other = {**same, "mtus": [4096], "env": {"NCCL_IB_HCA": "mlx5_0"}}
    found = doctor._disagreements([same, same, other])
    assert found == ["ranks disagree on mtus: rank 0: [1024]; rank 1: [1024]; rank 2: [4096]",
                     "ranks disagree on env: rank 0: {'NCCL_IB_HCA': None}; rank 1: {'NCCL_IB_HCA': None}; "
                     "rank 2: {'NCCL_IB_HCA': 'mlx5_0'}"], found
