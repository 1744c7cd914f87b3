"""A ``torch.distributed`` process group whose collectives run over the job's MPI (mpi4py).

torch's own ``"mpi"`` backend exists only in torch built from source on a host with MPI; a
pip-installed torch has Gloo and NCCL. This module writes the process group in Python over
mpi4py and registers it with torch as the backend ``"mpidag"``
(``torch.distributed.Backend.register_backend``), so that a pip install gives collectives on
the MPI the job already runs on: no Gloo, no ``MASTER_ADDR``, no TCP port.

How an operation runs:

* Each group owns a communicator of its members (``MPI_Comm_create_group`` from
  ``COMM_WORLD``, collective over the members only), never the RPC transport's.
* Contiguous CPU tensors are handed to MPI as zero-copy views of their memory; others
  (non-contiguous, float16/bfloat16 in a reduction, CUDA tensors where the MPI is not
  CUDA-aware) go through a contiguous staging copy that is copied back when the operation
  completes.
* Every operation starts a non-blocking MPI call (``Iallreduce``, ``Ibcast``, ``Isend``, ...)
  and returns at once with a ``Work`` made from a ``torch.futures.Future``: ``wait()``,
  ``is_completed()`` and ``get_future()`` (which DDP's reducer and comm hooks use).
* One progress thread per process (``mpidag-collectives``) tests the pending requests
  (``MPI_Testall``) and completes the futures in order. While something is pending it
  yields the core between tests (``os.sched_yield``) for up to a second, then sleeps from
  50 µs doubling to 1 ms; with nothing pending it sleeps on a condition variable. No thread
  ever sits in a blocking MPI call, which would contend with the RPC progress engine's MPI
  calls (``MPI_THREAD_MULTIPLE``); the price is a few µs of hand-off per operation, and
  Open MPI's non-blocking all-reduce of one large buffer is 2.5x slower than its blocking
  one, so an ``all_reduce`` or ``reduce`` of more than ``CHUNK_BYTES`` runs as chunks, at
  most ``CHUNK_WINDOW`` in flight, issued in order by the progress thread on a second
  communicator of the group (so they cannot mismatch with the group's other operations);
  ``benchmarks/README.md``, "Collectives: MPI vs Gloo". Callbacks chained on a ``Work``'s
  future (``then``) run in that thread: they must not wait for another operation.
* CUDA tensors go to MPI directly (``__cuda_array_interface__``, after synchronizing the
  current stream) only where the MPI library says it is CUDA-aware
  (``MPIX_Query_cuda_support``); otherwise through a host copy.

Example::

    # run with: python -m mpidag.run -n 2 prog.py
    import torch, torch.distributed as dist
    import mpidag.rpc as rpc

    rpc.init_rpc()
    pg = rpc.init_process_group(backend="mpi")     # this module's group over every rank
    t = torch.ones(4)
    dist.all_reduce(t)                              # tensor([2., 2., 2., 2.])
    dist.destroy_process_group()
    rpc.shutdown()
"""

from __future__ import annotations

import collections
import datetime
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from mpidag._backoff import Backoff

__all__ = ["BACKEND", "MPIProcessGroup", "new_mpi_group", "register"]

#: the name the backend is registered under (``dist.init_process_group(backend=BACKEND)``)
BACKEND = "mpidag"

_RedOp = dist.ReduceOp.RedOpType
_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_COMPLEX = (torch.complex64, torch.complex128)
#: dtypes MPI cannot reduce natively: reduced in float32
_WIDENED = {torch.float16: torch.float32, torch.bfloat16: torch.float32}

