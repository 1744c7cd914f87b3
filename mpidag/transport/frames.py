"""Message framing: a fixed header, a pickled payload with tensors taken out, tensor frames.

No tensor byte ever enters a pickle. The pickler replaces each tensor by its index in a
tensor table; the table's specs (dtype, shape, device, flags) travel in the header frame;
the tensors' bytes travel either inline at the end of the header frame (small ones: one MPI
message in all) or as their own frames, received straight into freshly allocated tensors.

Frame 0 layout (little endian)::

    HEADER | payload pickle | tensor specs (struct) | pad to 16 | inline tensors (16-aligned)

A payload pickle larger than :data:`PAYLOAD_FRAME_LIMIT` does not go into frame 0: it
travels as a frame of its own, the first one on the message's data tag (so frame 0 stays
small and the payload is never copied into it); its 64-bit length is in the header, so any
size arrives.

What the pickler takes out of the pickle (into the tensor table, sent as raw bytes):

* tensors, also subclasses of ``torch.Tensor`` (rebuilt as their class on arrival, with their
  ``__dict__``, and still attached to the autograd graph on the sender, so distributed
  autograd records them like plain tensors);
* ``nn.Parameter``: see :class:`_TensorPickler`;
* numpy arrays of the dtypes torch can hold (sent zero-copy, rebuilt as numpy arrays);
* sparse COO tensors stay one entry of the table (distributed autograd records them as one
  tensor, as torch does); on the wire they are a spec of their own (size, ``requires_grad``,
  whether coalesced) followed by their indices and values as two plain tensors, rebuilt with
  ``torch.sparse_coo_tensor`` on arrival (:func:`assemble_sparse`). Other layouts (CSR, CSC,
  BSR, BSC, mkldnn) are refused with a ``TypeError`` that names the layout;
* objects of types registered by the layers above in a :class:`Codecs` (RRefs): reduced by
  their layer's function to a name and a state, rebuilt by the function registered for the
  name on the receiving side.

This module does not import MPI; :mod:`mpidag.transport.base` and its subclasses move the
frames.
"""

from __future__ import annotations

import copyreg
import ctypes
import io
import pickle
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mpidag.transport.torch_native import torch_module

__all__ = [
    "HEADER",
    "INLINE_LIMIT",
    "PAYLOAD_FRAME_LIMIT",
    "Codecs",
    "Envelope",
    "Header",
    "TensorSpec",
    "dumps",
    "loads",
    "assemble_sparse",
    "byte_view",
]

#: kind, flags, wire flags, n_tensors, data_tag, request_id, context_id, message_id,
#: payload length (64 bits), specs length, inline length
HEADER = struct.Struct("<BBBHIqqqQII")
#: tensors are copied into frame 0 while the inline part stays below this many bytes
INLINE_LIMIT = 128 * 1024
#: a payload pickle above this many bytes travels as a frame of its own
PAYLOAD_FRAME_LIMIT = 1 << 20
#: wire flag: the payload is the first frame on the data tag, not part of frame 0
WIRE_PAYLOAD_FRAME = 1
#: wire flag: some specs describe sparse COO tensors (decoded by the slower loop)
WIRE_SPARSE = 2
ALIGN = 16


def _align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


#: wire codes of dtypes; every rank runs the same mpidag, so the order is shared
_DTYPE_NAMES = [
    "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "bool",
    "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "complex32",
]
DTYPES = [getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)]
DTYPE_CODE = {dt: i for i, dt in enumerate(DTYPES)}
_DEVICE_TYPES = ["cpu", "cuda"]
_REQUIRES_GRAD = 1
#: spec flag: a sparse COO tensor, made of the next two specs (indices, values); the spec's
#: shape is the sparse tensor's size, its dtype the values' dtype
_SPARSE = 2
#: spec flag (with ``_SPARSE``): the sparse tensor is coalesced
_COALESCED = 4
_STRIDED = torch.strided
#: the spec of a tensor of each number of dimensions: dtype code, ndim, flags, device type,
#: device index, inline offset (-1: own frame), nbytes, then the shape (one pack per tensor)
_SPEC_NDIM = [struct.Struct(f"<BBBBhqq{ndim}q") for ndim in range(9)]


def _spec_struct(ndim: int) -> struct.Struct:
    return _SPEC_NDIM[ndim] if ndim < len(_SPEC_NDIM) else struct.Struct(f"<BBBBhqq{ndim}q")


#: device strings by (device type code, index), as :meth:`TensorSpec.unpack_from` makes them
_DEVICE_NAMES: dict[tuple[int, int], str] = {}


def _device_name(dev_type: int, dev_index: int) -> str:
    name = _DEVICE_NAMES.get((dev_type, dev_index))
    if name is None:
        name = _DEVICE_TYPES[dev_type] + (f":{dev_index}" if dev_index >= 0 else "")
        _DEVICE_NAMES[(dev_type, dev_index)] = name
    return name


