"""The Python work of one call, both ends, with no MPI, no threads and no machine noise.

Two ranks of an in-process world (:class:`mpidag.transport.inproc.InProcWorld`) live in this
one thread; each call is driven by hand through the real agent, framing, autograd recording
and RRef code: the caller's agent sends, the callee's transport polls and its agent serves,
the caller's transport polls and its agent completes the call. What is timed is therefore
exactly the CPU cost of mpidag's Python on both ends of a round trip (plus the in-process
queues, a few hundred ns), without the wire, the polling loops or thread hand-offs, and it
repeats to within a few percent on a noisy VM, unlike the two-rank benchmarks::

    python benchmarks/inproc_cost.py              # table: us of Python per round trip
    python benchmarks/inproc_cost.py --profile    # plus a cProfile of the 1 KiB echo
    python benchmarks/inproc_cost.py --parts      # plus the recording's parts (below)
    python benchmarks/inproc_cost.py --instructions   # instructions per round trip instead

Rows: a no-op ``rpc_sync``, a 1 KiB tensor echo, and an ``rpc_sync`` of two tensors that
require grad inside a distributed autograd context (recording the send and recv functions
on both ends, the context created on the callee and released on both ends), then what that
row is made of: the same call without grad and without a context, and without grad in a
context (the difference to the row is the recording of the four functions), and the call
with and without grad in a context that stays open for 100 calls (both ranks have it: one
context made and released per 100 calls, as for the calls after a training step's first).
Each row is the best of 5 repetitions of 5,000-20,000 calls. The last row is a whole
iteration of the design document's example (``rpc_sync`` of its ``my_add``, here
:func:`add`, in a context, the loss, ``backward()`` across both ranks, the gradients, the
context's release): the
distributed engine's bookkeeping (the plans, events, gradient messages and the end of the
pass on both ranks), its waits driven in this thread (:meth:`TwoRanks.drive_waits`), its
gradients checked against local autograd first; µs per iteration, the best of 5 of 2,000.

``--instructions`` counts instead of timing: each of the first five rows and the last runs
in a process of its own under ``valgrind --tool=callgrind``, collecting only inside the
loop of its calls (the loop runs in ``itertools.starmap``, whose C function toggles the
collection), and prints the instructions per round trip (per iteration). The count is the
same whatever else the machine does (the µs of the recording row went from 29 to 95
between hours for one tree), so it compares two trees in any hour; it does not see cache
misses. ~2 minutes a row.

``--parts`` times the distributed autograd hooks that a call in an open context with grad
runs (each hook timed around its own body, so a hook's time includes the hooks it calls:
``sent`` includes ``prepare_send`` and the send function's ``prepare``, ``received``
includes ``record_recv``; ``received`` runs twice a call, for the arguments on the callee
and for the result on the caller), one hook at a time, the best of 5 repetitions.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import cProfile
import itertools
import os
import pstats
import re
import shutil
import subprocess
import sys
import tempfile
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mpidag._config import Config  # noqa: E402 - after the path set-up
from mpidag._runtime import Runtime  # noqa: E402
from mpidag.agent.options import MPIRpcBackendOptions  # noqa: E402
from mpidag.transport.inproc import InProcWorld  # noqa: E402

#: calls made in one open context before it is released and a new one made
CALLS_PER_CONTEXT = 100


def noop() -> None:
    """The no-op remote function."""


def identity(x: torch.Tensor) -> torch.Tensor:
    """The echo remote function."""
    return x


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The remote function of the autograd rows (the design document's ``my_add``)."""
    return torch.add(a, b)


