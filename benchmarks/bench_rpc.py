"""Compare ``mpidag.rpc`` with ``torch.distributed.rpc`` (TensorPipe) and raw mpi4py.

Run on exactly two MPI ranks; rank 0 measures, rank 1 serves::

    python -m mpidag.run -n 2 benchmarks/bench_rpc.py [--quick] [--only mpidag,torch,raw]

The three implementations are measured back to back in the same two processes:

* ``raw_mpi``: mpi4py point to point on a private duplicate of ``COMM_WORLD``; rank 1 runs an
  echo loop (pickled ``send``/``recv`` for the round trip, ``Send``/``Recv`` of preallocated
  buffers for tensors). This is the floor that any RPC layer on MPI pays.
* ``torch_rpc``: ``torch.distributed.rpc`` with the TensorPipe backend over ``127.0.0.1``.
* ``mpidag``: ``mpidag.rpc`` with no arguments to ``init_rpc`` (rank and size from MPI).

For the RPC implementations rank 1 sits in ``rpc.shutdown()`` while rank 0 issues calls.
Rank 0 writes ``benchmarks/results/rpc.json`` (after every implementation, so a crash keeps
what was measured) and prints a table to stdout; progress goes to stderr.

To add a row, write a ``measure_*`` function taking ``(impl, cfg)`` and returning a
:class:`Measurement`, give the implementations the batch method it needs (the base class
answers ``None``, i.e. "not applicable", for anything it does not know), and append a
:class:`Row` to :data:`ROWS`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import threading
import time
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
    log,
    machine_info,
    ratio,
    selected_impls,
    start_torch_rpc,
    timed_allreduce_min,
    timed_barrier,
    timed_recv,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
DEFAULT_OUT = RESULTS_DIR / "rpc.json"

#: Implementation keys as they appear in the JSON, in the order they are run.
IMPL_KEYS: dict[str, str] = {"raw": "raw_mpi", "torch": "torch_rpc", "mpidag": "mpidag"}

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

#: the threads of rank 0 that call at once in the threaded row (each its own calls in turn:
#: while one waits for its answer another leads, so the answers are handed between threads)
CALLER_THREADS = 4

# Tags on the private benchmark communicator (raw MPI and coordination only).
_TAG_CMD = 11
_TAG_DATA = 12
_TAG_IDLE = 13


# --------------------------------------------------------------------------------------------
# Remote functions. They live at module level in ``__main__`` on both ranks, so RPC libraries
# that pickle functions by qualified name find them on the callee.
# --------------------------------------------------------------------------------------------


def noop() -> None:
    """Do nothing; the payload of the round-trip rows."""
    return None


def identity(x: torch.Tensor) -> torch.Tensor:
    """Return the argument unchanged; the payload of the echo rows."""
    return x


# Safety: every blocking step runs under _common.Watchdog, which aborts the whole MPI job.


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reps:
    """How to repeat one measurement: ``warmup`` untimed calls, then ``reps`` x ``calls``."""

    warmup: int
    reps: int
    calls: int


@dataclass
class Config:
    """Run-wide settings derived from the command line."""

    quick: bool = False
    idle_seconds: float = 2.0
    row_timeout: float = 600.0
    torch_transports: list[str] | None = None
    noop: Reps = Reps(warmup=200, reps=7, calls=2000)
    async_noop: Reps = Reps(warmup=500, reps=5, calls=5000)
    #: the threaded row: ``calls`` in all, shared by :data:`CALLER_THREADS` threads
    threaded_noop: Reps = Reps(warmup=400, reps=5, calls=4000)
    echo: dict[int, Reps] = field(default_factory=dict)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Config:
        """Full settings, or the reduced ``--quick`` ones (no 1 GiB, 3 repetitions)."""
        transports = [t for t in (args.torch_transports or "").split(",") if t] or None
        common: dict[str, Any] = {
            "idle_seconds": args.idle_seconds,
            "row_timeout": args.row_timeout,
            "torch_transports": transports,
        }
        if args.quick:
            return cls(
                quick=True,
                **common,
                noop=Reps(warmup=50, reps=3, calls=500),
                async_noop=Reps(warmup=100, reps=3, calls=1000),
                threaded_noop=Reps(warmup=100, reps=3, calls=1000),
                echo={
                    KiB: Reps(warmup=10, reps=3, calls=100),
                    MiB: Reps(warmup=2, reps=3, calls=5),
                    64 * MiB: Reps(warmup=1, reps=3, calls=1),
                },
            )
        return cls(
            quick=False,
            **common,
            echo={
                KiB: Reps(warmup=50, reps=7, calls=500),
                MiB: Reps(warmup=5, reps=7, calls=20),
                64 * MiB: Reps(warmup=1, reps=7, calls=1),
                GiB: Reps(warmup=1, reps=3, calls=1),
            },
        )


# --------------------------------------------------------------------------------------------
# Implementations. Rank 0 calls the *_batch methods; each returns the elapsed wall time in
# seconds for ``n`` operations, or None when the implementation has no such operation.
# --------------------------------------------------------------------------------------------


class Impl:
    """Common interface of the three implementations.

    Lifecycle, on both ranks: :meth:`start`, :meth:`idle_phase`, then rank 0 runs the rows
    and calls :meth:`stop` while rank 1 calls :meth:`serve` (which returns once rank 0 has
    stopped).
    """

    key = "?"

    def __init__(self, comm: MPI.Comm, cfg: Config) -> None:
        self.comm = comm
        self.cfg = cfg
        self.rank = comm.Get_rank()

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Initialise on this rank (collective over both ranks)."""

    def idle_phase(self, seconds: float) -> dict[str, float] | None:
        """Measure rank 1's CPU use while idle; rank 0 gets ``{"rank1": %, "rank0": %}``."""
        return None

    def serve(self) -> None:
        """Rank 1: serve requests until rank 0 calls :meth:`stop`."""

    def stop(self) -> None:
        """Rank 0: finish (rank 1's :meth:`serve` returns)."""

    def abandon(self) -> None:
        """Best-effort teardown after a failed :meth:`start` on either rank."""

    # -- operations (rank 0) --------------------------------------------------------------
    def noop_batch(self, n: int) -> float | None:
        """Time ``n`` sequential synchronous no-op round trips."""
        return None

    def async_noop_batch(self, n: int) -> float | None:
        """Time ``n`` no-op calls issued asynchronously, then waited for together."""
        return None

    def threaded_noop_batch(self, n: int) -> float | None:
        """Time ``n`` synchronous no-op round trips made by :data:`CALLER_THREADS` threads of
        rank 0 at once (``n / CALLER_THREADS`` each, one after another in each thread)."""
        return None

    def echo_batch(self, x: torch.Tensor, n: int, check: bool = False) -> float | None:
        """Time ``n`` sequential echoes of ``x``; with ``check``, verify the data came back."""
        return None

    def rref_batch(self, x: torch.Tensor, n: int, check: bool = False) -> float | None:
        """Time ``n`` sequential ``remote(identity, x).to_here()``; ``None`` if unsupported."""
        return None