@dataclass(slots=True)
class TensorSpec:
    """What the receiver needs to allocate a tensor before its bytes arrive."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str  # where it must land on the receiver ("cpu", "cuda:1")
    requires_grad: bool
    inline_offset: int  # offset in frame 0, or -1 for a frame of its own
    nbytes: int

    @classmethod
    def unpack_from(cls, buf: memoryview, pos: int) -> tuple[TensorSpec, int]:
        spec_struct = _spec_struct(buf[pos + 1])
        code, _ndim, flags, dev_type, dev_index, offset, nbytes, *shape = \
            spec_struct.unpack_from(buf, pos)
        spec = cls(DTYPES[code], tuple(shape), _device_name(dev_type, dev_index),
                   bool(flags & _REQUIRES_GRAD), offset, nbytes)
        return spec, pos + spec_struct.size


@dataclass(slots=True)
class SparseSpec:
    """A sparse COO tensor of a message: made of the received tensors ``at`` (indices) and
    ``at + 1`` (values) of the message's wire specs."""

    at: int
    shape: tuple[int, ...]
    requires_grad: bool
    coalesced: bool

    @classmethod
    def unpack_from(cls, buf: memoryview, pos: int, at: int) -> tuple[SparseSpec, int]:
        spec_struct = _spec_struct(buf[pos + 1])
        _code, _ndim, flags, _dev_type, _dev_index, _offset, _nbytes, *shape = \
            spec_struct.unpack_from(buf, pos)
        spec = cls(at, tuple(shape), bool(flags & _REQUIRES_GRAD), bool(flags & _COALESCED))
        return spec, pos + spec_struct.size


@dataclass(slots=True)
class Envelope:
    """One message, as the layers above the transport see it."""

    kind: int
    request_id: int = 0
    flags: int = 0
    context_id: int = 0
    message_id: int = 0
    payload: bytes | memoryview = b""
    tensors: list[torch.Tensor] = field(default_factory=list)
    src: int = -1  # filled in by the transport on receipt


class Codecs:
    """Types that the layers above the transport pickle by their own rule.

    ``register(cls, name, reduce, rebuild)``: an object of exactly ``cls`` is pickled as
    ``(name, reduce(obj, scope))``, where ``scope.context`` is the ``context`` given to
    :func:`dumps` (the destination rank, for the agent) and ``scope.on_failure(action)``
    registers a step that undoes the reduction's side effects if the message is not
    pickled after all; on the receiving side ``rebuild(state)`` makes the object. Each
    agent has one ``Codecs`` (its RRef layer registers the RRef type in it), so the objects
    are rebuilt by the layer of the agent that receives them, with no global lookup.

    Example::

        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Point:
        ...     x: int
        ...     y: int
        >>> codecs = Codecs()
        >>> codecs.register(Point, "point", lambda p, scope: (p.x, p.y), lambda s: Point(*s))
        >>> payload, tensors = dumps([Point(1, 2)], codecs=codecs)
        >>> loads(payload, tensors, codecs)
        [Point(x=1, y=2)]
    """

    __slots__ = ("reducers", "rebuilders", "version")

    def __init__(self) -> None:
        self.reducers: dict[type, tuple[str, Callable[[Any, Any], Any]]] = {}
        self.rebuilders: dict[str, Callable[[Any], Any]] = {}
        self.version = 0  # picklers rebuild their dispatch tables when it changes

    def register(self, cls: type, name: str, reduce: Callable[[Any, Any], Any],
                 rebuild: Callable[[Any], Any]) -> None:
        if name in self.rebuilders:
            raise ValueError(f"a codec named {name!r} is already registered")
        self.reducers[cls] = (name, reduce)
        self.rebuilders[name] = rebuild
        self.version += 1


_NO_CODECS = Codecs()
_local = threading.local()


def _from_table(index: int) -> torch.Tensor:
    """Unpickling hook: the ``index``-th received tensor of the message being loaded."""
    return _local.table[index]


def _parameter_from_table(index: int, requires_grad: bool,
                          cls: type = torch.nn.Parameter) -> torch.nn.Parameter:
    """Unpickling hook: a new ``nn.Parameter`` (or subclass) around a received tensor."""
    param = torch.nn.Parameter(_local.table[index], requires_grad=requires_grad)
    return param if cls is torch.nn.Parameter else param.as_subclass(cls)


def _subclass_from_table(index: int, cls: type, state: dict | None) -> torch.Tensor:
    """Unpickling hook: a received tensor as an instance of its tensor subclass ``cls``
    (an alias that stays attached to the received tensor's autograd node)."""
    tensor = _local.table[index].as_subclass(cls)
    if state:
        tensor.__dict__.update(state)
    return tensor


def _numpy_from_table(index: int) -> np.ndarray:
    """Unpickling hook: a received tensor as the numpy array it was sent as (no copy)."""
    return _local.table[index].numpy()


def _from_codec(name: str, state: Any) -> Any:
    """Unpickling hook: an object pickled by a :class:`Codecs` rule."""
    return _local.codecs.rebuilders[name](state)


def _numpy_as_tensor(array: np.ndarray) -> torch.Tensor | None:
    """The array as a tensor sharing its memory, or ``None`` when torch cannot hold it."""
    if not array.dtype.isnative or array.dtype.hasobject or any(s < 0 for s in array.strides):
        return None
    try:
        tensor = torch.from_numpy(array)
    except (TypeError, ValueError, RuntimeError):
        return None
    return tensor if tensor.dtype in DTYPE_CODE else None


