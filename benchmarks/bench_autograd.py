"""Distributed autograd: mpidag vs ``torch.distributed.autograd`` (TensorPipe) vs one rank.

Run on exactly two MPI ranks; rank 0 drives, rank 1 holds the second stage::

    python -m mpidag.run -n 2 benchmarks/bench_autograd.py [--quick]

Workloads (forward + backward per iteration, median time of several repetitions):

* ``pipeline_mlp``: a 2-stage pipeline MLP, 4 layers of 1024x1024 + ReLU per stage, batch
  64. Stage 1 runs on rank 0, stage 2 on rank 1 (``rpc_sync`` of the activations), loss on
  rank 0, then the distributed backward.
* ``ops_1000``: a graph of 1,000 small ops (tanh, mul, add on 64 floats), 500 per stage.
* ``seed_example``: the design document's example (``my_add`` on worker1, ``t3 * t4``).
* ``large_sum``: a leaf of 1M floats (4 MiB) sent to worker1, doubled there, and the sum of
  the result as the loss: the gradient that goes back to worker1 is one element expanded
  to 4 MiB (what mpidag sends as its element and shape; the hand-written split sends the
  4 MiB that ``.grad`` holds), the one that comes back 4 MiB.
* ``large_dense``: the same with ``(y * 1.0).sum()`` as the loss: 4 MiB of gradient each way.
* ``seed_unused``: the example with ``h = t1 * 2`` sent instead of ``t1``, plus a second
  ``my_add(h, t4)`` on worker1 whose result the loss does not use: ``h``'s node waits for
  both send functions, the graph FAST mode cannot finish (torch returns ``t1``'s gradient
  silently missing), computed exactly by mpidag's SMART mode. Only ``local`` and ``mpidag``
  run it (torch's and the hand-written mpi4py's gradients would be wrong or need a protocol
  of their own); ``mpidag_vs_all_used`` is its
  time over ``seed_example``'s in the same run: the price of the unused RPC (its forward
  message and SMART mode's questions).

``local`` runs the same model on rank 0 alone with ``loss.backward()`` (gradients to
``.grad``, reset every iteration); the goal is mpidag <= 1.3x local, and faster than torch.
``mpi4py`` is the same split written by hand with raw mpi4py (``Send``/``Recv`` of the
activations, then of their gradients, each stage running ``backward`` on its half): the
floor of what any RPC-based engine can do on these two ranks.
Because one machine's speed drifts within a run (the same local iteration ranged from 78 to
164 ms within a minute, and the ratio of the torch and mpidag phases' medians from 1.06 to
1.52 for the pipeline in three runs of one hour), the mpidag phase also starts torch's RPC
beside mpidag's and runs blocks of mpidag, torch, the hand-written split and local
iterations back to back, in rotating order, and reports the medians of their ratios:
``mpidag_vs_local_interleaved`` (the engine overhead), ``split_vs_local_interleaved`` (the
same for the hand-written split: the floor of that overhead), ``mpidag_vs_split_interleaved``
(what mpidag adds to the floor), ``mpidag_vs_torch_interleaved`` and
``split_vs_torch_interleaved`` (the floor of that ratio). Rank 1 serves its half of a block
of the split on a pool thread, called with ``rpc_async``, on a communicator of its own.
torch's RPC starts there a second time in these processes (after its own phase): its RRefs
do not survive that (``bench_optim.py --interleaved`` starts fresh processes), its
distributed autograd does, and its gradients are checked against a local backward first.
During the torch, split and local blocks mpidag's agent idles (its leaders yield for 50 ms
after the last message, then nap: 4 % of a core idle, see ``bench_rpc.py``), a cost the
mpidag blocks do not pay; torch's agent idles in ``epoll`` during the others.
Every rank uses one intra-op thread (two ranks share two cores). Rank 0 writes
``benchmarks/results/autograd.json``; ``benchmarks/plot.py`` draws it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
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
from _common import (  # noqa: E402 - after the path set-up
    Watchdog,
    log,
    machine_info,
    start_torch_rpc,
    timed_allreduce_min,
    timed_barrier,
)

DEFAULT_OUT = HERE / "results" / "autograd.json"
IMPLS = ["local", "mpi4py", "torch_rpc", "mpidag"]
WIDTH, LAYERS, BATCH = 1024, 4, 64
OPS_PER_STAGE, OPS_SIZE = 500, 64
LARGE_SIZE = 1 << 20


# ---------------------------------------------------------------- models (both ranks)
def _stage(seed: int) -> torch.nn.Sequential:
    gen = torch.Generator().manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        lin = torch.nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(WIDTH, WIDTH, generator=gen) / WIDTH ** 0.5)
            lin.bias.zero_()
        layers += [lin, torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


STAGE1 = _stage(1)
STAGE2 = _stage(2)
W1 = torch.linspace(0.5, 1.0, OPS_SIZE).requires_grad_()
W2 = torch.linspace(1.0, 0.5, OPS_SIZE).requires_grad_()
LARGE = torch.linspace(0.0, 1.0, LARGE_SIZE).requires_grad_()


def stage2_forward(h: torch.Tensor) -> torch.Tensor:
    """On rank 1: the second pipeline stage."""
    return STAGE2(h)


def ops_half(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for i in range(OPS_PER_STAGE):
        h = (h * w) if i % 2 else torch.tanh(h + 0.01)
    return h


def ops_stage2(h: torch.Tensor) -> torch.Tensor:
    """On rank 1: the second half of the 1,000-op graph."""
    return ops_half(h, W2)


def my_add(t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
    return torch.add(t1, t2)


def double(h: torch.Tensor) -> torch.Tensor:
    """On rank 1: ``large_sum``'s second stage."""
    return h * 2


