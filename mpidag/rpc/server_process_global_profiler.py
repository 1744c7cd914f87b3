"""``_server_process_global_profile``: profile every RPC this process serves, as torch's.

Example::

    >>> x, y = torch.ones(2), torch.ones(2)
    >>> outer = rpc.remote("worker1", rpc._server_process_global_profile)
    >>> profile = outer.rpc_sync().__enter__()      # worker1 profiles what it serves
    >>> rpc.rpc_sync("worker1", torch.add, (x, y))
    tensor([2., 2.])
    >>> outer.rpc_sync().__exit__(None, None, None)
    False
    >>> [e.key for e in outer.rpc_sync().key_averages()]
    ['aten::add']
"""

from __future__ import annotations

import itertools
from typing import Any

from torch.autograd.profiler_legacy import profile
from torch.autograd.profiler_util import EventList

from mpidag import _remote_profiling

__all__: list[str] = []

#: id of a running profile -> its handle in mpidag._remote_profiling (kept off the object,
#: which travels by pickle: ``__enter__`` returns it to a remote caller)
_running: dict[int, object] = {}


class _server_process_global_profile(profile):  # noqa: N801 - torch's name
    """torch's ``torch.distributed.rpc._server_process_global_profile``: the API of the
    legacy ``torch.autograd.profiler.profile``, but it profiles every call that this
    process serves while it runs (on the serving threads), not the thread that enters it.
    Profiles nest: a call is recorded by every profile that ran when it began.

    After ``__exit__``: ``function_events`` (an ``EventList`` of every served call's events)
    and ``process_global_function_events`` (one list of ``FunctionEvent`` per served call,
    times from this profile's start).

    Example::

        >>> x, y = torch.ones(2), torch.ones(2)
        >>> rref = rpc.remote("worker1", rpc._server_process_global_profile)
        >>> profile = rref.rpc_sync().__enter__()
        >>> rpc.rpc_sync("worker1", torch.sub, (x, y))
        tensor([0., 0.])
        >>> rref.rpc_sync().__exit__(None, None, None)
        False
        >>> [[e.name for e in call] for call in rref.to_here().process_global_function_events]
        [['aten::sub']]
    """

    def __enter__(self) -> _server_process_global_profile | None:
        if not self.enabled:
            return None
        if self.entered:
            raise RuntimeError("autograd profiler traces are not reentrant")
        self.entered = True
        options = (bool(self.record_shapes), bool(self.profile_memory), False, False, False)
        _running[id(self)] = _remote_profiling.start_server_profile(options)
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> bool:
        if not self.enabled:
            return False
        handle = _running.pop(id(self), None)
        if handle is None:
            raise RuntimeError("the server-wide profile was not entered on this process "
                               "(call __enter__ first, on the process it profiles)")
        calls = _remote_profiling.stop_server_profile(handle)
        process_global_function_events = []
        for events in calls:
            events.sort(key=lambda e: [e.time_range.start, -e.time_range.end])
            process_global_function_events.append(events)
        self.function_events = EventList(
            list(itertools.chain.from_iterable(process_global_function_events)),
            use_device="cuda" if self.use_cuda else None,
            profile_memory=self.profile_memory)
        self.function_events._build_tree()
        self.process_global_function_events = process_global_function_events
        return False