def _default_reduce(obj: Any) -> Any:
    """What the pickler does for a type with no rule of its own."""
    return obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


class _DispatchTable(dict):
    """The pickler's reducers by exact type, filled on first sight of each type.

    The C pickler looks types up here only for objects that are not builtin scalars,
    containers, classes or Python functions, so a call like ``(f, args, kwargs)`` pickles
    at the speed of plain ``pickle.dumps`` (a ``reducer_override`` method, called for every
    such object, the function included, made a no-op call's pickle 25 % slower). A type
    seen for the first time gets its rule from :meth:`__missing__` and keeps it.
    """

    __slots__ = ("pickler",)

    def __init__(self, pickler: _TensorPickler, codecs: Codecs) -> None:
        super().__init__()
        self.pickler = pickler
        self[torch.nn.Parameter] = pickler._reduce_parameter
        for cls, (name, reduce) in codecs.reducers.items():
            self[cls] = _codec_reducer(name, reduce, pickler)

    def __missing__(self, cls: type) -> Callable[[Any], Any]:
        pickler = self.pickler
        if issubclass(cls, torch.nn.Parameter):
            rule = pickler._reduce_parameter
        elif issubclass(cls, torch.Tensor):
            rule = pickler._reduce_subclass
        elif cls is np.ndarray:
            rule = pickler._reduce_numpy
        elif issubclass(cls, type):  # classes with a metaclass: the pickler saves them
            raise KeyError(cls)  # by name (a tensor subclass's class, enum classes)
        else:
            rule = copyreg.dispatch_table.get(cls) or _default_reduce
        self[cls] = rule
        return rule


def _codec_reducer(name: str, reduce: Callable[[Any, Any], Any], pickler: _TensorPickler
                   ) -> Callable[[Any], tuple]:
    def reducer(obj: Any) -> tuple:
        return _from_codec, (name, reduce(obj, pickler))
    return reducer