# ---------------------------------------------------------------- one iteration each
def local_step(workload: str) -> None:
    if workload == "pipeline_mlp":
        x = torch.randn(BATCH, WIDTH)
        STAGE2(STAGE1(x)).pow(2).mean().backward()
        for p in (*STAGE1.parameters(), *STAGE2.parameters()):
            p.grad = None
    elif workload == "ops_1000":
        ops_half(ops_half(torch.full((OPS_SIZE,), 0.1), W1), W2).sum().backward()
        W1.grad = W2.grad = None
    elif workload in ("large_sum", "large_dense"):
        _loss(workload, double(LARGE)).backward()
        LARGE.grad = None
    else:
        t1, t2, t4 = (torch.rand((3, 3), requires_grad=True) for _ in range(3))
        if workload == "seed_unused":
            h = t1 * 2
            my_add(h, t4)  # computed, not used by the loss
            (my_add(h, t2) * t4).sum().backward()
        else:
            (my_add(t1, t2) * t4).sum().backward()


def distributed_step(rpc: ModuleType, dist_autograd: ModuleType, workload: str) -> None:
    with dist_autograd.context() as context_id:
        if workload == "pipeline_mlp":
            h = STAGE1(torch.randn(BATCH, WIDTH))
            loss = rpc.rpc_sync("worker1", stage2_forward, args=(h,)).pow(2).mean()
        elif workload == "ops_1000":
            h = ops_half(torch.full((OPS_SIZE,), 0.1), W1)
            loss = rpc.rpc_sync("worker1", ops_stage2, args=(h,)).sum()
        elif workload in ("large_sum", "large_dense"):
            loss = _loss(workload, rpc.rpc_sync("worker1", double, args=(LARGE,)))
        else:
            t1, t2, t4 = (torch.rand((3, 3), requires_grad=True) for _ in range(3))
            if workload == "seed_unused":
                t1 = t1 * 2  # h: its node waits for the gradients of both calls
                rpc.rpc_sync("worker1", my_add, args=(t1, t4))  # not used by the loss
            loss = (rpc.rpc_sync("worker1", my_add, args=(t1, t2)) * t4).sum()
        dist_autograd.backward(context_id, [loss])
        dist_autograd.get_gradients(context_id)


