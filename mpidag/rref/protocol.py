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
from dataclasses import dataclass, field
from typing import Any

import torch

from mpidag._ids import IdGenerator
from mpidag._remote_profiling import function_name
from mpidag.agent.agent import Handler, RpcAgent, RpcFuture, describe, detaches_parameters
from mpidag.dist_autograd import DistAutograd
from mpidag.errors import (
    RemoteBaseException,
    RPCError,
    async_result_error,
    detached_copy,
    frameless,
    future_error,
    operator_error,
    storable,
)
from mpidag.rref.handle import RRefHandle

__all__ = ["RRefContext", "OwnerRecord", "UserRecord"]

#: how many freed RRef ids an owner remembers to recognise repeated protocol messages
FREED_MEMORY = 1 << 16

log = logging.getLogger(__name__)


class _ArgumentForks(threading.local):
    #: while this thread unpickles a call's arguments: the user forks they made that the
    #: owner has not confirmed yet
    unconfirmed: list[UserRecord] | None = None


_arguments = _ArgumentForks()


@dataclass(slots=True)
class OwnerRecord:
    """The owner's state of one RRef."""

    rref_id: int
    value: RpcFuture = field(default_factory=RpcFuture)
    forks: set[int] = field(default_factory=set)  # user forks counted (confirmed or pending)
    holders: dict[int, int] = field(default_factory=dict)  # fork id -> the rank holding it
    pending: set[int] = field(default_factory=set)  # forks sent by the owner, not accepted
    tombstones: set[int] = field(default_factory=set)  # deleted before being registered
    deleted: set[int] = field(default_factory=set)  # for idempotence
    local_handles: int = 0  # Python RRef objects for this value on the owner
    created: bool = False  # the value (or the creation error) is set
    #: how ``to_here()`` sends parameters in the value, by torch's rule: a Python object
    #: is pickled (parameters detached); a tensor from ``RRef(tensor)`` or a builtin op's
    #: ``remote()`` travels as a TorchScript value (attached)
    detach_parameters: bool = True


@dataclass(slots=True)
class UserRecord:
    """A user fork's state on the rank that holds it."""

    rref_id: int
    fork_id: int
    owner: int
    confirmed: bool = False
    pending_children: set[int] = field(default_factory=set)
    released: bool = False  # its Python handle is gone
    delete_sent: bool = False
    creation_error: BaseException | None = None  # remote() whose function failed