class _TensorPickler(pickle.Pickler):
    """Pickler that moves tensors (and numpy arrays) into ``self.tensors`` and pickles their
    index, and pickles registered types by their :class:`Codecs` rule (through its
    :class:`_DispatchTable`). One instance per thread is reused.

    ``nn.Parameter``: where ``detach_rule()`` says so (torch's rule for what its RPC
    pickles: the arguments and results of Python functions), it travels as torch's own
    pickling sends it: its data, detached, and its ``requires_grad`` flag, arriving as a new
    leaf ``Parameter`` (distributed autograd records no send function for it). Otherwise (a
    torch builtin op's arguments, an RRef's tensor value: torch sends those as TorchScript
    values) it travels as the tensor it is, autograd history and all.
    """

    def __init__(self) -> None:
        self.buffer = io.BytesIO()
        super().__init__(self.buffer, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        #: id of a plain tensor -> its index in the table (with its view, if strided)
        self._seen: dict[int, int | tuple] = {}
        self.busy = False
        #: what the caller of :func:`dumps` passed as ``context`` (the destination rank)
        self.context: Any = None
        self._undo: list[Callable[[], None]] | None = None
        self.detach_rule: Callable[[], bool] = _always
        self.detach_answer: bool | None = None  # the rule's answer, asked once per message
        #: dispatch tables by codecs (one per agent that pickles in this thread)
        self._tables: dict[int, tuple[Codecs, int, _DispatchTable]] = {}
        self._using: tuple[Codecs | None, int] = (None, -1)

    def use(self, codecs: Codecs) -> None:
        """Pickle the next object with the rules of ``codecs``."""
        if self._using[0] is codecs and self._using[1] == codecs.version:
            return
        self._using = (codecs, codecs.version)
        entry = self._tables.get(id(codecs))
        if entry is None or entry[0] is not codecs or entry[1] != codecs.version:
            entry = self._tables[id(codecs)] = (codecs, codecs.version,
                                                 _DispatchTable(self, codecs))
        self.dispatch_table = entry[2]

    def persistent_id(self, obj: Any) -> int | None:
        """A plain tensor is pickled as its index in the table (a persistent id): no global
        to look up on either side (pickling one tensor argument 1.2 us instead of 2.4 us
        through a reducer). Other objects are pickled as usual (``None``)."""
        if type(obj) is not _Tensor:
            return None
        index = self._seen.get(id(obj))
        if index is None:  # a tensor seen twice arrives once
            if not _contiguous(obj):
                span = _storage_span(obj)
                if span is not None:  # (index, size, stride): a view of the span sent
                    index = (len(self.tensors), tuple(obj.shape), obj.stride())
                    self._seen[id(obj)] = index
                    self.tensors.append(span)
                    return index
            index = self._seen[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return index

    def on_failure(self, action: Callable[[], None]) -> None:
        """Run ``action`` if this pickle is not finished (a codec's side effect to undo)."""
        if self._undo is None:
            self._undo = []
        self._undo.append(action)

    def _add(self, tensor: torch.Tensor) -> tuple:
        # the memo maps an object seen twice to one entry, so it arrives once
        self.tensors.append(tensor)
        return _from_table, (len(self.tensors) - 1,)

    def _reduce_subclass(self, tensor: torch.Tensor) -> tuple:
        state = getattr(tensor, "__dict__", None) or None
        index = self._add(tensor.as_subclass(torch.Tensor))[1][0]
        return _subclass_from_table, (index, type(tensor), state)

    def _reduce_numpy(self, array: np.ndarray) -> Any:
        tensor = _numpy_as_tensor(array)
        if tensor is None:
            return _default_reduce(array)
        return _numpy_from_table, self._add(tensor)[1]

    def _reduce_parameter(self, param: torch.nn.Parameter) -> tuple:
        if self.detach_answer is None:
            self.detach_answer = bool(self.detach_rule())
        if not self.detach_answer:
            if type(param) is torch.nn.Parameter:
                return self._add(param)
            return self._reduce_subclass(param)
        self.tensors.append(param.detach())
        return _parameter_from_table, (len(self.tensors) - 1, param.requires_grad, type(param))


def _always() -> bool:
    return True


#: types whose objects hold no tensor, RRef or other object with a rule of its own: a
#: value of these (or a tuple of at most 8 of them) is pickled with plain ``pickle.dumps``,
#: 0.2 us instead of 1.3 us through the tensor pickler
PLAIN_TYPES = frozenset({type(None), bool, int, float, str, bytes, complex})


def is_plain(obj: Any) -> bool:
    """Whether ``obj`` is a plain value (see :data:`PLAIN_TYPES`) or a short tuple of them.

    Example::

        >>> is_plain((1, "a", None)), is_plain((torch.ones(1),))
        (True, False)
    """
    cls = type(obj)
    if cls in PLAIN_TYPES:
        return True
    if cls is tuple and len(obj) <= 8:
        for item in obj:  # noqa: SIM110 - faster than all() over a generator
            if type(item) not in PLAIN_TYPES:
                return False
        return True
    return False


def dumps(obj: Any, detach_parameters: Callable[[], bool] = _always,
          codecs: Codecs = _NO_CODECS, prefix: bytes = b"", context: Any = None
          ) -> tuple[bytes | memoryview, list[torch.Tensor]]:
    """Pickle ``obj`` with its tensors taken out; returns ``(payload, tensors)`` (a pickle
    over :data:`PAYLOAD_FRAME_LIMIT` is a ``memoryview`` of the pickler's buffer, no copy).

    ``detach_parameters()`` (asked once, at the first ``nn.Parameter``) tells how
    parameters travel: see :class:`_TensorPickler`. ``codecs``: types pickled by the rules
    of the layers above (see :class:`Codecs`). ``prefix``: bytes written before the pickle
    in the payload (the caller skips them before :func:`loads`). ``context``: passed to the
    codecs' reduce functions as ``scope.context`` (the agent passes the destination rank);
    ``scope.on_failure(action)`` registers an undo step run if the pickle fails.

    Example::

        >>> payload, tensors = dumps({"x": torch.ones(2), "n": 3})
        >>> len(tensors), loads(payload, tensors)["n"]
        (1, 3)
    """
    if is_plain(obj):
        return prefix + pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), []
    if type(obj) is _Tensor and not prefix and _contiguous(obj):
        return _LONE_TENSOR, [obj]
    detach_answer = None
    if type(obj) is _Parameter and not prefix and _contiguous(obj):
        # an RRef's value or a builtin op's argument travels as the tensor it is, as the
        # pickler's rule sends it: a lone tensor (no pickler; the receiver's fast path)
        detach_answer = bool(detach_parameters())
        if not detach_answer:
            return _LONE_TENSOR, [obj]
        payload = _LONE_PARAMETER.get(obj.requires_grad)  # what the pickler would write
        if payload is not None:
            return payload, [obj.detach()]
    pickler = getattr(_local, "pickler", None)
    if pickler is None or pickler.busy:  # busy: a __reduce__ that pickles again
        pickler = _TensorPickler()
        if getattr(_local, "pickler", None) is None:
            _local.pickler = pickler
    buffer = pickler.buffer
    buffer.seek(0)
    buffer.truncate()
    if prefix:
        buffer.write(prefix)
    pickler.tensors = tensors = []
    pickler.busy = True
    pickler.detach_rule, pickler.detach_answer = detach_parameters, detach_answer
    pickler.context = context
    if pickler._using[0] is not codecs or pickler._using[1] != codecs.version:
        pickler.use(codecs)
    try:
        pickler.dump(obj)
        if buffer.tell() <= PAYLOAD_FRAME_LIMIT:
            return buffer.getvalue(), tensors
        # a large pickle: hand out the buffer itself (no copy) and retire this pickler
        if getattr(_local, "pickler", None) is pickler:
            _local.pickler = None
        return buffer.getbuffer(), tensors
    except BaseException:
        undo, pickler._undo = pickler._undo, None
        for action in reversed(undo or ()):
            action()
        raise
    finally:
        pickler.clear_memo()
        pickler._seen.clear()
        pickler.tensors = []
        pickler.detach_rule = _always
        pickler.context = pickler._undo = None
        pickler.busy = False


class _TableUnpickler(pickle.Unpickler):
    """Unpickler that resolves persistent ids to the message's received tensors."""

    def persistent_load(self, pid: Any) -> torch.Tensor:
        if type(pid) is tuple:  # a non-contiguous tensor: its strides over the span sent
            views = self.__dict__.setdefault("views", {})  # one view per tensor sent
            view = views.get(pid[0])
            if view is None:
                view = views[pid[0]] = _local.table[pid[0]].as_strided(pid[1], pid[2])
            return view
        return _local.table[pid]


def _contiguous(tensor: torch.Tensor) -> bool:
    try:
        return tensor.is_contiguous()
    except RuntimeError:  # sparse CSR & co. (refused with their layout where framed)
        return True


#: torch's rule (``cloneSparseTensors`` of its RPC): a view that uses less than half of a
#: storage of at least this many bytes travels as a copy (contiguous), else with its storage
RECOPY_BYTES = 8 * 1024


def _storage_span(tensor: torch.Tensor) -> torch.Tensor | None:
    """The part of a non-contiguous tensor's storage that its elements lie in, as a
    contiguous 1-D view (no copy), sent with the tensor's shape and strides so that the
    receiver gets a tensor of the same strides, as torch's RPC does (it sends the storage);
    ``None`` (sent as a contiguous copy): a tensor that is not strided, requires grad, has
    no elements, or uses less than half of a span of at least :data:`RECOPY_BYTES`.

    Example::

        >>> view = torch.arange(25.0).reshape(5, 5).narrow(1, 2, 2)
        >>> span = _storage_span(view)
        >>> span.shape, span.as_strided(view.shape, view.stride()).equal(view)
        (torch.Size([22]), True)
    """
    if tensor.layout is not _STRIDED or tensor.requires_grad or tensor.numel() == 0:
        return None
    stride = tensor.stride()
    if any(s < 0 for s in stride):
        return None
    extent = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, stride, strict=True))
    if extent * tensor.element_size() >= RECOPY_BYTES and extent >= 2 * tensor.numel():
        return None
    return tensor.as_strided((extent,), (1,))


