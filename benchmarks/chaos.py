"""Chaos trials: kill a random rank of a training job at a random moment; check the outcome.

Each trial starts ``benchmarks/chaos_job.py`` on ``--ranks`` ranks (default 4) with
``python -m mpidag.run [--ft]``, waits until every rank has started its training loop
(calls, RRefs, distributed autograd and ``DistributedOptimizer`` steps touching every
other rank; see that file), waits a random 1-3 s, and sends ``SIGKILL`` to a random rank
(rank 0 included). Then:

* ``--ft`` (the default mode): the job must not hang; every survivor must get a
  ``WorkerFailedError`` naming the killed worker (``worker_name`` and ``rank``) and no
  other error, run ``--after`` more iterations among the survivors without an error, and
  complete ``rpc.shutdown()``. Reported: the time from the kill to each survivor's error
  (the survivors stamp ``time.time()``; same host, so one clock), and from the kill to the
  job's end.
* ``--no-ft``: the same job without ``--ft``: it must end with a non-zero status within
  ``--no-ft-limit`` seconds (default 10) of the kill, with mpirun's message naming the lost
  rank and its signal. Reported: the time from the kill to the job's end.

A trial that runs past ``--trial-timeout`` (default 60 s) is a hang: every live rank gets
``SIGUSR1`` (mpidag dumps its threads' stacks and calls in flight into the job's output,
kept in the JSON), then the whole process group is killed and the next trial starts. A job
whose ranks have not all started training within ``--startup-timeout`` (default 60 s) gets the
same treatment and is counted apart (``startup_failures``, with how far each rank got): no
rank was killed, so it is no hang of mpidag's failure handling, though still a failed trial.

Trial ``i`` uses the seed ``--seed + i`` for the victim, the delay and the job's own random
choices, printed with every trial: ``--seed S --trials 1`` replays trial seed ``S``.

Usage::

    python benchmarks/chaos.py --trials 20 --out benchmarks/results/chaos_ft.json
    python benchmarks/chaos.py --no-ft --trials 10 --out benchmarks/results/chaos_noft.json
    python benchmarks/chaos.py --seed 1007 --trials 1 --log info   # replay one trial

Progress lines go to stderr, a summary table to stdout, everything (per-trial details,
machine, software, git commit) to ``--out`` (default ``benchmarks/results/chaos.json``).
The exit status is 0 when every trial had the right outcome, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
JOB = REPO_ROOT / "benchmarks" / "chaos_job.py"
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


def log(msg: str) -> None:
    """A progress line on stderr."""
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Config:
    """The options of a run (see ``--help``)."""

    trials: int = 20
    ranks: int = 4
    ft: bool = True
    seed: int = 1000
    after: int = 5
    delay_min: float = 1.0
    delay_max: float = 3.0
    trial_timeout: float = 60.0
    startup_timeout: float = 60.0
    no_ft_limit: float = 10.0
    log_level: str | None = None


@dataclass
class Trial:
    """What happened in one trial, and what was wrong with it (``problems``)."""

    index: int
    seed: int
    victim: int
    delay_s: float
    replay: str
    ok: bool = False
    hang: bool = False
    hung_after_shutdown: bool = False
    startup_failed: bool = False
    problems: list[str] = field(default_factory=list)
    returncode: int | None = None
    victim_pid: int | None = None
    killed: bool = False
    kill_to_end_s: float | None = None
    duration_s: float | None = None
    leftover_processes: bool = False
    lost_rank_named: bool | None = None
    survivors: dict[str, dict[str, Any]] = field(default_factory=dict)
    output_tail: str | None = None
    events: dict[str, list[dict[str, Any]]] | None = None


# ----------------------------------------------------------------------------------------------
# One trial
# ----------------------------------------------------------------------------------------------


def read_events(out_dir: Path, ranks: int) -> dict[int, list[dict[str, Any]]]:
    """Every rank's events (JSON lines; a line cut by the kill is skipped)."""
    events: dict[int, list[dict[str, Any]]] = {}
    for r in range(ranks):
        path = out_dir / f"events.{r}.jsonl"
        rows = []
        if path.exists():
            for line in path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    rows.append(json.loads(line))
        events[r] = rows
    return events