#: an all_reduce / reduce of more bytes than this runs as chunks of this size. Measured at 2
#: ranks, Open MPI 5 wheel, 256 MiB float32 SUM (raw mpi4py, polled with Testall, medians
#: of 5): one MPI_Iallreduce 329 ms, blocking MPI_Allreduce 142 ms; all chunks
#: in flight at once: 1 MiB 174, 4 MiB 170, 16 MiB 206 ms; at most 16 MiB in flight:
#: 1 MiB x 16 124 ms, 4 MiB x 4 131 ms, 16 MiB x 2 152 ms (libnbc handles a bounded number
#: of moderate schedules well, one huge one or hundreds at once badly). Through this group
#: (benchmarks/bench_collectives.py, 3 rounds): 1 MiB x 16 gave 16 MiB 8.3 ms, 256 MiB
#: 124 ms; 4 MiB x 4 gave 9.9 ms and 145 ms (Gloo: 11.0-11.6 ms, 164-176 ms)
CHUNK_BYTES = 1 << 20
#: how many chunks of one operation are in flight at once (see CHUNK_BYTES)
CHUNK_WINDOW = 16


def _mpi() -> Any:
    from mpi4py import MPI  # initialises MPI; never at import of this module

    return MPI


@functools.cache
def _mpi_types() -> dict[torch.dtype, Any]:
    MPI = _mpi()
    return {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE,
            torch.complex64: MPI.C_FLOAT_COMPLEX, torch.complex128: MPI.C_DOUBLE_COMPLEX,
            torch.int8: MPI.INT8_T, torch.uint8: MPI.UINT8_T, torch.int16: MPI.INT16_T,
            torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T, torch.uint16: MPI.UINT16_T,
            torch.uint32: MPI.UINT32_T, torch.uint64: MPI.UINT64_T, torch.bool: MPI.C_BOOL}


def _mpi_op(op: Any, dtype: torch.dtype) -> Any:
    """The MPI reduction for torch's ``op`` on ``dtype`` (AVG is a SUM, divided after)."""
    MPI = _mpi()
    kind = op.op if hasattr(op, "op") else op
    if kind == _RedOp.PREMUL_SUM:
        raise ValueError("the mpidag backend does not support ReduceOp.PREMUL_SUM; scale the "
                         "tensor and use ReduceOp.SUM")
    if dtype == torch.bool:
        table = {_RedOp.SUM: MPI.LOR, _RedOp.MAX: MPI.LOR, _RedOp.BOR: MPI.LOR,
                 _RedOp.PRODUCT: MPI.LAND, _RedOp.MIN: MPI.LAND, _RedOp.BAND: MPI.LAND,
                 _RedOp.BXOR: MPI.LXOR}
        if kind not in table:
            raise ValueError(f"ReduceOp.{kind.name} is not defined on bool tensors")
        return table[kind]
    if kind in (_RedOp.MIN, _RedOp.MAX) and dtype in _COMPLEX:
        raise ValueError(f"ReduceOp.{kind.name} is not defined on complex tensors ({dtype})")
    if kind in (_RedOp.BAND, _RedOp.BOR, _RedOp.BXOR) and (dtype in _FLOATING
                                                           or dtype in _COMPLEX):
        raise ValueError(f"ReduceOp.{kind.name} needs an integer tensor, got {dtype}")
    if kind == _RedOp.AVG and not (dtype in _FLOATING or dtype in _COMPLEX):
        raise ValueError(f"ReduceOp.AVG needs a floating point or complex tensor, got {dtype} "
                         f"(use ReduceOp.SUM and divide)")
    return {_RedOp.SUM: MPI.SUM, _RedOp.AVG: MPI.SUM, _RedOp.PRODUCT: MPI.PROD,
            _RedOp.MIN: MPI.MIN, _RedOp.MAX: MPI.MAX, _RedOp.BAND: MPI.BAND,
            _RedOp.BOR: MPI.BOR, _RedOp.BXOR: MPI.BXOR}[kind]


def _unstack(flat: torch.Tensor, out: list[torch.Tensor]) -> None:
    """Copy row ``i`` of a gathered ``flat`` into ``out[i]`` (the caller's tensors)."""
    with torch.no_grad():
        for i, t in enumerate(out):
            t.copy_(flat[i].view(t.shape))


def _is_avg(op: Any) -> bool:
    return (op.op if hasattr(op, "op") else op) == _RedOp.AVG


