"""The RPC agent: calls, futures, timeouts, replies, remote errors, internal handlers.

It knows nothing of RRefs or distributed autograd: those layers register their message
handlers, pickling rules and hooks in the agent they are given, and autograd observes calls
through :class:`~mpidag.agent.agent.CallObserver`.
"""

from mpidag.agent.agent import CallObserver, Handler, RpcAgent, RpcFuture
from mpidag.agent.messages import FLAG_HANDLER, Kind

__all__ = ["FLAG_HANDLER", "CallObserver", "Handler", "Kind", "RpcAgent", "RpcFuture"]
