"""One Chrome trace for a whole job: every rank's ``torch.profiler`` trace, merged.

Each rank profiles itself as usual and saves its trace with :func:`export_rank_trace`, which
adds who the rank is and how far its clock is from rank 0's (a few RPC round trips; the
sample with the shortest round trip wins, as NTP does). :func:`merge_traces` (or ``python -m
mpidag.trace merge rank*.json -o job.json``) then writes one trace in which

* every rank is a process named after its worker (``worker0 (rank 0)``), its threads as
  they were recorded;
* every time stamp is on rank 0's clock (a trace's ``baseTimeNanoseconds`` plus its ``ts`` is
  the wall clock of its host; the measured offset moves it onto rank 0's; ranks on rank 0's
  host, which share its clock, are not moved);
* every caller's ``mpidag.rpc#f(a -> b)`` range is linked by a flow arrow to the callee's
  ``mpidag.rpc.serve#f(a -> b)`` range that served it: the serving range of the same
  function and pair of workers that starts inside the caller's range, earliest first (range
  names carry no request id, so that ``key_averages()`` groups them; on one machine the
  clocks are the same and the match is exact; across hosts a serving range may start up to
  the two offsets' error bounds outside its caller's range).

Open the result in ``chrome://tracing`` or https://ui.perfetto.dev. Example, on every rank::

    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(experimental_config=every_thread) as prof:
        train_step()
    mpidag.trace.export_rank_trace(prof, f"trace/rank{rank}.json")   # while RPC runs
    ...
    # afterwards, anywhere:  python -m mpidag.trace merge trace/rank*.json -o trace/job.json
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mpidag import _runtime

__all__ = ["clock_offset_ns", "export_rank_trace", "merge_traces", "main"]

#: the rpc ranges: ``mpidag.rpc#<what>(<caller> -> <callee>)`` and ``mpidag.rpc.serve#...``
_RANGE = re.compile(r"^mpidag\.rpc(\.serve)?#(.*)\((\S+) -> (\S+)\)$")


def _wall_clock_ns() -> int:
    """This host's wall clock (what a trace's time stamps are on)."""
    return time.time_ns()


def _clock_identity() -> str:
    """What names this host's clock: the running kernel's boot id (every process and
    container of one kernel reads one ``CLOCK_REALTIME``), else the host name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def clock_offset_ns(samples: int = 8) -> int:
    """How far rank 0's clock is ahead of this rank's, in ns (0 on rank 0, and on every rank
    of rank 0's host: they read the same clock).

    The sample whose round trip to rank 0 was the shortest gives the estimate: rank 0's
    clock reading minus the midpoint of this rank's two readings around it (its error is at
    most half that round trip).

    Example::

        >>> mpidag.trace.clock_offset_ns()     # on worker0 (rank 0)
        0
    """
    return _clock_offset(samples)[0]


