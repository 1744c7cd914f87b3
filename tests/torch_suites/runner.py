"""Run torch's own RPC suites against mpidag under MPI, and report per file.

For each world size the runner starts one MPI job (``python -m mpidag.run -n W -m
tests.torch_suites.rank``) with the tests of every class of that size still to run, in
order; a rank ends the job when a test fails (see :mod:`tests.torch_suites.rank`), and a
test that makes no progress for ``--timeout`` seconds is a hang: the job is killed. Either
way the runner goes on with the next test in a new job, so one bad test costs one job start,
never the run. A test passes only when it passed on every rank.

Usage (from the repository root)::

    .venv/bin/python -m tests.torch_suites                 # everything (about 20 min here)
    .venv/bin/python -m tests.torch_suites --part ci       # the fixed part CI runs
    .venv/bin/python -m tests.torch_suites -k rref --cls RpcTest --show-failures
    .venv/bin/python -m tests.torch_suites --json out.json --markdown table.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tests.torch_suites import exclusions, shim, suites

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Result:
    """The outcome of one test over all ranks."""

    file: str
    cls: str
    test: str
    outcome: str  #: passed, failed, skipped, hang, crashed, excluded
    seconds: float = 0.0
    detail: str = ""
    reason: str = ""  #: the exclusion reason, for excluded tests
    torch_internals: list[str] = field(default_factory=list)


def plan(part: str, only_class: str | None, pattern: str | None) -> list[tuple[suites.Suite, str,
                                                                               list[str]]]:
    """(suite, class, tests) to run, in order; excluded tests are not in it."""
    chosen = []
    for suite in suites.SUITES:
        for cls_name in suite.classes:
            if only_class and cls_name != only_class:
                continue
            try:
                names = suites.test_names(suites.test_class(suite, cls_name))
            except Exception as exc:  # noqa: BLE001 - the whole class fails
                chosen.append((suite, cls_name, [f"<import failed: {exc!r}>"]))
                continue
            names = [n for n in names if f"{cls_name}.{n}" not in exclusions.EXCLUDED]
            if part == "ci":
                names = [n for n in names if f"{cls_name}.{n}" in exclusions.CI_PART]
            if pattern:
                names = [n for n in names if pattern in n]
            if names:
                chosen.append((suite, cls_name, names))
    return chosen


def _world_size(suite: suites.Suite, cls_name: str, first_test: str) -> int:
    cls = suites.test_class(suite, cls_name)
    return int(suites.make_test(cls, first_test, 0, "").world_size)


@dataclass(frozen=True)
class Planned:
    """One test to run: its suite, class and name."""

    suite: suites.Suite
    cls: str
    test: str

    @property
    def key(self) -> str:
        """``Class.test``, as the ranks name it."""
        return f"{self.cls}.{self.test}"


def batches(chosen: list[tuple[suites.Suite, str, list[str]]]
            ) -> tuple[list[Result], list[tuple[int, list[Planned]]]]:
    """The classes' tests grouped by world size, in plan order, one job each (a job start,
    four ranks importing torch and its test modules, costs ~12 s here, the 28 tests of
    DistAutogradTest's CI part 5.5 s); and a crash result for each class whose module did
    not import."""
    crashed: list[Result] = []
    by_size: dict[int, list[Planned]] = {}
    for suite, cls_name, names in chosen:
        if names[0].startswith("<import failed"):
            crashed.append(Result(suite.file, cls_name, names[0], "crashed", detail=names[0]))
            continue
        size = _world_size(suite, cls_name, names[0])
        by_size.setdefault(size, []).extend(Planned(suite, cls_name, n) for n in names)
    return crashed, list(by_size.items())


def _read_records(results: Path) -> list[dict]:
    records = []
    for path in sorted(results.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                with contextlib.suppress(json.JSONDecodeError):  # a line cut by the kill
                    records.append(json.loads(line))
    return records


def _kill(job: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    job.wait()


def _settle(item: Planned, records: list[dict], size: int, job_over: bool, hung: bool,
            log_path: Path) -> Result | None:
    """The result of ``item`` from the ranks' records, or None while it is still running."""
    suite, cls_name, name = item.suite, item.cls, item.test
    ends = [r for r in records if r["test"] == item.key and r["event"] == "end"]
    seconds = max((r["seconds"] for r in ends), default=0.0)
    internals = sorted({i for r in ends for i in r.get("torch_internals", [])})
    failed = [r for r in ends if r["outcome"] == "failed"]
    if failed:
        return Result(suite.file, cls_name, name, "failed", seconds,
                      f"rank {failed[0]['rank']}: {failed[0]['detail']}",
                      torch_internals=internals)
    if len(ends) == size:
        skipped = [r for r in ends if r["outcome"] == "skipped"]
        if skipped:
            return Result(suite.file, cls_name, name, "skipped", seconds, skipped[0]["detail"])
        return Result(suite.file, cls_name, name, "passed", seconds, torch_internals=internals)
    if not job_over:
        return None
    tail = log_path.read_text(errors="replace")[-3000:]
    return Result(suite.file, cls_name, name, "hang" if hung else "crashed", seconds,
                  f"{len(ends)} of {size} ranks finished; job log:\n{tail}",
                  torch_internals=internals)


