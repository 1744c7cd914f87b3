"""``torch.profiler`` ranges for mpidag's own work, free when no profiler runs.

Names (one per kind of work, so ``key_averages()`` groups them):

* ``mpidag.rpc#<function>(<caller> -> <callee>)``: on the caller, from the call until its
  answer arrives (``rpc_sync``, ``rpc_async``, ``remote``, ``to_here``, proxies);
* ``mpidag.rpc.serve#<function>(<caller> -> <callee>)``: on the callee, running the function
  and sending the answer (until its future completes for ``@async_execution`` functions);
* ``mpidag.autograd.backward``: ``backward()`` on the rank that called it, until the pass is
  done everywhere; ``mpidag.autograd.gradients(<from> -> <to>)``: a rank's work on the
  gradients one message brought (or on the roots: ``(roots)``);
* ``mpidag.optim.step``: an owner's local optimizer step, locks included.

These are the ranges of ``torch.profiler``. Under torch's legacy profiler
(``torch.autograd.profiler_legacy.profile``) calls are profiled as torch profiles its RPCs
instead: torch's keys and the callee's events (:mod:`mpidag._remote_profiling`).

Calls are served by pool threads: a profiler sees the callee's side when it records every
thread (``experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=
True)``), as the example of :func:`span` shows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch.autograd import profiler as _profiler

__all__ = ["profiling", "span"]


def profiling() -> bool:
    """Whether ``torch.profiler`` runs in this process (in any thread).

    Example::

        >>> with torch.profiler.profile():
        ...     profiling()
        True
    """
    return _profiler._is_profiler_enabled


def span(name: Callable[[], str]) -> Any:
    """A ``record_function`` range named ``name()`` while a profiler runs, else nothing.

    Example::

        >>> every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        >>> with torch.profiler.profile(experimental_config=every_thread) as prof:
        ...     with span(lambda: "mpidag.optim.step"):
        ...         pass
        >>> "mpidag.optim.step" in {e.key for e in prof.key_averages()}
        True
    """
    if not _profiler._is_profiler_enabled:
        return _NO_SPAN
    return _profiler.record_function(name())


#: what :func:`span` returns while no profiler runs (``nullcontext`` keeps no state, so one
#: serves every thread and every nesting)
_NO_SPAN = contextlib.nullcontext()
