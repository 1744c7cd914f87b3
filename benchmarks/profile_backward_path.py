"""Where the time of one distributed forward + backward goes: the 1,000-op graph's
critical path, stamped on both ranks with their common clock.

Run on 2 ranks of one host (``time.perf_counter_ns`` is ``CLOCK_MONOTONIC``, the same clock
in every process)::

    python -m mpidag.run -n 2 benchmarks/profile_backward_path.py [--steps 600]

The workload is ``bench_autograd.py``'s ``ops_1000``: 500 small ops on rank 0, an
``rpc_sync`` to rank 1 that runs the other 500, the loss on rank 0, then
``dist_autograd.backward``. The path is strictly sequential (each half waits for the
other), so every step below is on the critical path. The script stamps, without changing
mpidag: the steps of rank 0's iteration, the remote function's start and end on rank 1,
and every call of torch's engine (``graph.engine_grad``: each rank's engine runs its part
of the backward pass as one such call: rank 0 twice, the loss's part and then its 500 ops).
Medians over ``--steps`` iterations, µs, next to the same ops run on one rank
(``loss.backward()``).

Then the floor below any engine, after ``rpc.shutdown()``: the same split written by hand
with raw mpi4py (``bench_autograd.py``'s ``mpi4py`` row, with stamps), its four 500-op
stretches next to the same stretches run back to back in one process. A stretch that
starts after its rank waited for the other runs slower than the same stretch run at once
(on this VM), and that cost is in every split of the graph over two ranks, whatever
carries the messages. The split's own hops between the ranks (a rank's stretch end to the
other's next stretch start, on the common clock) stand beside mpidag's.

Then the thread CPU beside the wall time of two of the engine's steps on the hops (the
pass's plan, a gradient message sent): a step whose CPU equals its wall time computed all
along, one whose CPU is lower waited for the GIL or a core. And, in one process, what a
cold start costs: the thread CPU of one ``contiguous()`` of the expanded 64-float gradient
that the first gradient message of a pass makes, warm and right after a 4 ms sleep, a
500-op ``grad()`` or a 4 ms Python loop (on the 2-core VM 5 µs warm and 38-66 µs cold:
any code's first run after a few milliseconds of anything else costs ~10x its warm run,
so a hop's cost is the amount of distinct code it runs).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_autograd as workload  # noqa: E402 - after the path set-up

import mpidag.autograd as dist_autograd  # noqa: E402
import mpidag.dist_autograd.engine as engine  # noqa: E402
import mpidag.dist_autograd.graph as graph  # noqa: E402
import mpidag.dist_autograd.native as native_records  # noqa: E402
import mpidag.rpc as rpc  # noqa: E402
from mpidag.agent.agent import RpcAgent  # noqa: E402

clock = time.perf_counter_ns
#: (name, ns) of this rank, in order
stamps: list[tuple[str, int]] = []
_grad = graph.engine_grad


def stamped_grad(*args, **kwargs):
    """``engine_grad``, stamped (the engine's one native call per part)."""
    stamps.append(("grad_start", clock()))
    try:
        return _grad(*args, **kwargs)
    finally:
        stamps.append(("grad_end", clock()))


def route_native_plans_through_stamps() -> None:
    """The C++ plan of disjoint sources (``_mpidag_torch.DisjointPlan``) calls torch's engine
    without Python: made with ``direct`` false, it calls ``graph.engine_grad`` (the stamped
    one) for each region instead, one Python call more per engine call."""
    native = native_records.records_module()
    if native is None or not hasattr(native, "disjoint_plan"):
        return
    made = native.disjoint_plan

    def disjoint_plan(*args: Any) -> Any:
        return made(*args[:-1], False)

    native.disjoint_plan = cpu_stamped(disjoint_plan, PLAN_BUILT)


#: (label, thread CPU ns, wall ns) of each call of the engine's steps on a hop
step_costs: list[tuple[str, int, int]] = []
#: the label of the C++ plan's construction (``disjoint_plan``), inside graph.make_plan
PLAN_BUILT = "  of which the C++ disjoint_plan()"

def _gradients(_self: Any, _dst: int, func: Any, *_: Any, **__: Any) -> bool:
    """Whether an agent's ``call``/``notify`` is a gradient message."""
    return getattr(func, "name", None) == "autograd.gradients"


#: the class of a pass's state here: NativePassState, whose _make_plan is C++ up to the C++
#: plan (PassCore._make_plan), where the C++ records module is built
PASS_CLASS = engine.NativePassState or engine.PassState
#: the engine's steps on the hops whose CPU is measured: (class, method, label, which calls
#: count: None, all). A gradient message is stamped where the agent takes it (the engine's
#: C++ PassCore compacts its gradients and builds its arguments before, PassState._send in
#: Python where the C++ records module is not built)
HOP_STEPS = ((PASS_CLASS, "_make_plan", f"the pass's plan ({PASS_CLASS.__name__}._make_plan)",
              None),
             (RpcAgent, "call", "a gradient message sent as a call (RpcAgent.call)",
              _gradients),
             (RpcAgent, "notify", "a gradient message sent as a notification "
                                  "(RpcAgent.notify)", _gradients))


def cpu_stamped(method: Any, label: str, which: Any = None) -> Any:
    """``method``, its thread CPU and wall time recorded in :data:`step_costs` (for the
    calls ``which(*args)`` is true of, all where it is None): a step whose CPU is its wall
    time computed all along (no wait for the GIL or a core)."""
    def stamped(*args: Any, **kwargs: Any) -> Any:
        if which is not None and not which(*args, **kwargs):
            return method(*args, **kwargs)
        cpu, wall = time.thread_time_ns(), clock()
        try:
            return method(*args, **kwargs)
        finally:
            step_costs.append((label, time.thread_time_ns() - cpu, clock() - wall))
    return stamped


def cold_start(repeats: int = 200) -> dict[str, list[int]]:
    """In this process: the thread CPU (ns) of one ``contiguous()`` of an expanded 64-float
    gradient (what the first gradient message of a pass makes) warm, and right after each
    of what precedes it on a hop: the other rank's 500-op ``grad()`` (here a sleep), this
    rank's own ``grad()``, a Python loop of the same length."""
    x = torch.full((workload.OPS_SIZE,), 0.1, requires_grad=True)
    h = workload.ops_half(x, workload.W1)
    expanded = torch.ones(()).expand(workload.OPS_SIZE)
    seed = torch.ones(workload.OPS_SIZE)

    def spin(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    before = {"warm": lambda: None,
              "after a 4 ms sleep": lambda: time.sleep(4e-3),
              "after a 500-op grad()": lambda: torch.autograd.grad(h, [x], seed,
                                                                   retain_graph=True),
              "after a 4 ms Python loop": lambda: spin(4e-3)}
    compact = getattr(native_records.records_module(), "compact_grads", None)
    copies = {"contiguous() of 64 floats": expanded.contiguous}
    if compact is not None:  # what PassState._send runs: the elements gathered in C++
        copies["compact_grads() of them (C++)"] = lambda: compact([expanded],
                                                                  engine.COMPACT_MIN_NUMEL)
    out: dict[str, list[int]] = collections.defaultdict(list)
    for _ in range(repeats):
        for what, copy in copies.items():
            for name, run in before.items():
                run()
                start = time.thread_time_ns()
                copy()
                out[f"one process: {what}, CPU, {name}"].append(
                    time.thread_time_ns() - start)
    workload.W1.grad = None
    return out


def second_half(h: torch.Tensor) -> torch.Tensor:
    """On rank 1: the other 500 ops, stamped."""
    stamps.append(("f1_start", clock()))
    out = workload.ops_half(h, workload.W2)
    stamps.append(("f1_end", clock()))
    return out


def step() -> None:
    """Rank 0: one distributed iteration, stamped."""
    with dist_autograd.context() as context_id:
        stamps.append(("start", clock()))
        h = workload.ops_half(torch.full((workload.OPS_SIZE,), 0.1), workload.W1)
        stamps.append(("f0_end", clock()))
        out = rpc.rpc_sync("worker1", second_half, args=(h,))
        stamps.append(("rpc_ret", clock()))
        loss = out.sum()
        stamps.append(("bwd_start", clock()))
        dist_autograd.backward(context_id, [loss])
        stamps.append(("bwd_end", clock()))
        dist_autograd.get_gradients(context_id)
    stamps.append(("end", clock()))


def pairs(records: list[tuple[str, int]], start: str, end: str) -> list[tuple[int, int]]:
    """(start, end) times of each ``start``/``end`` pair of stamps, in order."""
    starts = [t for name, t in records if name == start]
    ends = [t for name, t in records if name == end]
    return list(zip(starts, ends, strict=True))


def critical_path(rank0: list[tuple[str, int]], rank1: list[tuple[str, int]],
                  steps: int) -> dict[str, list[int]]:
    """Each step's durations (ns) along the path, from both ranks' stamps."""
    iterations, current = [], {}
    for name, t in rank0:
        if name == "start":
            current = {"start": t, "grads": []}
        elif name in ("grad_start", "grad_end"):
            current["grads"].append(t)
        else:
            current[name] = t
        if name == "end":
            iterations.append(current)
    functions = pairs(rank1, "f1_start", "f1_end")[-steps:]
    grads1 = pairs(rank1, "grad_start", "grad_end")[-steps:]
    out: dict[str, list[int]] = collections.defaultdict(list)
    for it, (f_start, f_end), (g_start, g_end) in zip(iterations, functions, grads1,
                                                       strict=True):
        last_start, last_end = it["grads"][-2:]  # rank 0's own 500 ops
        out["rank 0: forward, 500 ops"].append(it["f0_end"] - it["start"])
        out["rpc_sync: call to rank 1's function start"].append(f_start - it["f0_end"])
        out["rank 1: forward, 500 ops"].append(f_end - f_start)
        out["rpc_sync: function end to the call returns"].append(it["rpc_ret"] - f_end)
        out["rank 0: loss"].append(it["bwd_start"] - it["rpc_ret"])
        first_start, first_end = it["grads"][:2]  # rank 0's part before the send: the loss
        out["backward(): start to rank 0's first grad() (plan)"].append(
            first_start - it["bwd_start"])
        out["rank 0: grad() of the loss's part"].append(first_end - first_start)
        out["its end to rank 1's grad() start (message, rank 1's plan)"].append(
            g_start - first_end)
        out["rank 1: grad(), 500 ops"].append(g_end - g_start)
        out["rank 1's grad() end to rank 0's grad() start"].append(last_start - g_end)
        out["rank 0: grad(), 500 ops"].append(last_end - last_start)
        out["rank 0's grad() end to backward() returns"].append(it["bwd_end"] - last_end)
        out["get_gradients() and the context's exit"].append(it["end"] - it["bwd_end"])
        out["whole iteration"].append(it["end"] - it["start"])
    return out


# ------------------------------------------------------------ the floor: raw mpi4py
#: the prefix of the raw split's absolute stamps (ns, one per iteration and rank), which
#: :func:`split_hops` turns into the hops between the ranks
AT = "@"
#: the hops between the ranks, as in :func:`critical_path`: (name, from, to)
SPLIT_HOPS = (
    ("raw mpi4py split: rank 0's forward end to rank 1's forward start",
     "rank 0 forward end", "rank 1 forward start"),
    ("raw mpi4py split: rank 1's forward end to its result received",
     "rank 1 forward end", "rank 0 result received"),
    ("raw mpi4py split: loss's grad() end to rank 1's grad() start",
     "rank 0 loss's backward end", "rank 1 backward start"),
    ("raw mpi4py split: rank 1's grad() end to rank 0's grad() start",
     "rank 1 backward end", "rank 0 backward start"),
)


def split_hops(parts: list[dict[str, list[int]]]) -> dict[str, list[int]]:
    """The hand-written split's hops between the ranks (ns) from both ranks' absolute
    stamps, iteration by iteration (both ranks run the same iterations).

    Example::

        >>> split_hops([{"@rank 0 forward end": [10], "@rank 0 result received": [90],
        ...              "@rank 0 loss's backward end": [100], "@rank 0 backward start": [300]},
        ...             {"@rank 1 forward start": [15], "@rank 1 forward end": [80],
        ...              "@rank 1 backward start": [110], "@rank 1 backward end": [290]}])[
        ...     "raw mpi4py split: rank 1's grad() end to rank 0's grad() start"]
        [10]
    """
    stamps = {k[len(AT):]: v for part in parts for k, v in part.items() if k.startswith(AT)}
    return {name: [b - a for a, b in zip(stamps[start], stamps[end], strict=True)]
            for name, start, end in SPLIT_HOPS}


def split_rank0(comm: MPI.Comm, out: dict[str, list[int]]) -> None:
    """Rank 0's part of one iteration of the hand-written split, stamped."""
    t0 = clock()
    h = workload.ops_half(torch.full((workload.OPS_SIZE,), 0.1), workload.W1)
    t1 = clock()
    comm.Send(h.detach().numpy(), dest=1)
    result = torch.empty(workload.OPS_SIZE)
    comm.Recv(result.numpy(), source=1)
    t_result = clock()
    result.requires_grad_()
    result.sum().backward()
    t_loss = clock()
    comm.Send(result.grad.numpy(), dest=1)
    grad = torch.empty(workload.OPS_SIZE)
    comm.Recv(grad.numpy(), source=1)
    t2 = clock()
    h.backward(grad)
    t3 = clock()
    workload.W1.grad = None
    for name, t in (("forward end", t1), ("result received", t_result),
                    ("loss's backward end", t_loss), ("backward start", t2)):
        out[f"{AT}rank 0 {name}"].append(t)
    out["raw mpi4py split, rank 0: forward, 500 ops"].append(t1 - t0)
    out["raw mpi4py split, rank 0: backward, 500 ops (after a wait)"].append(t3 - t2)
    out["raw mpi4py split: whole iteration"].append(t3 - t0)


def split_rank1(comm: MPI.Comm, out: dict[str, list[int]]) -> None:
    """Rank 1's part of one iteration of the hand-written split, stamped."""
    x = torch.empty(workload.OPS_SIZE)
    comm.Recv(x.numpy(), source=0)
    x.requires_grad_()
    t0 = clock()
    result = workload.ops_half(x, workload.W2)
    t1 = clock()
    comm.Send(result.detach().numpy(), dest=0)
    grad = torch.empty(workload.OPS_SIZE)
    comm.Recv(grad.numpy(), source=0)
    t2 = clock()
    result.backward(grad)
    t3 = clock()
    comm.Send(x.grad.numpy(), dest=0)
    workload.W2.grad = None
    for name, t in (("forward start", t0), ("forward end", t1), ("backward start", t2),
                    ("backward end", t3)):
        out[f"{AT}rank 1 {name}"].append(t)
    out["raw mpi4py split, rank 1: forward, 500 ops (after a wait)"].append(t1 - t0)
    out["raw mpi4py split, rank 1: backward, 500 ops (after a wait)"].append(t3 - t2)


def split_one_process(out: dict[str, list[int]]) -> None:
    """The same split, both halves in this process back to back: no wait before a stretch."""
    t0 = clock()
    h = workload.ops_half(torch.full((workload.OPS_SIZE,), 0.1), workload.W1)
    t1 = clock()
    x = h.detach().requires_grad_()
    result = workload.ops_half(x, workload.W2)
    t2 = clock()
    tail = result.detach().requires_grad_()
    tail.sum().backward()
    t3 = clock()
    result.backward(tail.grad)
    t4 = clock()
    h.backward(x.grad)
    t5 = clock()
    workload.W1.grad = workload.W2.grad = None
    out["one process, the same split: forward, first 500 ops"].append(t1 - t0)
    out["one process, the same split: forward, second 500 ops"].append(t2 - t1)
    out["one process, the same split: backward, second 500 ops"].append(t4 - t3)
    out["one process, the same split: backward, first 500 ops"].append(t5 - t4)
    out["one process, the same split: whole iteration"].append(t5 - t0)


def floor(comm: MPI.Comm, steps: int) -> dict[str, list[int]]:
    """The raw split on both ranks and the one-process split on rank 0, in alternating
    blocks (each block ``steps // 6`` iterations after 10 unstamped ones)."""
    rank = comm.Get_rank()
    out: dict[str, list[int]] = collections.defaultdict(list)
    block = max(steps // 6, 1)
    for _ in range(6):
        scratch: dict[str, list[int]] = collections.defaultdict(list)
        for i in range(10 + block):
            (split_rank0 if rank == 0 else split_rank1)(comm, scratch if i < 10 else out)
        comm.Barrier()
        if rank == 0:
            for i in range(10 + block):
                split_one_process(scratch if i < 10 else out)
        comm.Barrier()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="iterations measured")
    args = parser.parse_args()
    torch.set_num_threads(1)
    graph.engine_grad = stamped_grad
    route_native_plans_through_stamps()
    for cls, name, label, which in HOP_STEPS:
        setattr(cls, name, cpu_stamped(getattr(cls, name), label, which))
    rank = MPI.COMM_WORLD.Get_rank()
    rpc.init_rpc(f"worker{rank}")
    local: list[int] = []
    if rank == 0:
        for _ in range(50):  # warm-up
            step()
        del stamps[:]
        for _ in range(args.steps):
            step()
        for _ in range(args.steps):
            t0 = clock()
            workload.local_step("ops_1000")
            local.append(clock() - t0)
    rpc.shutdown()  # (waits for every rank: rank 1's stamps are all there after it)
    comm = MPI.COMM_WORLD  # each rank's stamps, step costs and floor stretches, at once
    parts = comm.gather((list(stamps), list(step_costs), floor(comm, args.steps)), root=0)
    if rank == 0:  # (the one-rank reference calls backward(), not grad(): no stamps)
        gathered, comm_costs, floors = (list(column) for column in zip(*parts, strict=True))
        table = critical_path(gathered[0], gathered[1], args.steps)
        table["one rank: the same ops, loss.backward()"] = local
        for name, values in table.items():
            print(f"{name:66s} {statistics.median(values) / 1e3:9.1f}")
        print("the floor below any engine (after rpc.shutdown()):")
        for part in [*floors, split_hops(floors)]:
            for name, values in sorted(part.items()):
                if not name.startswith(AT):
                    print(f"{name:66s} {statistics.median(values) / 1e3:9.1f}")
        print("the engine's steps on the hops, thread CPU / wall:")
        for r, part in enumerate(comm_costs):
            labels = [step[2] for step in HOP_STEPS]
            labels.insert(1, PLAN_BUILT)  # (within the plan)
            for label in labels:
                mine = [(c, w) for name, c, w in part if name == label][-args.steps:]
                if mine:
                    cpu = statistics.median(c for c, _ in mine) / 1e3
                    wall = statistics.median(w for _, w in mine) / 1e3
                    print(f"{f'rank {r}: {label}':66s} {cpu:9.1f} / {wall:.1f}")
        print("the cost of a cold start (thread CPU):")
        for name, values in cold_start().items():
            print(f"{name:66s} {statistics.median(values) / 1e3:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