def run_batch(size: int, items: list[Planned], timeout: float, workdir: Path,
              report: Callable[[Result], None]) -> list[Result]:
    """Run ``items`` (tests of one world size) in as few jobs as failures allow, reporting
    each result as soon as every rank has finished the test."""
    results: list[Result] = []
    remaining = list(items)
    job_no = 0
    while remaining:
        job_no += 1
        jobdir = workdir / f"size{size}-{job_no}"
        (jobdir / "store").mkdir(parents=True)
        log_path = jobdir / "job.log"
        cmd = [sys.executable, "-m", "mpidag.run", "-n", str(size), "-m",
               "tests.torch_suites.rank", "--tests", ",".join(i.key for i in remaining),
               "--results", str(jobdir), "--store", str(jobdir / "store")]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MPIDAG_ABORT_ON_ERROR": "1",
               "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        with open(log_path, "w") as log:
            job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
        seen, last_progress, hung, done_here = 0, time.monotonic(), False, 0
        while True:
            job_over = job.poll() is not None
            if not job_over:
                time.sleep(0.25)
                count = sum(path.stat().st_size for path in jobdir.glob("rank*.jsonl"))
                if count != seen:
                    seen, last_progress = count, time.monotonic()
                elif time.monotonic() - last_progress > timeout:
                    hung = True
                    _kill(job)
                    job_over = True
            records = _read_records(jobdir)
            started = {r["test"] for r in records}
            while done_here < len(remaining) and remaining[done_here].key in started:
                result = _settle(remaining[done_here], records, size, job_over, hung,
                                 log_path)
                if result is None:
                    break
                results.append(result)
                report(result)
                done_here += 1
                if result.outcome in ("hang", "crashed"):
                    job_over = True
                    break
            if job_over:
                break
        if job.poll() is None:
            _kill(job)
        if done_here == 0:  # the job died before its first test: so would the next one
            tail = log_path.read_text(errors="replace")[-3000:]
            for item in remaining:
                result = Result(item.suite.file, item.cls, item.test, "crashed", 0.0,
                                f"the job ended before the test started; job log:\n{tail}")
                results.append(result)
                report(result)
            done_here = len(remaining)
        remaining = remaining[done_here:]
    return results


def excluded_results() -> list[Result]:
    """The excluded tests as results (for the table), with their reasons."""
    out = []
    for key, (reason, why) in exclusions.EXCLUDED.items():
        cls_name, _, test = key.partition(".")
        out.append(Result(suites.suite_of(cls_name).file, cls_name, test, "excluded",
                          reason=f"{exclusions.REASONS[reason]}: {why}"))
    return out


def table(results: list[Result]) -> str:
    """A markdown table: per file, tests run / passed / failed / skipped / excluded."""
    rows = []
    files = [s.file for s in suites.SUITES]
    total: Counter = Counter()
    for file in files:
        counts = Counter(r.outcome for r in results if r.file == file)
        counts["failed"] += counts.pop("hang", 0) + counts.pop("crashed", 0)
        run = counts["passed"] + counts["failed"]
        total.update(counts)
        rows.append((file, run, counts["passed"], counts["failed"], counts["skipped"],
                     counts["excluded"]))
    run = total["passed"] + total["failed"]
    rows.append(("**all**", run, total["passed"], total["failed"], total["skipped"],
                 total["excluded"]))
    lines = ["| torch file | run | passed | failed | skipped (torch's own skips) | excluded |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {f} | {r} | {p} | {fa} | {s} | {e} |" for f, r, p, fa, s, e in rows]
    rate = 100.0 * total["passed"] / run if run else 0.0
    lines.append("")
    lines.append(f"{total['passed']} of {run} tests outside the exclusion list pass "
                 f"({rate:.1f} %).")
    return "\n".join(lines)


def choose_ci_part(results: list[Result], max_seconds: float = 10.0) -> list[str]:
    """CI's fixed part from a full run: every passing test of the smaller files and every
    second passing test (by name) of rpc_test.py and dist_autograd_test.py, leaving out
    tests that took more than ``max_seconds`` and tests that race in torch's own code
    (``exclusions.RACY_IN_TORCH``)."""
    big = ("rpc/rpc_test.py", "rpc/dist_autograd_test.py")
    passing = sorted((r for r in results if r.outcome == "passed"
                      and r.seconds <= max_seconds
                      and f"{r.cls}.{r.test}" not in exclusions.RACY_IN_TORCH),
                     key=lambda r: (r.cls, r.test))
    chosen, seen_big = [], 0
    for result in passing:
        if result.file in big:
            seen_big += 1
            if seen_big % 2:
                continue
        chosen.append(f"{result.cls}.{result.test}")
    return chosen


