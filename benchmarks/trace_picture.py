"""The merged trace of one distributed training step, as a picture for the docs.

Runs two iterations of a 3-stage pipeline (worker0 -> worker1 -> worker2, a ``Linear`` per
stage, ``rpc_sync`` between stages, distributed backward, ``DistributedOptimizer`` step) under
``torch.profiler`` on every rank, saves each rank's trace with
:func:`mpidag.trace.export_rank_trace`, merges them with :func:`mpidag.trace.merge_traces`
(``benchmarks/results/trace/job.json``, open it in https://ui.perfetto.dev) and draws the
second iteration's mpidag ranges, one row per rank and thread, with the RPC links as arrows
(``docs/images/merged_trace.png``)::

    python -m mpidag.run -n 3 benchmarks/trace_picture.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import mpidag.autograd as dist_autograd
import mpidag.rpc as rpc
from mpidag import testing, trace
from mpidag.optim import DistributedOptimizer

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "trace"
PICTURE = HERE.parent / "docs" / "images" / "merged_trace.png"

torch.manual_seed(0)
STAGE = torch.nn.Linear(256, 256)


def stage_forward(route: list[str], x: torch.Tensor) -> torch.Tensor:
    """This rank's stage, then the rest of the pipeline over RPC."""
    y = torch.relu(STAGE(x))
    return y if not route else rpc.rpc_sync(route[0], stage_forward, args=(route[1:], y))


def stage_params() -> list[rpc.RRef]:
    return [rpc.RRef(p) for p in STAGE.parameters()]


def step(optimizer: DistributedOptimizer, route: list[str]) -> None:
    with dist_autograd.context() as context_id:
        out = stage_forward(route, torch.randn(64, 256))
        dist_autograd.backward(context_id, [out.pow(2).mean()])
        optimizer.step(context_id)


def draw(merged: dict, path: Path) -> None:
    """Rows of mpidag ranges (last iteration) per rank/thread, RPC links as arrows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = merged["traceEvents"]
    steps = [e for e in events if e.get("ph") == "X" and e["name"] == "mpidag.autograd.backward"]
    begin = sorted(e["ts"] for e in events if e.get("ph") == "X"
                   and e["name"].startswith("mpidag.rpc#") and "stage_forward" in e["name"]
                   and e["pid"] == 0)[-1] - 200
    end = max(e["ts"] + e["dur"] for e in steps) + 2000
    shown = [e for e in events if e.get("ph") == "X" and e["name"].startswith("mpidag.")
             and begin <= e["ts"] <= end]
    rows = sorted({(e["pid"], e["tid"]) for e in shown})
    row_of = {key: i for i, key in enumerate(rows)}
    colours = {"mpidag.rpc.serve": "#59a14f", "mpidag.rpc": "#4e79a7",
               "mpidag.autograd": "#f28e2b", "mpidag.optim": "#e15759"}
    fig, ax = plt.subplots(figsize=(12, 0.5 + 0.45 * len(rows)))
    for e in shown:
        kind = next(k for k in colours if e["name"].startswith(k))
        y = row_of[(e["pid"], e["tid"])]
        ax.broken_barh([((e["ts"] - begin) / 1e3, e["dur"] / 1e3)], (y - 0.35, 0.7),
                       facecolors=colours[kind], edgecolors="black", linewidth=0.3)
    starts = {e["id"]: e for e in events if e.get("ph") == "s"}
    for e in events:
        if e.get("ph") != "f" or e["id"] not in starts:
            continue
        s = starts[e["id"]]
        if not (begin <= s["ts"] <= end) or (s["pid"], s["tid"]) not in row_of \
                or (e["pid"], e["tid"]) not in row_of:
            continue
        ax.annotate("", xy=((e["ts"] - begin) / 1e3, row_of[(e["pid"], e["tid"])]),
                    xytext=((s["ts"] - begin) / 1e3, row_of[(s["pid"], s["tid"])]),
                    arrowprops={"arrowstyle": "->", "color": "#444444", "lw": 0.8})
    names = {m["rank"]: m["name"] for m in merged["mpidag"]["ranks"]}
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{names[p]} thread {i}" for i, (p, _) in enumerate(rows)])
    ax.invert_yaxis()
    ax.set_xlabel("ms (rank 0's clock)")
    ax.set_title("one pipeline step over 3 ranks: blue rpc (caller), green serve (callee), "
                 "orange autograd, red optimizer; arrows: caller -> callee")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    rpc.init_rpc()
    me = rpc.get_worker_info()
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    world_size = len(rpc.api._runtime.current().agent.workers)
    route = [f"worker{r}" for r in range(1, world_size)]
    testing.quiesce()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                experimental_config=every_thread) as prof:
        testing.quiesce()
        if me.id == 0:
            params = [p for r in ["worker0", *route] for p in
                      (rpc.rpc_sync(r, stage_params) if r != "worker0" else stage_params())]
            optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=0.01)
            for _ in range(2):
                step(optimizer, route)
            del optimizer, params
        testing.quiesce()
    trace.export_rank_trace(prof, OUT / f"rank{me.id}.json")
    testing.quiesce()
    if me.id == 0:
        files = sorted(OUT.glob("rank*.json"))
        merged = trace.merge_traces(files, OUT / "job.json")
        draw(merged, PICTURE)
        for f in files:
            f.unlink()
        print(f"wrote {OUT / 'job.json'} and {PICTURE}", file=sys.stderr)
    rpc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
