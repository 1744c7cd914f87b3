"""rpc_sync / rpc_async behaviour that only MPI ranks show; the rest of the RPC contract is in
tests/contract/test_rpc.py (run on both transports).

Run with ``mpirun -n 2`` (and ``-n 3``) ``python -m pytest --with-mpi -m mpi tests``.
"""

from __future__ import annotations

import pytest
import torch

import mpidag.rpc as rpc
from tests import rpc_funcs as f
from tests.conftest import profiled_names

pytestmark = pytest.mark.mpi(min_size=2)


def _at_two_ranks_only(rpc_world) -> None:
    """The payloads past 2 GiB go from rank 0 to rank 1 only: the transport's path is the same
    at any world size, and their copies take ~40 s a run here, so a larger world skips them
    (each MPI of the matrix runs them at 2 ranks)."""
    if rpc_world.size > 2:
        pytest.skip("past-2-GiB payloads run at 2 ranks only (the same path at any size)")


# MPI only: MPI 3's int32 count limit (in-process: several 2 GiB copies in one process)
def test_tensor_larger_than_2gib(rpc_world):
    _at_two_ranks_only(rpc_world)
    if rpc_world.rank != 0:
        return
    nbytes = (1 << 31) + (1 << 20)  # past the int32 count limit of MPI 3 calls
    n, strided_sum, last, dtype = rpc.rpc_sync(rpc_world.next, f.big_tensor_check,
                                               args=(f.make_big(nbytes),), timeout=120)
    expected = f.make_big(nbytes)
    assert n == expected.numel() and dtype == torch.int32
    assert last == float(expected[-1])
    assert strided_sum == float(expected[:: 1 << 20].double().sum())
    del expected
    back = rpc.rpc_sync(rpc_world.next, f.make_big, args=(nbytes,), timeout=120)
    assert back.numel() == nbytes // 4 and int(back[-1]) == nbytes // 4 - 1


@pytest.mark.parametrize("kind", ["bytes", "numpy"])
# MPI only: MPI 3's int32 count limit (in-process: several 2 GiB copies in one process)
def test_non_tensor_payload_larger_than_2gib(rpc_world, kind):
    """bytes go in the pickle (the payload travels as its own chunked frame); numpy arrays
    travel out of band like tensors (no copy into the pickle)."""
    _at_two_ranks_only(rpc_world)
    if rpc_world.rank != 0:
        return
    nbytes = (1 << 31) + (1 << 20) + 7  # past the int32 count limit of MPI 3 calls
    payload = f.make_large_payload(kind, nbytes)
    expected = f.payload_digest(payload)
    got = rpc.rpc_sync(rpc_world.next, f.payload_digest, args=(payload,), timeout=300)
    del payload
    assert got == (("bytes" if kind == "bytes" else "ndarray"), *expected[1:])


# MPI only: sys.modules is per process (in-process ranks would all see the module)
def _defined_only_on_rank_zero():
    return "found"


def test_function_missing_on_callee(rpc_world):
    # rank 0 publishes a function under a module name that only it has
    import sys
    import types

    mod = types.ModuleType("only_on_rank_zero")
    mod.func = _defined_only_on_rank_zero
    _defined_only_on_rank_zero.__module__ = "only_on_rank_zero"
    _defined_only_on_rank_zero.__qualname__ = "func"
    try:
        if rpc_world.rank == 0:
            sys.modules["only_on_rank_zero"] = mod
            with pytest.raises(ModuleNotFoundError, match="must be importable on the callee"
                               ) as info:
                rpc.rpc_sync("worker1", _defined_only_on_rank_zero, timeout=10)
            # torch's RuntimeError and wording (test_function_not_on_callee)
            assert isinstance(info.value, RuntimeError)
            assert "Default RPC pickler does not serialize function code" in str(info.value)
            del info
            assert rpc.rpc_sync("worker0", _defined_only_on_rank_zero, timeout=10) == "found"
            assert rpc.rpc_sync("worker1", f.add, args=(1, 2), timeout=10) == 3
    finally:
        sys.modules.pop("only_on_rank_zero", None)


