"""The distributed backward pass across ranks: FAST mode, completed by SMART mode.

Data flow of ``backward(context_id, [loss])`` on rank A, whose forward sent ``x`` to B and
got ``y`` back::

    A: plan the local graph from the roots and every send function of the context
       -> run the regions the roots alone feed (native engine) -> the recv function of y
       is complete: call the handler "autograd.gradients"(context, pass, message id of y,
       grad y) on B
    B: first event of this pass: plan from all of B's send functions -> the send function
       of y got its gradient: run its region -> the recv function of x is complete:
       call "autograd.gradients"(..., message id of x, grad x) on A
    A: the send function of x got its gradient: run its region; leaves accumulate into
       the context -> answer B's call -> B has nothing left: answer A's first call -> done

Termination is Dijkstra-Scholten's: each gradient message is a call; the first one that
finds a rank idle *engages* it and is answered only when that rank is idle again and all the
calls it made were answered; other calls are answered as soon as they are processed. So the
answer to the root's own pass arrives exactly when no rank has anything left to do for it.
One shortcut: a gradient message to the rank whose call engaged the sender (its *parent*)
is a notification, not a call. The parent waits for it in the sender's place: the sender's
answer says how many it handed over, and the parent is done only once it processed that
many. In the example above B's gradient for x goes to A as such a notification and B answers
A's first call right after it, so A is done as soon as x's region has run (before: A
answered B's call, and B then answered A's: two more messages on the critical path).
Answers carry each rank's errors (raised on the caller of ``backward`` with their type and
remote traceback) and a report of send functions that never got their gradient although a
part of the graph waits for them (the FAST mode rule: every send function of a context
expects one; see :class:`UnusedRPCGradientError`).

SMART mode (the default) completes FAST mode. A rank that plans its share of a SMART pass
sends its peer a gradient message carrying *no gradient* (``grads=None``) for each of its
recv functions that no source of its own reaches: those can never fire. It arrives like any
gradient and lets the regions behind the send function run with what they have, so "no
gradient" flows back along chains of unused results. Ranks the pass never reaches make no
plan; for them, when the pass is quiescent (the root's answer arrived) and some rank reports
waiting send functions, the root asks the rank of each one's recv function whether it can
still fire (the ``autograd.resolve`` handler, a call of the same termination protocol). That
rank plans (answering its unreached recv functions) and forwards the question, once per pass,
about each unarrived source of the recv function asked about. The question follows the chain
of dependencies forward in time (a source is always sent after the recv functions it reaches
were received), so it ends at recv functions no source reaches. Every node still runs once,
with the sum of the gradients that can reach it: exactly local autograd's result. When every
RPC is used nothing of this sends a message.

Hooks. A leaf's gradient goes to the context, never to ``.grad``, and the native engine never
runs its ``AccumulateGrad`` node. What local autograd runs there is run here once the leaf's
gradient of this pass is complete on this rank (every source reaching it arrived; see
:mod:`mpidag.dist_autograd.graph`): its tensor hooks (``register_hook``, each return value
replacing the gradient), then the gradient goes into the context, then its post-accumulate-
grad hooks, called with the leaf inside the context (``.grad`` is not set, as in torch's
distributed autograd: read the gradient with ``get_gradients``). Hooks registered on the
``AccumulateGrad`` node itself (``node.register_hook``/``register_prehook``) do not run.
The parameters of a torch ``DistributedDataParallel`` module (whose reducer works from such
node hooks) are averaged here instead, once all of the module's parameters this pass reaches
are complete: :func:`average_ddp_gradients`, through the reducer's own buckets, in the pass's
thread, after this rank's gradient messages of that step were sent.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import itertools
import logging
import threading
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import profiler as _profiler_module
from torch.utils.weak import WeakIdKeyDictionary

from mpidag._profiling import span
from mpidag.agent.agent import RpcAgent
from mpidag.dist_autograd import graph
from mpidag.dist_autograd.context import (
    RECV_NODE_TYPES,
    ContextContainer,
    DistAutogradContext,
    new_container,
)
from mpidag.dist_autograd.graph import (
    AccumulateGrad,
    Plan,
    disjoint_terms,
    edge_of,
    make_plan,
    track_intermediate_hooks,
)
from mpidag.dist_autograd.native import records_module
from mpidag.errors import detached_copy, frameless, future_error, node_error

__all__ = ["DistAutograd", "NativePassState", "PassState", "UnusedRPCGradientError",
           "UnusedRPCWarning", "check_roots", "merge_answer", "pack_answer"]

log = logging.getLogger(__name__)

#: what a rank reports: {rank: (event number, unused RPC results, send functions waiting,
#: (peer rank, message id) of each send function waiting)}
Report = dict[int, tuple[int, list[str], list[str], list[tuple[int, int]]]]

#: numbers of the events a rank handles, in order (the newest report of a rank wins)
_event_numbers = itertools.count(1)

#: the ``flags`` of a gradient message (the ``autograd.gradients`` handler's 4th argument);
#: ``TO_PARENT``: a notification to the rank whose call engaged the sender, which waits for
#: it in the sender's place (see "Termination" in :class:`PassState`); ``EXPANDED``: the
#: gradients are followed by one shape each (``None``, or the shape to expand that
#: gradient back to: see :func:`_compact`)
RETAIN_GRAPH, SMART, NO_GRADIENT, TO_PARENT, EXPANDED = 1, 2, 4, 8, 16
#: the most send functions one gradient message serves: their ids travel as a tuple, which
#: the compiled call path sends as a plain value up to this length
MAX_BATCH = 8
#: the fewest elements of a broadcast gradient that travels as its distinct elements and a
#: shape (:func:`_compact`); a smaller one travels whole (one torch call instead of two on
#: each end, and a few KiB at most)
COMPACT_MIN_NUMEL = 4096


def _compact(grad: torch.Tensor | None) -> tuple[torch.Tensor | None, tuple[int, ...] | None]:
    """A gradient to send, and the shape to expand it back to on arrival (``None``: it
    travels as it is). A strided one is made contiguous, so that a small CPU one travels by
    the compiled call path; a broadcast one (a dimension of stride 0: the gradient of a
    ``sum()`` of the received tensor is one element expanded to its shape) of at least
    :data:`COMPACT_MIN_NUMEL` elements and 8 dimensions at most travels as its distinct
    elements, so a loss's gradient costs no copy and no bytes the
    size of the tensor, and the receiver's autograd gets it expanded, as local autograd
    would.

    Example::

        >>> sent, shape = _compact(torch.ones(()).expand(64, 128))
        >>> sent.shape, shape
        (torch.Size([1, 1]), (64, 128))
        >>> _compact(torch.ones(64, 128).t())[0].is_contiguous()
        True
    """
    if grad is None or grad.layout is not torch.strided or grad.is_contiguous():
        return grad, None
    shape = grad.shape
    if grad.numel() >= COMPACT_MIN_NUMEL and len(shape) <= 8:  # (a shape is a plain value)
        distinct = grad
        for dim, (size, stride) in enumerate(zip(shape, grad.stride(), strict=True)):
            if stride == 0 and size > 1:
                distinct = distinct.narrow(dim, 0, 1)
        if distinct is not grad:
            return distinct.contiguous(), tuple(shape)
    return grad.contiguous(), None


def _expand_back(args: tuple) -> tuple:
    """The gradients of an :data:`EXPANDED` message: ``args`` holds the gradients, then one
    shape each (see :func:`_compact`); a gradient with a shape is expanded back to it.

    Example::

        >>> sent, shape = _compact(torch.ones(()).expand(64, 128))
        >>> _expand_back((sent, shape))[0].stride()
        (0, 0)
    """
    half = len(args) // 2
    return tuple(g if shape is None else g.expand(shape)
                 for g, shape in zip(args[:half], args[half:], strict=True))


#: an answer of the termination protocol as it travels (see :func:`pack_answer`)
Answer = tuple
#: the attribute of a failed answer's exception that carries its ``handed_over`` count
_HANDED_OVER = "_mpidag_handed_over"


def pack_answer(report: Report, handed_over: int = 0) -> Answer:
    """The answer to a call of the termination protocol: ``handed_over``, the number of
    gradient notifications the answering rank sent to the caller for it to wait for (see
    :class:`PassState`), then the report. When no rank in the report has anything to say
    (no unused RPC result, no send function waiting) and it has at most three ranks, the
    report is flat, ``(handed_over, rank, event number, ...)``, a plain value (a tuple of at
    most 8) that the compiled call path sends in C; else ``(handed_over, report)``.
    :func:`merge_answer` reads both.

    Example::

        >>> pack_answer({1: (7, [], [], [])}, 2)
        (2, 1, 7)
        >>> merged: Report = {}
        >>> merge_answer(merged, (2, 1, 7)), merged
        (2, {1: (7, [], [], [])})
    """
    if len(report) <= 3:
        flat = [handed_over]
        for rank, (seq, unused, waiting, waiting_ids) in report.items():
            if unused or waiting or waiting_ids:
                break
            flat += (rank, seq)
        else:
            return tuple(flat)
    return handed_over, report


def merge_answer(into: Report, answer: Answer) -> int:
    """Merge the report of ``answer`` (see :func:`pack_answer`) into ``into`` (the entry of
    a rank with the later event number wins); returns its ``handed_over`` count."""
    if len(answer) == 2 and type(answer[1]) is dict:
        _merge(into, answer[1])
    else:
        _merge(into, {answer[i]: (answer[i + 1], [], [], [])
                      for i in range(1, len(answer), 2)})
    return answer[0]


def _says_nothing(answer: Answer) -> bool:
    """Whether ``answer`` reports nothing: no rank has an unused RPC result or a send
    function waiting (:func:`pack_answer` makes such a report flat, and only such a one).

    Example::

        >>> _says_nothing(pack_answer({1: (7, [], [], [])})), _says_nothing(
        ...     pack_answer({1: (7, ["the result of f"], [], [])}))
        (True, False)
    """
    return len(answer) != 2 or type(answer[1]) is not dict


def _merge(into: Report, report: Report) -> None:
    for rank, entry in report.items():
        old = into.get(rank)
        if old is None or entry[0] >= old[0]:
            into[rank] = entry

#: the modes of :meth:`DistAutograd.backward`
MODES = ("smart", "fast")


class UnusedRPCGradientError(RuntimeError):
    """Part of the graph needed the gradient of a send function that never received one.

    Raised only with ``backward(..., mode="fast")``. FAST mode (as in PyTorch) assumes that
    every RPC of a context whose tensors require grad takes part in the backward pass: each
    send function waits for exactly one gradient. When an RPC's result is not used by the
    loss, its send function never gets one, and a node that also depends on it never runs:
    its gradients would be missing (PyTorch returns them silently missing). This error names
    those RPCs. The default SMART mode computes those gradients instead.

    Example::

        >>> a = torch.ones(2, requires_grad=True)
        >>> with dist_autograd.context() as context_id:
        ...     h = a * 2
        ...     d = rpc.rpc_sync("worker1", torch.square, args=(h,))
        ...     e = rpc.rpc_sync("worker1", torch.sin, args=(h,))   # never used
        ...     dist_autograd.backward(context_id, [d.sum()], mode="fast")
        Traceback (most recent call last):
        mpidag.dist_autograd.engine.UnusedRPCGradientError: distributed backward of context 1
        could not finish: the arguments of torch...sin sent to worker1 (from rank 0) never
        received a gradient, and other gradients depend on them. ... Results the loss does
        not use: the result of torch...sin from worker1. Detach or drop those results, or
        make those calls outside the autograd context.
    """


class UnusedRPCWarning(UserWarning):
    """FAST mode only: results of RPCs in the context that the backward pass did not reach
    (harmless when no other gradient depended on them, which is why this is only a warning;
    SMART mode, the default, handles them and does not warn).

    Example::

        >>> a, b, c = (torch.ones(2, requires_grad=True) for _ in range(3))
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     with dist_autograd.context() as context_id:
        ...         d = rpc.rpc_sync("worker1", torch.add, args=(a, b))
        ...         e = rpc.rpc_sync("worker1", torch.mul, args=(b, c))   # not in the loss
        ...         dist_autograd.backward(context_id, [d.sum()], mode="fast")
        >>> print(caught[0].message)
        distributed backward did not reach the result of torch...mul from worker1: no gradient
        flows back through those RPCs (their results are not used by the loss)
    """


@dataclasses.dataclass(slots=True)
class RootsEvent:
    """The pass starts here: the gradients of the roots of ``backward()``."""

    edges: list
    grads: list[torch.Tensor]


@dataclasses.dataclass(slots=True)
class GradientsEvent:
    """Gradients arrived for the send function ``message_id`` (``grads=None``: SMART mode
    says none can come), or for each send function of a tuple of ids, their gradients one
    after the other in ``grads`` (one message for several recv functions of one rank that
    fired together); ``reply`` answers the call that brought them."""

    message_id: int | tuple[int, ...]
    grads: list[torch.Tensor | None] | None
    reply: torch.futures.Future | None
    #: a notification from a rank this one engaged, which this rank waits for in its place
    to_parent: bool = False


@dataclasses.dataclass(slots=True)
class ResolveEvent:
    """SMART mode asks whether the recv function ``message_id`` can still fire."""

    message_id: int
    reply: torch.futures.Future | None


@dataclasses.dataclass(slots=True)
class AskEvent:
    """SMART mode, on the root's rank: ask the ``(peer, message_id)`` recv functions."""

    recvs: list[tuple[int, int]]


