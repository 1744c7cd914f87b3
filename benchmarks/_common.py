"""Helpers shared by the benchmark scripts of this directory (not a benchmark itself).

The scripts put ``benchmarks/`` on ``sys.path`` and import from here: the watchdog that
aborts a hung MPI job, MPI waits that sleep instead of busy-polling (with or without a
timeout), torch RPC started over MPI, progress lines, and the machine and git header of
every result JSON::

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import Watchdog, log, machine_info, start_torch_rpc
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import platform
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

import torch
from mpi4py import MPI

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

#: Timeout (seconds) passed to every RPC call and to the RPC agents.
RPC_TIMEOUT_S = 120.0

GiB = 1024 ** 3


# --------------------------------------------------------------------------------------------
# Safety: every blocking step runs under a watchdog that aborts the whole MPI job.
# --------------------------------------------------------------------------------------------


class Watchdog:
    """Abort the MPI job (after dumping all thread stacks) if a block runs too long.

    Used as ``with Watchdog(60, "init torch"): ...``. MPI calls and RPC shutdowns have no
    timeout of their own, so this is what guarantees that a broken implementation cannot hang
    the benchmark forever. Results already written to disk are kept.
    """

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds = seconds
        self.what = what
        self._timer: threading.Timer | None = None

    def _fire(self) -> None:
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write(
            f"\n[bench rank {rank}] WATCHDOG: '{self.what}' exceeded {self.seconds:.0f} s; "
            "thread stacks follow, then MPI_Abort\n"
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(124)

    def __enter__(self) -> Watchdog:
        self._timer = threading.Timer(self.seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._timer is not None:
            self._timer.cancel()


# --------------------------------------------------------------------------------------------
# MPI waits that never spin: a waiting rank leaves the core to its RPC threads
# --------------------------------------------------------------------------------------------


def wait_request(req: MPI.Request, timeout: float | None = None, what: str = "",
                 nap: float = 1e-3) -> Any:
    """Poll a nonblocking MPI request with ``test()`` and ``nap``-second sleeps until done.

    Returns the request's received object (for ``irecv``) or ``None``. With ``timeout``
    it raises ``TimeoutError`` naming ``what`` after that many seconds; without, the caller's
    :class:`Watchdog` bounds the wait. Never spins: on a 2-core machine a rank busy-polling
    in a blocking MPI call takes a core from the RPC threads that must serve the others.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done, obj = req.test()
        if done:
            return obj
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{what}: no progress after {timeout:.0f} s")
        time.sleep(nap)


def timed_barrier(comm: MPI.Comm, timeout: float, what: str) -> None:
    """``comm.Barrier()`` that raises ``TimeoutError`` instead of hanging."""
    wait_request(comm.Ibarrier(), timeout, what, nap=0.0005)


def timed_allreduce_min(comm: MPI.Comm, value: int, timeout: float, what: str) -> int:
    """Minimum of an ``int`` over ``comm``, with a timeout (used to agree on success flags)."""
    send = torch.tensor([value], dtype=torch.int64).numpy()
    recv = send.copy()
    wait_request(comm.Iallreduce(send, recv, op=MPI.MIN), timeout, what, nap=0.0005)
    return int(recv[0])


def timed_recv(comm: MPI.Comm, source: int, tag: int, timeout: float, what: str) -> Any:
    """Pickled ``comm.recv`` with a timeout."""
    return wait_request(comm.irecv(source=source, tag=tag), timeout, what, nap=0.0005)



def sleepy_barrier(comm: MPI.Comm) -> None:
    """A barrier on ``comm`` that sleeps instead of busy-polling (``Ibarrier`` + ``test``)."""
    wait_request(comm.Ibarrier())


def free_tcp_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_torch_rpc(comm: MPI.Comm, transports: list[str] | None = None,
                    timeout: float = RPC_TIMEOUT_S) -> ModuleType:
    """``torch.distributed.rpc.init_rpc`` with TensorPipe (16 worker threads) on every rank
    of ``comm``, named ``worker{rank}``; rank 0 picks a free port and MPI tells the others.
    Returns ``torch.distributed.rpc``."""
    import torch.distributed.rpc as rpc

    rank = comm.Get_rank()
    port = comm.bcast(free_tcp_port() if rank == 0 else None, root=0)
    extra: dict[str, Any] = {"_transports": transports} if transports else {}
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                           num_worker_threads=16, rpc_timeout=timeout, **extra)
    with warnings.catch_warnings():
        # init_rpc gathers device maps through a Gloo group and torch warns about its own
        # internal use of the Backend as a ProcessGroup; it is noise here.
        warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=comm.Get_size(),
                     rpc_backend_options=opts)
    return rpc


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------


def log(msg: str, tag: str = "bench") -> None:
    """Print a progress line ``[tag HH:MM:SS] msg`` to stderr."""
    sys.stderr.write(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or ``None`` when either is missing or ``b`` is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def selected_impls(parser: argparse.ArgumentParser, only: str, impl_keys: dict[str, str]
                   ) -> list[str]:
    """The JSON keys of the implementations ``--only`` names (short or long names), in
    ``impl_keys``' order; a parser error for an unknown one."""
    wanted = [s.strip() for s in only.split(",") if s.strip()]
    aliases = {**impl_keys, **{v: v for v in impl_keys.values()}}
    unknown = [w for w in wanted if w not in aliases]
    if unknown or not wanted:
        parser.error(f"--only: unknown implementation(s) {unknown}; choose from "
                     f"{','.join(impl_keys)}")
    keys = {aliases[w] for w in wanted}
    return [k for k in impl_keys.values() if k in keys]


def machine_info() -> dict[str, Any]:
    """Describe the machine and software versions for the JSON header."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = None
    with contextlib.suppress(ValueError, OSError):
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1)
    import numpy

    return {
        "host": socket.gethostname(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_GiB": mem_gib,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "mpi4py": __import__("mpi4py").__version__,
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "mpi": MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip(),
    }


def git_info() -> dict[str, Any]:
    """The checkout's commit and the uncommitted changes under ``mpidag/`` (what is measured)."""
    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True,
                                 text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout.strip()

    dirty = [line for line in git("status", "--porcelain", "--", "mpidag").splitlines() if line]
    return {"head": git("rev-parse", "HEAD") or None, "mpidag_uncommitted": dirty}