class RawMPI(Impl):
    """mpi4py point to point on the private communicator; rank 1 runs an echo server."""

    key = "raw_mpi"

    def __init__(self, comm: MPI.Comm, cfg: Config) -> None:
        super().__init__(comm, cfg)
        self._bufs: dict[int, Any] = {}

    def _buf(self, nbytes: int) -> Any:
        if nbytes not in self._bufs:
            self._bufs.clear()  # keep at most one large buffer alive
            self._bufs[nbytes] = torch.empty(nbytes, dtype=torch.uint8).numpy()
        return self._bufs[nbytes]

    def idle_phase(self, seconds: float) -> dict[str, float] | None:
        """Rank 1 sits in a blocking ``comm.recv`` (as the echo server does between calls)."""
        if self.rank == 1:
            c0, w0 = time.process_time(), time.perf_counter()
            self.comm.recv(source=0, tag=_TAG_IDLE)
            c1, w1 = time.process_time(), time.perf_counter()
            self.comm.send(100.0 * (c1 - c0) / (w1 - w0), dest=0, tag=_TAG_IDLE)
            return None
        c0, w0 = time.process_time(), time.perf_counter()
        time.sleep(seconds)
        c1, w1 = time.process_time(), time.perf_counter()
        self.comm.send(None, dest=1, tag=_TAG_IDLE)
        rank1 = timed_recv(self.comm, 1, _TAG_IDLE, 60, "raw idle result")
        return {"rank1": float(rank1), "rank0": 100.0 * (c1 - c0) / (w1 - w0)}

    def serve(self) -> None:
        comm = self.comm
        while True:
            cmd = comm.recv(source=0, tag=_TAG_CMD)
            if cmd[0] == "stop":
                return
            if cmd[0] == "noop":
                for _ in range(cmd[1]):
                    obj = comm.recv(source=0, tag=_TAG_DATA)
                    comm.send(obj, dest=0, tag=_TAG_DATA)
            elif cmd[0] == "echo":
                buf = self._buf(cmd[1])
                for _ in range(cmd[2]):
                    comm.Recv(buf, source=0, tag=_TAG_DATA)
                    comm.Send(buf, dest=0, tag=_TAG_DATA)
            else:
                raise ValueError(f"raw MPI server: unknown command {cmd!r}")

    def stop(self) -> None:
        self.comm.send(("stop",), dest=1, tag=_TAG_CMD)

    def noop_batch(self, n: int) -> float | None:
        comm = self.comm
        comm.send(("noop", n), dest=1, tag=_TAG_CMD)
        t0 = time.perf_counter()
        for _ in range(n):
            comm.send(None, dest=1, tag=_TAG_DATA)
            comm.recv(source=1, tag=_TAG_DATA)
        return time.perf_counter() - t0

    def async_noop_batch(self, n: int) -> float | None:
        """``rpc_async``'s row written by hand on mpi4py, as the no-op row is (pickled
        ``send``/``recv``): ``n`` requests (a request id each) sent with ``isend``, a torch
        ``Future`` made for each, then the ``n`` answers received, each completing its
        future, and ``wait_all``; rank 1 answers each request as it comes (the no-op
        server's loop). One thread per rank and nothing else: no function reference,
        arguments, deadline, table of calls under a lock or progress thread, and so no
        overlap of the caller's sends with its receipts either (an RPC layer's progress
        thread receives answers while the caller still sends)."""
        comm, future = self.comm, torch.futures.Future
        comm.send(("noop", n), dest=1, tag=_TAG_CMD)
        t0 = time.perf_counter()
        pending: dict[int, torch.futures.Future] = {}
        sends = []
        for request_id in range(n):
            sends.append(comm.isend(request_id, dest=1, tag=_TAG_DATA))
            pending[request_id] = future()
        futures = list(pending.values())
        for _ in range(n):  # (an id answered twice, or never sent: KeyError)
            pending.pop(comm.recv(source=1, tag=_TAG_DATA)).set_result(None)
        MPI.Request.waitall(sends)
        torch.futures.wait_all(futures)
        return time.perf_counter() - t0

    def echo_batch(self, x: torch.Tensor, n: int, check: bool = False) -> float | None:
        comm = self.comm
        nbytes = x.numel() * x.element_size()
        src = x.view(torch.uint8).numpy()
        dst = self._buf(nbytes)
        comm.send(("echo", nbytes, n), dest=1, tag=_TAG_CMD)
        t0 = time.perf_counter()
        for _ in range(n):
            comm.Send(src, dest=1, tag=_TAG_DATA)
            comm.Recv(dst, source=1, tag=_TAG_DATA)
        elapsed = time.perf_counter() - t0
        if check and not torch.equal(torch.from_numpy(dst), x.view(torch.uint8)):
            raise AssertionError("raw MPI echo returned different bytes")
        return elapsed


