"""Two revisions of mpidag benchmarked alternately, on one machine in one run, as a table.

The VM this project is measured on drifts 2x within an hour, so "before" and "after" figures
from different runs say little. This checks both revisions out (``git worktree``), then runs
``bench_rpc.py``, ``bench_autograd.py`` and ``bench_optim.py`` (each revision with its own
copy of the benchmark, all ``--quick``) for the old tree, then the new, ``--rounds`` times,
and prints per row the median over the rounds of mpidag's own figure and of its ratios to
torch RPC and raw mpi4py measured in the same run, with their ranges::

    python benchmarks/compare_revisions.py 00c95c9 HEAD --rounds 4 --out /tmp/ab

The JSON of every run stays in ``--out`` (``rpc_old_1.json``, ...); ``--table-only`` prints
the table of an earlier run again. A revision with compiled modules gets its own build
(``mpidag.transport.wire_build --into``), first on its ``PYTHONPATH``. Run it on an idle
machine; it takes the same lock as the
other benchmark scripts of this project (``flock /tmp/bench.lock``) when ``flock`` exists.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from summarize import fmt  # this directory is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
#: (short name, benchmark script, ranks)
BENCHMARKS = (("rpc", "bench_rpc.py", 2), ("autograd", "bench_autograd.py", 2),
              ("optim", "bench_optim.py", 3))
#: the columns compared: mpidag's figure, its ratios within the run, the engine overhead
METRICS = ("mpidag", "mpidag_vs_torch", "mpidag_vs_raw", "interleaved", "vs_split_interleaved",
           "vs_torch_interleaved")


def clear_earlier_run(out: Path) -> int:
    """Remove the rounds of an earlier run from ``out`` (its table reads every round there:
    a run of fewer rounds into the same directory once showed a stale fifth); returns how
    many files went."""
    stale = [path for side in ("old", "new") for path in out.glob(f"*_{side}_*.*")]
    for path in stale:
        path.unlink()
    return len(stale)


def checkout(revision: str, where: Path) -> str:
    """A detached worktree of ``revision`` at ``where``; returns its commit."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force",
                    str(where), revision], check=True, capture_output=True, text=True)
    return subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"],
                          check=True, capture_output=True, text=True).stdout.strip()


