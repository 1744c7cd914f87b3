"""The owner/user protocol of RRefs (one :class:`RRefContext` per RPC agent).

Terms: the *owner* rank holds the value in one owner record; every other reference is a
*user* fork with a globally unique fork id. The owner keeps the value while any fork it
knows of is alive, or while Python handles to it live on the owner itself.

Sending an RRef to rank D (pickling it as an argument or result of any RPC):

* from the owner: the owner counts the new fork at once (pending until D accepts it);
  D creates the user and sends ``user_accept``; if D is the owner itself, the pending fork
  just becomes a local handle.
* from a user P: P keeps itself alive (the child is in its *pending children*) until the
  owner confirms the child — guarantee G2. If D is the owner, D takes a local handle and
  sends ``child_accept`` to P. Otherwise D creates a user and sends ``fork_request`` to the
  owner; the owner counts the fork, then sends ``child_accept`` to P and ``fork_confirmed``
  to D.
* a user whose Python handle is gone, and whose children are all confirmed, sends
  ``user_delete`` to the owner — guarantee G1.

All protocol messages are handlers of mode ``control`` registered in the agent
(``rref.user_delete``, ``rref.user_accept``, ``rref.fork_request``, ``rref.child_accept``,
``rref.fork_confirmed``: run by the receiving leader in arrival order, never blocking).
They may still arrive late or reordered (delays can be injected in tests): a delete that
arrives before the fork it deletes leaves a *tombstone* that the registration consumes, and
repeated messages are ignored, so every step is idempotent. The calls (``rref.create``,
``rref.fetch``, ``rref.invoke``, ``rref.backward``) are handlers too, and RRef handles
travel through the agent's codecs (``rref``): every message reaches this rank's own
context, with no global lookup.
"""

from __future__ import annotations

import collections
import gc
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from mpidag._ids import IdGenerator
from mpidag._remote_profiling import function_name
from mpidag.agent.agent import Handler, RpcAgent, describe, detaches_parameters
from mpidag.dist_autograd import DistAutograd
from mpidag.errors import (
    RemoteBaseException,
    RPCError,
    async_result_error,
    detached_copy,
    future_error,
    operator_error,
)
from mpidag.rref.handle import RRefHandle
from mpidag.rref.owners import OwnerRecord, OwnerTable
from mpidag.rref.users import UserRecord, UserTable

__all__ = ["OwnerRecord", "RRefContext", "UserRecord"]

log = logging.getLogger(__name__)


class _ArgumentForks(threading.local):
    #: while this thread unpickles a call's arguments: the user forks they made that the
    #: owner has not confirmed yet
    unconfirmed: list[UserRecord] | None = None


_arguments = _ArgumentForks()