def pids(out_dir: Path, ranks: int) -> dict[int, int]:
    """The pid of every rank that has written one."""
    found = {}
    for r in range(ranks):
        with contextlib.suppress(OSError, ValueError):
            found[r] = int((out_dir / f"pid.{r}").read_text())
    return found


def alive(pid: int) -> bool:
    """Whether a process with this pid exists (and is not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_group(proc: subprocess.Popen) -> bool:
    """SIGKILL the job's whole process group; return whether anything was left in it."""
    try:
        os.killpg(proc.pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    return True


def wait_exit(proc: subprocess.Popen, deadline: float) -> float | None:
    """Poll the job until it exits (return ``time.time()`` then) or ``deadline`` (monotonic;
    return None)."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return time.time()
        time.sleep(0.01)
    return None


def startup_progress(out_dir: Path, ranks: int) -> str:
    """How far each rank got before training: which wrote its pid (``init_rpc()`` returned),
    which touched its ``training`` marker (its setup calls done).

    Example::

        >>> startup_progress(Path("/nonexistent"), 2)
        'init_rpc() returned on ranks [] of 2; training on ranks []'
    """
    inited = [r for r in range(ranks) if (out_dir / f"pid.{r}").exists()]
    training = [r for r in range(ranks) if (out_dir / f"training.{r}").exists()]
    return f"init_rpc() returned on ranks {inited} of {ranks}; training on ranks {training}"


def dump_and_kill(proc: subprocess.Popen, out_dir: Path, ranks: int) -> None:
    """``SIGUSR1`` to every live rank (mpidag prints its threads' stacks and calls in flight
    into the job's output), 3 s for the dumps, then SIGKILL to the whole process group."""
    for p in pids(out_dir, ranks).values():
        if alive(p):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGUSR1)
    time.sleep(3.0)
    kill_group(proc)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def run_trial(index: int, cfg: Config) -> Trial:
    """Start the job, kill the victim, wait for the end, judge the outcome."""
    seed = cfg.seed + index
    rng = random.Random(seed)
    victim = rng.randrange(cfg.ranks)
    delay = rng.uniform(cfg.delay_min, cfg.delay_max)
    replay = (f"python benchmarks/chaos.py {'' if cfg.ft else '--no-ft '}--ranks {cfg.ranks} "
              f"--seed {seed} --trials 1")
    trial = Trial(index=index, seed=seed, victim=victim, delay_s=round(delay, 3),
                  replay=replay)
    out_dir = Path(tempfile.mkdtemp(prefix=f"chaos-{seed}-"))
    cmd = [sys.executable, "-m", "mpidag.run", *(["--ft"] if cfg.ft else []),
           "-n", str(cfg.ranks), str(JOB), "--dir", str(out_dir), "--seed", str(seed),
           "--after", str(cfg.after), "--max-train-s", str(cfg.trial_timeout / 2)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                         os.environ.get("PYTHONPATH")]))}
    if cfg.log_level:
        env["MPIDAG_LOG"] = cfg.log_level
    output = out_dir / "output.txt"
    start = time.monotonic()
    deadline = start + cfg.trial_timeout  # from the start of training, once it started
    with open(output, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                env=env, start_new_session=True)
    t_kill: float | None = None
    t_end: float | None = None
    try:
        # 1. every rank in its training loop
        ready_by = start + cfg.startup_timeout
        while not all((out_dir / f"training.{r}").exists() for r in range(cfg.ranks)):
            if proc.poll() is not None or time.monotonic() > ready_by:
                trial.startup_failed = True
                trial.problems.append("the job did not start training: "
                                      + ("it exited" if proc.poll() is not None
                                         else f"not within {cfg.startup_timeout:.0f} s "
                                              f"(stacks in output_tail); no kill")
                                      + "; " + startup_progress(out_dir, cfg.ranks))
                if proc.poll() is None:
                    dump_and_kill(proc, out_dir, cfg.ranks)
                break
            time.sleep(0.02)
        else:
            # 2. the kill; a slow start (4 ranks importing torch on a loaded 2-core machine)
            # does not eat into the time the job has to end after it
            deadline = time.monotonic() + cfg.trial_timeout
            time.sleep(delay)
            trial.victim_pid = pids(out_dir, cfg.ranks).get(victim)
            if proc.poll() is not None:
                trial.problems.append("the job ended before the kill")
            elif trial.victim_pid is None:
                trial.problems.append(f"no pid file for rank {victim}")
            else:
                t_kill = time.time()  # taken before: a survivor may see the loss in < 1 ms
                os.kill(trial.victim_pid, signal.SIGKILL)
                trial.killed = True
        # 3. the end, or a hang (a job that never started training was ended above)
        if not trial.startup_failed:
            t_end = wait_exit(proc, deadline)
            if t_end is None:
                trial.hang = True
                living = {r: p for r, p in pids(out_dir, cfg.ranks).items() if alive(p)}
                done = {r for r, rows in read_events(out_dir, cfg.ranks).items()
                        if any(e["event"] == "shutdown_done" for e in rows)}
                trial.hung_after_shutdown = bool(living) and set(living) <= done
                where = ("every live rank had completed rpc.shutdown(): stuck at exit, in "
                         "mpi4py's MPI_Finalize (SIGUSR1 then crashes it; Open MPI's segfault "
                         "handler prints the C stack)" if trial.hung_after_shutdown else
                         f"ranks that completed rpc.shutdown(): {sorted(done)}")
                trial.problems.append(f"HANG: the job was still running {cfg.trial_timeout:.0f} s "
                                      f"after its start; live ranks {sorted(living)}; {where}; "
                                      f"stacks (SIGUSR1) in output_tail")
                dump_and_kill(proc, out_dir, cfg.ranks)
    finally:
        if proc.poll() is None:  # an exception in this driver: never leave a job behind
            kill_group(proc)
            proc.wait(timeout=10)
    trial.returncode = proc.returncode
    trial.duration_s = round(time.monotonic() - start, 3)
    trial.leftover_processes = kill_group(proc)
    if trial.leftover_processes and not trial.hang:
        trial.problems.append("processes of the job were left running after mpirun ended")
    if t_kill is not None and t_end is not None:
        trial.kill_to_end_s = round(t_end - t_kill, 4)
    text = output.read_text(errors="replace")
    events = read_events(out_dir, cfg.ranks)
    if trial.killed:
        (judge_ft if cfg.ft else judge_no_ft)(trial, cfg, events, text, t_kill)
    trial.ok = not trial.problems
    if not trial.ok:  # keep what is needed to diagnose it
        trial.output_tail = text[-20000:]
        trial.events = {f"worker{r}": rows for r, rows in events.items()}
    shutil.rmtree(out_dir, ignore_errors=True)
    return trial