class _RpcImpl(Impl):
    """Shared code of the two ``torch.distributed.rpc``-shaped implementations."""

    rpc: ModuleType

    def peer(self) -> str:
        """Name of the callee (rank 1)."""
        return "worker1"

    def idle_phase(self, seconds: float) -> dict[str, float] | None:
        """Both ranks idle for ``seconds`` between two barriers; rank 1 reports its CPU %."""
        timed_barrier(self.comm, 120, f"{self.key} idle start")
        c0, w0 = time.process_time(), time.perf_counter()
        time.sleep(seconds)
        c1, w1 = time.process_time(), time.perf_counter()
        pct = 100.0 * (c1 - c0) / (w1 - w0)
        timed_barrier(self.comm, 120, f"{self.key} idle end")
        if self.rank == 1:
            self.comm.send(pct, dest=0, tag=_TAG_IDLE)
            return None
        rank1 = timed_recv(self.comm, 1, _TAG_IDLE, 60, f"{self.key} idle result")
        return {"rank1": float(rank1), "rank0": pct}

    def serve(self) -> None:
        self.rpc.shutdown()

    def stop(self) -> None:
        self.rpc.shutdown()

    def abandon(self) -> None:
        try:
            self.rpc.shutdown(graceful=False)
        except Exception as exc:  # noqa: BLE001 - best effort
            sys.stderr.write(f"[bench] {self.key}: shutdown after failed init: {exc!r}\n")

    def noop_batch(self, n: int) -> float | None:
        rpc_sync, to = self.rpc.rpc_sync, self.peer()
        t0 = time.perf_counter()
        for _ in range(n):
            rpc_sync(to, noop, timeout=RPC_TIMEOUT_S)
        return time.perf_counter() - t0

    def async_noop_batch(self, n: int) -> float | None:
        rpc_async, to = self.rpc.rpc_async, self.peer()
        t0 = time.perf_counter()
        futs = [rpc_async(to, noop, timeout=RPC_TIMEOUT_S) for _ in range(n)]
        torch.futures.wait_all(futs)
        return time.perf_counter() - t0

    def threaded_noop_batch(self, n: int) -> float | None:
        rpc_sync, to = self.rpc.rpc_sync, self.peer()
        each = n // CALLER_THREADS
        start = threading.Barrier(CALLER_THREADS + 1)
        errors: list[BaseException] = []

        def caller() -> None:
            start.wait()
            try:
                for _ in range(each):
                    rpc_sync(to, noop, timeout=RPC_TIMEOUT_S)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the timing thread
                errors.append(exc)

        threads = [threading.Thread(target=caller, name=f"bench-caller-{i}")
                   for i in range(CALLER_THREADS)]
        for thread in threads:
            thread.start()
        start.wait()
        t0 = time.perf_counter()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - t0
        if errors:
            raise errors[0]
        return elapsed

    def echo_batch(self, x: torch.Tensor, n: int, check: bool = False) -> float | None:
        rpc_sync, to = self.rpc.rpc_sync, self.peer()
        y = None
        t0 = time.perf_counter()
        for _ in range(n):
            y = rpc_sync(to, identity, args=(x,), timeout=RPC_TIMEOUT_S)
        elapsed = time.perf_counter() - t0
        if check and not (isinstance(y, torch.Tensor) and torch.equal(y, x)):
            raise AssertionError(f"{self.key} echo returned a different tensor")
        return elapsed


    def rref_batch(self, x: torch.Tensor, n: int, check: bool = False) -> float | None:
        remote, to = self.rpc.remote, self.peer()
        y = None
        t0 = time.perf_counter()
        for _ in range(n):
            y = remote(to, identity, args=(x,), timeout=RPC_TIMEOUT_S).to_here(
                timeout=RPC_TIMEOUT_S)
        elapsed = time.perf_counter() - t0
        if check and not (isinstance(y, torch.Tensor) and torch.equal(y, x)):
            raise AssertionError(f"{self.key} remote().to_here() returned a different tensor")
        return elapsed