class _Buffer:
    """One tensor as MPI sees it: ``tensor`` itself when MPI can use its memory (contiguous,
    on the CPU or CUDA-aware, a dtype MPI has when ``typed``), else a contiguous staging
    copy (on the CPU, float32 for a float16/bfloat16 reduction), copied back by
    :meth:`finish` if ``output``."""

    __slots__ = ("tensor", "work", "typed")

    def __init__(self, tensor: torch.Tensor, *, typed: bool, cuda_aware: bool,
                 fill: bool = True, what: str = "tensor") -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"the mpidag backend needs a torch.Tensor as {what}, got "
                            f"{type(tensor).__name__}")
        if tensor.is_sparse or tensor.layout != torch.strided:
            raise ValueError(f"the mpidag backend supports dense (strided) tensors only, got "
                             f"a {tensor.layout} {what}")
        if typed and tensor.dtype not in _mpi_types() and tensor.dtype not in _WIDENED:
            raise ValueError(f"the mpidag backend cannot reduce {tensor.dtype} tensors")
        dtype = _WIDENED.get(tensor.dtype, tensor.dtype) if typed else tensor.dtype
        direct = (tensor.is_contiguous() and dtype == tensor.dtype
                  and (tensor.device.type == "cpu" or (tensor.is_cuda and cuda_aware)))
        self.tensor, self.typed = tensor, typed
        if direct:
            self.work = tensor.detach()
            if tensor.is_cuda:
                torch.cuda.current_stream(tensor.device).synchronize()
        elif fill:
            self.work = tensor.detach().to("cpu", dtype).contiguous()
            if self.work.data_ptr() == tensor.data_ptr():
                self.work = self.work.clone()
        else:
            self.work = torch.empty(tensor.shape, dtype=dtype)

    def spec(self) -> list[Any]:
        """``[buffer, datatype]`` for mpi4py (which infers the count, per rank in the
        collectives that split a buffer into blocks): typed, or the tensor's bytes."""
        flat = self.work.reshape(-1)
        if self.typed:
            return [flat.numpy() if flat.device.type == "cpu" else flat,
                    _mpi_types()[flat.dtype]]
        raw = flat.view(torch.uint8)
        return [raw.numpy() if raw.device.type == "cpu" else raw, _mpi().BYTE]

    def finish(self) -> None:
        if self.work.data_ptr() != self.tensor.data_ptr():
            with torch.no_grad():
                self.tensor.copy_(self.work)


class _Chunks:
    """A large reduction as ``count`` chunk operations (``start(i)`` issues chunk ``i`` and
    returns its request), at most ``CHUNK_WINDOW`` in flight; only the progress thread
    issues and tests them."""

    __slots__ = ("start", "count", "requests", "done")

    def __init__(self, start: Callable[[int], Any], count: int) -> None:
        self.start, self.count = start, count
        self.requests: list[Any] = []
        self.done = 0  # chunks known to be complete (they complete in order)

    def pump(self) -> bool:
        """Note the chunks that completed, issue more up to the window; True once every
        chunk is issued."""
        while self.done < len(self.requests) and self.requests[self.done].Test():
            self.done += 1
        while len(self.requests) < self.count and \
                len(self.requests) - self.done < CHUNK_WINDOW:
            self.requests.append(self.start(len(self.requests)))
        return len(self.requests) == self.count


class _Op:
    """A started operation: its MPI requests, what to do when they complete, its future
    (``pump``, for chunked operations, issues more requests and says whether all are)."""

    __slots__ = ("requests", "then", "result", "future", "deadline", "what", "keep", "pump")

    def __init__(self, requests: list[Any], then: Callable[[], None] | None,
                 result: list[torch.Tensor], deadline: float, what: str, keep: Any,
                 pump: Callable[[], bool] | None = None) -> None:
        self.requests, self.then, self.result = requests, then, result
        self.future: torch.futures.Future = torch.futures.Future()
        self.deadline, self.what, self.keep, self.pump = deadline, what, keep, pump