def judge_ft(trial: Trial, cfg: Config, events: dict[int, list[dict[str, Any]]],
             text: str, t_kill: float | None) -> None:
    """With ``--ft``: every survivor got one ``WorkerFailedError`` naming the victim, went
    on ``cfg.after`` iterations, and shut down."""
    victim = trial.victim
    for r, rows in events.items():
        if r == victim:
            continue
        name = f"worker{r}"
        errors = [e for e in rows if e["event"] == "error"]
        first = errors[0] if errors else None
        after_ok = sum(1 for e in rows if e["event"] == "after_ok")
        info: dict[str, Any] = {
            "errors": [{k: e.get(k) for k in ("type", "worker_name", "failed_rank", "op",
                                              "iteration", "message")} for e in errors],
            "time_to_error_s": (round(first["t"] - t_kill, 4)
                                if first is not None and t_kill is not None else None),
            "error_op": first["op"] if first else None,
            "after_ok": after_ok,
            "shutdown": any(e["event"] == "shutdown_done" for e in rows),
        }
        done = [e["t"] for e in rows if e["event"] == "shutdown_done"]
        if done and t_kill is not None:
            info["kill_to_shutdown_s"] = round(done[0] - t_kill, 4)
        right = (first is not None and first["type"] == "WorkerFailedError"
                 and first["worker_name"] == f"worker{victim}" and first["failed_rank"] == victim)
        info["right_error"] = right and len(errors) == 1
        # did rpc.failed_workers() already list the worker the error named?
        info["listed_in_failed_workers"] = (first is not None and f"worker{victim}" in
                                            first.get("failed_workers", []))
        trial.survivors[name] = info
        if first is None:
            seen = "no_error_seen" if any(e["event"] == "no_error_seen" for e in rows) else ""
            trial.problems.append(f"{name}: no error at all {seen}".strip())
        elif not right:
            trial.problems.append(
                f"{name}: wrong error in {first['op']!r}: {first['type']}"
                f"(worker_name={first['worker_name']!r}, rank={first['failed_rank']!r}): "
                f"{first['message'][:300]}")
        if errors[1:] and not info["listed_in_failed_workers"]:
            trial.problems.append(
                f"{name}: its first WorkerFailedError (in {first['op']!r}) came while "
                f"rpc.failed_workers() was still {first.get('failed_workers')}, so the "
                f"recovery kept worker{victim}")
        for extra in errors[1:]:
            trial.problems.append(
                f"{name}: another error after the first, in {extra['op']!r} (iteration "
                f"{extra['iteration']}): {extra['type']}: {extra['message'][:300]}")
        if first is not None and after_ok < cfg.after:
            trial.problems.append(f"{name}: only {after_ok} of {cfg.after} iterations among "
                                  f"the survivors after the error")
        if not info["shutdown"]:
            trial.problems.append(f"{name}: rpc.shutdown() did not complete")


