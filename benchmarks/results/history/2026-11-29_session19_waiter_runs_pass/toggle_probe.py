"""The in-run probe of session nineteen's experiment (needs ``waiter_runs_pass.patch``
applied, plus a module switch ``_KEEP_LEAD`` in ``mpidag/transport/progress.py`` for the
prototype's mode): rank 0 rotates three modes between blocks of ``calls`` iterations of a
``bench_autograd.py`` workload and prints each mode's per-pair ratio to ``off``::

    python -m mpidag.run -n 2 toggle_probe.py seed_example:300:30 ops_1000:20:20 \\
        pipeline_mlp:8:20

``off``: the waiting root hands the gradients that come back to a pool thread (``main``);
``vacate``: it runs them itself, the leadership given up (the patch); ``keep``: it runs
them holding the leadership (the first prototype).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import bench_autograd as ba  # noqa: E402

import mpidag.autograd as dist_autograd  # noqa: E402
import mpidag.rpc as rpc  # noqa: E402
import mpidag.transport.progress as progress  # noqa: E402
from mpidag import _runtime  # noqa: E402

MODES = ("off", "vacate", "keep")


def set_mode(mode: str) -> None:
    autograd = _runtime.current().autograd
    progress._KEEP_LEAD = mode == "keep"
    if mode == "off":
        autograd._runs_while_waiting = lambda work: False
    else:
        autograd.__dict__.pop("_runs_while_waiting", None)


def quartiles(ratios: list[float]) -> str:
    r = sorted(ratios)
    return f"{statistics.median(r):.3f} (q1 {r[len(r) // 4]:.3f}, q3 {r[3 * len(r) // 4]:.3f})"


def run(workload: str, calls: int, blocks: int) -> None:
    for _ in range(calls):
        ba.distributed_step(rpc, dist_autograd, workload)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for b in range(blocks):
        for mode in MODES[b % 3:] + MODES[:b % 3]:
            set_mode(mode)
            t0 = time.perf_counter()
            for _ in range(calls):
                ba.distributed_step(rpc, dist_autograd, workload)
            times[mode].append((time.perf_counter() - t0) / calls * 1e3)
    for mode in ("vacate", "keep"):
        ratios = [a / b for a, b in zip(times[mode], times["off"], strict=True)]
        print(f"{workload}: {mode}/off {quartiles(ratios)}; {mode} "
              f"{statistics.median(times[mode]):.3f} ms, off "
              f"{statistics.median(times['off']):.3f} ms", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    rank = MPI.COMM_WORLD.Get_rank()
    rpc.init_rpc(f"worker{rank}")
    if rank == 0:
        for spec in sys.argv[1:]:
            workload, calls, blocks = spec.split(":")
            run(workload, int(calls), int(blocks))
    rpc.shutdown()


if __name__ == "__main__":
    main()