class _Progress:
    """The thread that tests the pending requests of every group and completes their futures
    (one per process, started on first use, asleep while nothing is pending)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: list[_Op] = []
        self._thread: threading.Thread | None = None
        self._abandoned: list[_Op] = []  # timed out; their buffers stay alive for MPI

    def submit(self, op: _Op) -> None:
        with self._cond:
            self._pending.append(op)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="mpidag-collectives",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        MPI = _mpi()
        backoff = Backoff(spin=1.0, min_sleep=50e-6, max_sleep=1e-3)
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                batch = list(self._pending)
            done = []
            for op in batch:
                try:
                    issued = op.pump is None or op.pump()
                    complete = MPI.Request.Testall(op.requests) and issued
                except Exception as exc:  # an MPI error: this op fails, the others go on
                    op.future.set_exception(RuntimeError(f"{op.what} failed in MPI: {exc}"))
                    done.append(op)
                    continue
                if complete:
                    try:
                        if op.then is not None:
                            op.then()
                    except Exception as exc:
                        op.future.set_exception(exc)
                    else:
                        op.future.set_result(op.result)
                    done.append(op)
                elif time.monotonic() > op.deadline:
                    self._abandoned.append(op)
                    op.future.set_exception(RuntimeError(
                        f"{op.what} did not complete within the process group's timeout (a "
                        f"member did not call it?); the group cannot be used any more"))
                    done.append(op)
            if done:
                with self._cond:
                    self._pending = [op for op in self._pending if op not in done]
                backoff.reset()
            else:
                backoff.idle()


_progress = _Progress()


class MPIProcessGroup(dist.ProcessGroup):
    """A ``torch.distributed.ProcessGroup`` over an MPI communicator (see the module doc).

    Made by torch when a group of backend ``"mpidag"`` is created (``register()`` tells torch
    how), or directly with :func:`new_mpi_group`. Group rank ``i`` is the communicator's rank
    ``i``; ``world_ranks[i]`` is its rank in ``COMM_WORLD``.

    Example::

        # run with: python -m mpidag.run -n 2 prog.py
        pg = new_mpi_group()                           # over COMM_WORLD's ranks
        t = torch.tensor([float(pg.rank() + 1)])
        pg.allreduce([t]).wait()                       # t == tensor([3.])
    """

    def __init__(self, comm: Any, world_ranks: Sequence[int],
                 timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                 cuda_aware: bool | None = None) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())
        self._comm = comm
        # chunks of large reductions, issued in order by the progress thread (collective:
        # every group is made by all its members)
        self._chunk_comm = comm.Dup()
        self._chunked: collections.deque[_Chunks] = collections.deque()
        self._world_ranks = list(world_ranks)
        self._timeout = timeout.total_seconds()
        if cuda_aware is None:
            from mpidag.transport.mpi import detect_cuda_aware

            cuda_aware = detect_cuda_aware()
        self._cuda_aware = cuda_aware

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    def _get_backend(self, device: Any) -> MPIProcessGroup:
        """The group is its own backend on every device (torch 2.14's
        ``batch_isend_irecv`` asks for the device's backend; the C++ default finds none
        registered for a process group written in Python)."""
        return self

    @property
    def comm(self) -> Any:
        """The group's own MPI communicator (``mpi4py.MPI.Intracomm``)."""
        return self._comm

    @property
    def world_ranks(self) -> list[int]:
        """``COMM_WORLD`` rank of each group rank."""
        return list(self._world_ranks)

    def __repr__(self) -> str:
        return f"MPIProcessGroup(rank={self.rank()}, size={self.size()}, " \
               f"world_ranks={self._world_ranks})"

    # ------------------------------------------------------------------ plumbing
    def _buffer(self, tensor: Any, *, typed: bool, fill: bool = True,
                what: str = "tensor") -> _Buffer:
        return _Buffer(tensor, typed=typed, cuda_aware=self._cuda_aware, fill=fill, what=what)

    def _start(self, what: str, requests: list[Any], then: Callable[[], None] | None,
               result: list[torch.Tensor], keep: Any = None) -> Any:
        op = _Op(requests, then, result, time.monotonic() + self._timeout, what, keep)
        future = op.future
        _progress.submit(op)
        return _create_work_from_future(future)

    def _reduction(self, what: str, buffer: _Buffer, start: Callable[[Any, Any], Any],
                   then: Callable[[], None] | None, tensor: torch.Tensor) -> Any:
        """Start a reduction of ``buffer``: ``start(comm, spec)`` issues it on ``comm`` for
        the ``[buffer, datatype]`` ``spec``; in chunks if it is over ``CHUNK_BYTES``."""
        flat, datatype = buffer.spec()
        step = max(1, CHUNK_BYTES // buffer.work.element_size())
        if len(flat) <= step:
            return self._start(what, [start(self._comm, [flat, datatype])], then, [tensor],
                               buffer)
        chunks = _Chunks(lambda i: start(self._chunk_comm,
                                         [flat[i * step:(i + 1) * step], datatype]),
                         -(-len(flat) // step))
        self._chunked.append(chunks)

        def pump() -> bool:  # in the progress thread: the group's chunked ops in order
            while self._chunked and self._chunked[0].pump():
                self._chunked.popleft()
            return len(chunks.requests) == chunks.count

        op = _Op(chunks.requests, then, [tensor], time.monotonic() + self._timeout, what,
                 buffer, pump)
        _progress.submit(op)
        return _create_work_from_future(op.future)

    def _single(self, tensors: Any, what: str) -> torch.Tensor:
        if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
            raise ValueError(f"{what}: the mpidag backend takes one tensor per call (one "
                             f"device per process), got {len(tensors)}")
        return tensors[0]

    def _root(self, root: int, what: str) -> int:
        if not 0 <= root < self.size():
            raise ValueError(f"{what}: root rank {root} is not in this group of size "
                             f"{self.size()}")
        return root

    def _check_same(self, tensor: torch.Tensor, other: torch.Tensor, what: str,
                    numel: int | None = None) -> None:
        if not isinstance(other, torch.Tensor):
            raise TypeError(f"{what}: expected tensors, got {type(other).__name__}")
        if other.dtype != tensor.dtype:
            raise ValueError(f"{what}: tensors must have one dtype, got {tensor.dtype} and "
                             f"{other.dtype}")
        expected = tensor.numel() if numel is None else numel
        if other.numel() != expected:
            raise ValueError(f"{what}: a tensor of {expected} elements was expected, got "
                             f"shape {tuple(other.shape)} ({other.numel()} elements)")

    def _one_per_member(self, tensors: list[torch.Tensor], like: torch.Tensor, what: str,
                        name: str) -> None:
        """Check that ``tensors`` (the argument ``name``) has one tensor like ``like`` per
        group member."""
        if len(tensors) != self.size():
            raise ValueError(f"{what}: {name} has {len(tensors)} tensors; it needs one per "
                             f"group member ({self.size()})")
        for t in tensors:
            self._check_same(like, t, what)

    def _average(self, buffer: _Buffer, op: Any) -> Callable[[], None]:
        size = self.size()

        def then() -> None:
            if _is_avg(op):
                buffer.work.div_(size)
            buffer.finish()
        return then

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        tensor = self._single(tensors, "all_reduce")
        buffer = self._buffer(tensor, typed=True)
        mpi_op = _mpi_op(op, buffer.work.dtype)
        return self._reduction(
            "all_reduce", buffer,
            lambda comm, spec: comm.Iallreduce(_mpi().IN_PLACE, spec, mpi_op),
            self._average(buffer, op), tensor)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        works = [self.allreduce([t], opts) for t in tensors]
        for work in works[:-1]:
            work.wait()
        return works[-1]

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = self._root(opts.rootRank if opts is not None else 0, "broadcast")
        tensor = self._single(tensors, "broadcast")
        buffer = self._buffer(tensor, typed=False)
        request = self._comm.Ibcast(buffer.spec(), root)
        return self._start("broadcast", [request], buffer.finish, [tensor], buffer)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        root = self._root(opts.rootRank if opts is not None else 0, "reduce")
        tensor = self._single(tensors, "reduce")
        buffer = self._buffer(tensor, typed=True)
        mpi_op = _mpi_op(op, buffer.work.dtype)
        if self.rank() == root:
            return self._reduction(
                "reduce", buffer,
                lambda comm, spec: comm.Ireduce(_mpi().IN_PLACE, spec, mpi_op, root),
                self._average(buffer, op), tensor)
        return self._reduction("reduce", buffer,
                               lambda comm, spec: comm.Ireduce(spec, None, mpi_op, root),
                               None, tensor)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                        opts: Any = None) -> Any:
        self._check_same(input, output, "all_gather_into_tensor",
                         numel=input.numel() * self.size())
        src = self._buffer(input, typed=False, what="input")
        dst = self._buffer(output, typed=False, fill=False, what="output")
        request = self._comm.Iallgather(src.spec(), dst.spec())
        return self._start("all_gather_into_tensor", [request], dst.finish, [output],
                           (src, dst))

    all_gather_single = _allgather_base

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> Any:
        tensor = self._single(inputs, "all_gather")
        out = self._single(outputs, "all_gather")
        self._one_per_member(out, tensor, "all_gather", "tensor_list")
        src = self._buffer(tensor, typed=False, what="input")
        flat = torch.empty((self.size(), *tensor.shape), dtype=tensor.dtype)
        dst = self._buffer(flat, typed=False, fill=False)
        request = self._comm.Iallgather(src.spec(), dst.spec())
        return self._start("all_gather", [request], functools.partial(_unstack, flat, out),
                           list(out), (src, dst))

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Any:
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        for work in works[:-1]:
            work.wait()
        return works[-1]

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                             opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        self._check_same(output, input, "reduce_scatter_tensor",
                         numel=output.numel() * self.size())
        src = self._buffer(input, typed=True, what="input")
        dst = self._buffer(output, typed=True, fill=False, what="output")
        mpi_op = _mpi_op(op, src.work.dtype)
        request = self._comm.Ireduce_scatter_block(src.spec(), dst.spec(), mpi_op)
        return self._start("reduce_scatter_tensor", [request], self._average(dst, op),
                           [output], (src, dst))

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                       opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        output = self._single(outputs, "reduce_scatter")
        parts = self._single(inputs, "reduce_scatter")
        self._one_per_member(parts, output, "reduce_scatter", "input_list")
        dtype = _WIDENED.get(output.dtype, output.dtype)
        flat = torch.cat([t.detach().reshape(-1).to("cpu", dtype) for t in parts]) \
            if parts else torch.empty(0, dtype=dtype)
        src = self._buffer(flat, typed=True, what="input")
        dst = self._buffer(output, typed=True, fill=False, what="output")
        request = self._comm.Ireduce_scatter_block(src.spec(), dst.spec(),
                                                   _mpi_op(op, dtype))
        return self._start("reduce_scatter", [request], self._average(dst, op), [output],
                           (src, dst))

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: Any = None) -> Any:
        root = self._root(opts.rootRank if opts is not None else 0, "gather")
        tensor = self._single(inputs, "gather")
        src = self._buffer(tensor, typed=False, what="input")
        out: list[torch.Tensor] = []
        if self.rank() == root:
            out = self._single(outputs, "gather")
            self._one_per_member(out, tensor, "gather", "gather_list")
            flat = torch.empty((self.size(), *tensor.shape), dtype=tensor.dtype)
            dst = self._buffer(flat, typed=False, fill=False)
            request = self._comm.Igather(src.spec(), dst.spec(), root)
            return self._start("gather", [request], functools.partial(_unstack, flat, out),
                               list(out), (src, dst))
        request = self._comm.Igather(src.spec(), None, root)
        return self._start("gather", [request], None, [], src)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                opts: Any = None) -> Any:
        root = self._root(opts.rootRank if opts is not None else 0, "scatter")
        output = self._single(outputs, "scatter")
        dst = self._buffer(output, typed=False, fill=False, what="output")
        if self.rank() == root:
            parts = self._single(inputs, "scatter")
            self._one_per_member(parts, output, "scatter", "scatter_list")
            flat = torch.cat([t.detach().reshape(-1).cpu() for t in parts])
            src = self._buffer(flat, typed=False)
            request = self._comm.Iscatter(src.spec(), dst.spec(), root)
            return self._start("scatter", [request], dst.finish, [output], (src, dst))
        request = self._comm.Iscatter(None, dst.spec(), root)
        return self._start("scatter", [request], dst.finish, [output], dst)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any = None) -> Any:
        if output_split_sizes or input_split_sizes:
            raise ValueError("all_to_all_single: the mpidag backend supports equal splits only "
                             "(leave output_split_sizes/input_split_sizes unset)")
        self._check_same(output, input, "all_to_all_single")
        if input.numel() % self.size():
            raise ValueError(f"all_to_all_single: {input.numel()} elements do not split into "
                             f"{self.size()} equal parts")
        src = self._buffer(input, typed=False, what="input")
        dst = self._buffer(output, typed=False, fill=False, what="output")
        request = self._comm.Ialltoall(src.spec(), dst.spec())
        return self._start("all_to_all_single", [request], dst.finish, [output], (src, dst))

    def barrier(self, opts: Any = None) -> Any:
        return self._start("barrier", [self._comm.Ibarrier()], None, [])

    # ------------------------------------------------------------------ point to point
    def _peer(self, peer: int, what: str) -> int:
        if not 0 <= peer < self.size():
            raise ValueError(f"{what}: rank {peer} is not in this group of size {self.size()}")
        return peer

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        tensor = self._single(tensors, "send")
        buffer = self._buffer(tensor, typed=False)
        request = self._comm.Isend(buffer.spec(), self._peer(dst, "send"), tag)
        return self._start("send", [request], None, [tensor], buffer)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        tensor = self._single(tensors, "recv")
        buffer = self._buffer(tensor, typed=False, fill=False)
        request = self._comm.Irecv(buffer.spec(), self._peer(src, "recv"), tag)
        return self._start("recv", [request], buffer.finish, [tensor], buffer)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        raise ValueError("recv without src: the mpidag backend needs the source rank "
                         "(pass src=)")


