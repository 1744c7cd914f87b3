"""Public RPC API, mirroring ``torch.distributed.rpc`` name for name.

Every function here works on the current :class:`~mpidag._runtime.Runtime` (made by
:func:`init_rpc`, ended by :func:`shutdown`); the ``RRef`` type and ``remote`` are in
:mod:`mpidag.rpc.rref`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mpidag import _runtime
from mpidag._config import Config
from mpidag._debug import (
    StateWatcher,
    configure_logging,
    install_signal_dump,
    uninstall_signal_dump,
)
from mpidag._remote_profiling import set_gil_profiling
from mpidag._runtime import Runtime
from mpidag.agent.options import (
    DEFAULT_SHUTDOWN_TIMEOUT,
    UNSET_RPC_TIMEOUT,
    BackendType,
    MPIRpcBackendOptions,
    WorkerInfo,
    check_timeout,
)
from mpidag.errors import RPCError
from mpidag.rpc.agent_view import (  # noqa: F401 - torch's private helpers, as rpc.api has them
    _all_gather,
    _barrier,
    _get_current_rpc_agent,
    _wait_all_workers,
)
from mpidag.rpc.rref import RRef, check_call

__all__ = [
    "init_rpc",
    "shutdown",
    "rpc_sync",
    "rpc_async",
    "get_worker_info",
    "failed_workers",
    "is_available",
    "get_rpc_timeout",
]

log = logging.getLogger(__name__)


def is_available() -> bool:
    """Whether mpidag's RPC can be used (mpi4py importable), as torch's ``is_available``.

    Example::

        >>> mpidag.rpc.is_available()
        True
    """
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


class _FromMPI:
    """The default ``world_size`` of ``init_rpc``: the size of the MPI job."""

    def __repr__(self) -> str:
        return "<the MPI job's size>"


_FROM_MPI: Any = _FromMPI()

#: variables that MPI launchers (mpirun of Open MPI, MPICH, Intel MPI; srun) give the
#: processes they start, and that a process's children inherit
_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


def _started_again_in_a_child() -> RPCError | None:
    """The error for a child process of an MPI rank (``torch.multiprocessing.spawn``,
    ``multiprocessing.Process``) that would start MPI: it inherits the launcher's
    variables and would start MPI again as its parent's rank, which hangs or crashes."""
    import multiprocessing

    if multiprocessing.parent_process() is None:
        return None
    found = [v for v in _LAUNCHER_VARIABLES if v in os.environ]
    if not found:
        return None
    return RPCError(
        f"init_rpc called in a child process of MPI rank {os.environ[found[0]]} "
        f"(multiprocessing / torch.multiprocessing.spawn under an MPI launcher: {found[0]} is "
        f"set): the child would start MPI again as its parent's rank, which hangs or crashes. "
        f"With mpidag each worker is an MPI rank: drop mp.spawn and launch one rank per "
        f"worker with `python -m mpidag.run -n N prog.py` (or mpirun -n N), calling init_rpc "
        f"in every rank")