def judge_no_ft(trial: Trial, cfg: Config, events: dict[int, list[dict[str, Any]]],
                text: str, t_kill: float | None) -> None:
    """Without ``--ft``: the job ended, non-zero, soon, naming the lost rank."""
    if trial.hang:
        return
    if trial.returncode == 0:
        trial.problems.append("the job ended with status 0 after a rank was killed")
    if trial.kill_to_end_s is not None and trial.kill_to_end_s > cfg.no_ft_limit:
        trial.problems.append(f"the job ended {trial.kill_to_end_s:.1f} s after the kill "
                              f"(limit {cfg.no_ft_limit:.0f} s)")
    flat = " ".join(text.split())
    trial.lost_rank_named = bool(
        re.search(rf"process rank {trial.victim} with PID {trial.victim_pid}\b.*?"
                  r"signal 9", flat) or re.search(rf"rank {trial.victim}\b.*?Killed", flat))
    if not trial.lost_rank_named:
        trial.problems.append(f"mpirun's output does not name rank {trial.victim} and "
                              f"signal 9")
    for r, rows in events.items():  # what survivors saw before mpirun ended them
        errs = [e for e in rows if e["event"] == "error"]
        if r != trial.victim:
            trial.survivors[f"worker{r}"] = {
                "errors": [{k: e.get(k) for k in ("type", "worker_name", "op", "message")}
                           for e in errs]}


# ----------------------------------------------------------------------------------------------
# Summary, JSON, table
# ----------------------------------------------------------------------------------------------


def describe(values: list[float]) -> dict[str, float | None]:
    """Median, max, min and count of a list of seconds."""
    if not values:
        return {"n": 0, "median": None, "max": None, "min": None}
    return {"n": len(values), "median": round(statistics.median(values), 4),
            "max": round(max(values), 4), "min": round(min(values), 4)}


