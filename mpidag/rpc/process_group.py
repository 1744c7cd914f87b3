"""A ``torch.distributed`` process group for some ranks of the running mpidag job.

Hybrid jobs (torch's tutorial "Combining Distributed DataParallel with Distributed RPC
Framework") need RPC between every rank and a collective process group among some of them,
e.g. the trainers of a ``DistributedDataParallel`` model. With torch the user invents a
``MASTER_ADDR``/port and passes ranks and sizes twice; here the group comes from the MPI job:

    rpc.init_rpc()
    pg = rpc.init_process_group(ranks=[0, 1])        # every rank calls it; 2 and 3 get None
    if pg is not None:                               # mpidag.nn.parallel's DDP (torch's class)
        model = DistributedDataParallel(model, process_group=pg)

How: every rank of the job takes part in three small non-blocking all-reduces over mpidag's
transport (the RPC pool threads keep serving meanwhile): the first checks that all ranks
passed the same arguments and that none failed locally, the second spreads the address of a
``torch.distributed.TCPStore`` that the group's first rank opened on a free port. The members
then make the group with ``torch.distributed.init_process_group(store=...)``, and the third
returns on every rank only once every member has made it (or raises everywhere if one
could not).

``backend="mpi"`` makes the group of :mod:`mpidag.distributed` instead: collectives over the
job's MPI (a communicator of the members, split from ``COMM_WORLD``), no store, no port, no
Gloo; the second round is skipped.
"""

from __future__ import annotations

import datetime
import hashlib
import socket
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from mpidag import _runtime
from mpidag.agent.options import WorkerInfo
from mpidag.distributed import process_group as mpi_pg
from mpidag.errors import RPCError

__all__ = ["init_process_group"]

mpi_pg.register()  # backend "mpidag": torch.distributed.init_process_group(backend="mpi") too

#: the backend names that make the MPI group of :mod:`mpidag.distributed`
_MPI_BACKENDS = ("mpi", mpi_pg.BACKEND)

#: the longest host name the rendezvous spreads (RFC 1035 names have at most 253 bytes)
_MAX_HOST = 255


