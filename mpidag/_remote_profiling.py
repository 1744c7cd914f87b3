"""torch's RPC profiling: the caller's RPC range, remote events, server-wide profiles.

torch profiles RPCs with its *legacy* profiler (``torch.autograd.profiler_legacy.profile``,
the one its RPC tests use; ``torch.profiler.profile`` does not profile RPCs, by torch's
design, and sees mpidag's own ranges of :mod:`mpidag._profiling` instead). While a legacy
profile runs on the calling thread, a call made there:

* is a range named by torch's key, :func:`rpc_profiling_key`, e.g.
  ``rpc_async#udf(worker0 -> worker1)``, from the call until its answer arrived (the future
  handed to the user completes after the range ended, as torch's);
* runs on the callee under a legacy profile with the caller's options (record_shapes,
  profile_memory, ...): the callee's events come back with the answer and are added to the
  caller's profile with the callee's rank as ``node_id``, ``is_remote=True``, and named
  ``<key>#remote_op: <name>`` (``rpc_async#udf(worker0 -> worker1)#remote_op: aten::add``);
  events of calls the callee made meanwhile come back too, under both keys.

``prof.function_events`` of a legacy profile contains them because :func:`install` wraps
two functions of ``torch.autograd.profiler_legacy`` (there is no other way to add events
to it from Python): ``profile._start_trace`` (to learn the profile's options, which torch
does not expose) and ``_parse_legacy_records`` (to add the remote events to what the
profile parses, and give local events this worker's rank as ``node_id``, as torch's agent
does with ``setDefaultNodeId``). A remote event keeps the callee's own durations and order;
its block of events is centred in the caller's RPC range (clocks of different hosts are not
compared).

``mpidag.rpc._server_process_global_profile`` profiles every call served by this process
while it runs (:func:`start_server_profile`), and :func:`set_gil_profiling` makes the agent
measure how long its serving threads wait for the GIL.

Nothing here runs unless a profiler does: the agent checks :func:`call_profiling` once per
call and :func:`observing` once per served call.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.autograd import profiler as _profiler
from torch.autograd import profiler_legacy as _legacy
from torch.autograd.profiler_util import FunctionEvent
from torch.jit._builtins import _find_builtin

__all__ = [
    "REMOTE_OP",
    "ProfiledResult",
    "call_profiling",
    "function_name",
    "install",
    "legacy_profiling",
    "observing",
    "profiled_call",
    "profiling_flags",
    "rpc_profiling_key",
    "serve_profiled",
]

#: what separates an RPC's key from the name of an event that ran on the callee (torch's
#: ``REMOTE_PROFILING_KEY_PREFIX``)
REMOTE_OP = "#remote_op: "

_enabled = torch._C._autograd._profiler_enabled
_profiler_type = torch._C._autograd._profiler_type
_LEGACY = torch._C._profiler.ActiveProfilerType.LEGACY
_ORIGINAL_PARSE = _legacy._parse_legacy_records
_ORIGINAL_START = _legacy.profile._start_trace

_local = threading.local()  # .session: the _Session of this thread's legacy profile
_lock = threading.Lock()
_node_id = -1  # this worker's rank while RPC runs: the node_id of local events
_installed = False
_synthetic_ids = itertools.count(1 << 48)

#: options of a legacy profile, in this order: what a call's callee profiles with
Options = tuple[bool, bool, bool, bool, bool]
DEFAULT_OPTIONS: Options = (False, False, False, False, False)


def rpc_profiling_key(exec_mode: str, func_name: str, current_worker_name: str,
                      dst_worker_name: str) -> str:
    """The name of an RPC's range, torch's ``_build_rpc_profiling_key`` format.

    ``exec_mode``: ``"sync"``, ``"async"`` or ``"remote"`` (``RPCExecMode.value``).

    Example::

        >>> rpc_profiling_key("async", "udf", "worker0", "worker1")
        'rpc_async#udf(worker0 -> worker1)'
    """
    return f"rpc_{exec_mode}#{func_name}({current_worker_name} -> {dst_worker_name})"


def function_name(func: Any, args: tuple) -> tuple[str | None, str]:
    """``(exec_mode or None, name)`` of a called function in an RPC key, torch's rule: a
    builtin by its operator name (``aten::add``), a TorchScript function by its qualified
    name, anything else by ``__qualname__``. An internal handler (``remote()``, ``to_here``,
    the RRef proxies) names the user's call it carries through its ``profile_as(*args)``,
    which may also set the exec mode (``remote()`` is ``"remote"``).

    Example::

        >>> function_name(torch.add, ())
        (None, 'aten::add')
    """
    profile_as = getattr(func, "profile_as", None)
    if profile_as is not None:
        try:
            return profile_as(*args)
        except Exception:  # noqa: BLE001 - a name for a profile only; fall back to the handler's
            pass
        return None, str(getattr(func, "name", func))
    builtin = _find_builtin(func)
    if builtin is not None:
        return None, builtin
    if isinstance(func, torch.jit.ScriptFunction):
        return None, torch._jit_internal._qualified_name(func)
    name = getattr(func, "__qualname__", None) or getattr(func, "name", None)
    return None, str(name) if name else type(func).__name__


def call_profiling() -> bool:
    """Whether a call made now is profiled: ``torch.profiler`` runs in this process, or a
    profiler runs on this thread (the legacy one: see :func:`legacy_profiling`).

    Example::

        >>> call_profiling()
        False
    """
    return _profiler._is_profiler_enabled or _enabled()


def legacy_profiling() -> bool:
    """Whether torch's legacy profiler runs on this thread: calls are profiled as torch's
    RPCs are (its key, remote events).

    Example::

        >>> with torch.autograd.profiler_legacy.profile():
        ...     legacy_profiling()
        True
    """
    return _enabled() and _profiler_type() == _LEGACY


# ----------------------------------------------------------------- remote events
class _Call:
    """A profiled call of a session: its key, when it ran, what the callee recorded."""

    __slots__ = ("key", "thread", "start_ns", "end_ns", "duration_us", "events")

    def __init__(self, key: str) -> None:
        self.key = key
        self.thread = threading.get_ident()
        self.start_ns = time.perf_counter_ns()
        self.end_ns = 0
        self.duration_us = 0.0
        self.events: list[tuple] | None = None  # None: no answer (yet)


class _Session:
    """The profiled calls made under one legacy profile on one thread."""

    __slots__ = ("options", "node_id", "t0_ns", "calls")

    def __init__(self, options: Options, node_id: int, t0_ns: int | None) -> None:
        self.options = options
        self.node_id = node_id
        self.t0_ns = t0_ns  # perf_counter_ns() when the profile started, if known
        self.calls: list[_Call] = []

    def merge(self, events: list[FunctionEvent]) -> list[FunctionEvent]:
        """``events`` (parsed records of the profile) with the remote events of its calls,
        sorted as ``_parse_legacy_records`` sorts."""
        node_id = self.node_id
        if node_id >= 0:
            for event in events:
                if event.node_id == -1 and not event.is_remote:
                    event.node_id = node_id
        if not self.calls:
            return events
        keys = {call.key for call in self.calls}
        ranges: dict[str, list[FunctionEvent]] = {}
        for event in events:
            if event.name in keys and not event.is_remote:
                ranges.setdefault(event.name, []).append(event)
        out = list(events)
        for call in self.calls:
            if call.events is None:
                continue  # no answer before the profile ended: torch has no events either
            found = ranges.get(call.key)
            if found:
                span = found.pop(0)
                start, end = span.time_range.start, span.time_range.end
            elif self.t0_ns is not None and call.end_ns:
                # the range ended after this profile's records were taken (a call of an
                # @async_execution function): its range from this process's clock
                start = (call.start_ns - self.t0_ns) / 1e3
                end = (call.end_ns - self.t0_ns) / 1e3
                out.append(FunctionEvent(
                    id=next(_synthetic_ids), name=call.key, trace_name=call.key,
                    thread=call.thread, start_us=start, end_us=end, is_async=True,
                    node_id=node_id, is_legacy=True))
            else:
                continue
            offset = start + max(0.0, (end - start - call.duration_us) / 2)
            prefix = call.key + REMOTE_OP
            out.extend(_unpack(packed, prefix, offset) for packed in call.events)
        out.sort(key=lambda e: [e.time_range.start, -e.time_range.end])
        return out


class ProfiledResult(NamedTuple):
    """A profiled call's answer: the value, how long the callee's profile ran (us) and its
    events (:func:`_pack`), times from the start of that profile."""

    value: Any
    duration_us: float
    events: list[tuple]


def _pack(event: FunctionEvent) -> tuple:
    return (event.id, event.name, event.node_id, event.thread, event.time_range.start,
            event.time_range.end, event.fwd_thread, event.input_shapes, event.stack,
            event.scope, event.cpu_memory_usage, event.is_async, event.sequence_nr,
            event.flops, event.is_remote)


def _unpack(packed: tuple, prefix: str, offset: float, remote: bool = True) -> FunctionEvent:
    """The event of :func:`_pack`: named ``prefix + name``, its times shifted by ``offset``
    us; ``remote``: an event of another process (else it keeps its own ``is_remote``)."""
    (event_id, name, node_id, thread, start, end, fwd_thread, shapes, stack, scope, memory,
     is_async, sequence_nr, flops, is_remote) = packed
    return FunctionEvent(
        id=event_id, name=prefix + name, trace_name=prefix + name, thread=thread,
        start_us=offset + start, end_us=offset + end, fwd_thread=fwd_thread,
        input_shapes=shapes, stack=stack, scope=scope, cpu_memory_usage=memory,
        is_async=is_async, is_remote=remote or is_remote, sequence_nr=sequence_nr,
        node_id=node_id, is_legacy=True, flops=flops)


def _session() -> _Session:
    """This thread's session (made here when the profile started before :func:`install`)."""
    session = getattr(_local, "session", None)
    if session is None:
        session = _local.session = _Session(DEFAULT_OPTIONS, _node_id, None)
    return session


