"""Observability: ``MPIDAG_LOG`` rank-prefixed logging and the SIGUSR1 state dump.

``MPIDAG_LOG=debug|info|warning|error`` attaches a handler to the ``mpidag`` logger (only
to it: the library never configures the root logger) whose lines name the rank::

    [mpidag r1] WARNING mpidag.rpc.api: worker1 (rank 1 of 2) exits without ...

``kill -USR1 <pid>`` on a rank prints every thread's stack (``faulthandler``, which works
even when Python is stuck in a C call) and then, as soon as the main thread runs Python
again, the agent's state: calls in flight with their age, the progress engine, RRefs.

``python -m mpidag.inspect`` (:mod:`mpidag.inspect`) asks every rank of a running job for
its state at once: a :class:`StateWatcher` thread per rank looks for a request file in the
job's directory four times a second and answers with :func:`state_snapshot` as JSON,
without stopping anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from mpidag import _runtime
from mpidag._runtime import Runtime

__all__ = ["configure_logging", "state_report", "state_snapshot", "install_signal_dump",
           "uninstall_signal_dump",
           "StateWatcher"]

log = logging.getLogger(__name__)

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
    """:func:`state_snapshot` as readable text (what ``kill -USR1`` prints).

    Example::

        >>> print(state_report(mpidag._runtime.current()))  # doctest: +SKIP
        === mpidag state of worker0 (rank 0 of 2) ===
        calls in flight: 1
          0x17 tests.f.slow -> worker1, 3.2 s, timeout 60 s
    """
    state = state_snapshot(runtime)
    engine = state["engine"]
    lines = [f"=== mpidag state of {runtime.agent.where()} ===",
             f"calls in flight: {len(state['calls'])}"]
    for call in state["calls"][:50]:
        lines.append(f"  {call['id']} {call['what']} -> {call['to']}, {call['age_s']:.1f} s, "
                     f"timeout {call['timeout_s']:g} s")
    lines.append(f"progress: leader busy={engine['leader_busy']} waiting user threads="
                 f"{engine['waiting_user_threads']} idle pool threads="
                 f"{engine['idle_pool_threads']} queued requests={engine['queued_requests']} "
                 f"running requests={engine['running_requests']} "
                 f"sentinel parked={engine['sentinel_parked']}")
    lines.append(f"messages: sent={state['messages']['sent']} "
                 f"handled={state['messages']['handled']}")
    for part in ("rrefs", "autograd"):
        lines.append(f"{part}: " + ", ".join(f"{k}={v}" for k, v in state[part].items()))
    return "\n".join(lines)


def state_snapshot(runtime: Runtime) -> dict[str, Any]:
    """This rank's state as JSON-able data: calls in flight (who waits on whom), threads'
    top frames, the progress engine, autograd contexts and passes, RRef counters.

    Example::

        >>> state_snapshot(mpidag._runtime.current())["calls"]  # doctest: +SKIP
        [{'id': '0x17', 'what': 'tests.f.slow', 'to': 'worker1', 'to_rank': 1, 'age_s': 3.2,
          'timeout_s': 60.0}]
    """
    now = time.monotonic()
    agent = runtime.agent
    seen = agent.snapshot()
    host, pid = runtime.processes[agent.rank]
    calls = [{"id": f"0x{call.request_id:x}", "what": call.what,
              "to": agent.workers[call.dst].name, "to_rank": call.dst,
              "age_s": round(now - call.started, 3), "timeout_s": call.timeout_s}
             for call in seen.calls]
    contexts = []
    for ctx in list(runtime.autograd.container.contexts.copy().values())[:50]:
        passes = [{"id": f"0x{pass_id:x}", "calls_unanswered": state.deficit,
                   "events_queued": len(state.events), "root": state.root}
                  for pass_id, state in list(ctx.passes.items())]
        contexts.append({"id": ctx.context_id, "sends": len(ctx.sends),
                         "recvs": len(ctx.recvs), "known_workers": sorted(ctx.known_workers),
                         "passes": passes})
    frames = sys._current_frames()
    threads = []
    for thread in threading.enumerate():
        frame = frames.get(thread.ident)
        if frame is None:
            continue
        stack = traceback.extract_stack(frame)[-12:]
        threads.append({"name": thread.name, "main": thread is threading.main_thread(),
                        "stack": [f"{Path(f.filename).name}:{f.lineno} {f.name}"
                                  for f in stack],
                        "user": [f"{Path(f.filename).name}:{f.lineno} {f.name}"
                                 for f in stack if not _is_library(f.filename)][-3:]})
    return {
        "rank": agent.rank, "name": agent.info.name, "host": host, "pid": pid,
        "time": time.time(), "calls": calls,
        "engine": dataclasses.asdict(seen.engine),
        "messages": {"sent": seen.messages_sent, "handled": seen.messages_processed},
        "failed": [agent.workers[r].name for r in seen.failed],
        "rrefs": runtime.rrefs.debug_info(),
        "autograd": runtime.autograd.container.debug_info(),
        "contexts": contexts,
        "threads": threads,
    }


_PACKAGE_DIR = str(Path(__file__).resolve().parent)
_STDLIB_DIR = str(Path(threading.__file__).resolve().parent)


def _is_library(filename: str) -> bool:
    """Whether a frame is mpidag's or the standard library's (not the program's)."""
    path = str(Path(filename).resolve())
    return path.startswith((_PACKAGE_DIR, _STDLIB_DIR)) or "site-packages" in path


class StateWatcher:
    """Answers ``python -m mpidag.inspect`` for one rank, from a thread of its own.

    The job's directory is ``<Config.inspect_base>/job-<host of rank 0>-<its pid>``. At
    start the rank writes ``rank<r>.json`` (who it is); every ``interval`` seconds the
    thread looks at ``request`` and, when it holds a new token, writes
    ``rank<r>.state.json`` with :func:`state_snapshot` and that token. A stat of one small
    file per interval is all it costs while nobody asks.

    Example::

        >>> watcher = StateWatcher(runtime, "/tmp/mpidag-me")
        >>> watcher.start()
        >>> watcher.stop()     # at shutdown: its files are removed
    """

    def __init__(self, runtime: Runtime, base: str, interval: float = 0.25) -> None:
        self.runtime = runtime
        self.rank = runtime.agent.rank
        self.job_dir = Path(base) / f"job-{runtime.job_id}"
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: int | None = None
        self._answered = ""

    def start(self) -> None:
        try:
            self.job_dir.mkdir(parents=True, exist_ok=True)
            agent = self.runtime.agent
            host, pid = self.runtime.processes[self.rank]
            self._write(f"rank{self.rank}.json", {
                "rank": self.rank, "name": agent.info.name, "host": host, "pid": pid,
                "world_size": agent.world_size, "started": time.time()})
        except OSError as exc:
            log.warning("%s: mpidag.inspect will not see this rank (%s)",
                        self.runtime.where(), exc)
            return
        self._thread = threading.Thread(target=self._run, name="mpidag-inspect",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        request = self.job_dir / "request"
        while not self._stop.wait(self.interval):
            try:
                stamp = request.stat().st_mtime_ns
            except OSError:
                continue
            if stamp == self._seen:
                continue
            self._seen = stamp
            try:
                token = request.read_text().strip()
                if token and token != self._answered:
                    self._answered = token
                    self._write(f"rank{self.rank}.state.json",
                                {"token": token, **state_snapshot(self.runtime)})
            except Exception:  # never let a report break the rank
                log.exception("%s: could not answer mpidag.inspect", self.runtime.where())

    def _write(self, name: str, data: dict[str, Any]) -> None:
        path = self.job_dir / name
        temp = path.with_suffix(f".tmp{os.getpid()}")
        temp.write_text(json.dumps(data, default=str))
        os.replace(temp, path)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        names = [f"rank{self.rank}.json", f"rank{self.rank}.state.json"]
        if self.rank == 0:
            names.append("request")
        for name in names:
            with contextlib.suppress(OSError):
                (self.job_dir / name).unlink()
        with contextlib.suppress(OSError):
            self.job_dir.rmdir()  # the last rank out removes the directory


#: the SIGUSR1 handler there was before install_signal_dump(), while it is installed
_previous_handler: list[Any] = []


def install_signal_dump() -> None:
    """``kill -USR1 <pid>``: thread stacks (faulthandler) and then :func:`state_report`;
    undone by :func:`uninstall_signal_dump` (``shutdown()``). Only from the main thread
    (Python sets signal handlers there); installing twice changes nothing."""
    import signal

    if _previous_handler or not hasattr(signal, "SIGUSR1"):
        return
    import threading

    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread
    import faulthandler

    def report(signum, frame) -> None:
        runtime = _runtime.current_or_none()
        text = state_report(runtime) if runtime is not None else \
            "=== mpidag: RPC not running ==="
        sys.stderr.write(text + "\n")
        sys.stderr.flush()

    _previous_handler.append(signal.signal(signal.SIGUSR1, report))
    # the C-level dump first (works while Python is blocked), then the handler above
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)


def uninstall_signal_dump() -> None:
    """Put back the SIGUSR1 handler there was before :func:`install_signal_dump`."""
    import signal

    if not _previous_handler:
        return
    import threading

    if threading.current_thread() is not threading.main_thread():
        return  # (a shutdown from another thread leaves it: it reports "not running")
    import faulthandler

    faulthandler.unregister(signal.SIGUSR1)
    previous = _previous_handler.pop()
    signal.signal(signal.SIGUSR1, previous if previous is not None else signal.SIG_DFL)