# MPI only: the torch profiler is process-wide (in-process ranks would share one)
def test_profiler_ranges_on_caller_and_callee(rpc_world):
    me, nxt, prv = rpc_world.name, rpc_world.next, rpc_world.prev

    def calls():
        assert rpc.rpc_sync(nxt, f.add, args=(1, 2), timeout=10) == 3
        assert rpc.rpc_async(nxt, f.async_add_chained, args=(me, 1, 2, 3), timeout=10).wait() == 6

    names = profiled_names(calls)
    add, chained = "tests.rpc_funcs.add", "tests.rpc_funcs.async_add_chained"
    assert f"mpidag.rpc#{add}({me} -> {nxt})" in names, sorted(names)
    assert f"mpidag.rpc#{chained}({me} -> {nxt})" in names
    # served here for the previous rank, in a pool thread: the callee's side of its calls
    assert f"mpidag.rpc.serve#{add}({prv} -> {me})" in names, sorted(names)
    assert f"mpidag.rpc.serve#{chained}({prv} -> {me})" in names
    # the async function called back into its caller: that nested call is served here too
    assert f"mpidag.rpc#{add}({nxt} -> {me})" not in names  # made on the next rank, not here
    assert f"mpidag.rpc.serve#{add}({nxt} -> {me})" in names


# MPI only: the legacy profiler and its node ids are process-wide
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_legacy_profiler_records_torchs_keys_and_the_callees_events(rpc_world):
    """Under torch's legacy profiler (the one torch profiles RPCs with) a call is a range
    named by torch's key, and what ran on the callee comes back as remote events with the
    callee's rank, nested calls under both keys."""
    from torch.autograd.profiler_legacy import profile

    me, nxt = rpc_world.name, rpc_world.next
    with profile() as prof:
        fut = rpc.rpc_async(nxt, torch.mul, args=(torch.ones(2), 3), timeout=10)
        assert fut.wait().tolist() == [3.0, 3.0]
        assert rpc.rpc_sync(nxt, f.nested_add, args=(me, 1, 2), timeout=10) == 4
    events = prof.function_events
    key = f"rpc_async#aten::mul({me} -> {nxt})"
    ranges = [e for e in events if e.name == key]
    assert len(ranges) == 1 and ranges[0].node_id == rpc_world.rank
    mul = [e for e in events if e.name == f"{key}#remote_op: aten::mul"]
    assert len(mul) == 1 and mul[0].is_remote
    assert mul[0].node_id == (rpc_world.rank + 1) % rpc_world.size
    nested = f"rpc_sync#nested_add({me} -> {nxt})#remote_op: rpc_sync#add({nxt} -> {me})"
    assert nested in {e.name for e in events if e.is_remote}, sorted(e.name for e in events)


# MPI only: the user's own collectives on COMM_WORLD
@pytest.mark.parametrize("collective", ["barrier", "bcast", "allgather", "Allreduce"])
def test_calls_are_served_while_a_rank_waits_in_its_own_mpi_collective(rpc_world, collective):
    """The user's own MPI calls on COMM_WORLD (mpidag uses a private duplicate) do not stop a
    rank from serving RPCs while it waits in them (docs/quickstart.md)."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if rpc_world.rank == 0:  # the others are inside the collective meanwhile
        for dst in range(1, rpc_world.size):
            assert rpc.rpc_sync(dst, f.add, args=(dst, 1), timeout=20) == dst + 1
    if collective == "barrier":
        comm.barrier()
    elif collective == "bcast":
        assert comm.bcast("go" if rpc_world.rank == 0 else None, root=0) == "go"
    elif collective == "allgather":
        assert comm.allgather(rpc_world.rank) == list(range(rpc_world.size))
    else:
        value = np.array([rpc_world.rank], dtype=np.int64)
        comm.Allreduce(MPI.IN_PLACE, value, op=MPI.MIN)
        assert value[0] == 0