def summarize(trials: list[Trial], cfg: Config) -> dict[str, Any]:
    """The figures of a run."""
    survivors = [s for t in trials for s in t.survivors.values()]
    summary: dict[str, Any] = {
        "mode": "ft" if cfg.ft else "no-ft",
        "trials": len(trials),
        "ok": sum(t.ok for t in trials),
        "hangs": sum(t.hang for t in trials),
        "hangs_after_shutdown": sum(t.hung_after_shutdown for t in trials),
        "startup_failures": sum(t.startup_failed for t in trials),
        "failed_seeds": [t.seed for t in trials if not t.ok],
        "victims": [t.victim for t in trials],
    }
    if cfg.ft:
        summary.update({
            "survivors": len(survivors),
            "survivors_right_error": sum(bool(s.get("right_error")) for s in survivors),
            "survivors_shutdown": sum(bool(s.get("shutdown")) for s in survivors),
            "survivors_error_before_failed_workers": sum(
                s.get("listed_in_failed_workers") is False and bool(s.get("errors"))
                for s in survivors),
            "trials_every_survivor_right": sum(
                bool(t.survivors) and all(s.get("right_error") for s in t.survivors.values())
                for t in trials),
            "time_to_error_s": describe([s["time_to_error_s"] for s in survivors
                                         if s.get("time_to_error_s") is not None]),
            "kill_to_shutdown_s": describe([s["kill_to_shutdown_s"] for s in survivors
                                            if s.get("kill_to_shutdown_s") is not None]),
            "error_ops": sorted({s["error_op"] for s in survivors if s.get("error_op")}),
        })
    summary["kill_to_job_end_s"] = describe([t.kill_to_end_s for t in trials
                                             if t.kill_to_end_s is not None])
    if not cfg.ft:
        summary["lost_rank_named"] = sum(bool(t.lost_rank_named) for t in trials)
        summary["nonzero_exit"] = sum(t.returncode not in (0, None) for t in trials)
    return summary


def table(summary: dict[str, Any], cfg: Config) -> str:
    """The summary as a markdown table."""
    def s(d: dict[str, Any]) -> str:
        return "–" if not d["n"] else f"{d['median']:.3f} s / {d['max']:.3f} s"

    rows = [("mode", f"{summary['mode']}, {cfg.ranks} ranks, seeds {cfg.seed}-"
                     f"{cfg.seed + cfg.trials - 1}"),
            ("trials", str(summary["trials"])),
            ("right outcome", f"{summary['ok']} / {summary['trials']}"),
            ("hangs (of which stuck at exit after rpc.shutdown())",
             f"{summary['hangs']} ({summary['hangs_after_shutdown']})"),
            ("trials whose job did not start training", str(summary["startup_failures"]))]
    if cfg.ft:
        rows += [
            ("trials with the right error on every survivor",
             f"{summary['trials_every_survivor_right']} / {summary['trials']}"),
            ("survivors with the right error", f"{summary['survivors_right_error']} / "
                                               f"{summary['survivors']}"),
            ("survivors that trained on and shut down", f"{summary['survivors_shutdown']} / "
                                                        f"{summary['survivors']}"),
            ("survivors whose error came before rpc.failed_workers() listed the worker",
             f"{summary['survivors_error_before_failed_workers']} / {summary['survivors']}"),
            ("kill -> survivor's error, median / max", s(summary["time_to_error_s"])),
            ("kill -> survivor's shutdown done, median / max", s(summary["kill_to_shutdown_s"])),
            ("kill -> job end, median / max", s(summary["kill_to_job_end_s"])),
            ("operations the error came from", ", ".join(summary["error_ops"])),
        ]
    else:
        rows += [
            ("non-zero exit", f"{summary['nonzero_exit']} / {summary['trials']}"),
            ("mpirun names the lost rank", f"{summary['lost_rank_named']} / "
                                           f"{summary['trials']}"),
            ("kill -> job end, median / max", s(summary["kill_to_job_end_s"])),
        ]
    if summary["failed_seeds"]:
        rows.append(("failed trial seeds", ", ".join(map(str, summary["failed_seeds"]))))
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'chaos trials'.ljust(width)} | value |", f"| {'-' * width} | --- |"]
    lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    """Host, CPU, memory, load and software versions (MPI read in a child interpreter)."""
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(ValueError, OSError):
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    import mpi4py
    import torch

    from mpidag.run import mpi_library_version

    mpi = mpi_library_version().replace("\x00", "").strip()
    return {"host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(), "mem_GiB": mem,
            "os": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "mpi4py": mpi4py.__version__,
            "mpi": mpi.splitlines()[0] if mpi else "",
            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]}


