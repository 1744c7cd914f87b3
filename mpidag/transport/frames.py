"""Message framing: a fixed header, a pickled payload with tensors taken out, tensor frames.

No tensor byte ever enters a pickle. The pickler replaces each tensor by its index in a
tensor table; the table's specs (dtype, shape, device, flags) travel in the header frame;
the tensors' bytes travel either inline at the end of the header frame (small ones: one MPI
message in all) or as their own frames, received straight into freshly allocated tensors.

Frame 0 layout (little endian)::

    HEADER | payload pickle | tensor specs (struct) | pad to 16 | inline tensors (16-aligned)

This module does not import MPI; :mod:`mpidag.transport.mpi` moves the frames.
"""

from __future__ import annotations

import io
import pickle
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "HEADER",
    "INLINE_LIMIT",
    "Envelope",
    "TensorSpec",
    "dumps",
    "loads",
    "byte_view",
]

#: kind, flags, n_tensors, data_tag, request_id, context_id, message_id, payload, specs, inline
HEADER = struct.Struct("<BBHIqqqIII")
#: tensors are copied into frame 0 while the inline part stays below this many bytes
INLINE_LIMIT = 32 * 1024
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
#: dtypes whose bytes numpy can view directly (the fast copy path for inline tensors)
_NUMPY_DTYPES = frozenset(
    dt for dt in DTYPES if dt not in (torch.bfloat16, torch.complex32) and "float8" not in str(dt)
)
_DEVICE_TYPES = ["cpu", "cuda"]
#: dtype code, ndim, flags, device type, device index, inline offset (-1: own frame), nbytes
_SPEC = struct.Struct("<BBBBhqq")
_REQUIRES_GRAD = 1


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
        code, ndim, flags, dev_type, dev_index, offset, nbytes = _SPEC.unpack_from(buf, pos)
        pos += _SPEC.size
        shape = struct.unpack_from(f"<{ndim}q", buf, pos)
        device = _DEVICE_TYPES[dev_type]
        if dev_index >= 0:
            device = f"{device}:{dev_index}"
        spec = cls(DTYPES[code], shape, device, bool(flags & _REQUIRES_GRAD), offset, nbytes)
        return spec, pos + 8 * ndim


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


_local = threading.local()


def _from_table(index: int) -> torch.Tensor:
    """Unpickling hook: the ``index``-th received tensor of the message being loaded."""
    return _local.table[index]


def _parameter_from_table(index: int, requires_grad: bool) -> torch.nn.Parameter:
    """Unpickling hook: a new ``nn.Parameter`` around the ``index``-th received tensor."""
    return torch.nn.Parameter(_local.table[index], requires_grad=requires_grad)


class _TensorPickler(pickle.Pickler):
    """Pickler that moves every tensor into ``self.tensors`` and pickles its index.

    Only tensors reach Python code (through ``dispatch_table``), so pickling costs the same
    as plain ``pickle.dumps`` for everything else. One instance per thread is reused.

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
        self.busy = False
        self.detach_rule: Callable[[], bool] = _always
        self.detach_answer: bool | None = None  # the rule's answer, asked once per message
        self.dispatch_table = {torch.Tensor: self._reduce_tensor,
                               torch.nn.Parameter: self._reduce_parameter}

    def _reduce_tensor(self, tensor: torch.Tensor) -> tuple:
        # the memo maps a tensor seen twice to one entry, so it arrives once
        self.tensors.append(tensor)
        return _from_table, (len(self.tensors) - 1,)

    def _reduce_parameter(self, param: torch.nn.Parameter) -> tuple:
        if self.detach_answer is None:
            self.detach_answer = bool(self.detach_rule())
        if not self.detach_answer:
            return self._reduce_tensor(param)
        self.tensors.append(param.detach())
        return _parameter_from_table, (len(self.tensors) - 1, param.requires_grad)


def _always() -> bool:
    return True


def dumps(obj: Any, detach_parameters: Callable[[], bool] = _always
          ) -> tuple[bytes, list[torch.Tensor]]:
    """Pickle ``obj`` with its tensors taken out; returns ``(payload, tensors)``.

    ``detach_parameters()`` (asked once, at the first ``nn.Parameter``) tells how
    parameters travel: see :class:`_TensorPickler`.

    Example::

        >>> payload, tensors = dumps({"x": torch.ones(2), "n": 3})
        >>> len(tensors), loads(payload, tensors)["n"]
        (1, 3)
    """
    pickler = getattr(_local, "pickler", None)
    if pickler is None or pickler.busy:  # busy: a __reduce__ that pickles again
        pickler = _TensorPickler()
        if getattr(_local, "pickler", None) is None:
            _local.pickler = pickler
    buffer = pickler.buffer
    buffer.seek(0)
    buffer.truncate()
    pickler.tensors = tensors = []
    pickler.busy = True
    pickler.detach_rule, pickler.detach_answer = detach_parameters, None
    try:
        pickler.dump(obj)
        return buffer.getvalue(), tensors
    finally:
        pickler.clear_memo()
        pickler.tensors = []
        pickler.detach_rule = _always
        pickler.busy = False


def loads(payload: bytes | memoryview, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :func:`dumps`: unpickle ``payload``, putting ``tensors`` back in place."""
    if not tensors:
        return pickle.loads(payload)
    previous = getattr(_local, "table", None)
    _local.table = tensors
    try:
        return pickle.loads(payload)
    finally:
        _local.table = previous


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
    code = _dtype_code(tensor)
    shape = tensor.shape
    flags = _REQUIRES_GRAD if tensor.requires_grad else 0
    dev_type, dev_index = _device_code(device)
    return _SPEC.pack(code, len(shape), flags, dev_type, dev_index, inline_offset,
                      tensor.nbytes) + struct.pack(f"<{len(shape)}q", *shape)