_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
#: the payload of a message whose whole value is one plain tensor (a result, most often)
_LONE_TENSOR = b""  # set below, once the pickler exists


def _lone_tensor_payload() -> bytes:
    pickler = _TensorPickler()
    pickler.dump(torch.zeros(1))
    return pickler.buffer.getvalue()


_LONE_TENSOR = _lone_tensor_payload()
#: the payload of a message whose whole value is one plain tensor (the compiled call path
#: sends it too)
LONE_TENSOR_PAYLOAD = _LONE_TENSOR
#: requires_grad -> the payload of a message whose whole value is one ``nn.Parameter`` that
#: travels detached (a function's result): the pickler's own bytes, made once here
_LONE_PARAMETER: dict[bool, bytes] = {}  # empty while dumps makes them: the pickler writes
_LONE_PARAMETER.update(
    (rg, dumps(_Parameter(torch.zeros(1), requires_grad=rg))[0]) for rg in (False, True))
#: the same, the other way round, for :func:`loads`
_PARAMETER_OF_PAYLOAD = {payload: rg for rg, payload in _LONE_PARAMETER.items()}
_LONE_PARAMETER_LENGTHS = frozenset(len(p) for p in _LONE_PARAMETER.values())


def loads(payload: bytes | memoryview, tensors: list[torch.Tensor],
          codecs: Codecs = _NO_CODECS) -> Any:
    """Inverse of :func:`dumps`: unpickle ``payload``, putting ``tensors`` back in place and
    rebuilding registered types with ``codecs``. Not reentrant (no rebuild rule calls it)."""
    if not tensors:
        if codecs is _NO_CODECS:
            return pickle.loads(payload)
    elif len(payload) == len(_LONE_TENSOR) and payload == _LONE_TENSOR:
        return tensors[0]
    elif len(tensors) == 1 and len(payload) in _LONE_PARAMETER_LENGTHS:
        requires_grad = _PARAMETER_OF_PAYLOAD.get(bytes(payload))
        if requires_grad is not None:  # (as _parameter_from_table makes it)
            return _Parameter(tensors[0], requires_grad=requires_grad)
    local = _local
    local.table, local.codecs = tensors, codecs
    try:
        if not tensors:
            return pickle.loads(payload)
        return _TableUnpickler(io.BytesIO(payload)).load()
    finally:
        local.table = None  # the received tensors are freed with the message


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a tensor's values (a contiguous copy only when needed)."""
    t = tensor.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


_device_codes: dict[str, tuple[int, int]] = {"cpu": (0, -1)}


def _device_code(device: str) -> tuple[int, int]:
    code = _device_codes.get(device)
    if code is None:
        dev = torch.device(device)
        code = (_DEVICE_TYPES.index(dev.type), -1 if dev.index is None else dev.index)
        _device_codes[device] = code
    return code