def profiled_call(key: str, send: Callable[[Options], torch.futures.Future],
                  new_future: Callable[[], torch.futures.Future]) -> torch.futures.Future:
    """Make a call profiled as torch's RPCs: ``send(options)`` sends it (asking the callee
    to profile with ``options``) and returns the future of its answer, a
    :class:`ProfiledResult`; the call is a range named ``key`` until then, and the
    future returned here (made by ``new_future``) completes after that range ended, with
    the callee's value or error; the callee's events are kept for this thread's profile.

    Example::

        >>> def send(options):       # sends the call; here it is answered at once
        ...     answer = torch.futures.Future()
        ...     answer.set_result(3)
        ...     return answer
        >>> fut = profiled_call("rpc_async#f(worker0 -> worker1)", send, torch.futures.Future)
        >>> fut.wait()
        3
        >>> take_profiled_future() is fut      # kept for RRef._get_profiling_future
        True
    """
    session = _session()
    call = _Call(key)
    span = _profiler.record_function(key)
    span.__enter__()
    try:
        answer = send(session.options)
    except BaseException:
        span.__exit__(None, None, None)
        raise
    session.calls.append(call)
    box = torch.futures.Future()  # (value, error): a torch future's error loses its type
    ended = span._call_end_callbacks_on_future(box)  # in this thread's profile
    user = new_future()

    def answered(fut: torch.futures.Future) -> None:
        try:
            value = fut.value()
        except BaseException as exc:  # noqa: BLE001 - handed to the user's future
            exc.__traceback__ = None
            box.set_result((None, exc))
            return
        if type(value) is ProfiledResult:
            call.end_ns = time.perf_counter_ns()
            call.duration_us = value.duration_us
            call.events = value.events
            value = value.value
        box.set_result((value, None))

    def deliver(fut: torch.futures.Future) -> None:
        value, error = fut.value()
        if error is None:
            user.set_result(value)
        else:
            user.set_exception(error if isinstance(error, Exception) else Exception(error))

    ended.add_done_callback(deliver)
    answer.add_done_callback(answered)
    _local.future = user
    return user


