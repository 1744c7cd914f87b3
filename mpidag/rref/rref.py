"""``RRef``, ``remote()`` and the RRef proxies, mirroring ``torch.distributed.rpc``.

An ``RRef`` object is a handle: on the owner it refers to the owner record (the value), on
any other rank to a user fork. Handles are created by :func:`remote`, by ``RRef(value)``, and
by unpickling an RRef that arrived as an argument or result of any RPC; the protocol of
:mod:`mpidag.rref.context` keeps the value alive exactly as long as some handle exists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mpidag.errors import RPCError, detached_copy, future_error
from mpidag.rpc.agent import detaches_parameters
from mpidag.rpc.api import _check_call, _to_rank, current_agent
from mpidag.rpc.functions import async_execution
from mpidag.rpc.options import UNSET_RPC_TIMEOUT, WorkerInfo
from mpidag.rref import context as proto
from mpidag.rref.context import RRefContext

__all__ = ["RRef", "remote"]


class RRef:
    """A reference to a value that lives on one worker (its owner).

    ``RRef(value)`` wraps a local value: this worker is the owner. Remote references come
    from :func:`remote` or arrive as arguments and results of RPCs. The owner frees the
    value when no reference to it is left on any worker.

    Example::

        >>> rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        >>> rref.owner_name(), rref.is_owner()
        ('worker1', False)
        >>> rref.to_here()
        tensor([2., 2.])
        >>> rref.rpc_sync().size()        # runs value.size() on the owner
        torch.Size([2])
    """

    __slots__ = ("_rref_id", "_fork_id", "_owner", "_ctx", "__weakref__")

    def __init__(self, value: Any, type_hint: type | None = None) -> None:
        ctx = RRefContext.of(current_agent())
        self._ctx = ctx
        self._owner = ctx.rank
        self._fork_id = None
        self._rref_id = ctx.create_local(value)

    @classmethod
    def _handle(cls, ctx: RRefContext, rref_id: int, owner: int, fork_id: int | None) -> RRef:
        obj = cls.__new__(cls)
        obj._ctx, obj._rref_id, obj._owner, obj._fork_id = ctx, rref_id, owner, fork_id
        return obj

    def __del__(self) -> None:
        # __del__ may run inside any allocation of any thread (a GC), even one holding a
        # lock of mpidag's: only queue the release; the progress leader carries it out
        ctx = getattr(self, "_ctx", None)
        if ctx is not None:
            ctx.releases.append((self._rref_id, self._fork_id))

    def __repr__(self) -> str:
        kind = "OwnerRRef" if self.is_owner() else "UserRRef"
        return f"{kind}(rref_id=0x{self._rref_id:x}, owner={self.owner_name()})"

    # ---------------------------------------------------------------- queries
    def owner(self) -> WorkerInfo:
        """The ``WorkerInfo`` of the owner."""
        return self._ctx.agent.workers[self._owner]

    def owner_name(self) -> str:
        """The worker name of the owner."""
        return self.owner().name

    def is_owner(self) -> bool:
        """Whether this worker owns the value."""
        return self._fork_id is None

    def confirmed_by_owner(self) -> bool:
        """Whether the owner knows of this reference (always true on the owner)."""
        if self._fork_id is None:
            return True
        rec = self._ctx.users.get(self._fork_id)
        return rec is not None and rec.confirmed

    # ------------------------------------------------------------------ value
    def local_value(self) -> Any:
        """The value itself; only on the owner (waits for a ``remote()`` still running).

        Example::

            >>> rpc.RRef(torch.zeros(3)).local_value()
            tensor([0., 0., 0.])
        """
        if self._fork_id is not None:
            raise RPCError(
                f"RRef.local_value() called on a non-owner: this is "
                f"{self._ctx.agent.info.name}, the value lives on {self.owner_name()}. Call "
                f"to_here() for a copy, or rpc_sync().method(...) to run a method there."
            )
        return _owner_value(self._ctx, self._rref_id)

    def to_here(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """A copy of the value on this worker (the value itself on the owner).

        Raises the error of the function behind ``remote()`` if it failed. ``timeout`` as
        for :func:`mpidag.rpc.rpc_sync`.

        Example::

            >>> rpc.remote("worker1", torch.ones, args=(2,)).to_here()
            tensor([1., 1.])
        """
        agent = _live_agent(self)
        if self._fork_id is None:
            return self.local_value()
        rec = self._ctx.users.get(self._fork_id)
        if rec is not None and rec.creation_error is not None:
            raise detached_copy(rec.creation_error)
        return agent.wait(agent.call(self._owner, _fetch, (self._rref_id,), {}, timeout),
                          timeout)

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run a backward pass with the value (a scalar tensor) as the root, on the owner.

        With ``dist_autograd_ctx_id`` it is a distributed backward pass in that context
        (read the gradients with ``mpidag.autograd.get_gradients``); with -1 (the default)
        a plain local ``value.backward()``, which only the owner may call.

        Example::

            >>> with dist_autograd.context() as context_id:
            ...     rref = rpc.remote("worker1", torch.sum, args=(x,))   # x requires grad
            ...     rref.backward(context_id)
        """
        agent = _live_agent(self)
        if dist_autograd_ctx_id is None:
            dist_autograd_ctx_id = -1
        if self._fork_id is None:
            _backward_on_owner(self._rref_id, dist_autograd_ctx_id, retain_graph)
            return
        if dist_autograd_ctx_id == -1:
            raise RuntimeError(
                f"RRef.backward() without a dist_autograd_ctx_id runs a local backward pass, "
                f"which only the owner ({self.owner_name()}) can do; pass the context id of "
                f"`with mpidag.autograd.context() as context_id` for a distributed one")
        agent.wait(agent.call(self._owner, _backward_on_owner,
                              (self._rref_id, dist_autograd_ctx_id, retain_graph), {}, 0,
                              record=False), 0)

    # ---------------------------------------------------------------- proxies
    def rpc_sync(self, timeout: float = UNSET_RPC_TIMEOUT) -> _Proxy:
        """Proxy: ``rref.rpc_sync().m(*a)`` runs ``value.m(*a)`` on the owner, waits.

        Example::

            >>> rref = rpc.remote("worker1", torch.ones, args=(2,))
            >>> rref.rpc_sync().size()
            torch.Size([2])
        """
        return _Proxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: float = UNSET_RPC_TIMEOUT) -> _Proxy:
        """Proxy: ``rref.rpc_async().m(*a)`` returns a future of ``value.m(*a)``.

        Example::

            >>> rref.rpc_async().size().wait()
            torch.Size([2])
        """
        return _Proxy(self, "rpc_async", timeout)

    def remote(self, timeout: float = UNSET_RPC_TIMEOUT) -> _Proxy:
        """Proxy: ``rref.remote().m(*a)`` returns an RRef to ``value.m(*a)`` on the owner.

        Example::

            >>> rref.remote().size().to_here()
            torch.Size([2])
        """
        return _Proxy(self, "remote", timeout)

    # --------------------------------------------------------------- pickling
    def __reduce__(self) -> tuple:
        agent = _live_agent(self)
        dst = agent.pickling_for()
        if dst is None:
            raise RPCError("an RRef can only be pickled as an argument or return value of an "
                           "RPC (rpc_sync, rpc_async, remote)")
        ctx = self._ctx
        child = agent.ids.next()
        if self._fork_id is None:  # the owner forks: count the child at once
            ctx.register_fork(self._rref_id, child, pending=True)
            agent.on_pickling_failure(lambda: ctx.delete_fork(self._rref_id, child))
        else:  # a user forks: keep this user alive until the owner confirms the child (G2)
            with ctx.lock:
                rec = ctx.users.get(self._fork_id)
                if rec is None or rec.delete_sent:
                    raise RPCError(f"{self!r} was already deleted")
                rec.pending_children.add(child)
            agent.on_pickling_failure(lambda: ctx.child_accepted(self._fork_id, child))
        return _rebuild, (self._rref_id, self._owner, child, ctx.rank, self._fork_id)


