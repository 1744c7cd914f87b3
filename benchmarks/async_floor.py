"""The CPU of one ``rpc_async`` call, step by step, with one thread and no waiting.

``bench_rpc.py``'s ``async_calls_per_s`` row runs on two ranks, where each rank's threads
share its core and the figure moves with how they interleave. This one takes that away:
one thread carries a burst of calls through both ends, step by step, twice in turn:

* ``mpidag``: the real agents of a two-rank in-process world
  (:class:`~mpidag.transport.inproc.InProcWorld`, as ``inproc_cost.py``): ``Core.rpc`` (the
  compiled call path of ``rpc_async``) for every call, then the callee's transport polled
  and its agent serving every request, then the caller's polled and every answer completed,
  then ``torch.futures.wait_all``. No MPI: the in-process queues stand for the wire;
* ``hand-written``: the loop of ``bench_rpc.py``'s raw column on ``MPI.COMM_SELF``: a
  pickled ``isend`` and a torch ``Future`` per call, then each request received and answered
  as the raw callee does, then each answer received and its future completed, then
  ``wait_all``.

Each step's µs of CPU per call, the medians of ``--bursts`` bursts of ``--calls`` calls::

    python benchmarks/async_floor.py
    python benchmarks/async_floor.py --calls 1000 --bursts 5 --json out.json

The caller's share (issue + answers + ``wait_all``) is what rank 0's core must do per call
in the two-rank row; the hand-written loop's is that row's floor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))

from inproc_cost import TwoRanks, noop  # noqa: E402 - after the path set-up

STEPS = ("issue", "callee", "answers", "wait_all")
#: the steps the caller's core does (the callee's runs on the other rank)
CALLER_STEPS = ("issue", "answers", "wait_all")


def mpidag_burst(ranks: TwoRanks, calls: int) -> list[float]:
    """One burst through mpidag's agents; µs per call of each of :data:`STEPS`."""
    caller, callee = ranks.agents
    core = caller.core
    to_callee, to_caller = ranks.transports[1], ranks.transports[0]
    t0 = time.perf_counter()
    futures = [core.rpc(1, noop, None, None, -1, True) for _ in range(calls)]
    t1 = time.perf_counter()
    _deliver(to_callee.poll, callee.dispatch)
    t2 = time.perf_counter()
    _deliver(to_caller.poll, caller.dispatch)
    t3 = time.perf_counter()
    torch.futures.wait_all(futures)
    t4 = time.perf_counter()
    if None in futures or not all(f.done() for f in futures):
        raise AssertionError("mpidag: a call was not completed (or left the compiled path)")
    return [(b - a) / calls * 1e6 for a, b in ((t0, t1), (t1, t2), (t2, t3), (t3, t4))]


def _deliver(poll: Callable, dispatch: Callable) -> None:
    """Every message queued for one rank, dispatched (a work item run at once)."""
    while (env := poll()) is not None:
        work = dispatch(env)
        if work is not None:
            work()


def hand_written_burst(comm: MPI.Comm, calls: int) -> list[float]:
    """One burst of ``bench_rpc.py``'s hand-written loop on ``comm`` (one rank: itself)."""
    t0 = time.perf_counter()
    pending: dict[int, torch.futures.Future] = {}
    sends = []
    for request_id in range(calls):
        sends.append(comm.isend(request_id, dest=0, tag=1))
        pending[request_id] = torch.futures.Future()
    futures = list(pending.values())
    t1 = time.perf_counter()
    for _ in range(calls):  # the callee: each request received and answered
        comm.send(comm.recv(source=0, tag=1), dest=0, tag=2)
    t2 = time.perf_counter()
    for _ in range(calls):
        pending.pop(comm.recv(source=0, tag=2)).set_result(None)
    MPI.Request.waitall(sends)
    t3 = time.perf_counter()
    torch.futures.wait_all(futures)
    t4 = time.perf_counter()
    if pending:
        raise AssertionError(f"hand-written: {len(pending)} calls were not answered")
    return [(b - a) / calls * 1e6 for a, b in ((t0, t1), (t1, t2), (t2, t3), (t3, t4))]


def measure(calls: int, bursts: int, warmup: int = 3) -> dict[str, dict[str, float]]:
    """Both columns, bursts alternating; ``{column: {step: median µs per call}}`` with the
    caller's share as ``"caller"``."""
    torch.set_num_threads(1)
    ranks = TwoRanks()
    try:
        ranks.call(noop, ())  # the function's reference: plain calls from now on
        rows: dict[str, list[list[float]]] = {"mpidag": [], "hand-written": []}
        for i in range(warmup + bursts):
            m = mpidag_burst(ranks, calls)
            h = hand_written_burst(MPI.COMM_SELF, calls)
            if i >= warmup:
                rows["mpidag"].append(m)
                rows["hand-written"].append(h)
    finally:
        ranks.close()
    out: dict[str, dict[str, float]] = {}
    for column, samples in rows.items():
        medians = {step: statistics.median(s[i] for s in samples)
                   for i, step in enumerate(STEPS)}
        medians["caller"] = sum(medians[step] for step in CALLER_STEPS)
        out[column] = medians
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=5000, help="calls a burst (5,000)")
    parser.add_argument("--bursts", type=int, default=10, help="bursts a column (10)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.bursts < 1:
        parser.error(f"--calls and --bursts must be at least 1, got {args.calls} and "
                     f"{args.bursts}")
    result = measure(args.calls, args.bursts)
    print(f"µs of CPU per call, medians of {args.bursts} bursts of {args.calls} calls")
    print(f"{'step':<10}" + "".join(f"{c:>14}" for c in result))
    for step in (*STEPS, "caller"):
        print(f"{step:<10}" + "".join(f"{result[c][step]:>14.2f}" for c in result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
