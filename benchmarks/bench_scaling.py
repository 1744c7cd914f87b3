"""How RPC cost grows with the number of ranks: ``mpidag.rpc`` vs ``torch.distributed.rpc``.

Run on N MPI ranks (any N >= 2; the README reports 2, 4 and 8), then merge the runs::

    python -m mpidag.run -n 2 benchmarks/bench_scaling.py [--quick] [--only torch,mpidag]
    python -m mpidag.run -n 4 benchmarks/bench_scaling.py [--quick]
    python -m mpidag.run -n 8 benchmarks/bench_scaling.py [--quick]
    python benchmarks/bench_scaling.py --merge-table   # markdown table of scaling_{2,4,8}.json

Each run writes ``benchmarks/results/scaling_{N}.json`` (``--out`` to change it) and prints
its table; progress lines go to stderr.

Two implementations are measured back to back in the same N processes, in this order:

* ``torch_rpc``: ``torch.distributed.rpc`` with the TensorPipe backend,
  ``num_worker_threads=16``, rendezvous at ``tcp://127.0.0.1:<port>`` (rank 0 picks a free
  port and broadcasts it with MPI);
* ``mpidag``: ``mpidag.rpc.init_rpc()`` with no arguments. The repository root is put first on
  ``sys.path``, so the checkout's ``mpidag`` is measured.

Two patterns, two rows each (every call is ``rpc_sync``/``rpc_async`` of a module-level no-op
function with ``timeout=120``):

* ``lifecycle``: ``init_rpc`` and graceful ``shutdown()`` on every rank at once, each
  timed from a barrier until it returned on the slowest rank (rows ``lifecycle_init_s``,
  ``lifecycle_shutdown_s``).
* ``one_server``: ranks 1..N-1 all call rank 0, which only serves.
* ``all_to_all``: every rank calls every other rank in round robin (call ``i`` of rank ``r``
  goes to rank ``(r + 1 + i mod (N-1)) mod N``), so every rank is caller and server at once.

Rows:

* ``<pattern>_rtt_us`` (µs, lower is better): each caller times ``calls`` sequential
  ``rpc_sync`` no-op round trips; its sample is the mean time per call. The value of one
  repetition is the median over the callers; the row is the median over repetitions.
* ``<pattern>_calls_per_s`` (calls/s, higher is better): each caller issues batches of
  ``batch`` ``rpc_async`` no-op calls and waits each batch's futures with ``fut.wait()``,
  ``batches`` times; its sample is its calls divided by its elapsed time. The value of one
  repetition is the sum over the callers; the row is the median over repetitions. The JSON also
  has ``aggregate_wall_calls_per_s``: all callers' calls divided by the time from the first
  caller's start to the last caller's end (one host, one monotonic clock), which is lower than
  the sum when the callers do not finish together.

Method. All callers of a repetition start together: every repetition is fenced by two
barriers on a private ``COMM_WORLD.Dup()``. A barrier is an ``Ibarrier`` polled with
``Test()`` and a 1 ms ``time.sleep``, never a blocking ``Barrier()``: Open MPI's blocking wait
busy-polls, and a rank spinning in it while others call it would take a core from its own
RPC threads (on a 2-core machine that costs milliseconds per call). Warm-up calls (to every
target) precede the timed repetitions. After each row rank 0 gathers every rank's samples with
MPI and rewrites the JSON, so a crash keeps what was measured; before a row it marks that row
as unfinished, so a job killed by the watchdog leaves a JSON that says where it stopped. Every
blocking step runs under a watchdog that dumps all stacks and calls ``MPI_Abort``, so a hang
cannot block the machine. If an implementation fails to start, or a call fails, its values
are null and the row has an ``errors`` entry.

The JSON has the machine, the software versions, the git commit and the state of the
working tree's ``mpidag/``, the configuration, every repetition's per-caller samples, the
medians and ``mpidag_vs_torch`` = mpidag / torch (below 1 means mpidag has the smaller
number: better for µs, worse for calls/s).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import functools
import json
import os
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402 - after the path set-up
    RPC_TIMEOUT_S,
    Watchdog,
    git_info,
    machine_info,
    ratio,
    selected_impls,
    sleepy_barrier,
    start_torch_rpc,
    wait_request,
)
from _common import log as _log  # noqa: E402

#: progress lines on stderr, tagged ``[scaling HH:MM:SS]``
log = functools.partial(_log, tag="scaling")

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

#: Implementation keys as they appear in the JSON, in the order they are run.
IMPL_KEYS: dict[str, str] = {"torch": "torch_rpc", "mpidag": "mpidag"}

PATTERNS: dict[str, str] = {
    "one_server": "ranks 1..N-1 all call rank 0, which only serves",
    "all_to_all": "every rank calls every other rank in round robin",
    "lifecycle": "init_rpc and graceful shutdown on every rank at once",
}
METRICS: dict[str, tuple[str, str, str]] = {
    # metric -> (unit, better, description)
    "rtt_us": ("us", "lower",
               "rpc_sync no-op: mean us per round trip of each caller; median over callers, "
               "then median over repetitions"),
    "calls_per_s": ("calls/s", "higher",
                    "rpc_async no-op in batches waited with fut.wait(): calls/s of each "
                    "caller summed over callers; median over repetitions"),
    "init_s": ("s", "lower", "init_rpc, from a barrier until it returned on the slowest rank"),
    "shutdown_s": ("s", "lower",
                   "graceful shutdown(), from a barrier until it returned on the slowest rank"),
}
#: the lifecycle pattern's metrics, and the call patterns' (see ROWS)
LIFECYCLE_METRICS = ("init_s", "shutdown_s")


# --------------------------------------------------------------------------------------------
# Remote function: module level in ``__main__`` on every rank, so both RPC libraries find it.
# --------------------------------------------------------------------------------------------


def noop() -> None:
    """Do nothing; the payload of every call."""
    return None


# --------------------------------------------------------------------------------------------
# Coordination (the watchdog, the barrier without busy-polling: _common.py)
# --------------------------------------------------------------------------------------------


def allreduce_max_float(comm: MPI.Comm, value: float) -> float:
    """Maximum of a ``float`` over ``comm`` (the slowest rank's time)."""
    send = torch.tensor([value], dtype=torch.float64).numpy()
    recv = send.copy()
    wait_request(comm.Iallreduce(send, recv, op=MPI.MAX))
    return float(recv[0])


def allreduce_min(comm: MPI.Comm, value: int) -> int:
    """Minimum of an ``int`` over ``comm`` (used to agree that every rank started)."""
    send = torch.tensor([value], dtype=torch.int64).numpy()
    recv = send.copy()
    wait_request(comm.Iallreduce(send, recv, op=MPI.MIN))
    return int(recv[0])


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """Run-wide settings derived from the command line.

    ``rtt_*``: warm-up calls, repetitions and timed sequential calls per caller and repetition
    of the round-trip rows. ``async_*``: warm-up calls, repetitions, calls in flight per batch
    and batches per caller and repetition of the calls/s rows.
    """

    quick: bool
    row_timeout: float
    rtt_warmup: int
    rtt_reps: int
    rtt_calls: int
    async_warmup: int
    async_reps: int
    async_batch: int
    async_batches: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Config:
        """Full settings, or the reduced ``--quick`` ones."""
        if args.quick:
            return cls(quick=True, row_timeout=args.row_timeout,
                       rtt_warmup=20, rtt_reps=3, rtt_calls=100,
                       async_warmup=200, async_reps=3, async_batch=500, async_batches=1)
        return cls(quick=False, row_timeout=args.row_timeout,
                   rtt_warmup=100, rtt_reps=7, rtt_calls=1000,
                   async_warmup=1000, async_reps=5, async_batch=1000, async_batches=3)

    def as_json(self) -> dict[str, Any]:
        """The settings as recorded in the JSON."""
        return {
            "rtt": {"warmup_calls": self.rtt_warmup, "reps": self.rtt_reps,
                    "calls_per_caller_per_rep": self.rtt_calls},
            "async": {"warmup_calls": self.async_warmup, "reps": self.async_reps,
                      "batch": self.async_batch, "batches_per_caller_per_rep":
                      self.async_batches},
            "torch_num_worker_threads": 16,
            "rpc_timeout_s": RPC_TIMEOUT_S,
            "barrier": "Ibarrier polled with Test() and time.sleep(1e-3)",
        }


# --------------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------------


def start_mpidag(comm: MPI.Comm) -> ModuleType:
    """``mpidag.rpc.init_rpc()`` with no arguments (rank and size from ``COMM_WORLD``)."""
    if str(REPO_ROOT) not in sys.path:
        # `python benchmarks/bench_scaling.py` puts benchmarks/ first on sys.path, not the
        # repository; measure this checkout's mpidag even when it is not pip-installed.
        sys.path.insert(0, str(REPO_ROOT))
    import mpidag.rpc as rpc

    rpc.init_rpc()
    return rpc


STARTERS: dict[str, Callable[[MPI.Comm], ModuleType]] = {
    "torch_rpc": start_torch_rpc,
    "mpidag": start_mpidag,
}


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------


def callers_of(pattern: str, size: int) -> list[int]:
    """Ranks that issue calls in ``pattern``."""
    return list(range(1, size)) if pattern == "one_server" else list(range(size))


def targets_of(pattern: str, rank: int, size: int) -> list[str]:
    """Worker names that ``rank`` calls in ``pattern``, in its round-robin order."""
    if pattern == "one_server":
        return ["worker0"]
    return [f"worker{(rank + k) % size}" for k in range(1, size)]


def rtt_batch(rpc: ModuleType, targets: list[str], n: int) -> None:
    """``n`` sequential ``rpc_sync`` no-op calls, round robin over ``targets``."""
    rpc_sync, k = rpc.rpc_sync, len(targets)
    for i in range(n):
        rpc_sync(targets[i % k], noop, timeout=RPC_TIMEOUT_S)


def async_batches(rpc: ModuleType, targets: list[str], batch: int, batches: int) -> None:
    """``batches`` times: ``batch`` ``rpc_async`` no-op calls round robin over ``targets``,
    then ``fut.wait()`` on each."""
    rpc_async, k = rpc.rpc_async, len(targets)
    for _ in range(batches):
        futs = [rpc_async(targets[i % k], noop, timeout=RPC_TIMEOUT_S) for i in range(batch)]
        for fut in futs:
            fut.wait()


@dataclass
class RowResult:
    """One implementation's result for one row (rank 0): value, samples, errors."""

    value: float | None
    samples: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def run_row(rpc: ModuleType, comm: MPI.Comm, cfg: Config, pattern: str, metric: str
            ) -> RowResult | None:
    """Measure one row on every rank (collective); rank 0 returns the result.

    Every rank goes through the same barriers whatever happens, so a failing call on one
    rank is recorded instead of leaving the others waiting.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    callers = callers_of(pattern, size)
    targets = targets_of(pattern, rank, size)
    is_caller = rank in callers
    error: str | None = None
    per_rep: list[float] = []  # this caller's sample per repetition
    stamps: list[tuple[float, float]] = []  # (start, end) on the monotonic clock
    if metric == "rtt_us":
        reps, calls = cfg.rtt_reps, cfg.rtt_calls
        warm: Callable[[], None] = lambda: rtt_batch(
            rpc, targets, max(cfg.rtt_warmup, 2 * len(targets)))
        timed: Callable[[], None] = lambda: rtt_batch(rpc, targets, calls)
    else:
        reps, calls = cfg.async_reps, cfg.async_batch * cfg.async_batches
        warm = lambda: async_batches(
            rpc, targets, max(cfg.async_warmup, 2 * len(targets)), 1)
        timed = lambda: async_batches(rpc, targets, cfg.async_batch, cfg.async_batches)

    sleepy_barrier(comm)
    if is_caller:
        try:
            warm()
        except Exception as exc:  # noqa: BLE001 - recorded, the barriers go on
            error = f"rank {rank} warm-up: {exc!r}"
    for _ in range(reps):
        sleepy_barrier(comm)
        if is_caller and error is None:
            t0 = time.monotonic()
            try:
                timed()
            except Exception as exc:  # noqa: BLE001 - recorded, the barriers go on
                error = f"rank {rank}: {exc!r}"
            else:
                t1 = time.monotonic()
                stamps.append((t0, t1))
                per_rep.append(1e6 * (t1 - t0) / calls if metric == "rtt_us"
                               else calls / (t1 - t0))
        sleepy_barrier(comm)
    gathered = comm.gather(
        {"rank": rank, "caller": is_caller, "per_rep": per_rep, "stamps": stamps,
         "error": error}, root=0)
    if rank != 0:
        return None
    assert gathered is not None
    return summarize(gathered, metric, reps, calls)


def summarize(gathered: list[dict[str, Any]], metric: str, reps: int, calls: int
              ) -> RowResult:
    """Turn every rank's samples into the row's value (rank 0)."""
    callers = [g for g in gathered if g["caller"]]
    errors = [g["error"] for g in gathered if g["error"]]
    per_caller = {str(g["rank"]): g["per_rep"] for g in callers}
    samples: dict[str, Any] = {"per_caller": per_caller, "calls_per_caller_per_rep": calls}
    if errors or any(len(g["per_rep"]) != reps for g in callers):
        return RowResult(None, samples, errors or ["missing samples"])
    if metric == "rtt_us":
        rep_values = [statistics.median(g["per_rep"][r] for g in callers) for r in range(reps)]
    else:
        rep_values = [sum(g["per_rep"][r] for g in callers) for r in range(reps)]
        wall = []
        for r in range(reps):
            start = min(g["stamps"][r][0] for g in callers)
            end = max(g["stamps"][r][1] for g in callers)
            wall.append(len(callers) * calls / (end - start))
        samples["aggregate_wall_per_rep"] = wall
        samples["aggregate_wall_calls_per_s"] = statistics.median(wall)
    samples["per_rep"] = rep_values
    return RowResult(statistics.median(rep_values), samples)


#: (pattern, metric) in the order they are measured; row name = f"{pattern}_{metric}"
ROWS: list[tuple[str, str]] = [(p, m) for p in PATTERNS for m in METRICS
                               if (p == "lifecycle") == (m in LIFECYCLE_METRICS)]


def row_name(pattern: str, metric: str) -> str:
    """JSON key of a row."""
    return f"{pattern}_{metric}"


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def build_report(measured: dict[str, dict[str, RowResult]], cfg: Config, size: int,
                 previous: dict[str, Any] | None, extra: dict[str, Any]) -> dict[str, Any]:
    """Assemble the JSON document; with ``previous``, keep its values for impls not run now."""
    rows: dict[str, Any] = {}
    for pattern, metric in ROWS:
        name = row_name(pattern, metric)
        unit, better, description = METRICS[metric]
        prev = (previous or {}).get("rows", {}).get(name, {})
        entry: dict[str, Any] = {"pattern": pattern, "metric": metric, "ranks": size,
                                 "unit": unit, "better": better}
        samples: dict[str, Any] = {}
        errors: dict[str, list[str]] = {}
        for impl in IMPL_KEYS.values():
            res = measured.get(impl, {}).get(name)
            if res is None and impl not in measured and prev:
                entry[impl] = prev.get(impl)
                if impl in prev.get("samples", {}):
                    samples[impl] = prev["samples"][impl]
                if impl in prev.get("errors", {}):
                    errors[impl] = prev["errors"][impl]
                continue
            entry[impl] = None if res is None else res.value
            if res is not None:
                samples[impl] = res.samples
                if res.errors:
                    errors[impl] = res.errors
        entry["mpidag_vs_torch"] = ratio(entry["mpidag"], entry["torch_rpc"])
        if metric == "calls_per_s":
            entry["aggregate_wall_calls_per_s"] = {
                impl: samples.get(impl, {}).get("aggregate_wall_calls_per_s")
                for impl in IMPL_KEYS.values()}
        entry["samples"] = samples
        if errors:
            entry["errors"] = errors
        entry["description"] = f"{PATTERNS[pattern]}; {description}"
        rows[name] = entry
    return {
        "benchmark": "bench_scaling.py",
        "ranks": size,
        "machine": machine_info(),
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "quick": cfg.quick,
        "config": cfg.as_json(),
        **extra,
        "impls_run": sorted(measured),
        "rows": rows,
    }


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Write ``report`` atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)


def run_impl(key: str, comm: MPI.Comm, cfg: Config,
             on_row: Callable[[dict[str, RowResult]], None]) -> dict[str, RowResult] | None:
    """Start one implementation, measure every row, shut it down; rank 0 returns the rows.

    ``on_row`` (rank 0) receives the results so far before and after each row, so that the
    JSON on disk always says how far the run got.
    """
    rank = comm.Get_rank()
    results: dict[str, RowResult] = {}
    if rank == 0:
        log(f"{key}: init on {comm.Get_size()} ranks")
    ok, rpc = 1, None
    sleepy_barrier(comm)
    start = time.perf_counter()
    try:
        with Watchdog(300, f"{key} init"):
            rpc = STARTERS[key](comm)
    except Exception as exc:  # noqa: BLE001 - report and skip this implementation
        sys.stderr.write(f"[scaling rank {rank}] {key}: init failed: {exc!r}\n")
        ok = 0
    init_s = time.perf_counter() - start
    with Watchdog(300, f"{key} init agreement"):
        all_ok = allreduce_min(comm, ok)
        slowest_init = allreduce_max_float(comm, init_s)
    if all_ok == 0 or rpc is None:
        if ok and rpc is not None:
            with contextlib.suppress(Exception):
                rpc.shutdown(graceful=False)
        if rank != 0:
            return None
        log(f"{key}: skipped (init failed on some rank)")
        return {row_name(p, m): RowResult(None, errors=["init failed on some rank"])
                for p, m in ROWS}

    if rank == 0:
        results[row_name("lifecycle", "init_s")] = RowResult(slowest_init)
        log(f"{key}: init_rpc took {slowest_init:.2f} s on the slowest rank")
    for pattern, metric in ROWS:
        if pattern == "lifecycle":
            continue
        name = row_name(pattern, metric)
        if rank == 0:
            results[name] = RowResult(None, errors=[
                "did not finish: the job stopped during this row (watchdog or crash)"])
            on_row(results)
        t0 = time.perf_counter()
        with Watchdog(cfg.row_timeout, f"{key} {name}"):
            res = run_row(rpc, comm, cfg, pattern, metric)
        if rank == 0:
            assert res is not None
            results[name] = res
            on_row(results)
            unit = METRICS[metric][0]
            shown = "FAILED " + "; ".join(res.errors) if res.value is None else (
                f"{res.value:,.1f} {unit}")
            log(f"{key}: {name} = {shown}  [{time.perf_counter() - t0:.1f} s]")
    if rank == 0:
        log(f"{key}: shutdown")
    sleepy_barrier(comm)
    start = time.perf_counter()
    with Watchdog(300, f"{key} shutdown"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        rpc.shutdown()
    slowest_shutdown = allreduce_max_float(comm, time.perf_counter() - start)
    if rank == 0:
        results[row_name("lifecycle", "shutdown_s")] = RowResult(slowest_shutdown)
        log(f"{key}: shutdown took {slowest_shutdown:.2f} s on the slowest rank")
        on_row(results)
    return results if rank == 0 else None


def format_cell(v: float | None) -> str:
    """A table cell: no decimals from 1,000 on, one decimal below."""
    if v is None:
        return "–"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def _summary_cell(values: list[float | None], failed: bool, fmt: Callable[[float], str]
                  ) -> str:
    """One run's value, or the median of several runs' values with their range."""
    got = [v for v in values if v is not None]
    if not got:
        return "failed" if failed else "–"
    if len(values) == 1:
        return fmt(got[0])
    text = f"{fmt(statistics.median(got))} ({fmt(min(got))}–{fmt(max(got))})"
    return text if len(got) == len(values) else f"{text}, {len(got)} of {len(values)} runs"


def markdown_table(reports: list[dict[str, Any]]) -> str:
    """One markdown table of the rows of several runs: pattern x metric x ranks.

    Runs with the same number of ranks are combined: each cell is the median over the runs
    with the range in brackets, and ``mpidag_vs_torch`` is the median of the per-run ratios.
    """
    header = "| pattern | metric | ranks | torch_rpc | mpidag | mpidag_vs_torch |"
    lines = [header, "| --- | --- | ---: | ---: | ---: | ---: |"]
    by_size: dict[int, list[dict[str, Any]]] = {}
    for rep in reports:
        by_size.setdefault(int(rep["ranks"]), []).append(rep)
    for pattern, metric in ROWS:
        name = row_name(pattern, metric)
        for size in sorted(by_size):
            entries = [r["rows"][name] for r in by_size[size] if name in r["rows"]]
            if not entries:
                continue
            cells = [
                _summary_cell([e.get(impl) for e in entries],
                              any(impl in e.get("errors", {}) for e in entries), format_cell)
                for impl in IMPL_KEYS.values()
            ]
            ratio = _summary_cell([e.get("mpidag_vs_torch") for e in entries], False,
                                  lambda v: f"{v:.2f}x")
            unit, better = entries[0]["unit"], entries[0]["better"]
            lines.append(f"| {pattern} | {metric} ({unit}, {better} is better) | {size} | "
                         f"{' | '.join(cells)} | {ratio} |")
    return "\n".join(lines)


def merge_table(paths: list[Path]) -> int:
    """Print the markdown table of ``paths`` (default: every ``results/scaling_*.json``),
    then one line per run (date, ``--quick``, load average)."""
    if not paths:
        paths = sorted(RESULTS_DIR.glob("scaling_*.json"),
                       key=lambda p: int(m.group(1)) if (m := re.search(r"(\d+)", p.stem))
                       else 0)
    reports = [json.loads(p.read_text()) for p in paths if p.exists()]
    if not reports:
        sys.stderr.write("no scaling_*.json found; run the benchmark first\n")
        return 1
    print(markdown_table(reports))
    print()
    for rep in sorted(reports, key=lambda r: (r["ranks"], r["date"])):
        m = rep["machine"]
        quick = " --quick" if rep.get("quick") else ""
        print(f"- {rep['ranks']} ranks: {rep['date']}{quick}, 1-min load average "
              f"{m.get('loadavg_at_start', ['?'])[0]} at start, {m['loadavg_at_end'][0]} at end")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="torch,mpidag",
                   help="comma-separated subset of torch,mpidag (default: both)")
    p.add_argument("--quick", action="store_true", help="fewer calls and repetitions")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON output path (default: benchmarks/results/scaling_{N}.json)")
    p.add_argument("--merge", action="store_true",
                   help="keep the values of implementations not run now from the existing --out")
    p.add_argument("--row-timeout", type=float, default=600.0,
                   help="abort the job if one row takes longer than this (seconds, default 600)")
    p.add_argument("--merge-table", nargs="*", type=Path, default=None, metavar="JSON",
                   help="no benchmark: print the markdown table of these JSON files "
                        "(default: every benchmarks/results/scaling_*.json); no mpirun needed")
    args = p.parse_args(argv)
    args.impls = selected_impls(p, args.only, IMPL_KEYS)
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point on every rank (or, with ``--merge-table``, in one plain process)."""
    args = parse_args(argv)
    if args.merge_table is not None:
        return merge_table(args.merge_table)
    world = MPI.COMM_WORLD
    size = world.Get_size()
    if size < 2:
        sys.stderr.write("bench_scaling.py needs at least 2 MPI ranks "
                         "(python -m mpidag.run -n 4 benchmarks/bench_scaling.py)\n")
        return 2
    comm = world.Dup()  # private context for the benchmark's barriers and gathers
    rank = comm.Get_rank()
    cfg = Config.from_args(args)
    out: Path = args.out or RESULTS_DIR / f"scaling_{size}.json"

    previous = None
    extra: dict[str, Any] = {}
    load_before = [round(x, 2) for x in os.getloadavg()]
    affinity = comm.gather(sorted(os.sched_getaffinity(0)), root=0)
    if rank == 0:
        if load_before[0] > 0.5:
            log(f"WARNING: 1-minute load average is {load_before[0]:.2f} before starting; "
                "other processes compete for the cores and the numbers will be noisy")
        if args.merge and out.exists():
            previous = json.loads(out.read_text())
        extra = {"git": git_info(), "command": " ".join(sys.argv)}
    measured: dict[str, dict[str, RowResult]] = {}
    report: dict[str, Any] = {}

    def save(key: str, rows: dict[str, RowResult]) -> None:
        nonlocal report
        measured[key] = dict(rows)
        report = build_report(measured, cfg, size, previous, extra)
        report["machine"]["loadavg_at_start"] = load_before
        report["machine"]["cpu_affinity_per_rank"] = affinity
        if "mpidag" in sys.modules:  # which mpidag was measured
            report["git"]["mpidag_module"] = sys.modules["mpidag"].__file__
        write_json(out, report)

    for key in args.impls:
        res = run_impl(key, comm, cfg, lambda rows, key=key: save(key, rows))
        if rank == 0 and res is not None:
            save(key, res)
        with Watchdog(cfg.row_timeout, f"after {key}"):
            sleepy_barrier(comm)
    if rank == 0:
        print(markdown_table([report]), flush=True)
        log(f"wrote {out}")
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