def _rebuild(rref_id: int, owner: int, child: int, parent_rank: int,
             parent_fork: int | None) -> RRef:
    """Unpickle an RRef on the receiving worker and start its protocol steps."""
    ctx = RRefContext.of(current_agent())
    me = ctx.rank
    if me == owner:
        # back at the owner: a local handle; a pending fork of the owner's is consumed
        ctx.add_local_handle(rref_id, from_pending_fork=child if parent_fork is None else None)
        if parent_fork is not None:
            ctx.send(parent_rank, proto._on_child_accept, parent_fork, child)
        return RRef._handle(ctx, rref_id, owner, None)
    if parent_fork is None:  # sent by the owner, which already counts this fork
        ctx.add_user(rref_id, child, owner, confirmed=True)
        ctx.send(owner, proto._on_user_accept, rref_id, child)
    else:  # sent by another user: ask the owner to count it
        ctx.add_user(rref_id, child, owner, confirmed=False)
        ctx.send(owner, proto._on_fork_request, rref_id, child, parent_rank, parent_fork, me)
    return RRef._handle(ctx, rref_id, owner, child)


def _live_agent(rref: RRef):
    agent = current_agent()
    if agent is not rref._ctx.agent:
        raise RPCError(f"{rref!r} belongs to an RPC session that was shut down")
    return agent


