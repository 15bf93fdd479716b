"""The Python face of a rocenante communicator: rendezvous through a torch.distributed Store, argument
checks on torch tensors (and CUDA arrays such as CuPy's), then one call into the C++ core."""

from __future__ import annotations

import json
import math
import secrets
import sys
import time
from contextlib import nullcontext
from typing import Optional

import torch
import torch.distributed as dist

from rocenante import _C, _env, _ib, _store

_DTYPES = {
    torch.float32: _C.DType.float32,
    torch.float16: _C.DType.float16,
    torch.bfloat16: _C.DType.bfloat16,
    torch.int32: _C.DType.int32,
}
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_OPS = {
    "sum": _C.ReduceOp.sum,
    "avg": _C.ReduceOp.avg,
    "max": _C.ReduceOp.max,
    "min": _C.ReduceOp.min,
    dist.ReduceOp.SUM: _C.ReduceOp.sum,
    dist.ReduceOp.AVG: _C.ReduceOp.avg,
    dist.ReduceOp.MAX: _C.ReduceOp.max,
    dist.ReduceOp.MIN: _C.ReduceOp.min,
}


def _public_current_stream(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


# The current CUDA stream of a device as an integer. CUDA builds of torch have a private accessor (the one its
# compiler's generated code calls) that skips building a torch.cuda.Stream object on every call.
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _public_current_stream)


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ', not contiguous'}"


def _core_op(op) -> "Optional[_C.ReduceOp]":
    """The core's op for a name, a torch.distributed.ReduceOp or the core's own op; None for any other."""
    if isinstance(op, _C.ReduceOp):
        return op
    try:
        return _OPS.get(op)
    except TypeError:  # unhashable
        return None


def _lookup_op(op) -> "_C.ReduceOp":
    core = _core_op(op)
    if core is None:
        raise ValueError(f"unsupported op {op!r}; rocenante supports sum, avg, max and min")
    return core


def serves(x, op="sum", max_bytes: Optional[int] = None) -> bool:
    """Whether rocenante all-reduces ``x`` with ``op``: a dense torch tensor of float32, float16, bfloat16 or
    int32 (int32 not with avg) with at least one element and, when ``max_bytes`` is given, at most that many
    bytes; ``op`` sum, avg, max or min (a name or a ``torch.distributed.ReduceOp``). It reads only what every
    rank's call shares, so every rank of a collective gets the same answer, and it is the one rule the backend
    and the plugins serve by. Where ``x`` is and whether it is contiguous are the caller's to handle (a tensor
    on another device is refused by the call; the backend and the vLLM plugin all-reduce a contiguous copy)."""
    core = _core_op(op)
    return (isinstance(x, torch.Tensor) and x.layout == torch.strided and x.dtype in _DTYPES and core is not None
            and not (core == _C.ReduceOp.avg and x.dtype == torch.int32)
            and x.numel() > 0 and (max_bytes is None or x.numel() * x.element_size() <= max_bytes))


def _profiled(collective: str, x: torch.Tensor):
    """The label a profiler trace shows a call under, as c10d labels NCCL's ("nccl:all_reduce"): the collective,
    then this rank's input in bytes and its dtype, e.g. "rocenante:all_reduce 8192 B torch.bfloat16". The kernel
    (or, for CPU tensors, the host loop) runs inside it."""
    return torch.profiler.record_function(f"rocenante:{collective} {x.numel() * x.element_size()} B {x.dtype}")


# A peer's failure message is shown whatever its bytes, cut at this many characters.
_MAX_FAILURE_CHARS = 2000


def _failure_message(raw: bytes) -> str:
    """failed/{rank} as read from the store, which anything may have written: decoded whatever its bytes, with
    control characters escaped, and cut short."""
    text = raw[:_MAX_FAILURE_CHARS].decode("utf-8", "backslashreplace")
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    if len(text) > _MAX_FAILURE_CHARS or len(raw) > _MAX_FAILURE_CHARS:
        text = f"{text[:_MAX_FAILURE_CHARS]}... (cut; {len(raw)} bytes)"
    return text