class RRefContext:
    """Owner and user tables of one rank, the protocol steps on them, and the calls that
    create, fetch and use values.

    ``handle_type``: the class of the handles it makes (the public ``mpidag.rpc.RRef``
    under ``init_rpc``).

    Example::

        >>> rrefs = runtime.rrefs     # RRefContext(agent, autograd): registers its handlers
        >>> handle = rrefs.remote(1, torch.add, (torch.ones(2), 1), {}, timeout=10)
        >>> handle.to_here()
        tensor([2., 2.])
    """

    def __init__(self, agent: RpcAgent, autograd: DistAutograd,
                 handle_type: type[RRefHandle] = RRefHandle) -> None:
        self.agent = agent
        self.autograd = autograd
        self.handle_type = handle_type
        self.rank = agent.rank
        #: RRef and fork ids, counted apart from the agent's ids (as torch's RRef context
        #: does), so a rank's n-th RRef id reads as torch's (``repr`` of an RRef)
        self.ids = IdGenerator(agent.rank, agent.world_size)
        self.lock = threading.RLock()
        #: the values this rank owns, and the forks of them other ranks hold
        self.owners = OwnerTable(self.lock, self.ids, agent.failed, agent.where())
        #: the forks of values owned elsewhere that this rank holds
        self.users = UserTable(
            self.lock, lambda owner, rref_id, fork_id: self.send(
                owner, self._user_delete, rref_id, fork_id),
            agent.engine.wake_waiters, agent.where())
        #: (rref_id, fork_id or None) of handles Python freed, for the leader to process
        self.releases: collections.deque[tuple[int, int | None]] = collections.deque()
        self.releasing = 0  # releases taken off the queue whose messages are not sent yet
        register = agent.register_handler
        # protocol steps: short, in arrival order, on the receiving leader
        self._user_delete = register("rref.user_delete", self.owners.delete_fork,
                                     mode="control")
        self._user_accept = register("rref.user_accept", self.owners.accept_pending,
                                     mode="control")
        self._fork_request = register("rref.fork_request", self._on_fork_request,
                                      mode="control")
        self._child_accept = register("rref.child_accept", self.users.child_accepted,
                                      mode="control")
        self._fork_confirmed = register("rref.fork_confirmed", self.users.confirm,
                                        mode="control")
        # calls on the owner
        self._create = register(
            "rref.create", self._run_on_owner,
            describe=lambda rref_id, fork, func, args, kwargs: f"remote({describe(func, args)})",
            profile_as=lambda rref_id, fork, func, args, kwargs: (
                "remote", function_name(func, args)[1]),
            detaches=lambda rref_id, fork, func, args, kwargs: detaches_parameters(func, args))
        self._fetch = register(
            "rref.fetch", self._on_fetch, asynchronous=True,
            describe=lambda rref_id: f"RRef(0x{rref_id:x}).to_here()",
            profile_as=lambda rref_id: (None, "to_here"),
            detaches=self.owners.detaches)
        self._invoke = register(
            "rref.invoke", self._on_invoke, asynchronous=True,
            describe=lambda rref, name, *_: f"RRef(0x{rref._rref_id:x}).{name}()",
            profile_as=lambda rref, name, *_: (None, name))
        self._backward = register(
            "rref.backward", self._on_backward,
            describe=lambda rref_id, *_: f"RRef(0x{rref_id:x}).backward()")
        agent.codecs.register(handle_type, "rref", self._reduce_handle, self._rebuild_handle)
        agent.add_failure_listener(self._on_peer_failed)
        agent.add_hooks(tick=self.process_releases, tick_queue=self.releases,
                        busy=lambda: bool(self.releases) or self.releasing > 0,
                        before_shutdown=self.release_all_users,
                        arguments=(self._begin_arguments, self._end_arguments))

    # ------------------------------------------------------------- releases
    def process_releases(self) -> None:
        """Carry out the releases queued by ``RRef.__del__`` (called by the leader)."""
        releases = self.releases
        while releases:
            with self.lock:  # counted busy from before the pop until its message is sent
                self.releasing += 1
            try:
                try:
                    rref_id, fork_id = releases.popleft()
                except IndexError:
                    return
                if fork_id is None:
                    self.owners.drop_local_handle(rref_id)
                else:
                    self.users.release(fork_id)
            finally:
                with self.lock:
                    self.releasing -= 1

    def create_local_record(self, value: Any) -> int:
        """An owner record holding ``value`` at once (``RRef(value)``); returns its id."""
        return self.owners.create_local_record(value)

    # ------------------------------------------------------------ failed ranks
    def _on_peer_failed(self, rank: int) -> None:
        """``rank`` failed: its forks of this rank's values no longer count (the values
        are freed when nothing else holds them), and this rank's forks of values it owned
        are dropped (using them raises ``WorkerFailedError``; nothing is sent for them)."""
        self.owners.drop_forks_of(rank)
        self.users.drop_forks_owned_by(rank)

    # --------------------------------------------------------------- messages
    def send(self, dst: int, handler: Any, *args: Any) -> None:
        """Send one protocol step (a control handler) to ``dst``; never raises."""
        agent = self.agent
        if not agent.running or dst in agent.failed:
            return
        try:
            agent.notify(dst, handler, args)
        except Exception:
            log.exception("could not send RRef protocol message %s to rank %d",
                          handler.name, dst)

    # --------------------------------------------------------------- shutdown
    def release_all_users(self) -> None:
        """Shutdown hook: release user forks Python still references, and report them."""
        gc.collect()
        self.process_releases()
        live = self.users.release_all()
        if live:
            log.warning("%s: %d user RRef(s) still referenced at shutdown were released "
                        "(their owners free the values)", self.agent.where(), live)

    def debug_info(self) -> dict[str, int]:
        """mpidag's RRef counters (after carrying out queued releases).

        Example::

            >>> runtime.rrefs.debug_info()["num_owner_rrefs"]
            0
        """
        self.process_releases()
        owners, users = self.owners.counts(), self.users.counts()
        return {
            "num_owner_rrefs": owners["num_owner_rrefs"],
            "num_forks": owners["num_forks"],
            "num_pending_users": owners["num_pending_forks"] + users["num_unconfirmed_users"],
            "num_pending_children": users["num_pending_children"],
            "num_user_rrefs": users["num_user_rrefs"],
            "num_tombstones": owners["num_tombstones"],
        }

    def torch_debug_info(self) -> dict[str, str]:
        """torch's ``_rref_context_get_debug_info()``: its four keys, string values.

        Example::

            >>> runtime.rrefs.torch_debug_info()["num_pending_futures"]
            '0'
        """
        info = self.debug_info()  # carries out queued releases first
        shared = self.owners.counts()["num_shared"]
        with self.lock:
            releasing = len(self.releases) + self.releasing
        return {
            "num_owner_rrefs": str(shared),
            "num_forks": str(info["num_forks"]),
            "num_pending_users": str(info["num_pending_users"]),
            "num_pending_futures": str(info["num_pending_children"] + releasing),
        }

    def stuck_owners(self) -> list[int]:
        """Ids of owner records that still count user forks (after a graceful shutdown:
        a protocol message was lost)."""
        return self.owners.stuck()

    # ------------------------------------------------------------ pickling handles
    def _handle(self, rref_id: int, owner: int, fork_id: int | None) -> RRefHandle:
        return self.handle_type._handle(self, rref_id, owner, fork_id)

    def _reduce_handle(self, handle: RRefHandle, scope: Any) -> tuple:
        """Pickle a handle for the rank the message goes to (``scope.context``): start its
        fork (G2); ``scope.on_failure`` undoes that if the message is not sent."""
        agent = self.agent
        dst = scope.context
        if dst is None:
            raise RPCError("Can not pickle rref in python pickler, rref can only be pickled "
                           "when using RPC: as an argument or return value of rpc_sync, "
                           "rpc_async or remote")
        if handle._ctx is not self:
            raise RPCError(f"{handle!r} belongs to an RPC session that was shut down")
        if handle._owner in agent.failed:
            raise agent.failed_error(handle._owner, f"sending {handle!r}")
        child = self.ids.next()
        rref_id, fork_id = handle._rref_id, handle._fork_id
        if fork_id is None:  # the owner forks: count the child at once
            self.owners.register_fork(rref_id, child, dst, pending=True)
            scope.on_failure(lambda: self.owners.delete_fork(rref_id, child))
        else:  # a user forks: keep this user alive until the owner confirms the child (G2)
            if not self.users.start_child(fork_id, child):
                raise RPCError(f"{handle!r} was already deleted")
            scope.on_failure(lambda: self.users.child_accepted(fork_id, child))
        return rref_id, handle._owner, child, self.rank, fork_id

    def _rebuild_handle(self, state: tuple) -> RRefHandle:
        """Unpickle a handle on this rank and start its protocol steps."""
        rref_id, owner, child, parent_rank, parent_fork = state
        me = self.rank
        if me == owner:
            # back at the owner: a local handle; a pending fork of the owner's is consumed
            self.owners.add_local_handle(
                rref_id, from_pending_fork=child if parent_fork is None else None)
            if parent_fork is not None:
                self.send(parent_rank, self._child_accept, parent_fork, child)
            return self._handle(rref_id, owner, None)
        if parent_fork is None:  # sent by the owner, which already counts this fork
            self.users.add(rref_id, child, owner, confirmed=True)
            self.send(owner, self._user_accept, rref_id, child)
        else:  # sent by another user: ask the owner to count it
            rec = self.users.add(rref_id, child, owner, confirmed=False)
            unconfirmed = _arguments.unconfirmed
            if unconfirmed is not None:  # an argument: the call waits for the owner's answer
                unconfirmed.append(rec)
            self.send(owner, self._fork_request, rref_id, child, parent_rank, parent_fork, me)
        return self._handle(rref_id, owner, child)

    @staticmethod
    def _begin_arguments() -> None:
        """Before a call's arguments are unpickled: record the forks they make."""
        _arguments.unconfirmed = []

    def _end_arguments(self) -> Callable[[], bool] | None:
        """After: ``None``, or the test the call waits for before its function runs: every
        user RRef among the arguments is confirmed by its owner (torch runs a function
        only once the RRefs of its arguments are; ``confirmed_by_owner()`` is true in it)."""
        unconfirmed, _arguments.unconfirmed = _arguments.unconfirmed, None
        if not unconfirmed:
            return None
        failed = self.agent.failed
        return lambda: all(rec.confirmed or rec.delete_sent or rec.owner in failed
                           for rec in unconfirmed)

    # ---------------------------------------------------------- user-facing calls
    def create_local(self, value: Any) -> RRefHandle:
        """A handle to ``value`` owned by this rank (``RRef(value)``)."""
        return self._handle(self.owners.create_local_record(value), self.rank, None)

    def remote(self, dst: int, func: Callable, args: tuple, kwargs: dict,
               timeout: float) -> RRefHandle:
        """Run ``func(*args, **kwargs)`` on ``dst``; a handle to the result, at once."""
        agent = self.agent
        rref_id = self.ids.next()
        if dst == self.rank:
            with self.lock:
                self.owners.record(rref_id).local_handles += 1
            handle = self._handle(rref_id, dst, None)
            fut = agent.call(dst, self._create, (rref_id, None, func, args, kwargs), {},
                             timeout)
            fut.add_internal_callback(lambda f: self._creation_timeout(rref_id, f))
            handle._creation_future = fut
            return handle
        fork_id = self.ids.next()
        self.users.add(rref_id, fork_id, dst, confirmed=False)
        handle = self._handle(rref_id, dst, fork_id)
        fut = agent.call(dst, self._create, (rref_id, fork_id, func, args, kwargs), {},
                         timeout)
        fut.add_internal_callback(lambda f: self.users.confirm(fork_id, error=future_error(f)))
        handle._creation_future = fut
        return handle

    def _creation_timeout(self, rref_id: int, fut: torch.futures.Future) -> None:
        error = future_error(fut)
        if error is not None:  # the call itself failed (e.g. timed out): fail the value
            self.owners.finish_creation(rref_id, error=error)

    def fetch(self, handle: RRefHandle, timeout: float) -> Any:
        """A copy of a user handle's value, from its owner (``to_here()``)."""
        try:
            return self.agent.call_sync(handle._owner, self._fetch, (handle._rref_id,), {},
                                        timeout)
        except RemoteBaseException as exc:  # the value failed with SystemExit & co.
            error = detached_copy(exc.exception)
            error.__suppress_context__ = True  # its cause is the remote traceback
            raise error  # noqa: B904 - the cause is kept

    def invoke(self, handle: RRefHandle, mode: str, name: str, args: tuple, kwargs: dict,
               timeout: float) -> Any:
        """``value.name(*args, **kwargs)`` on the owner, as ``rpc_sync``, ``rpc_async`` or
        ``remote`` (the proxies)."""
        call_args = (handle, name, args, kwargs)
        if mode == "remote":
            # as torch's proxy: a method the value's type lacks fails here, at once (the
            # type is asked of the owner once per RRef); the other modes fail on the owner
            value_type = handle._get_type(timeout)
            if not hasattr(value_type, name):
                raise AttributeError(
                    f"{value_type.__name__!r} object has no attribute {name!r}: the RRef's "
                    f"value has no method {name!r} (called through rref.remote())")
            return self.remote(handle._owner, self._invoke, call_args, {}, timeout)
        if mode == "rpc_async":
            return self.agent.call(handle._owner, self._invoke, call_args, {}, timeout)
        return self.agent.call_sync(handle._owner, self._invoke, call_args, {}, timeout)

    def backward(self, handle: RRefHandle, context_id: int, retain_graph: bool) -> None:
        """Backward from the value on its owner (distributed with a context id)."""
        if handle._fork_id is None:
            self._on_backward(handle._rref_id, context_id, retain_graph)
            return
        self.agent.call_sync(handle._owner, self._backward,
                             (handle._rref_id, context_id, retain_graph), {}, 0, record=False)

    def owner_value(self, rref_id: int) -> Any:
        """The value of an owner record (waits for a ``remote()`` still running)."""
        rec = self.owners.existing_or_pending(rref_id)
        if rec is None:
            raise RPCError(f"the value of RRef 0x{rref_id:x} no longer exists on its owner "
                           f"{self.agent.info.name}")
        return self.agent.wait_for(rec.value)  # drives progress, raises a detached copy

    # ------------------------------------------------------------------ handlers
    def _on_fork_request(self, rref_id: int, fork_id: int, parent_rank: int,
                         parent_fork: int, child_rank: int) -> None:
        self.owners.register_fork(rref_id, fork_id, child_rank)
        self.send(parent_rank, self._child_accept, parent_fork, fork_id)
        self.send(child_rank, self._fork_confirmed, fork_id)

    def _on_fetch(self, rref_id: int) -> torch.futures.Future:
        """On the owner: a future of the value, answered when the value exists."""
        rec = self.owners.existing_or_pending(rref_id)
        if rec is None:
            fut = torch.futures.Future()
            fut.set_exception(RPCError(
                f"the value of RRef 0x{rref_id:x} no longer exists on its owner "
                f"{self.agent.info.name}: every reference to it was deleted"))
            return fut
        return rec.value

    def _run_on_owner(self, rref_id: int, creator_fork: int | None, func: Callable,
                      args: tuple, kwargs: dict) -> None:
        """On the owner: count the creator's fork, then run the function behind
        ``remote()`` and store its value or error."""
        if creator_fork is not None:  # made (by id) on the rank that called remote()
            self.owners.register_fork(rref_id, creator_fork, self.ids.creator(creator_fork))
        try:
            value = func(*args, **kwargs)
            if getattr(func, "_wrapped_async_rpc_function", None) is not None:
                if not isinstance(value, torch._C.Future):
                    raise async_result_error(describe(func), value)
                value = value.wait()
            elif type(func) is Handler and func.asynchronous and isinstance(
                    value, torch._C.Future):  # rref.remote().m() of an async method
                value = value.wait()
        except BaseException as exc:  # noqa: BLE001 - SystemExit & co. fail the value too
            exc = operator_error(func, exc)
            self.owners.finish_creation(rref_id, error=exc)
            raise exc  # the caller of remote() learns of it too
        self.owners.finish_creation(rref_id, value=value,
                                    detach_parameters=detaches_parameters(func, args))

    def _on_invoke(self, handle: RRefHandle, name: str, args: tuple, kwargs: dict) -> Any:
        """On the owner: ``getattr(value, name)(*args, **kwargs)``, or the method's own
        future for an ``@rpc.functions.async_execution`` method (as torch's proxies, the
        answer waits for it; an asynchronous handler may answer either)."""
        value = self.owner_value(handle._rref_id)
        try:
            bound = getattr(value, name)
        except AttributeError:
            raise AttributeError(f"{type(value).__name__!r} object has no attribute {name!r}: "
                                 f"the RRef's value on its owner has no method {name!r} "
                                 f"(called through an RRef proxy)") from None
        result = bound(*args, **kwargs)
        if getattr(bound, "_wrapped_async_rpc_function", None) is not None:
            if not isinstance(result, torch._C.Future):
                raise async_result_error(describe(bound), result)
            return result  # an @async_execution method: the answer is its future's value
        # a plain value is answered at once: a completed torch future cost 15 us more per
        # call (its callback releases the GIL to the spinning leader and waits to get it back)
        return result

    def _on_backward(self, rref_id: int, context_id: int, retain_graph: bool) -> None:
        """On the owner: backward from the value (distributed when given a context)."""
        value = self.owner_value(rref_id)
        if not isinstance(value, torch.Tensor):
            raise RuntimeError(f"RRef should contain a tensor for .backward(), but the RRef "
                               f"holds a {type(value).__name__}")
        if context_id == -1:
            if value.numel() != 1 and value.requires_grad:  # else torch's error, as torch
                raise RuntimeError(f"grad can be implicitly created only for scalar outputs: "
                                   f"RRef.backward() needs a scalar tensor, the value has "
                                   f"shape {tuple(value.shape)}")
            value.backward(retain_graph=retain_graph)
            return
        self.autograd.backward(context_id, [value], retain_graph)