def _owner_value(ctx: RRefContext, rref_id: int) -> Any:
    rec = ctx.existing_or_pending(rref_id)
    if rec is None:
        raise RPCError(f"the value of RRef 0x{rref_id:x} no longer exists on its owner "
                       f"{ctx.agent.info.name}")
    fut = rec.value
    fut._engine = ctx.agent.engine  # wait() drives progress and raises a detached copy
    return fut.wait()


@async_execution
def _fetch(rref_id: int) -> torch.futures.Future:
    """On the owner: a future of the value, answered when the value exists."""
    ctx = RRefContext.of(current_agent())
    rec = ctx.existing_or_pending(rref_id)
    if rec is None:
        fut = torch.futures.Future()
        fut.set_exception(RPCError(
            f"the value of RRef 0x{rref_id:x} no longer exists on its owner "
            f"{ctx.agent.info.name}: every reference to it was deleted"))
        return fut
    return rec.value


def _describe_remote(func: Callable, *_: Any) -> str:
    from mpidag.rpc.agent import describe

    return f"remote({describe(func)})"


def _fetch_detaches(rref_id: int) -> bool:
    """On the owner: how ``to_here()`` sends the value's parameters (torch's rule)."""
    rec = RRefContext.of(current_agent()).owners.get(rref_id)
    return True if rec is None else rec.detach_parameters


_fetch._mpidag_describe = lambda rref_id: f"RRef(0x{rref_id:x}).to_here()"
_fetch._mpidag_detaches = _fetch_detaches


def _backward_on_owner(rref_id: int, context_id: int, retain_graph: bool) -> None:
    """On the owner: backward from the RRef's value (distributed when given a context)."""
    value = _owner_value(RRefContext.of(current_agent()), rref_id)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"RRef.backward() needs a tensor value, but the RRef holds a "
                        f"{type(value).__name__}")
    if context_id == -1:
        if value.numel() != 1:
            raise RuntimeError(f"RRef.backward(): the value must be a scalar tensor, got "
                               f"shape {tuple(value.shape)}")
        value.backward(retain_graph=retain_graph)
        return
    from mpidag import autograd

    autograd.backward(context_id, [value], retain_graph)


def _make_value(rref_id: int, func: Callable, args: tuple, kwargs: dict) -> None:
    """On the owner: run the function behind ``remote()`` and store its value or error."""
    ctx = RRefContext.of(current_agent())
    try:
        value = func(*args, **kwargs)
        if getattr(func, "_wrapped_async_rpc_function", None) is not None and isinstance(
                value, torch._C.Future):
            value = value.wait()
    except Exception as exc:
        ctx.finish_creation(rref_id, error=exc)
        raise  # the caller of remote() learns of it too
    ctx.finish_creation(rref_id, value=value, detach_parameters=detaches_parameters(func, args))


_make_value._mpidag_describe = lambda rref_id, func, *_: _describe_remote(func)
_make_value._mpidag_detaches = lambda rref_id, func, args, kwargs: detaches_parameters(func,
                                                                                      args)