class TwoRanks:
    """Two runtimes of one in-process world, driven by hand in the calling thread.

    Example::

        >>> ranks = TwoRanks()
        >>> ranks.call(noop, ())          # one whole round trip, both ends' Python
    """

    def __init__(self) -> None:
        world = InProcWorld(2)
        options = MPIRpcBackendOptions(num_worker_threads=1, rpc_timeout=60)
        config = Config(gc_freeze=False)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # connect is collective
            self.runtimes = list(pool.map(
                lambda r: Runtime.connect(world.transports[r], options=options, config=config),
                range(2)))
        self.world, self.transports = world, world.transports
        self.agents = [runtime.agent for runtime in self.runtimes]
        self.contexts = self.runtimes[0].autograd.container
        self._open_context: Any = None
        self._open_calls = 0

    def drain(self) -> int:
        """Deliver and serve every queued message, on both ranks, until none is left;
        returns how many there were."""
        return self.world.deliver_all([agent.dispatch for agent in self.agents])

    def call(self, func: Callable, args: tuple) -> None:
        """One ``rpc_sync``-shaped call from rank 0 to rank 1 (no future, as rpc_sync)."""
        self.agents[0].calls.send_call(1, func, args, {}, 60, True, False)
        self.drain()

    def call_in_context(self, func: Callable, args: tuple) -> None:
        """One call inside a new distributed autograd context, which is then released."""
        contexts = self.contexts
        ctx = contexts.new_context()
        previous = contexts.enter(ctx)
        try:
            self.call(func, args)
        finally:
            contexts.leave(previous)
        contexts.release(ctx)
        self.drain()

    def call_in_open_context(self, func: Callable, args: tuple) -> None:
        """One call inside a context that stays open for :data:`CALLS_PER_CONTEXT` calls (both
        ranks have it after its first): what a call after a training step's first costs.
        The context is renewed that often because its records of every call stay until its
        release, and thousands of them make the garbage collector's passes the cost."""
        contexts = self.contexts
        if self._open_calls % CALLS_PER_CONTEXT == 0:
            if self._open_context is not None:
                contexts.release(self._open_context)
                self.drain()
            self._open_context = contexts.new_context()
        self._open_calls += 1
        previous = contexts.enter(self._open_context)
        try:
            self.call(func, args)
        finally:
            contexts.leave(previous)

    def drive_waits(self) -> None:
        """Make every wait of both agents' engines (``rpc_sync``'s, ``backward()``'s for the
        end of its pass) drain both ranks' queues in this thread until it is over, so that a
        call that waits inside the engine, such as a distributed backward pass, runs here
        too: an instance attribute over the engine's ``wait_until``, as nothing else
        leads in this harness."""
        def drained(done: Callable[[], bool], deadline: float | None) -> bool:
            while not done():
                if not self.drain():
                    raise RuntimeError("a wait of the harness can never end: no message "
                                       "is queued on either rank")
            return True

        for agent in self.agents:
            agent.engine.wait_until = drained

    def backward_example(self, t1: torch.Tensor, t2: torch.Tensor, t4: torch.Tensor
                         ) -> dict[torch.Tensor, torch.Tensor]:
        """One iteration of the design document's example (needs :meth:`drive_waits`):
        ``t3 = rpc_sync(worker1, add, (t1, t2))``, ``loss = (t3 * t4).sum()``, the
        distributed backward pass from ``loss``, its gradients, the context's release on
        both ranks; returns the gradients."""
        contexts = self.contexts
        ctx = contexts.new_context()
        previous = contexts.enter(ctx)
        try:
            t3 = self.agents[0].call_sync(1, add, (t1, t2), {}, 60)
            loss = (t3 * t4).sum()
            self.runtimes[0].autograd.backward(ctx.context_id, [loss])
            grads = ctx.gradients.snapshot()
        finally:
            contexts.leave(previous)
        contexts.release(ctx)
        self.drain()
        return grads

    def close(self) -> None:
        """Release the transports (the runtimes never started serving threads)."""
        for transport in self.transports:
            transport.close(collective=False)


#: the hooks ``--parts`` times: (class, method name) of the recording and its callers
PARTS = [("ContextContainer", "outgoing"), ("ContextContainer", "sent"),
         ("ContextContainer", "prepare_send"), ("SendFunction", "prepare"),
         ("ContextContainer", "record_send"), ("ContextContainer", "received"),
         ("ContextContainer", "record_recv"), ("ContextContainer", "serving"),
         ("ContextContainer", "served"), ("ContextContainer", "replying")]


