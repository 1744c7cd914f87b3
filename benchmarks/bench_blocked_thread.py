"""The no-op round trip while a user thread of the program sits in a blocking MPI receive.

    python -m mpidag.run -n 2 benchmarks/bench_blocked_thread.py [--rounds 3] [--calls 2000]
        [--out benchmarks/results/blocked_thread.json]

A program may keep a thread of its own in MPI while it uses RPC (a listener, a stop signal):
here the thread waits in ``comm.recv`` (pickled) on a duplicate of ``COMM_WORLD`` made by the
program. Rank 0 calls ``rpc_sync`` of a no-op on rank 1, ``--calls`` times per mode; each
mode runs once per round (the modes alternate), and each figure is the median over the
rounds of the median time per call. Modes (the blocked thread is on...):

* ``baseline``: no blocked thread;
* ``callee``, ``caller``, ``both``: a thread in a pickled ``comm.recv`` on rank 1, rank 0,
  both;
* ``both_Recv``: a thread in a buffer ``comm.Recv`` on both ranks;
* ``both_irecv_wait``: a thread in ``comm.irecv().wait()`` on both ranks.

At the end of each mode every blocked thread is sent its message (and checked to have
received it) and joined, so the job ends cleanly. The JSON has every sample, the ratios to
the baseline, and the MPI library; ``--out -`` prints it only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import (  # noqa: E402
    RESULTS_DIR,
    Watchdog,
    git_info,
    log,
    machine_info,
    timed_barrier,
)
from mpi4py import MPI  # noqa: E402

import mpidag.rpc as rpc  # noqa: E402

#: the blocked threads' messages (a tag of the program's own communicator)
TAG = 77
#: (mode, ranks with a blocked thread, how it waits)
MODES: list[tuple[str, tuple[int, ...], str]] = [
    ("baseline", (), ""),
    ("callee", (1,), "recv"),
    ("caller", (0,), "recv"),
    ("both", (0, 1), "recv"),
    ("both_Recv", (0, 1), "Recv"),
    ("both_irecv_wait", (0, 1), "irecv_wait"),
]


def noop() -> None:
    return None


def blocked(comm: MPI.Comm, how: str, peer: int, got: list[Any]) -> None:
    """Wait in MPI for the one message ``peer`` sends at the end of the mode."""
    if how == "recv":
        got.append(comm.recv(source=peer, tag=TAG))
    elif how == "Recv":
        buf = np.zeros(1, dtype=np.int64)
        comm.Recv(buf, source=peer, tag=TAG)
        got.append(int(buf[0]))
    else:
        got.append(comm.irecv(source=peer, tag=TAG).wait())


def run_mode(comm: MPI.Comm, ranks: tuple[int, ...], how: str, calls: int) -> float | None:
    """One mode: start this rank's blocked thread, time ``calls`` round trips on rank 0,
    release every blocked thread. Returns rank 0's median µs per call (``None`` on rank 1)."""
    rank, peer = comm.Get_rank(), 1 - comm.Get_rank()
    got: list[Any] = []
    thread = None
    if rank in ranks:
        thread = threading.Thread(target=blocked, args=(comm, how, peer, got), daemon=True)
        thread.start()
    time.sleep(0.05)  # the thread is inside MPI
    timed_barrier(comm, 60, "start of a mode")
    median = None
    if rank == 0:
        for _ in range(100):
            rpc.rpc_sync(1, noop)
        samples = []
        clock = time.perf_counter
        for _ in range(calls):
            start = clock()
            rpc.rpc_sync(1, noop)
            samples.append(clock() - start)
        median = statistics.median(samples) * 1e6
    timed_barrier(comm, 120, "end of a mode")
    if peer in ranks:  # release the peer's thread
        if how == "recv" or how == "irecv_wait":
            comm.send(("released", peer), dest=peer, tag=TAG)
        else:
            comm.Send(np.array([peer], dtype=np.int64), dest=peer, tag=TAG)
    if thread is not None:
        thread.join(30)
        expected = ("released", rank) if how != "Recv" else rank
        if thread.is_alive() or got != [expected]:
            raise RuntimeError(f"rank {rank}: the blocked thread got {got!r}, "
                               f"expected [{expected!r}]")
    return median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--modes", default=",".join(m[0] for m in MODES),
                        help="comma-separated subset of " + ",".join(m[0] for m in MODES))
    parser.add_argument("--out", default=str(RESULTS_DIR / "blocked_thread.json"))
    args = parser.parse_args()
    wanted = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in wanted if m not in {name for name, _, _ in MODES}]
    if unknown:
        parser.error(f"--modes: unknown mode(s) {unknown}")
    modes = [m for m in MODES if m[0] in wanted]
    comm = MPI.COMM_WORLD.Dup()  # the program's own communicator
    if comm.Get_size() != 2:
        raise SystemExit("run on 2 ranks: python -m mpidag.run -n 2 " + sys.argv[0])
    with Watchdog(120, "init_rpc"):
        rpc.init_rpc()
    samples: dict[str, list[float]] = {name: [] for name, _, _ in modes}
    for round_ in range(args.rounds):
        for name, ranks, how in modes:
            with Watchdog(300, f"mode {name}"):
                value = run_mode(comm, ranks, how, args.calls)
            if value is not None:
                samples[name].append(value)
                log(f"round {round_ + 1} {name:16s} {value:8.1f} us")
    with Watchdog(120, "shutdown"):
        rpc.shutdown()
    if comm.Get_rank() != 0:
        return
    medians = {name: statistics.median(s) for name, s in samples.items()}
    base = medians.get("baseline")
    rows = {name: {"rtt_us": round(m, 2),
                   "vs_baseline": None if not base else round(m / base, 2),
                   "samples_us": [round(x, 2) for x in samples[name]]}
            for name, m in medians.items()}
    report = {"benchmark": "bench_blocked_thread", "time_utc":
              time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "calls_per_mode": args.calls, "rounds": args.rounds,
              "machine": machine_info(), "git": git_info(), "rows": rows}
    print(f"{'mode':18s} {'us/call':>9s} {'x baseline':>10s}   ({report['machine']['mpi']})")
    for name, row in rows.items():
        print(f"{name:18s} {row['rtt_us']:9.1f} {row['vs_baseline'] or 0:10.2f}")
    if args.out != "-":
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