def init_rpc(
    name: str | None = None,
    backend: BackendType | None = None,
    rank: int = -1,
    world_size: int | None = _FROM_MPI,
    rpc_backend_options: Any = None,
) -> None:
    """Start RPC on this rank; collective: every rank of ``COMM_WORLD`` calls it.

    With no arguments the rank and world size come from MPI and the worker is named
    ``worker{rank}``. torch-style arguments are checked against MPI: a ``rank`` or
    ``world_size`` that does not match raises a ``ValueError`` at once on the rank that
    passed it, before any collective call (the other ranks may not call ``init_rpc`` at
    all); any other bad argument or setting raises on the rank that passed it, and an
    ``RPCError`` naming that rank on the others, so no rank hangs.

    Args:
        name: this worker's unique name (default ``worker{rank}``).
        backend: ``BackendType.MPI`` (default); ``TENSORPIPE`` is accepted and runs on MPI.
        rank: must equal the MPI rank, or -1/None to take it from MPI; with a rank, pass
            ``world_size`` too (without one torch starts its dynamic membership, which
            mpidag does not have).
        world_size: must equal the MPI world size; leave it out to take it from MPI
            (``None`` is refused, as torch refuses it without a rank).
        rpc_backend_options: :class:`MPIRpcBackendOptions` (torch's
            ``TensorPipeRpcBackendOptions`` is the same class here).

    Example::

        # prog.py, run with: python -m mpidag.run -n 2 prog.py
        import torch, mpidag.rpc as rpc
        rpc.init_rpc()                      # worker0 and worker1
        if rpc.get_worker_info().id == 0:
            print(rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)))
        rpc.shutdown()
    """
    with _runtime.lifecycle_lock:
        if _runtime.current_or_none() is not None:
            raise RPCError("RPC is already initialized; call mpidag.rpc.shutdown() first")
        problem = _started_again_in_a_child()
        if problem is not None:  # before MPI starts: it would hang or crash
            raise problem
        from mpidag.transport.mpi import (
            MPITransport,
            self_communicator,
            thread_level_error,
            world_rank_and_size,
        )

        # what this rank finds alone is raised at once, before any collective call
        problem = thread_level_error()  # the same on every rank
        if problem is not None:
            raise problem
        my_rank, size = world_rank_and_size()
        # torch's world of one (init_rpc(world_size=1) by one process of a larger job):
        # a world of its own on MPI_COMM_SELF, which no other rank takes part in
        alone = world_size == 1 and size > 1 and rank in (-1, 0, None)
        if alone:
            my_rank, size, rank = 0, 1, 0
        problem = _check_world(rank, world_size, my_rank, size)
        if problem is not None:
            # other ranks may wait for this one in init_rpc: uncaught, it ends the job
            problem._mpidag_abort_if_uncaught = True  # type: ignore[attr-defined]
            _install_process_hooks()
            raise problem
        if world_size is _FROM_MPI:
            world_size = None
        config = Config()
        problem = _check_init_arguments(name, backend, rank, world_size)
        options = None
        if problem is None:
            try:
                config = Config.from_env()
                options = MPIRpcBackendOptions.from_any(rpc_backend_options)
            except (TypeError, ValueError) as exc:  # ConfigError is a ValueError
                problem = exc
        transport = MPITransport(self_communicator() if alone else None,
                                 cuda_aware=config.cuda_aware,
                                 recv_cache_bytes=config.recv_cache_bytes, ft=config.ft,
                                 compiled=config.compiled)
        if problem is None:
            configure_logging(transport.rank, config.log_level)
        if problem is None and transport.size == 1 and not alone:
            problem = _singleton_of_a_larger_launch()
        runtime = Runtime.connect(transport, name=name, rank=rank, world_size=world_size,
                                  options=options, config=config, rref_type=RRef,
                                  problem=problem)
        # current before serving starts: a request that is already waiting may run user
        # code that calls the public API
        _runtime.install(runtime)
        if config.gc_freeze:
            _freeze_heap()
        if not config.glibc_fastbins:
            _without_fastbins()
        runtime.serve()
        watcher = StateWatcher(runtime, config.inspect_base)  # python -m mpidag.inspect
        watcher.start()
        runtime.closers.append(watcher.stop)
        _install_process_hooks()
        log.debug("RPC started on %s", runtime.where())