class TorchRPC(_RpcImpl):
    """``torch.distributed.rpc`` with TensorPipe; rendezvous on a port agreed through MPI."""

    key = "torch_rpc"

    def start(self) -> None:
        import torch.distributed.rpc as rpc

        self.rpc = rpc
        start_torch_rpc(self.comm, self.cfg.torch_transports)


class MpidagRPC(_RpcImpl):
    """``mpidag.rpc``, initialised with no arguments (rank and size from ``COMM_WORLD``)."""

    key = "mpidag"

    def start(self) -> None:
        if str(REPO_ROOT) not in sys.path:
            # `python benchmarks/bench_rpc.py` puts benchmarks/ first on sys.path, not the
            # repository; measure this checkout's mpidag even when it is not pip-installed.
            sys.path.insert(0, str(REPO_ROOT))
        import mpidag.rpc as rpc

        self.rpc = rpc
        rpc.init_rpc()


IMPLS: dict[str, type[Impl]] = {"raw_mpi": RawMPI, "torch_rpc": TorchRPC, "mpidag": MpidagRPC}


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------


@dataclass
class Measurement:
    """One implementation's result for one row: the headline value plus its raw samples."""

    value: float | None
    samples: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Row:
    """A benchmark row: name (JSON key), unit, which direction is better, and how to measure."""

    name: str
    unit: str
    better: str  # "lower" or "higher"
    measure: Callable[[Impl, Config], Measurement]
    description: str