# ------------------------------------------------- the same split by hand, raw mpi4py
def _first_half(workload: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Rank 0's forward up to the cut: (leaves it owns, tensors sent to rank 1)."""
    if workload == "pipeline_mlp":
        return [], [STAGE1(torch.randn(BATCH, WIDTH))]
    if workload == "ops_1000":
        return [], [ops_half(torch.full((OPS_SIZE,), 0.1), W1)]
    if workload in ("large_sum", "large_dense"):
        return [LARGE], [LARGE]
    t1, t2 = (torch.rand((3, 3), requires_grad=True) for _ in range(2))
    return [t1, t2], [t1, t2]


def _second_half(workload: str, inputs: list[torch.Tensor]) -> torch.Tensor:
    """Rank 1's part of the forward."""
    if workload == "pipeline_mlp":
        return STAGE2(inputs[0])
    if workload == "ops_1000":
        return ops_stage2(inputs[0])
    if workload in ("large_sum", "large_dense"):
        return double(inputs[0])
    return my_add(*inputs)


def _loss(workload: str, out: torch.Tensor) -> torch.Tensor:
    if workload == "pipeline_mlp":
        return out.pow(2).mean()
    if workload in ("ops_1000", "large_sum"):
        return out.sum()
    if workload == "large_dense":
        return (out * 1.0).sum()
    return (out * torch.rand((3, 3), requires_grad=True)).sum()


def _shape(workload: str) -> tuple[int, ...]:
    return {"pipeline_mlp": (BATCH, WIDTH), "ops_1000": (OPS_SIZE,),
            "large_sum": (LARGE_SIZE,), "large_dense": (LARGE_SIZE,)}.get(workload, (3, 3))


def mpi4py_step(comm: MPI.Comm, workload: str) -> None:
    """Rank 0: one forward + backward, activations and gradients sent with raw mpi4py."""
    _, sent = _first_half(workload)
    for t in sent:
        comm.Send(t.detach().numpy(), dest=1)
    out = torch.empty(_shape(workload))
    comm.Recv(out.numpy(), source=1)
    out.requires_grad_()
    _loss(workload, out).backward()
    comm.Send(out.grad.numpy(), dest=1)
    grads = [torch.empty_like(t) for t in sent]
    for g in grads:
        comm.Recv(g.numpy(), source=1)
    torch.autograd.backward(sent, grads)
    for p in (*STAGE1.parameters(), *STAGE2.parameters(), W1, W2, LARGE):
        p.grad = None


def mpi4py_serve(comm: MPI.Comm, workload: str) -> None:
    """Rank 1: its half of one :func:`mpi4py_step`."""
    n_in = 2 if workload == "seed_example" else 1
    inputs = [torch.empty(_shape(workload)) for _ in range(n_in)]
    for t in inputs:
        comm.Recv(t.numpy(), source=0)
        t.requires_grad_()
    out = _second_half(workload, inputs)
    comm.Send(out.detach().numpy(), dest=0)
    grad = torch.empty_like(out)
    comm.Recv(grad.numpy(), source=0)
    out.backward(grad)
    for t in inputs:
        comm.Send(t.grad.numpy(), dest=0)
    for p in (*STAGE2.parameters(), W2):
        p.grad = None


#: the hand-written split's communicator during the mpidag phase (both ranks; see run())
SPLIT_COMM: MPI.Comm | None = None


def serve_split(workload: str, iterations: int) -> None:
    """On rank 1, called by rank 0 with ``rpc_async``: its half of ``iterations`` steps of
    the hand-written split, on :data:`SPLIT_COMM`."""
    assert SPLIT_COMM is not None
    for _ in range(iterations):
        mpi4py_serve(SPLIT_COMM, workload)


# ---------------------------------------------------------------- driver
WORKLOADS: dict[str, dict[str, int]] = {
    # iterations per repetition, repetitions, warm-up iterations
    "pipeline_mlp": {"calls": 10, "reps": 7, "warmup": 5},
    "ops_1000": {"calls": 20, "reps": 7, "warmup": 10},
    "seed_example": {"calls": 300, "reps": 7, "warmup": 100},
    "seed_unused": {"calls": 300, "reps": 7, "warmup": 100},
    "large_sum": {"calls": 10, "reps": 7, "warmup": 5},
    "large_dense": {"calls": 10, "reps": 7, "warmup": 5},
}
#: workloads only some implementations can run correctly (see the module docstring)
ONLY = {"seed_unused": ("local", "mpidag")}


def runs(key: str, workloads: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The workloads implementation ``key`` runs."""
    return {w: spec for w, spec in workloads.items() if key in ONLY.get(w, (key,))}


def check_gradients(rpc: ModuleType, dist_autograd: ModuleType) -> None:
    """The pipeline's stage-1 gradients equal a local backward (same input)."""
    x = torch.randn(BATCH, WIDTH)
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", stage2_forward, args=(STAGE1(x),)).pow(2).mean()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
    STAGE2(STAGE1(x)).pow(2).mean().backward()
    for p in STAGE1.parameters():
        torch.testing.assert_close(grads[p], p.grad, rtol=1e-4, atol=1e-6)
        p.grad = None
    for p in STAGE2.parameters():
        p.grad = None


def measure(step: Callable[[], None], spec: dict[str, int]) -> list[float]:
    for _ in range(spec["warmup"]):
        step()
    per_iter = []
    for _ in range(spec["reps"]):
        t0 = time.perf_counter()
        for _ in range(spec["calls"]):
            step()
        per_iter.append((time.perf_counter() - t0) / spec["calls"] * 1e3)
    return per_iter


def start_rpc(key: str, comm: MPI.Comm) -> tuple[ModuleType, ModuleType]:
    if key == "mpidag":
        import mpidag.autograd as dist_autograd
        import mpidag.rpc as rpc

        rpc.init_rpc()
        return rpc, dist_autograd
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc

    start_torch_rpc(comm, timeout=300)
    return rpc, dist_autograd


def run(key: str, comm: MPI.Comm, workloads: dict[str, dict[str, int]]
        ) -> dict[str, list[float]] | None:
    rank = comm.Get_rank()
    workloads = runs(key, workloads)
    if key == "mpi4py":
        timed_barrier(comm, 600, "mpi4py start")
        out = {} if rank == 0 else None
        for w, spec in workloads.items():
            with Watchdog(3600, f"mpi4py {w}"):
                if rank == 0:
                    out[w] = measure(lambda w=w: mpi4py_step(comm, w), spec)
                    log(f"mpi4py: {w} = {statistics.median(out[w]):.3f} ms/iteration")
                else:
                    for _ in range(spec["warmup"] + spec["reps"] * spec["calls"]):
                        mpi4py_serve(comm, w)
        timed_barrier(comm, 600, "mpi4py end")
        return out
    if key == "local":
        timed_barrier(comm, 600, "local start")
        out = None
        if rank == 0:
            out = {w: measure(lambda w=w: local_step(w), spec) for w, spec in workloads.items()}
        timed_barrier(comm, 3600, "local end")
        return out
    global SPLIT_COMM
    beside: tuple[ModuleType, ModuleType] | None = None  # torch's RPC, in the mpidag phase
    if key == "mpidag":
        SPLIT_COMM = comm.Dup()  # collective: before the agents start
        with Watchdog(300, "torch_rpc init beside mpidag"):
            beside = start_rpc("torch_rpc", comm)
    with Watchdog(300, f"{key} init"):
        rpc, dist_autograd = start_rpc(key, comm)
    timed_allreduce_min(comm, 1, 300, f"{key} init")
    if rank == 1:
        with Watchdog(3600, f"{key} serve"):
            rpc.shutdown()
            stop_beside(beside)
        return None
    check_gradients(rpc, dist_autograd)
    if beside is not None:  # torch's RPC started a second time in these processes (its
        check_gradients(*beside)  # RRefs would not work; its autograd, checked here, does)
    out = {}
    for w, spec in workloads.items():
        t0 = time.perf_counter()
        out[w] = measure(lambda w=w: distributed_step(rpc, dist_autograd, w), spec)
        log(f"{key}: {w} = {statistics.median(out[w]):.3f} ms/iteration "
            f"[{time.perf_counter() - t0:.1f} s]")
        if key == "mpidag":
            ratios = interleaved_ratios((rpc, dist_autograd), beside, w, spec)
            out.update({f"{w}/{name}": values for name, values in ratios.items()})
            log(f"{key}: {w} interleaved: " + ", ".join(
                f"{name} {statistics.median(values):.2f}x" for name, values in ratios.items()))
    rpc.shutdown()
    stop_beside(beside)
    return out


def stop_beside(beside: tuple[ModuleType, ModuleType] | None) -> None:
    """After the mpidag phase's own shutdown: torch's RPC started beside it, and the
    hand-written split's communicator."""
    global SPLIT_COMM
    if beside is not None:
        beside[0].shutdown()
    if SPLIT_COMM is not None:
        SPLIT_COMM.Free()
        SPLIT_COMM = None


#: the ratios of interleaved blocks reported per workload: the JSON field of each ->
#: (numerator, denominator)
INTERLEAVED_RATIOS = {"mpidag_vs_local_interleaved": ("mpidag", "local"),
                      "split_vs_local_interleaved": ("split", "local"),
                      "mpidag_vs_split_interleaved": ("mpidag", "split"),
                      "mpidag_vs_torch_interleaved": ("mpidag", "torch"),
                      "split_vs_torch_interleaved": ("split", "torch")}


def interleaved_ratios(mpidag: tuple[ModuleType, ModuleType],
                       torch_rpc: tuple[ModuleType, ModuleType] | None, workload: str,
                       spec: dict[str, int]) -> dict[str, list[float]]:
    """Rank 0 in the mpidag phase: blocks of ``workload`` by mpidag, torch (when it runs
    beside), the hand-written split and one rank, interleaved; the per-block ratios of
    :data:`INTERLEAVED_RATIOS` that apply to the workload."""
    blocks = {"mpidag": lambda: distributed_step(*mpidag, workload),
              "local": lambda: local_step(workload)}
    if workload in runs("mpi4py", WORKLOADS):
        blocks["split"] = lambda: split_block(mpidag[0], workload, spec["calls"])
        split_block(mpidag[0], workload, spec["warmup"])
    if torch_rpc is not None and workload in runs("torch_rpc", WORKLOADS):
        blocks["torch"] = lambda: distributed_step(*torch_rpc, workload)
        for _ in range(spec["warmup"]):
            blocks["torch"]()
    times = interleaved_blocks(blocks, spec)
    return {name: [x / y for x, y in zip(times[a], times[b], strict=True)]
            for name, (a, b) in INTERLEAVED_RATIOS.items() if a in times and b in times}


def split_block(rpc: ModuleType, workload: str, iterations: int) -> None:
    """Rank 0: ``iterations`` steps of the hand-written split while the agent is up (rank 1
    serves them in :func:`serve_split`)."""
    served = rpc.rpc_async("worker1", serve_split, args=(workload, iterations))
    for _ in range(iterations):
        mpi4py_step(SPLIT_COMM, workload)
    served.wait()


def interleaved_blocks(blocks: dict[str, Callable[[], None]], spec: dict[str, int]
                       ) -> dict[str, list[float]]:
    """Seconds of each of ``reps`` blocks of each kind, the kinds back to back in rotating
    order (``calls`` iterations a block; a block named ``split`` runs all of its iterations
    itself), so that drifts of a noisy machine hit every kind alike.

    Example::

        >>> times = interleaved_blocks({"a": lambda: None, "b": lambda: None},
        ...                            {"reps": 3, "calls": 2})
        >>> sorted(times), len(times["a"])
        (['a', 'b'], 3)
    """
    names = list(blocks)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(spec["reps"]):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            t0 = time.perf_counter()
            if name == "split":
                blocks[name]()
            else:
                for _ in range(spec["calls"]):
                    blocks[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def report(measured: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for w in WORKLOADS:
        entry: dict[str, Any] = {"unit": "ms", "better": "lower"}
        for key in IMPLS:
            samples = measured.get(key, {}).get(w)
            entry[key] = statistics.median(samples) if samples else None
        entry["samples"] = {k: measured[k][w] for k in measured if w in measured[k]}

        def ratio(a: str, b: str, e: dict[str, Any] = entry) -> float | None:
            return e[a] / e[b] if e.get(a) and e.get(b) else None

        entry["mpidag_vs_local"] = ratio("mpidag", "local")
        for field in INTERLEAVED_RATIOS:
            inter = measured.get("mpidag", {}).get(f"{w}/{field}")
            entry[field] = statistics.median(inter) if inter else None
            if inter:
                entry["samples"][field] = inter
        entry["mpidag_vs_torch"] = ratio("mpidag", "torch_rpc")
        entry["mpidag_vs_mpi4py"] = ratio("mpidag", "mpi4py")
        entry["torch_vs_local"] = ratio("torch_rpc", "local")
        if w == "seed_unused":  # per-run ratio to the same graph with every RPC used
            base = measured.get("mpidag", {}).get("seed_example")
            entry["mpidag_vs_all_used"] = (entry["mpidag"] / statistics.median(base)
                                           if entry["mpidag"] and base else None)
        entry["description"] = (__doc__ or "").split(f"``{w}``: ")[-1].split("\n*")[0] \
            .replace("\n", " ").strip() if f"``{w}``" in (__doc__ or "") else w
        rows[f"autograd_{w}_ms"] = entry
    return {
        "machine": machine_info(),
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "config": {"torch_num_threads": torch.get_num_threads(), "batch": BATCH,
                   "width": WIDTH, "layers_per_stage": LAYERS,
                   "ops": 2 * OPS_PER_STAGE, "workloads": WORKLOADS},
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--only", default=",".join(IMPLS),
                        help=f"comma-separated subset of {','.join(IMPLS)}")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        if world.Get_rank() == 0:
            sys.stderr.write("bench_autograd.py needs exactly 2 MPI ranks\n")
        return 2
    torch.set_num_threads(1)
    workloads = {w: dict(spec) for w, spec in WORKLOADS.items()}
    if args.quick:
        for spec in workloads.values():
            spec["reps"], spec["warmup"] = 3, max(2, spec["warmup"] // 5)
    comm = world.Dup()
    rank = comm.Get_rank()
    if rank == 0 and os.getloadavg()[0] > 0.5:
        log(f"WARNING: load average {os.getloadavg()[0]:.2f} before starting: noisy numbers")
    measured: dict[str, dict[str, list[float]]] = {}
    for key in [k for k in IMPLS if k in args.only.split(",")]:
        if rank == 0:
            log(f"{key}: start")
        out = run(key, comm, workloads)
        if rank == 0 and out is not None:
            measured[key] = out
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report(measured), indent=2) + "\n")
        timed_barrier(comm, 3600, f"after {key}")
    if rank == 0:
        doc = report(measured)
        print(f"{'workload':<24}{'local ms':>10}{'mpi4py ms':>10}{'torch ms':>10}"
              f"{'mpidag ms':>11}{'mpidag/local':>14}{'interleaved':>13}{'split/local':>13}"
              f"{'mpidag/split':>14}{'mpidag/torch':>14}{'interleaved':>13}"
              f"{'split/torch':>13}")
        for name, e in doc["rows"].items():
            def f(v: float | None, fmt: str = "{:.3f}") -> str:
                return "-" if v is None else fmt.format(v)
            print(f"{name:<24}{f(e['local']):>10}{f(e['mpi4py']):>10}{f(e['torch_rpc']):>10}"
                  f"{f(e['mpidag']):>11}"
                  f"{f(e['mpidag_vs_local'], '{:.2f}x'):>14}"
                  f"{f(e['mpidag_vs_local_interleaved'], '{:.2f}x'):>13}"
                  f"{f(e['split_vs_local_interleaved'], '{:.2f}x'):>13}"
                  f"{f(e['mpidag_vs_split_interleaved'], '{:.2f}x'):>14}"
                  f"{f(e['mpidag_vs_torch'], '{:.2f}x'):>14}"
                  f"{f(e['mpidag_vs_torch_interleaved'], '{:.2f}x'):>13}"
                  f"{f(e['split_vs_torch_interleaved'], '{:.2f}x'):>13}")
        log(f"wrote {args.out}")
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
