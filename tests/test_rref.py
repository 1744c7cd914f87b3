"""remote(), RRef and its owner/user protocol across 2 and 3 ranks."""

from __future__ import annotations

import gc
import random
import time

import pytest
import torch

import mpidag.rpc as rpc
from mpidag import testing
from mpidag.errors import RPCError
from tests import rref_funcs as rf

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(scope="module")
def world():
    rpc.init_rpc()
    from mpi4py import MPI

    class World:
        rank = MPI.COMM_WORLD.Get_rank()
        size = MPI.COMM_WORLD.Get_size()
        name = f"worker{rank}"
        next = f"worker{(rank + 1) % size}"
        prev = f"worker{(rank - 1) % size}"

    yield World
    rpc.shutdown()


def settle():
    """Collective: drop garbage and wait until no protocol message is in flight.

    Garbage cycles that hold RRefs (tracebacks, frames) are freed whenever the collector
    runs, also on pool threads, so collect and drain a few rounds on every rank.
    """
    from mpi4py import MPI

    for _ in range(10):
        found = gc.collect()
        testing.quiesce(60)
        if MPI.COMM_WORLD.allreduce(found) == 0:
            return


def assert_no_rrefs_anywhere(world):
    settle()
    for r in range(world.size):
        info = rpc.rpc_sync(r, rf.debug_info, timeout=30)
        if any(info[k] for k in ("num_owner_rrefs", "num_pending_users", "num_user_rrefs",
                                 "num_pending_children")):
            users = [rpc.rpc_sync(k, rf.user_records, timeout=30) for k in range(world.size)]
            owners = rpc.rpc_sync(r, rf.owner_records, timeout=30)
            holders = rpc.rpc_sync(r, rf.handle_holders, timeout=30)
            raise AssertionError(f"rank {r}: {info}; owns {owners}; users: {users}; {holders}")
    testing.quiesce(60)  # no rank may start the next test while others still look


def test_remote_and_to_here(world):
    rref = rpc.remote(world.next, torch.add, args=(torch.ones(2), 3), timeout=30)
    assert not rref.is_owner() or world.size == 1
    assert rref.owner() == rpc.get_worker_info(world.next)
    assert rref.owner_name() == world.next
    torch.testing.assert_close(rref.to_here(timeout=30), torch.full((2,), 4.0))
    # the owner's answer to remote() may arrive after the fetched value: wait for it
    deadline = time.monotonic() + 10
    while not rref.confirmed_by_owner() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert rref.confirmed_by_owner()
    del rref
    assert_no_rrefs_anywhere(world)


def test_local_rref_and_remote_to_self(world):
    value = rf.Tracked(f"local-{world.rank}")
    rref = rpc.RRef(value)
    assert rref.is_owner() and rref.confirmed_by_owner()
    assert rref.local_value() is value and rref.to_here() is value
    own = rpc.remote(world.name, torch.mul, args=(torch.ones(2), 5))
    assert own.is_owner()
    torch.testing.assert_close(own.to_here(), torch.full((2,), 5.0))
    del rref, own, value
    assert_no_rrefs_anywhere(world)


def test_local_value_on_a_user_is_an_error(world):
    rref = rpc.remote(world.next, rf.make_tracked, args=("x",))
    with pytest.raises(RPCError, match="non-owner") as info:
        rref.local_value()
    assert isinstance(info.value, RuntimeError)
    assert rref.rpc_sync(timeout=30).get_tag() == "x"
    del rref, info  # the traceback's frames hold the RRef too
    assert_no_rrefs_anywhere(world)


def test_forks_along_every_rank_and_back_to_the_owner(world):
    owner = world.next
    rref = rpc.remote(owner, rf.make_tracked, args=(f"chain-{world.rank}", torch.ones(3)))
    # through every other rank, ending at the owner itself
    others = [f"worker{(world.rank + k) % world.size}" for k in range(2, world.size + 1)]
    path = others + [owner]
    value, where, at_owner = rpc.rpc_sync(path[0], rf.forward_then_fetch,
                                          args=(rref, path[1:]), timeout=60)
    assert where == owner and at_owner
    assert value.tag == f"chain-{world.rank}" and torch.equal(value.payload, torch.ones(3))
    # an owner sends its own RRef to a user, which sends it back
    mine = rpc.rpc_sync(world.next, rf.make_rref_here, args=(f"theirs-{world.rank}",),
                        timeout=30)
    assert mine.owner_name() == world.next and not mine.is_owner()
    assert rpc.rpc_sync(world.next, rf.owner_side_value_is_local, args=(mine,),
                        timeout=30) == (True, f"theirs-{world.rank}")
    del rref, mine, value
    assert_no_rrefs_anywhere(world)