def _repeat(batch: Callable[[int], float | None], r: Reps) -> list[float] | None:
    """Run ``warmup`` untimed operations, then ``reps`` timed batches; seconds per batch."""
    if r.warmup and batch(r.warmup) is None:
        return None
    times = []
    for _ in range(r.reps):
        t = batch(r.calls)
        if t is None:
            return None
        times.append(t)
    return times


def measure_rtt_noop(impl: Impl, cfg: Config) -> Measurement:
    """Median microseconds per synchronous no-op round trip."""
    times = _repeat(impl.noop_batch, cfg.noop)
    if times is None:
        return Measurement(None)
    per_call = [1e6 * t / cfg.noop.calls for t in times]
    return Measurement(statistics.median(per_call), per_call, {"calls_per_rep": cfg.noop.calls})


def measure_async_rate(impl: Impl, cfg: Config) -> Measurement:
    """Median no-op calls per second when ``calls`` are in flight at once."""
    times = _repeat(impl.async_noop_batch, cfg.async_noop)
    if times is None:
        return Measurement(None)
    rates = [cfg.async_noop.calls / t for t in times]
    return Measurement(
        statistics.median(rates), rates, {"calls_per_rep": cfg.async_noop.calls}
    )


def measure_threaded_rate(impl: Impl, cfg: Config) -> Measurement:
    """Median no-op ``rpc_sync`` calls per second of :data:`CALLER_THREADS` threads at once."""
    times = _repeat(impl.threaded_noop_batch, cfg.threaded_noop)
    if times is None:
        return Measurement(None)
    calls = cfg.threaded_noop.calls // CALLER_THREADS * CALLER_THREADS
    rates = [calls / t for t in times]
    return Measurement(statistics.median(rates), rates,
                       {"calls_per_rep": calls, "threads": CALLER_THREADS})


