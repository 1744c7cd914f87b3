"""Observability: ``MPIDAG_LOG`` rank-prefixed logging and the SIGUSR1 state dump.

``MPIDAG_LOG=debug|info|warning|error`` attaches a handler to the ``mpidag`` logger (only
to it: the library never configures the root logger) whose lines name the rank::

    [mpidag r1] WARNING mpidag.rpc.api: worker1 (rank 1 of 2) exits without ...

``kill -USR1 <pid>`` on a rank prints every thread's stack (``faulthandler``, which works
even when Python is stuck in a C call) and then, as soon as the main thread runs Python
again, the agent's state: calls in flight with their age, the progress engine, RRefs.
"""

from __future__ import annotations

import logging
import sys
import time

from mpidag import _runtime
from mpidag._runtime import Runtime

__all__ = ["configure_logging", "state_report", "install_signal_dump"]

def configure_logging(rank: int, wanted: str | None) -> None:
    """Attach a rank-prefixed stderr handler to ``mpidag`` for the level ``MPIDAG_LOG``
    asked for (``wanted``, as read into the config at ``init_rpc``; ``None``: none).

    Example::

        $ MPIDAG_LOG=info python -m mpidag.run -n 2 prog.py
    """
    if not wanted:
        return
    level = logging.getLevelName(wanted.upper())  # checked by Config: a known level name
    logger = logging.getLogger("mpidag")
    for handler in list(logger.handlers):
        if getattr(handler, "_mpidag", False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._mpidag = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter(f"[mpidag r{rank}] %(levelname)s %(name)s: "
                                           f"%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)


def state_report(runtime: Runtime) -> str:
    """A readable snapshot of a session: calls in flight, engine, RRefs, autograd contexts.

    Example::

        >>> print(state_report(mpidag._runtime.current()))  # doctest: +SKIP
        === mpidag state of worker0 (rank 0 of 2) ===
        calls in flight: 1
          0x17 tests.f.slow -> worker1, 3.2 s, timeout 60 s
    """
    now = time.monotonic()
    agent = runtime.agent
    engine = agent.engine
    lines = [f"=== mpidag state of {agent.where()} ==="]
    pending = list(agent._pending.copy().items())
    lines.append(f"calls in flight: {len(pending)}")
    for request_id, call in pending[:50]:
        started = call.deadline - call.seconds if call.deadline else None
        age = f"{now - started:.1f} s" if started is not None else "no timeout"
        lines.append(f"  0x{request_id:x} {call.what} -> {agent.workers[call.dst].name}, "
                     f"{age}, timeout {call.seconds:g} s")
    lines.append(f"progress: leader busy={engine._leader_busy} waiting user threads="
                 f"{engine._waiters} idle pool threads={engine._idle} queued requests="
                 f"{len(engine._work)} running requests={engine._running_work}")
    lines.append(f"messages: sent={agent.sent} handled={agent.processed}")
    lines.append("rrefs: " + ", ".join(f"{k}={v}" for k, v in
                                       runtime.rrefs.debug_info().items()))
    lines.append("autograd: " + ", ".join(f"{k}={v}" for k, v in
                                          runtime.autograd.container.debug_info().items()))
    return "\n".join(lines)


_installed = False


def install_signal_dump() -> None:
    """``kill -USR1 <pid>``: thread stacks (faulthandler) and then :func:`state_report`."""
    global _installed
    import signal

    if _installed or not hasattr(signal, "SIGUSR1"):
        return
    import threading

    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread
    _installed = True
    import faulthandler

    def report(signum, frame) -> None:
        runtime = _runtime.current_or_none()
        text = state_report(runtime) if runtime is not None else \
            "=== mpidag: RPC not running ==="
        sys.stderr.write(text + "\n")
        sys.stderr.flush()

    signal.signal(signal.SIGUSR1, report)
    # the C-level dump first (works while Python is blocked), then the handler above
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