def test_owner_frees_the_value_when_the_last_user_is_gone(world):
    tag = f"freed-{world.rank}"
    rref = rpc.remote(world.next, rf.make_tracked, args=(tag,))
    assert rref.rpc_sync(timeout=30).get_tag() == tag
    # a second user holds a fork on another rank for a while
    rpc.rpc_sync(world.prev, rf.hold, args=(rref,), timeout=30)
    del rref
    settle()
    assert tag not in rpc.rpc_sync(world.next, rf.freed_tags, timeout=30)  # still held
    rpc.rpc_sync(world.prev, rf.drop_held, timeout=30)
    settle()
    assert tag in rpc.rpc_sync(world.next, rf.freed_tags, timeout=30)
    assert_no_rrefs_anywhere(world)


def test_proxies(world):
    rref = rpc.remote(world.next, rf.make_tracked, args=("p", torch.arange(4.0)))
    torch.testing.assert_close(rref.rpc_sync(timeout=30).scaled(2), torch.arange(4.0) * 2)
    fut = rref.rpc_async(timeout=30).scaled(3)
    torch.testing.assert_close(fut.wait(), torch.arange(4.0) * 3)
    sub = rref.remote(timeout=30).scaled(4)
    assert sub.owner_name() == world.next
    torch.testing.assert_close(sub.to_here(timeout=30), torch.arange(4.0) * 4)
    with pytest.raises(AttributeError, match="no method 'nope'"):
        rref.rpc_sync(timeout=30).nope()
    del rref, sub, fut
    gc.collect()
    assert_no_rrefs_anywhere(world)


def test_remote_of_a_function_that_raises(world):
    rref = rpc.remote(world.next, rf.fail_creation, args=("missing key",))
    with pytest.raises(KeyError, match="missing key"):
        rref.to_here(timeout=30)
    with pytest.raises(KeyError, match="missing key"):
        rref.rpc_sync(timeout=30).get_tag()
    with pytest.raises(KeyError):
        rref.to_here(timeout=30)  # again: the error stays
    del rref
    assert_no_rrefs_anywhere(world)


def test_bad_rrefs(world):
    with pytest.raises(ValueError, match="unknown destination rank 99"):
        rpc.remote(99, rf.echo, args=(1,))
    import pickle

    rref = rpc.RRef(1)
    with pytest.raises(RPCError, match="only be pickled as an argument"):
        pickle.dumps(rref)
    del rref
    assert_no_rrefs_anywhere(world)


def _storm(world, n_ops: int, seed: int) -> None:
    rng = random.Random(seed)
    live: list = []
    for i in range(n_ops):
        op = rng.random()
        if op < 0.3 or not live:
            to = rng.randrange(world.size)
            live.append(rpc.remote(to, rf.echo, args=(i,)))
        elif op < 0.55:
            r = rng.choice(live)
            if isinstance(r, torch.futures.Future):
                r = r.wait()
            fut = rpc.rpc_async(rng.randrange(world.size), rf.echo, args=(r,))
            live.append(fut)  # the returned RRef comes back as yet another fork
        elif op < 0.6:
            live.append(rpc.RRef(i))
        else:
            live.pop(rng.randrange(len(live)))
        if i % 500 == 499:
            # everything still referenced must still be fetchable (no early free)
            for item in live[-20:]:
                r = item.wait() if isinstance(item, torch.futures.Future) else item
                r.to_here(timeout=60)
    futs = [x for x in live if isinstance(x, torch.futures.Future)]
    torch.futures.wait_all(futs)
    del live, futs


def test_storm_of_creates_forks_and_deletes_leaves_nothing(world):
    _storm(world, 10_000 // world.size, seed=world.rank)
    assert_no_rrefs_anywhere(world)


def test_delayed_and_reordered_control_messages_keep_g1_and_g2(world):
    with testing.delayed_control_messages(max_delay=0.005, seed=world.rank) as delays:
        _storm(world, 1500, seed=100 + world.rank)
        # chains of forks while every protocol message arrives late and out of order
        for k in range(20):
            rref = rpc.remote(world.next, rf.make_tracked, args=(f"slow-{world.rank}-{k}",))
            value, _, _ = rpc.rpc_sync(world.prev, rf.forward_then_fetch,
                                       args=(rref, [world.next, world.name]), timeout=60)
            assert value.tag == f"slow-{world.rank}-{k}"
            del rref, value
        settle()
    assert delays.delayed > 0
    assert_no_rrefs_anywhere(world)
