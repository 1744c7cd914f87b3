"""Distributed autograd contexts and the recording of send/recv functions in the forward pass.

Each rank keeps its contexts in one :class:`ContextContainer` (per RPC agent). A context is
created by ``mpidag.autograd.context()`` on the rank that enters it, and on every other rank
when the first RPC of that context reaches it (the message header carries the context id).

Recording, for every message of a context that carries tensors needing grad (requests of
``rpc_sync``/``rpc_async``/``remote``/``to_here``/proxies and their replies):

* the sender makes a :class:`SendFunction`: the gradient edges of those tensors, kept in the
  context under a new autograd message id written into the header;
* the receiver makes the received tensors outputs of one recv node that carries a
  :class:`RecvRecord` with the same message id and the sender's rank (not views, so in-place
  ops on them work): a C++ ``RecvRpcBackward`` node of :mod:`mpidag.dist_autograd.native`
  where that is built (no next edges, as torch's), else the node of :class:`RecvRPC`, an
  autograd function (its input is the container's anchor tensor). Either type is in
  :data:`RECV_NODE_TYPES`; both read the record as ``node.record``.

Leaving the ``with`` block releases the context here and, through the ranks it exchanged
messages with, everywhere (the ``autograd.release`` control handler); ids of released
contexts are remembered, so a late message does not bring one back.

The container sees the agent's messages as its :class:`~mpidag.agent.agent.CallObserver`
(the one way autograd learns of RPC messages); besides that it registers the
``autograd.release`` handler and a failure listener in the agent, and
:class:`~mpidag.dist_autograd.engine.DistAutograd` registers the handlers of the backward
pass. Where mpidag's C++ records are built, :func:`new_container` gives the container a
first base class, ``_mpidag_torch.ContextRecorder`` (``transport/torch_recorder.cpp``),
whose C++ hooks (``outgoing``, ``replying``, ``received``, ``serving``, ``served``,
``sent``) and context life (``new_context``, ``incoming``, ``release``, ``release_id``) do
what the Python methods here do, on the same tables, and makes the records through their
slots; the rare cases (a late message of a released context, a functorch transform, a
custom Function's node to walk, a failed walk, a release message the agent's compiled
``notify`` does not take) call the Python methods.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import operator
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import GradientEdge

from mpidag.agent import fastpath
from mpidag.agent.agent import CallObserver, RpcAgent
from mpidag.agent.messages import CALL
from mpidag.dist_autograd.graph import AccumulateGrad, Reach, edges_and_reach
from mpidag.dist_autograd.native import records_module
from mpidag.transport.frames import Envelope

if TYPE_CHECKING:
    from mpidag.dist_autograd.engine import PassState

__all__ = [
    "ContextContainer",
    "DistAutogradContext",
    "GradientMap",
    "LiveCount",
    "RECV_NODE_TYPES",
    "RecvRPC",
    "RecvRecord",
    "SendFunction",
    "live_count",
    "new_container",
]

log = logging.getLogger(__name__)

#: how many released context ids a rank remembers (late messages of those are not recorded)
RELEASED_MEMORY = 1 << 16

#: what makes a send function's walking lock (the compiled container is bound to it);
#: None: the container's own lock type (``threading.Lock`` for the Python container, the
#: records module's ``Lock`` for the compiled one, which its C++ takes with a C call)
_walking_lock: Callable[[], Any] | None = None


class LiveCount:
    """How many objects of one kind are alive: counted when made and when freed (when
    the :meth:`ticket` each holds goes, in whichever thread frees it), without a lock
    either way. This is the Python one; :func:`live_count` gives the C one
    (``_mpidag_fastpath.LiveCount``) where it is built, whose tickets are counted from
    their C dealloc instead of a Python ``__del__`` (two Python calls less per recorded
    message: 2.5 % of the instructions of a call recorded in a new context).

    :meth:`made` and :meth:`freed` are one ``next()`` of an ``itertools.count`` each: one C
    call, atomic under the GIL, so no count is lost between threads, and a ``__del__`` that
    runs inside another count (a collection) has no lock to wait for. :attr:`live` reads
    the counts by advancing them (it knows by how much: readers take a lock of their own)
    as ``made``, ``freed``, ``made`` again, and retries until nothing was made between its
    two reads of ``made``: the value read is then the live count at the moment ``freed``
    was read (reading each count once let a thread make and free thousands of objects
    between the two reads, and the difference overstate the live count). Each
    :class:`ContextContainer` has its own (its runtime's figures, however many runtimes
    share the process).

    ``made()`` (one more object made) and ``freed()`` (one of them freed, from its
    ``__del__``) are the counts' own ``__next__``: no Python frame per object.

    Example::

        >>> sends = LiveCount()
        >>> _ = sends.made(), sends.made(), sends.freed()
        >>> sends.live
        1
        >>> ticket = sends.ticket()       # what a send function holds
        >>> sends.live
        2
        >>> del ticket
        >>> sends.live
        1
    """

    __slots__ = ("_made", "_freed", "made", "freed", "_read_lock", "_made_reads",
                 "_freed_reads")

    def __init__(self) -> None:
        self._made = itertools.count()
        self._freed = itertools.count()
        self.made: Callable[[], int] = self._made.__next__
        self.freed: Callable[[], int] = self._freed.__next__
        self._read_lock = threading.Lock()
        self._made_reads = self._freed_reads = 0  # how far reads advanced each count

    @property
    def live(self) -> int:
        """Objects made and not freed yet, as of this read."""
        with self._read_lock:
            attempts = 0
            while True:
                made = next(self._made) - self._made_reads
                freed = next(self._freed) - self._freed_reads
                made_after = next(self._made) - self._made_reads - 1
                self._made_reads += 2
                self._freed_reads += 1
                if made_after == made:  # nothing made meanwhile: exact when freed was read
                    return made - freed
                attempts += 1
                if attempts % 64 == 0:
                    time.sleep(0)  # let the threads that make objects move on

    def ticket(self) -> _Ticket:
        """One more object alive, until the returned ticket goes (the object holds it)."""
        return _Ticket(self)


class _Ticket:
    """One live object of a Python :class:`LiveCount`: counted as freed from its
    ``__del__``."""

    __slots__ = ("_freed",)

    def __init__(self, count: LiveCount) -> None:
        self._freed = count.freed
        count.made()

    def __del__(self) -> None:
        self._freed()


def live_count(compiled: bool = True) -> Any:
    """A :class:`LiveCount`: ``_mpidag_fastpath``'s (tickets counted in C) where it is built
    and ``compiled``, else the Python one; both have ``ticket()`` and ``live``.

    Example::

        >>> count = live_count()
        >>> tickets = [count.ticket() for _ in range(3)]
        >>> del tickets[0]
        >>> count.live
        2
    """
    module = fastpath.compiled_module() if compiled else None
    return LiveCount() if module is None else module.LiveCount()


class _Named:
    """``what``, the name of a message for errors and reprs: kept as a string, or as a
    callable asked for once, when first read (``_what``, a slot of the subclass)."""

    __slots__ = ()
    _what: str | Callable[[], str]

    @property
    def what(self) -> str:
        what = self._what
        if not isinstance(what, str):
            what = self._what = what()
        return what

    @what.setter
    def what(self, what: str) -> None:
        self._what = what


class SendFunction(_Named):
    """The sender's half of one message: where the gradients of its tensors go.

    Made with the sent tensors; their gradient edges, the walk of the graph behind them
    and the readable name are worked out by :meth:`prepare`, right after the message left
    (while the peer works), not on the path of the message: the edge of a leaf tensor costs
    1.8 us through torch's Python API (a view to find its gradient accumulator), 0.25 us
    through the C++ records (``native``: :mod:`mpidag.dist_autograd.native`).
    """

    __slots__ = ("_ticket", "message_id", "peer", "_tensors", "_edges", "_what", "reach",
                 "_walking", "_native", "__weakref__")

    def __init__(self, message_id: int, peer: int, tensors: list[torch.Tensor],
                 what: str | Callable[[], str], count: Any = None,
                 native: Any = None):
        #: counted among its container's live send functions (a LiveCount) while it lives
        self._ticket = None if count is None else count.ticket()
        self._native = native  # the C++ records module that finds the edges, or None
        self.message_id = message_id
        self.peer = peer  # the rank the tensors went to (and the gradients come from)
        self._tensors: list[torch.Tensor] | None = tensors  # until prepare() takes edges
        self._edges: list[GradientEdge] = []
        self._what = what
        self.reach: Reach | None = None
        self._walking = (_walking_lock or threading.Lock)()

    @property
    def edges(self) -> list[GradientEdge]:
        """One gradient edge per sent tensor that requires grad, in message order."""
        if self._tensors is not None:
            self.prepare()
        return self._edges

    def prepare(self) -> Reach:
        """Take the edges of the sent tensors and walk the graph behind them (it never
        changes) once: right after the message left, while the peer works, so the backward
        pass need not; a backward pass that starts meanwhile waits for that walk instead of
        doing it again."""
        with self._walking:
            if self._tensors is not None:
                self._edges, self.reach = edges_and_reach(self._tensors, RECV_NODE_TYPES,
                                                          self._native)
                self._tensors = None
                if not isinstance(self._what, str):  # the name now: the callable may hold
                    self._what = self._what()        # the call's arguments
            if self.reach is None:
                self.reach = Reach(self._edges, RECV_NODE_TYPES, self._native)
            return self.reach

    @property
    def next_functions(self) -> tuple[tuple[Any, int], ...]:
        """``((node, input_nr), ...)`` like a torch autograd node's (for inspection): the
        nodes the gradients of the sent tensors flow into, e.g. ``AccumulateGrad``."""
        return tuple((e.node, e.output_nr) for e in self.edges)

    def name(self) -> str:
        """torch's name of this node."""
        return "torch::distributed::autograd::SendRpcBackward"

    def __repr__(self) -> str:
        return f"SendRpcBackward(message_id=0x{self.message_id:x}, to rank {self.peer}, " \
               f"{self.what})"


