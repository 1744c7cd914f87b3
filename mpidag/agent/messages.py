"""Message kinds and header flags of the RPC protocol.

User calls carry ``(func, args, kwargs)`` pickled; a call of a module-level function
(:data:`FLAG_FUNCTION_REF`) carries the function's pickled reference as a prefix that the
receiver looks up in a table, and only ``(args, kwargs)`` pickled (nothing at all for a
call without arguments): pickling and unpickling a function by name cost ~1.3 us each, a
third of a no-op call's Python work on each side. Internal
protocols (RRef creation, fetch and deletion; gradient propagation; context release) name
a *handler* that their layer registered in the agent (:meth:`RpcAgent.register_handler
<mpidag.agent.agent.RpcAgent.register_handler>`): the header has :data:`FLAG_HANDLER` and the
payload's prefix is the handler's name, so the receiving agent runs its own layer's bound
method, with no pickled function and no global lookup. The header's ``context_id``
and ``message_id`` fields carry the distributed-autograd metadata of a message that
records send/recv functions.
"""

from __future__ import annotations

import enum
import struct

__all__ = ["CALL", "CONTROL", "ERROR", "FLAG_FUNCTION_REF", "FLAG_HANDLER", "FLAG_PLAIN",
           "FLAG_TENSOR_SLOTS", "NOTIFY",
           "REF_LENGTH", "RESULT", "Kind"]

#: header flag: the payload names a registered handler instead of carrying a function
FLAG_HANDLER = 1
#: header flag: the payload starts with a reference to a module-level function (its pickle
#: by name), which the receiver resolves once and then finds in a table
FLAG_FUNCTION_REF = 2
#: header flag: the pickle after the reference (a call's ``(args, kwargs)``) or the whole
#: payload (a result) holds plain values only (:func:`mpidag.transport.frames.is_plain`):
#: the receiver may unpickle it without the tensor table (the compiled path does)
FLAG_PLAIN = 4
#: header flag: the pickle after the reference is ``(args, kwargs, slots)``, ``args`` with
#: ``None`` where ``slots[i] >= 0`` names the message's tensor ``slots[i]`` (the compiled
#: path sends the dense CPU tensor arguments of a call this way, with no tensor pickler)
FLAG_TENSOR_SLOTS = 8

#: a payload with either flag is ``<u16 length><reference><pickle of (args, kwargs)>``;
#: the pickle is left out when both are empty
REF_LENGTH = struct.Struct("<H")


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


#: the message kinds as plain ints, for the hot paths: reading an enum member costs ~90 ns,
#: a module global ~20 ns
CALL, RESULT, ERROR, NOTIFY, CONTROL = (int(kind) for kind in (
    Kind.CALL, Kind.RESULT, Kind.ERROR, Kind.NOTIFY, Kind.CONTROL))
