"""One MPI rank of a torch-suite job: runs the given tests (of classes of one world size) in
order.

Started by the runner as ``python -m mpidag.run -n W -m tests.torch_suites.rank ...``: one
job runs every class of its world size, as a job start (four ranks importing torch and its
test modules) costs about ten times the tests of a class here. Each rank appends JSON lines
to ``<results>/rank<r>.jsonl``: ``start`` before a test, ``end`` with the outcome after it,
the test named ``Class.test``. Ranks wait for each other between tests (an MPI barrier, as torch's
ranks are synchronised by starting together). After a test that fails on a rank, that rank
shuts RPC down gracefully itself (the others may be in their graceful shutdown, waiting for
it) and every rank leaves, because a failed test may leave state behind (a process group, a
thread): the runner starts the next test in a new job, as torch starts new processes for
every test. If the rank cannot meet the others within ``CLEANUP_SECONDS``, it ends the job
(``MPI_Abort``).

Example::

    python -m mpidag.run -n 4 -m tests.torch_suites.rank \\
        --tests RpcTest.test_add,DistAutogradTest.test_autograd_context \\
        --results /tmp/r --store /tmp/s
"""

from __future__ import annotations

import argparse
import array
import json
import os
import sys
import time
import traceback
import unittest
from pathlib import Path
from typing import Any

from tests.torch_suites import shim, suites


def _skip_reasons() -> dict[int, str]:
    from torch.testing._internal.common_distributed import TEST_SKIPS

    return {skip.exit_code: skip.message for skip in TEST_SKIPS.values()}


#: how long a rank whose test failed waits for RPC's shutdown and the other ranks
CLEANUP_SECONDS = 20.0


def _shut_rpc_down(deadline: float) -> bool:
    """Shut RPC down gracefully if the test left it running (the other ranks may be in
    their graceful shutdown, waiting for this one); False if that did not end in time."""
    import threading

    from mpidag import _runtime
    from mpidag import rpc as mpidag_rpc

    def shut_down() -> None:
        try:
            if _runtime.current_or_none() is not None:
                mpidag_rpc.shutdown(graceful=True)
        except BaseException:  # noqa: BLE001 - a failed shutdown is reported below
            pass

    worker = threading.Thread(target=shut_down, daemon=True)
    worker.start()
    worker.join(max(0.0, deadline - time.monotonic()))
    return not worker.is_alive() and _runtime.current_or_none() is None


def _any_rank_failed(comm: Any, failed: bool, deadline: float | None) -> bool | None:
    """Whether the test failed on any rank (a nonblocking all-reduce, so a rank whose test
    failed can give up at ``deadline``: None)."""
    from mpi4py import MPI

    flags = array.array("i", [int(failed)])
    total = array.array("i", [0])
    request = comm.Iallreduce(flags, total, op=MPI.SUM)
    while not request.Test():
        if deadline is not None and time.monotonic() > deadline:
            return None
        time.sleep(0.005)
    return total[0] > 0


def _destroy_process_group() -> None:
    """Destroy the default process group a test made (torch's ranks exit after each test,
    so its tests make one without checking for an old one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def run_one(cls: type, name: str, rank: int, store: str) -> tuple[str, str]:
    """Run one test as torch's ranks do (the method only: no setUp, as in
    ``MultiProcessTestCase.run_test``); returns (outcome, detail)."""
    from torch.testing._internal import common_utils

    test = suites.make_test(cls, name, rank, store)
    common_utils.set_rng_seed()
    try:
        getattr(test, name)()
    except unittest.SkipTest as skip:
        return "skipped", str(skip)
    except SystemExit as exc:  # torch's skip decorators exit with a skip code
        reason = _skip_reasons().get(exc.code if isinstance(exc.code, int) else -1)
        if reason is not None:
            return "skipped", reason
        return "failed", "".join(traceback.format_exc(limit=-12))
    except BaseException:  # noqa: BLE001 - every failure is a result
        return "failed", "".join(traceback.format_exc(limit=-12))
    return "passed", ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", required=True,
                        help="comma-separated tests, each Class.test (e.g. RpcTest.test_add)")
    parser.add_argument("--results", required=True, help="directory for rank<r>.jsonl")
    parser.add_argument("--store", required=True, help="directory for the tests' store files")
    args = parser.parse_args(argv)

    shim.install()
    from mpi4py import MPI

    from mpidag import _runtime

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    out = open(Path(args.results) / f"rank{rank}.jsonl", "a", buffering=1)  # noqa: SIM115

    def record(**fields: Any) -> None:
        out.write(json.dumps({"rank": rank, "time": time.time(), **fields}) + "\n")
        out.flush()
        os.fsync(out.fileno())

    for index, key in enumerate(args.tests.split(",")):
        cls_name, _, name = key.partition(".")
        # the module's globals start anew for every test, as in torch's processes
        cls = suites.test_class(suites.suite_of(cls_name), cls_name, fresh=index > 0)
        store = str(Path(args.store) / key)
        record(event="start", test=key)
        shim.reset_torch_internals_used()
        began = time.monotonic()
        outcome, detail = run_one(cls, name, rank, store)
        left_running = _runtime.current_or_none() is not None
        if outcome != "failed" and left_running:
            outcome, detail = "failed", "the test left RPC running (no rpc.shutdown())"
        record(event="end", test=key, outcome=outcome, detail=detail[-6000:],
               seconds=round(time.monotonic() - began, 3),
               torch_internals=shim.torch_internals_used())
        failed = outcome == "failed"
        deadline = None
        if failed:
            sys.stderr.write(f"[rank {rank}] {key} failed:\n{detail}\n")
            sys.stderr.flush()
            deadline = time.monotonic() + CLEANUP_SECONDS
            if not _shut_rpc_down(deadline):
                deadline = time.monotonic()  # give up at once
        verdict = _any_rank_failed(comm, failed, deadline)
        _destroy_process_group()  # every rank is past the test: torch's would exit here
        if verdict is None:  # the others did not come: end the job
            record(event="abort", test=key)
            comm.Abort(1)
        if verdict:  # a failed test may leave state behind: the next test gets a new job
            out.close()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