class RecvRecord(_Named):
    """The receiver's half of one message, carried by its recv node (``node.record``).

    ``what`` names the message: a string, or a callable that gives it when first read
    (a call's name before its arguments are unpickled, which serving replaces: see
    :meth:`ContextContainer.received`). Such a callable must not hold the message: its
    tensors become the recv node's outputs, and the node holds this record, a cycle through
    C++ that Python's collector cannot see.
    """

    __slots__ = ("_ticket", "context_id", "message_id", "peer", "n_outputs", "_what", "node",
                 "__weakref__")

    def __init__(self, context_id: int, message_id: int, peer: int, n_outputs: int,
                 what: str | Callable[[], str], count: Any = None) -> None:
        #: counted among its container's live recv functions (a LiveCount) while it lives
        self._ticket = None if count is None else count.ticket()
        #: the recv node, once recorded: a weak reference (called, the node or None)
        self.node: Callable[[], Any] | None = None
        self.context_id = context_id
        self.message_id = message_id
        self.peer = peer  # the rank the tensors came from (and the gradients go to)
        self.n_outputs = n_outputs
        self._what = what

    def __repr__(self) -> str:
        return f"RecvRpcBackward(message_id=0x{self.message_id:x}, from rank {self.peer}, " \
               f"{self.what})"

    def local_backward_error(self) -> str:
        """What a plain local ``backward()`` that reaches the recv node raises (either
        node type asks its record).

        Example::

            >>> RecvRecord(7, 0x20001, 1, 1, "rpc torch.mul").local_backward_error()[:37]
            'a local backward() reached tensors re'
        """
        return (f"a local backward() reached tensors received over RPC ({self.what}, "
                f"distributed autograd context {self.context_id}); run the backward pass "
                f"with mpidag.autograd.backward(context_id, [loss]) so that their gradients "
                f"are sent back to rank {self.peer}")