# ---------------------------------------------------------------------------- making groups

#: MPI_Comm_create_group's tag for the groups made here
CREATE_GROUP_TAG = 0x6D70

_pending = threading.local()  # the communicator rpc.init_process_group made for the next group


def new_mpi_group(world_ranks: Sequence[int] | None = None, *, parent: Any = None,
                  timeout: datetime.timedelta = datetime.timedelta(minutes=30)
                  ) -> MPIProcessGroup:
    """An :class:`MPIProcessGroup` over ``world_ranks`` (ranks of ``parent``, by default
    ``COMM_WORLD``; default all); collective over those ranks only.

    Example::

        # run with: python -m mpidag.run -n 3 prog.py
        pg = new_mpi_group([0, 2])                 # on ranks 0 and 2 only
        pg.barrier().wait()
    """
    MPI = _mpi()
    parent = MPI.COMM_WORLD if parent is None else parent
    ranks = list(range(parent.Get_size())) if world_ranks is None else list(world_ranks)
    if parent.Get_rank() not in ranks:
        raise ValueError(f"new_mpi_group: this rank ({parent.Get_rank()}) is not in "
                         f"ranks={ranks}; only the members call it")
    group = parent.Get_group().Incl(ranks)
    try:
        # a tag every MPI accepts (the standard guarantees MPI_TAG_UB >= 32767; MPICH's
        # wheel refuses 0x6D706964)
        comm = parent.Create_group(group, tag=CREATE_GROUP_TAG)
    finally:
        group.Free()
    return MPIProcessGroup(comm, ranks, timeout)


