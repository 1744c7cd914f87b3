"""The names of called functions and of recorded messages: cached only where that keeps
nothing alive, and computed once.

``describe`` names every call in an autograd context four times (both ends' send and recv
functions); it keeps the names of module-level functions and builtins, and must never keep a
lambda, a nested function or a bound method (and what they hold) alive. A recv record's
name may be given as a callable (a call's name before its arguments are unpickled), called
at most once, when first read.
"""

from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch

from mpidag.agent import fastpath, handlers
from mpidag.agent.handlers import Handler, describe
from mpidag.dist_autograd.context import LiveCount, RecvRecord, SendFunction, live_count


def module_level(x: torch.Tensor) -> torch.Tensor:
    return x


def test_module_functions_and_builtins_are_named_once():
    assert describe(torch.add) == "torch.add"
    assert describe(module_level) == "tests.test_names.module_level"
    assert describe(print) == "builtins.print"
    for func in (torch.add, module_level, print):
        assert handlers.DESCRIBED[func] is describe(func)  # kept: the same string again


def test_what_may_hold_something_is_named_every_time_and_not_kept():
    class Holder:
        def method(self) -> None:
            pass

    def nested() -> None:
        pass

    tensor = torch.ones(3)
    holder = Holder()
    funcs = {
        "lambda": lambda: None,
        "nested": nested,
        "tensor method": tensor.add,
        "bound method": holder.method,
        "partial": functools.partial(module_level, tensor),
        "handler": Handler("rref.fetch", print),
    }
    for what, func in funcs.items():
        name = describe(func)
        assert name and describe(func) == name, what
        assert func not in handlers.DESCRIBED, what
    kept = weakref.ref(tensor)
    del funcs, tensor
    gc.collect()
    assert kept() is None  # no name kept the tensor alive through its bound method


def test_unhashable_callables_are_named():
    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self) -> None:
            pass

    assert "Unhashable" in describe(Unhashable())


def test_the_name_cache_starts_over_when_full(monkeypatch):
    monkeypatch.setattr(handlers, "DESCRIBED", {})
    monkeypatch.setattr(handlers, "_DESCRIBED_MAX", 2)
    describe(torch.add)
    describe(torch.sub)
    assert len(handlers.DESCRIBED) == 2
    describe(torch.mul)  # full: cleared, then this one kept
    assert list(handlers.DESCRIBED) == [torch.mul]


def test_a_recv_records_name_is_asked_for_once_when_first_read():
    asked = []

    def name() -> str:
        asked.append(1)
        return "the arguments of a call from worker1"

    record = RecvRecord(1, 2, 1, 1, name)
    assert asked == []  # not at recording
    assert record.what == "the arguments of a call from worker1"
    assert record.what == "the arguments of a call from worker1"
    assert asked == [1]
    assert "worker1" in repr(record)
    record.what = "the arguments of torch.add from worker1"  # what serving sets
    assert record.what == "the arguments of torch.add from worker1" and asked == [1]
    unnamed = RecvRecord(1, 3, 1, 1, name)
    unnamed.what = "set before read"
    assert unnamed.what == "set before read" and asked == [1]  # never asked


@pytest.mark.parametrize("compiled", [True, False], ids=["c-tickets", "python-tickets"])
def test_live_counts_count_records_while_they_live(compiled):
    count = live_count(compiled)
    if compiled and fastpath.compiled_module() is None:
        pytest.skip("_mpidag_fastpath is not built here")
    assert isinstance(count, LiveCount) is not compiled
    records = [RecvRecord(1, i, 1, 1, "x", count) for i in range(5)]
    sends = [SendFunction(i, 1, [], "y", count) for i in range(3)]
    assert count.live == 8
    del records[:3], sends[0]
    assert count.live == 4
    cycle = [RecvRecord(1, 9, 1, 1, "z", count)]
    cycle.append(cycle)  # freed by the collector, not by its reference count
    del cycle
    assert count.live == 5
    gc.collect()
    assert count.live == 4
    del records, sends
    assert count.live == 0


def test_the_python_counts_count_without_a_python_frame_of_their_own():
    count = LiveCount()
    # the itertools counters' own __next__ (a C method), not a Python function
    assert type(count.made) is type(iter(()).__next__) is type(count.freed)