def init_process_group(ranks: Sequence[int | str | WorkerInfo] | None = None,
                       backend: str = "gloo",
                       timeout: float | datetime.timedelta | None = None,
                       host: str | None = None) -> Any:
    """Make torch's default process group over ``ranks`` of this mpidag job; collective.

    Call it after :func:`~mpidag.rpc.init_rpc` on **every** rank of the job (members and
    non-members), from one thread per rank, with the same ``ranks`` and ``backend``. On a
    member it initializes ``torch.distributed``'s default group over the members only
    (member ``ranks[i]`` gets group rank ``i``; ``torch.distributed.get_rank()`` and
    ``get_world_size()`` answer for the group) and returns that ``ProcessGroup``; on the
    other ranks it returns ``None``. Rank, size and the rendezvous address come from the
    MPI job: the group's first rank opens a ``TCPStore`` on a free port and the others learn
    its address through mpidag's transport (no ``MASTER_ADDR``/``MASTER_PORT``).

    Free it with ``torch.distributed.destroy_process_group()`` on the members, before or
    after :func:`~mpidag.rpc.shutdown`, once every member is done with it and the DDP
    models that hold it are freed (a ``torch.distributed.barrier()`` first): a Gloo group
    torn down while a peer has already left can hang (see the porting guide).

    Args:
        ranks: the members, as ranks, worker names or ``WorkerInfo`` (default: every rank).
        backend: a ``torch.distributed`` backend, ``"gloo"`` (default) or ``"nccl"``, ...;
            ``"mpi"`` (or ``"mpidag"``): collectives over the job's MPI
            (:class:`mpidag.distributed.MPIProcessGroup`: no store, no port; CPU tensors,
            CUDA ones where the MPI is CUDA-aware).
        timeout: seconds (or a ``timedelta``) for the rendezvous and for the group's
            operations; default torch's (30 minutes for gloo).
        host: the address the other members reach the first member at (default: ``127.0.0.1``
            when all members run on one host, else the first member's host name).

    Raises:
        RPCNotInitializedError: before ``init_rpc`` (or after ``shutdown``).
        ValueError: on the rank that passed bad arguments (no members, an unknown or
            repeated rank, a non-str backend) or that already has a default group, and
            ``RPCError`` naming that rank on every other rank; ``RPCError`` on every rank
            when ranks passed different ``ranks``/``backend``.

    Example::

        # run with: python -m mpidag.run -n 4 prog.py
        rpc.init_rpc()
        pg = rpc.init_process_group(ranks=[0, 1])          # trainers 0 and 1
        if pg is not None:
            # torch's DDP class, averaging also inside mpidag.autograd.backward:
            from mpidag.nn.parallel import DistributedDataParallel
            ddp = DistributedDataParallel(torch.nn.Linear(4, 2), process_group=pg)
            torch.distributed.all_reduce(torch.ones(1), group=pg)   # tensor([2.])
        rpc.shutdown()
        if pg is not None:
            torch.distributed.destroy_process_group()
    """
    runtime = _runtime.current()
    size, me = runtime.agent.world_size, runtime.agent.rank
    delta = dist.default_pg_timeout if dist.is_available() else datetime.timedelta(minutes=30)
    members: list[int] = []
    problem: Exception | None = None
    try:
        delta = _as_timedelta(timeout)
        members = _members(runtime, ranks, size)
        if not isinstance(backend, str) or not backend:
            raise ValueError(f"backend must be a torch.distributed backend name such as "
                             f"'gloo', got {backend!r}")
        if me in members and not dist.is_available():
            raise RuntimeError("this torch build has no torch.distributed")
        if backend in _MPI_BACKENDS and not _on_mpi(runtime):
            raise ValueError(
                f"init_process_group(backend={backend!r}) needs the MPI transport (a job "
                f"started with python -m mpidag.run / mpirun), not "
                f"{type(runtime.agent.transport).__name__}; use backend='gloo' here")
        if me in members and dist.is_initialized():
            raise ValueError(
                "torch.distributed already has a default process group on this rank (torch "
                "allows one); call torch.distributed.destroy_process_group() first")
    except (TypeError, ValueError, RuntimeError) as exc:
        problem = exc
    seconds = delta.total_seconds()
    # round 1: did every rank get this far, with the same arguments?
    digest = _digest(repr((members, backend)))
    hostname = host or socket.gethostname()
    rows = _gather_ints(runtime, [int(problem is not None), digest, _digest(hostname)], seconds)
    failed = [r for r, row in enumerate(rows) if row[0]]
    if problem is not None:
        raise problem
    if failed:
        raise RPCError(f"init_process_group failed on rank(s) {failed} (see their errors); no "
                       f"rank made the process group")
    differ = [r for r, row in enumerate(rows) if row[1] != digest]
    if differ:
        raise RPCError(
            f"init_process_group is collective over every rank with the same arguments, but "
            f"rank(s) {differ} passed other ranks/backend than rank {me} (ranks={members}, "
            f"backend={backend!r})")
    if backend in _MPI_BACKENDS:
        return _make_mpi_group(runtime, members, delta, seconds)
    # round 2: the first member opens the store; everyone learns where it listens
    leader = members[0]
    store = None
    row = [0] * (3 + _MAX_HOST)
    if me == leader:
        same_host = all(rows[r][2] == rows[leader][2] for r in members)
        address = host or ("127.0.0.1" if same_host else socket.gethostname())
        encoded = address.encode()[:_MAX_HOST]
        try:
            store = dist.TCPStore(address, 0, len(members), is_master=True, timeout=delta,
                                  wait_for_workers=False)
            row[:3] = [1, store.port, len(encoded)]
            row[3:3 + len(encoded)] = list(encoded)
        except Exception as exc:
            problem = exc
    spread = _gather_ints(runtime, row, seconds)[leader]
    if problem is not None:
        raise problem
    if not spread[0]:
        raise RPCError(f"init_process_group: rank {leader} (the group's first member) could "
                       f"not open the rendezvous store (see its error)")
    # round 3: the members make the group; every rank returns once all of them have, so
    # that an RPC sent right after this call finds the group made on its callee
    group = None
    if me in members:
        address = bytes(spread[3:3 + spread[2]]).decode()
        try:
            if store is None:
                store = dist.TCPStore(address, spread[1], len(members), is_master=False,
                                      timeout=delta)
            dist.init_process_group(backend, store=store, rank=members.index(me),
                                    world_size=len(members), timeout=delta)
            group = dist.group.WORLD
        except Exception as exc:
            problem = exc
    _all_made(runtime, problem, seconds)
    return group


