"""Everything at N ranks: correctness and the time of ``init_rpc`` and ``shutdown``.

Run on any number of ranks (the README reports 8, 16 and 32, oversubscribed on 2 cores)::

    python -m mpidag.run -n 32 benchmarks/scale_check.py [--out benchmarks/results/scale_32.json]

Every rank, in this order, checking every value against the same computation done locally:

1. ``init_rpc()`` (timed);
2. calls between every pair: each rank ``rpc_sync``-calls every other rank;
3. a nested chain through every rank: ``chain`` calls the next rank, which calls the next,
   until it is back (depth N);
4. RRef forks across all ranks: each rank ``remote()``-creates a value on its next rank and
   hands the RRef to every rank, which fetches it (``to_here``) and drops it;
5. a distributed backward pass whose graph visits every rank (the chain of 3 with tensors
   that require grad, inside ``mpidag.autograd.context()``), gradients against local
   autograd;
6. a ``DistributedOptimizer`` step over one parameter on every rank (rank 0 drives it),
   parameters read back on their owners;
7. leak counters at zero on every rank (``mpidag.testing.assert_no_leaks``);
8. graceful ``shutdown()`` (timed).

Rank 0 prints ``OK scale_check ranks=N ...`` with the slowest rank's time of each step and
writes them to ``--out``. Any wrong value raises (and, with ``MPIDAG_ABORT_ON_ERROR``'s
default, ends the job): nothing can pass silently. A watchdog aborts the job after
``--timeout`` seconds instead of letting it hang.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch
from mpi4py import MPI

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import mpidag.autograd as dist_autograd  # noqa: E402 - after the path set-up
import mpidag.rpc as rpc  # noqa: E402
from mpidag import testing  # noqa: E402
from mpidag.optim import DistributedOptimizer  # noqa: E402

PARAM = torch.nn.Parameter(torch.zeros(4))


def whoami() -> int:
    """The rank that serves this call."""
    return rpc.get_worker_info().id


def chain(route: list[str], x: torch.Tensor) -> torch.Tensor:
    """``sin`` here, then the rest of the route over RPC."""
    y = torch.sin(x) * 1.5 + 0.1
    return y if not route else rpc.rpc_sync(route[0], chain, args=(route[1:], y), timeout=0)


def chain_local(route: list[str], x: torch.Tensor) -> torch.Tensor:
    y = torch.sin(x) * 1.5 + 0.1
    return y if not route else chain_local(route[1:], y)


def make_value(owner_tag: int) -> torch.Tensor:
    return torch.full((3,), float(owner_tag))


def fetch(rref: rpc.RRef) -> list[float]:
    """On every rank: use a fork of the RRef, then drop it."""
    return rref.to_here().tolist()


def param_rref() -> rpc.RRef:
    return rpc.RRef(PARAM)


def weighted(x: torch.Tensor) -> torch.Tensor:
    """On a parameter's owner: uses its parameter (the optimizer steps it)."""
    return (PARAM * x).sum()


def read_param() -> list[float]:
    return PARAM.detach().tolist()


class Watchdog:
    """Abort the whole job if a step takes longer than ``seconds`` (never a hang)."""

    def __init__(self, seconds: float) -> None:
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True

    def _fire(self) -> None:
        sys.stderr.write(f"scale_check: rank {MPI.COMM_WORLD.Get_rank()} timed out; "
                         f"aborting the job\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(3)

    def __enter__(self) -> Watchdog:
        self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timer.cancel()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    me, n = comm.Get_rank(), comm.Get_size()
    names = [f"worker{r}" for r in range(n)]
    times: dict[str, float] = {}

    def timed(step: str, fn) -> None:
        start = time.perf_counter()
        fn()
        times[step] = time.perf_counter() - start

    with Watchdog(args.timeout):
        torch.set_num_threads(1)
        timed("init_rpc_s", rpc.init_rpc)
        ring = names[me + 1:] + names[:me + 1]  # the others, then back to me

        def pairs() -> None:
            for other in range(n):
                if other != me:
                    got = rpc.rpc_sync(names[other], whoami, timeout=0)
                    assert got == other, (me, other, got)

        def nested() -> None:
            x = torch.linspace(0, 1, 5)
            torch.testing.assert_close(rpc.rpc_sync(ring[0], chain, args=(ring[1:], x),
                                                    timeout=0), chain_local(ring[1:], x))

        def forks() -> None:
            rref = rpc.remote(ring[0], make_value, args=(me,))
            for other in names:
                assert rpc.rpc_sync(other, fetch, args=(rref,), timeout=0) == [float(me)] * 3
            del rref

        def backward() -> None:
            x = torch.linspace(0.1, 1, 5, requires_grad=True)
            with dist_autograd.context() as context_id:
                y = rpc.rpc_sync(ring[0], chain, args=(ring[1:], x), timeout=0)
                dist_autograd.backward(context_id, [y.sum()])
                grads = dist_autograd.get_gradients(context_id)
            (expected,) = torch.autograd.grad(chain_local(ring[1:], x).sum(), [x])
            torch.testing.assert_close(grads[x], expected)

        def optimizer_step() -> None:
            if me != 0:
                return
            params = [rpc.rpc_sync(name, param_rref, timeout=0) for name in names]
            opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.5)
            x = torch.arange(1.0, 5.0)
            with dist_autograd.context() as context_id:
                loss = sum(rpc.rpc_sync(name, weighted, args=(x,), timeout=0) for name in names)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
            for name in names:  # p -= 0.5 * d(p.x)/dp = 0.5 * x
                assert rpc.rpc_sync(name, read_param, timeout=0) == (-0.5 * x).tolist()
            del opt, params

        for step, fn in [("pairs_s", pairs), ("nested_chain_s", nested), ("rref_forks_s", forks),
                         ("backward_s", backward), ("optimizer_step_s", optimizer_step)]:
            testing.quiesce()
            timed(step, fn)
        testing.quiesce()
        testing.assert_no_leaks()
        timed("shutdown_s", rpc.shutdown)
    slowest = {k: max(v) for k, v in
               zip(times, zip(*comm.allgather(list(times.values())), strict=True),
                   strict=True)}
    if me == 0:
        line = " ".join(f"{k}={v:.2f}" for k, v in slowest.items())
        print(f"OK scale_check ranks={n} {line}", flush=True)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({
                "ranks": n, "slowest_rank_seconds": slowest,
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                            "torch": torch.__version__,
                            "mpi": MPI.Get_library_version().splitlines()[0]},
            }, indent=2) + "\n")
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