def build_compiled(tree: Path) -> str:
    """Build ``tree``'s own compiled modules into ``tree/.compiled`` (a revision without
    them: nothing); what happened, for the log."""
    if not (tree / "mpidag" / "transport" / "wire_build.py").exists():
        return "no compiled modules in this revision"
    result = subprocess.run([sys.executable, "-m", "mpidag.transport.wire_build", "--into",
                             str(tree / ".compiled")], cwd=tree, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    return (result.stdout + result.stderr).strip()


def run_benchmark(tree: Path, script: str, ranks: int, out: Path, log: Path) -> int:
    """One ``--quick`` run of ``tree``'s own copy of a benchmark, importing ``tree``'s mpidag
    (and its own compiled modules, where it has them)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / ".compiled"), str(tree)])}
    command = [sys.executable, "-m", "mpidag.run", "-n", str(ranks),
               f"benchmarks/{script}", "--quick", "--out", str(out)]
    if shutil.which("flock"):
        command = ["flock", "/tmp/bench.lock", *command]
    with log.open("w") as sink:
        return subprocess.run(command, cwd=tree, env=env, stdout=sink,
                              stderr=subprocess.STDOUT, timeout=1800).returncode


def figures(row: dict) -> dict[str, float]:
    """The compared figures of one row of one run's JSON."""
    found = {key: row[key] for key in ("mpidag", "mpidag_vs_torch", "mpidag_vs_raw")
             if isinstance(row.get(key), int | float)}
    if "mpidag_vs_torch" not in found and row.get("torch_rpc") and row.get("mpidag"):
        found["mpidag_vs_torch"] = row["mpidag"] / row["torch_rpc"]
    for metric, samples in (("interleaved", "mpidag_vs_local_interleaved"),
                            ("vs_split_interleaved", "mpidag_vs_split_interleaved"),
                            ("vs_torch_interleaved", "mpidag_vs_torch_interleaved")):
        interleaved = row.get("samples", {}).get(samples)
        if interleaved:
            found[metric] = statistics.median(interleaved)
    return found


def collect(out: Path) -> dict[str, dict[str, dict[str, list[float]]]]:
    """row -> side ("old"/"new") -> metric -> the values of the rounds."""
    rows: dict[str, dict[str, dict[str, list[float]]]] = {}
    for name, _, _ in BENCHMARKS:
        for side in ("old", "new"):
            for path in sorted(out.glob(f"{name}_{side}_*.json")):
                for row_name, row in json.loads(path.read_text())["rows"].items():
                    per_side = rows.setdefault(row_name, {"old": {}, "new": {}})[side]
                    for metric, value in figures(row).items():
                        per_side.setdefault(metric, []).append(value)
    return rows


def spread(values: list[float]) -> str:
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"


def table(out: Path, labels: tuple[str, str]) -> str:
    """A markdown table: per row and metric, old and new medians (ranges) and new/old."""
    lines = [f"| row | figure | {labels[0]} | {labels[1]} | new/old |",
             "| --- | --- | --- | --- | --- |"]
    for row_name, sides in collect(out).items():
        for metric in METRICS:
            old, new = sides["old"].get(metric), sides["new"].get(metric)
            if old and new:
                change = statistics.median(new) / statistics.median(old)
                lines.append(f"| `{row_name}` | {metric} | {spread(old)} | {spread(new)} | "
                             f"{change:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="the earlier revision (any git revision)")
    parser.add_argument("new", help="the later revision, e.g. HEAD")
    parser.add_argument("--rounds", type=int, default=4, help="old/new pairs (default 4)")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for the runs' JSON and logs (default: a new temp dir)")
    parser.add_argument("--table-only", action="store_true",
                        help="print the table of the runs already in --out")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.table_only:
        if args.out is None or not any(args.out.glob("*_old_*.json")):
            parser.error("--table-only needs --out with the JSON files of an earlier run")
        meta = json.loads((args.out / "revisions.json").read_text())
        print(table(args.out, (meta["old"], meta["new"])))
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="mpidag-ab-"))
    out.mkdir(parents=True, exist_ok=True)
    stale = clear_earlier_run(out)
    if stale:
        print(f"removed {stale} files of an earlier run from {out}", flush=True)
    trees = Path(tempfile.mkdtemp(prefix="mpidag-ab-trees-"))
    try:
        commits = {side: checkout(rev, trees / side)
                   for side, rev in (("old", args.old), ("new", args.new))}
        labels = (f"old ({commits['old']})", f"new ({commits['new']})")
        for side in ("old", "new"):
            print(f"{side}: {build_compiled(trees / side)}", flush=True)
        (out / "revisions.json").write_text(json.dumps({"old": labels[0], "new": labels[1]}))
        total = args.rounds * 2 * len(BENCHMARKS)
        done = 0
        started = time.monotonic()
        for round_no in range(1, args.rounds + 1):
            for side in ("old", "new"):
                for name, script, ranks in BENCHMARKS:
                    stem = f"{name}_{side}_{round_no}"
                    rc = run_benchmark(trees / side, script, ranks, out / f"{stem}.json",
                                       out / f"{stem}.log")
                    done += 1
                    elapsed = time.monotonic() - started
                    print(f"[{done}/{total}] round {round_no} {labels[side == 'new']} "
                          f"{script}: rc={rc}, {elapsed:.0f} s so far, about "
                          f"{elapsed / done * (total - done):.0f} s left", flush=True)
                    if rc != 0:
                        print(f"failed; its output is in {out / (stem + '.log')}",
                              file=sys.stderr)
                        return rc
    finally:
        for side in ("old", "new"):
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(trees / side)], capture_output=True)
        shutil.rmtree(trees, ignore_errors=True)
    print(f"\nruns in {out}\n")
    print(table(out, labels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