def _on_mpi(runtime: Any) -> bool:
    from mpidag.transport.mpi import MPITransport

    return isinstance(runtime.agent.transport, MPITransport)


def _make_mpi_group(runtime: Any, members: list[int], delta: datetime.timedelta,
                    seconds: float) -> Any:
    """Rounds 2 and 3 for ``backend="mpi"``: the members' communicator, split from
    ``COMM_WORLD`` (every rank takes part) when the transport spans it, else made by the
    members alone (``MPI_Comm_create_group``); then torch's default group over it."""
    from mpi4py import MPI

    me = runtime.agent.rank
    transport_comm = runtime.agent.transport.comm
    world = MPI.COMM_WORLD
    problem: Exception | None = None
    group = None
    try:
        world_ranks = MPI.Group.Translate_ranks(transport_comm.Get_group(), members,
                                                world.Get_group())
        if transport_comm.Get_size() == world.Get_size():
            comm = world.Split(0 if me in members else MPI.UNDEFINED,
                               members.index(me) if me in members else 0)
        elif me in members:
            incl = world.Get_group().Incl(world_ranks)
            comm = world.Create_group(incl, tag=mpi_pg.CREATE_GROUP_TAG)
            incl.Free()
        if me in members:
            mpi_pg._prepare(comm, list(world_ranks))
            try:
                dist.init_process_group(mpi_pg.BACKEND, store=dist.HashStore(),
                                        rank=members.index(me), world_size=len(members),
                                        timeout=delta)
            finally:
                mpi_pg._prepare(None, [])
            group = dist.group.WORLD
    except Exception as exc:
        problem = exc
    _all_made(runtime, problem, seconds)
    return group


def _all_made(runtime: Any, problem: Exception | None, seconds: float) -> None:
    """Round 3's end, collective: raise this rank's ``problem``, or ``RPCError`` naming the
    ranks that could not join the group; return once every rank has made its part."""
    made = _gather_ints(runtime, [int(problem is not None)], seconds)
    if problem is not None:
        raise problem
    failed = [r for r, row in enumerate(made) if row[0]]
    if failed:
        raise RPCError(f"init_process_group: rank(s) {failed} could not join the process "
                       f"group (see their errors)")


def _members(runtime: Any, ranks: Sequence[Any] | None, size: int) -> list[int]:
    if ranks is None:
        return list(range(size))
    if isinstance(ranks, (str, int, WorkerInfo)) or not isinstance(ranks, Sequence):
        raise TypeError(f"ranks must be a list of ranks or worker names, got {ranks!r}")
    members = [runtime.to_rank(r) for r in ranks]  # UnknownWorkerError is a ValueError
    if not members:
        raise ValueError("init_process_group(ranks=[]): a process group needs a member")
    repeated = sorted({r for r in members if members.count(r) > 1})
    if repeated:
        raise ValueError(f"init_process_group: rank(s) {repeated} appear more than once in "
                         f"ranks={list(ranks)!r}")
    return members


def _as_timedelta(timeout: float | datetime.timedelta | None) -> datetime.timedelta:
    if timeout is None:
        return dist.default_pg_timeout
    if isinstance(timeout, datetime.timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got "
                         f"{timeout!r}")
    return datetime.timedelta(seconds=float(timeout))


def _digest(text: str) -> int:
    """A 56-bit digest (a sum over ranks of one non-zero slot cannot overflow int64)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _gather_ints(runtime: Any, row: list[int], timeout: float) -> list[list[int]]:
    """Collective: every rank's ``row`` (same length on every rank), by rank. An all-gather
    made of the transport's non-blocking integer all-reduce (each rank fills its own slot),
    so this rank keeps serving RPCs while it waits."""
    agent = runtime.agent
    size, me, width = agent.world_size, agent.rank, len(row)
    values = [0] * (size * width)
    values[me * width:(me + 1) * width] = row
    wait = agent.collective_waiter(timeout, "a rank did not call init_process_group")
    total = agent.transport.allreduce_sum(values, wait)
    return [total[r * width:(r + 1) * width] for r in range(size)]
