"""python -m rocenante.doctor: is this host ready for rocenante over RDMA?

Lists the RDMA devices (through pyverbs, rdma-core's own Python binding), their ports, state, MTU and GIDs with
their types; says which device and GID index rocenante would use for each peer and why; reports the GPU's
attributes that matter for RDMA; and warns about what would slow or break a run. Under torchrun (RANK and
WORLD_SIZE set) every rank runs it and rank 0 also reports where ranks disagree.

Exit status: 0 when nothing is wrong, 1 when a warning was printed, 2 when rocenante could not use RDMA here.
"""

from __future__ import annotations

import ctypes
import os
import sys

from rocenante import _C, _env, _ib

_MTU = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
_STATE = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
_LINK = {0: "unspecified", 1: "InfiniBand", 2: "Ethernet"}
_PYVERBS_HINT = ("pyverbs is missing: install the system's package (Debian/Ubuntu: apt install python3-pyverbs; "
                 "it must match the system's rdma-core, which PyPI's pyverbs does not); with another Python of the "
                 "same version, add /usr/lib/python3/dist-packages to PYTHONPATH")


class Report:
    def __init__(self):
        self.lines: list[str] = []
        self.warnings: list[str] = []
        self.fatal = False

    def say(self, text: str = "") -> None:
        self.lines.append(text)

    def warn(self, text: str) -> None:
        self.warnings.append(text)
        self.lines.append(f"WARNING: {text}")


def _devices_with_pyverbs(report: Report, sysfs: list[_ib.Port]) -> dict:
    """Lists every device and port through pyverbs; returns {(device, port): active MTU in bytes}."""
    try:
        import pyverbs.device as d
        from pyverbs.device import Context
    except ImportError as err:
        # The system's package, built for this Python version, is the right one (it matches the system's
        # rdma-core); it lives outside a virtual environment's or pyenv's path. Only pyverbs is taken from there.
        tag = f"cpython-{sys.version_info.major}{sys.version_info.minor}"
        system = "/usr/lib/python3/dist-packages"
        built = os.path.isdir(os.path.join(system, "pyverbs")) and any(
            tag in name for name in os.listdir(os.path.join(system, "pyverbs")))
        if not built:
            report.warn(f"{_PYVERBS_HINT} ({err})")
            return {}
        sys.path.append(system)
        import pyverbs.device as d
        from pyverbs.device import Context

        report.say(f"(pyverbs from {system}: the system's, built for this Python)")
    types = {(p.device, p.port): {g.index: g.type for g in p.gids} for p in sysfs}
    mtus = {}
    try:
        devices = d.get_device_list()
    except Exception as err:  # pyverbs raises when the kernel has no RDMA device at all
        report.say(f"pyverbs lists no RDMA device ({err})")
        return {}
    for dev in devices:
        name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
        try:
            _list_device(report, Context, name, types, mtus)
        except Exception as err:  # report it and go on with the other devices
            report.warn(f"{name}: pyverbs could not query it: {type(err).__name__}: {err}")
    return mtus


def _list_device(report: Report, Context, name: str, types: dict, mtus: dict) -> None:
    with Context(name=name) as ctx:
        attr = ctx.query_device()
        firmware = getattr(attr, "fw_version", "?")
        firmware = firmware.decode() if isinstance(firmware, bytes) else firmware
        report.say(f"{name}: {attr.phys_port_cnt} port(s), firmware {firmware}")
        for port in range(1, attr.phys_port_cnt + 1):
            pa = ctx.query_port(port)
            mtu = _MTU.get(pa.active_mtu, 0)
            mtus[(name, port)] = mtu
            report.say(f"  port {port}: {_STATE.get(pa.state, pa.state)}, link layer {_LINK.get(pa.link_layer, pa.link_layer)}, "
                       f"active MTU {mtu}, max MTU {_MTU.get(pa.max_mtu, 0)}, {pa.gid_tbl_len} GID entries")
            for index in range(pa.gid_tbl_len):
                try:
                    found = ctx.query_gid(port, index)
                except Exception:  # an empty entry, on some providers
                    continue
                gid = str(getattr(found, "gid", found))
                if gid.replace(":", "").strip("0"):
                    kind = types.get((name, port), {}).get(index, "?")
                    report.say(f"    GID {index}: {gid} ({kind})")


def _check_ports(report: Report, sysfs: list[_ib.Port], mtus: dict) -> None:
    for p in sysfs:
        if p.link_layer != "Ethernet":
            continue
        if p.state != "ACTIVE":
            report.warn(f"{p.name} is {p.state or 'in an unknown state'}: not cabled, or its link is down")
            continue
        if mtus.get((p.device, p.port), 4096) < 4096:
            report.warn(f"{p.name}: active MTU {mtus[(p.device, p.port)]} below 4096 (raise the interface's MTU to 9000 "
                        "for RoCE's 4096)")
        v2 = [g for g in p.gids if g.type == "RoCE v2"]
        if v2 and not any(g.ipv4 for g in v2):
            report.warn(f"{p.name}: only IPv6 RoCE v2 GIDs; give its interface an IPv4 address (or set "
                        "ROCENANTE_IB_GID_INDEX)")


