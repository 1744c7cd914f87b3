"""The training job that ``benchmarks/chaos.py`` starts and kills a rank of.

Every rank runs the same symmetric loop; each iteration touches every other live rank with,
in a random order and with random pauses between them:

* ``rpc_async`` calls to every peer (each sleeping a random few ms before answering) and one
  ``rpc_sync`` to a random peer;
* ``remote()`` on every peer + ``to_here()``, and ``to_here()`` of an RRef made at start-up on
  every peer (so RRefs owned by every rank are in use);
* inside a distributed autograd context: a forward pass through every peer in a random order
  (the first hop nested: the first peer calls the second), ``mpidag.autograd.backward``, and a
  ``mpidag.optim.DistributedOptimizer`` step over one ``nn.Parameter`` owned by each rank
  (RRefs from every owner).

When a call raises, the rank records the error (type, ``worker_name``, ``rank``, the
operation, ``time.time()``), drops the workers of ``rpc.failed_workers()`` (their RRefs and
parameters), rebuilds its optimizer over the survivors' parameters, runs ``--after``
iterations among the survivors and calls ``rpc.shutdown()``. Each rank writes its pid to
``DIR/pid.<rank>``, touches ``DIR/training.<rank>`` when its loop starts, and appends its
events as JSON lines to ``DIR/events.<rank>.jsonl`` (read by the driver).

Usage (the driver does this; by hand for a replay)::

    python -m mpidag.run --ft -n 4 benchmarks/chaos_job.py --dir /tmp/c --seed 7
    kill -9 $(cat /tmp/c/pid.2)      # after every rank touched /tmp/c/training.<rank>
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
import traceback
from pathlib import Path
from typing import Any

import torch

import mpidag.autograd as dist_autograd
import mpidag.rpc as rpc
from mpidag.optim import DistributedOptimizer

#: Size of the tensors of the forward pass and of each rank's parameter.
DIM = 8
#: Timeout of every call (s): a stuck call becomes an RPCTimeoutError naming the operation,
#: before the driver's per-trial timeout would call the trial a hang.
CALL_TIMEOUT_S = 30.0

#: This rank's parameter (module level: peers reach it through ``param_rref``).
W = torch.nn.Parameter(torch.ones(DIM))


# ----------------------------------------------------------------------------------------------
# Remote functions (module level in __main__ on every rank)
# ----------------------------------------------------------------------------------------------


def param_rref() -> rpc.RRef:
    """An RRef of this rank's parameter, for the caller's optimizer."""
    return rpc.RRef(W)


def echo_after(x: torch.Tensor, delay: float) -> torch.Tensor:
    """Return ``x + 1`` after ``delay`` seconds (keeps calls in flight)."""
    time.sleep(delay)
    return x + 1


def make_tensor(owner: int, iteration: int) -> torch.Tensor:
    """The value of a ``remote()``: a tensor that says who made it for which iteration."""
    return torch.tensor([float(owner), float(iteration)])


def stage(h: torch.Tensor) -> torch.Tensor:
    """One stage of the forward pass on this rank: ``tanh(h * W)``.

    Multiplies by a copy of ``W`` (``CloneBackward`` still takes the gradient to ``W``): the
    optimizer steps of other ranks update ``W`` in place while this pass's graph is alive,
    and autograd refuses a saved tensor modified in place (Hogwild-style training).
    """
    return torch.tanh(h * W.clone())


def nested_stage(h: torch.Tensor, then: str | None) -> torch.Tensor:
    """A stage that calls the next rank's stage itself (a nested call), if ``then``."""
    h = stage(h)
    if then is not None:
        h = rpc.rpc_sync(then, stage, args=(h,), timeout=CALL_TIMEOUT_S)
    return h


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