def _dtype_code(tensor: torch.Tensor) -> int:
    """The dtype's wire code; raises for tensors RPC cannot send."""
    code = DTYPE_CODE.get(tensor.dtype)
    if code is None:
        raise TypeError(f"tensors of dtype {tensor.dtype} cannot be sent over RPC "
                        f"(supported: {[str(d) for d in DTYPES]})")
    if tensor.device.type not in _DEVICE_TYPES:
        raise TypeError(f"only CPU and CUDA tensors can be sent over RPC, not "
                        f"{tensor.device.type} tensors; move it with .cpu() first")
    return code


def pack_spec(tensor: torch.Tensor, device: str, inline_offset: int) -> bytes:
    """The wire spec of ``tensor`` landing on ``device`` (struct-packed, no pickle)."""
    code = DTYPE_CODE.get(tensor.dtype) if tensor.is_cpu else None
    if code is None:
        code = _dtype_code(tensor)  # CUDA tensors, and the error for what cannot travel
    shape = tensor.shape
    dev_type, dev_index = _device_codes.get(device) or _device_code(device)
    return _spec_struct(len(shape)).pack(
        code, len(shape), _REQUIRES_GRAD if tensor.requires_grad else 0, dev_type, dev_index,
        inline_offset, tensor.nbytes, *shape)


def make_spec(tensor: torch.Tensor, device: str, inline_offset: int) -> TensorSpec:
    """The :class:`TensorSpec` of ``tensor`` landing on ``device`` (a sparse COO tensor's
    ``nbytes`` counts its indices and values)."""
    _dtype_code(tensor)
    if tensor.layout is not _STRIDED:
        indices, values = sparse_parts(tensor)
        nbytes = indices.nbytes + values.nbytes
    else:
        nbytes = tensor.nbytes
    return TensorSpec(tensor.dtype, tuple(tensor.shape), device, tensor.requires_grad,
                      inline_offset, nbytes)


def sparse_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices and values of a sparse COO tensor, detached, as they travel (a
    ``TypeError`` naming the layout for any other non-strided tensor).

    Example::

        >>> s = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
        >>> [t.tolist() for t in sparse_parts(s)]
        [[[0, 2]], [1.0, 2.0]]
    """
    layout = tensor.layout
    if layout is not torch.sparse_coo:
        raise TypeError(
            f"tensors of layout {layout} cannot be sent over RPC: only strided (dense) and "
            f"sparse COO (torch.sparse_coo) tensors can; convert it first with .to_dense() "
            f"or, for a sparse one, .to_sparse() (COO)")
    return tensor._indices().detach(), tensor._values().detach()


def _sparse_head(tensor: torch.Tensor, device: str) -> bytes:
    """The wire spec that announces a sparse COO tensor (its two parts follow it)."""
    size = tensor.shape
    dev_type, dev_index = _device_codes.get(device) or _device_code(device)
    flags = _SPARSE | (_REQUIRES_GRAD if tensor.requires_grad else 0) \
        | (_COALESCED if tensor.is_coalesced() else 0)
    return _spec_struct(len(size)).pack(_dtype_code(tensor), len(size), flags, dev_type,
                                        dev_index, 0, 0, *size)


def assemble_sparse(received: list[torch.Tensor], sparse: list[SparseSpec]
                    ) -> list[torch.Tensor]:
    """The tensors of a message from its received wire tensors: each sparse COO tensor
    rebuilt from its indices and values (``sparse``: the header's :class:`SparseSpec` list),
    coalesced if it was, with its ``requires_grad`` flag.

    Example::

        >>> s = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,)).coalesce()
        >>> frame0, more = encode(Envelope(kind=1, tensors=[s]), ["cpu"], data_tag=0)
        >>> env, header = decode_header(frame0)
        >>> len(header.sparse), len(header.specs)    # s travels as indices and values
        (1, 2)
        >>> received = list(sparse_parts(s))          # what the receiver read for the specs
        >>> assemble_sparse(received, header.sparse)[0].to_dense()
        tensor([1., 0., 2., 0.])
    """
    out: list[torch.Tensor] = []
    pos = 0
    for spec in sparse:
        out.extend(received[pos:spec.at])
        indices, values = received[spec.at], received[spec.at + 1]
        tensor = torch.sparse_coo_tensor(indices, values, spec.shape,
                                         is_coalesced=spec.coalesced, check_invariants=False)
        if spec.requires_grad and (values.is_floating_point() or values.is_complex()):
            tensor.requires_grad_(True)
        out.append(tensor)
        pos = spec.at + 2
    out.extend(received[pos:])
    return out


#: zero bytes to pad parts of frame 0 to :data:`ALIGN`
_ZEROS = bytes(ALIGN)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A copy of a tensor's values as bytes (a CPU tensor's memory is copied with
    ``ctypes``: 0.7 us for 1 KiB, against 2.9 us through ``numpy()`` and a memoryview)."""
    if tensor.is_cpu and tensor.is_contiguous() and not tensor.is_conj() \
            and not tensor.is_neg():
        return ctypes.string_at(tensor.data_ptr(), tensor.nbytes)
    src = byte_view(tensor)
    if src.device.type != "cpu":
        src = src.cpu()
    return src.numpy().tobytes()