def _singleton_of_a_larger_launch() -> Exception | None:
    """An error when the launcher started several tasks but MPI put each in a world of its
    own (``srun --mpi=pmi2`` with Open MPI, or a launcher of another MPI than mpi4py's):
    every task would otherwise run alone as worker0 and "succeed"."""
    for variable in ("SLURM_STEP_NUM_TASKS", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        value = os.environ.get(variable, "")
        if value.isdigit() and int(value) > 1:
            return RPCError(
                f"the launcher started {value} tasks ({variable}) but MPI gives this one a "
                f"world of 1 rank: the launcher and the MPI that mpi4py uses do not match. "
                f"Under Slurm use `srun --mpi=pmix` for Open MPI and `--mpi=pmi2` for MPICH "
                f"or Intel MPI (`srun --mpi=list`; MPIDAG_SRUN_MPI for `python -m "
                f"mpidag.run`), or the mpirun of mpi4py's MPI (`python -c 'import mpi4py; "
                f"print(mpi4py.get_config())'`).")
    return None


def _freeze_heap() -> None:
    """Move every object alive now out of the cyclic collector's reach (``gc.freeze``).

    After ``import torch`` a full (generation 2) collection took 71-73 ms here and stalled
    every call in flight on that rank; frozen, it scans only objects made after init.
    Objects alive now are still freed by reference counting; only cycles among them are
    never collected. ``MPIDAG_GC_FREEZE=0`` turns this off.
    """
    gc.collect()
    gc.freeze()


#: ``mallopt``'s parameter number of the fastbins' size limit (glibc's malloc.h)
_M_MXFAST = 1


def _without_fastbins() -> bool:
    """Turn glibc's fastbins off for this process (``mallopt(M_MXFAST, 0)``); returns whether
    it did (not under another C library). ``init_rpc`` calls it unless
    ``MPIDAG_GLIBC_FASTBINS=1``.

    With fastbins, glibc keeps small freed chunks unmerged until an allocation of 1 KiB or
    more consolidates them all: after a backward pass freed its graph that one allocation
    took 55-60 µs here (a 100-byte one 1 µs), and it fell on the next message or plan
    (`docs/design.md`, "The compiled path"). Without them the chunks are merged as they are
    freed; the one-rank 1,000-op loop of ``bench_autograd.py`` was no slower.

    Example::

        >>> _without_fastbins()   # on glibc
        True
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(_M_MXFAST, 0) == 1


def _check_init_arguments(name, backend, rank, world_size) -> Exception | None:
    if name is not None and (not isinstance(name, str) or not name or ":" in name):
        return ValueError(f"worker name must be a non-empty str without ':', got {name!r}")
    if backend is not None and backend not in (BackendType.MPI, BackendType.TENSORPIPE) and \
            getattr(backend, "name", None) not in ("MPI", "TENSORPIPE"):  # torch's enum too
        return TypeError(f"Argument backend must be a member of BackendType: "
                         f"mpidag.rpc.BackendType.MPI (or TENSORPIPE, which runs on MPI), got "
                         f"{backend!r}")
    return None


def _check_world(rank: Any, world_size: Any, my_rank: int, size: int) -> Exception | None:
    """The error of a ``rank``/``world_size`` of ``init_rpc`` that does not fit the MPI job
    (this process is ``my_rank`` of ``size``). Found by this rank alone, it is raised at
    once, before any collective call: the other ranks may never call ``init_rpc`` (torch's
    world of a subset of the processes, ``init_rpc(world_size=1)`` on rank 0 only)."""
    if rank is not None and (not isinstance(rank, int) or rank < -1):
        return ValueError(f"rank must be a non-negative int or -1, got {rank!r}")
    explicit_none = world_size is None
    if world_size is _FROM_MPI:
        world_size = None
    elif world_size is not None and (not isinstance(world_size, int) or world_size < 1):
        return ValueError(f"world_size must be a positive int, got {world_size!r}")
    problem = _runtime.world_mismatch(rank, world_size, my_rank, size)
    if problem is not None:
        return problem
    if world_size is None and rank not in (-1, None):
        return ValueError(
            f"init_rpc(rank={rank!r}) without a world_size is torch's dynamic membership "
            f"(workers that join and leave one by one), which mpidag does not have: the RPC "
            f"world is the MPI job ({size} ranks), started and shut down together. Pass "
            f"world_size={size}, or leave out rank= too")
    if explicit_none:
        return ValueError(
            f"init_rpc(world_size=None) needs a rank (torch's dynamic membership), which mpidag "
            f"does not have: the RPC world is the MPI job ({size} ranks). Leave world_size= "
            f"out, or pass world_size={size}")
    return None


# ------------------------------------------------------------------ process hooks
# What a session needs from the process while it runs is installed by init_rpc and taken
# out by shutdown(), so every init_rpc/shutdown cycle installs and removes it once and the
# process is left as it was. One thing stays after a shutdown in which a worker of a
# fault-tolerant job had failed: the exit that skips MPI_Finalize, and the record of
# sys.exit's status it needs (see _keep_exit_without_finalize).


class _AbortOnUncaught:
    """``sys.excepthook`` while a session runs: prints as the hook before it did
    (``previous``), then ends what would otherwise hang: the whole MPI job (the other ranks
    would wait for this one forever), or under ``--ft`` this rank alone (killed, so that
    the survivors see it fail), or the job when ``init_rpc`` failed on this rank alone."""

    def __init__(self, previous: Callable[..., Any]) -> None:
        self.previous = previous

    def __call__(self, exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        self.previous(exc_type, exc, tb)
        if getattr(exc, "_mpidag_abort_if_uncaught", False):  # see init_rpc
            from mpidag.transport.mpi import abort_world

            sys.stderr.write(
                "mpidag: init_rpc failed on this rank alone (above); aborting the MPI job, "
                "whose other ranks may wait for this one in init_rpc\n")
            sys.stderr.flush()
            abort_world(1)
        runtime = _runtime.current_or_none()
        if runtime is not None and runtime.config.ft:
            sys.stderr.write(
                f"mpidag: uncaught {exc_type.__name__} on {runtime.where()}; this rank exits "
                f"and the other ranks of this fault-tolerant job go on without it\n")
            sys.stderr.flush()
            # killed, not exited: Open MPI's runtime reports a rank that dies of a signal
            # to the survivors (ULFM), but takes a plain exit for a normal end
            os.kill(os.getpid(), signal.SIGKILL)
        if runtime is not None and runtime.config.abort_on_error:
            sys.stderr.write(
                f"mpidag: uncaught {exc_type.__name__} on {runtime.where()}; aborting the MPI "
                f"job so that the other ranks do not wait for this one forever\n"
            )
            sys.stderr.flush()
            runtime.transport.abort(1)


def _install_process_hooks() -> None:
    """Install the session's process hooks (taken out by :func:`_remove_process_hooks`);
    calling it again before they are removed changes nothing.

    * ``sys.excepthook``: :class:`_AbortOnUncaught`, over the hook there was;
    * at exit, :func:`_shutdown_at_exit` shuts down a session the program forgot to, and
      :func:`_skip_finalize_after_failures` (registered first, so that it runs after the
      ones registered later: atexit is last in, first out) leaves without
      ``MPI_Finalize`` once a worker of a fault-tolerant job failed;
    * ``kill -USR1 <pid>``: thread stacks, calls in flight, RRefs.
    """
    install_signal_dump()
    for hook in (_skip_finalize_after_failures, _shutdown_at_exit):
        atexit.unregister(hook)  # never twice: the last session's may still be there
        atexit.register(hook)
    if not isinstance(sys.excepthook, _AbortOnUncaught):
        sys.excepthook = _AbortOnUncaught(sys.excepthook)


def _remove_process_hooks() -> None:
    """Undo :func:`_install_process_hooks` at ``shutdown()``: ``sys.excepthook`` is the
    hook there was before ``init_rpc`` again, the exit hooks are unregistered. A hook the
    program set over mpidag's since is left in place (it may call mpidag's, which still
    calls the one before it). After a worker failed, the exit without ``MPI_Finalize``
    stays (:func:`_keep_exit_without_finalize`)."""
    hook = sys.excepthook
    if isinstance(hook, _AbortOnUncaught):
        sys.excepthook = hook.previous
    uninstall_signal_dump()
    atexit.unregister(_shutdown_at_exit)  # no session left to shut down at exit
    if not _lost_workers:
        atexit.unregister(_skip_finalize_after_failures)


#: set by shutdown() of a fault-tolerant session in which some worker failed; for good:
#: MPI_Finalize would wait for the dead ranks in any later session of this process too
_lost_workers = False
#: the status a program asked for with sys.exit() (see _skip_finalize_after_failures)
_exit_status: list[Any] = [0]


class _RecordingExit:
    """``sys.exit`` once a worker of a fault-tolerant job failed: keeps the status for
    :func:`_skip_finalize_after_failures`, then exits through the ``sys.exit`` there was
    (``previous``)."""

    def __init__(self, previous: Callable[..., Any]) -> None:
        self.previous = previous

    def __call__(self, status: Any = None) -> None:
        _exit_status[0] = status
        self.previous(status)


def _keep_exit_without_finalize() -> None:
    """At the shutdown of a fault-tolerant session in which a worker failed: this process
    must leave without ``MPI_Finalize`` (:func:`_skip_finalize_after_failures`), so two
    hooks outlive the session, on purpose, for the rest of the process:

    * :func:`_skip_finalize_after_failures` stays registered with atexit: Open MPI 5's
      finalize waits for the dead rank forever (open-mpi/ompi#11404), and mpi4py calls
      it after every Python exit hook (``Py_AtExit``), with no switch to turn it off once
      ``mpi4py.MPI`` is imported: only ``os._exit`` from an exit hook gets past it.
    * ``sys.exit`` records its status (:class:`_RecordingExit`): ``os._exit`` needs the
      status to exit with, and Python keeps the status of a ``SystemExit`` to itself
      (it is gone by the time exit hooks run), so ``sys.exit(status)`` is the one place
      to see it (docs/fault_tolerance.md: the status of ``sys.exit(status)`` is kept).
    """
    global _lost_workers
    _lost_workers = True
    if not isinstance(sys.exit, _RecordingExit):
        sys.exit = _RecordingExit(sys.exit)


def _skip_finalize_after_failures() -> None:
    """Last exit hook of an ``--ft`` job in which a worker failed: leave without
    ``MPI_Finalize``, whose synchronization with the job's runtime would wait for the dead
    rank forever (Open MPI 5, open-mpi/ompi#11404). ``shutdown()`` has completed among the
    survivors by then; the status of ``sys.exit(status)`` is kept."""
    if not _lost_workers:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    status = _exit_status[0]
    code = status if isinstance(status, int) else (0 if status is None else 1)
    os._exit(code)


def _shutdown_at_exit() -> None:
    runtime = _runtime.current_or_none()
    if runtime is not None:
        log.warning("%s exits without mpidag.rpc.shutdown(); shutting down gracefully",
                    runtime.where())
        shutdown(graceful=True)


def shutdown(graceful: bool = True, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Stop RPC on this rank.

    With ``graceful=True`` (collective) this returns when every rank has called
    ``shutdown`` and no call, reply or internal message is in flight anywhere; requests
    keep being served meanwhile. ``timeout`` in seconds bounds that wait (0: no bound);
    past it an ``RPCTimeoutError`` is raised after a local shutdown. With
    ``graceful=False`` only this rank stops; its pending futures fail.

    Example (after ``rpc.init_rpc()`` on every rank)::

        >>> fut = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1))
        >>> rpc.shutdown()       # waits for fut's reply and for every rank
        >>> fut.wait()
        tensor([2., 2.])
    """
    with _runtime.lifecycle_lock:
        runtime = _runtime.current()
        try:
            runtime.shutdown(graceful, timeout)
        finally:
            _runtime.uninstall(runtime)
            if runtime.config.ft and runtime.agent.failed:
                _keep_exit_without_finalize()  # MPI_Finalize would wait for the dead ranks
            _remove_process_hooks()


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """The ``WorkerInfo`` of ``worker_name``, or of this worker when ``None``.

    Example::

        >>> rpc.get_worker_info()
        WorkerInfo(id=0, name=worker0)
    """
    runtime = _runtime.current()
    if worker_name is None:
        return runtime.agent.info
    return runtime.agent.workers[runtime.to_rank(worker_name)]


def failed_workers() -> list[WorkerInfo]:
    """The workers of this job found to have failed, by rank (always empty unless the job
    was started with ``python -m mpidag.run --ft``). Every other worker is alive as far as
    this rank knows: calls, RRefs and backward passes among them go on; calls to a failed
    one raise :class:`WorkerFailedError`.

    Example::

        >>> rpc.failed_workers()             # no worker failed
        []

    and in a job of ``python -m mpidag.run --ft -n 3`` whose worker2 was killed (not run by
    the doctests, which kill no process)::

        [w.name for w in rpc.failed_workers()]      # ['worker2']
    """
    agent = _runtime.current().agent
    return [agent.workers[rank] for rank in sorted(agent.failed)]


def rpc_async(to: str | WorkerInfo | int, func: Callable, args: tuple | None = None,
              kwargs: dict | None = None,
              timeout: float = UNSET_RPC_TIMEOUT) -> torch.futures.Future:
    """Call ``func(*args, **kwargs)`` on worker ``to``; return a ``torch.futures.Future``.

    ``timeout`` in seconds: -1 (unset) takes the default of the backend options, 0 means
    none. Past it the future completes with an ``RPCTimeoutError`` (a ``TimeoutError``).

    Example::

        >>> fut = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 3))
        >>> fut.wait()
        tensor([4., 4.])
    """
    runtime = _runtime.current()
    core = runtime.agent.core  # the compiled path takes a plain call with common arguments
    fut = core.rpc(to, func, args, kwargs, timeout, True) if core is not None else None
    if fut is None:
        args, kwargs = check_call(func, args, kwargs)
        fut = runtime.agent.call(runtime.to_rank(to), func, args, kwargs,
                                 check_timeout(timeout))
    if _wait_all_blocks.open and hasattr(_thread_local_var, "future_list"):  # (see _wait_all)
        _thread_local_var.future_list.append(fut)
    return fut


def rpc_sync(to: str | WorkerInfo | int, func: Callable, args: tuple | None = None,
             kwargs: dict | None = None, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
    """Call ``func(*args, **kwargs)`` on worker ``to`` and return its result.

    A remote exception is raised here with its type; its remote traceback is the
    ``__cause__``. ``timeout`` as for :func:`rpc_async`.

    Example::

        >>> rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3))
        tensor([4., 4.])
    """
    runtime = _runtime.current()
    agent = runtime.agent
    core = agent.core  # the compiled path takes a plain call with common arguments
    if core is not None:
        call = core.rpc(to, func, args, kwargs, timeout, False)
        if call is not None:
            return agent.calls.finish(call)
    args, kwargs = check_call(func, args, kwargs)
    return agent.call_sync(runtime.to_rank(to), func, args, kwargs, check_timeout(timeout))


# ----------------------------------------------------------------------------------------
# torch's private helpers that its test suites use, with the same meaning


#: torch's switch of the RRef leak check at shutdown (``True``: leaks are not an error).
#: mpidag releases every user RRef still referenced at a graceful shutdown and logs how
#: many there were, whatever this says.
_ignore_rref_leak = True

#: per thread: ``future_list``, the futures of ``rpc_async`` inside ``with _wait_all():``
_thread_local_var = threading.local()


class _OpenBlocks:
    """How many ``with _wait_all():`` blocks are open, in any thread: ``rpc_async`` looks
    for its thread's ``future_list`` only while some are (``hasattr`` of a missing
    thread-local attribute costs 0.3 us a call; torch's tests check that it is missing
    outside the block)."""

    def __init__(self) -> None:
        self.open = 0
        self._lock = threading.Lock()

    def change(self, by: int) -> None:
        with self._lock:
            self.open += by


_wait_all_blocks = _OpenBlocks()


@contextlib.contextmanager
def _wait_all() -> Iterator[None]:
    """Collect the futures of every ``rpc_async`` made in the block by this thread and wait
    for all of them at its end (torch's private helper); the first error is raised.

    Example::

        >>> with rpc.api._wait_all():
        ...     fut_1 = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1))
        ...     fut_2 = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 2))
        >>> fut_1.done() and fut_2.done()
        True
    """
    _thread_local_var.future_list = []
    _wait_all_blocks.change(+1)
    try:
        yield
    finally:
        try:
            torch.futures.wait_all(_thread_local_var.future_list)
        finally:
            del _thread_local_var.future_list
            _wait_all_blocks.change(-1)


def get_rpc_timeout() -> float:
    """The default timeout of calls of this worker, in seconds (torch's
    ``get_rpc_timeout``): the backend options' ``rpc_timeout``, or what
    :func:`_set_rpc_timeout` set since.

    Example (after ``rpc.init_rpc(rpc_backend_options=rpc.MPIRpcBackendOptions(rpc_timeout=20))``
    on every rank)::

        >>> rpc.get_rpc_timeout()
        20.0
    """
    return float(_runtime.current().agent.default_timeout)


def _set_rpc_timeout(rpc_timeout: float) -> None:
    """Set the default timeout of this worker's calls made from now on, in seconds; 0
    means none (torch's ``_set_rpc_timeout``). Calls already made keep theirs.

    Example::

        >>> rpc._set_rpc_timeout(0.5)
        >>> rpc.get_rpc_timeout()
        0.5
    """
    if isinstance(rpc_timeout, bool) or not isinstance(rpc_timeout, int | float) or \
            not rpc_timeout >= 0:
        raise ValueError(f"rpc_timeout must be a number of seconds >= 0 (0: no timeout), got "
                         f"{rpc_timeout!r}")
    _runtime.current().agent.default_timeout = float(rpc_timeout)


def _rref_context_get_debug_info() -> dict[str, str]:
    """torch's counters of this worker's RRefs, as strings: ``num_owner_rrefs`` (values
    this worker owns that some other worker references or is still making),
    ``num_forks`` (references to them on other workers), ``num_pending_users``
    (references not confirmed yet) and ``num_pending_futures`` (protocol steps not
    finished: forks of user RRefs waiting for the owner, releases not sent yet).

    Example::

        >>> rpc._rref_context_get_debug_info()["num_owner_rrefs"]
        '0'
    """
    return _runtime.current().rrefs.torch_debug_info()


# ------------------------------------------------------------------------ profiling
def enable_gil_profiling(flag: bool) -> None:
    """Measure (``True``) or not how long this process's serving threads wait for the GIL,
    as torch's ``rpc.enable_gil_profiling``: while on, each served call first lets go of
    the GIL and times taking it back, and the agent's debug info has
    ``agent.gil_average_wait_time_us`` (the average, microseconds). Off by default.

    Example::

        >>> rpc.enable_gil_profiling(True)
        >>> "agent.gil_average_wait_time_us" in rpc._get_current_rpc_agent().get_debug_info()
        True
        >>> rpc.enable_gil_profiling(False)     # (process-wide: off again)
    """
    set_gil_profiling(bool(flag))


def _get_debug_info() -> dict[str, str]:
    """The agent's, the RRefs' and the autograd contexts' counters in one dict, values as
    strings (torch's ``rpc._get_debug_info``).

    Example::

        >>> rpc._get_debug_info()["num_owner_rrefs"]
        '0'
    """
    info = _get_current_rpc_agent().get_debug_info()
    info.update(_rref_context_get_debug_info())
    info.update(_runtime.current().autograd.container.torch_debug_info())
    return info