def exclusion_table() -> str:
    """The exclusion list as a markdown table (for docs/porting.md)."""
    lines = ["| excluded test | reason | why |", "| --- | --- | --- |"]
    for key, (reason, why) in sorted(exclusions.EXCLUDED.items()):
        lines.append(f"| `{key}` | {exclusions.REASONS[reason]} | {why} |")
    for cls_name, reason in suites.CLASSES_NOT_RUN.items():
        lines.append(f"| `{cls_name}` (the class) | {exclusions.REASONS[reason]} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.torch_suites",
        description="Run torch's own RPC suites against mpidag under MPI.")
    parser.add_argument("--part", choices=("all", "ci"), default="all",
                        help="all tests outside the exclusion list, or CI's fixed part")
    parser.add_argument("--cls", help="only this test class, e.g. RpcTest")
    parser.add_argument("-k", dest="pattern", help="only tests whose name contains this")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds without progress before a test counts as a hang")
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument("--markdown", type=Path, help="write the per-file table here")
    parser.add_argument("--show-failures", action="store_true",
                        help="print each failure's traceback as it happens")
    parser.add_argument("--retries", type=int, default=0,
                        help="run a test that did not pass again, up to this many times, each "
                        "in a new job (a pass on a retry is reported as flaky)")
    parser.add_argument("--write-ci-part", type=Path, metavar="PATH",
                        help="after a full run, write CI's fixed part (choose_ci_part) here")
    parser.add_argument("--expect-pass", action="store_true",
                        help="exit 1 unless every test run passed (CI)")
    args = parser.parse_args(argv)

    exclusions.check()
    shim.install()
    chosen = plan(args.part, args.cls, args.pattern)
    total = sum(len(names) for _, _, names in chosen)
    print(f"torch {__import__('torch').__version__}: {total} tests in {len(chosen)} classes "
          f"({len(exclusions.EXCLUDED)} excluded by tests/torch_suites/exclusions.py)",
          flush=True)
    done = [0]
    began = time.monotonic()

    def report(result: Result) -> None:
        done[0] += 1
        print(f"[{done[0]:4d}/{total}] {result.cls}.{result.test} {result.outcome} "
              f"({result.seconds:.1f} s)", flush=True)
        if args.show_failures and result.outcome in ("failed", "hang", "crashed"):
            print("    " + result.detail.replace("\n", "\n    ")[-4000:], flush=True)

    crashed, jobs = batches(chosen)
    results: list[Result] = []
    for result in crashed:
        report(result)
        results.append(result)
    with tempfile.TemporaryDirectory(prefix="torch-suites-") as tmp:
        for size, items in jobs:
            results += run_batch(size, items, args.timeout, Path(tmp), report)
    flaky: list[str] = []
    for attempt in range(1, args.retries + 1):
        again = [(i, r) for i, r in enumerate(results)
                 if r.outcome in ("failed", "hang", "crashed")]
        if not again:
            break
        print(f"retry {attempt}: {len(again)} tests", flush=True)
        with tempfile.TemporaryDirectory(prefix="torch-suites-retry-") as tmp:
            for index, old in again:
                suite = suites.suite_of(old.cls)
                new = run_batch(_world_size(suite, old.cls, old.test),
                                [Planned(suite, old.cls, old.test)], args.timeout,
                                Path(tmp) / str(index), report)[0]
                if new.outcome == "passed":
                    flaky.append(f"{old.cls}.{old.test}")
                    new.detail = f"passed on retry {attempt}; first: {old.outcome}: " + \
                        old.detail[-2000:]
                results[index] = new
    every = results + (excluded_results() if args.part == "all" and not args.pattern
                       and not args.cls else [])
    text = table(every)
    print(text)
    print(f"wall time {time.monotonic() - began:.0f} s")
    bad = [r for r in results if r.outcome in ("failed", "hang", "crashed")]
    if flaky:
        print("passed only on a retry (flaky): " + ", ".join(flaky))
    if bad:
        print("not passing: " + ", ".join(f"{r.cls}.{r.test} ({r.outcome})" for r in bad))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in every], indent=1))
    if args.write_ci_part:
        args.write_ci_part.write_text(
            "# CI's fixed part of torch's suites, chosen by runner.choose_ci_part from a full "
            "run\n" + "\n".join(choose_ci_part(results)) + "\n")
    if args.markdown:
        args.markdown.write_text(text + "\n\n" + exclusion_table() + "\n")
    return 1 if (args.expect_pass and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