def take_profiled_future() -> torch.futures.Future | None:
    """The future of this thread's last profiled call, once (``None`` if there was none
    since the last time): ``remote()`` keeps it for ``RRef._get_profiling_future``.

    Example::

        >>> take_profiled_future() is None
        True
    """
    return _local.__dict__.pop("future", None)


def _legacy_config(options: Options) -> Any:
    record_shapes, profile_memory, with_stack, with_flops, with_modules = options
    return torch.autograd.ProfilerConfig(
        torch.autograd.ProfilerState.CPU, record_shapes, profile_memory, with_stack,
        with_flops, with_modules, torch._C._profiler._ExperimentalConfig())


def serve_profiled(node_id: int, options: Options | None, func: Callable, args: tuple,
                   kwargs: dict, asynchronous: bool) -> Any:
    """Run a served call under a legacy profile of this thread: ``options`` those of a
    caller that profiles (the answer is then a :class:`ProfiledResult`), ``None`` for a call
    profiled only by the server-wide profiles. Its events go to the server-wide profiles
    that ran when it began. ``asynchronous``: ``func`` returns a future (its answer's).

    Example::

        >>> x, y = torch.ones(2), torch.ones(2)
        >>> answer = serve_profiled(1, DEFAULT_OPTIONS, torch.add, (x, y), {}, False)
        >>> answer.value, answer.events[0][1]
        (tensor([2., 2.]), 'aten::add')
    """
    servers = list(_servers)
    caller = options is not None
    if _enabled() or not (caller or servers):
        # this thread profiles already (a call served inline by a profiling thread): its
        # events are in that profile
        result = func(*args, **kwargs)
        if not caller:
            return result
        if asynchronous:
            return _chain(result, lambda value: ProfiledResult(value, 0.0, []))
        return ProfiledResult(result, 0.0, [])
    session = _Session(options if caller else servers[-1].options, node_id, None)
    previous = getattr(_local, "session", None)
    torch.autograd._enable_profiler_legacy(_legacy_config(session.options))
    session.t0_ns = time.perf_counter_ns()
    _local.session = session
    try:
        result = func(*args, **kwargs)
    finally:
        records = torch.autograd._disable_profiler_legacy()
        _local.session = previous
    events = _ORIGINAL_PARSE(records)

    def finish(value: Any) -> Any:
        packed = [_pack(event) for event in session.merge(events)]
        for server in servers:
            server.add(packed, session.t0_ns)
        if not caller:
            return value
        return ProfiledResult(value, (time.perf_counter_ns() - session.t0_ns) / 1e3, packed)

    if asynchronous:
        return _chain(result, finish)
    return finish(result)


