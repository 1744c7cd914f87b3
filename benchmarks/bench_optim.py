"""Parameter server: mpidag's DistributedOptimizer vs torch's (TensorPipe), and locks.

Run on exactly three MPI ranks (rank 0 is the parameter server, ranks 1 and 2 train)::

    python -m mpidag.run -n 3 benchmarks/bench_optim.py [--quick]

The server holds an embedding table (20,000 x 64) and a linear layer (64 -> 16). Each
training step of a trainer, in a distributed autograd context: ``rpc_sync`` the embedding
lookup of a batch of 256 indices on the server, pull the linear layer's weight and bias
(``RRef.to_here()``), apply them and the cross entropy locally, run the distributed backward
pass (the gradients go back to the server through the lookup and the two fetches) and
``DistributedOptimizer(SGD, momentum 0.9).step``. Both trainers step at the same time.
(Computing the linear layer on the server instead would save its weight for the backward
pass, and the other trainer's concurrent step would change it in place: autograd rejects
that, in torch as here.)

Rows (total steps per second of the two trainers, higher is better; each sample is one
run of 150 timed steps per trainer: with 60, one session's five samples spread 1.7x on the
2-core VM, three ranks sharing two cores. torch's RRefs do not work in a process whose
torch RPC was shut down once, so its session and mpidag's run one after the other, minutes
apart. ``--interleaved`` runs instead one session of its own, in fresh processes: both
stacks started side by side, runs of each alternating, ``mpidag_vs_torch_interleaved``
being the median of the ratios of neighbouring runs (the VM's speed drifts 2x within
minutes, and the ratio of the sessions' medians with it). There torch runs with what
``init_rpc`` sets for the whole process (``gc.freeze()``, glibc's fastbins off) and with
mpidag's agent idling beside it (4 % of a core), and mpidag with torch's agent idling in
``epoll``; it writes ``results/optim_interleaved.json`` by default):

* ``ps_shared_steps_per_s``: both trainers train the same table and layer (the torch RPC
  parameter-server tutorial's shape): mpidag vs torch.
* ``ps_disjoint_steps_per_s``: each trainer has its own table and layer on the server:
  mpidag with its per-parameter locks vs mpidag with one global lock per rank (torch's
  scheme, ``MPIDAG_OPTIM_LOCKS=global``) vs torch.

Both rows also run ``mpi4py``: the same training written by hand with raw mpi4py
(:class:`RawServer`), the floor below any RPC stack here. It computes exactly what the
others do (the table's gradient by autograd through the lookup, one ``SGD`` per trainer on
the server), with the fewest messages: three round trips a step (the lookup, one fetch of
the weight and bias together, the gradients with the step) and no recording, no
termination protocol, no locks, no threads. ``mpidag_vs_mpi4py`` says how far a stack is
from it.

Rank 0 writes ``benchmarks/results/optim.json``; ``benchmarks/plot.py`` draws it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from mpi4py import MPI

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from _common import log, machine_info, start_torch_rpc  # noqa: E402

DEFAULT_OUT = HERE / "results" / "optim.json"
INTERLEAVED_OUT = HERE / "results" / "optim_interleaved.json"
ROWS_, DIM, CLASSES, BATCH = 20_000, 64, 16, 256


class Shard(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(ROWS_, DIM)
        self.fc = torch.nn.Linear(DIM, CLASSES)

    def lookup(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb(idx)


#: on the server: model name -> shard
SHARDS: dict[str, Shard] = {}


def server_lookup(name: str, idx: torch.Tensor) -> torch.Tensor:
    return SHARDS[name].lookup(idx)


def server_params(name: str, rref_cls: Any) -> list:
    if name not in SHARDS:
        SHARDS[name] = Shard(len(SHARDS))
    return [rref_cls(p) for p in SHARDS[name].parameters()]


def set_lock_mode(mode: str) -> str:
    from mpidag import _runtime

    locks = _runtime.current().parameter_locks
    previous, locks.mode = locks.mode, mode
    return previous


def timed_steps(step: Callable[[], None], steps: int, warmup: int, trainers: MPI.Comm
                ) -> float:
    """Run ``warmup`` + ``steps`` calls of ``step`` (the trainers start the timed part
    together); returns the seconds the timed part took."""
    for _ in range(warmup):
        step()
    trainers.Barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return time.perf_counter() - start


def train(rpc: ModuleType, dist_autograd: ModuleType, optim_cls: type, model: str,
          steps: int, warmup: int, trainers: MPI.Comm) -> float:
    """Run ``warmup`` + ``steps`` training steps; returns the seconds the timed part took."""
    params = rpc.rpc_sync("worker0", server_params, args=(model, rpc.RRef))
    opt = optim_cls(torch.optim.SGD, params, lr=0.05, momentum=0.9)
    weight, bias = params[1], params[2]
    gen = torch.Generator().manual_seed(trainers.Get_rank())

    def step() -> None:
        idx = torch.randint(0, ROWS_, (BATCH,), generator=gen)
        target = torch.randint(0, CLASSES, (BATCH,), generator=gen)
        with dist_autograd.context() as context_id:
            hidden = rpc.rpc_sync("worker0", server_lookup, args=(model, idx))
            out = torch.nn.functional.linear(hidden, weight.to_here(), bias.to_here())
            loss = torch.nn.functional.cross_entropy(out, target)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)

    return timed_steps(step, steps, warmup, trainers)


# ------------------------------------------------- the same server by hand, raw mpi4py
#: the tags of the hand-written server's messages (a reply has its request's tag)
LOOKUP, FETCH, GRADS, STOP = 1, 2, 3, 4
#: the hand-written server's model ids (the first element of a LOOKUP or FETCH)
SHARED_ID = 0


def _flat_grads_size() -> int:
    return BATCH * DIM + CLASSES * DIM + CLASSES


class RawServer:
    """Rank 0 of the parameter server written by hand with raw mpi4py: the floor below any
    RPC stack for this workload. One thread serves one message at a time (blocking
    ``Probe``/``Recv`` from any trainer), so nothing is locked and nothing is handed from
    thread to thread; each trainer makes three round trips a step:

    * LOOKUP ``[model, idx...]`` -> the embedding rows, computed with autograd (kept for the
      trainer's GRADS);
    * FETCH ``[model]`` -> the linear layer's weight and bias, packed;
    * GRADS (the rows' gradient, the weight's and the bias's, packed) -> the table's
      gradient by ``torch.autograd.grad`` through the lookup, then the trainer's own
      ``SGD(lr=0.05, momentum=0.9)`` steps the three parameters (one optimizer per trainer
      and model, as each ``DistributedOptimizer`` has its own on the server); the reply is
      an empty acknowledgement.

    Example (rank 0; ranks 1 and 2 call :func:`raw_train`, then send STOP)::

        RawServer(comm).serve(trainers=2)
    """

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.shards: dict[int, Shard] = {}
        self.optimizers: dict[tuple[int, int], torch.optim.SGD] = {}
        #: trainer rank -> (model id, the rows of its last lookup, with their graph)
        self.looked_up: dict[int, tuple[int, torch.Tensor]] = {}

    def shard(self, model: int) -> Shard:
        if model not in self.shards:
            self.shards[model] = Shard(model)
        return self.shards[model]

    def serve(self, trainers: int) -> None:
        """Serve until ``trainers`` trainers sent STOP."""
        comm, status = self.comm, MPI.Status()
        request = torch.empty(BATCH + 1, dtype=torch.int64)
        grads = torch.empty(_flat_grads_size())
        ack = torch.zeros(1, dtype=torch.int64)
        stopped = 0
        while stopped < trainers:
            comm.Probe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            src, tag = status.Get_source(), status.Get_tag()
            if tag == LOOKUP:
                comm.Recv(request.numpy(), src, LOOKUP)
                model = int(request[0])
                rows = self.shard(model).lookup(request[1:].clone())
                self.looked_up[src] = (model, rows)
                comm.Send(rows.detach().numpy(), src, LOOKUP)
            elif tag == FETCH:
                comm.Recv(request[:1].numpy(), src, FETCH)
                fc = self.shard(int(request[0])).fc
                packed = torch.cat([fc.weight.detach().flatten(), fc.bias.detach()])
                comm.Send(packed.numpy(), src, FETCH)
            elif tag == GRADS:
                comm.Recv(grads.numpy(), src, GRADS)
                model, rows = self.looked_up.pop(src)
                self.step(src, model, rows, grads)
                comm.Send(ack.numpy(), src, GRADS)
            else:
                comm.Recv(ack.numpy(), src, STOP)
                stopped += 1

    def step(self, trainer: int, model: int, rows: torch.Tensor, grads: torch.Tensor) -> None:
        shard = self.shard(model)
        key = (trainer, model)
        if key not in self.optimizers:
            self.optimizers[key] = torch.optim.SGD(shard.parameters(), lr=0.05, momentum=0.9)
        n_rows, n_weight = BATCH * DIM, CLASSES * DIM
        (table_grad,) = torch.autograd.grad(rows, [shard.emb.weight],
                                            grads[:n_rows].view(BATCH, DIM))
        shard.emb.weight.grad = table_grad
        shard.fc.weight.grad = grads[n_rows:n_rows + n_weight].view(CLASSES, DIM).clone()
        shard.fc.bias.grad = grads[n_rows + n_weight:].clone()
        try:
            self.optimizers[key].step()
        finally:
            for param in shard.parameters():
                param.grad = None


def raw_train(comm: MPI.Comm, model: int, steps: int, warmup: int, trainers: MPI.Comm
              ) -> float:
    """A trainer of :class:`RawServer`: the same steps as :func:`train`; returns the
    seconds the timed part took."""
    gen = torch.Generator().manual_seed(trainers.Get_rank())
    rows = torch.empty(BATCH, DIM)
    packed = torch.empty(CLASSES * DIM + CLASSES)
    header = torch.tensor([model], dtype=torch.int64)
    ack = torch.empty(1, dtype=torch.int64)

    def step() -> None:
        idx = torch.randint(0, ROWS_, (BATCH,), generator=gen)
        target = torch.randint(0, CLASSES, (BATCH,), generator=gen)
        comm.Send(torch.cat([header, idx]).numpy(), 0, LOOKUP)
        comm.Recv(rows.numpy(), 0, LOOKUP)
        comm.Send(header.numpy(), 0, FETCH)
        comm.Recv(packed.numpy(), 0, FETCH)
        hidden = rows.clone().requires_grad_()
        weight = packed[:CLASSES * DIM].view(CLASSES, DIM).clone().requires_grad_()
        bias = packed[CLASSES * DIM:].clone().requires_grad_()
        loss = torch.nn.functional.cross_entropy(
            torch.nn.functional.linear(hidden, weight, bias), target)
        grads = torch.autograd.grad(loss, [hidden, weight, bias])
        comm.Send(torch.cat([g.flatten() for g in grads]).numpy(), 0, GRADS)
        comm.Recv(ack.numpy(), 0, GRADS)

    return timed_steps(step, steps, warmup, trainers)


def raw_session(comm: MPI.Comm, trainers: MPI.Comm | None, phases: list[tuple[str, str]],
                steps: int, warmup: int, reps: int) -> dict[str, list[float]]:
    """The hand-written server's session: rank 0 serves; each trainer runs ``phases``."""
    if trainers is None:
        RawServer(comm).serve(comm.Get_size() - 1)
        return {}
    me = trainers.Get_rank()
    out: dict[str, list[float]] = {}
    for row, _ in phases:
        model = SHARED_ID if row.startswith("ps_shared") else 1 + me
        rates = []
        for _ in range(reps):
            seconds = raw_train(comm, model, steps, warmup, trainers)
            rates.append(2 * steps / trainers.allreduce(seconds, op=MPI.MAX))
        out[row] = rates
        if me == 0:
            log(f"mpi4py {row}: {statistics.median(rates):.1f} steps/s")
    comm.Send(torch.zeros(1, dtype=torch.int64).numpy(), 0, STOP)
    return out


def start(key: str, comm: MPI.Comm) -> tuple[ModuleType, ModuleType, type]:
    if key == "mpidag":
        import mpidag.autograd as dist_autograd
        import mpidag.rpc as rpc
        from mpidag.optim import DistributedOptimizer

        rpc.init_rpc()
        return rpc, dist_autograd, DistributedOptimizer
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer

    start_torch_rpc(comm, timeout=300)
    return rpc, dist_autograd, DistributedOptimizer


def session(key: str, comm: MPI.Comm, trainers: MPI.Comm | None, phases: list[tuple[str, str]],
            steps: int, warmup: int, reps: int) -> dict[str, list[float]]:
    """One RPC session: rank 0 serves; each trainer runs ``phases`` (row, lock mode).
    ``mpi4py`` is the hand-written server's, ``interleaved`` both stacks side by side."""
    if key == "mpi4py":
        return raw_session(comm, trainers, phases, steps, warmup, reps)
    if key == "interleaved":
        return interleaved_session(comm, trainers, phases, steps, warmup, reps)
    rpc, dist_autograd, optim_cls = start(key, comm)
    out: dict[str, list[float]] = {}
    if trainers is not None:
        me = trainers.Get_rank()
        for row, mode in phases:
            if key == "mpidag" and me == 0:
                rpc.rpc_sync("worker0", set_lock_mode, args=(mode,))
            model = model_name(row, me)
            rates = []
            for _ in range(reps):
                seconds = train(rpc, dist_autograd, optim_cls, model, steps, warmup, trainers)
                slowest = trainers.allreduce(seconds, op=MPI.MAX)
                rates.append(2 * steps / slowest)
            out[row] = rates
            if me == 0:
                log(f"{key} {row} ({mode} locks): {statistics.median(rates):.1f} steps/s")
        if key == "mpidag" and me == 0:
            rpc.rpc_sync("worker0", set_lock_mode, args=("parameter",))
    rpc.shutdown()
    return out


def model_name(row: str, trainer: int) -> str:
    """The server's model a trainer trains in ``row``: one for both trainers in the shared
    row, its own in the disjoint ones.

    Example::

        >>> model_name("ps_shared_steps_per_s", 1), model_name("ps_disjoint_steps_per_s", 1)
        ('shared', 'own1')
    """
    return "shared" if row.startswith("ps_shared") else f"own{trainer}"


def interleaved_session(comm: MPI.Comm, trainers: MPI.Comm | None,
                        phases: list[tuple[str, str]], steps: int, warmup: int, reps: int
                        ) -> dict[str, list[float]]:
    """torch's RPC and mpidag's in the same processes, runs of each alternating (the first
    of a pair alternating too); per row the ratios mpidag / torch of each pair's steps/s.
    Rank 0 serves both stacks."""
    stacks = {key: start(key, comm) for key in ("torch_rpc", "mpidag")}
    out: dict[str, list[float]] = {}
    if trainers is not None:
        me = trainers.Get_rank()
        for row, _ in phases:
            model = model_name(row, me)
            for key in stacks:
                out[f"{row}/{key}"] = []
            for rep in range(reps):
                for key in (("mpidag", "torch_rpc") if rep % 2 == 0 else ("torch_rpc", "mpidag")):
                    seconds = train(*stacks[key], model, steps, warmup, trainers)
                    out[f"{row}/{key}"].append(2 * steps / trainers.allreduce(seconds,
                                                                              op=MPI.MAX))
            if me == 0:
                ratios = pair_ratios(out, row)
                log(f"interleaved {row}: mpidag / torch {statistics.median(ratios):.2f}x "
                    f"({', '.join(f'{r:.2f}' for r in ratios)})")
    for key in ("mpidag", "torch_rpc"):
        stacks[key][0].shutdown()
    return out


def pair_ratios(measured: dict[str, list[float]], row: str) -> list[float]:
    """mpidag's steps/s over torch's, run by neighbouring run, of :func:`interleaved_session`.

    Example::

        >>> pair_ratios({"r/mpidag": [300.0, 330.0], "r/torch_rpc": [200.0, 300.0]}, "r")
        [1.5, 1.1]
    """
    return [m / t for m, t in zip(measured[f"{row}/mpidag"], measured[f"{row}/torch_rpc"],
                                  strict=True)]


def write_interleaved(measured: dict[str, list[float]], steps: int, warmup: int, reps: int,
                      out: Path) -> None:
    """The JSON of ``--interleaved`` (rank 0), and a line per row on stdout."""
    rows: dict[str, Any] = {}
    for row in ("ps_shared_steps_per_s", "ps_disjoint_steps_per_s"):
        ratios = pair_ratios(measured, row)
        rows[row] = {"unit": "steps/s", "better": "higher",
                     "mpidag": statistics.median(measured[f"{row}/mpidag"]),
                     "torch_rpc": statistics.median(measured[f"{row}/torch_rpc"]),
                     "mpidag_vs_torch_interleaved": statistics.median(ratios),
                     "samples": {"mpidag": measured[f"{row}/mpidag"],
                                 "torch_rpc": measured[f"{row}/torch_rpc"],
                                 "mpidag_vs_torch_interleaved": ratios}}
        print(f"{row}: mpidag {rows[row]['mpidag']:.1f}, torch {rows[row]['torch_rpc']:.1f} "
              f"steps/s, interleaved runs: mpidag / torch {statistics.median(ratios):.2f}x")
    write_document(rows, steps, warmup, reps, out, interleaved=True)
    log(f"wrote {out}")


def write_document(rows: dict[str, Any], steps: int, warmup: int, reps: int, out: Path,
                   **config: Any) -> None:
    """Rank 0: the results JSON (the machine, the date, the run's configuration and
    ``config``'s extra entries, the ``rows``) at ``out``."""
    doc = {"machine": machine_info(),
           "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
           "config": {"table": [ROWS_, DIM], "classes": CLASSES, "batch": BATCH,
                      "steps": steps, "warmup": warmup, "reps": reps, **config,
                      "optimizer": "SGD(lr=0.05, momentum=0.9)", "trainers": 2},
           "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"default {DEFAULT_OUT} ({INTERLEAVED_OUT} with --interleaved)")
    parser.add_argument("--interleaved", action="store_true",
                        help="only the session with both stacks side by side, runs alternating")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = INTERLEAVED_OUT if args.interleaved else DEFAULT_OUT
    world = MPI.COMM_WORLD
    if world.Get_size() != 3:
        if world.Get_rank() == 0:
            sys.stderr.write("bench_optim.py needs exactly 3 MPI ranks\n")
        return 2
    torch.set_num_threads(1)
    comm = world.Dup()
    rank = comm.Get_rank()
    trainers = comm.Split(1 if rank > 0 else MPI.UNDEFINED, rank)
    trainers = None if trainers == MPI.COMM_NULL else trainers
    steps, warmup, reps = (20, 5, 3) if args.quick else (150, 10, 5)
    measured: dict[str, dict[str, list[float]]] = {}
    plan = {"interleaved": [("ps_shared_steps_per_s", "-"),
                            ("ps_disjoint_steps_per_s", "-")]} if args.interleaved else {
        "mpidag": [("ps_shared_steps_per_s", "parameter"),
                   ("ps_disjoint_steps_per_s", "parameter"),
                   ("ps_disjoint_global_lock_steps_per_s", "global")],
        "torch_rpc": [("ps_shared_steps_per_s", "-"), ("ps_disjoint_steps_per_s", "-")],
        "mpi4py": [("ps_shared_steps_per_s", "-"), ("ps_disjoint_steps_per_s", "-")],
    }
    for key, phases in plan.items():
        if rank == 0:
            log(f"{key}: start")
        res = session(key, comm, trainers, phases, steps, warmup, reps)
        gathered = comm.gather(res, root=0)
        if rank == 0:
            measured[key] = gathered[1]  # the first trainer has the allreduced rates
        comm.Barrier()
    if rank == 0 and args.interleaved:
        write_interleaved(measured["interleaved"], steps, warmup, reps, args.out)
    elif rank == 0:
        rows: dict[str, Any] = {}
        for row in ("ps_shared_steps_per_s", "ps_disjoint_steps_per_s"):
            mp = statistics.median(measured["mpidag"][row])
            tp = statistics.median(measured["torch_rpc"][row])
            rp = statistics.median(measured["mpi4py"][row])
            entry: dict[str, Any] = {"unit": "steps/s", "better": "higher", "mpidag": mp,
                                     "torch_rpc": tp, "mpi4py": rp,
                                     "mpidag_vs_torch": mp / tp, "mpidag_vs_mpi4py": mp / rp,
                                     "torch_vs_mpi4py": tp / rp,
                                     "samples": {"mpidag": measured["mpidag"][row],
                                                 "torch_rpc": measured["torch_rpc"][row],
                                                 "mpi4py": measured["mpi4py"][row]}}
            if row == "ps_disjoint_steps_per_s":
                g = measured["mpidag"]["ps_disjoint_global_lock_steps_per_s"]
                entry["mpidag_global_lock"] = statistics.median(g)
                entry["samples"]["mpidag_global_lock"] = g
                entry["parameter_vs_global_lock"] = mp / statistics.median(g)
            rows[row] = entry
        write_document(rows, steps, warmup, reps, args.out)
        for name, e in rows.items():
            extra = (f", global lock {e['mpidag_global_lock']:.1f} "
                     f"(per-parameter locks {e['parameter_vs_global_lock']:.2f}x)"
                     if "mpidag_global_lock" in e else "")
            print(f"{name}: mpidag {e['mpidag']:.1f}, torch {e['torch_rpc']:.1f}, mpi4py "
                  f"{e['mpi4py']:.1f} steps/s ({e['mpidag_vs_torch']:.2f}x torch, "
                  f"{e['mpidag_vs_mpi4py']:.2f}x mpi4py){extra}")
        log(f"wrote {args.out}")
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