def _create(options: Any, backend_options: Any) -> MPIProcessGroup:
    """torch's creator for backend ``"mpidag"`` (extended API: ``options`` has ``group_rank``,
    ``group_size``, ``timeout`` and ``global_ranks_in_group``)."""
    comm = getattr(_pending, "comm", None)
    if comm is not None:  # made by mpidag.rpc.init_process_group for this group
        _pending.comm, ranks = None, _pending.ranks
    else:
        global_ranks = list(options.global_ranks_in_group)
        default = dist.distributed_c10d._world.default_pg
        if global_ranks and isinstance(default, MPIProcessGroup):  # dist.new_group(ranks)
            pg = new_mpi_group(global_ranks, parent=default.comm, timeout=options.timeout)
            pg._world_ranks = [default._world_ranks[r] for r in global_ranks]
            return pg
        MPI = _mpi()
        world = MPI.COMM_WORLD
        if global_ranks:
            raise ValueError(
                "a subgroup of backend 'mpidag' needs a default group of backend 'mpidag'; "
                "create the default group with mpidag.rpc.init_process_group(backend='mpi')")
        if options.group_size != world.Get_size() or options.group_rank != world.Get_rank():
            raise ValueError(
                f"backend 'mpidag': rank={options.group_rank}, world_size="
                f"{options.group_size} differ from the MPI job's (rank {world.Get_rank()} of "
                f"{world.Get_size()}); leave them unset, or make a group of some ranks with "
                f"mpidag.rpc.init_process_group(ranks, backend='mpi')")
        ranks = list(range(world.Get_size()))
        comm = world.Dup()
    if comm.Get_size() != options.group_size or comm.Get_rank() != options.group_rank:
        raise ValueError(f"backend 'mpidag': the communicator is rank {comm.Get_rank()} of "
                         f"{comm.Get_size()}, torch asked for rank {options.group_rank} of "
                         f"{options.group_size}")
    return MPIProcessGroup(comm, ranks, options.timeout)