class Trainer:
    """One rank's state: its peers, their RRefs, its optimizer, its event log.

    Example::

        trainer = Trainer(Path("/tmp/c"), seed=7, after=5, max_train_s=45)
        trainer.run()          # between rpc.init_rpc() and rpc.shutdown()
    """

    def __init__(self, out_dir: Path, seed: int, after: int, max_train_s: float) -> None:
        info = rpc.get_worker_info()
        self.rank, self.name = info.id, info.name
        self.size = _world_size()
        self.dir = out_dir
        self.rng = random.Random(f"{seed}-{self.rank}")
        self.gen = torch.Generator().manual_seed(seed * 100 + self.rank)
        self.after, self.max_train_s = after, max_train_s
        self.events = open(out_dir / f"events.{self.rank}.jsonl", "a", buffering=1)  # noqa: SIM115
        self.op = "setup"
        self.failed: set[int] = set()
        self.params: dict[int, rpc.RRef] = {}
        self.held: dict[int, rpc.RRef] = {}
        self.opt: DistributedOptimizer | None = None

    def event(self, kind: str, **values: Any) -> None:
        """Append one event (with ``time.time()``) to this rank's JSON lines file."""
        self.events.write(json.dumps({"event": kind, "t": time.time(), "rank": self.rank,
                                      **values}) + "\n")

    def peers(self) -> list[int]:
        """The other ranks, less those known to have failed."""
        return [r for r in range(self.size) if r != self.rank and r not in self.failed]

    def setup(self) -> None:
        """Fetch every peer's parameter RRef, make a long-lived RRef on every peer, build
        the optimizer."""
        self.params = {self.rank: rpc.RRef(W)}
        for p in self.peers():
            self.params[p] = rpc.rpc_sync(f"worker{p}", param_rref, timeout=CALL_TIMEOUT_S)
            self.held[p] = rpc.remote(f"worker{p}", make_tensor, args=(p, -1),
                                      timeout=CALL_TIMEOUT_S)
        self.build_optimizer()

    def build_optimizer(self) -> None:
        """A ``DistributedOptimizer`` over the parameters of this rank and its live peers."""
        self.opt = None
        owners = [self.rank, *self.peers()]
        self.opt = DistributedOptimizer(torch.optim.SGD, [self.params[r] for r in owners],
                                        lr=0.01)

    def pause(self) -> None:
        """A random pause of 0-10 ms, so the kill lands anywhere in the loop."""
        time.sleep(self.rng.uniform(0.0, 0.01))

    def iteration(self, i: int) -> None:
        """One training iteration touching every live peer (operations in random order)."""
        ops = ["calls", "rrefs", "autograd"]
        self.rng.shuffle(ops)
        with dist_autograd.context() as ctx:
            for op in ops:
                self.pause()
                getattr(self, f"op_{op}")(i, ctx)
        self.op = "between iterations"

    def op_calls(self, i: int, ctx: int) -> None:
        """``rpc_async`` to every peer (answers after a random few ms) + one ``rpc_sync``."""
        peers = self.peers()
        self.op = "rpc_async"
        x = torch.full((DIM,), float(i))
        futs = [rpc.rpc_async(f"worker{p}", echo_after, args=(x, self.rng.uniform(0, 0.005)),
                              timeout=CALL_TIMEOUT_S) for p in peers]
        self.op = "rpc_sync"
        y = rpc.rpc_sync(f"worker{self.rng.choice(peers)}", torch.add, args=(x, 2),
                         timeout=CALL_TIMEOUT_S)
        assert torch.equal(y, x + 2), (y, x)
        self.op = "rpc_async wait"
        for fut in futs:
            assert torch.equal(fut.wait(), x + 1)

    def op_rrefs(self, i: int, ctx: int) -> None:
        """``remote()`` on every peer, ``to_here()`` of those and of the start-up RRefs."""
        peers = self.peers()
        self.op = "remote"
        made = {p: rpc.remote(f"worker{p}", make_tensor, args=(p, i), timeout=CALL_TIMEOUT_S)
                for p in peers}
        self.op = "to_here"
        for p in peers:
            assert made[p].to_here(timeout=CALL_TIMEOUT_S).tolist() == [p, i]
            assert self.held[p].to_here(timeout=CALL_TIMEOUT_S).tolist() == [p, -1]

    def op_autograd(self, i: int, ctx: int) -> None:
        """Forward through every peer (first hop nested), backward, optimizer step."""
        order = self.peers()
        self.rng.shuffle(order)
        self.op = "forward"
        x = torch.rand(DIM, generator=self.gen)
        h = stage(x)
        then = f"worker{order[1]}" if len(order) > 1 else None
        h = rpc.rpc_sync(f"worker{order[0]}", nested_stage, args=(h, then),
                         timeout=CALL_TIMEOUT_S)
        for p in order[2:]:
            h = rpc.rpc_sync(f"worker{p}", stage, args=(h,), timeout=CALL_TIMEOUT_S)
        loss = (h * h).sum()
        self.op = "backward"
        dist_autograd.backward(ctx, [loss])
        self.op = "optimizer step"
        assert self.opt is not None
        self.opt.step(ctx)

    def drop_failed(self) -> list[int]:
        """Forget the workers of ``rpc.failed_workers()``; rebuild the optimizer."""
        lost = {w.id for w in rpc.failed_workers()} - self.failed
        self.failed |= lost
        for r in lost:
            self.params.pop(r, None)
            self.held.pop(r, None)
        self.op = "rebuild optimizer"
        self.build_optimizer()
        return sorted(lost)

    def run(self) -> None:
        """Train until an error, then ``--after`` more iterations among the survivors."""
        self.op = "setup"
        self.setup()
        (self.dir / f"training.{self.rank}").touch()
        self.event("training", peers=self.peers())
        start, i, errors, first_error_at = time.monotonic(), 0, 0, None
        after_ok = 0
        while True:
            if first_error_at is not None and after_ok >= self.after:
                break
            if first_error_at is None and time.monotonic() - start > self.max_train_s:
                self.event("no_error_seen", iterations=i)
                break
            try:
                self.iteration(i)
                if first_error_at is not None:
                    after_ok += 1
                    self.event("after_ok", iteration=i, peers=self.peers())
            except Exception as exc:  # every type is recorded; the driver judges
                errors += 1
                self.event("error", iteration=i, op=self.op, type=type(exc).__name__,
                           worker_name=getattr(exc, "worker_name", None),
                           failed_rank=getattr(exc, "rank", None), message=str(exc)[:500],
                           after_error=first_error_at is not None,
                           failed_workers=[w.name for w in rpc.failed_workers()],
                           traceback=traceback.format_exc()[-3000:])
                if first_error_at is None:
                    first_error_at = i
                if errors >= 5:
                    self.event("giving_up", iterations=i)
                    break
                try:
                    lost = self.drop_failed()
                    self.event("dropped", lost=lost, peers=self.peers())
                except Exception as exc2:
                    self.event("error", iteration=i, op=self.op, type=type(exc2).__name__,
                               worker_name=getattr(exc2, "worker_name", None),
                               failed_rank=getattr(exc2, "rank", None),
                               message=str(exc2)[:500], after_error=True,
                               failed_workers=[w.name for w in rpc.failed_workers()],
                               traceback=traceback.format_exc()[-3000:])
                    errors += 1
            i += 1
        self.event("loop_done", iterations=i, after_ok=after_ok)
        self.opt = None
        self.params.clear()
        self.held.clear()


