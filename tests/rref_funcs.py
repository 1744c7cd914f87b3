"""Functions the RRef tests run remotely (module level: they pickle by reference)."""

from __future__ import annotations

import gc

import torch

import mpidag.rpc as rpc

FREED: list[str] = []


class Tracked:
    """A value that records its own destruction on its owner."""

    def __init__(self, tag: str, payload=None) -> None:
        self.tag = tag
        self.payload = payload

    def __del__(self) -> None:
        FREED.append(self.tag)

    def get_tag(self) -> str:
        return self.tag

    def scaled(self, k):
        return self.payload * k


def make_tracked(tag, payload=None):
    return Tracked(tag, payload)


def freed_tags():
    gc.collect()
    return list(FREED)


def forward_then_fetch(rref, via_ranks):
    """Pass ``rref`` along ``via_ranks`` (each hop a nested rpc), fetch it at the end."""
    if not via_ranks:
        return rref.to_here(timeout=30), rpc.get_worker_info().name, rref.is_owner()
    return rpc.rpc_sync(via_ranks[0], forward_then_fetch, args=(rref, via_ranks[1:]),
                        timeout=60)


def _held() -> list:
    """This rank's held RRefs (per rank: in-process ranks share this module)."""
    from tests.contract.harness import rank_state

    return rank_state("rref_funcs.held", list)


def hold(rref):
    _held().append(rref)
    return len(_held())


def drop_held():
    _held().clear()
    gc.collect()


def echo(x):
    return x


def fail_creation(msg):
    raise KeyError(msg)


def owner_side_value_is_local(rref):
    return rref.is_owner(), rref.local_value().tag


def make_rref_here(tag):
    """Runs on one rank, returns an RRef owned by that rank to the caller."""
    return rpc.RRef(Tracked(tag, torch.arange(3.0)))



class AsyncAdder:
    """torch's AsyncExecutionClass: ``@rpc.functions.async_execution`` methods of every
    kind, called through RRef proxies; each adds ``x + y`` on ``to`` and then ``z``."""

    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset

    @staticmethod
    @rpc.functions.async_execution
    def static_add(to, x, y, z):
        return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)

    @classmethod
    @rpc.functions.async_execution
    def class_add(cls, to, x, y, z):
        ret = torch.futures.Future()
        rpc.rpc_async(to, torch.add, args=(x, y)).then(
            lambda fut: ret.set_result(fut.wait() + z))
        return ret

    @rpc.functions.async_execution
    def bound_add(self, to, x, y, z):
        return rpc.rpc_async(to, torch.add, args=(x, y)).then(
            lambda fut: fut.wait() + z + self.offset)

    @rpc.functions.async_execution
    def not_a_future(self):
        return 3

    @rpc.functions.async_execution
    def failing(self, to, msg):
        return rpc.rpc_async(to, fail_creation, args=(msg,))

    def plain(self, x):
        return x + self.offset


def confirmed_and_value(rref):
    """torch's check_rref_confirmed, and the value through the same user RRef."""
    return rref.confirmed_by_owner(), rref.to_here().sum().item()