class RRefContext:
    """Owner and user tables of one rank, the protocol steps on them, and the calls that
    create, fetch and use values.

    ``handle_type``: the class of the handles it makes (the public ``mpidag.rpc.RRef``
    under ``init_rpc``).

    Example::

        >>> rrefs = RRefContext(agent, autograd)     # registers its handlers in the agent
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
        self.owners: dict[int, OwnerRecord] = {}
        self.users: dict[int, UserRecord] = {}  # by fork id
        self.lock = threading.RLock()
        #: (rref_id, fork_id or None) of handles Python freed, for the leader to process
        self.releases: collections.deque[tuple[int, int | None]] = collections.deque()
        self.releasing = 0  # releases taken off the queue whose messages are not sent yet
        #: ids of freed owner records, so a repeated message is not taken for an early one
        self._freed: collections.deque[int] = collections.deque(maxlen=FREED_MEMORY)
        self._freed_set: set[int] = set()
        register = agent.register_handler
        # protocol steps: short, in arrival order, on the receiving leader
        self._user_delete = register("rref.user_delete", self.delete_fork, mode="control")
        self._user_accept = register("rref.user_accept", self.accept_pending, mode="control")
        self._fork_request = register("rref.fork_request", self._on_fork_request,
                                      mode="control")
        self._child_accept = register("rref.child_accept", self.child_accepted,
                                      mode="control")
        self._fork_confirmed = register("rref.fork_confirmed", self.confirm_user,
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
            detaches=self._fetch_detaches)
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

    # ------------------------------------------------------------- owner side
    def owner_record(self, rref_id: int) -> OwnerRecord:
        """Get or make the record: protocol messages may arrive before the creation."""
        rec = self.owners.get(rref_id)
        if rec is None:
            rec = self.owners[rref_id] = OwnerRecord(rref_id)
        return rec

    def existing_or_pending(self, rref_id: int) -> OwnerRecord | None:
        """The record, made if its creation has not run yet; ``None`` if already freed.

        A fetch can overtake the ``remote()`` call that creates the value: both are
        dispatched in order but run on different pool threads.
        """
        with self.lock:
            if rref_id in self._freed_set:
                return None
            return self.owner_record(rref_id)

    def create_local_record(self, value: Any) -> int:
        """An owner record holding ``value`` at once (``RRef(value)``); returns its id."""
        rref_id = self.ids.next()
        with self.lock:
            rec = self.owner_record(rref_id)
            rec.value.set_result(value)
            rec.created = True
            rec.detach_parameters = not isinstance(value, torch.Tensor)
            rec.local_handles += 1
        return rref_id

    def finish_creation(self, rref_id: int, value: Any = None,
                        error: BaseException | None = None,
                        detach_parameters: bool = True) -> None:
        if error is not None:
            error = frameless(error, self.agent.where())
        with self.lock:
            rec = self.owner_record(rref_id)
            if rec.created:
                return
            rec.created = True
            rec.detach_parameters = detach_parameters
            fut = rec.value
            self._maybe_free(rec)
        if error is None:
            fut.set_result(value)
        else:  # a future holds Exceptions only; its wait() raises a SystemExit as itself
            fut.set_exception(storable(error))

    def register_fork(self, rref_id: int, fork_id: int, holder: int,
                      pending: bool = False) -> None:
        with self.lock:
            rec = self.owner_record(rref_id)
            if fork_id in rec.deleted or fork_id in rec.forks:
                return
            if fork_id in rec.tombstones:  # its delete arrived first
                rec.tombstones.discard(fork_id)
                self._retire(rec, fork_id)
                return
            if holder in self.agent.failed:  # a fork for a rank that failed: never counted
                return
            rec.forks.add(fork_id)
            rec.holders[fork_id] = holder
            if pending:
                rec.pending.add(fork_id)

    def delete_fork(self, rref_id: int, fork_id: int) -> None:
        with self.lock:
            rec = self.owners.get(rref_id)
            if rec is None:
                if rref_id in self._freed_set:  # a repeated delete: nothing to do
                    return
                # the delete overtook the creation (or the fork request): remember it
                rec = self.owner_record(rref_id)
            if fork_id in rec.deleted:
                return
            if fork_id in rec.forks:
                self._retire(rec, fork_id)
            else:
                rec.tombstones.add(fork_id)
                self._maybe_free(rec)

    def accept_pending(self, rref_id: int, fork_id: int) -> None:
        with self.lock:
            rec = self.owners.get(rref_id)
            if rec is not None:
                rec.pending.discard(fork_id)

    def add_local_handle(self, rref_id: int, from_pending_fork: int | None = None) -> None:
        with self.lock:
            rec = self.owner_record(rref_id)
            rec.local_handles += 1
            if from_pending_fork is not None and from_pending_fork in rec.forks:
                self._retire(rec, from_pending_fork)

    def drop_local_handle(self, rref_id: int) -> None:
        with self.lock:
            rec = self.owners.get(rref_id)
            if rec is not None:
                rec.local_handles -= 1
                self._maybe_free(rec)

    def _retire(self, rec: OwnerRecord, fork_id: int) -> None:
        """The fork no longer counts; remember it so repeated messages are ignored."""
        rec.forks.discard(fork_id)
        rec.pending.discard(fork_id)
        rec.holders.pop(fork_id, None)
        rec.deleted.add(fork_id)
        self._maybe_free(rec)

    def _maybe_free(self, rec: OwnerRecord) -> None:
        if not rec.created or rec.forks or rec.tombstones or rec.local_handles > 0:
            return
        if self.owners.pop(rec.rref_id, None) is not None:
            if len(self._freed) == self._freed.maxlen:
                self._freed_set.discard(self._freed[0])
            self._freed.append(rec.rref_id)
            self._freed_set.add(rec.rref_id)

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
                    self.drop_local_handle(rref_id)
                else:
                    self.release_user(fork_id)
            finally:
                with self.lock:
                    self.releasing -= 1

    # -------------------------------------------------------------- user side
    def add_user(self, rref_id: int, fork_id: int, owner: int, confirmed: bool) -> UserRecord:
        with self.lock:
            rec = self.users.get(fork_id)
            if rec is None:
                rec = self.users[fork_id] = UserRecord(rref_id, fork_id, owner, confirmed)
            return rec

    def confirm_user(self, fork_id: int, error: BaseException | None = None) -> None:
        with self.lock:
            rec = self.users.get(fork_id)
            if rec is not None:
                rec.confirmed = True
                if isinstance(error, RemoteBaseException):  # to_here() raises SystemExit &co.
                    error = error.exception
                if error is not None:
                    rec.creation_error = frameless(error, self.agent.where())
                self._maybe_delete_user(rec)
        self.agent.engine.wake_waiters()  # a call may wait for its RRef arguments

    def child_accepted(self, parent_fork: int, child_fork: int) -> None:
        with self.lock:
            rec = self.users.get(parent_fork)
            if rec is not None:
                rec.pending_children.discard(child_fork)
                self._maybe_delete_user(rec)

    def release_user(self, fork_id: int) -> None:
        """The Python handle of a user fork is gone."""
        with self.lock:
            rec = self.users.get(fork_id)
            if rec is not None:
                rec.released = True
                self._maybe_delete_user(rec)

    def _maybe_delete_user(self, rec: UserRecord) -> None:
        # G2: not before every child forked from this user is confirmed by the owner. The
        # delete may overtake the remote() that made the value (the owner then keeps a
        # tombstone for it); a failed creation's fork is counted too and is dropped alike
        if not rec.released or rec.pending_children or rec.delete_sent:
            return
        rec.delete_sent = True
        self.users.pop(rec.fork_id, None)
        self.send(rec.owner, self._user_delete, rec.rref_id, rec.fork_id)

    # ------------------------------------------------------------ failed ranks
    def _on_peer_failed(self, rank: int) -> None:
        """``rank`` failed: its forks of this rank's values no longer count (the values
        are freed when nothing else holds them), and this rank's forks of values it owned
        are dropped (using them raises ``WorkerFailedError``; nothing is sent for them)."""
        with self.lock:
            for rec in list(self.owners.values()):
                for fork_id in [f for f, holder in rec.holders.items() if holder == rank]:
                    self._retire(rec, fork_id)
            for fork_id in [f for f, rec in self.users.items() if rec.owner == rank]:
                rec = self.users.pop(fork_id)
                rec.delete_sent = True

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
        with self.lock:
            live = [rec for rec in self.users.values() if not rec.released]
            for rec in live:
                rec.released = True
            for rec in list(self.users.values()):
                rec.pending_children.clear()
                self._maybe_delete_user(rec)
        if live:
            log.warning("%s: %d user RRef(s) still referenced at shutdown were released "
                        "(their owners free the values)", self.agent.where(), len(live))

    def debug_info(self) -> dict[str, int]:
        self.process_releases()
        with self.lock:
            return {
                "num_owner_rrefs": len(self.owners),
                "num_forks": sum(len(r.forks) for r in self.owners.values()),
                "num_pending_users": sum(len(r.pending) for r in self.owners.values())
                + sum(1 for r in self.users.values() if not r.confirmed),
                "num_pending_children": sum(len(r.pending_children)
                                            for r in self.users.values()),
                "num_user_rrefs": len(self.users),
                "num_tombstones": sum(len(r.tombstones) for r in self.owners.values()),
            }


    def stuck_owners(self) -> list[int]:
        """Ids of owner records that still count user forks (after a graceful shutdown:
        a protocol message was lost)."""
        with self.lock:
            return [rec.rref_id for rec in self.owners.values() if rec.forks or rec.tombstones]

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
            self.register_fork(rref_id, child, dst, pending=True)
            scope.on_failure(lambda: self.delete_fork(rref_id, child))
        else:  # a user forks: keep this user alive until the owner confirms the child (G2)
            with self.lock:
                rec = self.users.get(fork_id)
                if rec is None or rec.delete_sent:
                    raise RPCError(f"{handle!r} was already deleted")
                rec.pending_children.add(child)
            scope.on_failure(lambda: self.child_accepted(fork_id, child))
        return rref_id, handle._owner, child, self.rank, fork_id

    def _rebuild_handle(self, state: tuple) -> RRefHandle:
        """Unpickle a handle on this rank and start its protocol steps."""
        rref_id, owner, child, parent_rank, parent_fork = state
        me = self.rank
        if me == owner:
            # back at the owner: a local handle; a pending fork of the owner's is consumed
            self.add_local_handle(rref_id,
                                  from_pending_fork=child if parent_fork is None else None)
            if parent_fork is not None:
                self.send(parent_rank, self._child_accept, parent_fork, child)
            return self._handle(rref_id, owner, None)
        if parent_fork is None:  # sent by the owner, which already counts this fork
            self.add_user(rref_id, child, owner, confirmed=True)
            self.send(owner, self._user_accept, rref_id, child)
        else:  # sent by another user: ask the owner to count it
            rec = self.add_user(rref_id, child, owner, confirmed=False)
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
        return self._handle(self.create_local_record(value), self.rank, None)

    def remote(self, dst: int, func: Callable, args: tuple, kwargs: dict,
               timeout: float) -> RRefHandle:
        """Run ``func(*args, **kwargs)`` on ``dst``; a handle to the result, at once."""
        agent = self.agent
        rref_id = self.ids.next()
        if dst == self.rank:
            with self.lock:
                self.owner_record(rref_id).local_handles += 1
            handle = self._handle(rref_id, dst, None)
            fut = agent.call(dst, self._create, (rref_id, None, func, args, kwargs), {},
                             timeout)
            fut.add_internal_callback(lambda f: self._creation_timeout(rref_id, f))
            handle._creation_future = fut
            return handle
        fork_id = self.ids.next()
        self.add_user(rref_id, fork_id, dst, confirmed=False)
        handle = self._handle(rref_id, dst, fork_id)
        fut = agent.call(dst, self._create, (rref_id, fork_id, func, args, kwargs), {},
                         timeout)
        fut.add_internal_callback(lambda f: self.confirm_user(fork_id, error=future_error(f)))
        handle._creation_future = fut
        return handle

    def _creation_timeout(self, rref_id: int, fut: torch.futures.Future) -> None:
        error = future_error(fut)
        if error is not None:  # the call itself failed (e.g. timed out): fail the value
            self.finish_creation(rref_id, error=error)

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
        rec = self.existing_or_pending(rref_id)
        if rec is None:
            raise RPCError(f"the value of RRef 0x{rref_id:x} no longer exists on its owner "
                           f"{self.agent.info.name}")
        return self.agent.wait_for(rec.value)  # drives progress, raises a detached copy

    # ------------------------------------------------------------------ handlers
    def _on_fork_request(self, rref_id: int, fork_id: int, parent_rank: int,
                         parent_fork: int, child_rank: int) -> None:
        self.register_fork(rref_id, fork_id, child_rank)
        self.send(parent_rank, self._child_accept, parent_fork, fork_id)
        self.send(child_rank, self._fork_confirmed, fork_id)

    def _on_fetch(self, rref_id: int) -> torch.futures.Future:
        """On the owner: a future of the value, answered when the value exists."""
        rec = self.existing_or_pending(rref_id)
        if rec is None:
            fut = torch.futures.Future()
            fut.set_exception(RPCError(
                f"the value of RRef 0x{rref_id:x} no longer exists on its owner "
                f"{self.agent.info.name}: every reference to it was deleted"))
            return fut
        return rec.value

    def _fetch_detaches(self, rref_id: int) -> bool:
        """On the owner: how ``to_here()`` sends the value's parameters (torch's rule)."""
        rec = self.owners.get(rref_id)
        return True if rec is None else rec.detach_parameters

    def _run_on_owner(self, rref_id: int, creator_fork: int | None, func: Callable,
                      args: tuple, kwargs: dict) -> None:
        """On the owner: count the creator's fork, then run the function behind
        ``remote()`` and store its value or error."""
        if creator_fork is not None:  # made (by id) on the rank that called remote()
            self.register_fork(rref_id, creator_fork, self.ids.creator(creator_fork))
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
            self.finish_creation(rref_id, error=exc)
            raise exc  # the caller of remote() learns of it too
        self.finish_creation(rref_id, value=value,
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