def _wait_for_ranks(store, prefix: str, keys: list[str], world_size: int, timeout_s: float, what: str) -> None:
    """Waits until every rank has set its key. Raises at once if a rank reported that its setup failed, and
    after timeout_s naming the ranks that did not arrive."""
    failures = [f"{prefix}/failed/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while not store.check(keys):
        for rank, key in enumerate(failures):
            if store.check([key]):
                raise _C.RocenanteError(f"rank {rank} failed to set up the communicator: {_failure_message(store.get(key))}")
        if time.monotonic() > deadline:
            missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
            raise _C.PeerTimeoutError(f"timed out after {timeout_s} s waiting for rank(s) {missing} to {what}")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _exchange(store, prefix: str, rank: int, world_size: int, timeout_s: float) -> _ib.Exchange:
    """What _ib.choose_paths() shares with the peers, through the store: each round's values of every rank."""
    def exchange(round_: str, value) -> list:
        keys = [f"{prefix}/ib/{round_}/{r}" for r in range(world_size)]
        store.set(keys[rank], json.dumps(value))
        _wait_for_ranks(store, prefix, keys, world_size, timeout_s, f"publish its RDMA {round_}")
        values = []
        for r, key in enumerate(keys):
            try:
                values.append(json.loads(store.get(key)))
            except ValueError:
                raise _ib.RdmaSetupError(f"rank {r} published RDMA {round_} that cannot be read") from None
        return values
    return exchange


# A host record is "host|net|nonce" (_choose_net); a host id is at most this long (a host name is <= 64 bytes,
# a boot id 36).
_MAX_HOST_ID = 256


def _parse_host_record(rank: int, raw: bytes) -> tuple[str, str]:
    """Rank `rank`'s host record, as read from the store: anything may have written it, so it is checked."""
    fields = raw.decode("utf-8", "replace").split("|")
    if len(fields) != 3 or not fields[0] or len(fields[0]) > _MAX_HOST_ID or not fields[0].isprintable() \
            or fields[1] not in _env.NETS:
        raise _C.RocenanteError(f"rank {rank} published a host record of {len(raw)} bytes that is not rocenante's")
    return fields[0], fields[1]


class Communicator:
    """One-shot all-reduce among `world_size` processes: of one host (shared memory, CUDA IPC), or each on a
    host of its own (RDMA over RoCE v2, through a proxy thread; ``ROCENANTE_NET=ib`` forces RDMA on one host,
    ``ROCENANTE_NET=tcp`` the TCP software wire, a test vehicle for the network path).

    Build it on every rank with the same store (TCPStore, FileStore, or the store of an existing process
    group), or from a process group with ``Communicator(group=pg)``. ``device`` is ``"cpu"`` (shared memory)
    or a CUDA device (CUDA IPC; one GPU per rank). Every rank must then make the same sequence of calls
    with the same size, dtype and op; a rank that differs makes every rank's call fail naming it.

    ``name`` (default ``"default"``; with ``group=``, the group's name) keys the rendezvous: communicators built
    at the same time on one store need distinct names. A name may be reused once its previous communicator is built.
    ``net`` (default: ``ROCENANTE_NET``) is ``""``, ``"ib"`` or ``"tcp"``, as that variable. Once built, ``net`` is
    the path taken (``"shm"``, ``"ib"``, ``"tcp"``) and, over RDMA, ``ib_paths[p]`` the device, port and GID that
    reach peer ``p`` and why (docs/rdma.md; empty on other paths).
    """

    def __init__(
        self,
        store: Optional[dist.Store] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        *,
        group: Optional[dist.ProcessGroup] = None,
        device="cpu",
        capacity_bytes: Optional[int] = None,
        timeout_s: Optional[float] = None,
        name: Optional[str] = None,
        net: Optional[str] = None,
    ):
        if group is not None:
            if store is not None or rank is not None or world_size is not None:
                raise ValueError("pass either group= or store, rank and world_size, not both")
            store = dist.distributed_c10d._world.pg_map[group][1]
            rank, world_size = dist.get_rank(group), dist.get_world_size(group)
            name = group.group_name if name is None else name
        if store is None or rank is None or world_size is None:
            raise ValueError("Communicator needs store, rank and world_size (or group=)")
        name = "default" if name is None else name
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        self.name = name
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"unsupported device {device!r}: use 'cpu' or a CUDA device")
        self._cuda_index = self.device.index if self.device.type == "cuda" else None
        self.rank = rank
        self.world_size = world_size
        self.capacity_bytes = _env.capacity_bytes() if capacity_bytes is None else int(capacity_bytes)
        granule = _C.capacity_granule_bytes  # whole groups of int32 lines, twice over (csrc/layout.h)
        self.capacity_bytes = -(-self.capacity_bytes // granule) * granule
        self.timeout_s = _env.timeout_s(timeout_s)
        # Each rank must finish this rendezvous before it builds the next communicator of this name.
        prefix = _store.generation(store, f"rocenante/{name}/{world_size}", "tickets", world_size)
        self._c = None
        try:
            ordinal = -1 if self.device.type == "cpu" else self.device.index
            on_fault = _C.OnFault.abort if _env.on_fault() == "abort" else _C.OnFault.raise_
            self.net = self._choose_net(store, prefix, _env.net() if net is None else _env.parse_net(net, "net"))
            paths, self.ib_paths = [], []
            signal = getattr(_C.Signal, _env.ib_signal())
            if self.net == "ib":
                gid_index, gid_source = _env.ib_gid_index()
                # The completion signal tells of a delivery on one queue pair: it takes one rail (layout.h, Mailbox).
                rails = 1 if signal == _C.Signal.completion else _C.layout.max_rails
                chosen = _ib.choose_paths(rank, world_size, _ib.scan(), _env.ib_hca(), gid_index, gid_source or
                                          "ROCENANTE_IB_GID_INDEX", _exchange(store, prefix, rank, world_size,
                                                                              self.timeout_s), max_rails=rails)
                _ib.log_once(rank, chosen)
                self.ib_paths = chosen
                qos = _env.ib_qos()
                paths = [[(r.device, r.port, r.gid_index, *qos) for r in (p, *p.rails)] if p is not None else []
                         for p in chosen]
            twoshot_from, self.two_shot_basis = _env.twoshot_from(self.device.type, world_size, self.net)
            self._c = _C.Communicator(rank, world_size, ordinal, self.capacity_bytes, self.timeout_s, on_fault,
                                      getattr(_C.Net, self.net), paths, _env.test_first_call(), _env.proxy_spin_s(),
                                      signal, twoshot_from)
            self._rendezvous(store, prefix)
        except BaseException as err:
            # Tell the peers now, so that they fail at once instead of at their timeout.
            store.set(f"{prefix}/failed/{rank}", f"{type(err).__name__}: {err}")
            if self._c is not None:
                self._c.close()
            raise

    def _claim(self, store, key: str, value) -> None:
        """Sets this rank's key, only if unset: another value there means another communicator took this name
        and rank."""
        value = value.encode() if isinstance(value, str) else value
        if store.compare_set(key, "", value) != value:
            raise _C.RocenanteError(
                f"rank {self.rank} of communicator {self.name!r}: another communicator named {self.name!r} is "
                "being built on this store at the same time (give each communicator a distinct name)"
            )

    def _choose_net(self, store, prefix: str, forced: str) -> str:
        """"shm" when every rank is on this host, "ib" (RDMA) when every rank is on a host of its own or
        ROCENANTE_NET=ib, "tcp" when ROCENANTE_NET=tcp (every rank on this host). Every rank publishes its host and
        setting, so all decide alike."""
        if self.world_size == 1:
            return "shm"
        # A random token, not id(self): processes forked from one parent build their objects at the same addresses.
        self._claim(store, f"{prefix}/host/{self.rank}", f"{_env.host_id()}|{forced}|{secrets.token_hex(8)}")
        keys = [f"{prefix}/host/{r}" for r in range(self.world_size)]
        _wait_for_ranks(store, prefix, keys, self.world_size, self.timeout_s, "publish its host")
        hosts, nets = [], []
        for r, key in enumerate(keys):
            host, net = _parse_host_record(r, store.get(key))
            hosts.append(host)
            nets.append(net)
        if len(set(nets)) > 1:
            values = ", ".join(f"rank {r} {n!r}" for r, n in enumerate(nets))
            raise _C.RocenanteError(f"ranks disagree on ROCENANTE_NET: {values}; set it alike everywhere")
        if forced == "tcp" and len(set(hosts)) > 1:
            raise _C.RocenanteError("ROCENANTE_NET=tcp is a test vehicle on loopback: every rank must be on one host, "
                                    f"but they are on {len(set(hosts))}")
        if forced:
            if self.rank == 0:
                how = "by RDMA" if forced == "ib" else "through the TCP software wire (a test vehicle)"
                print(f"rocenante: ROCENANTE_NET={forced}: every peer is reached {how}, also those on this host",
                      file=sys.stderr, flush=True)
            return forced
        if len(set(hosts)) == 1:
            return "shm"
        if len(set(hosts)) == len(hosts):
            return "ib"
        shared = sorted(r for r, h in enumerate(hosts) if hosts.count(h) > 1)
        raise _C.RocenanteError(
            f"ranks {shared} share a host while other ranks are elsewhere: mixing shared-memory and RDMA peers in "
            "one communicator is not supported yet; set ROCENANTE_NET=ib to reach every peer by RDMA")

    def _rendezvous(self, store, prefix: str) -> None:
        world = self.world_size
        handle = self._c.local_handle()  # unique to this instance (a random shared memory name, a CUDA IPC handle)
        self._claim(store, f"{prefix}/handle/{self.rank}", handle)
        keys = [f"{prefix}/handle/{r}" for r in range(world)]
        _wait_for_ranks(store, prefix, keys, world, self.timeout_s, "publish its handle")
        self._c.connect([store.get(k) for k in keys])
        store.set(f"{prefix}/connected/{self.rank}", b"1")
        keys = [f"{prefix}/connected/{r}" for r in range(world)]
        _wait_for_ranks(store, prefix, keys, world, self.timeout_s, "connect")
        self._c.all_connected()

    def all_reduce(self, x, op="sum", out=None):
        """Reduces ``x`` over all ranks into ``out`` (a new tensor if None; may be ``x`` itself) and returns it.

        ``x`` is a contiguous torch tensor on this communicator's device (or a CUDA array exposing
        ``__cuda_array_interface__``, e.g. CuPy, on the current CuPy stream), of dtype float32, float16,
        bfloat16 or int32, of any size (calls larger than ``capacity_bytes``, int32 half of it, go as several
        pieces). ``op`` is "sum", "avg", "max", "min" or a
        ``torch.distributed.ReduceOp`` of those. On CUDA the call is enqueued on the current stream and
        returns at once; a peer fault it meets is raised by the next call or by :meth:`synchronize`.

        A bad dtype or op is refused with the communicator left usable (every rank refuses alike). A
        problem only this rank can see (device, layout, ``out``) is refused too, but the peers have started
        the call already: the communicator faults, they are told, and every later call raises.
        """
        if not isinstance(x, torch.Tensor) and hasattr(x, "__cuda_array_interface__"):
            return self._all_reduce_cuda_array(x, op, out)
        out = self._check(x, out)
        self._launch(x, out, op, self.current_stream())
        return out

    def all_gather(self, x, out=None):
        """Gathers ``x`` of every rank, concatenated along dim 0 in rank order, into ``out`` (a new tensor of
        shape ``(world_size * x.shape[0], *x.shape[1:])`` if None) and returns it. Every bit of every input is
        returned as given (-0.0 and NaN payloads included). ``x`` may be this rank's part of ``out``
        (``out[rank * n:(rank + 1) * n]``, in place). Dtypes, devices, pieces and faults as :meth:`all_reduce`."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise TypeError(f"all_gather takes a torch.Tensor of at least one dimension, got {_describe(x)}")
        shape = (self.world_size * x.shape[0], *x.shape[1:])
        out = self._check(x, out, shape, "all_gather")
        self._launch(x, out, "sum", self.current_stream(), "all_gather")
        return out

    def reduce_scatter(self, x, op="sum", out=None):
        """Reduces ``x`` over all ranks and returns this rank's part of the result along dim 0: rows
        ``[rank * n, (rank + 1) * n)`` with ``n = x.shape[0] // world_size`` (``x.shape[0]`` must be a multiple of
        ``world_size``), into ``out`` (a new tensor if None; may be that part of ``x``). Ops, dtypes, rounding
        (rank order, fp32 accumulation: the bits of :meth:`all_reduce`'s result), pieces and faults as
        :meth:`all_reduce`."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise TypeError(f"reduce_scatter takes a torch.Tensor of at least one dimension, got {_describe(x)}")
        if x.shape[0] % self.world_size != 0:
            raise ValueError(f"reduce_scatter of {_describe(x)}: dim 0 must be a multiple of the world size "
                             f"{self.world_size}")
        shape = (x.shape[0] // self.world_size, *x.shape[1:])
        out = self._check(x, out, shape, "reduce_scatter")
        self._launch(x, out, op, self.current_stream(), "reduce_scatter")
        return out

    def all_to_all(self, x, out=None, input_split_sizes=None, output_split_sizes=None):
        """Sends block ``p`` of ``x`` to rank ``p`` and returns what every rank sent this one: ``x`` is
        ``world_size`` equal blocks along dim 0 (``x.shape[0]`` must be a multiple of ``world_size``), and block
        ``s`` of ``out`` (a new tensor shaped as ``x`` if None; may be ``x`` itself, in place) is block ``rank`` of
        rank ``s``'s ``x``. Every bit is returned as given (-0.0 and NaN payloads included). Dtypes, devices, pieces
        and faults as :meth:`all_reduce`.

        With split lists, as ``torch.distributed.all_to_all_single``: rows ``input_split_sizes[p]`` of ``x``
        (packed in rank order along dim 0) go to rank ``p``, and ``out`` (a new tensor of
        ``sum(output_split_sizes)`` rows if None; never ``x``) holds ``output_split_sizes[s]`` rows from each rank
        ``s`` in rank order. A list left None means equal blocks. Rank ``s``'s ``input_split_sizes[r]`` and rank
        ``r``'s ``output_split_sizes[s]`` must agree: the receiver checks every block's size and a disagreement is
        a :class:`CallMismatchError` naming both ranks. One call of one piece: a block holds at most
        :meth:`largest_block` elements (larger: refused, and the communicator faults)."""
        if input_split_sizes is not None or output_split_sizes is not None:
            return self._split_all_to_all(x, out, input_split_sizes, output_split_sizes, self.current_stream())[0]
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise TypeError(f"all_to_all takes a torch.Tensor of at least one dimension, got {_describe(x)}")
        if x.shape[0] % self.world_size != 0:
            raise ValueError(f"all_to_all of {_describe(x)}: dim 0 must be a multiple of the world size "
                             f"{self.world_size}")
        out = self._check(x, out, tuple(x.shape), "all_to_all")
        self._launch(x, out, "sum", self.current_stream(), "all_to_all")
        return out

    def _split_all_to_all(self, x, out, input_split_sizes, output_split_sizes, stream: int):
        """all_to_all() with split lists, on `stream`: returns (out, the call's number)."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise TypeError(f"all_to_all takes a torch.Tensor of at least one dimension, got {_describe(x)}")
        world, rows = self.world_size, x.shape[0]
        sizes = []
        for name, given, total in (("input_split_sizes", input_split_sizes, rows),
                                   ("output_split_sizes", output_split_sizes, None)):
            if given is None:
                total = rows if total is None else total
                if total % world != 0:
                    raise ValueError(f"all_to_all of {_describe(x)}: {name} not given, and dim 0 is not a multiple "
                                     f"of the world size {world}")
                given = [total // world] * world
            given = [int(n) for n in given]
            if len(given) != world or min(given) < 0:
                self.refuse(f"all_to_all: {name} {given} must hold {world} non-negative sizes")
            sizes.append(given)
        if sum(sizes[0]) != rows:
            self.refuse(f"all_to_all: input_split_sizes {sizes[0]} add up to {sum(sizes[0])}, the input "
                        f"{_describe(x)} has {rows} rows")
        out = self._check(x, out, (sum(sizes[1]), *x.shape[1:]), "all_to_all")
        if out is x:
            self.refuse("all_to_all with split sizes: out must not be the input")
        row = math.prod(x.shape[1:])
        return out, self._launch(x, out, "sum", stream, "all_to_all", [[n * row for n in split] for split in sizes])

    def all_to_all_v(self, x, input_splits, out, out_counts=None):
        """All-to-all with the splits on the device, for mixture-of-experts routing: no host sync, and a CUDA
        graph may capture it (each replay reads the splits as they are then). ``input_splits`` (int64,
        ``world_size`` elements, on ``x``'s device) holds the rows of ``x`` (packed in rank order along dim 0) that
        go to each rank. ``out`` has ``world_size * capacity`` rows: rank ``s``'s block lands at rows
        ``[s * capacity, s * capacity + out_counts[s])``, the rest of its rows left as they were; ``capacity`` is
        every rank's alike. Returns ``out_counts`` (int64, allocated on ``x``'s device if None): the rows received
        from each rank, -1 each if the call faults. A count that is negative, above ``capacity`` or past ``x``
        faults the call on every rank (nothing is sent; an InvalidArgument error here); a block of another size than
        its sender's count never lands."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise TypeError(f"all_to_all_v takes a torch.Tensor of at least one dimension, got {_describe(x)}")
        world = self.world_size
        if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[0] % world != 0 or out.shape[0] == 0:
            raise ValueError(f"all_to_all_v: out must be a tensor of world_size * capacity rows, got {_describe(out)}")
        self._check(x, out, (out.shape[0], *x.shape[1:]), "all_to_all_v")
        if out_counts is None:
            out_counts = torch.empty(world, dtype=torch.int64, device=x.device)
        for name, t in (("input_splits", input_splits), ("out_counts", out_counts)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or tuple(t.shape) != (world,) \
                    or t.device != x.device or not t.is_contiguous():
                self.refuse(f"all_to_all_v: {name} must be a contiguous int64 tensor of {world} elements on "
                            f"{x.device}, got {_describe(t)}")
        self._launch(x, out, "sum", self.current_stream(), "all_to_all_v", (input_splits, out_counts))
        return out_counts

    def largest_block(self, dtype) -> int:
        """The most elements a block of a split all-to-all holds (of ``dtype``): the largest slot of a power of two
        16-byte chunks that ``world_size`` slots of ``capacity_bytes`` hold in lines, less its header."""
        return self._c.largest_block(_DTYPES[dtype])

    @property
    def two_shot_from_bytes(self) -> Optional[int]:
        """The size from which :meth:`all_reduce` goes two-shot (None: never), as every rank agreed at startup;
        ``two_shot_basis`` says where it comes from (the setting, a measurement or the model)."""
        return None if self._c.twoshot_from == _C.layout.never else self._c.twoshot_from

    def two_shot(self, nbytes: int) -> bool:
        """Whether :meth:`all_reduce` moves a call of ``nbytes`` bytes two-shot (agreed at startup:
        ``ROCENANTE_ALGO``)."""
        return self._c.two_shot(nbytes)

    @property
    def collectives(self) -> tuple:
        """The collectives this communicator serves."""
        return ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_v")

    def issue(self, x: torch.Tensor, op="sum", stream: Optional[int] = None, out: Optional[torch.Tensor] = None,
              collective: str = "all_reduce") -> int:
        """``collective`` on ``stream`` (a raw CUDA stream handle; by default the current stream), checked alike:
        :meth:`all_reduce` of ``x`` into ``x`` itself, or :meth:`all_gather`, :meth:`reduce_scatter` or
        :meth:`all_to_all` of a 1-D ``x`` into a 1-D ``out``. Returns the call's number, for callers that follow
        their calls one by one (:meth:`faulted_by`, as the backend's Work does)."""
        out = x if out is None else out
        if collective in ("reduce_scatter", "all_to_all") and x.numel() % self.world_size != 0:
            raise ValueError(f"{collective} of {_describe(x)}: its elements must be a multiple of the world size "
                             f"{self.world_size}")
        shape = {"all_reduce": tuple(x.shape), "all_gather": (self.world_size * x.numel(),),
                 "reduce_scatter": (x.numel() // self.world_size,), "all_to_all": (x.numel(),)}[collective]
        self._check(x, out, shape, collective)
        return self._launch(x, out, op, self.current_stream() if stream is None else stream, collective)

    def current_stream(self) -> int:
        """The raw handle of the stream calls are enqueued on: the current CUDA stream (0 on the CPU)."""
        return 0 if self._cuda_index is None else _current_raw_stream(self._cuda_index)

    def _launch(self, x: torch.Tensor, out: torch.Tensor, op, stream: int, collective: str = "all_reduce",
                splits=None) -> int:
        """The call into the core, for checked arguments. Returns the call's number. `splits`: a split
        all-to-all's, its element lists (all_to_all) or its counts and received counts (all_to_all_v)."""
        if torch.autograd._profiler_enabled():  # a C call: nothing else is paid without a profiler
            with _profiled(collective, x):
                return self._call_core(x, out, op, stream, collective, splits)
        return self._call_core(x, out, op, stream, collective, splits)

    def _call_core(self, x: torch.Tensor, out: torch.Tensor, op, stream: int, collective: str, splits=None) -> int:
        if collective == "all_to_all_v":
            counts, out_counts = splits
            return self._c.all_to_all_v_counts(x.data_ptr(), out.data_ptr(), _DTYPES[x.dtype], counts.data_ptr(),
                                               out_counts.data_ptr(), math.prod(x.shape[1:]), x.shape[0],
                                               out.shape[0] // self.world_size, stream)
        if splits is not None:
            return self._c.all_to_all_v(x.data_ptr(), out.data_ptr(), _DTYPES[x.dtype], *splits, stream)
        if collective == "all_gather":
            return self._c.all_gather(x.data_ptr(), out.data_ptr(), x.numel(), _DTYPES[x.dtype], stream)
        if collective == "reduce_scatter":
            return self._c.reduce_scatter(x.data_ptr(), out.data_ptr(), out.numel(), _DTYPES[x.dtype],
                                          _lookup_op(op), stream)
        if collective == "all_to_all":
            return self._c.all_to_all(x.data_ptr(), out.data_ptr(), x.numel() // self.world_size, _DTYPES[x.dtype],
                                      stream)
        return self._c.all_reduce(x.data_ptr(), out.data_ptr(), x.numel(), _DTYPES[x.dtype], _lookup_op(op), stream)

    def _all_reduce_cuda_array(self, x, op, out):
        """CuPy (or any __cuda_array_interface__) arrays: viewed as tensors, run on CuPy's current stream."""
        import cupy

        if out is None:
            out = cupy.empty_like(x)
        tx, tout = torch.as_tensor(x), torch.as_tensor(out)  # zero-copy views on the arrays' own devices
        self._check(tx, tout)
        self._launch(tx, tout, op, cupy.cuda.get_current_stream().ptr)
        return out

    def _check(self, x: torch.Tensor, out: Optional[torch.Tensor], shape=None, what="all_reduce") -> torch.Tensor:
        """Argument checks; returns ``out``, allocated if None with ``shape`` (default: ``x``'s). What every rank's
        call shares (type, dtype) leaves the communicator usable; what only this rank can see goes through
        refuse."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} takes a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _DTYPES:
            raise TypeError(f"unsupported dtype {x.dtype}; rocenante supports float32, float16, bfloat16 and int32")
        if x.device != self.device:
            self.refuse(f"a tensor on {x.device}, this communicator is on {self.device}")
        if not x.is_contiguous():
            self.refuse("a non-contiguous tensor (call .contiguous() first)")
        shape = tuple(x.shape) if shape is None else tuple(shape)
        if out is None:
            return torch.empty(shape, dtype=x.dtype, device=x.device)
        if out is x and shape == tuple(x.shape):  # in place (issue(), the backend's calls): x was checked above
            return out
        if not isinstance(out, torch.Tensor) or out.dtype != x.dtype or tuple(out.shape) != shape \
                or out.device != x.device:
            self.refuse(f"{what}: an out that does not match the input: out must match the input ({x.dtype} {shape} "
                        f"on {x.device}), got {_describe(out)}")
        if not out.is_contiguous():
            self.refuse("a non-contiguous out (out must be contiguous)")
        return out

    def fuses_add_rmsnorm(self, x, gamma) -> bool:
        """Whether :meth:`all_reduce_add_rmsnorm` serves ``x`` (rows of ``x.shape[-1]`` elements) with ``gamma``:
        a CUDA communicator, ``x`` of float32, float16 or bfloat16 in rows of a multiple of 16 bytes and at most
        32 KiB, the whole call within ``capacity_bytes``, and ``gamma`` of ``x``'s dtype. Every rank of a
        tensor-parallel group gets the same answer (it depends on shapes and dtypes only)."""
        return (isinstance(x, torch.Tensor) and x.dtype in _FLOAT_DTYPES and x.dim() > 0
                and isinstance(gamma, torch.Tensor) and gamma.dtype == x.dtype
                and self._c.fuses_add_rmsnorm(x.numel(), x.shape[-1], _DTYPES[x.dtype]))

    def all_reduce_add_rmsnorm(self, x, residual_in, gamma, eps: float = 1e-6, weight_bias: float = 0.0,
                               residual_out=None, norm_out=None):
        """FlashInfer's kARResidualRMSNorm in one kernel: ``residual_out = sum over ranks of x + residual_in``
        and ``norm_out = residual_out * rsqrt(mean(residual_out ** 2, -1) + eps) * (weight_bias + gamma)``;
        returns ``(residual_out, norm_out)`` (allocated if None; either may be ``x`` or ``residual_in``, or the
        other output). The sum itself is not kept. Rounding as the all-reduce followed by torch's ops: the sum
        rounded to the dtype, the add in fp32 rounded, the norm in fp32 from the rounded residual_out.

        For what :meth:`fuses_add_rmsnorm` accepts (a call it refuses raises ValueError alike on every rank,
        and the communicator stays usable). Every rank must make this same fused call; a rank that runs a plain
        all-reduce instead makes every rank's call fail naming it. Tensors that do not match ``x`` (device,
        shape, dtype, contiguity, overlaps) are refused as in :meth:`all_reduce`: the communicator faults.
        """
        if self._c.closed:
            self._c.check()  # a faulted communicator raises its fault
            raise _C.ClosedError("communicator is closed")
        if not self.fuses_add_rmsnorm(x, gamma):
            raise ValueError(f"all_reduce_add_rmsnorm does not serve {_describe(x)} with gamma {_describe(gamma)} "
                             "(see fuses_add_rmsnorm)")
        hidden = x.shape[-1]
        residual_out = torch.empty_like(x) if residual_out is None else residual_out
        norm_out = torch.empty_like(x) if norm_out is None else norm_out
        for name, t, shape in (("input", x, x.shape), ("residual_in", residual_in, x.shape),
                               ("residual_out", residual_out, x.shape), ("norm_out", norm_out, x.shape),
                               ("gamma", gamma, (hidden,))):
            if not isinstance(t, torch.Tensor) or t.device != self.device or t.dtype != x.dtype \
                    or tuple(t.shape) != tuple(shape) or not t.is_contiguous():
                self.refuse(f"{name} {_describe(t)}: it must be a contiguous {x.dtype} tensor of shape "
                             f"{tuple(shape)} on {self.device}")
        with _profiled("all_reduce_add_rmsnorm", x) if torch.autograd._profiler_enabled() else nullcontext():
            self._c.all_reduce_add_rmsnorm(x.data_ptr(), residual_in.data_ptr(), gamma.data_ptr(),
                                           residual_out.data_ptr(), norm_out.data_ptr(), x.numel(), hidden,
                                           _DTYPES[x.dtype], float(eps), float(weight_bias), self.current_stream())
        return residual_out, norm_out

    def refuse(self, why: str):
        """Raises ValueError for a call only this rank refuses while its peers may have started it: the
        communicator faults and tells them at once, naming ``why``, and every later call raises this error."""
        self._c.refuse(why)

    def synchronize(self) -> None:
        """Waits for the current stream and raises any fault this communicator met (every time, once faulted)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._c.check()

    def check(self) -> None:
        """Raises the fault this communicator met, if any, without waiting for anything."""
        self._c.check()

    def faulted_by(self, call: int) -> bool:
        """Whether the fault struck at or before call number ``call`` (from :meth:`issue`); once a graph has
        replayed calls, whose numbers the host does not see, any fault counts."""
        return self._c.faulted_by(call)

    def stream_done(self, stream: int) -> bool:
        """Whether the CUDA stream ``stream`` (a raw handle) has run everything enqueued on it so far; never ask
        while it captures a graph."""
        return self._c.stream_done(stream)

    @property
    def closed(self) -> bool:
        return self._c.closed

    def close(self) -> None:
        """Releases the communicator once its own calls have ended (docs/guarantees.md: close()). Idempotent.
        In a process forked from the one that built it, releases nothing of the creator's."""
        self._c.close()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"rocenante.Communicator(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
            f"capacity_bytes={self.capacity_bytes}, {state})"
        )
