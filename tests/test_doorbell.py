"""The progress engine's doorbell (mpidag/transport/doorbell.py and doorbell.h): where user
threads wait while another thread leads, in Python and in C with the GIL released."""

from __future__ import annotations

import threading
import time

import pytest

from mpidag.agent import fastpath
from mpidag.transport import progress
from mpidag.transport.doorbell import Doorbell
from mpidag.transport.progress import ProgressEngine

#: how long a test waits for a thread that should finish at once (a hang fails, not a
#: slow machine)
HANG = 30.0

KINDS = ["Python", "C"]


def new_bell(kind: str):
    if kind == "Python":
        return Doorbell()
    module = fastpath.compiled_module()
    if module is None:
        pytest.skip(f"_mpidag_fastpath is not built: {fastpath.problem()}")
    return module.Doorbell()


def until(condition, what: str) -> None:
    deadline = time.monotonic() + HANG
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


@pytest.mark.parametrize("kind", KINDS)
def test_a_wait_returns_at_once_when_the_bell_rang_since_the_generation_was_read(kind):
    bell = new_bell(kind)
    seen = bell.generation
    assert seen == 0
    bell.ring()
    bell.ring()
    assert bell.wait(seen, HANG) == 2
    assert bell.wait(seen, HANG, 1_000_000) == 2  # nor does it yield first
    assert bell.generation == 2 and bell.sleepers == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_wait_nobody_rings_ends_with_its_timeout_and_the_same_generation(kind):
    bell = new_bell(kind)
    bell.ring()
    assert bell.wait(1, 0.01) == 1
    assert bell.wait(1, 0.0, 5) == 1  # yields five times, sleeps not at all
    assert bell.wait(1, -1.0) == 1
    assert bell.sleepers == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_timeout_that_is_not_a_number_is_refused(kind):
    bell = new_bell(kind)
    with pytest.raises(ValueError, match="timeout must be a number of seconds, got nan"):
        bell.wait(0, float("nan"))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spins", [0, 2_000_000])
def test_a_thread_in_wait_is_woken_by_a_ring_from_another_python_thread(kind, spins):
    """The waiter sleeps (``spins=0``) or yields the core for a long time (two million
    yields); either way the ringing thread runs Python meanwhile, so the C wait holds no
    GIL (else the ring would come only after the wait ended, and it would return the
    generation it was given)."""
    bell = new_bell(kind)
    seen = bell.generation
    started = threading.Event()
    got: list[int] = []

    def waiter():
        started.set()
        got.append(bell.wait(seen, HANG, spins))

    thread = threading.Thread(target=waiter)
    thread.start()
    assert started.wait(HANG)
    if spins == 0:
        until(lambda: bell.sleepers == 1, "the waiter sleeps")
    bell.ring()
    thread.join(HANG)
    assert not thread.is_alive() and got == [seen + 1]
    assert bell.sleepers == 0


@pytest.mark.parametrize("kind", KINDS)
def test_every_sleeper_wakes_on_one_ring(kind):
    bell = new_bell(kind)
    got: list[int] = []
    threads = [threading.Thread(target=lambda: got.append(bell.wait(0, HANG)))
               for _ in range(3)]
    for thread in threads:
        thread.start()
    until(lambda: bell.sleepers == 3, "three sleepers")
    bell.ring()
    for thread in threads:
        thread.join(HANG)
    assert got == [1, 1, 1] and bell.sleepers == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_user_thread_waiting_while_another_leads_is_woken_by_the_completion(kind,
                                                                             monkeypatch):
    """A pool thread leads (held inside its poll); a user thread waits for its call and
    sleeps on the engine's doorbell; another thread completes the call and calls
    ``wake_waiters``, as the Python path's completion does. With the waiter's sleeps made
    an hour long, only the ring can end its wait while the leader still polls."""
    monkeypatch.setattr(progress, "USER_WAIT", 3600.0)
    bell = new_bell(kind)
    in_poll, release_poll = threading.Event(), threading.Event()

    def poll():
        in_poll.set()
        release_poll.wait(HANG)
        return None

    engine = ProgressEngine(poll, lambda env: None, lambda: None, num_threads=1,
                            doorbell=bell)
    assert engine.doorbell is bell
    engine.start()
    done = threading.Event()
    result: list[bool] = []
    try:
        assert in_poll.wait(HANG)
        waiter = threading.Thread(target=lambda: result.append(
            engine.wait_until(done.is_set, deadline=None)))
        waiter.start()
        until(lambda: bell.sleepers == 1, "the user thread sleeps on the doorbell")
        assert engine.snapshot().waiting_user_threads == 1
        done.set()
        engine.wake_waiters()
        waiter.join(HANG)
        assert not waiter.is_alive() and result == [True]
        assert engine.snapshot().waiting_user_threads == 0
    finally:
        release_poll.set()
        engine.stop()


@pytest.mark.parametrize("kind", KINDS)
def test_a_vacant_leadership_goes_to_the_user_thread_asleep_on_the_doorbell(kind,
                                                                          monkeypatch):
    """The pool leader hands over to a waiting user thread (it vacates and rings): the user
    thread, asleep with hour-long sleeps, wakes, leads and polls until its reply arrives."""
    monkeypatch.setattr(progress, "USER_WAIT", 3600.0)
    bell = new_bell(kind)
    hold, release = threading.Event(), threading.Event()
    hold.set()
    polls_by: set[str] = set()
    replied = threading.Event()

    def poll():
        polls_by.add(threading.current_thread().name)
        if hold.is_set() and threading.current_thread().name.endswith("pool-0"):
            release.wait(HANG)  # keep the pool leader here until the user thread sleeps
        if threading.current_thread().name == "user" and polls_by:
            replied.set()  # the user thread polls: its reply "arrives"
        return None

    engine = ProgressEngine(poll, lambda env: None, lambda: None, num_threads=1,
                            doorbell=bell, name="bell-test")
    engine.start()
    result: list[bool] = []
    try:
        until(lambda: "bell-test-pool-0" in polls_by, "the pool thread leads")
        waiter = threading.Thread(target=lambda: result.append(
            engine.wait_until(replied.is_set, deadline=None)), name="user")
        waiter.start()
        until(lambda: bell.sleepers == 1, "the user thread sleeps on the doorbell")
        hold.clear()
        release.set()  # the leader sees the waiting user thread and hands over
        waiter.join(HANG)
        assert not waiter.is_alive() and result == [True]
        assert "user" in polls_by
    finally:
        release.set()
        engine.stop()


def test_the_compiled_agent_waits_on_the_c_doorbell_and_the_python_one_on_python():
    from tests.test_fastpath import HandDriven

    module = fastpath.compiled_module()
    if module is None:
        pytest.skip(f"_mpidag_fastpath is not built: {fastpath.problem()}")
    for compiled, kind in ((True, module.Doorbell), (False, Doorbell)):
        ranks = HandDriven(compiled=compiled)
        try:
            assert all(type(agent.engine.doorbell) is kind for agent in ranks.agents)
        finally:
            ranks.close()
