"""RPC while a thread of the program sits in a blocking MPI receive of its own (a listener, a
stop signal): calls still complete with the right values, and the blocked thread still gets
its message afterwards (docs/design.md, "A user thread blocked in MPI"; the speed of this is
``benchmarks/bench_blocked_thread.py``'s, never asserted here).

Run with ``python -m mpidag.run -n 2 -m pytest --with-mpi -m mpi tests/test_blocked_thread.py``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

import mpidag.rpc as rpc

TAG = 91


def _sleepy_barrier(comm: Any, timeout: float = 60) -> None:
    request = comm.Ibarrier()
    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:
            pytest.fail("the other ranks did not reach the barrier")
        time.sleep(0.001)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("how", ["recv", "Recv"])
def test_calls_complete_while_a_user_thread_blocks_in_mpi_on_every_rank(rpc_world, how):
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()  # the program's own communicator
    # ranks of the program's communicator (rpc_world.next is the next worker's *name*)
    prev, nxt = (rpc_world.rank - 1) % rpc_world.size, (rpc_world.rank + 1) % rpc_world.size
    got: list[Any] = []

    def listener() -> None:  # blocks in MPI until the previous rank releases it
        if how == "recv":
            got.append(comm.recv(source=prev, tag=TAG))
        else:
            buf = np.zeros(1, dtype=np.int64)
            comm.Recv(buf, source=prev, tag=TAG)
            got.append(int(buf[0]))

    thread = threading.Thread(target=listener, daemon=True)
    try:
        thread.start()
        time.sleep(0.05)  # (inside MPI by now: not needed for the result, only for the point)
        _sleepy_barrier(comm)
        results = [rpc.rpc_sync(rpc_world.next, torch.add, args=(torch.full((3,), i), 1),
                                timeout=60) for i in range(200)]
        futures = [rpc.rpc_async(rpc_world.next, torch.mul, args=(torch.ones(2), i),
                                 timeout=60) for i in range(50)]
        assert [r.tolist() for r in results] == [[i + 1.0] * 3 for i in range(200)]
        assert [f.wait().tolist() for f in futures] == [[float(i)] * 2 for i in range(50)]
        assert thread.is_alive() and got == []  # still waiting for its message
        _sleepy_barrier(comm)
    finally:
        if how == "recv":  # release the next rank's listener
            comm.send(("stop", nxt), dest=nxt, tag=TAG)
        else:
            comm.Send(np.array([nxt], dtype=np.int64), dest=nxt, tag=TAG)
        thread.join(30)
    assert not thread.is_alive()
    assert got == ([("stop", rpc_world.rank)] if how == "recv" else [rpc_world.rank])
    _sleepy_barrier(comm)
    comm.Free()


def test_a_users_own_setting_wins_and_other_mpis_are_left_alone():
    from mpidag.transport.mpi import YIELD_SETTINGS, make_blocking_waits_yield

    assert YIELD_SETTINGS == {"Open MPI": "OMPI_MCA_mpi_yield_when_idle",
                              "MPICH": "MPIR_CVAR_CH4_PROGRESS_THROTTLE"}
    assert make_blocking_waits_yield("Open MPI v5.0.11", {"OMPI_MCA_mpi_yield_when_idle": "0"}
                                     ) is None
    assert make_blocking_waits_yield("MPICH Version: 5.0.2",
                                     {"MPIR_CVAR_CH4_PROGRESS_THROTTLE": "0"}) is None
    assert make_blocking_waits_yield("Intel(R) MPI Library 2021", {}) is None


@pytest.mark.mpi(min_size=2)
def test_blocking_waits_yield_on_this_mpi(rpc_world):
    """What init_rpc set (unless the environment says otherwise), read back from the library."""
    import ctypes
    import os

    from mpi4py import MPI

    from mpidag.transport.mpi import YIELD_SETTINGS, make_blocking_waits_yield

    version = MPI.Get_library_version()
    library = next((n for n in YIELD_SETTINGS if version.startswith(n)), None)
    if library is None or YIELD_SETTINGS[library] in os.environ:
        pytest.skip(f"nothing is set on this MPI or in this environment ({version[:40]!r})")
    made = make_blocking_waits_yield(version, {})
    if library == "Open MPI":
        assert made == "Open MPI: mpi_yield_when_idle=1"
        with open("/proc/self/maps") as maps:
            path = next(line.split()[-1] for line in maps if "libopen-pal" in line)
        pal = ctypes.CDLL(path)
        assert ctypes.c_bool.in_dll(pal, "opal_progress_yield_when_idle").value is True
    else:
        assert made == "MPICH: MPIR_CVAR_CH4_PROGRESS_THROTTLE=1"
