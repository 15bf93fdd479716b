"""The torch.distributed backend "rocenante", registered on `import rocenante`.

    dist.init_process_group(backend="rocenante")

The process group runs eligible all-reduces (contiguous or not, supported dtype and op, at most the threshold),
and all_gather_into_tensor, reduce_scatter_tensor and all_gather of equal-size tensors (CPU and CUDA), through a
rocenante Communicator and delegates everything else to a gloo group (CPU tensors) or an NCCL group (CUDA tensors)
built on the same store. Collectives it does not override reach those groups directly, as the backends registered
for their device. Eligibility depends only on what every rank shares (dtype, size, op, configuration), so ranks
never take different paths.

At creation each device type runs a startup self-test: every rank checks its configuration, then the group
builds a Communicator and all-reduces known data; the verdict is agreed through the store, so either every
rank uses rocenante for that device type or every rank falls back. `rocenante.status(group)` tells which
and why. In a group that also serves CUDA tensors the CPU path starts at the group's first all-reduce of a
CPU tensor instead (every rank makes that call, so they start it together): its shared-memory region,
3 x (world - 1) x capacity, is then held only by groups that use it.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import math
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions, ProcessGroupGloo, ReduceOp, Work
from torch.futures import Future

from rocenante import _env, _store, startup
from rocenante.communicator import Communicator, _core_op, serves

logger = logging.getLogger("rocenante")

# The custom op's names (torch.ops.rocenante.all_reduce): what rocenante serves, and product for the delegate.
_OP_TYPES = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "max": ReduceOp.MAX, "min": ReduceOp.MIN,
             "product": ReduceOp.PRODUCT}


def _stream_of(raw_stream: int, device) -> torch.cuda.Stream:
    """The torch stream of a raw handle. Handle 0, the default stream, is torch's default stream:
    torch.cuda.ExternalStream(0) would be a fresh stream of torch's pool instead (a zero stream_ptr reads as none
    given), which orders nothing after the default stream's work."""
    if raw_stream == 0:
        return torch.cuda.default_stream(device)
    return torch.cuda.ExternalStream(raw_stream, device=device)


class _Work(Work):
    """Work of a rocenante all-reduce, as ProcessGroupNCCL's. On the CPU the call has completed. On CUDA its kernel
    is enqueued on the stream that was current at the call (kept as a raw handle: no Stream object on the hot
    path): wait() orders the caller's current stream after that one and never blocks the host; is_completed()
    is true once that stream has run everything enqueued on it so far (so never before the kernel; never
    queried while the stream captures a graph); get_future() is a CUDA-aware future completed in stream order.
    wait() and the future raise the communicator's fault when it struck at or before this call. None of it costs
    anything per call (a first version with an end event and a capture query per call took dist.all_reduce from
    22 to 41 us at 1 KiB in eager mode on the 2 x H200 host)."""

    def __init__(self, tensors, comm=None, raw_stream=0, call=0):
        super().__init__()
        self._tensors = tensors
        self._comm = comm  # None on the CPU
        self._raw_stream = raw_stream
        self._call = call

    def _raise_fault(self):
        """Raises the communicator's fault if it struck at or before this call (once a graph has replayed
        calls, whose numbers the host does not see, any fault)."""
        if self._comm is not None and self._comm.faulted_by(self._call):
            self._comm.check()

    def wait(self, timeout=None):
        self._raise_fault()
        if self._comm is not None and self._comm.current_stream() != self._raw_stream:
            device = self._comm.device
            torch.cuda.current_stream(device).wait_stream(_stream_of(self._raw_stream, device))
        return True

    def result(self):
        return self._tensors

    def is_completed(self):
        return self._comm is None or self._comm.stream_done(self._raw_stream)

    def get_future(self):
        if self._comm is None:
            future = Future()
            future.set_result(self._tensors)
            return future
        device = self._comm.device
        future = Future(devices=[device])
        try:
            self._raise_fault()
        except Exception as err:
            future.set_exception(err)
            return future
        with torch.cuda.stream(_stream_of(self._raw_stream, device)):
            future.set_result(self._tensors)  # records an event on this stream, which the future's waiters wait for
        return future


