"""The ``>>>`` examples of mpidag's docstrings, run with :mod:`doctest` (issue 22).

Every docstring with examples is one test item, named by the object it documents. The
examples run in one process, in an in-process world of two ranks
(:class:`~mpidag.transport.inproc.InProcWorld`): the test thread is ``worker0`` (rank 0's
runtime bound to it with :func:`mpidag._runtime.bind_thread`, so ``rpc.rpc_sync("worker1",
...)``, ``dist_autograd.context()``, RRefs and the optimizer work as in a program), and
``worker1`` serves, its main thread waiting in a graceful shutdown as a torch worker's
``init_rpc(); shutdown()`` does. Docstrings in :data:`EVERY_RANK` (collectives) run on
both ranks at once; those in :data:`NO_WORLD` run with no RPC session.

The examples see their module's names and the usual ones (:func:`example_globals`); a
function an example defines can be called over RPC (the examples' namespace is a module
of its own, found by name). What cannot run in one process (``mpirun``, a GPU, Slurm, a
killed rank) is written as a ``.. code-block:: python`` without prompts, not as ``>>>``.

:data:`MODULES` lists the modules whose examples run; :func:`test_every_module_with_examples_is_run`
fails for a module with ``>>>`` examples that is in neither it nor :data:`NOT_RUN`.
"""

from __future__ import annotations

import builtins
import concurrent.futures
import contextlib
import doctest
import gc
import importlib
import itertools
import operator
import pathlib
import re
import sys
import threading
import time
import types
from collections.abc import Iterator

import pytest
import torch

import mpidag
import mpidag.rpc
from mpidag._config import Config
from mpidag._runtime import Runtime, bind_thread
from mpidag.agent.options import MPIRpcBackendOptions
from mpidag.transport.inproc import InProcWorld

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: the modules whose examples run here
MODULES = (
    "mpidag._backoff",
    "mpidag._config",
    "mpidag._ids",
    "mpidag._locks",
    "mpidag._profiling",
    "mpidag._remote_profiling",
    "mpidag._debug",
    "mpidag._runtime",
    "mpidag.agent.agent",
    "mpidag.agent.calls",
    "mpidag.agent.compiled",
    "mpidag.agent.encoding",
    "mpidag.agent.fastpath",
    "mpidag.agent.futures",
    "mpidag.agent.handlers",
    "mpidag.agent.messages",
    "mpidag.agent.options",
    "mpidag.agent.peers",
    "mpidag.agent.quiescence",
    "mpidag.agent.sending",
    "mpidag.agent.serving",
    "mpidag.autograd",
    "mpidag.dist_autograd.context",
    "mpidag.dist_autograd.engine",
    "mpidag.dist_autograd.graph",
    "mpidag.dist_autograd.native",
    "mpidag.distributed.process_group",
    "mpidag.errors",
    "mpidag.nn.api.remote_module",
    "mpidag.optim.optimizer",
    "mpidag.pytest_plugin",
    "mpidag.rpc.agent_view",
    "mpidag.rpc.api",
    "mpidag.rpc.backend_registry",
    "mpidag.rpc.constants",
    "mpidag.rpc.functions",
    "mpidag.rpc.options",
    "mpidag.rpc.rref",
    "mpidag.rpc.server_process_global_profiler",
    "mpidag.rref.handle",
    "mpidag.rref.owners",
    "mpidag.rref.protocol",
    "mpidag.rref.users",
    "mpidag.inspect",
    "mpidag.run",
    "mpidag.testing",
    "mpidag.trace",
    "mpidag.transport.base",
    "mpidag.transport.buffers",
    "mpidag.transport.frames",
    "mpidag.transport.growth",
    "mpidag.transport.inproc",
    "mpidag.transport.mpi",
    "mpidag.transport.naps",
    "mpidag.transport.parking",
    "mpidag.transport.doorbell",
    "mpidag.transport.progress",
    "mpidag.transport.torch_native",
    "mpidag.transport.wire",
    "mpidag.transport.wire_build",
)

#: modules (or packages: every module in them) with ``>>>`` examples that are not run here,
#: and why; each one is a debt: move the module to MODULES once its examples run
NOT_RUN: dict[str, str] = {}


def not_run(name: str) -> bool:
    return any(name == entry or name.startswith(entry + ".") for entry in NOT_RUN)

#: docstrings whose examples run on both ranks at once (collective calls); rank 0's
#: output is checked, rank 1 runs the same statements (``rank`` tells them apart)
EVERY_RANK = {
    "mpidag.agent.agent.RpcAgent.register_handler",
    "mpidag.rpc.agent_view._all_gather",
    "mpidag.rpc.agent_view._barrier",
    "mpidag.rpc.agent_view._wait_all_workers",
    "mpidag.testing.quiesce",
    "mpidag.testing.assert_no_leaks",
    "mpidag.testing.settle",
    "mpidag.testing.leak_report",
    "mpidag.testing.delayed_control_messages",
}