def encode_python(env: Envelope, devices: list[str], data_tag: int
                  ) -> tuple[bytearray | bytes, list[torch.Tensor | memoryview]]:
    """Build frame 0 and the list of what follows as frames of their own, in order: the
    payload (a ``memoryview``) when it is larger than :data:`PAYLOAD_FRAME_LIMIT`, then the
    tensors that do not fit inline. ``devices[i]`` is where tensor ``i`` must land on the
    receiver. Frames after frame 0 exist only with a ``data_tag`` (non-zero).
    """
    tensors = env.tensors
    payload = env.payload
    separate: list[torch.Tensor | memoryview] = []
    wire = 0
    if len(payload) > PAYLOAD_FRAME_LIMIT:
        if not data_tag:
            raise ValueError("a payload sent as its own frame needs a data tag")
        wire = WIRE_PAYLOAD_FRAME
        separate.append(memoryview(payload))
        in_frame0 = b""
    else:
        in_frame0 = payload
    if not tensors:
        header = HEADER.pack(env.kind, env.flags, wire, 0, data_tag, env.request_id,
                             env.context_id, env.message_id, len(payload), 0, 0)
        return header + in_frame0, separate
    packed: list[bytes] = []
    inline: list[bytes] = []
    inline_total = 0
    for tensor, device in zip(tensors, devices, strict=True):
        if tensor.layout is _STRIDED:
            parts: tuple[torch.Tensor, ...] = (tensor,)
        else:  # a sparse COO tensor: its spec, then its indices and values as tensors
            parts = sparse_parts(tensor)
            packed.append(_sparse_head(tensor, device))
            wire |= WIRE_SPARSE
        for part in parts:
            nbytes = part.nbytes
            if nbytes == 0:
                packed.append(pack_spec(part, device, 0))
            elif inline_total + nbytes <= INLINE_LIMIT:
                packed.append(pack_spec(part, device, inline_total))
                inline.append(_tensor_bytes(part))
                padded = _align(nbytes)
                if padded != nbytes:
                    inline.append(_ZEROS[:padded - nbytes])
                inline_total += padded
            else:
                packed.append(pack_spec(part, device, -1))
                separate.append(part)
    specs_blob = b"".join(packed)
    head_len = HEADER.size + len(in_frame0) + len(specs_blob)
    header = HEADER.pack(env.kind, env.flags, wire, len(packed), data_tag, env.request_id,
                         env.context_id, env.message_id, len(payload), len(specs_blob),
                         inline_total)
    # one copy of every part into the frame (a bytes join), inline tensors 16-aligned
    return b"".join([header, in_frame0, specs_blob, _ZEROS[:_align(head_len) - head_len],
                     *inline]), separate


@dataclass(slots=True)
class Header:
    """What frame 0 says about a message, besides the envelope fields."""

    data_tag: int
    specs: list[TensorSpec]
    inline_start: int
    payload_length: int
    payload_separate: bool  # the payload is the first frame on the data tag
    #: the sparse COO tensors made of the received tensors (``None``: none); the receiver
    #: passes the tensors of ``specs`` through :func:`assemble_sparse`
    sparse: list[SparseSpec] | None = None


def decode_header_python(frame: bytearray | bytes, src: int = -1
                         ) -> tuple[Envelope, Header | None]:
    """Parse frame 0: returns the envelope (without tensors; without payload when that
    travels as its own frame) and the :class:`Header` that says what follows, or ``None``
    for a message that is all in frame 0 and has no tensor (most calls and replies).
    ``src``: the sending rank, the envelope's ``src``."""
    (kind, flags, wire, n_tensors, data_tag, request_id, context_id, message_id, payload_len,
     specs_len, _inline_len) = HEADER.unpack_from(frame, 0)
    view = memoryview(frame)
    pos = HEADER.size
    separate = bool(wire & WIRE_PAYLOAD_FRAME)
    if not n_tensors and not separate:
        return Envelope(kind, request_id, flags, context_id, message_id,
                        view[pos:pos + payload_len], [], src), None
    in_frame0 = 0 if separate else payload_len
    payload = b"" if separate else view[pos:pos + payload_len]
    specs: list[TensorSpec] = []
    sparse: list[SparseSpec] | None = None
    inline_start = 0
    if n_tensors:
        pos += in_frame0
        end = pos + specs_len
        if wire & WIRE_SPARSE:
            sparse = []
            while pos < end:
                if frame[pos + 2] & _SPARSE:
                    head, pos = SparseSpec.unpack_from(frame, pos, len(specs))
                    sparse.append(head)
                else:
                    spec, pos = TensorSpec.unpack_from(frame, pos)
                    specs.append(spec)
        else:
            while pos < end:
                spec, pos = TensorSpec.unpack_from(frame, pos)
                specs.append(spec)
        inline_start = _align(end)
    env = Envelope(kind=kind, request_id=request_id, flags=flags, context_id=context_id,
                   message_id=message_id, payload=payload, src=src)
    return env, Header(data_tag, specs, inline_start, payload_len, separate, sparse)


