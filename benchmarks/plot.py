"""Plot the benchmark results ``results/{rpc,autograd,optim}.json`` as PNGs.

One panel per benchmark row, one bar per implementation on a log scale, each labelled with
its value: raw mpi4py, torch.distributed.rpc and mpidag for RPC; one rank with
``loss.backward()``, a hand-written raw mpi4py split, torch.distributed.autograd and mpidag
for distributed autograd; a hand-written raw mpi4py server, torch's DistributedOptimizer and
mpidag's with one global lock and with per-parameter locks for the parameter server::

    python benchmarks/plot.py                      # every results file that exists
    python benchmarks/plot.py --json PATH --out PATH

The ``bench_scaling.py`` results (``results/scaling_*.json``, one file per run) become one
figure, ``results/scaling.png``: each row against the number of ranks, torch vs mpidag.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after selecting the backend

RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: (JSON key, legend label, colour), in plotting order.
IMPLS: list[tuple[str, str, str]] = [
    ("raw_mpi", "raw mpi4py", "#7f7f7f"),
    ("torch_rpc", "torch.distributed.rpc (TensorPipe)", "#ee7733"),
    ("mpidag", "mpidag.rpc", "#0077bb"),
]
AUTOGRAD_IMPLS: list[tuple[str, str, str]] = [
    ("local", "one rank, loss.backward()", "#bbbbbb"),
    ("mpi4py", "the same split by hand, raw mpi4py", "#7f7f7f"),
    ("torch_rpc", "torch.distributed.autograd (TensorPipe)", "#ee7733"),
    ("mpidag", "mpidag.autograd", "#0077bb"),
]
OPTIM_IMPLS: list[tuple[str, str, str]] = [
    ("mpi4py", "the same server by hand, raw mpi4py", "#7f7f7f"),
    ("torch_rpc", "torch DistributedOptimizer (TensorPipe)", "#ee7733"),
    ("mpidag_global_lock", "mpidag, one global lock per rank (torch's scheme)", "#77aadd"),
    ("mpidag", "mpidag, per-parameter locks", "#0077bb"),
]
#: results file stem -> (implementations, figure title)
KINDS: dict[str, tuple[list[tuple[str, str, str]], str]] = {
    "rpc": (IMPLS, "RPC between 2 MPI ranks on one host"),
    "autograd": (AUTOGRAD_IMPLS, "Forward + distributed backward per iteration, 2 MPI ranks"),
    "optim": (OPTIM_IMPLS, "Parameter server (1 server, 2 trainers, 3 MPI ranks): steps/s"),
}
#: ratio keys of a row and how to label them
RATIOS = [("mpidag_vs_local", "mpidag/local"),
          ("mpidag_vs_local_interleaved", "mpidag/local, interleaved"),
          ("mpidag_vs_mpi4py", "mpidag/mpi4py"),
          ("mpidag_vs_torch", "mpidag/torch"),
          ("parameter_vs_global_lock", "per-parameter/global lock")]


def format_value(value: float, unit: str) -> str:
    """Format a value compactly; microseconds are shown in us, ms or s as fits."""
    if unit == "us":
        if value >= 1e6:
            return f"{value / 1e6:.2f} s"
        if value >= 1e3:
            return f"{value / 1e3:.3g} ms"
        return f"{value:.3g} µs"
    if unit == "calls/s":
        return f"{value / 1e3:.3g}k/s" if value >= 1e3 else f"{value:.3g}/s"
    if unit == "%":
        return f"{value:.3g} %"
    if unit == "ms":
        return f"{value * 1e3:.3g} µs" if value < 1 else f"{value:.3g} ms"
    return f"{value:.3g} {unit}"


def plot_row(ax: Any, name: str, entry: dict[str, Any],
             impls: list[tuple[str, str, str]] = IMPLS) -> None:
    """Draw one row's three bars (log scale) with value labels into ``ax``."""
    unit = entry.get("unit", "")
    gbps = entry.get("GBps") or {}
    values = [entry.get(key) for key, _, _ in impls]
    present = [v for v in values if isinstance(v, (int, float)) and v > 0]
    lo = min(present) if present else 1.0
    hi = max(present) if present else 10.0
    floor = 10 ** math.floor(math.log10(lo) - 0.5)
    top = 10 ** math.ceil(math.log10(hi) + 0.8)
    ax.set_yscale("log")
    ax.set_ylim(floor, top)
    for i, ((key, _, colour), v) in enumerate(zip(impls, values, strict=True)):
        if v is None:
            if key in (entry.get("errors") or {}):
                note = "failed"
            else:
                note = "pending" if key == "mpidag" else "n/a"
            ax.text(i, floor * 1.3, note, ha="center", va="bottom", fontsize=9,
                    color="#555555", style="italic")
            continue
        height = max(float(v), floor * 1.01)
        ax.bar(i, height, width=0.7, color=colour, edgecolor="black", linewidth=0.5)
        label = format_value(float(v), unit)
        if gbps.get(key) is not None:
            label += f"\n{gbps[key]:.2f} GB/s"
        ax.text(i, height * 1.15, label, ha="center", va="bottom", fontsize=8.5)
    better = entry.get("better", "lower")
    ax.set_title(f"{name}\n({unit}, {better} is better)", fontsize=10)
    ax.set_xlim(-0.6, len(impls) - 0.4)
    ax.set_xticks(range(len(impls)))
    ax.set_xticklabels([key for key, _, _ in impls], fontsize=8.5)
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(axis="y", which="major", alpha=0.3)
    ratios = [f"{label} = {entry[key]:.2f}x" for key, label in RATIOS
              if entry.get(key) is not None]
    if ratios:
        ax.text(0.98, 0.98, "\n".join(ratios), transform=ax.transAxes,
                ha="right", va="top", fontsize=8, color="#0077bb")