def make_spec(tensor: torch.Tensor, device: str, inline_offset: int) -> TensorSpec:
    """The :class:`TensorSpec` of ``tensor`` landing on ``device``."""
    _dtype_code(tensor)
    return TensorSpec(tensor.dtype, tuple(tensor.shape), device, tensor.requires_grad,
                      inline_offset, tensor.nbytes)


def _copy_into(frame: bytearray, start: int, tensor: torch.Tensor) -> None:
    """Copy a tensor's values into ``frame[start:]`` (the fast path goes through numpy)."""
    t = tensor.detach()
    if (t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES and t.is_contiguous()
            and not t.is_conj() and not t.is_neg()):
        if t.dim() == 0:
            t = t.reshape(1)
        frame[start:start + t.nbytes] = memoryview(t.numpy()).cast("B")
        return
    src = byte_view(t)
    if src.device.type != "cpu":
        src = src.cpu()
    frame[start:start + src.numel()] = memoryview(src.numpy()).cast("B")


def encode(env: Envelope, devices: list[str], data_tag: int
           ) -> tuple[bytearray | bytes, list[torch.Tensor]]:
    """Build frame 0 and the list of tensors sent as frames of their own.

    ``devices[i]`` is where tensor ``i`` must land on the receiver.
    """
    tensors = env.tensors
    if not tensors:
        header = HEADER.pack(env.kind, env.flags, 0, 0, env.request_id, env.context_id,
                             env.message_id, len(env.payload), 0, 0)
        return header + env.payload, []
    packed: list[bytes] = []
    inline: list[tuple[int, torch.Tensor]] = []
    separate: list[torch.Tensor] = []
    inline_total = 0
    for tensor, device in zip(tensors, devices, strict=True):
        nbytes = tensor.nbytes
        if nbytes == 0:
            packed.append(pack_spec(tensor, device, 0))
        elif inline_total + nbytes <= INLINE_LIMIT:
            packed.append(pack_spec(tensor, device, inline_total))
            inline.append((inline_total, tensor))
            inline_total = _align(inline_total + nbytes)
        else:
            packed.append(pack_spec(tensor, device, -1))
            separate.append(tensor)
    specs_blob = b"".join(packed)
    head_len = HEADER.size + len(env.payload) + len(specs_blob)
    inline_start = _align(head_len)
    frame = bytearray(inline_start + inline_total)
    HEADER.pack_into(frame, 0, env.kind, env.flags, len(tensors), data_tag, env.request_id,
                     env.context_id, env.message_id, len(env.payload), len(specs_blob),
                     inline_total)
    pos = HEADER.size
    frame[pos:pos + len(env.payload)] = env.payload
    pos += len(env.payload)
    frame[pos:pos + len(specs_blob)] = specs_blob
    for offset, tensor in inline:
        _copy_into(frame, inline_start + offset, tensor)
    return frame, separate


def decode_header(frame: bytearray | bytes) -> tuple[Envelope, int, list[TensorSpec], int]:
    """Parse frame 0: returns ``(envelope without tensors, data_tag, specs, inline_start)``."""
    (kind, flags, n_tensors, data_tag, request_id, context_id, message_id, payload_len,
     specs_len, _inline_len) = HEADER.unpack_from(frame, 0)
    view = memoryview(frame)
    pos = HEADER.size
    payload = view[pos:pos + payload_len]
    specs: list[TensorSpec] = []
    inline_start = 0
    if n_tensors:
        pos += payload_len
        end = pos + specs_len
        while pos < end:
            spec, pos = TensorSpec.unpack_from(view, pos)
            specs.append(spec)
        inline_start = _align(end)
    env = Envelope(kind=kind, request_id=request_id, flags=flags, context_id=context_id,
                   message_id=message_id, payload=payload)
    return env, data_tag, specs, inline_start


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
