"""torch's own RPC suites against mpidag: the runner's parts, and CI's fixed part of the run.

The full run is ``.venv/bin/python -m tests.torch_suites`` (docs/porting.md has its table);
CI runs the fixed part ``exclusions.CI_PART`` of it here, every test on every rank (a test
that fails gets one more try in a new job; passing only then is reported as flaky).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT
from tests.torch_suites import exclusions
from tests.torch_suites.runner import Result, choose_ci_part, table


def _python(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


#: one process for the checks below (each needs a fresh interpreter with the shim installed,
#: and importing torch's test modules costs ~6 s here): each check prints one JSON line
CHECKS = """
import json
from tests.torch_suites import shim
shim.install()
import torch.distributed.rpc as rpc
import torch.distributed.autograd as dist_autograd
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.nn import RemoteModule
from torch.distributed.rpc import RRef, rpc_async
import mpidag.rpc, mpidag.autograd, mpidag.optim, mpidag.nn
assert rpc.rpc_sync is mpidag.rpc.rpc_sync
assert rpc_async is mpidag.rpc.rpc_async and RRef is mpidag.rpc.RRef
assert rpc.functions.async_execution is mpidag.rpc.functions.async_execution
assert dist_autograd.backward is mpidag.autograd.backward
assert DistributedOptimizer is mpidag.optim.DistributedOptimizer
assert RemoteModule is mpidag.nn.RemoteModule
import torch.distributed.optim as optim
assert optim.DistributedOptimizer is mpidag.optim.DistributedOptimizer
assert shim.torch_internals_used() == []
rpc.TensorPipeAgent           # no such name in mpidag: torch's, recorded
print(json.dumps({"internals": shim.torch_internals_used()}))

from tests.torch_suites import exclusions
exclusions.check()
print(json.dumps({"sizes": [len(exclusions.EXCLUDED), len(exclusions.CI_PART)]}))

errors = []
exclusions.EXCLUDED["RpcTest.test_add"] = ("flaky", "because")
try:
    exclusions.check()
except ValueError as exc:
    errors.append(str(exc))
exclusions.EXCLUDED.clear()
exclusions.EXCLUDED["RpcTest.test_no_such_test"] = ("gpu", "because")
try:
    exclusions.check()
except ValueError as exc:
    errors.append(str(exc))
exclusions.EXCLUDED.clear()
exclusions.CI_PART = exclusions.CI_PART | {"DdpUnderDistAutogradTest.test_backward_ddp_inside"}
try:
    exclusions.check()
except ValueError as exc:
    errors.append(str(exc))
print(json.dumps({"errors": errors}))
"""


@pytest.fixture(scope="module")
def checks() -> dict:
    """The answers of :data:`CHECKS`, run once for the module."""
    out = _python(CHECKS)
    assert out.returncode == 0, out.stderr
    answers: dict = {}
    for line in out.stdout.splitlines():
        answers.update(json.loads(line))
    return answers


def test_shim_points_torch_names_at_mpidag_and_records_torch_internals(checks):
    assert checks["internals"] == ["torch.distributed.rpc.TensorPipeAgent"]


def test_exclusion_list_is_valid_and_names_only_reasons_of_the_closed_list(checks):
    excluded, ci_part = checks["sizes"]
    assert ci_part > 0


def test_exclusion_check_rejects_unknown_reasons_and_tests(checks):
    first, second, third = checks["errors"]
    assert "unknown reason 'flaky'" in first
    assert "RpcTest.test_no_such_test is not a test of the installed torch" in second
    assert "race in torch's own code: ['DdpUnderDistAutogradTest.test_backward_ddp_inside']" \
        in third


def test_ci_part_is_chosen_without_slow_or_racy_tests():
    racy = next(iter(exclusions.RACY_IN_TORCH))
    cls, name = racy.split(".")
    results = [Result("ddp_under_dist_autograd_test.py", cls, name, "passed", seconds=1.0),
               Result("ddp_under_dist_autograd_test.py", cls, "test_backward_no_ddp",
                      "passed", seconds=1.0),
               Result("ddp_under_dist_autograd_test.py", cls, "test_slow", "passed",
                      seconds=30.0)]
    assert choose_ci_part(results) == [f"{cls}.test_backward_no_ddp"]


def test_table_counts_hangs_and_crashes_as_failures_and_gives_the_rate():
    results = [Result("rpc/rpc_test.py", "RpcTest", "a", "passed"),
               Result("rpc/rpc_test.py", "RpcTest", "b", "hang"),
               Result("rpc/rpc_test.py", "RpcTest", "c", "crashed"),
               Result("rpc/rpc_test.py", "RpcTest", "d", "skipped"),
               Result("rpc/rpc_test.py", "RpcTest", "e", "excluded"),
               Result("rpc/dist_optimizer_test.py", "DistOptimizerTest", "f", "passed")]
    text = table(results)
    assert "| rpc/rpc_test.py | 3 | 1 | 2 | 1 | 1 |" in text
    assert "| rpc/dist_optimizer_test.py | 1 | 1 | 0 | 0 | 0 |" in text
    assert "| **all** | 4 | 2 | 2 | 1 | 1 |" in text
    assert "2 of 4 tests outside the exclusion list pass (50.0 %)." in text


def test_ci_part_of_torch_suites_passes_on_every_rank(tmp_path):
    report = tmp_path / "results.json"
    out = subprocess.run(
        [sys.executable, "-m", "tests.torch_suites", "--part", "ci", "--expect-pass",
         "--retries", "1", "--show-failures", "--json", str(report)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=1500, check=False)
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-4000:]
    assert "not passing" not in out.stdout
    from tests.torch_suites.exclusions import CI_PART

    runs = json.loads(report.read_text())
    assert len(runs) == len(CI_PART)
    assert {r["outcome"] for r in runs} <= {"passed", "skipped"}


def test_porting_guide_shows_every_exclusion():
    out = _python("""
        from tests.torch_suites import exclusions
        print("\\n".join(exclusions.EXCLUDED))
    """)
    assert out.returncode == 0, out.stderr
    guide = (ROOT / "docs" / "porting.md").read_text()
    missing = [key for key in out.stdout.split() if f"`{key}`" not in guide]
    assert not missing, f"docs/porting.md does not list these exclusions: {missing}"
    missing = [key for key in exclusions.RACY_IN_TORCH if f"`{key}`" not in guide]
    assert not missing, f"docs/porting.md does not name these racy tests: {missing}"
