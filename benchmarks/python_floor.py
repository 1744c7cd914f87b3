"""The floor of any RPC layer written in Python on mpi4py, on this machine.

Run on two ranks::

    python -m mpidag.run -n 2 benchmarks/python_floor.py

Rank 1 serves from a non-main thread (as an RPC layer must: its main thread belongs to the
user), rank 0 calls from its main thread. Each row is the smallest possible version of one
part of mpidag's path, measured side by side in one run (median of 7 repetitions of 20,000
calls, µs per round trip):

* ``raw blocking``: pickled ``comm.send``/``comm.recv`` of ``None`` with a blocking receive
  on both ends: the ``raw_mpi`` row of ``bench_rpc.py``. It busy-waits inside MPI, so an idle
  rank burns a whole core, and it cannot serve several callers or callers that never call;
* ``python polling``: a call ``(function, args, kwargs)`` pickled and sent, both ends
  polling with ``improbe`` in a Python loop (what a progress engine that must also stay idle
  cheaply does), the function looked up and run, its result pickled and sent back; nothing
  else: no futures, no timeouts, no tensors, no counters;
* ``python polling + yield``: the same with ``os.sched_yield()`` between empty polls.

The gap between ``raw blocking`` and ``python polling`` is what Python itself costs before a
line of an RPC layer's own bookkeeping runs; mpidag's no-op round trip is compared with it
in ``benchmarks/README.md``.
"""

from __future__ import annotations

import os
import pickle
import statistics
import sys
import threading
import time

from mpi4py import MPI

CALLS, REPS = 20_000, 7
STOP = b"stop"


def noop() -> None:
    """The remote function."""


def serve_polling(comm: MPI.Comm, yield_between: bool) -> None:
    """Rank 1's serving loop: improbe, receive, unpickle, call, pickle, send."""
    status = MPI.Status()
    while True:
        message = comm.improbe(MPI.ANY_SOURCE, 0, status)
        if message is None:
            if yield_between:
                os.sched_yield()
            continue
        frame = bytearray(status.Get_count())
        message.Recv(frame)
        if frame == STOP:
            return
        func, args, kwargs = pickle.loads(frame)
        comm.Send(pickle.dumps(func(*args, **kwargs), pickle.HIGHEST_PROTOCOL),
                  status.Get_source(), 0)


def call_polling(comm: MPI.Comm, status: MPI.Status, yield_between: bool) -> object:
    """Rank 0: one call in the polling style."""
    comm.Send(pickle.dumps((noop, (), {}), pickle.HIGHEST_PROTOCOL), 1, 0)
    while True:
        message = comm.improbe(1, 0, status)
        if message is not None:
            break
        if yield_between:
            os.sched_yield()
    frame = bytearray(status.Get_count())
    message.Recv(frame)
    return pickle.loads(frame)


def serve_blocking(comm: MPI.Comm) -> None:
    while comm.recv(source=0, tag=1) is not None:
        comm.send(None, dest=0, tag=1)


def timed(fn: object) -> float:
    samples = []
    for _ in range(REPS):
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        samples.append((time.perf_counter() - start) / CALLS * 1e6)
    return statistics.median(samples)


def main() -> int:
    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        if world.Get_rank() == 0:
            sys.stderr.write("python_floor.py needs exactly 2 MPI ranks\n")
        return 2
    comm = world.Dup()
    rank = comm.Get_rank()
    results = {}
    # raw blocking
    if rank == 1:
        server = threading.Thread(target=serve_blocking, args=(comm,))
        server.start()
        server.join()
    else:
        for _ in range(2000):
            comm.send(0, dest=1, tag=1)
            comm.recv(source=1, tag=1)

        def blocking() -> None:
            comm.send(0, dest=1, tag=1)
            comm.recv(source=1, tag=1)

        results["raw blocking"] = timed(blocking)
        comm.send(None, dest=1, tag=1)
    comm.Barrier()
    for yield_between in (False, True):
        name = "python polling + yield" if yield_between else "python polling"
        if rank == 1:
            server = threading.Thread(target=serve_polling, args=(comm, yield_between))
            server.start()
            server.join()
        else:
            status = MPI.Status()
            for _ in range(2000):
                call_polling(comm, status, yield_between)
            results[name] = timed(lambda s=status, y=yield_between: call_polling(comm, s, y))
            comm.Send(STOP, 1, 0)
        comm.Barrier()
    if rank == 0:
        for name, value in results.items():
            print(f"{name:<26}{value:8.2f} us per round trip")
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
