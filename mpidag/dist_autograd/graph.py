"""One rank's part of a distributed backward pass: regions of the local graph, run natively.

A rank's local autograd graph is entered from several *sources*: the roots of ``backward``
(on the rank that called it) and the send functions of the context, each of which receives
its gradient later, from another rank (FAST mode: every send function expects exactly one).
A node may be reached from several sources; it must run once, with the sum of everything
that reaches it. So the graph is split into *regions*: the nodes reached from exactly the
same set of sources (a bit mask). A region can run as soon as every source in its mask has
arrived. Every region upstream of it (nearer the sources) has a mask that is a subset of its
own, so it ran earlier or runs in the same native-engine call: a region's inputs from other
regions are complete when it runs.

Each run is one call of the native engine (:func:`engine_grad`: what
``torch.autograd.grad`` does with ``GradientEdge`` outputs and inputs, in one C++ call where
it can): the outputs are the region's entry edges with their
summed gradients, the inputs are the edges where it stops: into leaves (their gradients go
to the context, never to ``.grad``), into recv functions (their gradients go to the rank
the tensor came from) and into regions that must wait for more sources. Nodes behind a
stop edge do not run in that call; every node runs in exactly one call.

Leaves need no waiting: a leaf's gradient is a sum, so each region adds its part. Except
*watched* leaves, which wait until every source that reaches them has arrived, so that what
runs on a leaf's gradient sees it whole and once, as in local autograd: leaves with tensor
hooks (``register_hook``: run by :class:`Plan` on the complete gradient, the hook's return
value replacing it; the native engine's own run of them on each part is suppressed),
leaves with post-accumulate-grad hooks, and leaves the caller asks to watch (the engine:
parameters of a torch ``DistributedDataParallel``). :meth:`Plan.take_completed` hands them
over once complete. A tensor hook on an *intermediate* tensor whose node gets its gradient
in parts (it is an exit of one region and an entry of another, e.g. a tensor both sent and
used locally) would run when the engine captures each part and again on their sum; Python
cannot reach a graph node's tensor hooks, so while a runtime lives
(:func:`track_intermediate_hooks`) the non-leaf tensors given hooks are remembered (weakly)
and their hooks are held back while a part is captured: they run once, on the sum, when
the region behind the node runs, as in local autograd.

This module knows nothing of RPC: :mod:`mpidag.dist_autograd.engine` feeds it gradients and
sends what it returns. It is tested on one process with sources that arrive in any order.

Example::

    >>> a = torch.ones(2, requires_grad=True); sent = a * 2; root = (sent * 3).sum()
    >>> plan = Plan([[edge_of(root)], [edge_of(sent)]], recv_types=type(None))
    >>> leaves, recvs = plan.arrive(0, [torch.tensor(1.0)], retain_graph=False)
    >>> leaves                         # nothing yet: `a` is behind source 1 (a "send")
    []
    >>> leaves, recvs = plan.arrive(1, [torch.ones(2)], retain_graph=False)
    >>> leaves[0][1]                   # d(root)/da + d(sent)/da * 1 = 6 + 2
    tensor([8., 8.])
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["AccumulateGrad", "EdgeKey", "Plan", "Reach", "drop_unrun_tasks", "edge_of",
           "edges_of", "make_plan", "tensor_hooks", "track_intermediate_hooks"]

log = logging.getLogger(__name__)

#: the node type of a leaf tensor's gradient accumulator
AccumulateGrad: type = type(get_gradient_edge(torch.empty(0, requires_grad=True)).node)

#: (node, input number of that node): where a gradient enters a node
EdgeKey = tuple[Any, int]


_FunctionBase = torch._C._FunctionBase  # the base of Python nodes (autograd.Function)


def edge_of(tensor: torch.Tensor) -> GradientEdge:
    """The edge through which ``tensor``'s gradient enters the graph (keeps it alive).

    What ``torch.autograd.graph.get_gradient_edge`` returns, for less than its cost (1.5 instead
    of 2.5 us for a leaf, 0.3 instead of 0.6 us for the output of a native op): the same
    node, input number and ownership token, without its generic checks, and without a grad
    mode switch when grad mode is on (it is, wherever a message is recorded).

    Example::

        >>> edge_of(torch.ones(1, requires_grad=True)).node.name()
        'torch::autograd::AccumulateGrad'
    """
    node = tensor.grad_fn
    if node is not None and not isinstance(node, _FunctionBase):
        return GradientEdge(node, tensor.output_nr)  # a native node owns its graph
    if not tensor.requires_grad:
        return get_gradient_edge(tensor)  # torch's own error
    if tensor.layout is not torch.strided:
        # a sparse tensor: torch finds a leaf's accumulator (and keeps a Python node's
        # graph alive) through a view, which sparse tensors lack; a clone's node leads to
        # the same edge and owns the graph behind it
        with torch.enable_grad():
            token = tensor.clone().grad_fn
        node, output_nr = token.next_functions[0]
        return GradientEdge(node, output_nr, ownership_token=token)
    if torch.is_grad_enabled():
        token = tensor.view_as(tensor).grad_fn
    else:
        with torch.enable_grad():
            token = tensor.view_as(tensor).grad_fn
    if node is None:  # a leaf: the view's node leads to its gradient accumulator
        return GradientEdge(token.next_functions[0][0], 0)
    # a Python node (a custom Function's output) does not keep the native graph behind it
    # alive: the view's native node does
    return GradientEdge(node, tensor.output_nr, ownership_token=token)


def edges_of(tensors: list[torch.Tensor], native: Any = None) -> list[GradientEdge]:
    """:func:`edge_of` of each tensor; through ``native``'s C++ ``gradient_edges`` where a
    records module is given (0.5 instead of 1.8 us a leaf), :func:`edge_of` where it finds
    none (a custom Function's output, a tensor without grad).

    Example::

        >>> a = torch.ones(1, requires_grad=True)
        >>> [edge.node.name() for edge in edges_of([a, a * 2])]
        ['torch::autograd::AccumulateGrad', 'MulBackward0']
    """
    if native is None:
        return [edge_of(t) for t in tensors]
    return _completed(native.gradient_edges(tensors, GradientEdge), tensors)


def _completed(found: list[GradientEdge | None], tensors: list[torch.Tensor]
               ) -> list[GradientEdge]:
    """The C++ edges ``found``, with :func:`edge_of` where it left ``None``."""
    return [edge if edge is not None else edge_of(t)
            for edge, t in zip(found, tensors, strict=True)]


def edges_and_reach(tensors: list[torch.Tensor], recv_types: frozenset[type],
                    native: Any = None) -> tuple[list[GradientEdge], Reach | None]:
    """:func:`edges_of` the tensors and, where ``native`` does both in one C++ call
    (``send_reach``: what a send function needs of its tensors), their :class:`Reach`;
    ``None`` for the reach where Python walks (no ``native``, or a custom Function's output
    among the tensors).

    Example::

        >>> a = torch.ones(1, requires_grad=True)
        >>> edges, reach = edges_and_reach([a * 2], frozenset())
        >>> [edge.node.name() for edge in edges], reach
        (['MulBackward0'], None)
    """
    if native is None:
        return edges_of(tensors), None
    edges, walked = native.send_reach(tensors, GradientEdge, recv_types, AccumulateGrad)
    if walked is None:
        return _completed(edges, tensors), None
    reach = Reach.__new__(Reach)  # (a Reach of the C++ walk, without _take's frame)
    reach.succ, reach.leaf_edges, reach.recv_edges, reach.recv_nodes = walked
    return edges, reach


def _type_set(recv_types: type | frozenset[type]) -> frozenset[type]:
    return frozenset((recv_types,)) if isinstance(recv_types, type) else recv_types


class Reach:
    """What one source reaches in the local graph: its nodes (with their next functions),
    and its edges into leaves and into recv functions (where the walk stops).

    The graph behind a tensor never changes once made, so the reach of a send function can
    be computed as soon as it is recorded (see ``SendFunction.prepare``). ``native`` (the C++
    records module, :mod:`mpidag.dist_autograd.native`) walks torch's C++ nodes instead of
    Python's ``next_functions`` (0.3 instead of 1-2 us for a call's few nodes), the same
    result; Python walks where an edge starts at a custom Function's node.

    Example::

        >>> a = torch.ones(2, requires_grad=True)
        >>> reach = Reach([edge_of(a * 2 + 1)], recv_types=frozenset())
        >>> sorted(node.name() for node in reach.succ), len(reach.leaf_edges)
        (['AddBackward0', 'MulBackward0'], 1)
    """

    __slots__ = ("succ", "leaf_edges", "recv_edges", "recv_nodes")

    def __init__(self, edges: list[GradientEdge | None],
                 recv_types: type | frozenset[type], native: Any = None) -> None:
        acc, recv_types = AccumulateGrad, _type_set(recv_types)
        walked = None if native is None else \
            native.reach(edges if type(edges) is list else list(edges), recv_types, acc)
        self._take(walked if walked is not None else self._walk(edges, recv_types))

    def _take(self, walked: tuple[dict, set, set, set]) -> None:
        self.succ, self.leaf_edges, self.recv_edges, self.recv_nodes = walked

    @staticmethod
    def _walk(edges: list[GradientEdge | None], recv_types: frozenset[type]
              ) -> tuple[dict, set, set, set]:
        """The Python walk: ``(succ, leaf_edges, recv_edges, recv_nodes)``."""
        acc = AccumulateGrad
        succ: dict[Any, tuple] = {}
        leaf_edges: set[EdgeKey] = set()
        recv_edges: set[EdgeKey] = set()
        stack = []
        for edge in edges:
            if edge is None or edge.node is None:
                continue
            kind = type(edge.node)
            if kind is not acc and kind not in recv_types and edge.node not in succ:
                succ[edge.node] = ()
                stack.append(edge.node)
        recv_nodes = {e.node for e in edges if e is not None and type(e.node) in recv_types}
        while stack:
            node = stack.pop()
            nexts = node.next_functions
            succ[node] = nexts
            for key in nexts:
                nxt = key[0]
                if nxt is None or nxt in succ:
                    continue
                kind = type(nxt)
                if kind is acc:
                    leaf_edges.add(key)
                elif kind in recv_types:
                    recv_edges.add(key)
                    recv_nodes.add(nxt)
                else:
                    succ[nxt] = ()
                    stack.append(nxt)
        return succ, leaf_edges, recv_edges, recv_nodes


@dataclass(slots=True, eq=False)
class _Region:
    """The nodes reached from exactly one set of sources."""

    mask: int
    entries: set[EdgeKey] = field(default_factory=set)  # edges into the region from outside
    exits: set[EdgeKey] = field(default_factory=set)  # edges to nodes of later regions
    leaf_edges: set[EdgeKey] = field(default_factory=set)
    recv_edges: set[EdgeKey] = field(default_factory=set)
    done: bool = False


def _disjoint(reaches: list[Reach]) -> bool:
    """Whether no node is in two of ``reaches``: one pass at C speed, smallest reach first,
    without copying the largest (a rank's plan runs between a gradient's arrival and its
    ``grad()`` call, on the critical path)."""
    ordered = sorted(reaches, key=lambda reach: len(reach.succ))
    seen: dict[Any, tuple] = {}
    for reach in ordered[:-1]:
        if not seen.keys().isdisjoint(reach.succ.keys()):
            return False
        seen.update(reach.succ)
    return not ordered or seen.keys().isdisjoint(ordered[-1].succ.keys())


class Plan:
    """The regions of the local graph reached from ``sources``, and their execution.

    ``sources[i]`` lists the edges of source ``i`` (``None`` for a tensor without grad);
    its gradients arrive through :meth:`arrive`. Nodes of a type in ``recv_types`` (one
    type or a set) are recv functions: gradients stop there and are returned to the caller
    once complete. ``reaches[i]`` is source ``i``'s :class:`Reach` where it is known (a send
    function's, walked when it was recorded); the others are walked here, in C++ where
    ``native`` (the C++ records module) is given.
    """

    def __init__(self, sources: list[list[GradientEdge | None]],
                 recv_types: type | frozenset[type],
                 reaches: list[Reach | None] | None = None,
                 watch: Callable[[torch.Tensor], bool] | None = None,
                 native: Any = None) -> None:
        self.n_sources = len(sources)
        self.recv_types = _type_set(recv_types)
        self.arrived = 0
        self.sources: list[list[EdgeKey | None]] = [
            [None if e is None or e.node is None else (e.node, e.output_nr) for e in edges]
            for edges in sources
        ]
        self._keep = sources  # the ownership tokens of custom Function nodes
        self.native = native
        self.buffers: dict[EdgeKey, torch.Tensor] = {}
        self.recv_buffers: dict[Any, dict[int, torch.Tensor]] = {}
        self.recv_mask: dict[Any, int] = {}
        self.fired: set[Any] = set()
        self.regions: dict[int, _Region] = {}
        #: the source mask of every node reached (only where some node is reached from
        #: two sources: otherwise each source is a region of its own, with no exits)
        self.node_mask: dict[Any, int] = {}
        reaches = list(reaches) if reaches is not None else [None] * len(sources)
        for i, edges in enumerate(sources):
            if reaches[i] is None:
                reaches[i] = Reach(edges, self.recv_types, native)
        self._build(reaches)
        #: watched leaves not complete yet: their source masks, their gradients so far
        self.leaf_mask: dict[Any, int] = {}
        self.leaf_grads: dict[Any, torch.Tensor] = {}
        self.hooked: set[Any] = set()  # watched leaves with tensor hooks
        self.completed: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._watch(watch)

    # ------------------------------------------------------------------ build
    def _build(self, reaches: list[Reach]) -> None:
        """Give every node reached from the sources its source mask, and form regions.

        Each source's reach is one depth-first pass (done when its send function was
        recorded, where possible, while the peer computes). When no node is reached from two
        sources (the common case: a pipeline stage, a parameter server; checked at C speed)
        each source is one region and no node needs a mask; otherwise a topological pass
        computes every node's mask.
        """
        shared = False
        recv_mask = self.recv_mask
        for i, reach in enumerate(reaches):
            for node in reach.recv_nodes:
                seen = recv_mask.get(node, 0)
                shared = shared or seen != 0
                recv_mask[node] = seen | 1 << i
        shared = shared or not _disjoint(reaches)
        regions = self.regions
        if not shared:  # one region per source; no region has exits, so no node masks
            for i, reach in enumerate(reaches):
                bit = 1 << i
                region = _Region(bit, leaf_edges=reach.leaf_edges, recv_edges=reach.recv_edges)
                region.entries = {key for key in self.sources[i]
                                  if key is not None and key[0] in reach.succ}
                regions[bit] = region
            return
        succ: dict[Any, tuple] = {}
        for reach in reaches:
            succ.update(reach.succ)
        masks = self._full_masks(succ)
        self.node_mask = masks
        acc, recv = AccumulateGrad, self.recv_types
        for mask in set(masks.values()):
            regions[mask] = _Region(mask)
        for node, nexts in succ.items():
            region = regions[masks[node]]
            for nxt, input_nr in nexts:
                if nxt is None:
                    continue
                kind = type(nxt)
                key = (nxt, input_nr)
                if kind is acc:
                    region.leaf_edges.add(key)
                elif kind in recv:
                    region.recv_edges.add(key)
                elif masks[nxt] != region.mask:
                    region.exits.add(key)
                    regions[masks[nxt]].entries.add(key)
        for edges in self.sources:
            for key in edges:
                if key is not None and key[0] in masks:
                    regions[masks[key[0]]].entries.add(key)

    def _full_masks(self, succ: dict[Any, tuple]) -> dict[Any, int]:
        """Source masks of every node (a node's mask: the union of its parents')."""
        masks: dict[Any, int] = dict.fromkeys(succ, 0)
        indegree: dict[Any, int] = dict.fromkeys(succ, 0)
        for nexts in succ.values():
            for nxt, _ in nexts:
                if nxt in indegree:
                    indegree[nxt] += 1
        for i, edges in enumerate(self.sources):
            for key in edges:
                if key is not None and key[0] in masks:
                    masks[key[0]] |= 1 << i
        recv, recv_mask = self.recv_types, self.recv_mask
        ready = [n for n, d in indegree.items() if d == 0]
        while ready:
            node = ready.pop()
            mask = masks[node]
            for nxt, _ in succ[node]:
                if nxt is None:
                    continue
                if nxt in indegree:
                    masks[nxt] |= mask
                    indegree[nxt] -= 1
                    if indegree[nxt] == 0:
                        ready.append(nxt)
                elif type(nxt) in recv:
                    recv_mask[nxt] = recv_mask.get(nxt, 0) | mask
        return masks

    def _watch(self, watch: Callable[[torch.Tensor], bool] | None) -> None:
        """Find the watched leaves (see the module's text) and the sources that reach each."""
        checked: dict[Any, bool] = {}
        leaf_mask = self.leaf_mask

        def watched(node: Any) -> bool:
            seen = checked.get(node)
            if seen is None:
                var = node.variable
                hooked = bool(tensor_hooks(var))
                if hooked:
                    self.hooked.add(node)
                seen = checked[node] = hooked or bool(var._post_accumulate_grad_hooks) \
                    or (watch is not None and watch(var))
            return seen

        for mask, region in self.regions.items():
            for node, _ in region.leaf_edges:
                if watched(node):
                    leaf_mask[node] = leaf_mask.get(node, 0) | mask
        for i, keys in enumerate(self.sources):
            for key in keys:
                if key is not None and type(key[0]) is AccumulateGrad and watched(key[0]):
                    leaf_mask[key[0]] = leaf_mask.get(key[0], 0) | 1 << i

    def take_completed(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The watched leaves completed since the last call: ``(leaf, gradient)``, tensor
        hooks applied (``None``: no gradient reached it)."""
        done, self.completed = self.completed, []
        return done

    # -------------------------------------------------------------- execution
    @property
    def complete(self) -> bool:
        """Every source has arrived: nothing is left to run."""
        return self.arrived == (1 << self.n_sources) - 1

    def waiting_sources(self) -> list[int]:
        """Sources that have not arrived although a region they feed has other sources that
        have: under FAST mode those regions can never run (their gradients are lost)."""
        arrived = self.arrived
        if arrived == (1 << self.n_sources) - 1:
            return []  # every source arrived: none can be missing
        stuck = 0
        for mask, region in self.regions.items():
            if not region.done and mask & arrived:
                stuck |= mask & ~arrived
        for node, mask in self.recv_mask.items():
            if node not in self.fired and mask & arrived:
                stuck |= mask & ~arrived
        for mask in self.leaf_mask.values():  # watched leaves wait for every part
            if mask & arrived:
                stuck |= mask & ~arrived
        return [i for i in range(self.n_sources) if stuck >> i & 1]

    def arrive(self, index: int, grads: list[torch.Tensor | None], retain_graph: bool
               ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[Any, list]]]:
        """Source ``index`` got its gradients (one per edge); run what is now runnable.

        Returns ``(leaf_grads, fired_recvs)``: ``(leaf tensor, gradient)`` pairs to add to
        the context, and ``(recv node, {output number: gradient})`` for each recv function
        whose gradient is now complete.
        """
        return self.arrive_many([(index, grads)], retain_graph)

    def arrive_many(self, arrivals: list[tuple[int, list[torch.Tensor | None]]],
                    retain_graph: bool
                    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[Any, list]]]:
        """:meth:`arrive` for several sources at once (one gradient message for several
        send functions): every ``(index, grads)`` first, then what is now runnable, in one
        engine call.

        Example::

            >>> a = torch.ones(2, requires_grad=True); sent = a * 2; root = (sent * 3).sum()
            >>> plan = Plan([[edge_of(root)], [edge_of(sent)]], recv_types=type(None))
            >>> leaves, recvs = plan.arrive_many([(0, [torch.tensor(1.0)]),
            ...                                   (1, [torch.ones(2)])], retain_graph=False)
            >>> leaves[0][1]               # both sources at once: 6 + 2, in one engine call
            tensor([8., 8.])
        """
        twice = () if len(arrivals) == 1 else \
            {i for i, n in collections.Counter(i for i, _ in arrivals).items() if n > 1}
        for index, grads in arrivals:  # check all before taking any
            edges = self.sources[index]
            if self.arrived >> index & 1 or index in twice:
                raise RuntimeError(f"source {index} of this backward pass got gradients twice")
            if len(grads) != len(edges):
                raise RuntimeError(f"source {index} expects {len(edges)} gradients, got "
                                   f"{len(grads)}")
        leaves: list[tuple[torch.Tensor, torch.Tensor]] = []
        for index, grads in arrivals:
            self.arrived |= 1 << index
            for key, grad in zip(self.sources[index], grads, strict=True):
                if key is not None and grad is not None:
                    self._deliver(key, grad, leaves)
        batch = [r for m, r in self.regions.items() if not r.done and m & ~self.arrived == 0]
        if batch:
            self._run(batch, retain_graph, leaves)
        fired = []
        for node, mask in self.recv_mask.items():
            if node not in self.fired and mask & ~self.arrived == 0:
                self.fired.add(node)
                fired.append((node, self.recv_buffers.pop(node, {})))
        if self.leaf_mask:
            self._complete_leaves()
        return leaves, fired

    def _complete_leaves(self) -> None:
        arrived = self.arrived
        for node in [n for n, m in self.leaf_mask.items() if m & ~arrived == 0]:
            del self.leaf_mask[node]
            grad = self.leaf_grads.pop(node, None)
            var = node.variable
            if grad is not None and node in self.hooked:
                grad = run_tensor_hooks(var, grad)
            self.completed.append((var, grad))

    def _deliver(self, key: EdgeKey, grad: torch.Tensor,
                 leaves: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        node = key[0]
        kind = type(node)
        if kind is AccumulateGrad:
            if node in self.leaf_mask:
                old = self.leaf_grads.get(node)
                self.leaf_grads[node] = grad if old is None else old + grad
            else:
                leaves.append((node.variable, grad))
        elif kind in self.recv_types:
            slots = self.recv_buffers.setdefault(node, {})
            old = slots.get(key[1])
            slots[key[1]] = grad if old is None else old + grad
        else:
            old = self.buffers.get(key)
            self.buffers[key] = grad if old is None else old + grad

    def _run(self, batch: list[_Region], retain_graph: bool,
             leaves: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        masks = {r.mask for r in batch}
        outputs: list[EdgeKey] = []
        grad_outputs: list[torch.Tensor] = []
        stops: dict[EdgeKey, None] = {}
        exits: list[Any] = []
        node_mask = self.node_mask
        for region in batch:
            region.done = True
            for key in region.entries:
                grad = self.buffers.pop(key, None)
                if grad is not None:
                    outputs.append(key)
                    grad_outputs.append(grad)
            for key in region.exits:
                if node_mask[key[0]] not in masks:
                    stops[key] = None
                    exits.append(key[0])
            for key in region.leaf_edges:
                stops[key] = None
            for key in region.recv_edges:
                stops[key] = None
        if not outputs or not stops:
            return
        keys = list(stops)
        hooks = []
        if exits and self._behind_exits(exits, keys):
            # A stop is also reachable through an exit node: the native engine runs every
            # node on a path to a requested edge, so that exit node would run now with a
            # partial gradient. Its gradient is captured before it runs; the pre-hook then
            # hands it nothing, so it and the nodes behind it compute nothing now, and
            # their saved tensors must survive this call for their real run later.
            hooks = [node.register_prehook(_nothing) for node in set(exits)]
            retain_graph = True
        hooked = [n.variable for n, _ in keys if n in self.hooked] if self.hooked else ()
        try:
            if hooked or (exits and _hooked_intermediates):
                with _hooks_suppressed(hooked), _intermediate_hooks_suppressed(exits):
                    results = engine_grad(self.native, outputs, grad_outputs, keys,
                                          retain_graph)
            else:  # nothing to hold back (the common case): no context managers
                results = engine_grad(self.native, outputs, grad_outputs, keys, retain_graph)
        finally:
            for hook in hooks:
                hook.remove()
        for key, grad in zip(keys, results, strict=True):
            if grad is not None:
                self._deliver(key, grad, leaves)

    @staticmethod
    def _behind_exits(exits: list[Any], stops: list[EdgeKey]) -> bool:
        """Whether some stop can be reached from one of the exit nodes."""
        targets = {key[0] for key in stops}
        seen: set[Any] = set()
        stack = [nxt for node in set(exits) for nxt, _ in node.next_functions]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            if node in targets:
                return True
            seen.add(node)
            stack.extend(nxt for nxt, _ in node.next_functions)
        return False


def make_plan(sources: list[list[GradientEdge | None]], recv_types: type | frozenset[type],
              reaches: list[Reach | None] | None = None,
              watch: Callable[[torch.Tensor], bool] | None = None,
              native: Any = None, disjoint: bool = True) -> Any:
    """The plan of ``sources`` (:class:`Plan`'s arguments): the C++ ``DisjointPlan`` of
    ``native`` (the C++ records module) where no node and no recv function is reached from
    two sources and no leaf reached is watched (a pipeline stage, a parameter server: one
    region per source, run as soon as it arrives, with no Python frame per step), else a
    :class:`Plan`. Both have the surface the engine uses (``arrive``, ``arrive_many``,
    ``complete``, ``arrived``, ``recv_mask``, ``fired``, ``waiting_sources``, ...) and give
    the same gradients. ``disjoint`` false: a :class:`Plan` (the caller already asked
    ``disjoint_plan``, which said no).

    Example::

        >>> a = torch.ones(2, requires_grad=True); root = (a * 3).sum()
        >>> plan = make_plan([[edge_of(root)]], recv_types=type(None))
        >>> plan.arrive(0, [torch.tensor(1.0)], retain_graph=False)[0][0][1]
        tensor([3., 3.])
    """
    kinds = _type_set(recv_types)
    terms = disjoint_terms(watch) if disjoint and native is not None and sources else None
    if terms is not None:
        known = list(reaches) if reaches is not None else [None] * len(sources)
        known = [reach if reach is not None else Reach(edges, kinds, native)
                 for edges, reach in zip(sources, known, strict=True)]
        plan = native.disjoint_plan(
            sources if type(sources) is list else list(sources), known, kinds, AccumulateGrad,
            watch, engine_grad, drop_unrun_tasks, native, terms[1])
        if plan is not None:
            return plan
        reaches = known
    return Plan(sources, kinds, reaches, watch=watch, native=native)


def disjoint_terms(watch: Callable[[torch.Tensor], bool] | None
                   ) -> tuple[Callable[[torch.Tensor], bool] | None, bool] | None:
    """The arguments of the C++ ``disjoint_plan`` that change while a program runs,
    ``(watch, direct)`` as :func:`make_plan` passes them (``direct``: torch's autograd log
    is not at DEBUG, so the plan may call torch's engine without Python), or ``None`` where
    no DisjointPlan may be made now (tensor hooks held back by a running engine call:
    ``disjoint_plan`` would not see them). For :func:`make_plan` and the C++
    ``PassCore._make_plan``.

    Example::

        >>> disjoint_terms(None)
        (None, True)
    """
    if _suppressed:
        return None
    return watch, _autograd_log.getEffectiveLevel() > logging.DEBUG


def engine_grad(native: Any, outputs: list[EdgeKey], grads: list[torch.Tensor],
                inputs: list[EdgeKey], retain_graph: bool) -> tuple[torch.Tensor | None, ...]:
    """One call of torch's engine: the gradients at the edges ``inputs`` (``None`` where
    none arrives) of ``grads`` entering at the edges ``outputs``, what
    ``torch.autograd.grad(outputs, inputs, grads, retain_graph=..., allow_unused=True)``
    gives with ``GradientEdge``s.

    Through ``native``'s ``run_grad`` (the C++ records module) where it can: the same engine
    call without ``torch.autograd.grad``'s Python, which repeats checks the engine makes
    and stashes the context per call (~30 us a call, and more per node: 3.42 instead of
    3.59 ms for 500 ops). ``torch.autograd.grad`` runs where ``native`` is ``None``, an edge
    starts at a custom Function's Python node, a gradient is not on the CPU (device threads
    read the stashed context), or torch's autograd log is at DEBUG (it hooks every node).

    Example::

        >>> w = torch.ones(2, requires_grad=True); y = w * 3
        >>> acc = y.grad_fn.next_functions[0]
        >>> engine_grad(None, [(y.grad_fn, 0)], [torch.ones(2)], [acc], False)
        (tensor([3., 3.]),)
    """
    try:
        if native is not None and all(g.is_cpu for g in grads) \
                and _autograd_log.getEffectiveLevel() > logging.DEBUG:
            results = native.run_grad(outputs, grads, inputs, retain_graph)
            if results is not None:
                return results
        return torch.autograd.grad([GradientEdge(*key) for key in outputs],
                                   [GradientEdge(*key) for key in inputs], grads,
                                   retain_graph=retain_graph, allow_unused=True)
    except BaseException:
        drop_unrun_tasks()
        raise


def drop_unrun_tasks() -> None:
    """Free the nodes that a failed engine call left queued on this thread.

    When a node raises, torch's engine ends the call at once: the nodes that were ready to
    run stay in the calling thread's ready queue (with their input gradients and, through
    their edges, the graph behind them, recv functions included) until the next engine
    call on that thread pops and discards them. A pool thread may not run another for a
    long time, so a failed pass would keep part of its graph alive after its context is
    released (torch's distributed engine drains its queue on errors too). One tiny engine
    call on this thread discards them now.

    Example::

        >>> a = torch.ones(2, requires_grad=True)
        >>> kept, bad = a * 2, a * 3
        >>> _ = bad.register_hook(lambda g: g[:1])  # breaks the engine call: wrong size
        >>> try:
        ...     torch.autograd.grad(kept.sum() + bad.sum(), [a])
        ... except RuntimeError:
        ...     drop_unrun_tasks()  # kept's node, queued but never run, is freed now
    """
    try:  # never in place of the error being raised
        with torch.inference_mode(False), torch.enable_grad():
            anchor = torch.zeros((), requires_grad=True)
            torch.autograd.grad(anchor * 1, [anchor])
    except Exception:  # noqa: BLE001 - the caller raises its own error next
        log.debug("could not discard the nodes a failed engine call left", exc_info=True)


#: torch's autograd logger (at DEBUG, torch.autograd.grad hooks every node to log it)
_autograd_log = logging.getLogger("torch.autograd.graph")


def _nothing(grads: tuple) -> tuple:
    """Pre-hook of an exit node: it has nothing to compute in this run."""
    return tuple(None for _ in grads)


# ---------------------------------------------------------------- leaf tensor hooks
#: leaves whose tensor hooks are taken away during native-engine calls (which would run
#: them on each part of a gradient): leaf -> [number of calls under way, their hooks]
_suppressed: WeakIdKeyDictionary = WeakIdKeyDictionary()
_suppressed_lock = threading.Lock()


def tensor_hooks(var: torch.Tensor) -> Any:
    """The ``register_hook`` hooks of leaf ``var`` (an ordered dict, or ``None``), also while
    an engine call of this module has taken them away.

    Example::

        >>> w = torch.ones(2, requires_grad=True); _ = w.register_hook(lambda g: g * 2)
        >>> len(tensor_hooks(w))
        1
    """
    if _suppressed:
        entry = _suppressed.get(var)
        if entry is not None:
            return entry[1]
    return var._backward_hooks


def run_tensor_hooks(var: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` through the tensor hooks of leaf ``var``, in registration order, each one's
    return value (unless ``None``) replacing the gradient, as local autograd does.

    Example::

        >>> w = torch.ones(2, requires_grad=True); _ = w.register_hook(lambda g: g * 2)
        >>> run_tensor_hooks(w, torch.ones(2))
        tensor([2., 2.])
    """
    hooks = tensor_hooks(var)
    for hook in list(hooks.values()) if hooks else ():
        out = hook(grad)
        if out is not None:
            if not isinstance(out, torch.Tensor) or out.shape != grad.shape:
                raise RuntimeError(
                    f"hook {getattr(hook, '__name__', hook)!r} returned "
                    f"{type(out).__name__ if not isinstance(out, torch.Tensor) else out.shape}"
                    f" for a gradient of shape {tuple(grad.shape)}: a tensor hook must return "
                    f"None or a tensor of the gradient's shape")
            grad = out
        # (torch checks the same: "hook ... has changed the size of value")
    return grad


@contextmanager
def _hooks_suppressed(variables: list[torch.Tensor] | tuple):
    """Take the tensor hooks of ``variables`` away for one native-engine call (reference
    counted across threads; hooks registered meanwhile are kept)."""
    if not variables:
        yield
        return
    with _suppressed_lock:
        for var in variables:
            entry = _suppressed.get(var)
            if entry is None:
                _suppressed[var] = [1, var._backward_hooks]
                var._backward_hooks = None
            else:
                entry[0] += 1
    try:
        yield
    finally:
        with _suppressed_lock:
            for var in variables:
                entry = _suppressed[var]
                entry[0] -= 1
                if entry[0] == 0:
                    del _suppressed[var]
                    hooks, added = entry[1], var._backward_hooks
                    if added:  # registered while taken away
                        if hooks is None:
                            hooks = added
                        else:
                            hooks.update(added)
                    var._backward_hooks = hooks


# -------------------------------------------------------- intermediate tensor hooks
#: non-leaf tensors given a tensor hook while tracking is on (weakly; see the module text)
_hooked_intermediates: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: [runtimes tracking, torch's own Tensor.register_hook while replaced]
_tracking: list[Any] = [0, None]
#: id(hooks dict) -> [native calls holding it back, the dict, its hooks]
_held: dict[int, list[Any]] = {}


def track_intermediate_hooks() -> Callable[[], None]:
    """Remember the non-leaf tensors given a tensor hook (``Tensor.register_hook`` wrapped,
    counted per caller); returns the function that stops it (the last one puts torch's
    ``register_hook`` back, unless another library replaced it since).

    Example::

        >>> stop = track_intermediate_hooks()
        >>> h = torch.ones(2, requires_grad=True) * 2; _ = h.register_hook(lambda g: g)
        >>> stop()
    """
    with _suppressed_lock:
        if _tracking[0] == 0:
            original = torch.Tensor.register_hook

            def register_hook(self: torch.Tensor, hook: Callable) -> Any:
                handle = original(self, hook)
                if self.grad_fn is not None:
                    _hooked_intermediates[self] = None
                return handle

            register_hook.__doc__ = original.__doc__
            register_hook.__wrapped__ = original  # type: ignore[attr-defined]
            torch.Tensor.register_hook = register_hook  # type: ignore[method-assign]
            _tracking[1] = (original, register_hook)
        _tracking[0] += 1
    stopped = [False]

    def stop() -> None:
        with _suppressed_lock:
            if stopped[0]:
                return
            stopped[0] = True
            _tracking[0] -= 1
            if _tracking[0] == 0:
                original, wrapper = _tracking[1]
                if torch.Tensor.register_hook is wrapper:
                    torch.Tensor.register_hook = original  # type: ignore[method-assign]
                _tracking[1] = None

    return stop


@contextmanager
def _intermediate_hooks_suppressed(nodes: list[Any]):
    """Hold back the tensor hooks of the non-leaf tensors whose node is in ``nodes`` (the
    exits of a native-engine call: they get a part of their gradient now, and run on the
    sum later) for that call; reference counted across threads."""
    if not nodes or not _hooked_intermediates:
        yield
        return
    targets = set(nodes)
    held: list[dict] = []
    with _suppressed_lock:
        for tensor in list(_hooked_intermediates.keys()):
            if tensor.grad_fn not in targets:
                continue
            hooks = tensor._backward_hooks
            if hooks is None:
                continue
            entry = _held.get(id(hooks))
            if entry is not None:
                entry[0] += 1
            elif hooks:
                _held[id(hooks)] = [1, hooks, dict(hooks)]
                hooks.clear()  # in place: the node's pre-hook reads this very dict
            else:
                continue
            held.append(hooks)
    try:
        yield
    finally:
        with _suppressed_lock:
            for hooks in held:
                entry = _held[id(hooks)]
                entry[0] -= 1
                if entry[0] == 0:
                    del _held[id(hooks)]
                    added = dict(hooks)  # registered meanwhile: after the earlier ones
                    hooks.clear()
                    hooks.update(entry[2])
                    hooks.update(added)