def _prepare(comm: Any, ranks: list[int]) -> None:
    """Hand ``comm`` (over ``ranks`` of ``COMM_WORLD``) to the next group made on this
    thread (``mpidag.rpc.init_process_group``)."""
    _pending.comm, _pending.ranks = comm, ranks


_torch_init_process_group: Callable[..., Any] | None = None


def _init_process_group(backend: Any = None, init_method: str | None = None,
                        *args: Any, **kwargs: Any) -> Any:
    """``torch.distributed.init_process_group``, with ``backend="mpidag"`` (and ``"mpi"`` on a
    torch without its own MPI) made over the MPI job when neither ``init_method`` nor
    ``store`` is given: rank and size come from ``COMM_WORLD``, no rendezvous."""
    assert _torch_init_process_group is not None
    name = str(backend).lower() if backend is not None else ""
    ours = name == BACKEND or (name == "mpi" and not dist.is_mpi_available())
    if ours and init_method is None and kwargs.get("store") is None and not args:
        world = _mpi().COMM_WORLD
        kwargs.pop("store", None)
        rank, size = kwargs.pop("rank", -1), kwargs.pop("world_size", -1)
        if (rank, size) not in ((-1, -1), (world.Get_rank(), world.Get_size())):
            raise ValueError(
                f"init_process_group(backend={backend!r}): rank={rank}, world_size={size} "
                f"differ from the MPI job's (rank {world.Get_rank()} of {world.Get_size()}); "
                f"leave them unset, or make a group of some ranks with "
                f"mpidag.rpc.init_process_group(ranks, backend='mpi')")
        return _torch_init_process_group(BACKEND, store=dist.HashStore(),
                                         rank=world.Get_rank(), world_size=world.Get_size(),
                                         **kwargs)
    return _torch_init_process_group(backend, init_method, *args, **kwargs)


def register() -> None:
    """Register the backend ``"mpidag"`` with torch (done when ``mpidag.rpc`` is imported;
    loads no MPI), and let ``torch.distributed.init_process_group(backend="mpidag")`` (or
    ``"mpi"`` on a pip-installed torch, which has no MPI backend of its own) make a group
    over the MPI job without ``MASTER_ADDR`` or a port. Idempotent.

    Example::

        >>> register()
        >>> "mpidag" in torch.distributed.Backend.backend_list
        True
    """
    global _torch_init_process_group
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True,
                                      devices=["cpu", "cuda"])
    if _torch_init_process_group is None:
        _torch_init_process_group = dist.init_process_group
        wrapped = functools.wraps(_torch_init_process_group)(_init_process_group)
        dist.init_process_group = wrapped  # the attribute users call

