"""Message kinds and header flags of the RPC protocol.

User calls carry ``(func, args, kwargs)`` with the function pickled by reference. Internal
protocols (RRef creation, fetch and deletion; gradient propagation; context release) name
a *handler* that their layer registered in the agent (:meth:`RpcAgent.register_handler
<mpidag.agent.agent.RpcAgent.register_handler>`): the header has :data:`FLAG_HANDLER` and the
payload is ``(handler name, args, kwargs)``, so the receiving agent runs its own layer's
bound method, with no pickled function and no global lookup. The header's ``context_id``
and ``message_id`` fields carry the distributed-autograd metadata of a message that
records send/recv functions.
"""

from __future__ import annotations

import enum

__all__ = ["FLAG_HANDLER", "Kind"]

#: header flag: the payload names a registered handler instead of carrying a function
FLAG_HANDLER = 1


class Kind(enum.IntEnum):
    """The five message kinds.

    Example::

        >>> Kind.CALL, Kind(5)
        (<Kind.CALL: 1>, <Kind.CONTROL: 5>)
    """

    CALL = 1  #: payload (func or handler, args, kwargs); answered by RESULT or ERROR
    RESULT = 2  #: payload: the return value
    ERROR = 3  #: payload: :func:`mpidag.errors.pack_exception` bytes
    NOTIFY = 4  #: payload (func or handler, args, kwargs); no answer
    CONTROL = 5  #: a handler run at once by the receiving leader, in arrival order