class _Works(Work):
    """Several delegated works as one (a coalesced call the delegate made pair by pair)."""

    def __init__(self, works, tensors):
        super().__init__()
        self._works = works
        self._tensors = tensors

    def wait(self, timeout=None):
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        return True

    def result(self):
        return self._tensors

    def is_completed(self):
        return all(work.is_completed() for work in self._works)

    def get_future(self):
        tensors = self._tensors
        return torch.futures.collect_all([work.get_future() for work in self._works]).then(lambda _: tensors)


class RocenanteProcessGroup(dist.ProcessGroup):
    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta, group_name: str):
        super().__init__(rank, size)
        # Every key of this init (the delegates', the self-test's, the communicators') lives under its own
        # generation, so an init on a store an earlier one used (after destroy_process_group) reads none of its keys.
        store = dist.PrefixStore(_store.generation(store, f"rocenante/{size}", "inits", size) + "/", store)
        self._fallback = {"cpu": ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)}
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._fallback["cpu"])
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        if torch.cuda.is_available() and _env.test_shared_gpu():  # NCCL refuses ranks sharing a GPU (_env)
            gloo = ProcessGroupGloo(dist.PrefixStore("gloo-cuda/", store), rank, size, timeout)
            self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, gloo)
            self._fallback["cuda"] = gloo
        elif torch.cuda.is_available() and dist.is_nccl_available():
            from torch._C._distributed_c10d import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = timeout
            nccl = ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, options)
            self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
            self._fallback["cuda"] = nccl
        self._comms: dict[str, Communicator] = {}
        self._status: dict[str, dict] = {}
        self._start_args = (store, rank, size, timeout, group_name)
        self._unstarted = {"cpu"} if "cuda" in self._fallback else set()  # see the module's docstring
        for device_type in self._fallback:
            if device_type in self._unstarted:
                self._status[device_type] = {"active": False, "threshold_bytes": 0, "fallback": "gloo",
                                             "reason": "not started: the group's first CPU all-reduce starts it"}
            else:
                self._start(device_type)

    def getBackendName(self) -> str:
        return "rocenante"

    # ---- startup self-test ----

    def _start(self, device_type) -> None:
        self._unstarted.discard(device_type)
        store, rank, size, timeout, group_name = self._start_args
        exchange = startup.store_exchange(store, f"rocenante/selftest/{device_type}", rank, size, timeout)
        comm_store = dist.PrefixStore(f"rocenante/{device_type}/", store)
        started = startup.open_agreed(exchange, comm_store, rank, size, device_type, group_name, device_type,
                                      group_timeout=timeout)
        fallback = "gloo" if isinstance(self._fallback[device_type], ProcessGroupGloo) else "nccl"
        self._status[device_type] = {
            "active": started.comm is not None,
            "reason": started.why,
            "threshold_bytes": started.threshold_bytes,
            "fallback": fallback,
        }
        if started.comm is not None:
            self._comms[device_type] = started.comm
            self._status[device_type].update(collectives=list(started.comm.collectives),
                                             two_shot_from_bytes=started.comm.two_shot_from_bytes)
            if rank == 0:
                logger.info("rocenante: %s: %s up to %d bytes; all-reduce two-shot %s (%s)", device_type,
                            ", ".join(started.comm.collectives), started.threshold_bytes,
                            "never" if started.comm.two_shot_from_bytes is None
                            else f"from {started.comm.two_shot_from_bytes} bytes",
                            started.comm.two_shot_basis)
        elif rank == 0:
            logger.warning("rocenante: %s all-reduces fall back to %s: %s", device_type, fallback, started.why)

    # ---- collectives ----

    def _eligible(self, t: torch.Tensor, op, collective: str = "all_reduce", nbytes: int | None = None):
        """The communicator that serves `collective` of `t`, or None: one that serves the collective, and
        rocenante.serves() with `nbytes` (default: t's; an all-gather's output, a reduce-scatter's input) up to the
        agreed threshold. Only rank-shared facts decide; a path not started yet starts here, at the same call on
        every rank."""
        device_type = "cuda" if t.is_cuda else "cpu" if t.is_cpu else None
        if device_type in self._unstarted:
            self._start(device_type)
        comm = self._comms.get(device_type)
        nbytes = t.numel() * t.element_size() if nbytes is None else nbytes
        if comm is not None and collective in comm.collectives and serves(t, op) \
                and nbytes <= self._status[device_type]["threshold_bytes"]:
            return comm
        return None

    def _gather_comm(self, collective, output, input, op):
        """The communicator that serves all_gather_into_tensor or reduce_scatter_tensor of these tensors, or None:
        their numels and dtypes match (facts every rank's call shares) and _eligible() says so."""
        big = output if collective == "all_gather" else input
        small = input if collective == "all_gather" else output
        if output.dtype == input.dtype and small.numel() * self.size() == big.numel() \
                and output.device == input.device:
            return self._eligible(input, op, collective, big.numel() * big.element_size())
        return None

    def _gather_issue(self, comm, collective, output, input, op, stream) -> int:
        """One all-gather, reduce-scatter or all-to-all through `comm`; returns its call number. Non-contiguous
        tensors go through contiguous copies, so that layout (a fact of this rank only) never decides the path."""
        flat_in = input.reshape(-1) if input.is_contiguous() else input.contiguous().view(-1)
        flat_out = output.view(-1) if output.is_contiguous() else torch.empty(output.numel(), dtype=output.dtype,
                                                                              device=output.device)
        call = comm.issue(flat_in, op, stream, out=flat_out, collective=collective)
        if not output.is_contiguous():
            _copy_back(output, flat_out.view(output.shape))
        return call

    def _gather_or_scatter(self, collective, output, input, op, delegate):
        """all_gather_into_tensor and reduce_scatter_tensor: through rocenante where it serves them, else
        `delegate()`."""
        comm = self._gather_comm(collective, output, input, op)
        if comm is None:
            return delegate()
        stream = comm.current_stream()
        call = self._gather_issue(comm, collective, output, input, op, stream)
        return _Work([output], comm, stream, call) if output.is_cuda else _Work([output])

    def _coalesced(self, collective, outputs, inputs, op, opts):
        """Coalesced all-gathers or reduce-scatters (the functional collectives' all_gather_tensor and
        reduce_scatter_tensor come this way): one by one through rocenante where it serves every pair, as one
        Work; else every pair by the delegate's single-tensor call (its backend has no coalesced binding), as
        one Work that waits for them all."""
        comms = [self._gather_comm(collective, o, i, op) for o, i in zip(outputs, inputs)]
        if comms and None not in comms:
            comm = comms[0]
            stream = comm.current_stream()
            for o, i in zip(outputs, inputs):
                call = self._gather_issue(comm, collective, o, i, op, stream)
            return _Work(list(outputs), comm, stream, call) if outputs[0].is_cuda else _Work(list(outputs))
        delegate = self._delegate(inputs[0])
        single = delegate._allgather_base if collective == "all_gather" else delegate._reduce_scatter_base
        return _Works([single(o, i, *_given(opts)) for o, i in zip(outputs, inputs)], list(outputs))

    def _allgather_base(self, output, input, opts=None):
        return self._gather_or_scatter("all_gather", output, input, "sum",
                                       lambda: self._delegate(input)._allgather_base(output, input, *_given(opts)))

    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        op = _core_op(opts.reduceOp.op) if opts is not None else _core_op("sum")
        return self._gather_or_scatter("reduce_scatter", output, input, op,
                                       lambda: self._delegate(input)._reduce_scatter_base(output, input, *_given(opts)))

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_base(output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._coalesced("all_gather", outputs, inputs, "sum", opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        op = _core_op(opts.reduceOp.op) if opts is not None else _core_op("sum")
        return self._coalesced("reduce_scatter", outputs, inputs, op, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """all_to_all_single: through rocenante where input and output match in dtype and device, else the
        delegate. Which path a call takes rests on facts every rank shares, never on the split values (a rank
        knows only its own blocks, and MoE routing can make one rank's equal by chance while another's are not):
        without split lists (torch's empty list), an all-to-all of equal blocks within the threshold, as every
        rank's input is world_size blocks of the size each pair shares; with split lists (on either side, equal
        or not), the ranks first agree on the largest block of all (a one-element max all-reduce on the CPU path's
        communicator, a few microseconds on the host, no GPU sync) and make a split all-to-all (one piece) where
        that block fits one (Communicator.largest_block()) and world_size of it fit the threshold, as an equal
        all-to-all's input must; else, or where the CPU path does not run, the delegate. A pair that exchanges a
        block shares its split, and the receiver checks it (a disagreement is a CallMismatchError naming both)."""
        world = self.size()
        comm = None
        alike = output.dtype == input.dtype and output.device == input.device and input.dim() > 0 \
            and output.shape[1:] == input.shape[1:]
        split = len(input_split_sizes) > 0 or len(output_split_sizes) > 0  # how the program calls it: alike
        if alike and not split and output.shape == input.shape and input.shape[0] % world == 0:
            comm = self._eligible(input, "sum", "all_to_all")
        elif alike and split:
            comm = self._split_comm(input, output, input_split_sizes, output_split_sizes)
        if comm is None:
            return self._delegate(input).alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                                       *_given(opts))
        stream = comm.current_stream()
        if not split:
            call = self._gather_issue(comm, "all_to_all", output, input, "sum", stream)
        else:
            flat_out = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
            _, call = comm._split_all_to_all(input.contiguous(), flat_out, list(input_split_sizes) or None,
                                              list(output_split_sizes) or None, stream)
            if flat_out is not output:
                _copy_back(output, flat_out)
        return _Work([output], comm, stream, call) if output.is_cuda else _Work([output])

    def _split_comm(self, input, output, input_split_sizes, output_split_sizes):
        """The communicator that serves a split all-to-all of these tensors, or None (alltoall_base())."""
        world, row = self.size(), math.prod(input.shape[1:])
        blocks = [*(input_split_sizes or [input.shape[0] // world]), *(output_split_sizes or [output.shape[0] // world])]
        probe = torch.tensor([min(max(blocks) * row, 2**31 - 1)], dtype=torch.int32)  # this rank's largest block
        agreeing = self._eligible(probe, "max")  # a CPU communicator: every rank takes this path alike
        if agreeing is None:
            return None
        agreeing.all_reduce(probe, op="max", out=probe)
        most = int(probe)
        comm = self._eligible(input.new_empty(1), "sum", "all_to_all", world * most * input.element_size())
        return comm if comm is not None and most <= comm.largest_block(input.dtype) else None

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """all_to_all of lists: where both lists hold world_size tensors of one dtype, device and element count,
        one all-to-all of equal blocks through flat copies; else the delegate. The two ranks of each block share
        its size, as for all_to_all_single's splits (alltoall_base())."""
        world, t = self.size(), input_tensors[0]
        alike = len(input_tensors) == world and len(output_tensors) == world and all(
            x.dtype == t.dtype and x.device == t.device and x.numel() == t.numel()
            for x in (*input_tensors, *output_tensors))
        comm = self._eligible(t, "sum", "all_to_all", world * t.numel() * t.element_size()) if alike else None
        if comm is None:
            return self._delegate(t).alltoall(output_tensors, input_tensors, *_given(opts))
        flat = torch.cat([x.reshape(-1) for x in input_tensors])
        out = torch.empty_like(flat)
        stream = comm.current_stream()
        call = comm.issue(flat, "sum", stream, out=out, collective="all_to_all")
        with torch.no_grad():  # on the current stream: after the all-to-all's kernel
            for o, block in zip(output_tensors, out.chunk(world)):
                o.copy_(block.view(o.shape))
        return _Work(list(output_tensors), comm, stream, call) if t.is_cuda else _Work(list(output_tensors))

    def allgather(self, output_tensors, input_tensors, opts=None):
        """all_gather into a list: equal-size tensors of one input go through one all-gather into a flat tensor,
        then into the list; anything else (several inputs, sizes or dtypes that differ) to the delegate."""
        t = input_tensors[0] if len(input_tensors) == 1 else None
        outs = output_tensors[0] if len(output_tensors) == 1 else []
        if t is None or len(outs) != self.size() or any(o.dtype != t.dtype or o.numel() != t.numel() for o in outs):
            return self._delegate(input_tensors[0]).allgather(output_tensors, input_tensors, *_given(opts))
        flat = torch.empty(self.size() * t.numel(), dtype=t.dtype, device=t.device)
        work = self._gather_or_scatter("all_gather", flat, t, "sum", lambda: None)
        if work is None:
            return self._delegate(t).allgather(output_tensors, input_tensors, *_given(opts))
        with torch.no_grad():  # on the current stream: after the all-gather's kernel
            for r, o in enumerate(outs):
                o.copy_(flat[r * t.numel():(r + 1) * t.numel()].view(o.shape))
        work._tensors = output_tensors
        return work

    def allreduce(self, tensors, opts=None):
        opts = AllreduceOptions() if opts is None else opts
        t = tensors[0]
        # The core's op, converted once from the RedOpType (ReduceOp objects do not hash by value); None for an op
        # rocenante does not serve, which then goes to the delegate with `opts` as it came.
        op = _core_op(opts.reduceOp.op)
        # A tensor whose elements share memory (expand()) cannot take the result back from a contiguous copy: it
        # goes to the delegate as it is, as with gloo or NCCL alone. A layout fact, alike on every rank.
        single = len(tensors) == 1 and not _overlaps_itself(t)
        dense = t if not single or t.is_contiguous() else t.contiguous()
        comm = self._eligible(t, op) if single else None
        if comm is None:
            if dense is t:
                return self._delegate(t).allreduce(tensors, opts)
            # gloo reduces a strided tensor wrongly (elements and their neighbours mixed): it gets the copy.
            work = self._delegate(t).allreduce([dense], opts)
            work.wait()  # the copy back is ordered after it (on the current stream for CUDA tensors)
            _copy_back(t, dense)
            return work
        stream = comm.current_stream()
        call = comm.issue(dense, op, stream)  # a tensor on another device is refused, telling the peers; the core
        if dense is not t:                    # raises this communicator's fault, if any
            _copy_back(t, dense)
        return _Work(tensors, comm, stream, call) if t.is_cuda else _Work(tensors)

    def _raise_if_broken(self) -> None:
        """Once a communicator of the group has faulted, every collective raises that fault (the first one)."""
        for comm in self._comms.values():
            comm.check()

    def all_reduce_out_of_place(self, x: torch.Tensor, op: str) -> torch.Tensor:
        """For torch.ops.rocenante.all_reduce: a new tensor, without first copying the input."""
        if op not in _OP_TYPES:
            raise ValueError(f"unsupported op {op!r}: torch.ops.rocenante.all_reduce takes sum, avg, max, min or product")
        core = _core_op(_OP_TYPES[op])  # None for product
        comm = self._eligible(x, core)
        if comm is not None:
            return comm.all_reduce(x.contiguous(), op=core)
        out = x.clone(memory_format=torch.contiguous_format)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp(_OP_TYPES[op])
        self._delegate(x).allreduce([out], opts).wait()
        return out

    def _delegate(self, tensor):
        self._raise_if_broken()
        return self._fallback["cuda" if tensor.is_cuda else tensor.device.type]

    def barrier(self, opts):
        """gloo's barrier; in a group with CUDA tensors, first this rank's current stream is waited for, as NCCL's
        barrier completes only after the work enqueued on it."""
        self._raise_if_broken()
        if "cuda" in self._fallback and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()
        return self._fallback["cpu"].barrier(opts)

    def status(self) -> dict:
        return {device: dict(s) for device, s in self._status.items()}

    def shutdown(self) -> None:
        """Called by destroy_process_group: releases the communicators; the delegate groups are retired."""
        for comm in self._comms.values():
            comm.close()
        self._comms.clear()
        _retired.extend(self._fallback.values())
        super().shutdown()


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether elements of `t` share memory (an expanded tensor); contiguous tensors never do."""
    return not t.is_contiguous() and torch._debug_has_internal_overlap(t) == 1


def _copy_back(t: torch.Tensor, dense: torch.Tensor) -> None:
    """The result into the caller's tensor, as the collective wrote it: outside autograd (a view of a leaf
    that requires grad takes it, as from gloo's in-place write)."""
    with torch.no_grad():
        t.copy_(dense)


def _given(opts) -> list:
    """The options argument to pass on: none when the caller gave none (the delegate's default)."""
    return [] if opts is None else [opts]


# Every collective rocenante does not serve, under the names of every torch version it supports: the group's
# fault first (_delegate), then the delegate of the device of the tensor at `where` among the arguments
# (index, then index into a list, or None). Newer torch names a collective for the process group (first name)
# and for the backend (second) differently. The other overrides are above: barrier(), all-reduce, the
# all-gathers and reduce-scatters, single and coalesced (also under both names), and the all-to-alls (single and
# of lists), which rocenante serves where it can. Every collective torch's C++ trampoline forwards to Python must
# be overridden here or above: for one the class lacks, the trampoline calls the delegate from C++ holding the
# GIL, and a gloo worker that frees a finished work (holding its queue lock) and needs the GIL to free a tensor's
# Python object deadlocks with it (docs/guarantees.md; tests/cpu/test_real_clients.py,
# test_collectives_proceed_while_gloo_waits_for_the_gil).
_DELEGATED = {  # process group's name: (backend's name, where)
    "allreduce_coalesced": ("allreduce_coalesced", (0, 0)),
    "allgather_coalesced": ("allgather_coalesced", (1, 0)),
    "broadcast": ("broadcast", (0, 0)),
    "reduce": ("reduce", (0, 0)),
    "gather": ("gather", (1, 0)),
    "scatter": ("scatter", (0, 0)),
    "reduce_scatter": ("reduce_scatter", (0, 0)),
    "send": ("send", (0, 0)),
    "recv": ("recv", (0, 0)),
    "recv_anysource": ("recv_anysource", (0, 0)),
}


def _delegated(backend_name: str, where: tuple):
    index, item = where

    def collective(self, *args):
        tensor = args[index] if item is None else args[index][item]
        return getattr(self._delegate(tensor), backend_name)(*args)

    return collective


for _name, (_backend_name, _where) in _DELEGATED.items():
    if hasattr(dist.ProcessGroup, _name):
        setattr(RocenanteProcessGroup, _name, _delegated(_backend_name, _where))


# Delegate groups of destroyed process groups, freed later by _free_retired(). Freeing a gloo group joins its
# worker threads; a worker may still be dropping its last work item, which takes the GIL, so freeing it right
# away from Python (GIL held) can deadlock. Later, after a sleep that lets workers take the GIL, it cannot.
_retired: list = []


def _free_retired() -> None:
    if _retired:
        time.sleep(0.01)
        _retired.clear()


atexit.register(_free_retired)


def _create(opts, pg_options):
    """The extended creator API: opts carries the group's name (group_id) along with its store, rank and size."""
    _free_retired()
    if pg_options is not None:
        logger.warning("rocenante: pg_options (%s) are not used: the rocenante backend takes its settings from "
                       "ROCENANTE_* variables", type(pg_options).__name__)
    return RocenanteProcessGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout, opts.group_id)


def register() -> None:
    if "ROCENANTE" not in dist.Backend._plugins:
        dist.Backend.register_backend("rocenante", _create, extended_api=True, devices=["cpu", "cuda"])


def status(group=None) -> dict:
    """Per device type: whether rocenante serves `group` (default: the world) and why, and when it does which
    collectives (`collectives`), up to what size (`threshold_bytes`), and from what size all-reduces go two-shot
    (`two_shot_from_bytes`, None: never)."""
    pg = group if group is not None else dist.group.WORLD
    if not isinstance(pg, RocenanteProcessGroup):
        raise ValueError(f"group uses backend {dist.get_backend(pg)!r}, not 'rocenante'")
    return pg.status()
