"""Soak run: mixed mpidag traffic on every rank for minutes, watching memory, throughput, leaks.

Run (4 ranks, 10 minutes; the issue 14 figures), then look at the table, JSON and PNG::

    python -m mpidag.run -n 4 benchmarks/soak.py --minutes 10
    python -m mpidag.run -n 4 benchmarks/soak.py --minutes 1 --out /tmp/soak.json --seed 7

Every rank loops until the time is up, each iteration one operation drawn at random (the
seed is chosen by rank 0 unless ``--seed``, printed, and each rank draws from
``random.Random(f"{seed}-{rank}")``) from this mix (weights in :data:`MIX`):

* ``sync``: ``rpc_sync`` to a random peer of a small (16 floats) or 64 KiB tensor, result
  checked;
* ``async``: 1-8 ``rpc_async`` calls to random peers, small or 64 KiB tensors, waited and
  checked;
* ``rref``: ``remote()`` on a random owner, then either passed to a third rank (a fork: it
  ``to_here()``s the value and drops the RRef) or not, ``to_here()`` here (or not), deleted;
* ``autograd``: a distributed autograd forward through this rank and 1-2 peers (each applies
  its own parameter), ``mpidag.autograd.backward``, the input's gradient checked;
* ``optim``: the same forward through 2 peers, backward, then a ``DistributedOptimizer`` (SGD)
  step over the parameters of all ranks (each rank owns one); every 25th ``optim`` on a rank
  builds a fresh optimizer for the step (local optimizer RRefs made and freed);
* ``error``: a call to a function that raises ``ValueError``; the type and message must arrive;
* ``timeout``: a call to a function that sleeps 0.25 s with ``timeout=0.05``: it must raise
  ``RPCTimeoutError``; the next call to that peer must get its own answer (the late one is
  dropped without harm).

Measured: each rank's resident memory (RSS, ``/proc/self/statm``) and iteration count every
``--sample-s`` seconds, the RSS growth per 1,000 of the rank's iterations (least-squares slope
after the first ``--warmup-s`` seconds; "flat" means below 1 MiB per 1,000), the iterations/s
of all ranks per interval (60 s, or 10 s for runs shorter than 3 minutes) and their
iterations per second of the ranks' CPU time (every thread; a machine loaded by something
else slows the first, not the second, so the second shows a job that slows itself), the
mean time per operation kind, the errors by type (expected ones apart; any unexpected one
fails the run) and, at the end, after ``testing.quiesce()``, the leak counters of every rank
(``testing.leak_report()``: RRefs, pending forks, calls in flight, autograd contexts and
passes, live send/recv functions) together with each rank's full runtime ``debug_info()``.

Output: a progress line per interval on stderr (rank 0 asks every rank with an RPC), a table
on stdout, the JSON ``--out`` (default ``benchmarks/results/soak.json``, every rank's time
series) and a PNG next to it (RSS and throughput over time). Exit status 0 when there was no
unexpected error and no leak, 1 otherwise. A watchdog dumps the stacks (and mpidag's state,
``SIGUSR1``) and aborts the job when no rank's iteration finishes for ``--stall-s`` seconds
or the run overshoots its time by 5 minutes.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import faulthandler
import gc
import json
import logging
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from mpi4py import MPI

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # measure this checkout's mpidag
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import git_info, machine_info, sleepy_barrier  # noqa: E402

import mpidag.autograd as dist_autograd  # noqa: E402 - after the path set-up
import mpidag.rpc as rpc  # noqa: E402
from mpidag import _runtime, testing  # noqa: E402
from mpidag.optim import DistributedOptimizer  # noqa: E402

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

#: operation kind -> weight in the random mix
MIX: dict[str, int] = {"sync": 30, "async": 20, "rref": 22, "autograd": 12, "optim": 8,
                       "error": 6, "timeout": 2}

SMALL = 16  # floats in a small tensor
BIG = 16 * 1024  # floats in a 64 KiB tensor
DIM = 8  # size of the autograd vectors; each rank's parameter is DIM x DIM
CALL_TIMEOUT_S = 60.0  # every ordinary call's timeout (a stuck call fails, never hangs)
SLEEP_S, SHORT_TIMEOUT_S = 0.25, 0.05  # the timeout operation
#: zero at the end too (besides testing.LEAK_COUNTERS), from each rank's runtime debug_info()
EXTRA_LEAK_COUNTERS = ("num_forks", "num_tombstones", "num_send_functions",
                       "num_recv_functions")
FLAT_MIB_PER_1000 = 1.0  # "flat" memory: growth per 1,000 iterations below this
PAGE = os.sysconf("SC_PAGE_SIZE")
MiB = 1024 * 1024


# --------------------------------------------------------------------------------------------
# Remote functions: module level in __main__ on every rank.
# --------------------------------------------------------------------------------------------

#: this rank's parameter (made in main); ``layer`` applies it, the optimizers update it
PARAM: torch.Tensor | None = None
#: this rank's live progress, read by ``stats()`` from rank 0
STATE: dict[str, Any] = {"iterations": 0, "unexpected": 0}


def echo(x: Any) -> Any:
    """Return the argument (``sync``/``async``; the timeout check's follow-up call)."""
    return x


def add_one(x: torch.Tensor) -> torch.Tensor:
    """``x + 1`` (a call whose answer differs from its request)."""
    return x + 1


def make_tensor(n: int, value: float) -> torch.Tensor:
    """A tensor of ``n`` copies of ``value`` (an RRef's value)."""
    return torch.full((n,), value)


def use_rref(rref: rpc.RRef) -> float:
    """On a third rank: fetch the forked RRef's value and drop the RRef; the value's sum."""
    return float(rref.to_here().sum())


def raise_value_error(token: str) -> None:
    """Raise ``ValueError`` naming ``token`` (the ``error`` operation)."""
    raise ValueError(f"soak error {token}")


def sleep_then(seconds: float, token: str) -> str:
    """Sleep, then return ``token`` (longer than the caller's timeout: the answer is late)."""
    time.sleep(seconds)
    return token


def get_param() -> torch.Tensor:
    """This rank's parameter (``remote(owner, get_param)`` makes an RRef of it)."""
    assert PARAM is not None
    return PARAM


def layer(x: torch.Tensor) -> torch.Tensor:
    """``tanh(W x)`` with this rank's parameter ``W``.

    ``W.clone()``: the product saves the clone, not ``W``, so another rank's optimizer step
    updating ``W`` in place between this forward and its backward is no autograd error (the
    gradient still reaches ``W`` through the clone).
    """
    assert PARAM is not None
    return torch.tanh(PARAM.clone() @ x)


def stats() -> dict[str, Any]:
    """This rank's iterations so far, RSS (bytes) and unexpected errors (for progress)."""
    return {"iterations": STATE["iterations"], "rss": rss_bytes(),
            "unexpected": STATE["unexpected"]}


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def rss_bytes() -> int:
    """Resident set size of this process, from ``/proc/self/statm`` (second field, pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def bounded_memories() -> dict[str, int]:
    """Entries in mpidag's bounded memories of freed RRef ids and released autograd context
    ids (each capped at 65,536): they grow with the traffic until full, so they show up as
    RSS growth in a soak shorter than it takes to fill them. Read-only, private attributes;
    empty where they do not exist.

    Example::

        >>> bounded_memories()
        {'freed_rref_ids': 23917, 'released_context_ids': 60210}
    """
    from mpidag import _runtime

    rt = _runtime.current()
    out: dict[str, int] = {}
    for name, obj in (("freed_rref_ids", getattr(rt.rrefs, "_freed", None)),
                      ("released_context_ids",
                       getattr(rt.autograd.container, "_released", None))):
        if obj is not None:
            out[name] = len(obj)
    return out


def log(msg: str) -> None:
    """A progress line on stderr."""
    sys.stderr.write(f"[soak {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


class SoakCheckError(AssertionError):
    """A wrong answer or an expected error that did not arrive as it should (unexpected)."""


def check(cond: bool, what: str) -> None:
    """Raise :class:`SoakCheckError` with ``what`` unless ``cond``."""
    if not cond:
        raise SoakCheckError(what)


class StallWatch:
    """Abort the job when this rank's loop makes no progress for ``stall_s`` seconds, or the
    whole run passes ``deadline`` (monotonic): stacks, mpidag's state (``SIGUSR1``), then
    ``MPI_Abort``, so a hang is diagnosed and cannot block the machine.

    Example::

        watch = StallWatch(60, time.monotonic() + 900); watch.start()
        ...; watch.beat()   # after each iteration
        watch.stop()
    """

    def __init__(self, stall_s: float, deadline: float) -> None:
        self.stall_s, self.deadline = stall_s, deadline
        self.last = time.monotonic()
        self.phase = "loop"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="soak-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def beat(self, phase: str | None = None) -> None:
        self.last = time.monotonic()
        if phase is not None:
            self.phase = phase

    def stop(self) -> None:
        self._stop.set()

    def _main(self) -> None:
        while not self._stop.wait(1.0):
            now = time.monotonic()
            why = None
            if now - self.last > self.stall_s:
                why = f"no progress for {now - self.last:.0f} s in phase '{self.phase}'"
            elif now > self.deadline:
                why = f"run overshot its deadline in phase '{self.phase}'"
            if why is None:
                continue
            rank = MPI.COMM_WORLD.Get_rank()
            sys.stderr.write(f"\n[soak rank {rank} pid {os.getpid()}] WATCHDOG: {why}; "
                             "thread stacks and mpidag state follow, then MPI_Abort\n")
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            if hasattr(signal, "SIGUSR1"):
                os.kill(os.getpid(), signal.SIGUSR1)  # mpidag's dump: calls in flight, RRefs
                time.sleep(2.0)
            MPI.COMM_WORLD.Abort(124)


# --------------------------------------------------------------------------------------------
# The operations
# --------------------------------------------------------------------------------------------


class Soak:
    """One rank's soak loop: the operations, the counters and the samples.

    Example::

        soak = Soak(rank=0, size=4, seed=1, param_rrefs=rrefs)
        soak.run(duration_s=60, interval_s=10, sample_s=1, watch=watch)
    """

    def __init__(self, rank: int, size: int, seed: int, param_rrefs: list[rpc.RRef],
                 inject_leak: bool = False) -> None:
        self.rank, self.size = rank, size
        self.rng = random.Random(f"{seed}-{rank}")
        torch.manual_seed(seed * 1009 + rank)
        self.peers = [r for r in range(size) if r != rank]
        self.param_rrefs = param_rrefs
        self.optimizer = DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=0.01)
        self.inject_leak = inject_leak
        self.kept: list[rpc.RRef] = []  # --inject-leak: RRefs deliberately never dropped
        self.ops: Counter[str] = Counter()
        self.op_time: Counter[str] = Counter()
        self.expected: Counter[str] = Counter()
        self.unexpected: Counter[str] = Counter()
        self.unexpected_samples: list[dict[str, str]] = []
        self.samples: list[tuple[float, int, int]] = []  # (t, iterations, rss bytes)
        self.interval_iters: list[int] = []
        self.interval_cpu: list[float] = []  # CPU seconds of this rank per interval
        self.optim_steps = 0
        self.token = 0
        self.kinds = list(MIX)
        self.weights = [MIX[k] for k in self.kinds]
        self.ops_fn: dict[str, Callable[[], None]] = {
            "sync": self.op_sync, "async": self.op_async, "rref": self.op_rref,
            "autograd": self.op_autograd, "optim": self.op_optim, "error": self.op_error,
            "timeout": self.op_timeout}

    def next_token(self) -> str:
        self.token += 1
        return f"r{self.rank}-{self.token}"

    def tensor(self) -> torch.Tensor:
        n = BIG if self.rng.random() < 0.3 else SMALL
        return torch.full((n,), float(self.rng.randint(0, 1000)))

    def op_sync(self) -> None:
        peer = self.rng.choice(self.peers)
        x = self.tensor()
        if self.rng.random() < 0.5:
            out = rpc.rpc_sync(peer, echo, args=(x,), timeout=CALL_TIMEOUT_S)
            check(torch.equal(out, x), f"echo from worker{peer} returned a different tensor")
        else:
            out = rpc.rpc_sync(peer, add_one, args=(x,), timeout=CALL_TIMEOUT_S)
            check(torch.equal(out, x + 1), f"add_one on worker{peer} returned a wrong tensor")

    def op_async(self) -> None:
        calls = []
        for _ in range(self.rng.randint(1, 8)):
            peer, x = self.rng.choice(self.peers), self.tensor()
            calls.append((peer, x, rpc.rpc_async(peer, add_one, args=(x,),
                                                 timeout=CALL_TIMEOUT_S)))
        for peer, x, fut in calls:
            check(torch.equal(fut.wait(), x + 1), f"rpc_async add_one on worker{peer}: wrong")

    def op_rref(self) -> None:
        owner = self.rng.choice(self.peers)
        n = BIG if self.rng.random() < 0.3 else SMALL
        value = float(self.rng.randint(0, 1000))
        rref = rpc.remote(owner, make_tensor, args=(n, value), timeout=CALL_TIMEOUT_S)
        if self.rng.random() < 0.6:  # fork: a third rank uses the RRef and drops it
            third = self.rng.choice([r for r in self.peers if r != owner])
            got = rpc.rpc_sync(third, use_rref, args=(rref,), timeout=CALL_TIMEOUT_S)
            check(got == n * value, f"worker{third} read a wrong value of worker{owner}'s RRef")
        if self.rng.random() < 0.8:
            out = rref.to_here(timeout=CALL_TIMEOUT_S)
            check(out.shape == (n,) and bool((out == value).all()),
                  f"to_here from worker{owner} returned a wrong value")
        if self.inject_leak and len(self.kept) < 3:
            self.kept.append(rref)
        del rref

    def _forward(self, path: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(DIM, requires_grad=True)
        h = x
        for r in path:
            h = rpc.rpc_sync(r, layer, args=(h,), timeout=CALL_TIMEOUT_S)
        loss = ((h - 0.5) ** 2).sum()
        return x, loss

    def op_autograd(self) -> None:
        path = self.rng.sample(self.peers, self.rng.randint(1, 2))
        if self.rng.random() < 0.5:
            path = [self.rank, *path]  # this rank's own parameter too (no RPC for it)
        with dist_autograd.context() as cid:
            x, loss = self._forward(path)
            dist_autograd.backward(cid, [loss])
            grads = dist_autograd.get_gradients(cid)
            check(x in grads and grads[x].shape == (DIM,) and bool(torch.isfinite(grads[x])
                                                                   .all()),
                  f"no finite gradient for the input after a backward through {path}")

    def op_optim(self) -> None:
        path = self.rng.sample(self.peers, 2)
        self.optim_steps += 1
        optimizer = self.optimizer
        if self.optim_steps % 25 == 0:
            optimizer = DistributedOptimizer(torch.optim.SGD, self.param_rrefs, lr=0.01)
        with dist_autograd.context() as cid:
            x, loss = self._forward(path)
            dist_autograd.backward(cid, [loss])
            optimizer.step(cid)
            check(x in dist_autograd.get_gradients(cid), "no gradient for the input")

    def op_error(self) -> None:
        peer, token = self.rng.choice(self.peers), self.next_token()
        try:
            rpc.rpc_sync(peer, raise_value_error, args=(token,), timeout=CALL_TIMEOUT_S)
        except ValueError as exc:
            check(f"soak error {token}" in str(exc),
                  f"remote ValueError from worker{peer} lost its message: {exc}")
            self.expected["ValueError (remote, expected)"] += 1
            return
        raise SoakCheckError(f"raise_value_error on worker{peer} did not raise")

    def op_timeout(self) -> None:
        peer, token = self.rng.choice(self.peers), self.next_token()
        try:
            rpc.rpc_sync(peer, sleep_then, args=(SLEEP_S, token), timeout=SHORT_TIMEOUT_S)
        except rpc.RPCTimeoutError:
            self.expected["RPCTimeoutError (expected)"] += 1
        else:
            raise SoakCheckError(f"a {SLEEP_S} s call to worker{peer} with timeout "
                                 f"{SHORT_TIMEOUT_S} s did not time out")
        follow = self.next_token()  # the late answer must not be taken for this one's
        got = rpc.rpc_sync(peer, echo, args=(follow,), timeout=CALL_TIMEOUT_S)
        check(got == follow, f"after a timeout, worker{peer} answered {got!r}, not {follow!r}")

    # ----------------------------------------------------------------------------------------

    def run(self, duration_s: float, interval_s: float, sample_s: float, watch: StallWatch,
            progress: Callable[[int, float], None] | None) -> None:
        """Loop over random operations for ``duration_s`` seconds (from now)."""
        n_intervals = max(1, round(duration_s / interval_s))
        self.interval_iters = [0] * n_intervals
        self.interval_cpu = [0.0] * n_intervals
        t0 = time.monotonic()
        cpu_before = time.process_time()
        end = t0 + duration_s
        self.samples.append((0.0, 0, rss_bytes()))
        next_sample, next_progress = t0 + sample_s, t0 + interval_s
        iterations = 0
        while True:
            now = time.monotonic()
            if now >= next_sample:
                self.samples.append((now - t0, iterations, rss_bytes()))
                next_sample += sample_s
            if progress is not None and now >= next_progress and now < end:
                progress(int(round((now - t0) / interval_s)), now - t0)
                next_progress += interval_s
            if now >= end:
                break
            kind = self.rng.choices(self.kinds, self.weights)[0]
            start = time.monotonic()
            try:
                self.ops_fn[kind]()
            except Exception as exc:  # noqa: BLE001 - counted; the run fails at the end
                name = type(exc).__name__
                self.unexpected[name] += 1
                STATE["unexpected"] += 1
                if len(self.unexpected_samples) < 20:
                    self.unexpected_samples.append({
                        "op": kind, "type": name, "message": str(exc)[:2000],
                        "traceback": traceback.format_exc()[-4000:],
                        "t": round(time.monotonic() - t0, 3)})
                    log(f"rank {self.rank}: UNEXPECTED {name} in '{kind}': {exc}")
            done = time.monotonic()
            self.ops[kind] += 1
            self.op_time[kind] += done - start
            iterations += 1
            STATE["iterations"] = iterations
            index = min(int((done - t0) / interval_s), n_intervals - 1)
            self.interval_iters[index] += 1
            cpu_now = time.process_time()  # every thread of the rank: the leader's polls too
            self.interval_cpu[index] += cpu_now - cpu_before
            cpu_before = cpu_now
            watch.beat()
        self.samples.append((time.monotonic() - t0, iterations, rss_bytes()))

    def summary(self) -> dict[str, Any]:
        """What this rank sends to rank 0 at the end."""
        return {
            "rank": self.rank,
            "iterations": sum(self.ops.values()),
            "ops": dict(self.ops),
            "mean_ms_per_op": {k: round(1e3 * self.op_time[k] / self.ops[k], 3)
                               for k in self.ops},
            "expected_errors": dict(self.expected),
            "unexpected_errors": dict(self.unexpected),
            "unexpected_samples": self.unexpected_samples,
            "samples": [[round(t, 3), i, r] for t, i, r in self.samples],
            "interval_iterations": self.interval_iters,
            "interval_cpu_s": [round(c, 4) for c in self.interval_cpu],
        }


# --------------------------------------------------------------------------------------------
# Analysis (rank 0)
# --------------------------------------------------------------------------------------------


def linear_slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ``ys`` over ``xs`` (``None`` with fewer than 2 distinct xs).

    Example::

        >>> linear_slope([0, 1, 2], [1, 3, 5])
        2.0
    """
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def rss_growth(samples: list[list[float]], warmup_s: float) -> dict[str, Any]:
    """RSS growth of one rank: MiB per 1,000 iterations (fit after ``warmup_s``) and more.

    Example::

        >>> rss_growth([[0, 0, 100 * MiB], [20, 1000, 101 * MiB], [30, 2000, 102 * MiB]], 10)
        {'MiB_per_1000_iterations': 1.0, ...}
    """
    after = [s for s in samples if s[0] >= warmup_s]
    slope = linear_slope([s[1] for s in after], [s[2] for s in after])
    return {
        "MiB_per_1000_iterations": None if slope is None else round(slope * 1000 / MiB, 4),
        "rss_start_MiB": round(samples[0][2] / MiB, 2),
        "rss_after_warmup_MiB": round(after[0][2] / MiB, 2) if after else None,
        "rss_end_MiB": round(samples[-1][2] / MiB, 2),
        "rss_max_MiB": round(max(s[2] for s in samples) / MiB, 2),
        "iterations_fitted": (after[-1][1] - after[0][1]) if after else 0,
        "samples_fitted": len(after),
    }


def build_report(per_rank: list[dict[str, Any]], leaks: dict[int, dict[str, int]],
                 debug: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The JSON document (rank 0)."""
    interval_s = meta["interval_s"]
    leaks = {r: dict(v) for r, v in leaks.items()}
    for d in debug:  # counters leak_report does not check: forks, tombstones, functions
        extra = {c: d[c] for c in EXTRA_LEAK_COUNTERS if d.get(c)}
        if extra:
            leaks.setdefault(d["rank"], {}).update(extra)
    n_int = len(per_rank[0]["interval_iterations"])
    intervals = []
    for k in range(n_int):
        its = [p["interval_iterations"][k] for p in per_rank]
        cpu = sum(p["interval_cpu_s"][k] for p in per_rank)
        intervals.append({"t_start_s": k * interval_s, "t_end_s": (k + 1) * interval_s,
                          "iterations_per_rank": its,
                          "iterations_per_s": round(sum(its) / interval_s, 2),
                          "cpu_s": round(cpu, 3),
                          "iterations_per_cpu_s": round(sum(its) / cpu, 2) if cpu else None})
    growth = {str(p["rank"]): rss_growth(p["samples"], meta["warmup_s"]) for p in per_rank}
    expected: Counter[str] = Counter()
    unexpected: Counter[str] = Counter()
    ops: Counter[str] = Counter()
    for p in per_rank:
        expected.update(p["expected_errors"])
        unexpected.update(p["unexpected_errors"])
        ops.update(p["ops"])
    rates = [i["iterations_per_s"] for i in intervals]
    slopes = [g["MiB_per_1000_iterations"] for g in growth.values()]
    verdict = {
        "unexpected_errors": sum(unexpected.values()),
        "leaks_zero": not leaks,
        "rss_flat": all(s is not None and s < FLAT_MIB_PER_1000 for s in slopes),
        "max_MiB_per_1000_iterations": max((s for s in slopes if s is not None), default=None),
        "throughput_last_over_first": round(rates[-1] / rates[0], 3) if rates[0] else None,
        "throughput_min_over_max": round(min(rates) / max(rates), 3) if max(rates) else None,
    }
    verdict["passed"] = verdict["unexpected_errors"] == 0 and verdict["leaks_zero"]
    return {
        "benchmark": "soak",
        **meta,
        "mix": MIX,
        "total_iterations": sum(p["iterations"] for p in per_rank),
        "ops": dict(ops),
        "intervals": intervals,
        "rss_growth": growth,
        "flat_bound_MiB_per_1000_iterations": FLAT_MIB_PER_1000,
        "errors": {"expected": dict(expected), "unexpected": dict(unexpected)},
        "leaks": {str(r): v for r, v in leaks.items()},
        "leak_counters": [*testing.LEAK_COUNTERS, *EXTRA_LEAK_COUNTERS],
        "debug_info_end": debug,
        "verdict": verdict,
        "ranks": per_rank,
    }


def table(report: dict[str, Any]) -> str:
    """Markdown tables of the figures (stdout)."""
    lines = ["| rank | iterations | RSS start / after warm-up / end MiB | "
             "RSS growth MiB per 1,000 it. | leaks |",
             "| ---: | ---: | ---: | ---: | --- |"]
    for p in report["ranks"]:
        g = report["rss_growth"][str(p["rank"])]
        leak = report["leaks"].get(str(p["rank"])) or "0"
        lines.append(f"| {p['rank']} | {p['iterations']:,} | {g['rss_start_MiB']:.1f} / "
                     f"{g['rss_after_warmup_MiB']} / {g['rss_end_MiB']:.1f} | "
                     f"{g['MiB_per_1000_iterations']} | {leak} |")
    lines += ["", "| interval | iterations/s (all ranks) | iterations per CPU second |",
              "| --- | ---: | ---: |"]
    for i in report["intervals"]:
        per_cpu = i.get("iterations_per_cpu_s")
        lines.append(f"| {i['t_start_s']:.0f}-{i['t_end_s']:.0f} s | "
                     f"{i['iterations_per_s']:,.1f} | "
                     f"{'-' if per_cpu is None else f'{per_cpu:,.1f}'} |")
    v, e = report["verdict"], report["errors"]
    lines += ["", f"operations: {report['ops']}",
              f"expected errors: {e['expected']}; unexpected errors: {e['unexpected'] or 0}",
              f"throughput last/first interval {v['throughput_last_over_first']}, "
              f"min/max {v['throughput_min_over_max']}; max RSS growth "
              f"{v['max_MiB_per_1000_iterations']} MiB per 1,000 iterations "
              f"({'flat' if v['rss_flat'] else 'NOT flat'}, bound {FLAT_MIB_PER_1000})",
              f"leak counters zero on every rank: {v['leaks_zero']}",
              f"soak {'PASSED' if v['passed'] else 'FAILED'} (seed {report['seed']})"]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """PNG: every rank's RSS over time, and the throughput of all ranks per interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for p in report["ranks"]:
        ts = [s[0] for s in p["samples"]]
        slope = report["rss_growth"][str(p["rank"])]["MiB_per_1000_iterations"]
        ax1.plot(ts, [s[2] / MiB for s in p["samples"]],
                 label=f"rank {p['rank']} ({slope} MiB / 1,000 it.)")
    ax1.axvline(report["warmup_s"], color="grey", ls=":", lw=1)
    ax1.set_ylabel("RSS (MiB)")
    ax1.set_title(f"mpidag soak: {report['world_size']} ranks, {report['minutes']} min, "
                  f"seed {report['seed']} (dotted: end of warm-up)")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    iv = report["intervals"]
    ax2.bar([i["t_start_s"] for i in iv], [i["iterations_per_s"] for i in iv],
            width=report["interval_s"] * 0.9, align="edge", color="tab:blue")
    ax2.set_ylabel("iterations/s, all ranks")
    ax2.set_xlabel("time (s)")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="length of the loop (default 10)")
    p.add_argument("--seed", type=int, default=None, help="seed of the mix (default: random)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "soak.json",
                   help="JSON path (default benchmarks/results/soak.json)")
    p.add_argument("--png", type=Path, default=None,
                   help="PNG path (default: --out with .png)")
    p.add_argument("--interval-s", type=float, default=None,
                   help="throughput interval (default 60 s; 10 s for runs under 3 minutes)")
    p.add_argument("--sample-s", type=float, default=1.0, help="RSS sampling period (1 s)")
    p.add_argument("--warmup-s", type=float, default=None,
                   help="samples before this are left out of the RSS fit "
                        "(default: 10 %% of the run, at least 10 s)")
    p.add_argument("--stall-s", type=float, default=120.0,
                   help="abort when a rank's iteration takes longer than this (default 120)")
    p.add_argument("--inject-leak", action="store_true",
                   help="keep 3 RRefs per rank alive (to see the leak check fail)")
    args = p.parse_args(argv)
    duration = args.minutes * 60
    if args.interval_s is None:
        args.interval_s = 60.0 if args.minutes >= 3 else 10.0
    if args.warmup_s is None:
        args.warmup_s = max(10.0, 0.1 * duration)
    if args.png is None:
        args.png = args.out.with_suffix(".png")
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point on every rank."""
    global PARAM
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    if world.Get_size() < 3:
        sys.stderr.write("soak.py needs at least 3 ranks (forks go to a third rank): "
                         "python -m mpidag.run -n 4 benchmarks/soak.py\n")
        return 2
    comm = world.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    seed = comm.bcast(args.seed if args.seed is not None else random.SystemRandom()
                      .randrange(1, 1_000_000) if rank == 0 else None, root=0)
    duration = args.minutes * 60
    watch = StallWatch(args.stall_s, time.monotonic() + duration + 300)
    watch.start()
    load_before = [round(x, 2) for x in os.getloadavg()]
    if rank == 0:
        log(f"{size} ranks, {args.minutes:g} min, seed {seed}, interval {args.interval_s:g} s, "
            f"1-min load average {load_before[0]}")
    # the callee logs every failing call as torch does; the mix's own errors would bury
    # the lines a failed run needs in its output
    logging.getLogger("mpidag.agent.agent").addFilter(
        lambda record: "soak error" not in record.getMessage())
    rpc.init_rpc()
    torch.manual_seed(seed * 1009 + rank)
    PARAM = (0.3 * torch.randn(DIM, DIM)).requires_grad_()
    sleepy_barrier(comm)  # every PARAM exists before anyone asks for it
    param_rrefs = [rpc.RRef(PARAM) if r == rank else rpc.remote(r, get_param)
                   for r in range(size)]
    soak = Soak(rank, size, seed, param_rrefs, inject_leak=args.inject_leak)
    sleepy_barrier(comm)
    watch.beat("loop")
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")

    def progress(k: int, t: float) -> None:
        try:
            others = [rpc.rpc_sync(r, stats, timeout=CALL_TIMEOUT_S) for r in range(1, size)]
        except Exception as exc:  # noqa: BLE001 - progress is best effort; counted below
            log(f"progress at {t:.0f} s: stats call failed: {exc!r}")
            soak.unexpected[f"{type(exc).__name__} (progress)"] += 1
            return
        every = [stats(), *others]
        its = sum(s["iterations"] for s in every)
        rss = " ".join(f"{s['rss'] / MiB:.0f}" for s in every)
        log(f"{t / 60:4.1f} min ({t:.0f} s): {its:,} iterations ({its / t:,.0f}/s overall), "
            f"RSS MiB by rank {rss}, unexpected errors {sum(s['unexpected'] for s in every)}")

    soak.run(duration, args.interval_s, args.sample_s, watch, progress if rank == 0 else None)

    # The end: drop every reference, then everything must be quiet and freed everywhere.
    watch.beat("quiesce")
    soak.optimizer = None  # type: ignore[assignment]
    soak.param_rrefs = []
    del param_rrefs
    gc.collect()
    testing.quiesce(120)
    watch.beat("leak report")
    leaks = testing.leak_report(120)
    watch.beat("gather")
    # every counter of the runtime (torch's _get_debug_info has torch's keys only)
    debug = {**_runtime.current().debug_info(), **bounded_memories()}
    sleepy_barrier(comm)
    per_rank = comm.gather(soak.summary(), root=0)
    debugs = comm.gather(debug, root=0)
    code = 0
    if rank == 0:
        assert per_rank is not None and debugs is not None
        meta = {
            "date": started, "command": " ".join(sys.argv), "seed": seed, "world_size": size,
            "minutes": args.minutes, "interval_s": args.interval_s, "sample_s": args.sample_s,
            "warmup_s": args.warmup_s, "inject_leak": args.inject_leak,
            "machine": {**machine_info(), "loadavg_at_start": load_before},
            "git": git_info(),
        }
        report = build_report(per_rank, leaks, debugs, meta)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        try:
            plot(report, args.png)
        except Exception as exc:  # noqa: BLE001 - the JSON is what counts
            log(f"could not draw {args.png}: {exc!r}")
        print(table(report), flush=True)
        log(f"wrote {args.out} and {args.png}")
        code = 0 if report["verdict"]["passed"] else 1
    code = comm.bcast(code, root=0)
    watch.beat("shutdown")
    soak.kept.clear()
    rpc.shutdown()
    watch.stop()
    comm.Free()
    return code


if __name__ == "__main__":
    sys.exit(main())