#: docstrings that need the in-process world though no name of WORLD_NAMES says so
WORLD = {
    "mpidag.trace.clock_offset_ns",
}

#: docstrings whose examples run with no RPC session (no runtime bound to the thread)
NO_WORLD = {
    "mpidag.errors.RPCNotInitializedError",
}

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
#: seconds: the calls of the examples and the shutdown at the end of each item
TIMEOUT = 20.0
#: seconds after which an item's world is aborted (its examples hang)
WATCHDOG = 30.0
#: no gc.freeze, short spins: the ranks share this process and its cores
CONFIG = Config(gc_freeze=False, poll_spin=2e-3)


def collect() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder()
    tests = []
    for name in MODULES:
        tests += [t for t in finder.find(importlib.import_module(name)) if t.examples]
    return tests


DOCTESTS = collect()


def module_names() -> Iterator[tuple[str, pathlib.Path]]:
    for path in sorted((ROOT / "mpidag").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def test_every_module_with_examples_is_run():
    with_examples = {name for name, path in module_names()
                     if re.search(r"^\s*>>>", path.read_text(encoding="utf-8"), re.M)}
    forgotten = sorted(n for n in with_examples - set(MODULES) if not not_run(n))
    assert not forgotten, f"modules with >>> examples neither in MODULES nor in NOT_RUN: " \
                          f"{forgotten}"
    assert not [n for n in MODULES if not_run(n)]
    gone = sorted(set(MODULES) - with_examples) + sorted(
        entry for entry in NOT_RUN if not any(n == entry or n.startswith(entry + ".")
                                              for n in with_examples))
    assert not gone, f"listed modules without >>> examples (drop them): {gone}"


def test_every_example_is_collected():
    """Each ``>>>`` line of a listed module is an example of some docstring that runs (not
    one in a comment or a nested function's docstring, which doctest never finds)."""
    names = {t.name.split(".")[0] for t in DOCTESTS}
    assert names == {"mpidag"}
    for name, path in module_names():
        if name not in MODULES:
            continue
        prompts = len(re.findall(r"^\s*>>>", path.read_text(encoding="utf-8"), re.M))
        found = sum(len(t.examples) for t in DOCTESTS
                    if t.filename and pathlib.Path(t.filename) == path)
        assert found == prompts, f"{name}: {prompts} >>> lines, {found} examples collected"
    assert not EVERY_RANK - {t.name for t in DOCTESTS}
    assert not NO_WORLD - {t.name for t in DOCTESTS}


def on_every_rank(size: int, fn) -> list:
    with concurrent.futures.ThreadPoolExecutor(size) as pool:
        return list(pool.map(fn, range(size), timeout=120))


def start_world(size: int = 2) -> list[Runtime]:
    world = InProcWorld(size)
    options = MPIRpcBackendOptions(num_worker_threads=4, rpc_timeout=TIMEOUT)
    runtimes = on_every_rank(size, lambda r: Runtime.connect(
        world.transports[r], options=options, config=CONFIG, rref_type=mpidag.rpc.RRef))
    for runtime in runtimes:
        runtime.serve()
    return runtimes


_numbers = itertools.count()


def example_globals(test: doctest.DocTest, rank: int,
                    runtimes: list[Runtime] | None) -> dict:
    """The namespace of one docstring's examples on ``rank``: the usual imports, the
    module's own names, then this rank's ``rank``, ``runtime``, ``runtimes`` and
    ``rpc_world``. It is the namespace of a module of its own in ``sys.modules``, so that
    functions the examples define are pickled by name and found again by the rank that
    runs them."""
    import mpidag.autograd
    import mpidag.optim
    import mpidag.testing
    import mpidag.trace
    from mpidag.pytest_plugin import RpcWorld

    module = types.ModuleType(f"mpidag_doctest_{next(_numbers)}")
    namespace = module.__dict__
    namespace.update({
        "torch": torch, "time": time, "sys": sys, "operator": operator,
        "concurrent": concurrent, "threading": threading,
        "mpidag": mpidag, "rpc": mpidag.rpc, "dist_autograd": mpidag.autograd,
        "RRef": mpidag.rpc.RRef, "DistributedOptimizer": mpidag.optim.DistributedOptimizer,
        "optim": torch.optim, "testing": mpidag.testing, "InProcWorld": InProcWorld,
    })
    namespace.update({k: v for k, v in test.globs.items() if not k.startswith("__")})
    namespace.update({"rank": rank, "rpc_world": RpcWorld(rank=rank, size=2)})
    if runtimes is not None:
        namespace.update({"runtime": runtimes[rank], "runtimes": runtimes})
    namespace["__name__"] = module.__name__
    sys.modules[module.__name__] = module
    return namespace


def forget(namespace: dict) -> None:
    """Drop an examples' namespace (and the RRefs in it, released before the shutdown)."""
    sys.modules.pop(namespace.get("__name__", ""), None)
    namespace.clear()


def run_statements(test: doctest.DocTest, namespace: dict) -> None:
    """Rank 1's part of an :data:`EVERY_RANK` docstring: each example's statements, errors
    and output ignored (rank 0's run checks them)."""
    for example in test.examples:
        if example.options.get(doctest.SKIP):
            continue
        with contextlib.suppress(BaseException):  # an example may show an exception
            exec(compile(example.source, f"<{test.name} on rank 1>", "exec"), namespace)


def abort(runtimes: list[Runtime]) -> None:
    """End the in-process world: every wait of its ranks raises ``InProcAbort``."""
    world = runtimes[0].transport.world  # type: ignore[attr-defined]
    with world.changed:
        world.aborted = 1
        world.changed.notify_all()


def shut_down(runtimes: list[Runtime], rank1: threading.Thread) -> bool:
    """Rank 0's graceful shutdown if the examples left it running; rank 1 follows. A rank 0
    that left alone (``shutdown(graceful=False)``) leaves rank 1 waiting: the world is
    aborted (returns whether it was)."""
    if runtimes[0].agent.running:
        runtimes[0].shutdown(graceful=True, timeout=TIMEOUT)
    deadline = time.monotonic() + 5.0
    while rank1.is_alive() and time.monotonic() < deadline \
            and 0 not in runtimes[1].agent.failed:  # rank 0 said goodbye: it left alone
        rank1.join(0.01)
    aborted = rank1.is_alive()
    if aborted:
        abort(runtimes)
        rank1.join(TIMEOUT)
    assert not rank1.is_alive(), "rank 1 did not shut down"
    return aborted


#: names whose use makes a docstring's examples need the in-process world (the others run
#: without one, which saves its start and shutdown)
WORLD_NAMES = {"rpc", "dist_autograd", "RRef", "DistributedOptimizer", "RemoteModule",
               "runtime", "runtimes", "testing", "current", "remote", "rpc_world"}


def names_used(test: doctest.DocTest) -> set[str]:
    names: set[str] = set()

    def visit(code: types.CodeType) -> None:
        names.update(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                visit(const)

    for example in test.examples:
        visit(compile(example.source, test.name, "exec"))
    return names


def needs_world(test: doctest.DocTest) -> bool:
    return test.name in WORLD or (test.name not in NO_WORLD
                                  and bool(names_used(test) & WORLD_NAMES))


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """The objects alive before the item out of the collector's reach while it runs, as
    ``init_rpc`` does (``MPIDAG_GC_FREEZE``): the full collections of each shutdown (RRef
    releases) then take milliseconds, not a tenth of a second in this process's heap."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.mark.parametrize("test", DOCTESTS, ids=[t.name for t in DOCTESTS])
def test_docstring_examples(test: doctest.DocTest, tmp_path, monkeypatch, frozen_heap):
    monkeypatch.chdir(tmp_path)  # files the examples write land there
    runtimes = start_world(2) if needs_world(test) else None
    every_rank = runtimes is not None and test.name in EVERY_RANK
    mine = doctest.DocTest(test.examples, {}, test.name, test.filename, test.lineno,
                           test.docstring)
    mine.globs = example_globals(test, 0, runtimes)  # that module's namespace, not a copy
    rank1_errors: list[BaseException] = []

    def rank1_main() -> None:
        try:
            if every_rank:
                bind_thread(runtimes[1])
                namespace = example_globals(test, 1, runtimes)
                run_statements(test, namespace)
                forget(namespace)
            if runtimes[1].agent.running:  # the examples may have shut it down
                runtimes[1].shutdown(graceful=True)
        except BaseException as exc:  # noqa: BLE001 - reported below
            rank1_errors.append(exc)
        finally:
            bind_thread(None)

    rank1 = threading.Thread(target=rank1_main, name="doctest rank 1", daemon=True)
    output: list[str] = []
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    # an example that hangs (a collective that rank 1 does not join) fails, not the run
    watchdog = threading.Timer(WATCHDOG, lambda: runtimes and abort(runtimes))
    aborted = False
    if runtimes is not None:
        rank1.start()
        bind_thread(runtimes[0])
        watchdog.start()
    try:
        runner.run(mine, out=output.append, clear_globs=False)
    finally:
        watchdog.cancel()
        bind_thread(None)
        forget(mine.globs)
        builtins.__dict__.pop("_", None)  # the last value shown
        if runtimes is not None:
            aborted = shut_down(runtimes, rank1)
    if runner.failures:
        pytest.fail("".join(output), pytrace=False)
    if rank1_errors and not aborted:
        raise rank1_errors[0]