def git_info() -> dict[str, Any]:
    """The commit and whether ``mpidag/`` or the chaos files differ from it."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True,
                                  text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "mpidag_dirty": bool(git("status", "--porcelain", "mpidag")),
            "chaos_dirty": bool(git("status", "--porcelain", "benchmarks/chaos.py",
                                    "benchmarks/chaos_job.py"))}


def main(argv: list[str] | None = None) -> int:
    """Run the trials; print the table; write the JSON. Returns 0 if every trial was right.

    Example::

        >>> main(["--trials", "2", "--out", "/tmp/chaos.json"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(
        description="Kill a random rank of a training job at a random moment, check the "
                    "outcome (see the module docstring).")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--no-ft", dest="ft", action="store_false",
                        help="run the job without --ft: it must end, never hang")
    parser.add_argument("--ft", dest="ft", action="store_true", default=True,
                        help="(default) run the job with --ft: the survivors must go on")
    parser.add_argument("--seed", type=int, default=1000,
                        help="trial i uses seed SEED+i (default 1000)")
    parser.add_argument("--after", type=int, default=5,
                        help="iterations among the survivors after the error (default 5)")
    parser.add_argument("--delay", type=float, nargs=2, default=(1.0, 3.0),
                        metavar=("MIN", "MAX"),
                        help="kill this long after every rank started training (s)")
    parser.add_argument("--trial-timeout", type=float, default=60.0,
                        help="a trial running longer is a hang (s, default 60)")
    parser.add_argument("--no-ft-limit", type=float, default=10.0,
                        help="without --ft the job must end within this time of the kill")
    parser.add_argument("--startup-timeout", type=float, default=60.0,
                        help="seconds for every rank to reach its training loop (a trial "
                             "that does not is counted apart, as a start-up failure)")
    parser.add_argument("--log", dest="log_level", choices=["debug", "info", "warning"],
                        help="MPIDAG_LOG for the job (its output is kept for failed trials)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "chaos.json")
    args = parser.parse_args(argv)
    if args.ranks < 3:
        parser.error("--ranks must be at least 3 (survivors must call each other)")
    cfg = Config(trials=args.trials, ranks=args.ranks, ft=args.ft, seed=args.seed,
                 after=args.after, delay_min=args.delay[0], delay_max=args.delay[1],
                 trial_timeout=args.trial_timeout,
                 startup_timeout=args.startup_timeout,
                 no_ft_limit=args.no_ft_limit, log_level=args.log_level)
    load_start = [round(x, 2) for x in os.getloadavg()]
    started = _dt.datetime.now(_dt.timezone.utc)
    mode = "--ft" if cfg.ft else "--no-ft"
    log(f"{cfg.trials} trials, {mode}, {cfg.ranks} ranks, seeds {cfg.seed}.."
        f"{cfg.seed + cfg.trials - 1}, load average {load_start}")
    trials: list[Trial] = []
    for i in range(cfg.trials):
        trial = run_trial(i, cfg)
        trials.append(trial)
        if cfg.ft:
            times = [s["time_to_error_s"] for s in trial.survivors.values()
                     if s.get("time_to_error_s") is not None]
            ops = sorted({s["error_op"] for s in trial.survivors.values() if s.get("error_op")})
            detail = (f"errors after {min(times):.3f}-{max(times):.3f} s in {ops}"
                      if times else "no error")
        else:
            detail = f"rc {trial.returncode}"
        end = f"{trial.kill_to_end_s:.2f} s" if trial.kill_to_end_s is not None else "–"
        log(f"trial {i + 1}/{cfg.trials} seed={trial.seed} victim=worker{trial.victim} "
            f"delay={trial.delay_s:.2f}s: {'ok' if trial.ok else 'FAILED'}, {detail}, "
            f"job end {end} after the kill ({trial.duration_s:.1f} s)")
        for problem in trial.problems:
            log(f"    {problem}")
        if not trial.ok:
            log(f"    replay: {trial.replay}")
    summary = summarize(trials, cfg)
    result = {
        "benchmark": "chaos",
        "date": started.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "config": asdict(cfg),
        "machine": {**machine_info(), "loadavg_at_start": load_start},
        "git": git_info(),
        "summary": summary,
        "trials": [asdict(t) for t in trials],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(summary, cfg))
    log(f"wrote {args.out}")
    return 0 if summary["ok"] == summary["trials"] else 1


if __name__ == "__main__":
    sys.exit(main())
