"""The chaos driver (``benchmarks/chaos.py``) on a few trials: a random rank of a 4-rank
training job is killed at a random moment. With ``--ft`` every survivor gets the
``WorkerFailedError`` naming it, trains on and shuts down; without, the job ends at once with
mpirun naming the lost rank. Never a hang. The 20-trial figures are the script's
(``benchmarks/results/chaos_ft.json``, ``chaos_noft.json``).

Run::

    python -m pytest tests/test_chaos.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def chaos(tmp_path: Path, *options: str, timeout: float) -> tuple[dict[str, Any], str]:
    """Run ``benchmarks/chaos.py`` with ``options``; return its JSON and its output."""
    out = tmp_path / "chaos.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "chaos.py"), *options,
         "--trial-timeout", "30", "--delay", "0.5", "1.5", "--out", str(out)],
        capture_output=True, text=True, timeout=timeout, cwd=str(ROOT),
    )
    text = result.stdout + result.stderr
    assert out.exists(), text
    data = json.loads(out.read_text())
    return data, text + failed_trials(data)


def failed_trials(data: dict[str, Any]) -> str:
    """What a failure message needs beyond the table: each failed trial's problems, how far
    each rank got (its events) and the end of the job's output (the SIGUSR1 stacks)."""
    parts = []
    for trial in data["trials"]:
        if trial["ok"]:
            continue
        events = {name: [e["event"] for e in rows]
                  for name, rows in (trial.get("events") or {}).items()}
        parts.append(f"\n--- trial seed {trial['seed']}: {trial['problems']}\n"
                     f"events: {events}\noutput tail:\n{(trial['output_tail'] or '')[-8000:]}")
    return "".join(parts)


def test_ft_survivors_get_the_error_and_go_on(tmp_path):
    # two trials take ~30 s; the limit leaves room for a trial that fails to start (60 s
    # and the stack dump), so that its diagnosis reaches the failure message
    data, text = chaos(tmp_path, "--trials", "2", "--seed", "1", timeout=150)
    summary = data["summary"]
    assert summary["hangs"] == 0, text
    assert summary["startup_failures"] == 0, text
    assert summary["ok"] == summary["trials"] == 2, text
    assert summary["survivors_right_error"] == summary["survivors"] == 6, text
    assert summary["survivors_shutdown"] == 6, text
    for trial in data["trials"]:
        for name, survivor in trial["survivors"].items():
            assert name != f"worker{trial['victim']}"
            assert [e["worker_name"] for e in survivor["errors"]] == \
                [f"worker{trial['victim']}"], text
            assert survivor["after_ok"] == data["config"]["after"], text
            assert survivor["time_to_error_s"] >= 0, text  # the error follows the kill


def test_without_ft_the_job_ends_naming_the_lost_rank(tmp_path):
    data, text = chaos(tmp_path, "--no-ft", "--trials", "1", "--seed", "2", timeout=60)
    summary, trial = data["summary"], data["trials"][0]
    assert summary["hangs"] == 0 and summary["ok"] == 1, text
    assert trial["returncode"] != 0 and trial["lost_rank_named"], text
    assert not trial["leftover_processes"], text