def _world_size() -> int:
    from mpi4py import MPI  # already initialized by init_rpc

    return MPI.COMM_WORLD.Get_size()


def main() -> None:
    """Parse the options, start RPC, write the pid, train, shut down."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="pid/marker/event files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--after", type=int, default=5,
                        help="iterations among the survivors after the error")
    parser.add_argument("--max-train-s", type=float, default=45.0,
                        help="stop (and report it) if no error came within this time")
    args = parser.parse_args()
    rpc.init_rpc()
    rank = rpc.get_worker_info().id
    (args.dir / f"pid.{rank}").write_text(str(os.getpid()))
    trainer = Trainer(args.dir, args.seed, args.after, args.max_train_s)
    trainer.event("started", pid=os.getpid(), seed=args.seed)
    try:
        trainer.run()
    except Exception as exc:  # setup failed: say so, the driver judges
        trainer.event("error", iteration=-1, op=trainer.op, type=type(exc).__name__,
                      worker_name=getattr(exc, "worker_name", None),
                      failed_rank=getattr(exc, "rank", None), message=str(exc)[:500],
                      after_error=False, failed_workers=[w.name for w in rpc.failed_workers()],
                      traceback=traceback.format_exc()[-3000:])
    trainer.event("shutdown_start")
    rpc.shutdown()
    trainer.event("shutdown_done")


if __name__ == "__main__":
    main()
