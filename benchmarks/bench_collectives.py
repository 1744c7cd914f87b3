"""torch.distributed collectives on the job's MPI (mpidag's ``backend="mpi"`` group) vs Gloo.

Run on two (or more) MPI ranks::

    python -m mpidag.run -n 2 benchmarks/bench_collectives.py [--quick] [--rounds 3]

Both groups come from ``mpidag.rpc.init_process_group`` in the same job, after
``init_rpc`` (RPC runs beside them, idle): ``backend="gloo"`` (a TCPStore rendezvous, Gloo's
TCP pairs) and ``backend="mpi"`` (:mod:`mpidag.distributed`: non-blocking MPI collectives
on a communicator of the members, completed by a progress thread). Each round makes one
group, measures it, destroys it, then the other; the order alternates between rounds.

Rows:

* ``allreduce_<size>_us``: ``dist.all_reduce`` (SUM) of a float32 tensor of 4 KiB, 64 KiB,
  1 MiB, 16 MiB, 256 MiB; per repetition the mean time of ``n`` back-to-back calls
  (after a barrier), rank 0's clock; the median over repetitions and rounds. ``GBps`` is
  the algorithm bandwidth, bytes / time (as nccl-tests' ``algbw``). The first call of each
  size checks the sum.
* ``ddp_steps_per_s``: torch's unchanged ``DistributedDataParallel`` on the group, an MLP
  (256 -> 512 -> 512 -> 10, 0.4 M parameters, 4 buckets of 0.5 MB), batch 64 per rank,
  SGD: steps per second (rank 0), median over repetitions and rounds.

``gloo_vs_mpi`` is Gloo's time / MPI's (above 1: MPI faster); for steps/s, MPI's / Gloo's.
Rank 0 writes ``benchmarks/results/collectives.json``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from _common import git_info, log, machine_info  # noqa: E402

import mpidag.rpc as rpc  # noqa: E402

DEFAULT_OUT = HERE / "results" / "collectives.json"
KiB = 1024
#: bytes -> (calls per repetition, repetitions), full and --quick
SIZES = {4 * KiB: (200, 7), 64 * KiB: (100, 7), KiB * KiB: (20, 7), 16 * KiB * KiB: (3, 5),
         256 * KiB * KiB: (1, 5)}
QUICK = {4 * KiB: (100, 3), 64 * KiB: (50, 3), KiB * KiB: (10, 3), 16 * KiB * KiB: (2, 3),
         256 * KiB * KiB: (1, 3)}


def _label(nbytes: int) -> str:
    return f"{nbytes // (KiB * KiB)}MiB" if nbytes >= KiB * KiB else f"{nbytes // KiB}KiB"


def measure_allreduce(nbytes: int, calls: int, reps: int) -> list[float]:
    """Seconds per all-reduce, one value per repetition."""
    size = dist.get_world_size()
    t = torch.full((nbytes // 4,), float(dist.get_rank() + 1))
    dist.all_reduce(t)  # warm-up, and a check
    expected = size * (size + 1) / 2
    if not (t[0].item() == t[-1].item() == expected):
        raise AssertionError(f"all_reduce of {nbytes} bytes gave {t[0].item()}, expected "
                             f"{expected}")
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(t)
        times.append((time.perf_counter() - start) / calls)
    return times


def measure_ddp(pg: Any, steps: int, reps: int) -> list[float]:
    """Steps per second of DDP training, one value per repetition."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=pg, bucket_cap_mb=0.5)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(64, 256, generator=gen), torch.randint(0, 10, (64,), generator=gen)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()

    for _ in range(5):
        step()
    rates = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        rates.append(steps / (time.perf_counter() - start))
    return rates


def run_backend(backend: str, sizes: dict[int, tuple[int, int]], ddp_steps: int,
                ddp_reps: int) -> dict[str, list[float]]:
    pg = rpc.init_process_group(backend=backend, timeout=300)
    out: dict[str, list[float]] = {}
    try:
        for nbytes, (calls, reps) in sizes.items():
            out[f"allreduce_{_label(nbytes)}_us"] = [
                s * 1e6 for s in measure_allreduce(nbytes, calls, reps)]
            log(f"{backend}: all_reduce {_label(nbytes)} "
                f"{statistics.median(out[f'allreduce_{_label(nbytes)}_us']):.1f} us")
        out["ddp_steps_per_s"] = measure_ddp(pg, ddp_steps, ddp_reps)
        log(f"{backend}: DDP {statistics.median(out['ddp_steps_per_s']):.1f} steps/s")
    finally:
        dist.barrier()
        dist.destroy_process_group()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds, each measuring both groups (order alternates)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON path ('-': none)")
    args = parser.parse_args()
    sizes = QUICK if args.quick else SIZES
    ddp_steps, ddp_reps = (20, 3) if args.quick else (50, 5)
    rpc.init_rpc()
    from mpi4py import MPI

    rank, ranks = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    samples: dict[str, dict[str, list[float]]] = {"gloo": {}, "mpi": {}}
    per_round: list[dict[str, dict[str, float]]] = []
    for r in range(args.rounds):
        order = ("gloo", "mpi") if r % 2 == 0 else ("mpi", "gloo")
        this_round: dict[str, dict[str, float]] = {}
        for backend in order:
            got = run_backend(backend, sizes, ddp_steps, ddp_reps)
            this_round[backend] = {k: statistics.median(v) for k, v in got.items()}
            for key, values in got.items():
                samples[backend].setdefault(key, []).extend(values)
        per_round.append(this_round)
    rpc.shutdown()
    if rank != 0:
        return 0
    rows: dict[str, Any] = {}
    for key in samples["mpi"]:
        mpi, gloo = statistics.median(samples["mpi"][key]), statistics.median(samples["gloo"][key])
        entry: dict[str, Any] = {"mpi": mpi, "gloo": gloo,
                                 "gloo_vs_mpi": gloo / mpi if key.endswith("_us") else mpi / gloo,
                                 "rounds": {b: [rd[b][key] for rd in per_round]
                                            for b in ("mpi", "gloo")}}
        if key.startswith("allreduce_"):
            nbytes = next(n for n in sizes if f"_{_label(n)}_" in key)
            entry["bytes"] = nbytes
            entry["GBps"] = {b: nbytes / (entry[b] * 1e-6) / 1e9 for b in ("mpi", "gloo")}
        rows[key] = entry
    doc = {"machine": machine_info(), "git": git_info(),
           "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
           "config": {"ranks": ranks, "rounds": args.rounds,
                      "quick": args.quick, "sizes": {_label(n): {"calls": c, "reps": p}
                                                     for n, (c, p) in sizes.items()},
                      "ddp": {"model": "256-512-512-10 MLP", "batch_per_rank": 64,
                              "steps": ddp_steps, "reps": ddp_reps, "bucket_cap_mb": 0.5}},
           "rows": rows}
    print(f"{'row':<24} {'mpi':>12} {'gloo':>12} {'gloo/mpi':>9}")
    for key, e in rows.items():
        bw = (f"   {e['GBps']['mpi']:.2f} / {e['GBps']['gloo']:.2f} GB/s"
              if "GBps" in e else "")
        print(f"{key:<24} {e['mpi']:>12.1f} {e['gloo']:>12.1f} {e['gloo_vs_mpi']:>8.2f}x{bw}")
    if str(args.out) != "-":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
