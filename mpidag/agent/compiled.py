"""The compiled path of plain calls, assembled from an agent's parts (see
:mod:`mpidag.agent.fastpath` for what it does and when it is used).

Example::

    >>> core = runtime.agent.core        # make_core(...) at the agent's start, or None
    >>> core is None or callable(core.dispatch)
    True
    >>> runtime.agent.call_path.split(" (")[0]
    'compiled call path'
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch

from mpidag._remote_profiling import call_profiling, observing, profiling_flags
from mpidag.agent import fastpath
from mpidag.agent.calls import EXPIRY_SCAN_INTERVAL, OutgoingCalls, PendingCall
from mpidag.agent.futures import RpcFuture
from mpidag.agent.handlers import DESCRIBED, Handler, describe
from mpidag.agent.serving import Server
from mpidag.errors import WorkerFailedError
from mpidag.transport import frames, torch_native
from mpidag.transport.base import FramedTransport

__all__ = ["make_core", "slots_drift"]


def _set_result() -> Any:
    """``RpcFuture.set_result``, unbound: torch's C method itself unless a class between
    overrides it (one Python frame less a completed future)."""
    if RpcFuture.set_result is torch.futures.Future.set_result:
        return torch._C.Future.set_result
    return RpcFuture.set_result


def _torch_futures() -> Any:
    """``_mpidag_torch``'s ``futures_api`` capsule: ``rpc_async``'s futures made and completed
    in C++ (torch's ``__init__`` without its binding, ``set_result`` without dropping the
    GIL); ``None`` where that module is not built, where a class between ``RpcFuture`` and
    torch's overrides ``set_result``, or where this torch holds its futures otherwise than
    the C++ expects (``futures_problem()``): then torch's bindings run."""
    native = torch_native.torch_module()
    if native is None or _set_result() is not torch._C.Future.set_result or \
            native.futures_problem() is not None:
        return None
    return native.futures_api


def _tensor_facts() -> Any:
    """``_mpidag_torch``'s ``tensor_facts_api`` capsule: a tensor's layout, device,
    contiguity and size read in C++ (``None`` where that module is not built: its Python
    attributes are read)."""
    native = torch_native.torch_module()
    return None if native is None else native.tensor_facts_api


def slots_drift(module: Any) -> str:
    """The classes whose slots are not the ones the C module fills (it makes ``Envelope`` and
    ``PendingCall`` objects through their slots, without ``__init__``); ``""`` when none.

    Example::

        >>> slots_drift(fastpath.compiled_module()) if fastpath.compiled_module() else ""
        ''
    """
    drifted = [cls.__name__ for cls, fields in ((frames.Envelope, module.ENVELOPE_FIELDS),
                                                (PendingCall, module.PENDING_CALL_FIELDS))
               if set(cls.__slots__) != set(fields)]
    return " and ".join(drifted)


def make_core(calls: OutgoingCalls, server: Server, transport: Any,
              python_dispatch: Callable[[Any], Any], compiled: bool = True
              ) -> tuple[Any, str]:
    """``(core, why)``: the compiled plain-call path of an agent's parts, or ``None`` (see
    the module's doc), and which path the agent takes and why (the agent's ``call_path``).

    ``python_dispatch(env)``: the agent's Python dispatch, for every message the C path
    leaves to Python. The core's ``step`` is the progress engine's leader step (see
    ``ProgressEngine.set_step``), whose after-poll hook is ``RpcAgent._tick`` done in C: the
    layers' tick hooks (``calls.plugins.tick_hooks``, read live) and ``calls.expire_due``
    at most every :data:`~mpidag.agent.calls.EXPIRY_SCAN_INTERVAL`. The sender's counters
    must be the C ones (:func:`mpidag.agent.fastpath.make_counters`).
    """
    module = fastpath.compiled_module()
    if not compiled:
        return None, "Python call path: MPIDAG_COMPILED=0"
    if module is None:
        return None, fastpath.problem()
    sender, codec, ids = calls.sender, calls.codec, calls.ids
    if not isinstance(sender.counters, module.Counters):
        return None, "Python call path: the sender counts in Python"
    if not isinstance(transport, FramedTransport):
        return None, "Python call path: the transport does not send frames"
    drift = slots_drift(module)
    if drift:
        return None, (f"Python call path: {module.__file__} fills other slots than {drift}; "
                      f"rebuild it with 'python -m mpidag.transport.wire_build'")
    profiler_globals, profiler_enabled, observing_globals = profiling_flags()
    core = module.Core(
        calls=calls, pending=calls.table, peers_failed=calls.peers.failed,
        prefixes=codec.prefixes, targets=codec.targets, id_counter=ids.counter,
        id_base=ids.base, id_max=ids.max_counter, counters=sender.counters,
        transport=transport, transport_failed=transport.failed,
        rank=transport.rank, frames=frames, plugins=calls.plugins,
        future_type=RpcFuture, future_init=torch._C.Future.__init__, engine=calls.engine,
        set_result=_set_result(),
        wake_waiters=calls.engine.wake_waiters, poll=transport.poll,
        requeue=transport.requeue, observing=observing, dumps=pickle.dumps,
        loads=pickle.loads, protocol=pickle.HIGHEST_PROTOCOL, handler_type=Handler,
        envelope=frames.Envelope, pending_call=PendingCall,
        payload_limit=frames.PAYLOAD_FRAME_LIMIT, py_dispatch=python_dispatch,
        py_complete=calls.complete, py_serve=server.serve_call,
        py_reply_value=server.reply_value, py_fail=server.fail_call,
        failed_error=calls.peers.failed_error,
        worker_failed_error=WorkerFailedError, by_name=calls.peers.by_name,
        peers_left=calls.peers.left, call_profiling=call_profiling, tensor_type=torch.Tensor,
        strided=torch.strided,
        lone_tensor=frames.LONE_TENSOR_PAYLOAD, inline_limit=frames.INLINE_LIMIT,
        loopback=transport.loopback,
        decode_message=frames.decode_message, receive_rest=transport.receive_rest,
        poll_wait=transport.poll_wait, describe=describe, described=DESCRIBED,
        peer_names=calls.peers.names, result_not_recorded=calls.result_not_recorded,
        py_unsendable=server.reply_unsendable,
        py_serve_notify=server.serve_notify, py_notify_failed=server.notify_failed,
        cfuture_type=torch._C.Future, py_answer_when_done=server.answer_when_done,
        torch_futures=_torch_futures(), tick_hooks=calls.plugins.tick_hooks,
        expire_due=calls.expire_due, expiry_interval=EXPIRY_SCAN_INTERVAL,
        profiler_globals=profiler_globals, profiler_enabled=profiler_enabled,
        observing_globals=observing_globals, tensor_facts=_tensor_facts(),
        interrupt=calls.engine.interrupt, doorbell=calls.engine.doorbell,
    )
    return core, f"compiled call path ({module.__file__})"


