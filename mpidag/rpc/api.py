"""Public RPC API, mirroring ``torch.distributed.rpc`` name for name."""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from mpidag.errors import RPCError, RPCNotInitializedError, UnknownWorkerError
from mpidag.rpc.agent import RpcAgent
from mpidag.rpc.options import (
    DEFAULT_SHUTDOWN_TIMEOUT,
    UNSET_RPC_TIMEOUT,
    BackendType,
    MPIRpcBackendOptions,
    WorkerInfo,
)

__all__ = [
    "init_rpc",
    "shutdown",
    "rpc_sync",
    "rpc_async",
    "get_worker_info",
    "is_available",
]

log = logging.getLogger(__name__)

_agent: RpcAgent | None = None
_init_lock = threading.Lock()
_hooks_installed = False


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


def current_agent() -> RpcAgent:
    """The agent made by :func:`init_rpc`; raises if RPC is not initialized."""
    agent = _agent
    if agent is None:
        raise RPCNotInitializedError(
            "RPC has not been initialized. Call mpidag.rpc.init_rpc first."
        )
    return agent


def init_rpc(
    name: str | None = None,
    backend: BackendType | None = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: Any = None,
) -> None:
    """Start RPC on this rank; collective: every rank of ``COMM_WORLD`` calls it.

    With no arguments the rank and world size come from MPI and the worker is named
    ``worker{rank}``. torch-style arguments are checked against MPI: a mismatch raises a
    ``ValueError`` on the rank that passed it, and an ``RPCError`` naming that rank on the
    others, so no rank hangs.

    Args:
        name: this worker's unique name (default ``worker{rank}``).
        backend: ``BackendType.MPI`` (default); ``TENSORPIPE`` is accepted and runs on MPI.
        rank: must equal the MPI rank, or -1/None to take it from MPI.
        world_size: must equal the MPI world size, or None.
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
    global _agent
    with _init_lock:
        if _agent is not None:
            raise RPCError("RPC is already initialized; call mpidag.rpc.shutdown() first")
        from mpidag.transport.mpi import MPITransport

        problem = _check_init_arguments(name, backend, rank, world_size)
        options = None
        if problem is None:
            try:
                options = MPIRpcBackendOptions.from_any(rpc_backend_options)
            except (TypeError, ValueError) as exc:
                problem = exc
        transport = MPITransport()
        my_rank, size = transport.rank, transport.size
        from mpidag._debug import configure_logging

        if problem is None:
            try:
                configure_logging(my_rank)
            except ValueError as exc:
                problem = exc
        if problem is None and rank not in (-1, None) and rank != my_rank:
            problem = ValueError(
                f"init_rpc(rank={rank!r}) but this process is MPI rank {my_rank} of {size}: "
                f"ranks come from the MPI launcher; omit rank= or pass the MPI rank"
            )
        if problem is None and size == 1:
            problem = _singleton_of_a_larger_launch()
        if problem is None and world_size is not None and world_size != size:
            problem = ValueError(
                f"init_rpc(world_size={world_size!r}) but the MPI job has {size} ranks: "
                f"launch with `python -m mpidag.run -n {world_size} ...` or omit world_size="
            )
        my_name = name if name is not None else f"worker{my_rank}"
        maps = {k: {str(a): str(b) for a, b in v.items()}
                for k, v in (options.device_maps if options else {}).items()}
        gathered = transport.comm.allgather(
            (my_name, None if problem is None else f"{type(problem).__name__}: {problem}", maps)
        )
        if problem is None:
            problem = _check_gathered(gathered, my_rank)
        if problem is not None:
            transport.close(collective=True)
            raise problem
        workers = [WorkerInfo(n, r) for r, (n, _, _) in enumerate(gathered)]
        device_maps = {
            n: {peer: {torch.device(a): torch.device(b) for a, b in m.items()}
                for peer, m in mp.items()}
            for (n, _, mp) in gathered
        }
        agent = RpcAgent(transport, workers, options, device_maps)
        _agent = agent  # before the threads start: a request may already be waiting
        _freeze_heap()
        agent.start()
        _install_process_hooks()
        log.debug("RPC started on %s", agent.where())


def _singleton_of_a_larger_launch() -> Exception | None:
    """An error when the launcher started several tasks but MPI put each in a world of its
    own (``srun --mpi=pmi2`` with Open MPI, or a launcher of another MPI than mpi4py's):
    every task would otherwise run alone as worker0 and "succeed"."""
    import os

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
    import gc
    import os

    if os.environ.get("MPIDAG_GC_FREEZE", "1") != "0":
        gc.collect()
        gc.freeze()


def _check_init_arguments(name, backend, rank, world_size) -> Exception | None:
    if name is not None and (not isinstance(name, str) or not name or ":" in name):
        return ValueError(f"worker name must be a non-empty str without ':', got {name!r}")
    if backend is not None and backend not in (BackendType.MPI, BackendType.TENSORPIPE) and \
            str(backend).upper().rsplit(".", 1)[-1] not in ("MPI", "TENSORPIPE"):
        return ValueError(f"unknown backend {backend!r}; use mpidag.rpc.BackendType.MPI")
    if rank is not None and (not isinstance(rank, int) or rank < -1):
        return ValueError(f"rank must be a non-negative int or -1, got {rank!r}")
    if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
        return ValueError(f"world_size must be a positive int, got {world_size!r}")
    return None


def _check_gathered(gathered: list, my_rank: int) -> Exception | None:
    failed = [(r, err) for r, (_, err, _) in enumerate(gathered) if err is not None]
    if failed:
        ranks = ", ".join(f"rank {r} ({err})" for r, err in failed)
        return RPCError(f"init_rpc failed on {ranks}; no rank started RPC")
    names = [n for n, _, _ in gathered]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        return ValueError(f"worker names must be unique, but {dup} are used by several ranks: "
                          f"{names}")
    for rank, (_, _, maps) in enumerate(gathered):
        unknown = sorted(set(maps) - set(names))
        if unknown:
            cls = UnknownWorkerError if rank == my_rank else RPCError
            return cls(f"the device maps of rank {rank} name unknown workers {unknown}; "
                       f"workers: {names}")
    return None


def _install_process_hooks() -> None:
    """At exit, shut down a forgotten agent; on an uncaught error, abort the job."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_shutdown_at_exit)
    from mpidag._debug import install_signal_dump

    install_signal_dump()  # `kill -USR1 <pid>`: thread stacks, calls in flight, RRefs
    previous = sys.excepthook

    def abort_on_uncaught(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        agent = _agent
        import os

        if agent is not None and os.environ.get("MPIDAG_ABORT_ON_ERROR", "1") != "0":
            sys.stderr.write(
                f"mpidag: uncaught {exc_type.__name__} on {agent.where()}; aborting the MPI "
                f"job so that the other ranks do not wait for this one forever\n"
            )
            sys.stderr.flush()
            agent.transport.abort(1)

    sys.excepthook = abort_on_uncaught


def _shutdown_at_exit() -> None:
    if _agent is not None:
        log.warning("%s exits without mpidag.rpc.shutdown(); shutting down gracefully",
                    _agent.where())
        shutdown(graceful=True)


def shutdown(graceful: bool = True, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Stop RPC on this rank.

    With ``graceful=True`` (collective) this returns when every rank has called
    ``shutdown`` and no call, reply or internal message is in flight anywhere; requests
    keep being served meanwhile. ``timeout`` in seconds bounds that wait (0: no bound);
    past it an ``RPCTimeoutError`` is raised after a local shutdown. With
    ``graceful=False`` only this rank stops; its pending futures fail.

    Example::

        >>> rpc.init_rpc()
        >>> fut = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1))
        >>> rpc.shutdown()       # waits for fut's reply and for every rank
    """
    global _agent
    with _init_lock:
        agent = current_agent()
        try:
            if graceful:
                deadline = time.monotonic() + timeout if timeout > 0 else None
                agent.wait_quiescent(timeout)
                for hook in agent.shutdown_hooks:  # e.g. release leftover user RRefs
                    hook(agent)
                # A second round on every rank, hooks or not: the number of collectives
                # must not depend on what a rank used (only some ranks hold RRefs).
                left = 0.0 if deadline is None else max(1e-3, deadline - time.monotonic())
                agent.wait_quiescent(left)
                _report_leaks(agent)
        except BaseException:
            agent.stop(graceful=False)
            _agent = None
            raise
        agent.stop(graceful=graceful)
        _agent = None


def _report_leaks(agent: RpcAgent) -> None:
    ctx = getattr(agent, "rref_context", None)
    if ctx is None:
        return
    stuck = [rec for rec in ctx.owners.values() if rec.forks or rec.tombstones]
    if stuck:
        log.warning("%s: %d owner RRef(s) still have user forks after shutdown (a protocol "
                    "message was lost?): %s", agent.where(), len(stuck),
                    [f"0x{rec.rref_id:x}" for rec in stuck[:5]])


def _get_debug_info() -> dict[str, int]:
    """Counters of this worker's agent and RRefs, for tests and debugging (as torch's).

    Example::

        >>> rpc.api._get_debug_info()["num_owner_rrefs"]
        0
    """
    agent = current_agent()
    info = {
        "rank": agent.rank,
        "num_pending_requests": len(agent._pending),
        "thread_pool_size": agent.options.num_worker_threads,
        "messages_sent": agent.sent,
        "messages_processed": agent.processed,
    }
    ctx = getattr(agent, "rref_context", None)
    if ctx is None:
        from mpidag.rref.context import RRefContext

        ctx = RRefContext.of(agent)
    info.update(ctx.debug_info())
    if agent.autograd is not None:
        info.update(agent.autograd.debug_info())
    return info


def _to_rank(agent: RpcAgent, to: str | WorkerInfo | int) -> int:
    if isinstance(to, str):
        info = agent.by_name.get(to)
        if info is None:
            raise UnknownWorkerError(
                f"unknown destination worker {to!r}; workers: {sorted(agent.by_name)}"
            )
        return info.id
    if isinstance(to, WorkerInfo):
        if not 0 <= to.id < agent.world_size or agent.workers[to.id] != to:
            raise UnknownWorkerError(f"{to!r} is not a worker of this job; workers: "
                                     f"{agent.workers}")
        return to.id
    if isinstance(to, int) and not isinstance(to, bool):
        if not 0 <= to < agent.world_size:
            raise UnknownWorkerError(
                f"unknown destination rank {to!r}; ranks are 0..{agent.world_size - 1}"
            )
        return to
    raise TypeError(f"`to` must be a worker name, a WorkerInfo or a rank, got "
                    f"{type(to).__name__}")


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """The ``WorkerInfo`` of ``worker_name``, or of this worker when ``None``.

    Example::

        >>> rpc.get_worker_info()
        WorkerInfo(id=0, name=worker0)
    """
    agent = current_agent()
    if worker_name is None:
        return agent.info
    return agent.workers[_to_rank(agent, worker_name)]


def _check_call(func: Callable, args: Any, kwargs: Any) -> tuple[tuple, dict]:
    if not callable(func):
        raise TypeError(f"function should be callable, got {type(func).__name__}")
    args = tuple(args) if args else ()
    kwargs = dict(kwargs) if kwargs else {}
    return args, kwargs


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
    agent = current_agent()
    args, kwargs = _check_call(func, args, kwargs)
    return agent.call(_to_rank(agent, to), func, args, kwargs, timeout)


def rpc_sync(to: str | WorkerInfo | int, func: Callable, args: tuple | None = None,
             kwargs: dict | None = None, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
    """Call ``func(*args, **kwargs)`` on worker ``to`` and return its result.

    A remote exception is raised here with its type; its remote traceback is the
    ``__cause__``. ``timeout`` as for :func:`rpc_async`.

    Example::

        >>> rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3))
        tensor([4., 4.])
    """
    agent = current_agent()
    args, kwargs = _check_call(func, args, kwargs)
    return agent.wait(agent.call(_to_rank(agent, to), func, args, kwargs, timeout), timeout)
