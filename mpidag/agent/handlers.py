"""What the layers above plug into the agent: named handlers, a call observer, hooks.

The agent knows nothing of RRefs or distributed autograd. Those layers register
:class:`Handler` objects for their internal messages, one :class:`CallObserver` that sees
every call (autograd records send/recv functions through it) and a few hooks; the
:class:`Plugins` registry holds them for the agent's parts (calls, serving, quiescence).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.jit._builtins import _find_builtin

from mpidag.errors import RPCError
from mpidag.transport.frames import Envelope

__all__ = ["NO_OBSERVER", "CallObserver", "Handler", "Plugins", "describe",
           "detaches_parameters", "is_asynchronous"]


@dataclass(slots=True, eq=False)
class Handler:
    """An internal message handler registered by a layer above the agent.

    ``fn(*args, **kwargs)`` runs on the receiving rank; for ``mode="call"`` its result (or,
    with ``asynchronous``, the value of the ``torch.futures.Future`` it returns, or any
    other value it returns, answered at once) is the answer. ``describe(*args)`` names the
    call in errors and profiles; ``detaches(*args)`` applies torch's parameter rule of the
    user's call the message carries.

    Example::

        >>> Handler("rref.fetch", print, asynchronous=True).mode
        'call'
    """

    name: str
    fn: Callable[..., Any]
    mode: str = "call"  # "call" (answered), "notify" (pool, no answer), "control" (leader)
    asynchronous: bool = False
    describe: Callable[..., str] | None = None
    detaches: Callable[..., bool] | None = None
    #: ``profile_as(*args)``: (exec mode or None, name) of the user's call in a profile
    profile_as: Callable[..., tuple[str | None, str]] | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("call", "notify", "control"):
            raise ValueError(f"handler mode must be 'call', 'notify' or 'control', got "
                             f"{self.mode!r}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def is_asynchronous(func: Any) -> bool:
    """Whether ``func`` answers with a future: an asynchronous handler, or a function
    decorated with ``@rpc.functions.async_execution``.

    Example::

        >>> is_asynchronous(torch.add)
        False
    """
    if type(func) is Handler:
        return func.asynchronous
    return getattr(func, "_wrapped_async_rpc_function", None) is not None


def detaches_parameters(func: Any, args: tuple) -> bool:
    """torch's rule for the ``nn.Parameter`` objects a call carries (arguments and result).

    torch pickles the arguments and results of Python functions, and ``Parameter`` pickles
    as its detached data (a new leaf on arrival); torch builtin ops (``torch.add``) travel
    as TorchScript values, parameters attached. mpidag's internal handlers (``remote``,
    ``to_here``) apply the rule of the user's call they carry (``Handler.detaches``).

    Example::

        >>> detaches_parameters(describe, ()), detaches_parameters(torch.add, ())
        (True, False)
    """
    if isinstance(func, Handler) and func.detaches is not None:
        return func.detaches(*args)
    return _find_builtin(func) is None


#: names of module-level functions and builtins (``torch.add``), which live as long as their
#: modules: each call in an autograd context names its messages four times (the compiled
#: path's message names read this same dict before they call :func:`describe`)
DESCRIBED: dict[Any, str] = {}
_DESCRIBED_MAX = 4096
_NAMED_TYPES = (types.BuiltinFunctionType, types.FunctionType)


def describe(func: Any, args: tuple | None = None) -> str:
    """A readable name of a called function; mpidag's internal handlers (``remote``,
    ``to_here``, RRef proxies) describe the user's call they carry (``Handler.describe``).

    Example::

        >>> describe(torch.sin), describe(Handler("rref.fetch", print))
        ('torch.sin', 'mpidag:rref.fetch')
    """
    try:
        name = DESCRIBED.get(func)
    except TypeError:  # unhashable
        name = None
    if name is not None:
        return name
    name = _describe(func, args)
    if _lives_with_its_module(func):
        if len(DESCRIBED) >= _DESCRIBED_MAX:  # functions made at run time: start over
            DESCRIBED.clear()
        DESCRIBED[func] = name
    return name


def _lives_with_its_module(func: Any) -> bool:
    """A plain function defined at a module's top level, or a builtin of a module or a class
    (not a lambda, a function defined in a function, or a method bound to an object: the
    name cache must not keep those, or what they hold, alive)."""
    if type(func) not in _NAMED_TYPES or "<" in getattr(func, "__qualname__", "<"):
        return False
    owner = getattr(func, "__self__", None)
    return owner is None or isinstance(owner, (types.ModuleType, type))


def _describe(func: Any, args: tuple | None) -> str:
    if isinstance(func, Handler):
        if func.describe is not None and args is not None:
            try:
                return func.describe(*args)
            except Exception:
                pass
        return f"mpidag:{func.name}"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    module = getattr(func, "__module__", None)
    if name and name.startswith("_VariableFunctionsClass."):  # torch.add & co.: as written
        name = name[len("_VariableFunctionsClass."):]
    return f"{module}.{name}" if module and name else repr(func)


class CallObserver:
    """How a layer above sees the agent's messages (distributed autograd's interface).

    The agent calls these from the threads that send and receive; this base class observes
    nothing. ``active`` is false while the observer has nothing to record in outgoing
    requests (no context on this rank): the agent then skips :meth:`outgoing` altogether.

    Example::

        >>> CallObserver().outgoing(1, [], lambda: "a call")   # outside any context
        (0, 0)
    """

    active = False

    def outgoing(self, dst: int, tensors: list[torch.Tensor],
                 what: Callable[[], str]) -> tuple[int, int]:
        """A request from this thread to ``dst`` is being sent: its header's
        ``(context_id, message_id)``, ``(0, 0)`` outside any context."""
        return 0, 0

    def replying(self, context_id: int, dst: int, tensors: list[torch.Tensor],
                 what: Callable[[], str]) -> int:
        """A reply in ``context_id`` is being sent to ``dst``: its message id (0: none)."""
        return 0

    def sent(self, context_id: int, message_id: int) -> None:
        """A message that got a message id left this rank."""

    def received(self, env: Envelope, what: Callable[[], str]) -> Any:
        """A message with a ``context_id`` arrived: record it (may replace ``env.tensors``);
        returns the state to serve its call in (see :meth:`serving`), or ``None``."""
        return None

    def serving(self, state: Any, message_id: int, what: Callable[[], str]) -> Any:
        """The call of a received message is about to run in ``state``; returns a token
        for :meth:`served`."""
        return None

    def served(self, token: Any) -> None:
        """The call that :meth:`serving` announced returned."""


#: the observer of an agent that no layer observes
NO_OBSERVER = CallObserver()

#: ``(begin, end)`` run around unpickling a call's arguments (see :meth:`Plugins.add_hooks`)
ArgumentsHook = tuple[Callable[[], None], Callable[[], Callable[[], bool] | None]]


class Plugins:
    """The registry of what the layers above plugged into one agent.

    Example::

        >>> plugins = Plugins("worker0 (rank 0 of 2)")
        >>> fetch = plugins.register("rref.fetch", print)
        >>> plugins.named("rref.fetch") is fetch
        True
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self.handlers: dict[str, Handler] = {}
        self.observer: CallObserver = NO_OBSERVER
        #: (queue, hook): the leader calls hook() after a poll while the queue is not empty
        self.tick_hooks: list[tuple[Any, Callable[[], None]]] = []
        #: extra "this rank is not idle" conditions for the quiescence test
        self.busy_checks: list[Callable[[], bool]] = []
        #: called as hook() before a graceful shutdown's final quiescence (RRefs)
        self.shutdown_hooks: list[Callable[[], None]] = []
        #: (begin, end) around unpickling a call's arguments, or None
        self.arguments_hook: ArgumentsHook | None = None
        #: called as listener(rank) when a rank failed, after its pending calls failed
        self.failure_listeners: list[Callable[[int], None]] = []

    def register(self, name: str, fn: Callable[..., Any], *, mode: str = "call",
                 asynchronous: bool = False, describe: Callable[..., str] | None = None,
                 detaches: Callable[..., bool] | None = None,
                 profile_as: Callable[..., tuple[str | None, str]] | None = None) -> Handler:
        """Register ``fn`` as the handler of internal messages named ``name`` (see
        :meth:`mpidag.agent.agent.RpcAgent.register_handler`)."""
        if name in self.handlers:
            raise ValueError(f"a handler named {name!r} is already registered")
        handler = Handler(name, fn, mode, asynchronous, describe, detaches, profile_as)
        self.handlers[name] = handler
        return handler

    def named(self, name: str) -> Handler:
        """The handler registered as ``name``; a message naming an unknown one is an error
        of the job (ranks that run different code)."""
        handler = self.handlers.get(name)
        if handler is None:
            raise RPCError(f"{self.where} has no internal handler {name!r} (known: "
                           f"{sorted(self.handlers)}): do the ranks run different mpidag "
                           f"versions?")
        return handler

    def set_observer(self, observer: CallObserver) -> None:
        """Let ``observer`` see every call, reply and received message (one observer)."""
        if self.observer is not NO_OBSERVER and observer is not self.observer:
            raise RuntimeError("the agent already has a call observer")
        self.observer = observer

    def add_hooks(self, *, tick: Callable[[], None] | None = None, tick_queue: Any = None,
                  busy: Callable[[], bool] | None = None,
                  before_shutdown: Callable[[], None] | None = None,
                  arguments: ArgumentsHook | None = None) -> None:
        """See :meth:`mpidag.agent.agent.RpcAgent.add_hooks`."""
        if tick is not None:
            if tick_queue is None:
                raise ValueError("a tick hook needs the queue that tells when it has work")
            self.tick_hooks.append((tick_queue, tick))
        if busy is not None:
            self.busy_checks.append(busy)
        if before_shutdown is not None:
            self.shutdown_hooks.append(before_shutdown)
        if arguments is not None:
            if self.arguments_hook is not None:
                raise RuntimeError("the agent already has an arguments hook")
            self.arguments_hook = arguments

    def any_busy(self) -> bool:
        """Whether a layer still has work the termination test must wait for."""
        return any(check() for check in self.busy_checks)