def _choice(report: Report, sysfs: list[_ib.Port], rank: int, world: int, store=None):
    """What rocenante would use here, for `world` ranks (with the peers' ports and routes through `store`, under
    torchrun, as a communicator would); None when it could not."""
    from rocenante.communicator import _exchange

    prefix = "rocenante/doctor"
    try:
        gid_index, source = _env.ib_gid_index()
        exchange = _exchange(store, prefix, rank, world, 120.0) if store is not None else None
        paths = _ib.choose_paths(rank, world, sysfs, _env.ib_hca(), gid_index, source or "ROCENANTE_IB_GID_INDEX",
                                 exchange)
        tc, sl = _env.ib_qos()
        signal = _env.ib_signal()
    except (ValueError, _C.RocenanteError) as err:
        if store is not None:  # the peers stop waiting for this rank's ports
            store.set(f"{prefix}/failed/{rank}", str(err))
        report.fatal = True
        report.say(f"rocenante could not use RDMA here: {err}")
        return None
    report.say(_ib.describe(rank, paths))
    report.say(f"  queue pairs: traffic class {tc}, service level {sl} (ROCENANTE_IB_TC/NCCL_IB_TC, "
               "ROCENANTE_IB_SL/NCCL_IB_SL; 0 where unset)")
    report.say(f"  delivery signal: {signal} (ROCENANTE_IB_SIGNAL; flag: the reducer polls a flag written after the "
               "data, which needs a fabric that places a queue pair's writes in order)")
    if not _C.with_ibverbs:
        report.fatal = True
        report.say("this rocenante was built without rdma-core's headers: install libibverbs-dev and reinstall it")
    return paths


def _gpu(report: Report) -> None:
    """The GPU's attributes that decide how its memory can reach the NIC (CUDA driver API through ctypes)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        report.say("GPU: no CUDA driver (libcuda.so.1) here")
        return
    if cuda.cuInit(0) != 0:
        report.say("GPU: the CUDA driver found no usable GPU")
        return
    count = ctypes.c_int()
    cuda.cuDeviceGetCount(ctypes.byref(count))
    # CUdevice_attribute values (cuda.h): integrated 18, GPUDirect RDMA supported 116, its write ordering 118,
    # dma-buf supported 124.
    attrs = {"integrated": 18, "GPUDirect RDMA": 116, "GPUDirect RDMA writes ordering": 118, "dma-buf": 124}
    for i in range(count.value):
        dev = ctypes.c_int()
        cuda.cuDeviceGet(ctypes.byref(dev), i)
        name = ctypes.create_string_buffer(256)
        cuda.cuDeviceGetName(name, 256, dev)
        values = {}
        for what, code in attrs.items():
            v = ctypes.c_int(-1)
            values[what] = v.value if cuda.cuDeviceGetAttribute(ctypes.byref(v), code, dev) == 0 else "unknown"
        report.say(f"GPU {i}: {name.value.decode()}: " + ", ".join(f"{k} {v}" for k, v in values.items()))
        if values["GPUDirect RDMA"] != 1:
            report.say(f"  GPU {i}: no GPUDirect RDMA: GPU tensors are staged through pinned host memory")


def _disagreements(summaries: list[dict]) -> list[str]:
    out = []
    for key in ("ports", "mtus", "gid_types", "rocenante", "with_ibverbs", "env"):
        values = [s.get(key) for s in summaries]
        if any(v != values[0] for v in values):
            out.append(f"ranks disagree on {key}: " + "; ".join(f"rank {r}: {v}" for r, v in enumerate(values)))
    return out


def main() -> int:
    report = Report()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    report.say(f"rocenante {getattr(__import__('rocenante'), '__version__', '?')}, RDMA transport "
               f"{'built' if _C.with_ibverbs else 'NOT built (no rdma-core headers at build time)'}")
    sysfs = _ib.scan()
    if not sysfs:
        report.fatal = True
        report.say(f"no RDMA device under {_ib.SYSFS}: no RDMA NIC, or its driver (and rdma-core) is not loaded")
    mtus = _devices_with_pyverbs(report, sysfs)
    _check_ports(report, sysfs, mtus)
    report.say("")
    report.say(f"choice for rank {rank} of {max(world, 2)} (ROCENANTE_IB_HCA/NCCL_IB_HCA, ROCENANTE_IB_GID_INDEX/"
               "NCCL_IB_GID_INDEX apply):")
    store = None
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        store = dist.distributed_c10d._get_default_store()
    paths = _choice(report, sysfs, rank, max(world, 2), store)
    report.say("")
    _gpu(report)
    if world > 1:
        mine = {
            "ports": sorted(p.name for p in sysfs if p.state == "ACTIVE"),
            "mtus": sorted(set(mtus.values())),
            "gid_types": sorted({g.type for p in sysfs for g in p.gids}),
            "rocenante": getattr(__import__("rocenante"), "__version__", "?"),
            "with_ibverbs": _C.with_ibverbs,
            "env": {k: os.environ.get(k) for k in ("ROCENANTE_IB_HCA", "NCCL_IB_HCA", "ROCENANTE_IB_GID_INDEX",
                                                   "NCCL_IB_GID_INDEX", "ROCENANTE_IB_TC", "NCCL_IB_TC",
                                                   "ROCENANTE_IB_SL", "NCCL_IB_SL", "ROCENANTE_NET",
                                                   "ROCENANTE_IB_SIGNAL")},
            "usable": paths is not None,
            "choice": _ib.describe(rank, paths) if paths is not None else "",
        }
        summaries = [None] * world
        dist.all_gather_object(summaries, mine)
        dist.destroy_process_group()
        if rank == 0:
            report.say("every rank's choice, per pair:")
            for summary in summaries:
                for line in summary["choice"].splitlines():
                    report.say(f"  {line}")
            for text in _disagreements(summaries):
                report.warn(text)
            unusable = [r for r, s in enumerate(summaries) if not s["usable"]]
            if unusable:
                report.fatal = True
                report.say(f"ranks {unusable} cannot use RDMA (see their output)")
    print("\n".join(report.lines))
    return 2 if report.fatal else 1 if report.warnings else 0


if __name__ == "__main__":
    sys.exit(main())
