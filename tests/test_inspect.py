"""``python -m mpidag.inspect``: the state of every rank of a running job, and the wait-for
graph, taken while the job runs (a chain of calls; a real deadlock of pool threads)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from mpidag.inspect import cycles, wait_for_graph

ROOT = Path(__file__).resolve().parents[1]

JOB = """
import sys, time
import mpidag.rpc as rpc

def sleeper(seconds):
    time.sleep(seconds)
    return seconds

def chain(route, seconds):
    if not route:
        return sleeper(seconds)
    return rpc.rpc_sync(route[0], chain, args=(route[1:], seconds), timeout=0)

import threading
TABLE = threading.Lock()                # an application lock, held across an RPC

# the cycle lasts until forward's call times out (the job's shutdown waits for that)
def back_to(caller, seconds):          # on worker1: calls worker0, which calls worker1 again
    with TABLE:
        return rpc.rpc_sync(caller, forward, args=("worker1", seconds), timeout=12)

def forward(to, seconds):
    return rpc.rpc_sync(to, locked, args=(seconds,), timeout=10)

def locked(seconds):                    # on worker1 again: waits for TABLE, held above
    with TABLE:
        return seconds

opts = rpc.MPIRpcBackendOptions(num_worker_threads=4)
rpc.init_rpc(rpc_backend_options=opts)
me = rpc.get_worker_info().id
print("READY", flush=True)
if me == 0 and sys.argv[1] == "chain":
    rpc.rpc_sync("worker1", chain, args=(["worker2"], 8.0), timeout=0)
if me == 0 and sys.argv[1] == "deadlock":
    try:   # worker1 holds TABLE while it waits on worker0, whose call needs TABLE there
        rpc.rpc_sync("worker1", back_to, args=("worker0", 0.1), timeout=8)
    except Exception as exc:
        print("TIMED OUT", type(exc).__name__, flush=True)
rpc.shutdown()
"""


def _inspect_running(tmp_path: Path, mode: str, nprocs: int,
                     shows: tuple[str, ...]) -> tuple[str, str]:
    """Start the job, run the inspector until its report shows every text of ``shows`` (the
    state the test asserts on: a call is in the wait-for graph a moment before its callee's
    pool thread is in the user's function), at most 60 s; return both outputs."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    env = {"MPIDAG_INSPECT_DIR": str(tmp_path / "inspect"), "PYTHONUNBUFFERED": "1"}
    import os
    env = {**os.environ, **env}
    job = subprocess.Popen([sys.executable, "-m", "mpidag.run", "-n", str(nprocs), str(script),
                            mode], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env)
    try:
        deadline = time.monotonic() + 60
        report = ""
        while time.monotonic() < deadline:
            time.sleep(1.0)
            run = subprocess.run([sys.executable, "-m", "mpidag.inspect", "--timeout", "5"],
                                 capture_output=True, text=True, env=env, timeout=30)
            report = run.stdout + run.stderr
            if run.returncode == 0 and all(text in report for text in shows):
                break
        out, _ = job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            job.kill()
    return report, out


def test_chain_of_calls_shows_who_waits_on_whom(tmp_path):
    report, out = _inspect_running(tmp_path, "chain", 3,
                                   shows=("worker1 -> worker2", "sleeper"))
    assert "3 ranks, 3 answered" in report, report + out
    assert "worker0 -> worker1: __main__.chain" in report, report
    assert "worker1 -> worker2: __main__.chain" in report, report
    assert "sleeper" in report, report            # worker2's pool thread, in user code
    assert "CYCLE" not in report, report
    assert not list((tmp_path / "inspect").glob("job-*/rank*")), "files left after shutdown"


def test_deadlock_is_shown_as_a_cycle(tmp_path):
    report, out = _inspect_running(tmp_path, "deadlock", 2, shows=("CYCLE", " locked"))
    assert "CYCLE: worker0 -> worker1 -> worker0" in report, report
    assert re.search(r"thread \S+: .*job\.py:\d+ locked", report), report  # waits for TABLE
    assert "TIMED OUT RPCTimeoutError" in out, out  # the job itself gets out (timeouts)


def test_wait_for_graph_and_cycles():
    answers = {0: {"name": "a", "calls": [{"to": "b", "what": "f", "age_s": 1.0}]},
               1: {"name": "b", "calls": [{"to": "c", "what": "g", "age_s": 2.0}]},
               2: {"name": "c", "calls": [{"to": "a", "what": "h", "age_s": 3.0},
                                          {"to": "b", "what": "k", "age_s": 0.5}]}}
    graph = wait_for_graph(answers)
    assert graph["c"] == [("a", "h", 3.0), ("b", "k", 0.5)]
    assert cycles(graph) == [["a", "b", "c"], ["b", "c"]]
    assert cycles({"a": [("b", "f", 1.0)]}) == []