def _run_on_owner(rref_id: int, creator_fork: int, func: Callable, args: tuple,
                  kwargs: dict) -> None:
    """On the owner: count the creator's fork, then make the value."""
    RRefContext.of(current_agent()).register_fork(rref_id, creator_fork)
    _make_value(rref_id, func, args, kwargs)


_run_on_owner._mpidag_detaches = lambda rref_id, fork, func, args, kwargs: \
    detaches_parameters(func, args)


def remote(to: str | WorkerInfo | int, func: Callable, args: tuple | None = None,
           kwargs: dict | None = None, timeout: float = UNSET_RPC_TIMEOUT) -> RRef:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return an ``RRef`` to the result.

    Returns at once; the value is made on ``to`` in the background. An error raised by
    ``func`` surfaces on ``to_here()`` and on the proxies, with its type.

    Example::

        >>> rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
        >>> rref.to_here()
        tensor([4., 4.])
    """
    agent = current_agent()
    args, kwargs = _check_call(func, args, kwargs)
    dst = _to_rank(agent, to)
    ctx = RRefContext.of(agent)
    rref_id = agent.ids.next()
    if dst == ctx.rank:
        with ctx.lock:
            ctx.owner_record(rref_id).local_handles += 1
        handle = RRef._handle(ctx, rref_id, dst, None)
        fut = agent.call(dst, _make_value, (rref_id, func, args, kwargs), {}, timeout)
        fut.add_done_callback(lambda f: _creation_timeout(ctx, rref_id, f))
        return handle
    fork_id = agent.ids.next()
    ctx.add_user(rref_id, fork_id, dst, confirmed=False)
    handle = RRef._handle(ctx, rref_id, dst, fork_id)
    fut = agent.call(dst, _run_on_owner, (rref_id, fork_id, func, args, kwargs), {}, timeout)
    fut.add_done_callback(lambda f: _creation_answered(ctx, fork_id, f))
    return handle


def _creation_answered(ctx: RRefContext, fork_id: int, fut: torch.futures.Future) -> None:
    error = future_error(fut)
    ctx.confirm_user(fork_id, error=error)


def _creation_timeout(ctx: RRefContext, rref_id: int, fut: torch.futures.Future) -> None:
    error = future_error(fut)
    if error is not None:  # the call itself failed (e.g. timed out): fail the value
        ctx.finish_creation(rref_id, error=error)


class _Proxy:
    """``rref.rpc_sync()`` / ``rpc_async()`` / ``remote()``: methods run on the owner."""

    __slots__ = ("_rref", "_mode", "_timeout")

    def __init__(self, rref: RRef, mode: str, timeout: float) -> None:
        self._rref, self._mode, self._timeout = rref, mode, timeout

    def __getattr__(self, name: str) -> Callable[..., Any]:
        rref, mode, timeout = self._rref, self._mode, self._timeout

        def method(*args: Any, **kwargs: Any) -> Any:
            from mpidag.rpc import api

            call_args = (rref, name, args, kwargs)
            if mode == "remote":
                return remote(rref._owner, _invoke_method, call_args, timeout=timeout)
            if mode == "rpc_async":
                return api.rpc_async(rref._owner, _invoke_method, call_args, timeout=timeout)
            return api.rpc_sync(rref._owner, _invoke_method, call_args, timeout=timeout)

        method.__name__ = name
        return method


def _invoke_method(rref: RRef, name: str, args: tuple, kwargs: dict) -> Any:
    """On the owner: ``getattr(value, name)(*args, **kwargs)``."""
    value = rref.local_value()
    try:
        bound = getattr(value, name)
    except AttributeError:
        raise AttributeError(f"{type(value).__name__!r} value of the RRef has no method "
                             f"{name!r} (called through rref.{name})") from None
    return bound(*args, **kwargs)


_run_on_owner._mpidag_describe = lambda rref_id, fork, func, *_: _describe_remote(func)
_invoke_method._mpidag_describe = lambda rref, name, *_: f"RRef(0x{rref._rref_id:x}).{name}()"
