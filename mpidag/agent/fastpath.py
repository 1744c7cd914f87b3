"""The agent's path of a plain call in C (``_mpidag_fastpath``, ``fastpath.c``), and the
message counters that C and Python share.

A *plain* call names a module-level function or handler whose reference the caller's codec
already made, has no keyword arguments, carries and returns only plain values (see
:func:`mpidag.transport.frames.is_plain`, and dense contiguous CPU tensors small enough for
frame 0), and is made outside any profiler. For those the compiled :class:`Core` does, in C, what
:meth:`OutgoingCalls.send_call <mpidag.agent.calls.OutgoingCalls.send_call>`, the agent's
dispatch, :meth:`Server.serve_call <mpidag.agent.serving.Server.serve_call>` and
:meth:`OutgoingCalls.complete <mpidag.agent.calls.OutgoingCalls.complete>` do in Python:
the same ``PendingCall`` and ``Envelope`` objects, the same bytes on the wire (the header
flag :data:`~mpidag.agent.messages.FLAG_PLAIN` says the pickle holds plain values only; the
module writes those pickles itself, and the Python encoder uses its writer too:
:func:`mpidag.agent.encoding.pickle_plain`),
the same message counters, the same errors. Inside a distributed autograd context it calls
the agent's call observer where the Python path does (``outgoing``/``sent`` on the caller,
``received`` at dispatch and ``serving``/``served`` around the function on the callee,
``replying``/``sent`` for a result with tensors, and ``received`` for that result on the
caller), so a call records the same send and recv functions on either
path. An asynchronous handler (:class:`~mpidag.agent.handlers.Handler` with
``asynchronous=True``) is served here too: its future's value is the answer when it has
one, else ``Server.answer_when_done`` answers later, through ``Core.reply`` (the agent's
``Server.answer``). Anything else goes untouched to the Python
code, which also raises every error a user sees. Its ``step(wait)`` is also the progress
engine's leader step (:meth:`ProgressEngine.set_step
<mpidag.transport.progress.ProgressEngine.set_step>`): the after-poll hook, one poll through
the transport's published probe and the C frame-0 decoder, and the dispatch, in one call.

:func:`mpidag.agent.compiled.make_core` gives the ``Core`` of an agent's parts, or ``None``
(the Python path) when ``MPIDAG_COMPILED=0`` asks for it, when the module is not built, or
when it was built from other sources; the agent's ``call_path`` says which and why.

Example::

    >>> counters = make_counters(2, compiled=False)
    >>> counters.sent(1); counters.answered(1)
    >>> counters.totals(set()), counters.sent_total
    ((2, 1), 2)
"""

from __future__ import annotations

import threading
from typing import Any

from mpidag.agent import messages
from mpidag.transport.doorbell import Doorbell
from mpidag.transport.wire import import_built

__all__ = ["FASTPATH_VERSION", "PythonCounters", "compiled_module", "make_counters",
           "new_doorbell", "problem"]

#: the ``VERSION`` of ``fastpath.c`` this code calls (a build from older sources is not used)
FASTPATH_VERSION = 16

def _load() -> tuple[Any, str]:
    module, why = import_built("_mpidag_fastpath", FASTPATH_VERSION, "Python call path")
    if module is None:
        return None, why
    ours = (module.CALL, module.RESULT, module.NOTIFY, module.CONTROL, module.FLAG_HANDLER,
            module.FLAG_FUNCTION_REF, module.FLAG_PLAIN, module.FLAG_TENSOR_SLOTS)
    theirs = (messages.CALL, messages.RESULT, messages.NOTIFY, messages.CONTROL,
              messages.FLAG_HANDLER, messages.FLAG_FUNCTION_REF, messages.FLAG_PLAIN,
              messages.FLAG_TENSOR_SLOTS)
    if ours != theirs:
        return None, (f"Python call path: {module.__file__} has other protocol constants "
                      f"({ours} vs {theirs}); rebuild it")
    return module, f"compiled call path ({module.__file__})"


_module, _problem = _load()


def compiled_module() -> Any:
    """The C module, or ``None`` when it is not built (or built from other sources).

    Example::

        >>> compiled_module() is None or compiled_module().VERSION == FASTPATH_VERSION
        True
    """
    return _module


def problem() -> str:
    """Why the C module is not used (when :func:`compiled_module` is ``None``)."""
    return _problem


class PythonCounters:
    """The per-peer message counts of the shutdown's termination test, in Python (the
    compiled path's ``Counters`` has the same methods, each atomic under the GIL).

    Example::

        >>> counters = PythonCounters(2)
        >>> counters.sent(1); counters.unsent(1); counters.processed(0)
        >>> counters.sent_total, counters.processed_total
        (0, 1)
    """

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self._sent_to = [0] * world_size
        self._processed_from = [0] * world_size
        self._lock = threading.Lock()

    def sent(self, rank: int) -> None:
        """A message was sent to ``rank``."""
        with self._lock:
            self._sent_to[rank] += 1

    def unsent(self, rank: int) -> None:
        """A send to ``rank`` failed: it is not counted."""
        with self._lock:
            self._sent_to[rank] -= 1

    def processed(self, rank: int) -> None:
        """A message from ``rank`` is handled."""
        with self._lock:
            self._processed_from[rank] += 1

    def answered(self, rank: int) -> None:
        """A request from ``rank`` is answered: a message sent, and the request handled."""
        with self._lock:
            self._sent_to[rank] += 1
            self._processed_from[rank] += 1

    def totals(self, failed: set[int]) -> tuple[int, int]:
        """``(sent, processed)`` over the ranks not in ``failed``."""
        sent = processed = 0
        with self._lock:  # no container allocated under this lock: a GC could run
            for rank in range(len(self._sent_to)):
                if rank not in failed:
                    sent += self._sent_to[rank]
                    processed += self._processed_from[rank]
        return sent, processed

    @property
    def sent_total(self) -> int:
        """Messages sent."""
        return sum(self._sent_to)

    @property
    def processed_total(self) -> int:
        """Messages received and handled."""
        return sum(self._processed_from)


def make_counters(world_size: int, compiled: bool = True) -> Any:
    """The message counters of a world of ``world_size`` ranks: the C ones when the module
    is built and ``compiled``, else :class:`PythonCounters`.

    Example::

        >>> make_counters(4, compiled=False).totals({3})
        (0, 0)
    """
    if compiled and _module is not None:
        return _module.Counters(world_size)
    return PythonCounters(world_size)


def new_doorbell(compiled: bool = True) -> Any:
    """The progress engine's doorbell (:mod:`mpidag.transport.doorbell`): the C one when the
    module is built and ``compiled`` (its waits hold no GIL, and the compiled completion
    path rings it with a C call), else the Python :class:`~mpidag.transport.doorbell.Doorbell`.

    Example::

        >>> bell = new_doorbell(compiled=False)
        >>> seen = bell.generation; bell.ring(); bell.wait(seen, 0.0) == seen + 1
        True
    """
    if compiled and _module is not None:
        return _module.Doorbell()
    return Doorbell()
