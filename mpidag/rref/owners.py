"""The owner's side of the RRef protocol: one record per value this rank owns, the forks
(user references on other ranks) it counts, and when the value can be freed."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from mpidag._ids import IdGenerator
from mpidag.agent.futures import RpcFuture
from mpidag.errors import frameless, storable

__all__ = ["FREED_MEMORY", "OwnerRecord", "OwnerTable"]

#: how many freed RRef ids an owner remembers to recognise repeated protocol messages
FREED_MEMORY = 1 << 16


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

    @property
    def shared(self) -> bool:
        """Referenced from another rank, or still being made (torch's owner RRefs)."""
        return bool(self.forks or self.tombstones or not self.created)


class OwnerTable:
    """The owner records of one rank. Every step is idempotent: protocol messages may
    arrive late, repeated or reordered (a delete before the fork it deletes leaves a
    tombstone that the registration consumes).

    ``lock``: the RRef context's lock (held by the caller of the underscored methods);
    ``failed``: the ranks that failed (a fork for one is never counted).

    Example::

        >>> table = OwnerTable(threading.RLock(), IdGenerator(0, 2), set(), "worker0")
        >>> rref_id = table.create_local_record(torch.ones(2))
        >>> table.register_fork(rref_id, fork_id=7, holder=1)
        >>> table.counts()["num_forks"]
        1
    """

    def __init__(self, lock: threading.RLock, ids: IdGenerator, failed: set[int],
                 where: str) -> None:
        self.lock = lock
        self.ids = ids
        self.failed = failed
        self.where = where
        self.records: dict[int, OwnerRecord] = {}
        #: ids of freed owner records, so a repeated message is not taken for an early one
        self._freed: collections.deque[int] = collections.deque(maxlen=FREED_MEMORY)
        self._freed_set: set[int] = set()

    def record(self, rref_id: int) -> OwnerRecord:
        """Get or make the record (call under the lock): protocol messages may arrive
        before the creation."""
        rec = self.records.get(rref_id)
        if rec is None:
            rec = self.records[rref_id] = OwnerRecord(rref_id)
        return rec

    def existing_or_pending(self, rref_id: int) -> OwnerRecord | None:
        """The record, made if its creation has not run yet; ``None`` if already freed.

        A fetch can overtake the ``remote()`` call that creates the value: both are
        dispatched in order but run on different pool threads.
        """
        with self.lock:
            if rref_id in self._freed_set:
                return None
            return self.record(rref_id)

    def create_local_record(self, value: Any) -> int:
        """An owner record holding ``value`` at once (``RRef(value)``); returns its id."""
        rref_id = self.ids.next()
        with self.lock:
            rec = self.record(rref_id)
            rec.value.set_result(value)
            rec.created = True
            rec.detach_parameters = not isinstance(value, torch.Tensor)
            rec.local_handles += 1
        return rref_id

    def finish_creation(self, rref_id: int, value: Any = None,
                        error: BaseException | None = None,
                        detach_parameters: bool = True) -> None:
        """The function behind ``remote()`` returned ``value`` or raised ``error``."""
        if error is not None:
            error = frameless(error, self.where)
        with self.lock:
            rec = self.record(rref_id)
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
        """Count the fork ``fork_id`` held by rank ``holder`` (``pending``: sent by this
        owner, not accepted yet)."""
        with self.lock:
            rec = self.record(rref_id)
            if fork_id in rec.deleted or fork_id in rec.forks:
                return
            if fork_id in rec.tombstones:  # its delete arrived first
                rec.tombstones.discard(fork_id)
                self._retire(rec, fork_id)
                return
            if holder in self.failed:  # a fork for a rank that failed: never counted
                return
            rec.forks.add(fork_id)
            rec.holders[fork_id] = holder
            if pending:
                rec.pending.add(fork_id)

    def delete_fork(self, rref_id: int, fork_id: int) -> None:
        """The fork is gone (``user_delete``), possibly before it was registered."""
        with self.lock:
            rec = self.records.get(rref_id)
            if rec is None:
                if rref_id in self._freed_set:  # a repeated delete: nothing to do
                    return
                # the delete overtook the creation (or the fork request): remember it
                rec = self.record(rref_id)
            if fork_id in rec.deleted:
                return
            if fork_id in rec.forks:
                self._retire(rec, fork_id)
            else:
                rec.tombstones.add(fork_id)
                self._maybe_free(rec)

    def accept_pending(self, rref_id: int, fork_id: int) -> None:
        """The rank this owner sent the fork to accepted it (``user_accept``)."""
        with self.lock:
            rec = self.records.get(rref_id)
            if rec is not None:
                rec.pending.discard(fork_id)

    def add_local_handle(self, rref_id: int, from_pending_fork: int | None = None) -> None:
        """A Python handle on the owner (``from_pending_fork``: a fork sent back home)."""
        with self.lock:
            rec = self.record(rref_id)
            rec.local_handles += 1
            if from_pending_fork is not None and from_pending_fork in rec.forks:
                self._retire(rec, from_pending_fork)

    def drop_local_handle(self, rref_id: int) -> None:
        """A Python handle on the owner is gone."""
        with self.lock:
            rec = self.records.get(rref_id)
            if rec is not None:
                rec.local_handles -= 1
                self._maybe_free(rec)

    def drop_forks_of(self, rank: int) -> None:
        """``rank`` failed: its forks no longer count (values nothing else holds are freed)."""
        with self.lock:
            for rec in list(self.records.values()):
                for fork_id in [f for f, holder in rec.holders.items() if holder == rank]:
                    self._retire(rec, fork_id)

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
        if self.records.pop(rec.rref_id, None) is not None:
            if len(self._freed) == self._freed.maxlen:
                self._freed_set.discard(self._freed[0])
            self._freed.append(rec.rref_id)
            self._freed_set.add(rec.rref_id)

    def detaches(self, rref_id: int) -> bool:
        """How ``to_here()`` sends the value's parameters (torch's rule)."""
        rec = self.records.get(rref_id)
        return True if rec is None else rec.detach_parameters

    # ------------------------------------------------------------------ views
    def counts(self) -> dict[str, int]:
        """Owner records, the forks they count, forks not accepted yet, tombstones, and
        the shared records (torch's ``num_owner_rrefs``)."""
        with self.lock:
            records = self.records.values()
            return {
                "num_owner_rrefs": len(records),
                "num_forks": sum(len(r.forks) for r in records),
                "num_pending_forks": sum(len(r.pending) for r in records),
                "num_tombstones": sum(len(r.tombstones) for r in records),
                "num_shared": sum(1 for r in records if r.shared),
            }

    def stuck(self) -> list[int]:
        """Ids of records that still count forks (after a graceful shutdown: a protocol
        message was lost)."""
        with self.lock:
            return [rec.rref_id for rec in self.records.values() if rec.forks or rec.tombstones]