def recording_parts(ranks: TwoRanks, args: tuple, calls: int = 5_000) -> None:
    """Print the time of each hook of :data:`PARTS` per call in an open context: one hook
    wrapped with a timer at a time (wrapping them all at once made the call 50 % slower and
    its parts unstable), the best of 5 repetitions, the method restored after."""
    import time

    from mpidag.dist_autograd import context as context_module
    # the container's own class: a compiled one's hooks are its C++ first base's
    # (ContextRecorder), wrapped here in its subclass and unwrapped after
    classes = {"ContextContainer": type(ranks.contexts),
               "SendFunction": context_module.SendFunction}
    print("\nrecording's parts (us per call in an open context, with grad; a hook's time "
          "includes the hooks it calls; '-': not called, the C++ hooks do its work):")
    for cls_name, name in PARTS:
        cls = classes[cls_name]
        own = cls.__dict__.get(name)
        method = getattr(cls, name) if own is None else own
        spent = [0]

        def timed(*a: Any, _method: Callable = method, _spent: list = spent, **k: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return _method(*a, **k)
            finally:
                _spent[0] += time.perf_counter_ns() - start

        setattr(cls, name, timed)
        try:
            for _ in range(calls // 10):
                ranks.call_in_open_context(add, args)
            best = None
            for _ in range(5):
                spent[0] = 0
                for _ in range(calls):
                    ranks.call_in_open_context(add, args)
                best = spent[0] if best is None else min(best, spent[0])
        finally:
            if own is None:
                delattr(cls, name)
            else:
                setattr(cls, name, own)
        part = f"{best / calls / 1e3:>8.2f}" if best else f"{'-':>8}"
        print(f"  {cls_name + '.' + name:<36}{part}")


#: the design document's example, forward, backward and release (its own row of both tables)
BACKWARD_ROW = "the design document's example: forward, backward, release"


def example_leaves() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The leaves ``t1``, ``t2``, ``t4`` of :data:`BACKWARD_ROW`."""
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.rand(3, 3, generator=gen).requires_grad_() for _ in range(3))


def checked_example(ranks: TwoRanks) -> Callable[[], None]:
    """:data:`BACKWARD_ROW`'s iteration, after one whose gradients were checked against
    local autograd (a harness that lost a gradient would time nothing)."""
    t1, t2, t4 = leaves = example_leaves()
    ranks.drive_waits()
    grads = ranks.backward_example(t1, t2, t4)
    expected = torch.autograd.grad(((t1 + t2) * t4).sum(), leaves)
    for leaf, want in zip(leaves, expected, strict=True):
        if not torch.equal(grads[leaf], want):
            raise SystemExit(f"the distributed backward gave {grads[leaf]}, local autograd "
                             f"{want}")
    return lambda: ranks.backward_example(t1, t2, t4)


#: the rows ``--instructions`` counts, and how many calls each: the first rows of the
#: table, then what the recording row is made of (the call alone; the call and the context)
COUNTED_ROWS = {"no-op rpc_sync": 2_000, "1 KiB tensor echo": 2_000,
                "2 tensors requiring grad, in an autograd context": 500,
                "the same call, tensors without grad, no context": 500,
                "the same call, tensors without grad, in a context": 500,
                BACKWARD_ROW: 300}


def row_calls(ranks: TwoRanks) -> dict[str, Callable[[], None]]:
    """The calls of :data:`COUNTED_ROWS` but :data:`BACKWARD_ROW` (:func:`checked_example`)."""
    x = torch.ones(256)
    a, b = torch.rand(3, 3, requires_grad=True), torch.rand(3, 3, requires_grad=True)
    an, bn = a.detach(), b.detach()
    return {"no-op rpc_sync": lambda: ranks.call(noop, ()),
            "1 KiB tensor echo": lambda: ranks.call(identity, (x,)),
            "2 tensors requiring grad, in an autograd context":
                lambda: ranks.call_in_context(add, (a, b)),
            "the same call, tensors without grad, no context":
                lambda: ranks.call(add, (an, bn)),
            "the same call, tensors without grad, in a context":
                lambda: ranks.call_in_context(add, (an, bn))}


def run_counted(row: str, calls: int) -> None:
    """The loop ``--instructions`` counts: ``calls`` calls of ``row`` inside
    ``itertools.starmap`` (after 200 not counted)."""
    torch.set_num_threads(1)
    ranks = TwoRanks()  # (the backward row's waits are driven only where it is counted)
    fn = checked_example(ranks) if row == BACKWARD_ROW else row_calls(ranks)[row]
    for _ in range(200):
        fn()
    collections.deque(itertools.starmap(fn, itertools.repeat((), calls)), 0)
    ranks.close()


def count_instructions(row: str, calls: int) -> float:
    """Instructions per round trip of ``row``, counted by callgrind in a child process."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("--instructions needs valgrind on PATH (Debian: apt-get install "
                         "valgrind)")
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run(
            [valgrind, "--tool=callgrind", "--collect-atstart=no",
             "--toggle-collect=starmap_next", f"--callgrind-out-file={scratch}/out",
             sys.executable, __file__, "--counted-row", row, "--calls", str(calls)],
            capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"},
            check=False)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"callgrind of {row!r} failed ({done.returncode}):\n"
                         f"{done.stderr[-2000:]}")
    return int(found.group(1)) / calls


def best_us(fn: Callable[[], None], number: int) -> float:
    """Best of 5 repetitions, microseconds per call."""
    for _ in range(number // 10):
        fn()
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--profile", action="store_true",
                        help="also print a cProfile of the 1 KiB echo (sorted by own time)")
    parser.add_argument("--parts", action="store_true",
                        help="also time the recording's hooks (see the module's doc)")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions per round trip under callgrind instead")
    parser.add_argument("--counted-row", help=argparse.SUPPRESS)  # (--instructions' child)
    parser.add_argument("--calls", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.counted_row:
        run_counted(args.counted_row, args.calls)
        return 0
    if args.instructions:
        print(f"{'row':<52}{'instructions per round trip (both ends)':>42}")
        for row, calls in COUNTED_ROWS.items():
            print(f"{row:<52}{count_instructions(row, calls):>42,.0f}", flush=True)
        return 0
    torch.set_num_threads(1)
    ranks = TwoRanks()
    x = torch.ones(256)
    a, b = torch.rand(3, 3, requires_grad=True), torch.rand(3, 3, requires_grad=True)
    an, bn = a.detach(), b.detach()
    rows = [
        ("no-op rpc_sync", lambda: ranks.call(noop, ()), 20_000),
        ("1 KiB tensor echo", lambda: ranks.call(identity, (x,)), 20_000),
        ("2 tensors requiring grad, in an autograd context",
         lambda: ranks.call_in_context(add, (a, b)), 5_000),
        # what that row is made of: the call alone, and the context without recording
        ("  the same call, tensors without grad, no context",
         lambda: ranks.call(add, (an, bn)), 5_000),
        ("  the same call, tensors without grad, in a context",
         lambda: ranks.call_in_context(add, (an, bn)), 5_000),
    ]
    # and without the context's making and release: calls in a context left open (run after
    # the rows above: while a rank has a context, all its calls take the observed path)
    open_rows = [
        ("  2 tensors requiring grad, in an open context",
         lambda: ranks.call_in_open_context(add, (a, b)), 5_000),
        ("  tensors without grad, in an open context",
         lambda: ranks.call_in_open_context(add, (an, bn)), 5_000),
    ]
    print(f"{'row':<52}{'us of Python per round trip (both ends)':>42}")
    for name, fn, number in rows:
        print(f"{name:<52}{best_us(fn, number):>42.1f}")
    for name, fn, number in open_rows:
        print(f"{name:<52}{best_us(fn, number):>42.1f}")
    print(f"{BACKWARD_ROW:<60}{best_us(checked_example(ranks), 2_000):>34.1f}")
    if args.parts:
        recording_parts(ranks, (a, b))
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(10_000):
            ranks.call(identity, (x,))
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    ranks.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