def _clock_offset(samples: int) -> tuple[int, int]:
    """``(offset, error bound)`` of this rank's clock to rank 0's, in ns."""
    agent = _runtime.current().agent
    if agent.rank == 0 or agent.call_sync(0, _clock_identity, (), {}, timeout=30,
                                          record=False) == _clock_identity():
        return 0, 0
    best: tuple[int, int] | None = None
    for _ in range(samples):
        before = _wall_clock_ns()
        remote = agent.call_sync(0, _wall_clock_ns, (), {}, timeout=30, record=False)
        after = _wall_clock_ns()
        sample = (after - before, remote - (before + after) // 2)
        if best is None or sample[0] < best[0]:
            best = sample
    assert best is not None
    return best[1], (best[0] + 1) // 2


def export_rank_trace(prof: Any, path: str | Path) -> Path:
    """Save this rank's ``torch.profiler`` trace with what :func:`merge_traces` needs: the
    rank, its worker's name and its clock's offset to rank 0 (call it while RPC runs).

    Example::

        >>> with torch.profiler.profile() as prof:
        ...     y = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
        >>> mpidag.trace.export_rank_trace(prof, "trace/rank0.json")
        PosixPath('trace/rank0.json')
    """
    runtime = _runtime.current()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    data = json.loads(path.read_text())
    agent = runtime.agent
    offset, error = _clock_offset(8)
    data["mpidag"] = {"rank": agent.rank, "name": agent.info.name,
                      "world_size": agent.world_size,
                      "clock_offset_ns": offset, "clock_error_ns": error}
    path.write_text(json.dumps(data))
    return path


def merge_traces(paths: Iterable[str | Path], out: str | Path | None = None
                 ) -> dict[str, Any]:
    """One trace of the whole job from the ranks' traces (see the module's description);
    written to ``out`` when given.

    Example::

        >>> def traced(path):            # each rank: profile its work, save its trace
        ...     with torch.profiler.profile() as prof:
        ...         torch.ones(2).add(1)
        ...     return mpidag.trace.export_rank_trace(prof, path)
        >>> traced("trace/rank0.json"), rpc.rpc_sync("worker1", traced,
        ...                                          args=("trace/rank1.json",))
        (PosixPath('trace/rank0.json'), PosixPath('trace/rank1.json'))
        >>> job = mpidag.trace.merge_traces(["trace/rank0.json", "trace/rank1.json"],
        ...                                 "trace/job.json")
        >>> sorted({e["pid"] for e in job["traceEvents"]})
        [0, 1]
    """
    ranks = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        meta = data.get("mpidag")
        if meta is None:
            raise ValueError(f"{path} was not saved with mpidag.trace.export_rank_trace (it has "
                             f"no rank and clock offset)")
        ranks.append((meta, data))
    if not ranks:
        raise ValueError("no trace to merge")
    ranks.sort(key=lambda item: item[0]["rank"])
    # each event's wall time on rank 0's clock, in ns
    starts = [d.get("baseTimeNanoseconds", 0) + m["clock_offset_ns"] for m, d in ranks]
    origin = min(starts)
    events: list[dict[str, Any]] = []
    for (meta, data), start in zip(ranks, starts, strict=True):
        rank = meta["rank"]
        shift_us = (start - origin) / 1e3
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"{meta['name']} (rank {rank})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        for event in data.get("traceEvents", []):
            if event.get("ph") == "M" and event.get("name", "").startswith("process_"):
                continue  # the process is named above, after its worker
            event = dict(event)
            event["pid"] = rank
            if "ts" in event:
                event["ts"] = float(event["ts"]) + shift_us
            events.append(event)
    errors_us = {meta["rank"]: meta.get("clock_error_ns", 0) / 1e3 for meta, _ in ranks}
    events.extend(_rpc_flows(events, errors_us))
    merged = {"traceEvents": events, "displayTimeUnit": "ms",
              "mpidag": {"ranks": [m for m, _ in ranks], "origin_ns": origin}}
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(merged))
    return merged


def _rpc_flows(events: list[dict[str, Any]], errors_us: dict[int, float]
               ) -> list[dict[str, Any]]:
    """Flow arrows from each caller's rpc range to the serving range that answered it
    (``errors_us``: each rank's clock error bound: how far outside its caller's range a
    serving range may appear to start)."""
    callers: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    servers: list[tuple[tuple[str, str, str], dict[str, Any]]] = []
    for event in events:
        if event.get("ph") != "X":
            continue
        found = _RANGE.match(event.get("name", ""))
        if found is None:
            continue
        key = (found.group(2), found.group(3), found.group(4))
        if found.group(1):
            servers.append((key, event))
        else:
            callers.setdefault(key, []).append(event)
    flows: list[dict[str, Any]] = []
    used: set[int] = set()
    for key, serve in sorted(servers, key=lambda item: item[1]["ts"]):
        begin = serve["ts"]
        error = errors_us.get(serve["pid"], 0.0)
        candidates = []
        for c in callers.get(key, []):
            slack = error + errors_us.get(c["pid"], 0.0)
            if id(c) not in used and c["ts"] - slack <= begin <= c["ts"] + c.get("dur", 0) + slack:
                candidates.append(c)
        if not candidates:
            continue
        call = min(candidates, key=lambda c: c["ts"])  # the oldest call still waiting
        used.add(id(call))
        flow_id = len(flows) // 2 + 1
        flows.append({"ph": "s", "id": flow_id, "name": "rpc", "cat": "mpidag.rpc",
                      "pid": call["pid"], "tid": call["tid"], "ts": call["ts"]})
        flows.append({"ph": "f", "bp": "e", "id": flow_id, "name": "rpc", "cat": "mpidag.rpc",
                      "pid": serve["pid"], "tid": serve["tid"], "ts": begin})
    return flows


def main(argv: list[str] | None = None) -> int:
    """``python -m mpidag.trace merge rank*.json -o job.json``.

    Example::

        >>> main(["merge", "trace/rank0.json", "trace/rank1.json", "-o", "trace/job.json"])
        ... # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(prog="python -m mpidag.trace",
                                     description="Merge the ranks' Chrome traces of one job.")
    sub = parser.add_subparsers(dest="command", required=True)
    merge = sub.add_parser("merge", help="merge rank traces into one Chrome trace")
    merge.add_argument("traces", nargs="+", help="the ranks' traces (export_rank_trace)")
    merge.add_argument("-o", "--out", required=True, help="the merged trace to write")
    args = parser.parse_args(argv)
    try:
        merged = merge_traces(args.traces, args.out)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    flows = sum(1 for e in merged["traceEvents"] if e.get("ph") == "s")
    print(f"wrote {args.out}: {len(merged['mpidag']['ranks'])} ranks, {flows} rpc links",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
