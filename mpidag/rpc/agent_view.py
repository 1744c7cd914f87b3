"""torch's private RPC helpers that its suites and some programs use, with the same meaning.

``torch.distributed.rpc`` exposes the running agent (``_get_current_rpc_agent()``, with
``get_worker_info``, ``get_worker_infos`` and ``get_debug_info``), and an all-gather and a
barrier over RPC among named workers (``api._all_gather``, ``api._barrier``). They are
mirrored here over mpidag's runtime, so code that reaches for them ports by its imports too.

Example::

    import mpidag.rpc as rpc
    rpc.init_rpc()
    names = [w.name for w in rpc._get_current_rpc_agent().get_worker_infos()]
    ids = rpc.api._all_gather(rpc.get_worker_info().id)   # {'worker0': 0, 'worker1': 1}
    rpc.api._barrier(names)
    rpc.shutdown()
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from mpidag import _runtime
from mpidag.agent.options import DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT, WorkerInfo
from mpidag.errors import RPCTimeoutError

__all__ = ["CurrentAgent", "_all_gather", "_barrier", "_get_current_rpc_agent",
           "_wait_all_workers"]


class CurrentAgent:
    """A view of this rank's running agent with torch's ``RpcAgent`` query methods."""

    def get_worker_info(self, worker_name: str | None = None) -> WorkerInfo:
        """This worker's ``WorkerInfo``, or that of ``worker_name``.

        Example::

            >>> rpc._get_current_rpc_agent().get_worker_info("worker1").id
            1
        """
        runtime = _runtime.current()
        if worker_name is None:
            return runtime.agent.info
        return runtime.agent.workers[runtime.to_rank(worker_name)]

    def get_worker_infos(self) -> list[WorkerInfo]:
        """Every worker of the job, by rank.

        Example::

            >>> [w.name for w in rpc._get_current_rpc_agent().get_worker_infos()]
            ['worker0', 'worker1']
        """
        return list(_runtime.current().agent.workers)

    def get_debug_info(self) -> dict[str, str]:
        """The agent's counters under torch's ``agent.`` keys, values as strings.

        Example::

            >>> rpc._get_current_rpc_agent().get_debug_info()["agent.num_pending_requests"]
            '0'
        """
        return {f"agent.{key}": str(value)
                for key, value in _runtime.current().agent_debug_info().items()}


def _get_current_rpc_agent() -> CurrentAgent:
    """The running agent (torch's ``rpc._get_current_rpc_agent``); raises if RPC is not up.

    Example::

        >>> rpc._get_current_rpc_agent().get_worker_info().name
        'worker0'
    """
    _runtime.current()  # raises the not-initialized error
    return CurrentAgent()


class _Gathering:
    """One all-gather on its leader, or one follower's wait for the result."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.done = threading.Event()


class _GatherState:
    """A worker's all-gathers: those it leads or waits in, and its sequence numbers."""

    def __init__(self) -> None:
        self.gatherings: defaultdict[str, _Gathering] = defaultdict(_Gathering)
        self.sequence: dict[str, int] = {}


#: per runtime, not per process: the ranks of an in-process world share this module
_states: weakref.WeakKeyDictionary[Any, _GatherState] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _state() -> _GatherState:
    """The current runtime's all-gather state (call with ``_lock`` held)."""
    runtime = _runtime.current()
    state = _states.get(runtime)
    if state is None:
        state = _states[runtime] = _GatherState()
    return state


def _gather_to_leader(sequence_id: str, worker_name: str, obj: Any,
                      worker_names: list[str]) -> None:
    with _lock:
        gathering = _state().gatherings[sequence_id]
        if worker_name in gathering.objects:
            raise RuntimeError(f"{worker_name} joined all-gather {sequence_id!r} twice")
        gathering.objects[worker_name] = obj
        if set(gathering.objects) == set(worker_names):
            gathering.done.set()


def _broadcast_to_follower(sequence_id: str, objects: dict[str, Any]) -> None:
    with _lock:
        gathering = _state().gatherings[sequence_id]
    gathering.objects = objects
    gathering.done.set()


def _all_gather(obj: Any, worker_names: Iterable[str] | None = None,
                timeout: float = UNSET_RPC_TIMEOUT) -> dict[str, Any]:
    """Gather ``obj`` from every worker of ``worker_names`` (default: all) to all of them, over
    RPC, as torch's ``rpc.api._all_gather``: the smallest name leads, the others send it their
    object and wait for the whole map. Returns ``{worker name: object}``.

    ``timeout`` (seconds) bounds the leader's wait and every call; unset means the default
    RPC timeout for the calls and no bound for the wait.

    Example::

        >>> sorted(rpc.api._all_gather(rpc.get_worker_info().id).items())   # on every rank
        [('worker0', 0), ('worker1', 1)]
    """
    runtime = _runtime.current()
    agent = CurrentAgent()
    names = sorted(set(worker_names) if worker_names else
                   {w.name for w in agent.get_worker_infos()})
    leader = names[0]
    me = agent.get_worker_info().name
    with _lock:
        key = "".join(names)
        number = _state().sequence.get(key, 0)
        _state().sequence[key] = number + 1
        sequence_id = f"{key}{number}"
    if timeout == UNSET_RPC_TIMEOUT:
        rpc_timeout, wait_timeout = float(runtime.agent.default_timeout), None
    elif timeout == DEFAULT_SHUTDOWN_TIMEOUT:
        rpc_timeout, wait_timeout = timeout, None
    else:
        rpc_timeout = wait_timeout = timeout
    if me == leader:
        _gather_to_leader(sequence_id, me, obj, names)
    else:
        runtime.agent.call_sync(runtime.to_rank(leader), _gather_to_leader,
                                (sequence_id, me, obj, names), {}, rpc_timeout)
    with _lock:
        gathering = _state().gatherings[sequence_id]
    if not gathering.done.wait(timeout=wait_timeout):
        with _lock:
            _state().gatherings.pop(sequence_id, None)
        raise RPCTimeoutError(
            f"timed out in _all_gather after {timeout:.2f} seconds: "
            f"{sorted(set(names) - set(gathering.objects))} had not joined; "
            f"raise the timeout or check those workers")
    if me == leader:
        failed = []
        futures = [(name, runtime.agent.call(runtime.to_rank(name), _broadcast_to_follower,
                                             (sequence_id, gathering.objects), {},
                                             rpc_timeout))
                   for name in names if name != leader]
        for name, future in futures:
            try:
                future.wait()
            except RuntimeError as exc:
                failed.append((name, exc))
        if failed:
            with _lock:
                _state().gatherings.pop(sequence_id, None)
            raise RuntimeError(
                f"Followers {[n for n, _ in failed]} timed out in _all_gather after "
                f"{rpc_timeout:.2f} seconds. The first exception is {failed[0][1]}")
    with _lock:
        _state().gatherings.pop(sequence_id, None)
    return gathering.objects


def _barrier(worker_names: Iterable[str]) -> None:
    """Wait until every worker of ``worker_names`` reached this barrier (over RPC), as torch's
    ``rpc.api._barrier``.

    Example::

        >>> rpc.api._barrier(["worker0", "worker1"])
    """
    try:
        _all_gather(None, set(worker_names))
    except RuntimeError as exc:
        raise RuntimeError(f"failed to complete the barrier over {sorted(worker_names)}: "
                           f"{exc}") from exc


def _wait_all_workers(timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Block until every worker reached this call (torch's private helper, an all-gather of
    nothing): the first step of torch's graceful shutdown, which some programs call
    themselves before ``rpc.shutdown(graceful=False)``.

    Example::

        >>> rpc.api._wait_all_workers()
        >>> rpc.shutdown(graceful=False)
    """
    _all_gather(None, timeout=timeout)
