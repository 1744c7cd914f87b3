"""One RPC session of this rank: everything ``init_rpc`` starts and ``shutdown`` ends.

:class:`Runtime` holds the layers of one session, each made with the one below it::

    transport (MPI, or in-process)  ->  RpcAgent  ->  DistAutograd  ->  RRefContext
                                                                    +  ParameterLocks

The current runtime (:func:`current`) is the only module-level state of a session: the
public facades (``mpidag.rpc``, ``.autograd``, ``.optim``, ``.testing``) look it up;
the layers below it never do, they use the objects they were given. (Other module-level
data is per thread, such as the reusable pickler and the autograd context a thread is in,
or process-wide caches and debug counters.) Several runtimes can live in one process
(in-process worlds in tests); only the one made by ``init_rpc`` is current.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from mpidag._config import Config
from mpidag._locks import ParameterLocks
from mpidag._remote_profiling import gil_average_wait_us
from mpidag.agent.agent import RpcAgent
from mpidag.agent.options import MPIRpcBackendOptions, WorkerInfo
from mpidag.dist_autograd import DistAutograd
from mpidag.errors import (
    InvalidArgumentError,
    RPCError,
    RPCNotInitializedError,
    UnknownWorkerError,
)
from mpidag.rref.handle import RRefHandle
from mpidag.rref.protocol import RRefContext
from mpidag.transport.base import Transport

__all__ = ["Runtime", "bind_thread", "current", "current_or_none", "install", "uninstall",
           "world_mismatch"]

log = logging.getLogger(__name__)


class Runtime:
    """The layers of one RPC session of this rank.

    Made collectively by :meth:`connect` (every rank of the transport calls it), started
    by :meth:`serve`, ended by :meth:`shutdown`.

    Example::

        >>> world = InProcWorld(2)          # or MPITransport() on each rank under mpirun
        >>> every_rank = concurrent.futures.ThreadPoolExecutor(2)   # a thread per rank
        >>> ranks = list(every_rank.map(lambda r: Runtime.connect(world.transports[r]),
        ...                             range(2)))
        >>> for r in ranks:
        ...     r.serve()
        >>> ranks[0].agent.workers
        [WorkerInfo(id=0, name=worker0), WorkerInfo(id=1, name=worker1)]
        >>> list(every_rank.map(lambda r: r.shutdown(), ranks))
        [None, None]
        >>> every_rank.shutdown()
    """

    def __init__(self, transport: Transport, workers: list[WorkerInfo],
                 options: MPIRpcBackendOptions,
                 device_maps: dict[str, dict[str, dict[torch.device, torch.device]]],
                 config: Config, rref_type: type[RRefHandle] = RRefHandle,
                 processes: list[tuple[str, int]] | None = None) -> None:
        self.config = config
        #: (host, pid) of every rank, by rank (the job's identity: rank 0's)
        self.processes = processes or [(socket.gethostname(), os.getpid())] * len(workers)
        #: called (last first) when the session ends: things the facade attached to it
        self.closers: list[Callable[[], None]] = []
        self.transport = transport
        self.options = options
        self.agent = RpcAgent(transport, workers, options, device_maps, config)
        self.autograd = DistAutograd(self.agent)
        self.closers.append(self.autograd.close)
        self.rrefs = RRefContext(self.agent, self.autograd, rref_type)
        self.parameter_locks = ParameterLocks(config.optim_locks)
        # the engine's threads serve this runtime: calls they run see it as current()
        self.agent.engine.thread_started = lambda: bind_thread(self)

    # ------------------------------------------------------------------ start
    @classmethod
    def connect(cls, transport: Transport, *, name: str | None = None, rank: int | None = -1,
              world_size: int | None = None, options: MPIRpcBackendOptions | None = None,
              config: Config | None = None, rref_type: type[RRefHandle] = RRefHandle,
              problem: Exception | None = None) -> Runtime:
        """Collective: agree on the workers with every rank; :meth:`serve` starts serving.

        A ``problem`` found by the caller on this rank (a bad argument), or one found here
        (``rank``/``world_size`` that do not match the transport, duplicate names, device
        maps naming unknown workers), is raised on this rank and, as an ``RPCError`` naming
        the rank, on every other one, so no rank waits for a rank that gave up.
        """
        my_rank, size = transport.rank, transport.size
        if problem is None:
            problem = world_mismatch(rank, world_size, my_rank, size)
        options = options or MPIRpcBackendOptions()
        my_name = name if name is not None else f"worker{my_rank}"
        maps = {k: {str(a): str(b) for a, b in v.items()} for k, v in options.device_maps.items()}
        gathered = transport.allgather(
            (my_name, None if problem is None else f"{type(problem).__name__}: {problem}", maps,
             (socket.gethostname(), os.getpid())))
        if problem is None:
            problem = _check_gathered(gathered, my_rank)
        if problem is not None:
            transport.close(collective=True)
            raise problem
        workers = [WorkerInfo(n, r) for r, (n, _, _, _) in enumerate(gathered)]
        device_maps = {
            n: {peer: {torch.device(a): torch.device(b) for a, b in m.items()}
                for peer, m in mp.items()}
            for (n, _, mp, _) in gathered
        }
        return cls(transport, workers, options, device_maps, config or Config(), rref_type,
                   [tuple(g[3]) for g in gathered])

    @property
    def job_id(self) -> str:
        """The job's name for tools: rank 0's host and process id."""
        host, pid = self.processes[0]
        return f"{host}-{pid}"

    def serve(self) -> None:
        """Start the progress engine: from now on this rank receives and serves calls."""
        self.agent.start()

    # --------------------------------------------------------------- shutdown
    def shutdown(self, graceful: bool = True, timeout: float = 0) -> None:
        """Stop this rank's session.

        ``graceful`` (collective): return when every rank is here and no call, reply or
        internal message is in flight anywhere (two quiescence rounds, with the RRef
        layer's release of leftover user RRefs between them, on every rank). Past
        ``timeout`` seconds (0: none) the session stops locally and ``RPCTimeoutError`` is
        raised.
        """
        agent = self.agent
        try:
            if graceful:
                deadline = time.monotonic() + timeout if timeout > 0 else None
                agent.wait_quiescent(timeout)
                agent.run_shutdown_hooks()  # e.g. release leftover user RRefs
                # A second round on every rank, hooks or not: the number of collectives
                # must not depend on what a rank used (only some ranks hold RRefs).
                left = 0.0 if deadline is None else max(1e-3, deadline - time.monotonic())
                agent.wait_quiescent(left)
                stuck = self.rrefs.stuck_owners()
                if stuck:
                    log.warning("%s: %d owner RRef(s) still have user forks after shutdown "
                                "(a protocol message was lost?): %s", agent.where(),
                                len(stuck), [f"0x{i:x}" for i in stuck[:5]])
        except BaseException:
            agent.stop(graceful=False)
            self._close()
            raise
        agent.stop(graceful=graceful)
        self._close()

    def _close(self) -> None:
        while self.closers:
            try:
                self.closers.pop()()
            except Exception:
                log.exception("%s: closing the session", self.where())

    # ---------------------------------------------------------------- queries
    def where(self) -> str:
        return self.agent.where()

    def to_rank(self, to: str | WorkerInfo | int) -> int:
        """The rank of a worker name, ``WorkerInfo`` or rank; a clear error if unknown."""
        agent = self.agent
        if isinstance(to, str):
            info = agent.by_name.get(to)
            if info is None:
                raise UnknownWorkerError(
                    f"could not find destination name {to} (unknown destination worker "
                    f"{to!r}); workers: {sorted(agent.by_name)}")
            return info.id
        if isinstance(to, WorkerInfo):
            if not 0 <= to.id < agent.world_size or agent.workers[to.id] != to:
                raise UnknownWorkerError(f"{to!r} is not a worker of this job; workers: "
                                         f"{agent.workers}")
            return to.id
        if isinstance(to, int) and not isinstance(to, bool):
            if not 0 <= to < agent.world_size:
                raise UnknownWorkerError(
                    f"unknown destination rank {to!r}; ranks are 0..{agent.world_size - 1}")
            return to
        raise InvalidArgumentError(  # torch's ValueError, with its wording first
            f"Cannot get WorkerInfo from name {to}: `to` must be a worker name (str), a "
            f"WorkerInfo or a rank (int), got {type(to).__name__}; workers: "
            f"{sorted(agent.by_name)}")

    def agent_debug_info(self) -> dict[str, Any]:
        """The agent's counters (torch's names, without torch's ``agent.`` prefix)."""
        agent = self.agent
        info: dict[str, Any] = {
            "rank": agent.rank,
            "num_pending_requests": len(agent.calls),
            # the pool as it is (num_worker_threads, more once it grew), as kill -USR1 and
            # python -m mpidag.inspect report it: one figure, the engine's
            "thread_pool_size": agent.engine.pool_size,
            "messages_sent": agent.sent,
            "messages_processed": agent.processed,
        }
        gil_wait = gil_average_wait_us()
        if gil_wait is not None:  # rpc.enable_gil_profiling(True)
            info["gil_average_wait_time_us"] = gil_wait
        return info

    def debug_info(self) -> dict[str, Any]:
        """Counters of the agent, the RRefs and the autograd contexts (torch's names)."""
        info = self.agent_debug_info()
        info.update(self.rrefs.debug_info())
        info.update(self.autograd.container.debug_info())
        return info


def world_mismatch(rank: int | None, world_size: int | None, my_rank: int,
                   size: int) -> ValueError | None:
    """The error of a ``rank`` or ``world_size`` given to ``init_rpc`` that is not this
    process's MPI rank (``my_rank``) or the MPI job's ``size`` (``None``/-1: not given).

    Example::

        >>> world_mismatch(None, 1, 0, 2).args[0][:56]
        'init_rpc(world_size=1) but the MPI job has 2 ranks: laun'
    """
    if rank not in (-1, None) and rank != my_rank:
        return ValueError(
            f"init_rpc(rank={rank!r}) but this process is MPI rank {my_rank} of {size}: "
            f"ranks come from the MPI launcher; omit rank= or pass the MPI rank")
    if world_size is not None and world_size != size:
        return ValueError(
            f"init_rpc(world_size={world_size!r}) but the MPI job has {size} ranks: "
            f"launch with `python -m mpidag.run -n {world_size} ...` (or `mpirun -n "
            f"{world_size}`) or omit world_size=. The RPC world is the whole MPI job: every "
            f"rank calls init_rpc, a subset of the ranks cannot start RPC alone")
    return None


def _check_gathered(gathered: list, my_rank: int) -> Exception | None:
    failed = [(r, err) for r, (_, err, _, _) in enumerate(gathered) if err is not None]
    if failed:
        ranks = ", ".join(f"rank {r} ({err})" for r, err in failed)
        return RPCError(f"init_rpc failed on {ranks}; no rank started RPC")
    names = [n for n, _, _, _ in gathered]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        first, second = [r for r, n in enumerate(names) if n == dup][:2]
        return RPCError(  # torch's RuntimeError and wording first
            f"RPC worker name {dup} is not unique. Workers {first} and {second} share the same "
            f"name: every rank needs a name of its own (init_rpc(name=...)); leave name= out "
            f"for worker{{rank}}. Names by rank: {names}")
    for rank, (_, _, maps, _) in enumerate(gathered):
        unknown = sorted(set(maps) - set(names))
        if unknown:
            cls = UnknownWorkerError if rank == my_rank else RPCError
            return cls(f"the device maps of rank {rank} name unknown workers {unknown}; "
                       f"workers: {names}")
    return None


# ---------------------------------------------------------- the current runtime
_current: Runtime | None = None
#: a thread's own runtime, ahead of ``_current``: the threads of an in-process world's rank
#: (its test thread, its engine's threads) each see that rank's runtime
class _Bound(threading.local):
    #: unset: init_rpc's (a class default: a missing thread-local attribute costs 1.3 us
    #: per lookup through getattr's AttributeError, this 0.16 us)
    runtime: Runtime | None = None


_bound = _Bound()
#: held while a runtime is being installed or removed (init_rpc / shutdown)
lifecycle_lock = threading.Lock()


def current() -> Runtime:
    """The runtime made by ``init_rpc``; raises if RPC is not initialized.

    Example::

        >>> current().agent.where()
        'worker0 (rank 0 of 2)'
    """
    runtime = _bound.runtime or _current
    if runtime is None:
        raise RPCNotInitializedError(
            "RPC has not been initialized. Call mpidag.rpc.init_rpc first, on every rank of "
            "the MPI job (torch: Current RPC agent is not set! Did you initialize the RPC "
            "framework?)")
    return runtime


def current_or_none() -> Runtime | None:
    """The runtime made by ``init_rpc`` (or bound to this thread), or ``None``."""
    return _bound.runtime or _current


def bind_thread(runtime: Runtime | None) -> None:
    """Make ``runtime`` this thread's current runtime (``None``: back to ``init_rpc``'s).

    In-process worlds run one thread per rank; each binds its rank's runtime, so the
    public API (``mpidag.rpc.rpc_sync``, ``mpidag.autograd.context``, ...) acts as that rank.

    Example::

        >>> bind_thread(runtimes[1])     # this thread is now worker1
        >>> rpc.get_worker_info().name
        'worker1'
        >>> bind_thread(None)
    """
    _bound.runtime = runtime


def install(runtime: Runtime) -> None:
    """Make ``runtime`` the current one (``init_rpc``)."""
    global _current
    if _current is not None:
        raise RPCError("RPC is already initialized; call mpidag.rpc.shutdown() first")
    _current = runtime


def uninstall(runtime: Runtime) -> None:
    """Forget ``runtime`` (``shutdown``)."""
    global _current
    if _current is runtime:
        _current = None
