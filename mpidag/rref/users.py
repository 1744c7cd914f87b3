"""The user's side of the RRef protocol: one record per fork (reference to a value owned
elsewhere) that this rank holds, and when to tell the owner it is gone."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from mpidag.errors import RemoteBaseException, frameless

__all__ = ["UserRecord", "UserTable"]

#: ``send_delete(owner, rref_id, fork_id)``: tell the owner that a user fork is gone
DeleteSender = Callable[[int, int, int], None]


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


class UserTable:
    """The user forks of one rank, by fork id.

    A fork is deleted (``send_delete`` to its owner) once its Python handle is gone and
    every child forked from it is confirmed by the owner (guarantees G1 and G2).
    ``on_confirmed()`` runs after a fork is confirmed (a call may wait for its RRef
    arguments).

    Example::

        >>> sent = []
        >>> users = UserTable(threading.RLock(), lambda *a: sent.append(a), lambda: None,
        ...                   "worker0")
        >>> rec = users.add(rref_id=5, fork_id=6, owner=1, confirmed=True)
        >>> users.release(6)
        >>> sent
        [(1, 5, 6)]
    """

    def __init__(self, lock: threading.RLock, send_delete: DeleteSender,
                 on_confirmed: Callable[[], None], where: str) -> None:
        self.lock = lock
        self.records: dict[int, UserRecord] = {}
        self._send_delete = send_delete
        self._on_confirmed = on_confirmed
        self.where = where

    def get(self, fork_id: int) -> UserRecord | None:
        """The record of a fork this rank holds, or ``None``."""
        return self.records.get(fork_id)

    def add(self, rref_id: int, fork_id: int, owner: int, confirmed: bool) -> UserRecord:
        """Record a fork (once: a repeated message finds the first record)."""
        with self.lock:
            rec = self.records.get(fork_id)
            if rec is None:
                rec = self.records[fork_id] = UserRecord(rref_id, fork_id, owner, confirmed)
            return rec

    def confirm(self, fork_id: int, error: BaseException | None = None) -> None:
        """The owner counts the fork (``error``: the ``remote()`` that made it failed)."""
        with self.lock:
            rec = self.records.get(fork_id)
            if rec is not None:
                rec.confirmed = True
                if isinstance(error, RemoteBaseException):  # to_here() raises SystemExit &co.
                    error = error.exception
                if error is not None:
                    rec.creation_error = frameless(error, self.where)
                self._maybe_delete(rec)
        self._on_confirmed()

    def start_child(self, fork_id: int, child_fork: int) -> bool:
        """A child of this fork is being sent: keep the fork until the owner confirms the
        child (G2). False if the fork is already deleted."""
        with self.lock:
            rec = self.records.get(fork_id)
            if rec is None or rec.delete_sent:
                return False
            rec.pending_children.add(child_fork)
            return True

    def child_accepted(self, parent_fork: int, child_fork: int) -> None:
        """The owner confirmed a child of ``parent_fork`` (or its message was not sent)."""
        with self.lock:
            rec = self.records.get(parent_fork)
            if rec is not None:
                rec.pending_children.discard(child_fork)
                self._maybe_delete(rec)

    def release(self, fork_id: int) -> None:
        """The Python handle of a user fork is gone."""
        with self.lock:
            rec = self.records.get(fork_id)
            if rec is not None:
                rec.released = True
                self._maybe_delete(rec)

    def _maybe_delete(self, rec: UserRecord) -> None:
        # G2: not before every child forked from this user is confirmed by the owner. The
        # delete may overtake the remote() that made the value (the owner then keeps a
        # tombstone for it); a failed creation's fork is counted too and is dropped alike
        if not rec.released or rec.pending_children or rec.delete_sent:
            return
        rec.delete_sent = True
        self.records.pop(rec.fork_id, None)
        self._send_delete(rec.owner, rec.rref_id, rec.fork_id)

    def drop_forks_owned_by(self, rank: int) -> None:
        """``rank`` failed: its values' forks here are dropped; nothing is sent for them."""
        with self.lock:
            for fork_id in [f for f, rec in self.records.items() if rec.owner == rank]:
                self.records.pop(fork_id).delete_sent = True

    def release_all(self) -> int:
        """Shutdown: release every fork (children pending or not); returns how many still
        had a live Python handle."""
        with self.lock:
            live = [rec for rec in self.records.values() if not rec.released]
            for rec in live:
                rec.released = True
            for rec in list(self.records.values()):
                rec.pending_children.clear()
                self._maybe_delete(rec)
        return len(live)

    def counts(self) -> dict[str, int]:
        """User forks, those not confirmed yet, and children waiting for the owner."""
        with self.lock:
            records = self.records.values()
            return {
                "num_user_rrefs": len(records),
                "num_unconfirmed_users": sum(1 for r in records if not r.confirmed),
                "num_pending_children": sum(len(r.pending_children) for r in records),
            }