#: one step of a rank's share of a backward pass
PassEvent = RootsEvent | GradientsEvent | ResolveEvent | AskEvent
#: the events that answer the call that brought them (the termination protocol's calls)
_ANSWERED = (GradientsEvent, ResolveEvent)


def _drop_foreign(record: Any) -> None:
    """A fired recv function of another context than the pass's: its gradient is dropped."""
    log.debug("gradient for %r of another context dropped", record)


class PassState:
    """One rank's share of one backward pass (``pass_id``) of a context."""

    def __init__(self, autograd: DistAutograd, ctx: DistAutogradContext, pass_id: int,
                 retain_graph: bool, root: bool, smart: bool = True) -> None:
        self.autograd = autograd
        self.agent = autograd.agent
        self.ctx = ctx
        self.pass_id = pass_id
        self.retain_graph = retain_graph
        self.smart = smart  # SMART mode: answer "no gradient" for recv functions unreached
        self.root = root
        self.lock = threading.Lock()
        self.events: collections.deque = collections.deque()
        self.running = False
        self.deficit = 0  # gradient calls made and not answered yet
        self.parent: torch.futures.Future | None = None  # answer of the engaging call
        self.parent_rank: int | None = None  # the rank that made it (None: unknown)
        self.handed_over = 0  # gradient notifications sent to the parent since engaged
        #: notifications handed over to this rank by ranks it engaged, not processed yet
        #: (below 0 while one is processed before the answer that announces it arrives)
        self.handed_to_me = 0
        self.errors: list[BaseException] = []
        self.reports: Report = {}
        self.seq = 0
        self.plan: Plan | Any = None  # (a Plan, or native's DisjointPlan: make_plan)
        #: a DisjointPlan's ``step``: an event's arrivals, engine calls and gradient
        #: messages in one C++ call (None: a Plan's pass, run by the Python below)
        self.native_step: Any = None
        #: native's ``compact_grads`` (:func:`_compact` of each gradient in C++), or None
        native = ctx.container.native
        self.compact_grads: Any = getattr(native, "compact_grads", None)
        self.source_of: dict[int, int] = {}  # send message id -> source index
        self.source_send: list[Any] = []  # the send function of each source (None: roots)
        self.asked: set[int] = set()  # SMART: message ids of recv functions asked about
        self.resolved: set[int] = set()  # SMART: recv functions this rank answered for
        self._recv_node_of: dict[int, Any] | None = None
        #: the context's recv functions that no source here reaches, and how many recv
        #: functions the context had when they were listed (:meth:`_unreached_records`)
        self._unreached: tuple[int, list[Any]] = (-1, [])
        #: torch DDP modules whose parameters this pass reaches here: the parameters not
        #: complete yet, and the complete gradients (averaged once all are complete)
        self.ddp_waiting: dict[Any, set[torch.Tensor]] = {}
        self.ddp_grads: dict[Any, dict[torch.Tensor, torch.Tensor | None]] = {}

    # ------------------------------------------------------------- events
    def post(self, event: PassEvent) -> None:
        """Queue an event and process the queue unless another thread already does."""
        with self.lock:
            if type(event) in _ANSWERED and self.parent is None and event.reply is not None:
                self.parent = event.reply  # engaged: answered when everything is done
                event.reply = None
                self.parent_rank = self._caller(event)
            self.events.append(event)
            if self.running:
                return
            self.running = True
        while True:
            with self.lock:
                if not self.events:
                    self.running = False
                    break
                event = self.events.popleft()
            reply = event.reply if type(event) in _ANSWERED else None
            leaves: list[tuple[torch.Tensor, torch.Tensor]] = []
            try:
                leaves = self._handle(event)
            except Exception as exc:
                self._failed(exc)
            if reply is not None:  # the answer first: the caller's pass waits for it
                reply.set_result(pack_answer(self._own_report()))
            if leaves:  # read only once the pass has ended, and it has not: still running
                try:
                    store = self.ctx.gradients
                    for variable, grad in leaves:
                        store.add(variable, grad)
                except Exception as exc:
                    self._failed(exc)
            if type(event) is GradientsEvent and event.to_parent:
                with self.lock:  # handed over by a rank this one engaged: processed
                    self.handed_to_me -= 1
        self._maybe_finish()

    def _caller(self, event: PassEvent) -> int | None:
        """The rank whose call brought ``event``: the rank a gradient's send function sent
        to (``None`` for other events: their gradients are not handed over)."""
        if type(event) is not GradientsEvent:
            return None
        send = self.ctx.sends.get(_first(event.message_id))
        return None if send is None else send.peer

    def _failed(self, exc: Exception) -> None:
        """This rank's share of the pass raised ``exc``: kept for the root, which raises it."""
        log.debug("backward pass %x failed on %s", self.pass_id, self.agent.where(),
                  exc_info=True)
        with self.lock:  # torch's "Error on Node {rank}: ...", original as cause
            self.errors.append(node_error(frameless(exc, self.agent.where()),
                                          self.agent.rank))

    def _handle(self, event: PassEvent) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Process one event; returns the gradients of the unwatched leaves it reached, which
        :meth:`post` stores in the context after it sent what others wait for."""
        with span(lambda: self._describe(event)):
            if self.plan is None:
                self._make_plan(event.edges if type(event) is RootsEvent else None)
            plan = self.plan
            self.seq = next(_event_numbers)  # across passes: the later report of a rank wins
            if type(event) is ResolveEvent:
                self._resolve(event.message_id)
                return []
            if type(event) is AskEvent:
                for peer, message_id in event.recvs:
                    self._ask(peer, message_id)
                return []
            step = self.native_step
            if step is not None:
                done = step(None if type(event) is RootsEvent else event.message_id,
                            event.grads, self.retain_graph, self.ctx.context_id, MAX_BATCH)
                if done is not None:  # (None: a message that does not fit, raised below)
                    leaves, sends, foreign = done
                    for record in foreign or ():
                        _drop_foreign(record)
                    for peer, message_id, grads in sends:
                        self._send(peer, message_id, grads)
                    return leaves  # (no leaf of a DisjointPlan is watched: none completed)
            if type(event) is RootsEvent:
                leaves, fired = plan.arrive(0, event.grads, self.retain_graph)
            else:
                leaves, fired = plan.arrive_many(self._arrivals(event), self.retain_graph)
            by_peer: dict[int, list[tuple[int, list[torch.Tensor | None]]]] = {}
            for node, slots in fired:
                record = node.record
                if record.context_id != self.ctx.context_id:
                    _drop_foreign(record)
                    continue
                by_peer.setdefault(record.peer, []).append(
                    (record.message_id, [slots.get(i) for i in range(record.n_outputs)]))
            for peer, ready in by_peer.items():  # one message per peer (up to MAX_BATCH)
                for start in range(0, len(ready), MAX_BATCH):
                    chunk = ready[start:start + MAX_BATCH]
                    if len(chunk) == 1:
                        self._send(peer, *chunk[0])
                    else:
                        self._send(peer, tuple(mid for mid, _ in chunk),
                                   [g for _, grads in chunk for g in grads])
            if plan.completed:  # after the sends: a DDP all-reduce waits for the peers
                self._complete_leaves(plan.take_completed())
            return leaves

    def _arrivals(self, event: GradientsEvent) -> list[tuple[int, list[torch.Tensor | None]]]:
        """The ``(source index, gradients)`` of a gradient message: one per send function
        it serves (several share the message's flat gradients, in order)."""
        plan = self.plan
        ids = event.message_id if type(event.message_id) is tuple else (event.message_id,)
        arrivals: list[tuple[int, list[torch.Tensor | None]]] = []
        offset = 0
        for message_id in ids:
            index = self.source_of.get(message_id)
            if index is None:
                raise RuntimeError(
                    f"gradients arrived for autograd message 0x{message_id:x}, but "
                    f"{self.agent.where()} has no send function with that id in context "
                    f"{self.ctx.context_id}")
            n = len(plan.sources[index])
            if event.grads is None:  # SMART: no gradient can ever reach that recv function
                arrivals.append((index, [None] * n))
            else:
                arrivals.append((index, event.grads[offset:offset + n]))
                offset += n
        if event.grads is not None and offset != len(event.grads):
            raise RuntimeError(
                f"a gradient message for {len(ids)} send function(s) of context "
                f"{self.ctx.context_id} carried {len(event.grads)} gradients, but they take "
                f"{offset}")
        return arrivals

    def _complete_leaves(self, completed: list[tuple[torch.Tensor, torch.Tensor | None]]
                         ) -> None:
        """Watched leaves whose gradient is complete on this rank in this pass: into the
        context (a DDP module's parameters once all of them are complete, averaged over its
        process group), then their post-accumulate-grad hooks, inside the context."""
        store = self.ctx.gradients
        finished: list[torch.Tensor] = []
        for var, grad in completed:
            ddp = _ddp_index.lookup(var) if self.ddp_waiting else None
            waiting = self.ddp_waiting.get(ddp) if ddp is not None else None
            if waiting is not None:
                self.ddp_grads[ddp][var] = grad
                waiting.discard(var)
                if not waiting:
                    del self.ddp_waiting[ddp]
                    for param, avg in average_ddp_gradients(ddp, self.ddp_grads.pop(ddp)):
                        store.add(param, avg)
                        finished.append(param)
                continue
            if grad is not None:
                store.add(var, grad)
                finished.append(var)
        hooked = [v for v in finished if v._post_accumulate_grad_hooks]
        if hooked:
            previous = ContextContainer.enter(self.ctx)
            try:
                for var in hooked:
                    for hook in list(var._post_accumulate_grad_hooks.values()):
                        hook(var)
            finally:
                ContextContainer.leave(previous)

    def _describe(self, event: PassEvent) -> str:
        """The profiler range of one event: where its gradients came from."""
        if type(event) is RootsEvent:
            return "mpidag.autograd.gradients(roots)"
        if type(event) is not GradientsEvent:
            return f"mpidag.autograd.resolve({self.agent.info.name})"
        send = self.ctx.sends.get(_first(event.message_id))  # from where it sent to
        origin = "?" if send is None else self.agent.workers[send.peer].name
        return f"mpidag.autograd.gradients({origin} -> {self.agent.info.name})"

    def _make_plan(self, root_edges: list | None) -> None:
        """The pass's plan: its sources (the roots of ``backward()`` on the root's rank,
        then every send function of the context) and what each reaches (:func:`make_plan`).
        ``NativePassState``'s is ``PassCore._make_plan`` in C++, which does the same for a
        DisjointPlan and calls :meth:`_plan_of` for the rest."""
        with self.ctx.lock:
            sends = list(self.ctx.sends.values())
        sources = [] if root_edges is None else [root_edges]
        reaches = [] if root_edges is None else [None]
        self.source_send = [] if root_edges is None else [None]
        for send in sends:
            self.source_of[send.message_id] = len(sources)
            sources.append(send.edges)
            reaches.append(send.prepare())
            self.source_send.append(send)
        self._plan_of(sources, reaches)

    def _plan_of(self, sources: list[list[Any]], reaches: list[Any],
                 disjoint: bool = True) -> None:
        """The plan of ``sources`` (:attr:`source_of` and :attr:`source_send` already
        name them), its DDP modules, and SMART mode's answers for the recv functions no
        source reaches. ``disjoint`` false: the C++ ``disjoint_plan`` already said no."""
        watch = _ddp_watch()
        ddp_possible = watch is not None
        self.plan = make_plan(sources, RECV_NODE_TYPES, reaches, watch=watch,
                              native=self.ctx.container.native, disjoint=disjoint)
        if type(self.plan) is not Plan:  # native's DisjointPlan: one C++ call an event
            self.plan.name_sources([None if send is None else send.message_id
                                    for send in self.source_send])
            self.native_step = self.plan.step
        for node in self.plan.leaf_mask if ddp_possible else ():
            ddp = _ddp_index.averaged(_ddp_index.lookup(node.variable))
            if ddp is not None:
                _check_ddp(ddp)
                if ddp not in self.ddp_waiting:
                    self.ddp_waiting[ddp] = set()
                    self.ddp_grads[ddp] = {}
                self.ddp_waiting[ddp].add(node.variable)
        if self.smart:
            self._answer_unreached()

    def _source_what(self, index: int) -> str:
        """What source ``index`` of the plan is, for reports (made only when one waits)."""
        send = self.source_send[index]
        return "the roots of backward()" if send is None else \
            f"{send.what} (from rank {self.agent.rank})"

    def _recv_nodes(self) -> dict[int, Any]:
        """The recv nodes this pass reaches, by message id."""
        if self._recv_node_of is None:
            self._recv_node_of = {node.record.message_id: node for node in self.plan.recv_mask}
        return self._recv_node_of

    def _unreached_records(self) -> list[Any]:
        """The records of the context's recv functions that no source of this rank
        reaches (listed again only when the context has a recv function more)."""
        recvs = self.ctx.recvs
        count, records = self._unreached
        if count != len(recvs):
            reached = self._recv_nodes()
            with self.ctx.lock:
                count = len(recvs)
                records = [r for mid, r in recvs.items() if mid not in reached]
            self._unreached = (count, records)
        return records

    def _answer_unreached(self) -> None:
        """SMART: no source of this rank reaches these recv functions, so their send
        functions will never get a gradient in this pass: say so at once, without waiting
        for a question (nothing is sent when every RPC of the context is used)."""
        for record in self._unreached_records():
            if record.message_id not in self.resolved:
                self.resolved.add(record.message_id)
                self._send(record.peer, record.message_id, None)

    # ------------------------------------------------------------ SMART mode
    def _resolve(self, message_id: int) -> None:
        """SMART: another rank's send function ``message_id`` waits for the gradient of this
        rank's recv function of that message. Answer "no gradient" now if no source of this
        rank reaches it (done when this rank planned: :meth:`_answer_unreached`); otherwise
        ask about each of its sources that has not arrived."""
        if message_id in self.resolved:  # (unreached ones were answered by the plan)
            return
        self.resolved.add(message_id)
        plan = self.plan
        node = self._recv_nodes().get(message_id)
        if node is None or node in plan.fired:  # None: no such recv function here
            return
        pending = plan.recv_mask[node] & ~plan.arrived
        for index in range(plan.n_sources):
            if pending >> index & 1:
                send = self.source_send[index]
                if send is not None:
                    self._ask(send.peer, send.message_id)

    def _ask(self, peer: int, message_id: int) -> None:
        """SMART: ask ``peer`` whether its recv function of ``message_id`` can still fire (a
        call of the termination protocol, like a gradient message)."""
        if message_id in self.asked:
            return
        self.asked.add(message_id)
        self._call(peer, self.autograd.resolve_handler,
                   (self.ctx.context_id, self.pass_id, message_id, self.retain_graph))

    def _send(self, peer: int, message_id: int | tuple[int, ...],
              grads: list[torch.Tensor | None] | None) -> None:
        """The gradients of this rank's recv function ``message_id`` to the rank of its send
        function (``None``: SMART mode's "no gradient can come"); for a tuple of ids (recv
        functions of one peer that fired together), all their gradients one after the
        other. The arguments are flat and the tensors contiguous, a broadcast one (a loss's
        gradient) as its distinct elements and its shape (:func:`_compact`): a message of a
        few small CPU gradients is a plain call, sent and served by the compiled path."""
        with self.lock:  # (engaged while this rank runs: the parent stays until the answer)
            to_parent = self.parent is not None and peer == self.parent_rank
            if to_parent:
                self.handed_over += 1
        flags = (RETAIN_GRAPH if self.retain_graph else 0) | (SMART if self.smart else 0) | \
            (NO_GRADIENT if grads is None else 0) | (TO_PARENT if to_parent else 0)
        compacted = None if not grads or self.compact_grads is None else \
            self.compact_grads(grads, COMPACT_MIN_NUMEL)  # (None: done in Python)
        if compacted is None:
            pairs = [_compact(g) for g in grads or ()]
            sent = [g for g, _ in pairs]
            shapes: list | None = [shape for _, shape in pairs]
            if all(shape is None for shape in shapes):
                shapes = None
        else:
            sent, shapes = compacted
        args = (self.ctx.context_id, self.pass_id, message_id,
                flags | (EXPANDED if shapes is not None else 0), *sent, *(shapes or ()))
        if not to_parent:
            self._call(peer, self.autograd.gradients_handler, args)
            return
        try:  # the parent waits for it in this rank's place: no answer to wait for
            self.agent.notify(peer, self.autograd.gradients_handler, args)
        except BaseException:
            with self.lock:
                self.handed_over -= 1
            raise

    def _call(self, peer: int, handler: Any, args: tuple) -> None:
        """A call of the termination protocol: counted until answered."""
        with self.lock:
            self.deficit += 1
        try:
            fut = self.agent.call(peer, handler, args, {}, timeout=0, record=False)
        except BaseException:
            with self.lock:
                self.deficit -= 1
            raise
        fut.add_internal_callback(self._answered)  # (short: may run on the leader)

    def _answered(self, fut: torch.futures.Future) -> None:
        error = future_error(fut)
        with self.lock:
            self.deficit -= 1
            if error is not None:  # (its count travels with it when it pickles)
                self.handed_to_me += error.__dict__.pop(_HANDED_OVER, 0)
                self.errors.append(error)
            else:
                self.handed_to_me += merge_answer(self.reports, fut.value())
        self._maybe_finish()

    # -------------------------------------------------------- termination
    def _own_report(self) -> Report:
        plan = self.plan
        if plan is None:
            return {}
        unused = [r.what for r in self._unreached_records()]
        if self.native_step is not None:  # (a DisjointPlan: no source ever waits)
            return {self.agent.rank: (self.seq, unused, [], [])}
        stuck = plan.waiting_sources()
        waiting = [self._source_what(i) for i in stuck]
        waiting_ids = [(self.source_send[i].peer, self.source_send[i].message_id)
                       for i in stuck if self.source_send[i] is not None]
        return {self.agent.rank: (self.seq, unused, waiting, waiting_ids)}

    def _maybe_finish(self) -> None:
        with self.lock:
            if self.running or self.events or self.deficit or self.parent is None or \
                    (self.handed_to_me and not self.errors):
                return  # (a failed pass does not wait for notifications whose count was lost)
            parent, self.parent = self.parent, None
            handed_over, self.handed_over, self.parent_rank = self.handed_over, 0, None
            errors, self.errors = self.errors, []
            report, self.reports = self.reports, {}
        _merge(report, self._own_report())
        if not self.root and (errors or (self.plan is not None and self.plan.complete)):
            with self.ctx.lock:
                if self.ctx.passes.get(self.pass_id) is self:
                    del self.ctx.passes[self.pass_id]
        if errors:
            if handed_over:  # the parent waits for them: their count goes with the error
                errors[0].__dict__[_HANDED_OVER] = handed_over
            parent.set_exception(errors[0])
        else:
            parent.set_result(pack_answer(report, handed_over))




def _disjoint_terms() -> tuple[Any, bool] | None:
    """What ``PassCore._make_plan`` passes to ``disjoint_plan`` that changes at run time:
    ``(watch, direct)``, DDP's watch only where a process group exists (None where no
    DisjointPlan may be made now: :func:`graph.disjoint_terms`).

    Example::

        >>> _disjoint_terms()
        (None, True)
    """
    return disjoint_terms(_ddp_watch())


def _ddp_watch() -> Any:
    """DDP's watch of a plan's leaves (:meth:`_DDPIndex.watch`) where a process group
    exists, else ``None`` (no DDP module can average anything: nothing to watch).

    Example::

        >>> _ddp_watch() is None  # (no process group here)
        True
    """
    return _ddp_index.watch if _ddp_index.possible() else None


#: the C++ base of :class:`NativePassState` (None: the C++ records module is not built)
_PassCore: Any = getattr(records_module(), "PassCore", None)


if _PassCore is not None:
    class NativePassState(_PassCore, PassState):
        """:class:`PassState` with its event loop and termination counts in C++
        (``_mpidag_torch.PassCore``, ``mpidag/transport/torch_pass.cpp``): ``post``,
        ``_send``, ``_call``, ``_answered`` and ``_maybe_finish`` are the C++ ones, which
        run a DisjointPlan's roots and gradient messages with no Python frame and hand
        everything else (SMART mode's questions, a :class:`Plan`, a running profiler) to
        :meth:`PassState._handle`; the gradients, the messages and the answers are the
        same. Made for contexts of the C++ records (:func:`_pass_state`)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            PassState.__init__(self, *args, **kwargs)
            self._bind()

    _PassCore.configure({
        "RootsEvent": RootsEvent, "GradientsEvent": GradientsEvent,
        "ResolveEvent": ResolveEvent, "event_numbers": _event_numbers,
        "profiler": _profiler_module, "merge_answer": merge_answer, "merge": _merge,
        "pack_answer": pack_answer, "py_send": PassState._send,
        "py_own_report": PassState._own_report, "dropped": _drop_foreign,
        "handed_key": _HANDED_OVER, "max_batch": MAX_BATCH,
        "COMPACT_MIN_NUMEL": COMPACT_MIN_NUMEL, "RETAIN_GRAPH": RETAIN_GRAPH,
        "SMART": SMART, "NO_GRADIENT": NO_GRADIENT, "TO_PARENT": TO_PARENT,
        "EXPANDED": EXPANDED, "disjoint_terms": _disjoint_terms,
        "py_make_plan": PassState._make_plan, "py_plan_of": PassState._plan_of,
        "recv_types": RECV_NODE_TYPES, "AccumulateGrad": AccumulateGrad,
        "native": records_module(), "graph_globals": vars(graph)})
else:
    NativePassState = None  # type: ignore[assignment,misc]


def _pass_state(ctx: DistAutogradContext) -> type[PassState]:
    """The class of a pass's state in ``ctx``: :class:`NativePassState` where the context's
    records are the C++ ones, else :class:`PassState`."""
    if NativePassState is not None and ctx.container.native is not None:
        return NativePassState
    return PassState


def _first(message_id: int | tuple[int, ...]) -> int:
    """The (first) send function a gradient message is for: all of its send functions sent
    to the same rank."""
    return message_id[0] if type(message_id) is tuple else message_id


def check_roots(roots: Any) -> list[torch.Tensor]:
    """The roots as a list, or a clear error naming the bad one (torch's types and words
    first, then what to do).

    Example::

        >>> check_roots([])
        Traceback (most recent call last):
        RuntimeError: No tensors provided for gradient computation: pass roots=[loss]
    """
    if isinstance(roots, torch.Tensor):
        roots = [roots]
    if not isinstance(roots, (list, tuple)):
        raise TypeError(f"backward(): incompatible function arguments: roots must be a list "
                        f"of tensors, got {type(roots).__name__}")
    if not roots:
        raise RuntimeError("No tensors provided for gradient computation: pass roots=[loss]")
    for i, root in enumerate(roots):
        if not isinstance(root, torch.Tensor):
            raise TypeError(f"backward(): incompatible function arguments: roots[{i}] must be "
                            f"a tensor, got {type(root).__name__}")
        if not root.requires_grad:
            raise RuntimeError(
                f"requires_grad not set on roots[{i}]: element {i} of tensors does not "
                f"require grad and does not have a grad_fn (it was not computed from tensors "
                f"that require grad)")
        if root.numel() != 1:
            raise RuntimeError(
                f"roots[{i}] of shape {tuple(root.shape)} is not a scalar, all roots need to "
                f"be scalar: reduce it first (e.g. loss.sum())")
        if root.grad_fn is None:
            raise RuntimeError(
                f"roots[{i}] does not have a valid gradient function: it is a leaf tensor; "
                f"a root must be computed from the tensors whose gradients you want")
    return list(roots)


class DistAutograd:
    """Distributed autograd of one rank: its contexts and its backward passes.

    Made with the agent it works through; registers the ``autograd.gradients`` handler (a
    gradient message, or SMART mode's "no gradient can come": a call, answered by the
    Dijkstra-Scholten rule above) and the ``autograd.resolve`` handler (SMART mode's question
    to a rank no message of the pass reached), and, through its :class:`ContextContainer`,
    the ``autograd.release`` handler, the call observer and a failure listener.

    Example::

        >>> autograd = runtime.autograd             # DistAutograd(runtime.agent)
        >>> ctx = autograd.container.new_context()
        >>> previous = autograd.container.enter(ctx)
        >>> x = torch.ones(2, requires_grad=True)
        >>> loss = rpc.rpc_sync("worker1", torch.mul, args=(x, 2)).sum()
        >>> autograd.container.leave(previous)
        >>> autograd.backward(ctx.context_id, [loss], retain_graph=False, mode="smart")
        >>> ctx.gradients.snapshot()[x]
        tensor([2., 2.])
        >>> autograd.container.release(ctx)
    """

    def __init__(self, agent: RpcAgent) -> None:
        self.agent = agent
        self.container = new_container(agent)
        #: tensor hooks of intermediate tensors run once on their whole gradient (graph.py)
        self.close = track_intermediate_hooks()
        self.gradients_handler = agent.register_handler(
            "autograd.gradients", self._on_gradients, asynchronous=True,
            describe=lambda context_id, *_: f"gradients of autograd context {context_id}")
        self.resolve_handler = agent.register_handler(
            "autograd.resolve", self._on_resolve, asynchronous=True,
            describe=lambda context_id, *_: f"SMART mode question in autograd context "
                                            f"{context_id}")

    def _on_gradients(self, context_id: int, pass_id: int, message_id: int, flags: int,
                      *grads: torch.Tensor | None) -> torch.futures.Future | None:
        """On the rank of a send function: its gradients arrived (``message_id`` a tuple:
        several send functions', their gradients one after the other). ``flags``:
        :data:`RETAIN_GRAPH`, :data:`SMART`, :data:`NO_GRADIENT` (none can come),
        :data:`TO_PARENT` (a notification handed over by a rank this one engaged: no answer)
        and :data:`EXPANDED` (a shape per gradient follows: broadcast gradients travel as
        their distinct elements, :func:`_compact`); a call is answered per the protocol."""
        to_parent = bool(flags & TO_PARENT)
        if flags & EXPANDED:  # each gradient's shape follows the gradients
            grads = _expand_back(grads)
        reply = None if to_parent else torch.futures.Future()
        self._post(context_id, pass_id, bool(flags & RETAIN_GRAPH), bool(flags & SMART),
                   GradientsEvent(message_id, None if flags & NO_GRADIENT else list(grads),
                                  reply, to_parent))
        return reply

    def _on_resolve(self, context_id: int, pass_id: int, message_id: int, retain_graph: bool
                    ) -> torch.futures.Future:
        """On the rank of a recv function: SMART mode asks whether it can still fire."""
        reply: torch.futures.Future = torch.futures.Future()
        self._post(context_id, pass_id, retain_graph, True, ResolveEvent(message_id, reply))
        return reply

    def _post(self, context_id: int, pass_id: int, retain_graph: bool, smart: bool,
              event: GradientsEvent | ResolveEvent) -> None:
        """Hand a message of the termination protocol to this rank's share of the pass. With
        no such context, a call is answered with the error and a notification (no
        ``event.reply``) raises it, which the server logs."""
        ctx = self.container.contexts.get(context_id)
        if ctx is None:
            error = RuntimeError(
                f"the backward pass reached {self.agent.where()}, which has no autograd "
                f"context {context_id} (already released: did the `with context()` block end "
                f"before backward() returned?)")
            if event.reply is None:
                raise error
            event.reply.set_exception(error)
            return
        with ctx.lock:
            state = ctx.passes.get(pass_id)
            if state is None:
                state = ctx.passes[pass_id] = _pass_state(ctx)(
                    self, ctx, pass_id, retain_graph, root=False, smart=smart)
        state.post(event)

    def backward(self, context_id: int, roots: list[torch.Tensor],
                 retain_graph: bool = False, mode: str = "smart") -> None:
        """Run the distributed backward pass from ``roots``; return when it is done
        everywhere (raises the first error of any rank, with its type)."""
        if mode not in MODES:
            raise ValueError(f"mode must be 'smart' (exact gradients for any recorded graph, "
                             f"the default) or 'fast' (PyTorch's rule: every RPC of the "
                             f"context must take part in the backward pass), got {mode!r}")
        ctx = self.container.retrieve(context_id)
        roots = check_roots(roots)
        agent = self.agent
        edges = [edge_of(r) for r in roots]
        grads = [torch.ones_like(r, memory_format=torch.preserve_format) for r in roots]
        pass_id = agent.ids.next()
        state = _pass_state(ctx)(self, ctx, pass_id, bool(retain_graph), root=True,
                                 smart=mode == "smart")
        done: torch.futures.Future = torch.futures.Future()
        state.parent = done
        with ctx.lock:
            ctx.passes[pass_id] = state
        report: Report = {}
        try:
            with span(lambda: "mpidag.autograd.backward"):
                state.post(RootsEvent(edges, grads))
                agent.engine.wait_until(done.done, None)
                asked: set[tuple[int, int]] = set()
                while mode == "smart" and future_error(done) is None:
                    if not report and _says_nothing(done.value()):
                        break  # (the common case: every rank done, nothing reported)
                    merge_answer(report, done.value())
                    waiting = {w for entry in report.values() for w in entry[3]}
                    new = waiting - asked
                    if not new:
                        break  # done, or nothing new to ask (reported below)
                    asked |= new
                    done = torch.futures.Future()
                    with state.lock:
                        state.parent = done
                    state.post(AskEvent(sorted(new)))
                    agent.engine.wait_until(done.done, None)
        finally:
            with ctx.lock:
                ctx.passes.pop(pass_id, None)
        error = future_error(done)
        if error is not None:
            raise detached_copy(error)
        if report or not _says_nothing(done.value()):
            merge_answer(report, done.value())
            _check_report(report, ctx.context_id, mode)


def _check_report(report: Report, context_id: int, mode: str) -> None:
    waiting = [w for rank in sorted(report) for w in report[rank][2]]
    unused = [u for rank in sorted(report) for u in report[rank][1]]
    if waiting and mode == "smart":  # a defect, not a user error: say what is stuck
        raise RuntimeError(
            f"distributed backward of context {context_id} (SMART mode) could not finish: "
            f"{'; '.join(waiting)} still wait for a gradient after every rank was asked; "
            f"please report this with the program")
    if mode == "smart":
        return
    if waiting:
        raise UnusedRPCGradientError(
            f"distributed backward of context {context_id} could not finish: "
            f"{'; '.join(waiting)} never received a gradient, and other gradients depend on "
            f"them. FAST mode expects a gradient for every RPC of the context that carries "
            f"tensors requiring grad. Results the loss does not use: "
            f"{'; '.join(unused) or 'none found'}. Detach or drop those results, or make those "
            f"calls outside the autograd context.")
    if unused:
        warnings.warn(
            f"distributed backward did not reach {'; '.join(unused)}: no gradient flows back "
            f"through those RPCs (their results are not used by the loss)",
            UnusedRPCWarning, stacklevel=3)


# ------------------------------------------------- torch's DistributedDataParallel
class _DDPIndex:
    """Which torch ``DistributedDataParallel`` module (if any) a parameter belongs to.

    torch's DDP averages from hooks on the parameters' ``AccumulateGrad`` nodes that read
    torch's own thread-local distributed autograd context; mpidag's backward never runs
    those nodes, so it averages DDP's parameters itself (:func:`average_ddp_gradients`).
    The modules are found by one scan of the garbage collector's objects when a backward
    pass meets a ``Parameter`` not seen before while a process group exists (the answer is
    remembered per parameter, for the parameter's lifetime).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.of: WeakIdKeyDictionary = WeakIdKeyDictionary()  # param -> weakref(DDP) | None

    @staticmethod
    def possible() -> bool:
        """Whether a DDP module can average anything: a process group exists."""
        return _DIST and dist.is_initialized()

    def lookup(self, var: torch.Tensor) -> Any:
        """The live DDP module holding ``var``, or ``None``."""
        if not isinstance(var, torch.nn.Parameter) or not self.possible():
            return None  # no process group: no DDP module can average anything
        entry = self.of.get(var, False)
        if entry is False or (entry is not None and entry() is None):
            self._scan()
            entry = self.of.get(var, False)
            if entry is False or (entry is not None and entry() is None):
                self.of[var] = entry = None
        return None if entry is None else entry()

    def watch(self, var: torch.Tensor) -> bool:
        """Whether ``var`` is a parameter of a torch DDP module that must be averaged."""
        return self.averaged(self.lookup(var)) is not None

    @staticmethod
    def averaged(ddp: Any) -> Any:
        """``ddp`` if mpidag must average it in this backward (its last forward synced: not
        under ``no_sync()``, and not mpidag's own subclass), else ``None``."""
        if ddp is None or not getattr(ddp, "require_forward_param_sync", False) \
                or getattr(ddp, "_mpidag_averages_itself", False):
            return None
        return ddp

    def _scan(self) -> None:
        from torch.nn.parallel import DistributedDataParallel

        with self.lock:
            for obj in gc.get_objects():
                if isinstance(obj, DistributedDataParallel):
                    ref = weakref.ref(obj)
                    for param in getattr(obj, "_module_parameters", ()):
                        self.of[param] = ref


_DIST = dist.is_available()
_ddp_index = _DDPIndex()


def _check_ddp(ddp: Any) -> None:
    """A clear error for what mpidag cannot do on torch DDP's behalf."""
    unsupported = [name for name, on in (
        ("static_graph=True", getattr(ddp, "static_graph", False)),
        ("mixed_precision", getattr(ddp, "mixed_precision", None) is not None),
        ("the Python reducer (compiled autograd)", getattr(ddp, "_use_python_reducer", False)),
        ("delay_all_reduce_named_params", getattr(ddp, "_delay_all_reduce_all_params", False)),
        ("join() (uneven inputs)", getattr(getattr(ddp, "_join_config", None), "enable", False)),
    ) if on]
    if unsupported:
        raise RuntimeError(
            f"torch.nn.parallel.DistributedDataParallel with {', '.join(unsupported)} cannot "
            f"average gradients inside mpidag's distributed backward (its reducer works from "
            f"autograd hooks that only torch's own engine runs); wrap the module in "
            f"mpidag.nn.parallel.DistributedDataParallel, or drop that option")


def average_ddp_gradients(ddp: Any, grads: dict[torch.Tensor, torch.Tensor | None]
                          ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The gradients of a torch DDP module's parameters averaged over its process group, as
    its reducer would: through the reducer's own buckets, in their order, divided by the
    group's size before the communication hook (the default all-reduce, or the one
    registered with ``register_comm_hook``, which divides itself), so that ranks that joined
    early (``ddp.join()``) match; a parameter without a gradient here contributes zeros.
    Modules with sparse gradients (no flat buckets) all-reduce each parameter instead.
    Every member of the group must call this for the same module and backward.

    Example (on every member of the group: not run by the doctests, which have no process
    group)::

        averaged = average_ddp_gradients(ddp, {p: grads.get(p) for p in ddp.parameters()})
        # [(param, gradient averaged over the group)]
    """
    group = ddp.process_group
    divide = not getattr(ddp, "_comm_hooks", None)
    size = dist.get_world_size(group)
    sparse = any(g is not None and g.is_sparse for g in grads.values())
    try:
        buckets = None if sparse else ddp.reducer._get_zeros_like_grad_buckets()
    except RuntimeError:  # a sparse-gradient bucket has no flat buffer
        buckets = None
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    if buckets is None:
        for param in ddp._module_parameters:
            if not param.requires_grad:
                continue
            grad = grads.get(param)
            if grad is None:
                grad = torch.zeros_like(param)
            grad = grad / size if divide else grad.clone()
            dist.all_reduce(grad, group=group)
            out.append((param, grad))
        return out
    for bucket in buckets:
        params = bucket.parameters()
        for param, view in zip(params, bucket.gradients(), strict=True):
            grad = grads.get(param)
            if grad is not None:
                view.copy_(grad)
        if divide:
            bucket.buffer().div_(size)
        result = ddp.reducer._run_comm_hook(bucket).wait()
        if isinstance(result, (list, tuple)):
            result = result[0]
        bucket.set_buffer(result)
        for param, view in zip(params, bucket.gradients(), strict=True):
            out.append((param, view.clone()))
    return out