def plot(report: dict[str, Any], out: Path, kind: str = "rpc") -> None:
    """Write the figure for ``report`` (the parsed JSON of results/<kind>.json) to ``out``."""
    rows = list(report["rows"].items())
    impls, what = KINDS[kind]
    wide_legend = kind != "rpc"
    ncols = min(4, len(rows))
    nrows = math.ceil(len(rows) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 4.4 * nrows), squeeze=False)
    flat = [ax for line in axes for ax in line]
    for ax, (name, entry) in zip(flat, rows, strict=False):
        plot_row(ax, name, entry, impls)
    for ax in flat[len(rows):]:
        ax.axis("off")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, ec="black", lw=0.5) for _, _, c in impls]
    if wide_legend:
        fig.legend(handles, [label for _, label, _ in impls], loc="lower center",
                   ncol=min(len(impls), max(2, ncols)), fontsize=9, frameon=False)
    else:
        fig.legend(handles, [label for _, label, _ in impls], loc="lower right",
                   bbox_to_anchor=(0.98, 0.08), fontsize=10, frameon=False)
    m = report.get("machine", {})
    mpi = str(m.get("mpi", "")).replace(chr(0), "").split(",")[0]
    machine = (f"{m.get('cores', '?')} cores {m.get('cpu', '')}, torch {m.get('torch', '?')}, "
               f"mpi4py {m.get('mpi4py', '?')}, {mpi}")
    quick = "  [--quick]" if report.get("quick") else ""
    fig.suptitle(f"{what} — {report.get('date', '')}{quick}\n{machine}", fontsize=11)
    fig.tight_layout(rect=(0, 0.11 if wide_legend else 0, 1, 0.9 if wide_legend else 0.95))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_scaling(reports: list[dict[str, Any]], out: Path) -> None:
    """Write the ``bench_scaling.py`` figure: one panel per row, value against ranks.

    ``reports`` are parsed ``scaling_*.json`` files; runs with the same number of ranks are
    drawn as their median with the range as an error bar.
    """
    names = list(reports[0]["rows"])
    fig, axes = plt.subplots(2, math.ceil(len(names) / 2), figsize=(10, 8), squeeze=False)
    flat = [ax for line in axes for ax in line]
    for ax, name in zip(flat, names, strict=False):
        entry0 = reports[0]["rows"][name]
        for key, label, colour in IMPLS:
            by_size: dict[int, list[float]] = {}
            for rep in reports:
                v = rep["rows"].get(name, {}).get(key)
                if isinstance(v, (int, float)) and v > 0:  # (a log axis)
                    by_size.setdefault(int(rep["ranks"]), []).append(float(v))
            if not by_size:
                continue
            sizes = sorted(by_size)
            mid = [sorted(by_size[n])[len(by_size[n]) // 2] for n in sizes]
            low = [m - min(by_size[n]) for m, n in zip(mid, sizes, strict=True)]
            high = [max(by_size[n]) - m for m, n in zip(mid, sizes, strict=True)]
            ax.errorbar(sizes, mid, yerr=[low, high], color=colour, marker="o", capsize=3,
                        label=label)
            for n, m in zip(sizes, mid, strict=True):
                ax.annotate(format_value(m, entry0.get("unit", "")), (n, m), fontsize=8,
                            textcoords="offset points", xytext=(4, 4), color=colour)
        ax.set_xscale("log", base=2)
        sizes_all = sorted({int(r["ranks"]) for r in reports})
        ax.set_xticks(sizes_all)
        ax.set_xticklabels([str(n) for n in sizes_all])
        ax.set_yscale("log")
        ax.set_xlabel("MPI ranks")
        ax.set_title(f"{name}\n({entry0.get('unit', '')}, {entry0.get('better', '')} is "
                     "better)", fontsize=10)
        ax.grid(alpha=0.3, which="both")
    for ax in flat[len(names):]:
        ax.axis("off")
    handles, labels = flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=9, frameon=False)
    m = reports[0].get("machine", {})
    quick = "  [--quick]" if any(r.get("quick") for r in reports) else ""
    counts: dict[int, int] = {}
    for rep in reports:
        counts[int(rep["ranks"])] = counts.get(int(rep["ranks"]), 0) + 1
    runs = ", ".join(f"{c} x {n} ranks" for n, c in sorted(counts.items()))
    fig.suptitle(f"RPC cost against the number of ranks (one host), runs: "
                 f"{runs}{quick}\n{m.get('cores', '?')} cores "
                 f"{m.get('cpu', '')}, torch {m.get('torch', '?')}", fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 0.93))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=None, help="input JSON (default: both)")
    p.add_argument("--out", type=Path, default=None, help="output PNG (with --json)")
    p.add_argument("--scaling-dir", type=Path, default=None,
                   help="only the scaling_*.json of this directory, to its scaling.png")
    args = p.parse_args(argv)
    if args.scaling_dir is not None:
        found = sorted(args.scaling_dir.glob("scaling_*.json"))
        plot_scaling([json.loads(f.read_text()) for f in found],
                     args.scaling_dir / "scaling.png")
        print(f"wrote {args.scaling_dir / 'scaling.png'}")
        return 0
    if args.json is not None:
        pairs = [(args.json, args.out or args.json.with_suffix(".png"))]
    else:
        pairs = [(RESULTS_DIR / f"{n}.json", RESULTS_DIR / f"{n}.png")
                 for n in KINDS if (RESULTS_DIR / f"{n}.json").exists()]
    scaling = sorted(RESULTS_DIR.glob("scaling_*.json")) if args.json is None else []
    scaling_out = RESULTS_DIR / "scaling.png"
    for src, out in pairs:
        if src.stem.startswith("scaling"):
            scaling = [src]
            scaling_out = out
            continue
        kind = next((k for k in KINDS if src.stem.startswith(k)), "rpc")
        plot(json.loads(src.read_text()), out, kind)
        print(f"wrote {out}")
    if scaling:
        plot_scaling([json.loads(p.read_text()) for p in scaling], scaling_out)
        print(f"wrote {scaling_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
