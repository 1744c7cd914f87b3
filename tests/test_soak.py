"""The 1-minute soak (issue 14, part 2): mixed traffic on 4 ranks, then its figures checked.

Runs ``python -m mpidag.run -n 4 benchmarks/soak.py --minutes 1 --out <tmp>`` (about 80 s
on the 2-core VM) and checks its JSON with :func:`problems`: no unexpected error, every
leak counter zero on every rank, each rank's RSS growth per 1,000 iterations below
:data:`RSS_BOUND_MIB_PER_1000` (generous: the 10-minute run measures about 0.05-0.4, see
``benchmarks/README.md``), and the throughput of the last 10 s interval at least half of
the median interval's, in iterations per second of the ranks' CPU time: under ``pytest -n
2`` another test file's ranks share the two cores for part of the minute, which halved the
wall-clock rate of one interval in a CI run, while a job that slows itself (a table that
grows, a scan per call) spends more CPU per iteration whatever the load.
The checks themselves are tested on made-up reports, so they can fail.

Example::

    python -m pytest -q tests/test_soak.py
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

#: RSS growth per 1,000 iterations of a rank above which the 1-minute soak fails (MiB)
RSS_BOUND_MIB_PER_1000 = 5.0
#: the last interval's iterations per CPU second must be at least this fraction of the
#: median interval's
THROUGHPUT_FLOOR = 0.5


def problems(report: dict[str, Any]) -> list[str]:
    """What is wrong with a soak report (empty when it passes the test's checks).

    Example::

        >>> problems(json.loads(Path("benchmarks/results/soak.json").read_text()))
        []
    """
    found: list[str] = []
    unexpected = report["errors"]["unexpected"]
    if unexpected:
        samples = [s for r in report["ranks"] for s in r["unexpected_samples"]][:3]
        found.append(f"unexpected errors {unexpected}, e.g. {samples}")
    if report["leaks"]:
        found.append(f"leak counters not zero after quiesce: {report['leaks']}")
    for rank, g in report["rss_growth"].items():
        slope = g["MiB_per_1000_iterations"]
        if slope is None or slope > RSS_BOUND_MIB_PER_1000:
            found.append(f"rank {rank}: RSS grew {slope} MiB per 1,000 iterations "
                         f"(bound {RSS_BOUND_MIB_PER_1000}); {g}")
    rates = [i["iterations_per_cpu_s"] or 0.0 for i in report["intervals"]]
    if not rates or min(rates) <= 0 or rates[-1] < THROUGHPUT_FLOOR * statistics.median(rates):
        found.append(f"throughput fell: iterations per CPU second per interval {rates} "
                     f"(iterations/s {[i['iterations_per_s'] for i in report['intervals']]})")
    if not report["total_iterations"] or any(not r["iterations"] for r in report["ranks"]):
        found.append("some rank did no iteration")
    expected = report["errors"]["expected"]
    for kind in ("ValueError (remote, expected)", "RPCTimeoutError (expected)"):
        if not expected.get(kind):
            found.append(f"the mix never produced {kind!r}: {expected}")
    return found


def _good_report() -> dict[str, Any]:
    ranks = [{"rank": r, "iterations": 1000, "unexpected_samples": []} for r in range(4)]
    return {
        "errors": {"unexpected": {}, "expected": {"ValueError (remote, expected)": 5,
                                                   "RPCTimeoutError (expected)": 2}},
        "leaks": {},
        "rss_growth": {str(r): {"MiB_per_1000_iterations": 0.2} for r in range(4)},
        "intervals": [{"iterations_per_s": 600.0, "iterations_per_cpu_s": 320.0},
                      {"iterations_per_s": 580.0, "iterations_per_cpu_s": 310.0},
                      {"iterations_per_s": 250.0, "iterations_per_cpu_s": 315.0}],
        "total_iterations": 4000,
        "ranks": ranks,
    }


def test_checks_pass_a_good_report():
    assert problems(_good_report()) == []


@pytest.mark.parametrize("spoil, words", [
    (lambda r: r["errors"]["unexpected"].update(KeyError=1), "unexpected errors"),
    (lambda r: r["leaks"].update({"2": {"num_owner_rrefs": 3}}), "leak counters"),
    (lambda r: r["rss_growth"]["1"].update(MiB_per_1000_iterations=12.0), "RSS grew"),
    (lambda r: r["intervals"][-1].update(iterations_per_cpu_s=140.0), "throughput fell"),
    (lambda r: r["intervals"][1].update(iterations_per_cpu_s=None), "throughput fell"),
    (lambda r: r["errors"]["expected"].pop("RPCTimeoutError (expected)"), "never produced"),
])
def test_checks_catch_a_bad_report(spoil, words):
    report = copy.deepcopy(_good_report())
    spoil(report)
    found = problems(report)
    assert len(found) == 1 and words in found[0], found


def test_one_minute_soak(tmp_path: Path):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "mpidag.run", "-n", "4", str(ROOT / "benchmarks" / "soak.py"),
         "--minutes", "1", "--out", str(out), "--stall-s", "60"],
        capture_output=True, text=True, timeout=150, cwd=str(ROOT),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert out.exists(), f"no JSON (exit {proc.returncode}):\n{tail}"
    report = json.loads(out.read_text())
    found = problems(report)
    assert found == [], f"seed {report['seed']}: {found}\nintervals {report['intervals']}\n{tail}"
    assert proc.returncode == 0, tail
    assert len(report["intervals"]) == 6  # 10 s intervals over the minute
    assert all(r["iterations"] > 100 for r in report["ranks"]), report["ranks"]
