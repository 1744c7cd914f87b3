"""``python -m mpidag.inspect``: every rank's state of a running job, and who waits on whom.

A job that seems hung is looked at without stopping it. Every rank runs a small thread
(:class:`mpidag._debug.StateWatcher`) that watches a request file in the job's directory
(``$MPIDAG_INSPECT_DIR``, default ``<tmp>/mpidag-<user>``; use a shared file system for jobs
over several nodes). This command writes a new request, waits up to ``--timeout`` seconds for
every rank's answer, and prints:

* per rank: where its threads are (the top frames), its calls in flight (what, to whom, how
  long), the progress engine (busy pool threads, queued requests), open autograd contexts
  and backward passes, RRef counters, workers it saw fail;
* the wait-for graph over ranks (an edge ``A -> B`` for every call of A that B has not
  answered), and its cycles: a cycle whose calls all stay unanswered is a deadlock (for
  instance every pool thread of a rank waits on a call back into a busy rank);
* ranks that did not answer: their Python could not run for the whole timeout (a C call
  holding the GIL, a rank stopped by a debugger, a dead process); ``kill -USR1 <pid>`` makes
  such a rank print its thread stacks on the job's stderr.

Usage::

    python -m mpidag.inspect                 # the newest running job of this user
    python -m mpidag.inspect JOB --json      # a job by (a prefix of) its id; raw answers

The launcher's layer: this module reads files only, it never touches MPI or the job's
processes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from mpidag._config import Config

__all__ = ["find_jobs", "ask", "wait_for_graph", "cycles", "render", "main"]


def find_jobs(base: Path) -> list[tuple[Path, dict[int, dict[str, Any]]]]:
    """The job directories under ``base`` with their ranks' ``rank<r>.json``, newest first.

    Example::

        >>> [d.name for d, ranks in find_jobs(Path("/tmp/mpidag-me"))]  # doctest: +SKIP
        ['job-node1-41213']
    """
    jobs = []
    for job_dir in base.glob("job-*"):
        ranks = {}
        for info in job_dir.glob("rank*.json"):
            if info.name.endswith(".state.json"):
                continue
            try:
                data = json.loads(info.read_text())
            except (OSError, ValueError):
                continue
            ranks[int(data["rank"])] = data
        if ranks:
            jobs.append((job_dir, ranks))
    jobs.sort(key=lambda job: max(r["started"] for r in job[1].values()), reverse=True)
    return jobs


def _alive(info: dict[str, Any]) -> bool:
    """Whether a rank's process may still run (only checkable on this host)."""
    if info.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ask(job_dir: Path, world_size: int, timeout: float) -> tuple[dict[int, dict], float]:
    """Ask every rank of the job for its state; ``({rank: answer}, seconds it took)``.

    Example::

        >>> answers, seconds = ask(Path("/tmp/mpidag-me/job-node1-41213"), 4, 5.0)
        ... # doctest: +SKIP
    """
    token = f"{uuid.uuid4().hex}-{time.time():.3f}"
    request = job_dir / "request"
    temp = job_dir / f"request.tmp{os.getpid()}"
    temp.write_text(token)
    os.replace(temp, request)
    start = time.monotonic()
    answers: dict[int, dict] = {}
    while time.monotonic() - start < timeout and len(answers) < world_size:
        for rank in range(world_size):
            if rank in answers:
                continue
            try:
                data = json.loads((job_dir / f"rank{rank}.state.json").read_text())
            except (OSError, ValueError):
                continue
            if data.get("token") == token:
                answers[rank] = data
        time.sleep(0.05)
    return answers, time.monotonic() - start


def wait_for_graph(answers: dict[int, dict]) -> dict[str, list[tuple[str, str, float]]]:
    """``{caller: [(callee, what, age in s), ...]}`` from every rank's calls in flight.

    Example::

        >>> wait_for_graph({0: {"name": "worker0", "calls": [{"to": "worker1", "what": "f",
        ...                                                   "age_s": 2.0}]}})
        {'worker0': [('worker1', 'f', 2.0)]}
    """
    graph: dict[str, list[tuple[str, str, float]]] = {}
    for data in answers.values():
        for call in data.get("calls", []):
            graph.setdefault(data["name"], []).append((call["to"], call["what"], call["age_s"]))
    return graph


def cycles(graph: dict[str, list[tuple[str, str, float]]]) -> list[list[str]]:
    """The elementary cycles of the wait-for graph over ranks, each once (smallest name
    first).

    Example::

        >>> cycles({"a": [("b", "f", 1.0)], "b": [("a", "g", 1.0)]})
        [['a', 'b']]
    """
    edges = {caller: sorted({callee for callee, _, _ in calls}) for caller, calls in
             graph.items()}
    found: set[tuple[str, ...]] = set()

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in edges.get(node, []):
            if nxt == start:
                found.add(tuple(path))
            elif nxt not in path and nxt > start:
                walk(start, nxt, [*path, nxt])

    for start in sorted(edges):
        walk(start, start, [start])
    return [list(c) for c in sorted(found)]