def make_echo_measure(nbytes: int, method: str = "echo_batch"
                      ) -> Callable[[Impl, Config], Measurement]:
    """Build the measure function of the ``nbytes`` echo row (float32 tensor, identity);
    ``method`` names the Impl batch method (``echo_batch`` or ``rref_batch``)."""

    def measure(impl: Impl, cfg: Config) -> Measurement:
        r = cfg.echo[nbytes]
        batch = getattr(impl, method)
        x = torch.arange(nbytes // 4, dtype=torch.float32)
        first = batch(x, 1, check=True)  # correctness check, also a warm-up call
        if first is None:
            return Measurement(None)
        rest = Reps(max(r.warmup - 1, 0), r.reps, r.calls)
        times = _repeat(lambda n: batch(x, n), rest)
        assert times is not None
        per_call = [t / r.calls for t in times]
        med = statistics.median(per_call)
        return Measurement(
            1e6 * med,
            [1e6 * t for t in per_call],
            {"GBps": 2 * nbytes / med / 1e9, "bytes": nbytes, "calls_per_rep": r.calls},
        )

    return measure


def _size_label(nbytes: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= size:
            return f"{nbytes // size}{unit}"
    return f"{nbytes}B"


ROWS: list[Row] = [
    Row("rtt_noop_us", "us", "lower", measure_rtt_noop,
        "rpc_sync of a no-op function: median microseconds per round trip"),
    Row("async_calls_per_s", "calls/s", "higher", measure_async_rate,
        "rpc_async of a no-op, N calls in flight then wait_all: median calls per second"),
    Row("threaded_calls_per_s", "calls/s", "higher", measure_threaded_rate,
        "rpc_sync of a no-op from 4 threads of rank 0 at once, each call after the last: "
        "median calls per second of all four"),
]
for _nbytes in (KiB, MiB, 64 * MiB, GiB):
    ROWS.append(Row(
        f"echo_{_size_label(_nbytes)}_us", "us", "lower", make_echo_measure(_nbytes),
        f"rpc_sync(identity, float32 tensor of {_size_label(_nbytes)}): median microseconds "
        "per round trip; GB/s = 2*bytes/time",
    ))
for _nbytes in (KiB, 64 * MiB):
    ROWS.append(Row(
        f"rref_{_size_label(_nbytes)}_us", "us", "lower",
        make_echo_measure(_nbytes, "rref_batch"),
        f"remote(identity, float32 tensor of {_size_label(_nbytes)}).to_here(): median "
        "microseconds per remote + fetch; GB/s = 2*bytes/time",
    ))
IDLE_ROW = Row("idle_cpu_percent", "%", "lower", lambda impl, cfg: Measurement(None),
               "CPU time of rank 1 (all threads) over ~2 s idle after init, % of one core")


def rows_for(cfg: Config) -> list[Row]:
    """The rows this run measures (``--quick`` drops the 1 GiB echo)."""
    sizes = {f"echo_{_size_label(n)}_us" for n in cfg.echo}
    return [r for r in ROWS if not r.name.startswith("echo_") or r.name in sizes]


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def run_impl(
    key: str, comm: MPI.Comm, cfg: Config, rows: list[Row]
) -> dict[str, Measurement] | None:
    """Run every row for one implementation; rank 0 returns row name -> Measurement."""
    rank = comm.Get_rank()
    impl = IMPLS[key](comm, cfg)
    if rank == 0:
        log(f"{key}: init")
    ok = 1
    try:
        with Watchdog(300, f"{key} init"):
            impl.start()
    except Exception as exc:  # noqa: BLE001 - report and skip this implementation
        sys.stderr.write(f"[bench rank {rank}] {key}: init failed: {exc!r}\n")
        ok = 0
    if timed_allreduce_min(comm, ok, 300, f"{key} init agreement") == 0:
        if ok:
            impl.abandon()
        if rank == 0:
            log(f"{key}: skipped (init failed on some rank)")
            return {r.name: Measurement(None, extra={"error": "init failed"}) for r in rows}
        return None

    with Watchdog(cfg.idle_seconds + 300, f"{key} idle"):
        idle = impl.idle_phase(cfg.idle_seconds)

    if rank == 1:
        # rank 0 needs at most row_timeout per row plus its shutdown
        with Watchdog(cfg.row_timeout * (len(rows) + 2), f"{key} serve/shutdown"):
            impl.serve()
        return None

    results: dict[str, Measurement] = {}
    if idle is not None:
        results[IDLE_ROW.name] = Measurement(
            idle["rank1"], [idle["rank1"]], {"rank0_percent": idle["rank0"]}
        )
        log(f"{key}: {IDLE_ROW.name} = {idle['rank1']:.2f} % (rank 0: {idle['rank0']:.2f} %)")
    else:
        results[IDLE_ROW.name] = Measurement(None)
    for row in rows:
        t0 = time.perf_counter()
        try:
            with Watchdog(cfg.row_timeout, f"{key} {row.name}"):
                m = row.measure(impl, cfg)
        except Exception as exc:  # noqa: BLE001 - record the failure and go on
            m = Measurement(None, extra={"error": repr(exc)})
            log(f"{key}: {row.name} FAILED: {exc!r}")
        else:
            extra = f" ({m.extra['GBps']:.3f} GB/s)" if "GBps" in m.extra else ""
            shown = "n/a" if m.value is None else f"{m.value:.6g} {row.unit}{extra}"
            log(f"{key}: {row.name} = {shown}  [{time.perf_counter() - t0:.1f} s]")
        results[row.name] = m
    log(f"{key}: shutdown")
    with Watchdog(300, f"{key} shutdown"):
        impl.stop()
    return results


def build_report(
    measured: dict[str, dict[str, Measurement]],
    rows: list[Row],
    cfg: Config,
    previous: dict[str, Any] | None,
) -> dict[str, Any]:
    """Assemble the JSON document; with ``previous``, keep its values for impls not run now."""
    out_rows: dict[str, Any] = {}
    for row in [*ROWS, IDLE_ROW]:
        prev = (previous or {}).get("rows", {}).get(row.name, {})
        if row not in rows and row is not IDLE_ROW and not prev:
            continue  # not measured now (e.g. 1 GiB under --quick) and nothing to keep
        entry: dict[str, Any] = {"unit": row.unit, "better": row.better}
        gbps: dict[str, float | None] = {}
        samples: dict[str, list[float]] = {}
        errors: dict[str, str] = {}
        for impl in IMPL_KEYS.values():
            m = measured.get(impl, {}).get(row.name)
            if m is None and prev and (impl not in measured or row not in rows):
                entry[impl] = prev.get(impl)
                if prev.get("GBps", {}).get(impl) is not None:
                    gbps[impl] = prev["GBps"][impl]
                if prev.get("samples", {}).get(impl):
                    samples[impl] = prev["samples"][impl]
                if prev.get("rank0_percent", {}).get(impl) is not None:
                    entry.setdefault("rank0_percent", {})[impl] = prev["rank0_percent"][impl]
                continue
            entry[impl] = None if m is None else m.value
            if m is not None:
                if "GBps" in m.extra:
                    gbps[impl] = m.extra["GBps"]
                if m.samples:
                    samples[impl] = m.samples
                if "error" in m.extra:
                    errors[impl] = m.extra["error"]
                if "rank0_percent" in m.extra:
                    entry.setdefault("rank0_percent", {})[impl] = m.extra["rank0_percent"]
        entry["mpidag_vs_torch"] = ratio(entry["mpidag"], entry["torch_rpc"])
        entry["mpidag_vs_raw"] = ratio(entry["mpidag"], entry["raw_mpi"])
        if row.name.startswith("echo_"):
            entry["GBps"] = {k: gbps.get(k) for k in IMPL_KEYS.values()}
        entry["samples"] = samples
        if errors:
            entry["errors"] = errors
        entry["description"] = row.description
        out_rows[row.name] = entry
    return {
        "machine": machine_info(),
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "quick": cfg.quick,
        "config": {
            "torch_transports": cfg.torch_transports or "tensorpipe default",
            "torch_num_worker_threads": 16,
            "rpc_timeout_s": RPC_TIMEOUT_S,
            "idle_seconds": cfg.idle_seconds,
        },
        "impls_run": sorted(measured),
        "rows": out_rows,
    }


def format_table(report: dict[str, Any]) -> str:
    """Render the report as a plain-text table."""
    def cell(v: float | None, g: float | None = None) -> str:
        if v is None:
            return "-"
        s = f"{v:,.1f}" if abs(v) >= 100 else f"{v:.3g}"
        return s + (f" ({g:.2f} GB/s)" if g is not None else "")

    header = ["row", "unit", "raw_mpi", "torch_rpc", "mpidag", "mpidag/torch", "mpidag/raw"]
    lines = [header]
    for name, e in report["rows"].items():
        g = e.get("GBps", {})
        lines.append([
            name, e["unit"], cell(e["raw_mpi"], g.get("raw_mpi")),
            cell(e["torch_rpc"], g.get("torch_rpc")), cell(e["mpidag"], g.get("mpidag")),
            "-" if e["mpidag_vs_torch"] is None else f"{e['mpidag_vs_torch']:.2f}x",
            "-" if e["mpidag_vs_raw"] is None else f"{e['mpidag_vs_raw']:.2f}x",
        ])
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    text = []
    for i, r in enumerate(lines):
        text.append("  ".join(c.ljust(w) if j < 2 else c.rjust(w)
                              for j, (c, w) in enumerate(zip(r, widths, strict=True))))
        if i == 0:
            text.append("  ".join("-" * w for w in widths))
    return "\n".join(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="raw,torch,mpidag",
                   help="comma-separated subset of raw,torch,mpidag (default: all three)")
    p.add_argument("--quick", action="store_true",
                   help="fewer repetitions and no 1 GiB echo")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"JSON output path (default: {DEFAULT_OUT})")
    p.add_argument("--merge", action="store_true",
                   help="keep the values of implementations not run now from the existing --out")
    p.add_argument("--idle-seconds", type=float, default=2.0,
                   help="length of the idle-CPU window (default 2)")
    p.add_argument("--torch-transports", default=None, metavar="LIST",
                   help="TensorPipe transports for torch_rpc, e.g. 'uv' (default: TensorPipe's "
                        "choice, which is the busy-polling 'shm' transport on one host)")
    p.add_argument("--row-timeout", type=float, default=600.0,
                   help="abort the job if one row takes longer than this (seconds, default 600)")
    args = p.parse_args(argv)
    args.impls = selected_impls(p, args.only, IMPL_KEYS)
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point on every rank."""
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        if world.Get_rank() == 0:
            sys.stderr.write("bench_rpc.py needs exactly 2 MPI ranks "
                             "(python -m mpidag.run -n 2 benchmarks/bench_rpc.py)\n")
        return 2
    comm = world.Dup()  # private context: raw-MPI traffic never meets an RPC library's
    rank = comm.Get_rank()
    cfg = Config.from_args(args)
    rows = rows_for(cfg)

    previous = None
    if rank == 0:
        load1 = os.getloadavg()[0]
        if load1 > 0.5:
            log(f"WARNING: 1-minute load average is {load1:.2f} before starting; other "
                "processes compete for the cores and the numbers will be noisy")
    if rank == 0 and args.merge and args.out.exists():
        previous = json.loads(args.out.read_text())

    measured: dict[str, dict[str, Measurement]] = {}
    report: dict[str, Any] = {}
    load_before = [round(x, 2) for x in os.getloadavg()]
    # CPU binding decides a lot on a small machine (mpirun binds ranks to cores unless
    # oversubscribed); record what each rank got.
    affinity = comm.gather(sorted(os.sched_getaffinity(0)), root=0)
    for key in args.impls:
        res = run_impl(key, comm, cfg, rows)
        if rank == 0 and res is not None:
            measured[key] = res
            report = build_report(measured, rows, cfg, previous)
            report["machine"]["loadavg_at_start"] = load_before
            report["machine"]["cpu_affinity_per_rank"] = affinity
            args.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.out.with_suffix(args.out.suffix + ".tmp")
            tmp.write_text(json.dumps(report, indent=2) + "\n")
            tmp.replace(args.out)
        timed_barrier(comm, cfg.row_timeout, f"after {key}")
    if rank == 0:
        print(format_table(report), flush=True)
        log(f"wrote {args.out}")
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
