"""Functions the RRef tests run remotely (module level: they pickle by reference)."""

from __future__ import annotations

import gc

import torch

import mpidag.rpc as rpc
from mpidag.rpc import api

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


def debug_info():
    return api._get_debug_info()


def fetch(rref):
    return rref.to_here(timeout=30)


def forward_then_fetch(rref, via_ranks):
    """Pass ``rref`` along ``via_ranks`` (each hop a nested rpc), fetch it at the end."""
    if not via_ranks:
        return rref.to_here(timeout=30), rpc.get_worker_info().name, rref.is_owner()
    return rpc.rpc_sync(via_ranks[0], forward_then_fetch, args=(rref, via_ranks[1:]),
                        timeout=60)


def hold(rref):
    HELD.append(rref)
    return len(HELD)


def drop_held():
    HELD.clear()
    gc.collect()


HELD: list = []


def echo(x):
    return x


def fail_creation(msg):
    raise KeyError(msg)


def owner_side_value_is_local(rref):
    return rref.is_owner(), rref.local_value().tag


def make_rref_here(tag):
    """Runs on one rank, returns an RRef owned by that rank to the caller."""
    return rpc.RRef(Tracked(tag, torch.arange(3.0)))


def owner_records():
    from mpidag.rref.context import RRefContext

    gc.collect()
    ctx = RRefContext.of(api.current_agent())
    ctx.process_releases()
    return [(hex(r.rref_id), sorted(map(hex, r.forks)), sorted(map(hex, r.pending)),
             sorted(map(hex, r.tombstones)), r.local_handles, r.created)
            for r in ctx.owners.values()]


def user_records():
    from mpidag.rref.context import RRefContext

    gc.collect()
    ctx = RRefContext.of(api.current_agent())
    ctx.process_releases()
    return [(hex(r.rref_id), hex(r.fork_id), r.confirmed, sorted(map(hex, r.pending_children)),
             r.released, r.delete_sent) for r in ctx.users.values()]


def handle_holders():
    """Debug aid: for each live RRef handle, the types of the objects referring to it."""
    from mpidag.rref.rref import RRef

    gc.collect()
    out = []
    for obj in gc.get_objects():
        if isinstance(obj, RRef):
            refs = []
            for r in gc.get_referrers(obj):
                if type(r).__name__ == "list" and len(r) > 1000:
                    continue
                name = type(r).__name__
                if name == "frame":
                    name += ":" + r.f_code.co_name + ":" + str(r.f_lineno)
                elif name == "cell":
                    name += ":" + str([type(x).__name__ for x in gc.get_referrers(r)][:3])
                refs.append(name)
            in_futures = []
            for f in gc.get_objects():
                if isinstance(f, torch._C.Future) and f.done():
                    try:
                        v = f.value()
                    except Exception:
                        continue
                    items = v if isinstance(v, (tuple, list)) else [v]
                    if any(x is obj for x in items):
                        in_futures.append((type(f).__name__, len(gc.get_referrers(f))))
            out.append((hex(obj._rref_id), refs[:6], in_futures))
    return out
