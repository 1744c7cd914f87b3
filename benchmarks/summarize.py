"""Medians over several runs of the benchmarks, as the markdown tables of the README.

Each benchmark writes one JSON file per run (``--out``); this reads several runs of each and
prints, per row, the median over the runs of each run's value with the range in brackets,
and the median of the per-run ratios (ratios are only meaningful within one run)::

    python benchmarks/summarize.py --rpc runs/rpc_*.json --autograd runs/autograd_*.json \\
        --optim runs/optim_*.json --optim-interleaved runs/optim_interleaved_*.json

Targets of issue 11 are printed beside the rows they apply to, with whether the median met
them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

#: issue 24's goals against torch, on the ratio of the phases' medians and on the ratio of
#: interleaved blocks or runs (bench_autograd.py's mpidag phase, bench_optim.py --interleaved)
FASTER_THAN_TORCH = [("mpidag_vs_torch", "<=", 0.7, "<= 0.7x torch"),
                     ("mpidag_vs_torch_interleaved", "<=", 0.7, "interleaved <= 0.7x torch")]
PS_GOAL = [("mpidag_vs_torch", ">=", 1.3, ">= 1.3x torch"),
           ("mpidag_vs_torch_interleaved", ">=", 1.3, "interleaved >= 1.3x torch")]
#: (row, column of the ratio, comparison, bound, text) of the open targets: issue 24's
#: where it set one (the no-op, the 1 KiB echo, rpc_async, distributed autograd, the
#: parameter server), issue 11's for the rest
TARGETS: dict[str, list[tuple[str, str, float, str]]] = {
    "rtt_noop_us": [("mpidag_vs_raw", "<=", 5.0, "<= 5x raw")],
    "echo_1KiB_us": [("mpidag_vs_raw", "<=", 12.0, "<= 12x raw")],
    "echo_1MiB_us": [("mpidag_vs_raw", "<=", 1.5, "<= 1.5x raw")],
    "echo_64MiB_us": [("mpidag_vs_raw", "<=", 1.1, "<= 1.1x raw")],
    "echo_1GiB_us": [("mpidag_vs_raw", "<=", 1.1, "<= 1.1x raw")],
    "async_calls_per_s": [("mpidag", ">=", 200_000, ">= 200,000/s")],
    "idle_cpu_percent": [("mpidag", "<=", 5.0, "<= 5 %")],
    "autograd_pipeline_mlp_ms": FASTER_THAN_TORCH,
    "autograd_ops_1000_ms": [*FASTER_THAN_TORCH, ("mpidag_vs_local_interleaved", "<=", 1.15,
                                                  "engine <= 1.15x local")],
    "autograd_seed_example_ms": FASTER_THAN_TORCH,
    "ps_shared_steps_per_s": PS_GOAL,
    "ps_disjoint_steps_per_s": PS_GOAL,
}


def fmt(value: float | None) -> str:
    """A number as the README writes it: 3 significant digits, thousands separated."""
    if value is None:
        return "–"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def cell(values: list[float | None], ratio: bool = False) -> str:
    """``median (min-max)`` over the runs that have a value."""
    present = [v for v in values if v is not None]
    if not present:
        return "–"
    unit = "x" if ratio else ""
    median = statistics.median(present)
    if len(present) == 1:
        return f"{fmt(median)}{unit}"
    return f"{fmt(median)}{unit} ({fmt(min(present))}–{fmt(max(present))}{unit})"


def table(paths: list[Path], columns: list[str], ratios: list[str]) -> str:
    """One markdown table of the rows of ``paths`` (runs of one benchmark)."""
    runs = [json.loads(p.read_text())["rows"] for p in paths]
    lines = ["| row | " + " | ".join(columns + ratios) + " | target (median) |",
             "| --- " * (len(columns) + len(ratios) + 2) + "|"]
    for name in runs[0]:
        entries = [run.get(name, {}) for run in runs]
        cells = [cell([e.get(c) for e in entries]) for c in columns]
        cells += [cell([e.get(c) for e in entries], ratio=True) for c in ratios]
        verdicts = []
        for column, op, bound, text in TARGETS.get(name, []):
            present = [e.get(column) for e in entries if e.get(column) is not None]
            if not present:
                continue
            median = statistics.median(present)
            met = median <= bound if op == "<=" else median >= bound
            verdicts.append(f"{text}: {'met' if met else 'not met'}")
        lines.append(f"| `{name}` | " + " | ".join(cells) + " | "
                     + ("; ".join(verdicts) or "–") + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rpc", nargs="*", type=Path, default=[])
    parser.add_argument("--autograd", nargs="*", type=Path, default=[])
    parser.add_argument("--optim", nargs="*", type=Path, default=[])
    parser.add_argument("--optim-interleaved", nargs="*", type=Path, default=[],
                        help="runs of bench_optim.py --interleaved")
    args = parser.parse_args(argv)
    out: list[str] = []
    if args.rpc:
        out += [f"RPC ({len(args.rpc)} runs)", "",
                table(args.rpc, ["raw_mpi", "torch_rpc", "mpidag"],
                      ["mpidag_vs_torch", "mpidag_vs_raw"]), ""]
    if args.autograd:
        out += [f"Distributed autograd, ms per iteration ({len(args.autograd)} runs)", "",
                table(args.autograd, ["local", "mpi4py", "torch_rpc", "mpidag"],
                      ["mpidag_vs_torch", "mpidag_vs_torch_interleaved",
                       "split_vs_torch_interleaved", "mpidag_vs_local_interleaved",
                       "split_vs_local_interleaved", "mpidag_vs_split_interleaved",
                       "mpidag_vs_all_used"]), ""]
    if args.optim:
        out += [f"Parameter server, steps/s ({len(args.optim)} runs)", "",
                table(args.optim, ["mpi4py", "torch_rpc", "mpidag_global_lock", "mpidag"],
                      ["mpidag_vs_torch", "mpidag_vs_mpi4py"]), ""]
    if args.optim_interleaved:
        out += [f"Parameter server, torch and mpidag side by side, runs alternating, steps/s "
                f"({len(args.optim_interleaved)} runs of bench_optim.py --interleaved)", "",
                table(args.optim_interleaved, ["torch_rpc", "mpidag"],
                      ["mpidag_vs_torch_interleaved"]), ""]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