def decode_message_python(frame: bytearray, src: int = -1) -> tuple[Envelope, Header | None]:
    """:func:`decode_header`, and a message whose tensors all lie inline in frame 0 for
    the CPU finished at once: its tensors made as views of frame 0 (no copy; frame 0 must
    be the message's own buffer), and no :class:`Header` (the message is complete). What
    the transports receive with; a header still says what follows frame 0.

    Example::

        >>> frame0, more = encode(Envelope(kind=1, tensors=[torch.ones(2, 2)]), ["cpu"], 0)
        >>> env, header = decode_message(bytearray(frame0))
        >>> header, env.tensors[0].shape
        (None, torch.Size([2, 2]))
    """
    env, header = decode_header_python(frame, src)
    if header is None or header.payload_separate or header.sparse:
        return env, header
    specs = header.specs
    for spec in specs:
        if spec.inline_offset < 0 or not spec.nbytes or spec.device != "cpu":
            return env, header
    start = header.inline_start
    env.tensors = [finish_tensor(inline_tensor(frame, start, spec), spec) for spec in specs]
    return env, None


def inline_tensor(frame: bytearray, inline_start: int, spec: TensorSpec) -> torch.Tensor:
    """The tensor of ``spec`` as a view of frame 0's inline bytes (no copy)."""
    t = torch.frombuffer(frame, dtype=spec.dtype, count=spec.nbytes // spec.dtype.itemsize,
                         offset=inline_start + spec.inline_offset)
    return t if len(spec.shape) == 1 else t.view(spec.shape)


def finish_tensor(t: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """Restore the received tensor's autograd flag."""
    if spec.requires_grad and (t.is_floating_point() or t.is_complex()):
        t.requires_grad_(True)
    return t


# ---------------------------------------------------------------- the compiled codec
#: what :func:`encode`, :func:`decode_header` and :func:`decode_message` are: the C codec
#: ``_mpidag_frames``
#: (``frames.c``, built per environment by ``python -m mpidag.transport.wire_build``) when it
#: is built, else the Python functions above. The C functions give the same results and
#: hand every message they do not cover (a payload frame, sparse or CUDA tensors, a new
#: dtype or device) to the Python ones, which also raise the errors.
encode = encode_python
decode_header = decode_header_python
decode_message = decode_message_python
_codec: Any = None


#: the ``VERSION`` of ``frames.c`` this module calls (a build from older sources is not
#: used: the Python codec runs, with a warning to rebuild)
CODEC_VERSION = 5


def _load_codec() -> Any:
    try:
        import _mpidag_frames as codec  # type: ignore[import-not-found]
    except ImportError:
        return None
    if getattr(codec, "VERSION", 1) != CODEC_VERSION:
        global _codec_problem
        _codec_problem = (f"{codec.__file__} was built from other sources (version "
                          f"{getattr(codec, 'VERSION', 1)}, this mpidag needs "
                          f"{CODEC_VERSION}): the Python codec runs; rebuild it with "
                          f"'python -m mpidag.transport.wire_build'")
        return None
    configure_codec(codec, use_torch_native=True)
    return codec


def configure_codec(codec: Any, use_torch_native: bool) -> None:
    """Give the C codec this module's classes, tables and Python fallbacks, and
    ``_mpidag_torch``'s frame-0 tensor maker and tensor reader (capsules) where it is built
    and ``use_torch_native`` (else the codec calls ``torch.frombuffer`` and reads tensors'
    Python attributes: the tests run both)."""
    module = torch_module() if use_torch_native else None
    codec.configure(envelope=Envelope, header=Header, spec=TensorSpec, dtypes=DTYPES,
                    dtype_codes=DTYPE_CODE, device_name=_device_name,
                    device_codes=_device_codes, strided=_STRIDED, encode=encode_python,
                    decode=decode_header_python, decode_message=decode_message_python,
                    frombuffer=torch.frombuffer,
                    grad_dtypes=[dt.is_floating_point or dt.is_complex for dt in DTYPES],
                    inline_limit=INLINE_LIMIT,
                    payload_frame_limit=PAYLOAD_FRAME_LIMIT,
                    frame_tensor=None if module is None else module.frame_tensor_api,
                    tensor_facts=None if module is None else module.tensor_facts_api)


def use_compiled(compiled: bool) -> bool:
    """Make :func:`encode` and :func:`decode_header` the C codec (when built) or the Python
    functions (``MPIDAG_COMPILED=0``: the MPI transport calls this); whether C is in use.

    Example::

        >>> import mpidag.transport.frames as f
        >>> f.use_compiled(False), f.encode is f.encode_python
        (False, True)
        >>> f.use_compiled(True) == (f.compiled_codec() is not None)
        True
    """
    global encode, decode_header, decode_message
    codec = _codec if compiled else None
    encode = codec.encode if codec is not None else encode_python
    decode_header = codec.decode_header if codec is not None else decode_header_python
    decode_message = codec.decode_message if codec is not None else decode_message_python
    return codec is not None


def compiled_codec() -> Any:
    """The C codec module, or ``None`` when it is not built (or built from other sources:
    see :func:`codec_problem`)."""
    return _codec


def codec_problem() -> str | None:
    """Why a built C codec is not used (``None``: it is, or none is built); the MPI
    transport logs it at ``init_rpc``."""
    return _codec_problem


_codec_problem: str | None = None


_codec = _load_codec()
use_compiled(True)