def render(job_dir: Path, ranks: dict[int, dict], answers: dict[int, dict],
           seconds: float) -> str:
    """The report as text (what :func:`main` prints).

    Example::

        >>> print(render(job_dir, ranks, answers, 0.3))  # doctest: +SKIP
        job node1-41213: 3 ranks, 3 answered in 0.3 s
    """
    world_size = max(int(r["world_size"]) for r in ranks.values())
    lines = [f"job {job_dir.name.removeprefix('job-')}: {world_size} ranks, {len(answers)} "
             f"answered in {seconds:.1f} s"]
    for rank in sorted(answers):
        data = answers[rank]
        engine = data["engine"]
        lines.append(f"\n{data['name']} (rank {rank}, pid {data['pid']} on {data['host']})")
        for thread in data["threads"]:
            if thread["main"] or thread["user"]:  # pool threads in the program's code
                where = thread["user"] or thread["stack"][-2:]
                inner = thread["stack"][-1:] if thread["stack"][-1:] != where[-1:] else []
                lines.append(f"  thread {thread['name']}: {' > '.join(where)}"
                             + (f" ... {inner[0]}" if inner else ""))
        busy = engine["pool_threads"] - engine["idle_pool_threads"]
        lines.append(f"  pool threads busy {busy}/{engine['pool_threads']}, requests queued "
                     f"{engine['queued_requests']}, user threads waiting "
                     f"{engine['waiting_user_threads']}")
        lines.append(f"  calls in flight: {len(data['calls'])}")
        for call in sorted(data["calls"], key=lambda c: -c["age_s"])[:20]:
            limit = f"timeout {call['timeout_s']:g} s" if call["timeout_s"] else "no timeout"
            lines.append(f"    {call['what']} -> {call['to']}, {call['age_s']:.1f} s ({limit})")
        for ctx in data["contexts"]:
            passes = ", ".join(f"pass {p['id']}: {p['calls_unanswered']} gradient call(s) "
                               f"unanswered" for p in ctx["passes"]) or "no backward pass"
            lines.append(f"  autograd context {ctx['id']}: {ctx['sends']} send / "
                         f"{ctx['recvs']} recv functions, workers {ctx['known_workers']}; "
                         f"{passes}")
        rrefs = data["rrefs"]
        lines.append(f"  rrefs: owned {rrefs['num_owner_rrefs']} (forks out "
                     f"{rrefs['num_forks']}), held {rrefs['num_user_rrefs']}, pending "
                     f"{rrefs['num_pending_users']}")
        if data["failed"]:
            lines.append(f"  failed workers seen: {', '.join(data['failed'])}")
    graph = wait_for_graph(answers)
    lines.append("\nwait-for graph (caller -> callee: oldest call):")
    if not graph:
        lines.append("  nobody waits for an answer")
    for caller in sorted(graph):
        by_callee: dict[str, tuple[str, float, int]] = {}
        for callee, what, age in graph[caller]:
            old = by_callee.get(callee)
            if old is None or age > old[1]:
                by_callee[callee] = (what, age, (old[2] if old else 0) + 1)
            else:
                by_callee[callee] = (old[0], old[1], old[2] + 1)
        for callee, (what, age, count) in sorted(by_callee.items()):
            lines.append(f"  {caller} -> {callee}: {what}, {age:.1f} s"
                         + (f" (+{count - 1} more)" if count > 1 else ""))
    for cycle in cycles(graph):
        lines.append(f"  CYCLE: {' -> '.join([*cycle, cycle[0]])} (a deadlock if these calls "
                     f"stay unanswered: look at their ages and the pool threads above)")
    missing = sorted(set(range(world_size)) - set(answers))
    for rank in missing:
        info = ranks.get(rank, {})
        state = "its process is gone" if info and not _alive(info) else \
            f"its Python did not run for {seconds:.0f} s; `kill -USR1 {info.get('pid', '?')}`" \
            f" prints its thread stacks on the job's stderr"
        lines.append(f"\nrank {rank} ({info.get('name', '?')}) did not answer: {state}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: ``python -m mpidag.inspect [JOB] [--timeout S] [--json]``.

    Example::

        >>> main(["--timeout", "5"])  # doctest: +SKIP
        job node1-41213: 3 ranks, 3 answered in 0.3 s
    """
    parser = argparse.ArgumentParser(
        prog="python -m mpidag.inspect",
        description="Print every rank's state of a running mpidag job and who waits on whom.")
    parser.add_argument("job", nargs="?", help="job id or a prefix of it (default: the newest "
                        "running job)")
    parser.add_argument("--dir", help="the directory of job directories (default: "
                        "$MPIDAG_INSPECT_DIR or <tmp>/mpidag-<user>)")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for the ranks' answers (default 5)")
    parser.add_argument("--json", action="store_true", help="print the raw answers as JSON")
    args = parser.parse_args(argv)
    base = Path(args.dir or Config.from_env().inspect_base)
    jobs = find_jobs(base)
    if args.job:
        jobs = [j for j in jobs if j[0].name.removeprefix("job-").startswith(args.job)]
    else:
        jobs = [j for j in jobs if any(_alive(info) for info in j[1].values())]
    if not jobs:
        print(f"no running mpidag job found under {base} (set MPIDAG_INSPECT_DIR or --dir "
              f"to the job's directory of job directories)", file=sys.stderr)
        return 1
    job_dir, ranks = jobs[0]
    world_size = max(int(r["world_size"]) for r in ranks.values())
    answers, seconds = ask(job_dir, world_size, args.timeout)
    if args.json:
        print(json.dumps({"job": job_dir.name, "answers": answers}, indent=2))
    else:
        print(render(job_dir, ranks, answers, seconds))
    return 0 if len(answers) == world_size else 2


if __name__ == "__main__":
    sys.exit(main())