class RecvRPC(torch.autograd.Function):
    """Makes received tensors outputs of one node (the recv function of a message).

    ``anchor`` (an empty tensor that requires grad, one per context) only makes autograd
    record the node; the tensors come in a list, so they are not inputs and the outputs are
    the received tensors themselves (no copy, not views). The distributed engine stops at
    this node and sends the gradients of its outputs to ``record.peer``; the node's own
    ``backward`` runs only if a plain local ``backward()`` reaches it, which is an error.
    """

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, record: RecvRecord,
                tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        ctx.record = record
        record.node = weakref.ref(ctx)  # ctx is the node (what the outputs' grad_fn is)
        return tuple(tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> None:
        raise RuntimeError(ctx.record.local_backward_error())


def _apply_recv(anchor: torch.Tensor, record: RecvRecord,
                tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``RecvRPC.apply(anchor, record, tensors)`` with grad mode on, without
    ``Function.apply``'s Python layer (2.6 instead of 3.6 us a message): RecvRPC has no
    ``setup_context`` and its arguments are no functorch wrappers, so that layer would only
    call the native ``apply``; under a functorch transform the full ``apply`` runs. Grad
    mode is switched on only when it is off (it is on in the threads that receive)."""
    if not torch.is_grad_enabled():
        with torch.enable_grad():
            return _apply_recv(anchor, record, tensors)
    if _functorch_active():
        return RecvRPC.apply(anchor, record, tensors)
    return _native_recv_apply(anchor, record, tensors)


#: the native ``_FunctionBase.apply`` bound to RecvRPC (what ``Function.apply`` ends in)
_native_recv_apply = super(torch.autograd.Function, RecvRPC).apply
_functorch_active = torch._C._are_functorch_transforms_active

#: the node type of the Python recv functions
RECV_NODE_TYPE: type = RecvRPC._backward_cls
# torch's name of the node, as ``grad_fn.name()`` and graph printers show it
RECV_NODE_TYPE.__name__ = "torch::distributed::autograd::RecvRpcBackward"

#: the node types of recv functions (what the engine looks for in the graph): the Python
#: one, and the C++ one where it is built (an agent with ``MPIDAG_COMPILED=0`` makes Python
#: ones in the same process)
RECV_NODE_TYPES: frozenset[type] = frozenset(
    t for t in (RECV_NODE_TYPE, getattr(records_module(), "RecvRpcBackward", None))
    if t is not None)


class GradientMap:
    """The gradients of one context: ``{leaf tensor: gradient}``, accumulated like
    ``AccumulateGrad`` does for ``.grad`` (a stored gradient is never shared with anything
    else, so adding in place is safe).

    Sparse COO gradients (``nn.Embedding(sparse=True)``) are kept sparse, as torch keeps
    them: a sparse gradient is stored without a copy when its indices and values are
    contiguous (cloned otherwise, or when one buffer reaches two leaves); a later sparse or
    dense gradient is added into a stored dense one in place, a sparse one into a stored
    sparse one in place (the sum stays sparse, uncoalesced), and a dense gradient onto a
    stored sparse one makes a new dense sum.

    Example::

        >>> weight = torch.zeros(4, 2, requires_grad=True)
        >>> grads = GradientMap()
        >>> grads.add(weight, torch.sparse_coo_tensor([[1]], [[1.0, 2.0]], (4, 2)))
        >>> grads.snapshot()[weight].is_sparse
        True
        >>> grads.add(weight, torch.ones(4, 2))       # sparse + dense: a dense sum
        >>> grads.snapshot()[weight][1]
        tensor([2., 3.])
    """

    __slots__ = ("grads", "_owned", "_storage", "lock")

    def __init__(self) -> None:
        self.grads: dict[torch.Tensor, torch.Tensor] = {}
        self._owned: set[int] = set()  # ids of stored tensors that are safe to add into
        self._storage: set[int] = set()  # data pointers of the stored tensors
        self.lock = threading.Lock()

    def add(self, variable: torch.Tensor, grad: torch.Tensor) -> None:
        with self.lock:
            old = self.grads.get(variable)
            if old is None:
                new = _own_copy(grad, variable)
                if new is grad:
                    data = grad._values() if grad.is_sparse else grad
                    if data.data_ptr() in self._storage or not data.numel():
                        new = grad.clone()  # one engine buffer handed to two leaves (a + b)
                self.grads[variable] = new
                self._storage.add((new._values() if new.is_sparse else new).data_ptr())
                self._owned.add(id(new))
            elif id(old) in self._owned and (grad.is_sparse or not old.is_sparse):
                old.add_(grad)  # dense += dense or sparse; sparse += sparse
            else:
                self._owned.discard(id(old))
                self.grads[variable] = new = grad + old if old.is_sparse else old + grad
                self._owned.add(id(new))

    def snapshot(self) -> dict[torch.Tensor, torch.Tensor]:
        with self.lock:
            return dict(self.grads)

    def __len__(self) -> int:
        return len(self.grads)


def _own_copy(grad: torch.Tensor, variable: torch.Tensor) -> torch.Tensor:
    """``grad`` as a tensor this map may keep and change: taken as it is when it has the
    variable's layout (only the engine's own buffers and received gradients reach here; one
    buffer handed to two leaves is caught by the caller), copied when it is a broadcast or
    laid out otherwise (copying a 1024x1024 weight gradient costs 1.8 ms here). A sparse
    COO gradient is taken as it is when its indices and values are contiguous (torch's
    ``AccumulateGrad`` rule), cloned otherwise."""
    if grad.is_sparse:
        if grad._indices().is_contiguous() and grad._values().is_contiguous():
            return grad
        return grad.clone()
    if grad.layout is not torch.strided:
        return grad.clone()
    if grad.shape == variable.shape and grad.stride() == variable.stride() \
            and not grad.is_conj() and not grad.is_neg():
        return grad  # views too (a Linear's weight gradient is one): the map owns them
    return torch.empty_like(variable, dtype=grad.dtype).copy_(grad)


class DistAutogradContext:
    """One rank's state of one distributed autograd context.

    Mirrors torch's ``DistAutogradContext``: ``_context_id()``, ``_send_functions()``,
    ``_recv_functions()``, ``_known_worker_ids()``.

    Example::

        >>> x = torch.ones(2, requires_grad=True)
        >>> with dist_autograd.context() as context_id:
        ...     y = rpc.rpc_sync("worker1", torch.mul, args=(x, 2))
        ...     ctx = dist_autograd._current_context()
        ...     ctx._send_functions()
        ...     ctx._known_worker_ids()
        {...: SendRpcBackward(...)}
        {1}
    """

    __slots__ = ("container", "context_id", "lock", "sends", "recvs", "known_workers",
                 "_gradients", "passes", "released", "__weakref__")

    def __init__(self, container: ContextContainer, context_id: int) -> None:
        self.container = container
        self.context_id = context_id
        self.lock = threading.Lock()
        self.sends: dict[int, SendFunction] = {}
        self.recvs: dict[int, RecvRecord] = {}
        self.known_workers: set[int] = set()
        self._gradients: GradientMap | None = None  # made by the first pass that stores one
        self.passes: dict[int, PassState] = {}
        self.released = False

    @property
    def gradients(self) -> GradientMap:
        """The gradients accumulated in this context on this rank (made when first asked
        for: most contexts of a rank that only serves calls never store one)."""
        gradients = self._gradients
        if gradients is None:
            with self.lock:
                if self._gradients is None:
                    self._gradients = GradientMap()
                gradients = self._gradients
        return gradients

    @property
    def anchor(self) -> torch.Tensor:
        """The tensor that makes autograd record a recv function (shared by the contexts of
        a container: it never gets a gradient, the engine stops at recv functions)."""
        return self.container.anchor

    def _context_id(self) -> int:
        return self.context_id

    def _send_functions(self) -> dict[int, SendFunction]:
        with self.lock:
            return dict(self.sends)

    def _recv_functions(self) -> dict[int, Any]:
        """``{message id: recv node}`` as torch's: the node the received tensors'
        ``grad_fn`` is (its record when the graph is gone)."""
        with self.lock:
            records = dict(self.recvs)
        nodes = {}
        for message_id, record in records.items():
            node = record.node() if record.node is not None else None
            nodes[message_id] = node if node is not None else record
        return nodes

    def _known_worker_ids(self) -> set[int]:
        with self.lock:
            return set(self.known_workers)

    def __repr__(self) -> str:
        return (f"DistAutogradContext(id={self.context_id}, sends={len(self.sends)}, "
                f"recvs={len(self.recvs)}, known_workers={sorted(self.known_workers)})")


class _ThreadContext(threading.local):
    """The distributed autograd context each thread is in (``ctx``; ``None``: none). A class
    default, so that a thread that never entered one reads ``None`` without the
    ``AttributeError`` a missing thread-local attribute costs (0.3 us)."""

    ctx: DistAutogradContext | None = None


_current = _ThreadContext()

_requires_grad = operator.attrgetter("requires_grad")


class ContextContainer(CallObserver):
    """All distributed autograd contexts of one rank; the agent's call observer.

    Example::

        >>> container = runtime.autograd.container  # ContextContainer(runtime.agent)
        >>> ctx = container.new_context()
        >>> previous = container.enter(ctx)         # this thread's RPCs now record
        >>> x = torch.ones(2, requires_grad=True)
        >>> y = rpc.rpc_sync("worker1", torch.neg, args=(x,))
        >>> container.leave(previous)
        >>> ctx
        DistAutogradContext(id=1, sends=1, recvs=1, known_workers=[1])
        >>> container.release(ctx)                  # here and on worker1
    """

    def __init__(self, agent: RpcAgent) -> None:
        self.agent = agent
        self.rank = agent.rank
        self.contexts: dict[int, DistAutogradContext] = {}
        self.lock = threading.Lock()
        self._released: collections.deque[int] = collections.deque(maxlen=RELEASED_MEMORY)
        self._released_set: set[int] = set()
        #: whether this rank has a context (cached ``bool(self.contexts)``, updated under
        #: ``lock``): the agent skips :meth:`outgoing` on the hot path while it is false
        self.active = False
        #: the input of every recv function of this rank (see DistAutogradContext.anchor)
        self.anchor = torch.empty(0, requires_grad=True)
        #: the send functions and recv records this container made that are still alive
        #: (debug_info's num_live_*: a graph kept after its context was released)
        self.live_sends = live_count(agent.config.compiled)
        self.live_recvs = live_count(agent.config.compiled)
        #: the C++ records (None: the Python ones; MPIDAG_COMPILED=0 or not built)
        self.native = records_module(agent.config.compiled)
        self._ids = agent.ids  # (the agent's property, read once: every recorded call asks)
        self._release_handler = agent.register_handler(
            "autograd.release", self.release_id, mode="control")
        self._start_recording()  # (before the agent can call a hook: it is not started yet)
        agent.set_observer(self)
        agent.add_failure_listener(self._on_peer_failed)

    def _start_recording(self) -> None:
        """Ready the hooks before the agent first calls one: nothing for these Python
        hooks; :func:`new_container`'s compiled container binds its C++ ones here."""

    # ------------------------------------------------------ the agent's observer
    def outgoing(self, dst: int, tensors: list[torch.Tensor],
                 what: Callable[[], str]) -> tuple[int, int]:
        ctx = _current.ctx
        if ctx is None or ctx.container is not self:
            return 0, 0
        return self.record_send(ctx, dst, tensors, what)

    def replying(self, context_id: int, dst: int, tensors: list[torch.Tensor],
                 what: Callable[[], str]) -> int:
        return self.record_send(self.contexts.get(context_id), dst, tensors, what)[1]

    def received(self, env: Envelope, what: Callable[[], str]) -> DistAutogradContext | None:
        ctx = self.contexts.get(env.context_id)
        if ctx is None or env.src not in ctx.known_workers:  # (else incoming() gives ctx)
            ctx = self.incoming(env.context_id, env.src)
        if ctx is not None and env.message_id:
            # a call's name before unpickling (Server.arguments_from: the server and the
            # sender's rank) is kept uncalled: serving names the record once unpickled;
            # any other name may hold the message (an answer's holds the pending call)
            env.tensors = self.record_recv(ctx, env.message_id, env.src, env.tensors,
                                           what if env.kind == CALL else what())
        return ctx

    def serving(self, state: DistAutogradContext, message_id: int,
                what: Callable[[], str]) -> DistAutogradContext | None:
        if message_id:  # the recv record named once its call is unpickled
            record = state.recvs.get(message_id)
            if record is not None:
                record._what = what()  # (the ``what`` setter without its frame)
        previous, _current.ctx = _current.ctx, state
        return previous

    def served(self, token: DistAutogradContext | None) -> None:
        _current.ctx = token

    # -------------------------------------------------------------- lifetime
    def new_context(self) -> DistAutogradContext:
        ctx = DistAutogradContext(self, self._ids.next())
        with self.lock:
            self.contexts[ctx.context_id] = ctx
            self.active = True
        return ctx

    def retrieve(self, context_id: int) -> DistAutogradContext:
        """The context with this id on this rank; a clear error if there is none."""
        ctx = self.contexts.get(context_id)
        if ctx is None:
            if isinstance(context_id, bool) or not isinstance(context_id, int):
                raise TypeError(f"context_id must be an int (the value `with "
                                f"mpidag.autograd.context() as context_id` gives), got "
                                f"{type(context_id).__name__}")
            state = "was released (its `with` block ended)" if context_id in \
                self._released_set else "does not exist"
            raise RuntimeError(
                f"Could not find autograd context with id: {context_id} on "
                f"{self.agent.where()}: it {state}. Call backward/get_gradients inside "
                f"`with mpidag.autograd.context() as context_id:` with that id."
            )
        return ctx

    def incoming(self, context_id: int, src: int) -> DistAutogradContext | None:
        """The context a message from ``src`` belongs to, made if new (``None``: released)."""
        ctx = self.contexts.get(context_id)
        if ctx is None:
            with self.lock:
                ctx = self.contexts.get(context_id)
                if ctx is None:
                    if context_id in self._released_set:
                        self._late(context_id, src)
                        return None
                    ctx = self.contexts[context_id] = DistAutogradContext(self, context_id)
                    self.active = True
        if src not in ctx.known_workers:  # (an answer's sender is known: the call went there)
            with ctx.lock:
                ctx.known_workers.add(src)
        return ctx

    def release(self, ctx: DistAutogradContext, from_rank: int | None = None) -> None:
        """Drop ``ctx`` here and tell every rank it exchanged messages with."""
        context_id, contexts = ctx.context_id, self.contexts
        with self.lock:
            if contexts.get(context_id) is not ctx:
                return
            del contexts[context_id]
            self.active = bool(contexts)  # the agent asks outgoing() only while true
            self._remember(context_id)
        with ctx.lock:
            ctx.released = True
            peers = sorted(ctx.known_workers)
            if ctx.sends:
                ctx.sends.clear()
            if ctx.recvs:
                ctx.recvs.clear()
            if ctx.passes:
                ctx.passes.clear()
        if peers:
            self._tell_released(context_id, peers, from_rank)

    def _tell_released(self, context_id: int, peers: list[int],
                       from_rank: int | None) -> None:
        """Send the release of ``context_id`` to ``peers`` (but ``from_rank``, this rank and
        failed ranks)."""
        agent, me = self.agent, self.rank
        failed = agent.failed
        for peer in peers:
            if peer in (from_rank, me) or peer in failed or not agent.running:
                continue
            try:
                agent.notify(peer, self._release_handler, (context_id, me))
            except Exception:
                log.exception("could not send the release of context %d to rank %d",
                              context_id, peer)

    def release_id(self, context_id: int, from_rank: int) -> None:
        """The context ended on ``from_rank`` (the ``autograd.release`` handler)."""
        ctx = self.contexts.get(context_id)
        if ctx is None:
            with self.lock:
                self._remember(context_id)
            return
        self.release(ctx, from_rank)

    def _on_peer_failed(self, rank: int) -> None:
        """``rank`` failed: the contexts it created (its ``with`` blocks) can never be
        released by it, so release them here and on the other ranks that know them."""
        with self.lock:
            orphans = [ctx for cid, ctx in self.contexts.items()
                       if self.agent.ids.creator(cid) == rank]
        for ctx in orphans:
            self.release(ctx, from_rank=rank)

    @staticmethod
    def _late(context_id: int, src: int) -> None:
        log.debug("message of released context %d from rank %d: not recorded", context_id,
                  src)

    def _remember(self, context_id: int) -> None:
        released = self._released
        if len(released) == RELEASED_MEMORY:
            self._released_set.discard(released[0])
        released.append(context_id)
        self._released_set.add(context_id)

    # ---------------------------------------------------- the current context
    def current(self) -> DistAutogradContext | None:
        """The context this thread is in (entered with ``context()`` or serving an RPC)."""
        ctx = _current.ctx
        if ctx is None or ctx.container is not self:
            return None
        return ctx

    @staticmethod
    def enter(ctx: DistAutogradContext | None) -> DistAutogradContext | None:
        """Make ``ctx`` this thread's context; returns the previous one for :meth:`leave`."""
        previous = _current.ctx
        _current.ctx = ctx
        return previous

    @staticmethod
    def leave(previous: DistAutogradContext | None) -> None:
        _current.ctx = previous

    # ------------------------------------------------------------- recording
    def record_send(self, ctx: DistAutogradContext | None, dst: int,
                    tensors: list[torch.Tensor], what: Callable[[], str]
                    ) -> tuple[int, int]:
        """Header ids ``(context_id, message_id)`` of a message to ``dst`` in ``ctx``.

        Makes a send function when some of ``tensors`` require grad (message id 0 when none
        does: the message only carries the context to the callee).
        """
        if ctx is None or ctx.released:
            return 0, 0
        grad_tensors = list(filter(_requires_grad, tensors))  # (no comprehension's frame)
        if not grad_tensors:
            with ctx.lock:
                ctx.known_workers.add(dst)
            return ctx.context_id, 0
        message_id = self._ids.next()
        send = SendFunction(message_id, dst, grad_tensors, what, self.live_sends, self.native)
        with ctx.lock:
            ctx.known_workers.add(dst)
            ctx.sends[message_id] = send
        return ctx.context_id, message_id

    def record_recv(self, ctx: DistAutogradContext, message_id: int, src: int,
                    tensors: list[torch.Tensor], what: str | Callable[[], str]
                    ) -> list[torch.Tensor]:
        """``tensors`` as received in ``ctx``: those that require grad become outputs of a
        new recv function paired with the sender's send function ``message_id``; ``what``
        names it (see :class:`RecvRecord`)."""
        native = self.native
        if native is not None and not _functorch_active():
            record = RecvRecord(ctx.context_id, message_id, src, 0, what, self.live_recvs)
            result = native.record_recv(record, tensors)  # sets record.n_outputs
            if not record.n_outputs:  # no tensor requires grad: nothing to record
                return tensors
        else:
            index = [i for i, t in enumerate(tensors) if t.requires_grad]
            if not index:
                return tensors
            record = RecvRecord(ctx.context_id, message_id, src, len(index), what,
                                self.live_recvs)
            plain = [tensors[i].detach() for i in index]
            outs = _apply_recv(ctx.anchor, record, plain)
            result = list(tensors)
            for i, out in zip(index, outs, strict=True):
                result[i] = out
        with ctx.lock:  # src is a known worker already: incoming() made it one
            ctx.recvs[message_id] = record
        return result

    def prepare_send(self, context_id: int, message_id: int) -> None:
        """Precompute the reach of a send function just sent (never raises)."""
        ctx = self.contexts.get(context_id)
        send = None if ctx is None else ctx.sends.get(message_id)
        if send is not None:
            try:
                send.prepare()
            except Exception:  # the backward pass walks it again and reports what fails
                log.debug("could not walk the graph of %r", send, exc_info=True)

    #: the observer's ``sent`` (the agent's name for it) is :meth:`prepare_send` itself
    sent = prepare_send

    @staticmethod
    def _unprepared(send: SendFunction, error: BaseException) -> None:
        """The walk of a send function just sent failed (the compiled ``sent``'s report)."""
        log.debug("could not walk the graph of %r", send, exc_info=error)

    # ------------------------------------------------------------- debugging
    def torch_debug_info(self) -> dict[str, str]:
        """torch's two counters, as strings (``dist_autograd._get_debug_info()``)."""
        info = self.debug_info()
        return {"num_current_backward_passes": str(info["num_current_backward_passes"]),
                "num_autograd_contexts": str(info["num_autograd_contexts"])}

    def debug_info(self) -> dict[str, int]:
        """Every counter of the contexts and send/recv functions (leak checks, tools)."""
        with self.lock:
            contexts = list(self.contexts.values())
        return {
            "num_autograd_contexts": len(contexts),
            "num_current_backward_passes": sum(len(c.passes) for c in contexts),
            "num_send_functions": sum(len(c.sends) for c in contexts),
            "num_recv_functions": sum(len(c.recvs) for c in contexts),
            "num_live_send_functions": self.live_sends.live,
            "num_live_recv_functions": self.live_recvs.live,
        }


def new_container(agent: RpcAgent) -> ContextContainer:
    """The context container of ``agent``: one whose per-message hooks (``outgoing``,
    ``replying``, ``received``, ``serving``, ``served``, ``sent``) and context life
    (``new_context``, ``incoming``, ``release``, ``release_id``) are C++
    (``_mpidag_torch.ContextRecorder``, a first base class) where the C++ records are built
    and ``agent.config.compiled``, else the Python :class:`ContextContainer`. Both keep the
    same tables in the same Python objects; the compiled methods leave the rare cases (a
    late message, a functorch transform, a custom Function's node, a failed walk, a
    release message the agent's compiled ``notify`` does not take) to the Python
    methods.

    Example::

        >>> container = runtime.autograd.container  # new_container(runtime.agent)
        >>> isinstance(container, ContextContainer), runtime.agent.observer is container
        (True, True)
    """
    native = records_module(agent.config.compiled)
    recorder = getattr(native, "ContextRecorder", None)
    cls = ContextContainer if recorder is None else _compiled_container(recorder)
    return cls(agent)


@functools.cache
def _compiled_container(recorder: type) -> type[ContextContainer]:
    """:class:`ContextContainer` with the C++ hooks of ``recorder`` ahead of its own."""

    class CompiledContextContainer(recorder, ContextContainer):  # type: ignore[misc,valid-type]
        """A :class:`ContextContainer` whose per-message hooks and context life are C++
        (see ``torch_recorder.cpp``), working on the container's own tables."""

        def _start_recording(self) -> None:
            # the container's lock (and each context's and send function's, made by the
            # recorder) is the module's Lock, which the C++ takes by a C call instead of a
            # method call
            self.lock = self.native.Lock()
            self._bind_recorder(
                contexts=self.contexts, current=_current, ids=self._ids,
                SendFunction=SendFunction, RecvRecord=RecvRecord,
                DistAutogradContext=DistAutogradContext, Envelope=Envelope,
                live_sends=self.live_sends, live_recvs=self.live_recvs, native=self.native,
                lock=self.lock, released=self._released, released_set=self._released_set,
                rank=self.rank, walking_lock=_walking_lock or self.native.Lock,
                notify=None if self.agent.core is None else self.agent.core.notify,
                release_handler=self._release_handler,
                functorch_active=_functorch_active, call_kind=CALL,
                Parameter=torch.nn.Parameter, GradientEdge=GradientEdge,
                recv_types=RECV_NODE_TYPES, AccumulateGrad=AccumulateGrad, Reach=Reach)

    return CompiledContextContainer
