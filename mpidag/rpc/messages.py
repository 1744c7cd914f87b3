"""Message kinds of the RPC protocol; every layer above speaks through these five.

Internal protocols (RRef creation, fetch and deletion; gradient propagation; context
release; optimizer steps) are calls of module-level mpidag functions: a ``CALL`` when an
answer is needed, a ``NOTIFY`` when not, a ``CONTROL`` for short non-blocking protocol steps
that must run in arrival order (RRef fork and delete messages). The header's
``context_id`` and ``message_id`` fields carry distributed-autograd metadata of a message
that records send/recv functions.
"""

from __future__ import annotations

import enum

__all__ = ["Kind"]


class Kind(enum.IntEnum):
    CALL = 1  #: payload (func, args, kwargs); answered by RESULT or ERROR
    RESULT = 2  #: payload: the return value
    ERROR = 3  #: payload: :func:`mpidag.errors.pack_exception` bytes
    NOTIFY = 4  #: payload (func, args, kwargs); no answer
    CONTROL = 5  #: like NOTIFY, but run at once by the receiving leader, in arrival order
