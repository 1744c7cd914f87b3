"""The documentation site builds with warnings as errors and shows what it should.

Builds ``docs/`` once with ``python -m sphinx -W --keep-going -b html`` (as docs/README.md
says), then checks the rendered pages: signatures of the API, every public name, the diff of
the porting guide. Also runs the two programs of the porting guide, whose diff it shows.
"""

from __future__ import annotations

import difflib
import html
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOCS = ROOT / "docs"
EXAMPLES = DOCS / "examples"

#: the modules of the API reference and their pages
API_PAGES = {
    "mpidag.rpc": "api/rpc.html",
    "mpidag.rpc.functions": "api/functions.html",
    "mpidag.autograd": "api/autograd.html",
    "mpidag.optim": "api/optim.html",
    "mpidag.nn": "api/nn.html",
    "mpidag.testing": "api/testing.html",
    "mpidag.pytest_plugin": "api/pytest_plugin.html",
    "mpidag.run": "api/run.html",
}

def page_text(path: Path) -> str:
    """The text of an HTML page: tags removed, entities decoded (code keeps its lines)."""
    return html.unescape(re.sub(r"<[^>]+>", "", path.read_text(encoding="utf-8")))


def signature(page: Path, object_id: str) -> str:
    """The rendered signature (the ``<dt id=...>`` element) of one documented object."""
    source = page.read_text(encoding="utf-8")
    match = re.search(rf'<dt[^>]*\bid="{re.escape(object_id)}"[^>]*>(.*?)</dt>', source, re.S)
    assert match, f"{object_id} is not documented on {page.name}"
    text = html.unescape(re.sub(r"<[^>]+>", "", match.group(1)))
    return " ".join(text.split()).replace("\u00b6", "").strip()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("html")
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(out / ".doctrees"), str(DOCS), str(out)],
        capture_output=True, text=True, timeout=300, cwd=str(ROOT),
    )
    assert proc.returncode == 0, (
        f"the documentation does not build with warnings as errors:\n{proc.stdout}\n"
        f"{proc.stderr}")
    assert "WARNING" not in proc.stderr, proc.stderr
    return out


def test_site_has_every_page(site):
    for page in ("index", "quickstart", "porting", "overview", "design", "api/index",
                 *[p.removesuffix(".html") for p in API_PAGES.values()]):
        assert (site / f"{page}.html").is_file(), page
    index = page_text(site / "index.html")
    assert "python -m sphinx -W --keep-going -b html docs docs/_build/html" in index


def test_rpc_sync_shows_its_signature_with_the_default_timeout(site):
    sig = signature(site / "api/rpc.html", "mpidag.rpc.rpc_sync")
    assert sig.startswith("mpidag.rpc.rpc_sync(to")
    assert "timeout: float = UNSET_RPC_TIMEOUT" in sig, sig
    for name in ("mpidag.rpc.rpc_async", "mpidag.rpc.remote"):
        assert "timeout: float = UNSET_RPC_TIMEOUT" in signature(site / "api/rpc.html", name)
    assert "= -1.0" in signature(site / "api/rpc.html", "mpidag.rpc.UNSET_RPC_TIMEOUT")
    options = signature(site / "api/rpc.html", "mpidag.rpc.MPIRpcBackendOptions")
    assert "num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS" in options
    assert "_transports" not in options  # private parameters are left out


def test_autograd_backward_is_documented(site):
    page = site / "api/autograd.html"
    sig = signature(page, "mpidag.autograd.backward")
    assert "context_id: int" in sig and "retain_graph: bool = False" in sig, sig
    assert "mode: str = 'smart'" in sig, sig  # keyword-only, after torch's parameters
    text = page_text(page)
    assert "Run the distributed backward pass from roots" in text
    assert "dist_autograd.backward(context_id, [loss])" in text


def test_every_public_name_is_on_its_api_page(site):
    for module_name, page in API_PAGES.items():
        module = importlib.import_module(module_name)
        source = (site / page).read_text(encoding="utf-8")
        for name in module.__all__:
            if inspect.ismodule(getattr(module, name)):
                assert f'id="module-{module_name}.{name}"' in \
                    (site / API_PAGES[f"{module_name}.{name}"]).read_text(encoding="utf-8")
                continue
            assert f'id="{module_name}.{name}"' in source, \
                f"{module_name}.{name} is in __all__ but not documented on {page}"


def test_public_functions_and_classes_have_an_example():
    missing = []
    for module_name in API_PAGES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.isfunction(obj) or inspect.isclass(obj) or callable(obj)):
                continue
            if inspect.ismodule(obj):
                continue
            doc = inspect.getdoc(obj) or ""
            if "Example" not in doc:
                missing.append(f"{module_name}.{name}")
    assert not missing, f"public names without an Example in their docstring: {missing}"


def test_porting_page_shows_the_diff_of_the_two_programs(site):
    torch_lines = (EXAMPLES / "porting_torch.py").read_text().splitlines()
    mpidag_lines = (EXAMPLES / "porting_mpidag.py").read_text().splitlines()
    changed = [line for line in difflib.unified_diff(torch_lines, mpidag_lines, lineterm="")
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert "-import torch.distributed.rpc as rpc" in changed
    assert "+import mpidag.rpc as rpc" in changed
    text = page_text(site / "porting.html")
    assert "--- examples/porting_torch.py" in text
    assert "+++ examples/porting_mpidag.py" in text
    assert str(ROOT) not in text  # no machine's paths
    for line in changed:
        assert line in text, f"the porting page lacks the diff line {line!r}"
    for difference in ("init_method", "mpirun", "srun", "python -m mpidag.run"):
        assert difference in text


def _printed(proc: subprocess.CompletedProcess) -> list[str]:
    """The program's report lines, with the (random) loss values taken out.

    Two processes print to one pipe, so one's line can land inside the other's (``print``
    writes the text and the newline separately): the reports are found by pattern, not
    by line.
    """
    reports = re.findall(r"worker\d+: loss -?[\d.]+(?:e-?\d+)?, optimizer step done", proc.stdout)
    return sorted(re.sub(r"loss \S+,", "loss X,", report) for report in reports)


def test_porting_example_runs_with_mpidag():
    proc = subprocess.run(
        [sys.executable, "-m", "mpidag.run", "-n", "2", str(EXAMPLES / "porting_mpidag.py")],
        capture_output=True, text=True, timeout=180, cwd=str(EXAMPLES),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _printed(proc) == ["worker0: loss X, optimizer step done",
                              "worker1: loss X, optimizer step done"], proc.stdout


def test_porting_example_runs_with_torch_and_prints_the_same():
    import torch.distributed.rpc as torch_rpc

    if not torch_rpc.is_available():
        pytest.skip("this torch build has no torch.distributed.rpc")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(EXAMPLES / "porting_torch.py")],
        capture_output=True, text=True, timeout=180, cwd=str(EXAMPLES),
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _printed(proc) == ["worker0: loss X, optimizer step done",
                              "worker1: loss X, optimizer step done"], proc.stdout
