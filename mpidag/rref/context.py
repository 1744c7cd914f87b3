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

All protocol messages are ``CONTROL`` messages (run by the receiving leader in arrival
order, never blocking). They may still arrive late or reordered (delays can be injected in
tests): a delete that arrives before the fork it deletes leaves a *tombstone* that the
registration consumes, and repeated messages are ignored, so every step is idempotent.
"""

from __future__ import annotations

import collections
import gc
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from mpidag.errors import frameless
from mpidag.rpc.agent import RpcFuture

if TYPE_CHECKING:
    from mpidag.rpc.agent import RpcAgent

__all__ = ["RRefContext", "OwnerRecord", "UserRecord"]

#: how many freed RRef ids an owner remembers to recognise repeated protocol messages
FREED_MEMORY = 1 << 16

log = logging.getLogger(__name__)


@dataclass(slots=True)
class OwnerRecord:
    """The owner's state of one RRef."""

    rref_id: int
    value: RpcFuture = field(default_factory=RpcFuture)
    forks: set[int] = field(default_factory=set)  # user forks counted (confirmed or pending)
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
    """Owner and user tables of one agent, and the protocol steps on them."""

    def __init__(self, agent: RpcAgent) -> None:
        self.agent = agent
        self.rank = agent.rank
        self.owners: dict[int, OwnerRecord] = {}
        self.users: dict[int, UserRecord] = {}  # by fork id
        self.lock = threading.RLock()
        #: (rref_id, fork_id or None) of handles Python freed, for the leader to process
        self.releases: collections.deque[tuple[int, int | None]] = collections.deque()
        self.releasing = 0  # releases taken off the queue whose messages are not sent yet
        #: ids of freed owner records, so a repeated message is not taken for an early one
        self._freed: collections.deque[int] = collections.deque(maxlen=FREED_MEMORY)
        self._freed_set: set[int] = set()

    @classmethod
    def of(cls, agent: RpcAgent) -> RRefContext:
        """The agent's context, made (and hooked into its shutdown) on first use."""
        ctx = getattr(agent, "rref_context", None)
        if ctx is None:
            with _make_lock:
                ctx = getattr(agent, "rref_context", None)
                if ctx is None:
                    ctx = cls(agent)
                    agent.rref_context = ctx
                    agent.shutdown_hooks.append(ctx.release_all_users)
                    agent.tick_hooks.append(ctx.process_releases)
                    agent.busy_checks.append(lambda: bool(ctx.releases) or ctx.releasing > 0)
        return ctx

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

    def create_local(self, value: Any) -> int:
        """An owner record holding ``value`` at once (``RRef(value)``); returns its id."""
        rref_id = self.agent.ids.next()
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
        else:
            fut.set_exception(error)

    def register_fork(self, rref_id: int, fork_id: int, pending: bool = False) -> None:
        with self.lock:
            rec = self.owner_record(rref_id)
            if fork_id in rec.deleted or fork_id in rec.forks:
                return
            if fork_id in rec.tombstones:  # its delete arrived first
                rec.tombstones.discard(fork_id)
                self._retire(rec, fork_id)
                return
            rec.forks.add(fork_id)
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
                if error is not None:
                    rec.creation_error = frameless(error, self.agent.where())
                self._maybe_delete_user(rec)

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
        # G2: not before every child forked from this user is confirmed by the owner;
        # and not before the owner answered the remote() that made it (a failed creation
        # left no value to delete but the fork must still be dropped on the owner)
        if not rec.released or rec.pending_children or rec.delete_sent:
            return
        rec.delete_sent = True
        self.users.pop(rec.fork_id, None)
        self.send(rec.owner, _on_user_delete, rec.rref_id, rec.fork_id)

    # --------------------------------------------------------------- messages
    def send(self, dst: int, func: Any, *args: Any) -> None:
        agent = self.agent
        if not agent.running:
            return
        try:
            agent.notify(dst, func, args, control=True)
        except Exception:
            log.exception("could not send RRef protocol message %s to rank %d",
                          func.__name__, dst)

    # --------------------------------------------------------------- shutdown
    def release_all_users(self, agent: RpcAgent) -> None:
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
                        "(their owners free the values)", agent.where(), len(live))

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


_make_lock = threading.Lock()


# ------------------------------------------------------ protocol message handlers
# Module-level functions so they pickle by reference; each runs on the receiving leader.

def _ctx() -> RRefContext:
    from mpidag.rpc.api import current_agent

    return RRefContext.of(current_agent())


def _on_user_delete(rref_id: int, fork_id: int) -> None:
    _ctx().delete_fork(rref_id, fork_id)


def _on_user_accept(rref_id: int, fork_id: int) -> None:
    _ctx().accept_pending(rref_id, fork_id)


def _on_fork_request(rref_id: int, fork_id: int, parent_rank: int, parent_fork: int,
                     child_rank: int) -> None:
    ctx = _ctx()
    ctx.register_fork(rref_id, fork_id)
    ctx.send(parent_rank, _on_child_accept, parent_fork, fork_id)
    ctx.send(child_rank, _on_fork_confirmed, fork_id)


def _on_child_accept(parent_fork: int, child_fork: int) -> None:
    _ctx().child_accepted(parent_fork, child_fork)


def _on_fork_confirmed(fork_id: int) -> None:
    _ctx().confirm_user(fork_id)