def _chain(fut: torch.futures.Future, then: Callable[[Any], Any]) -> torch.futures.Future:
    """A future of ``then(value)`` of ``fut``'s value, or of its error (type kept); a
    value that is not a future (an asynchronous handler's immediate answer) as is."""
    out = torch.futures.Future()
    if not isinstance(fut, torch._C.Future):
        out.set_result(then(fut))
        return out

    def done(f: torch.futures.Future) -> None:
        try:
            value = f.value()
        except BaseException as exc:  # noqa: BLE001 - the answer's error
            exc.__traceback__ = None
            out.set_exception(exc if isinstance(exc, Exception) else Exception(exc))
            return
        out.set_result(then(value))

    fut.add_done_callback(done)
    return out


# ------------------------------------------------------------ server-wide profiles
class _ServerProfile:
    """One running ``_server_process_global_profile``: the events of each call served
    since it started (one list per call), times from its start."""

    __slots__ = ("options", "t0_ns", "calls")

    def __init__(self, options: Options) -> None:
        self.options = options
        self.t0_ns = time.perf_counter_ns()
        self.calls: list[list[FunctionEvent]] = []

    def add(self, packed: list[tuple], t0_ns: int) -> None:
        offset = (t0_ns - self.t0_ns) / 1e3
        events = [_unpack(event, "", offset, remote=False) for event in packed]
        with _lock:
            self.calls.append(events)


_servers: list[_ServerProfile] = []  # the running server-wide profiles, innermost last
_gil: list[int] | None = None  # [total ns, samples] while GIL profiling is on
_observing = False  # a server-wide profile runs, or GIL profiling is on


def _update_observing() -> None:
    global _observing
    _observing = bool(_servers) or _gil is not None


def profiling_flags() -> tuple[dict[str, Any], Callable[[], bool], dict[str, Any]]:
    """What :func:`call_profiling` and :func:`observing` read, for the compiled call path,
    which reads them in C (their Python frames less a call): torch's profiler module's
    globals (``_is_profiler_enabled``), torch's ``_profiler_enabled`` and this module's
    globals (``_observing``).

    Example::

        >>> torch_globals, enabled, own_globals = profiling_flags()
        >>> torch_globals["_is_profiler_enabled"] or enabled() or own_globals["_observing"]
        False
    """
    return vars(_profiler), _enabled, globals()


def observing() -> bool:
    """Whether served calls take the agent's observed path: ``torch.profiler`` runs, a
    server-wide profile runs, or GIL profiling is on.

    Example::

        >>> observing()
        False
    """
    return _profiler._is_profiler_enabled or _observing


def server_profiling() -> bool:
    """Whether a server-wide profile runs: every served call is profiled for it.

    Example::

        >>> server_profiling()
        False
    """
    return bool(_servers)


def start_server_profile(options: Options) -> object:
    """Profile every call this process serves from now until :func:`stop_server_profile`
    with the handle returned (``mpidag.rpc._server_process_global_profile``).

    Example::

        >>> handle = start_server_profile(DEFAULT_OPTIONS)
        >>> stop_server_profile(handle)
        []
    """
    profile = _ServerProfile(options)
    with _lock:
        _servers.append(profile)
        _update_observing()
    return profile


def stop_server_profile(handle: object) -> list[list[FunctionEvent]]:
    """End a server-wide profile; the events of each call it saw, one list per call.

    Example::

        >>> handle = start_server_profile(DEFAULT_OPTIONS)
        >>> x, y = torch.ones(2), torch.ones(2)
        >>> rpc.rpc_sync("worker0", torch.add, args=(x, y))     # served by this worker
        tensor([2., 2.])
        >>> rpc.rpc_sync("worker0", torch.sub, args=(x, y))
        tensor([0., 0.])
        >>> [[e.name for e in call] for call in stop_server_profile(handle)]
        [['aten::add'], ['aten::sub']]
    """
    if not isinstance(handle, _ServerProfile):
        raise TypeError(f"not a server-wide profile: {handle!r}")
    with _lock:
        if handle in _servers:
            _servers.remove(handle)
        _update_observing()
        return list(handle.calls)


def set_gil_profiling(flag: bool) -> None:
    """Measure (``True``) or not how long serving threads wait for the GIL.

    Example::

        >>> set_gil_profiling(True); gil_average_wait_us()
        0.0
        >>> set_gil_profiling(False); gil_average_wait_us() is None
        True
    """
    global _gil
    with _lock:
        if flag and _gil is None:
            _gil = [0, 0]
        elif not flag:
            _gil = None
        _update_observing()


def measure_gil_wait() -> None:
    """While GIL profiling is on: let go of the GIL and time taking it back (what a
    serving thread waits for it now), once per served call."""
    totals = _gil
    if totals is None:
        return
    start = time.perf_counter_ns()
    time.sleep(0)  # releases the GIL; returns when this thread holds it again
    totals[0] += time.perf_counter_ns() - start
    totals[1] += 1


def gil_average_wait_us() -> float | None:
    """The average GIL wait measured so far, microseconds; ``None`` when GIL profiling
    is off.

    Example::

        >>> gil_average_wait_us() is None
        True
    """
    totals = _gil
    if totals is None:
        return None
    return totals[0] / totals[1] / 1e3 if totals[1] else 0.0


# ----------------------------------------------------------------------- install
def _start_trace(self: Any) -> None:
    """``profile._start_trace`` that also opens this thread's session with the profile's
    options."""
    _ORIGINAL_START(self)
    _local.session = _Session(
        (bool(self.record_shapes), bool(self.profile_memory), bool(self.with_stack),
         bool(self.with_flops), bool(self.with_modules)), _node_id, time.perf_counter_ns())


def _parse_legacy_records(thread_records: Any) -> list[FunctionEvent]:
    """``_parse_legacy_records`` with the remote events of this thread's session."""
    events = _ORIGINAL_PARSE(thread_records)
    session = _local.__dict__.pop("session", None)
    if session is None:
        if _node_id >= 0:
            for event in events:
                if event.node_id == -1 and not event.is_remote:
                    event.node_id = _node_id
        return events
    return session.merge(events)


def install(node_id: int) -> None:
    """Profile RPCs as torch does from now on, local events with ``node_id`` (this
    worker's rank; -1 after shutdown). Idempotent; called by the agent.

    Example::

        >>> install(0)          # rank 0's agent starts
        >>> install(-1)         # and shuts down
    """
    global _installed, _node_id
    _node_id = node_id
    if _installed:
        return
    _legacy.profile._start_trace = _start_trace
    _legacy._parse_legacy_records = _parse_legacy_records
    _installed = True
