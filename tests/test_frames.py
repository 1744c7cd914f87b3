"""Framing without MPI: encode/decode of headers, payloads and tensor tables."""

import pickle
import struct

import numpy as np
import pytest
import torch

from mpidag.transport import frames
from mpidag.transport.frames import Envelope

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
          torch.complex128, torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32,
          torch.int64, torch.float8_e4m3fn]


@pytest.fixture(autouse=True, params=["compiled", "python"])
def codec(request):
    """Every test runs on the C codec (``_mpidag_frames``, where built) and on Python's."""
    if request.param == "compiled" and frames.compiled_codec() is None:
        pytest.skip("_mpidag_frames is not built here (python -m mpidag.transport.wire_build)")
    frames.use_compiled(request.param == "compiled")
    yield request.param
    frames.use_compiled(True)


def messages():
    """Envelopes that take every branch of the codecs."""
    return [
        Envelope(kind=3, request_id=7, flags=2, context_id=-5, message_id=2**62, payload=b"a"),
        Envelope(kind=1, payload=b"x" * 100, tensors=[torch.ones(256)]),
        Envelope(kind=1, payload=bytearray(b"y" * 10),
                 tensors=[torch.arange(6.).reshape(2, 3), torch.zeros(0, 3),
                          torch.ones(3, requires_grad=True), torch.ones(100_000),
                          torch.ones(3, dtype=torch.int8), torch.ones(())]),
        Envelope(kind=1, payload=memoryview(b"zz"), tensors=[torch.ones(2, 2).t()]),
        Envelope(kind=1, payload=b"", tensors=[
            torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,), check_invariants=True)]),
        Envelope(kind=1, payload=b"p" * (frames.PAYLOAD_FRAME_LIMIT + 1)),
        Envelope(kind=1, payload=b"q", tensors=[torch.ones(5)[1:], torch.ones(9)[::2]]),
        Envelope(kind=1, payload=b"q", tensors=[torch.ones(3, dtype=torch.complex64).conj()]),
        Envelope(kind=1, payload=b"r", tensors=[torch.ones(4)] * 40),  # past INLINE_LIMIT
        Envelope(kind=1, payload=b"s", tensors=[
            torch.nn.Parameter(torch.ones(2, 3)), torch._neg_view(torch.ones(3)),
            torch.ones([1] * 9), torch.ones(2, 2, requires_grad=True).expand(3, 2, 2)]),
    ]


@pytest.mark.parametrize("index", range(len(messages())))
def test_the_c_codec_writes_and_reads_the_very_bytes_of_the_python_one(codec, index):
    if codec == "python":
        pytest.skip("compares the two codecs (run under the compiled parameter)")
    c = frames.compiled_codec()
    env = messages()[index]
    devices = ["cpu"] * len(env.tensors)
    frame_py, separate_py = frames.encode_python(env, devices, 5)
    frame_c, separate_c = c.encode(env, devices, 5)
    assert bytes(frame_c) == bytes(frame_py)
    assert [bytes(x) if isinstance(x, memoryview) else id(x) for x in separate_c] == \
        [bytes(x) if isinstance(x, memoryview) else id(x) for x in separate_py]
    env_py, header_py = frames.decode_header_python(bytearray(frame_py), 3)
    env_c, header_c = c.decode_header(bytearray(frame_py), 3)
    assert env_c.src == 3 and c.decode_header(bytearray(frame_py))[0].src == -1
    fields = ("kind", "request_id", "flags", "context_id", "message_id", "tensors", "src")
    assert [getattr(env_c, f) for f in fields] == [getattr(env_py, f) for f in fields]
    assert type(env_c.payload) is type(env_py.payload)
    assert bytes(env_c.payload) == bytes(env_py.payload)
    assert header_c == header_py


#: the indices of :func:`messages` whose tensors all travel inside frame 0
COMPLETE_IN_FRAME_0 = {0, 1, 3, 6, 7, 8, 9}


@pytest.mark.parametrize("index", range(len(messages())))
def test_decode_message_finishes_messages_all_in_frame_0_in_c_as_in_python(codec, index):
    env = messages()[index]
    frame0, _ = frames.encode_python(env, ["cpu"] * len(env.tensors), 5)
    decoders = [frames.decode_message_python]
    if codec != "python":
        decoders.append(frames.compiled_codec().decode_message)
    results = [decoder(bytearray(frame0), 2) for decoder in decoders]
    _, full = frames.decode_header_python(bytearray(frame0))
    complete = full is None or not (full.payload_separate or full.sparse) and all(
        spec.inline_offset >= 0 and spec.nbytes and spec.device == "cpu" for spec in full.specs)
    assert complete == (index in COMPLETE_IN_FRAME_0)
    for out, header in results:
        assert (header is None) == complete, index
        assert bytes(out.payload) == bytes(frames.decode_header_python(bytearray(frame0))[0]
                                           .payload)
        assert out.src == 2
        if complete:  # the very values, grad flags, shapes and dtypes, as views of frame 0
            assert [(t.tolist(), t.requires_grad, t.dtype, t.shape) for t in out.tensors] == \
                [(t.tolist(), t.requires_grad, t.dtype, t.shape) for t in env.tensors]
        else:  # what follows frame 0 is still for receive_rest to read
            assert header == frames.decode_header_python(bytearray(frame0))[1]
    if len(results) == 2:
        (env_py, header_py), (env_c, header_c) = results
        assert header_py == header_c
        assert [(t.tolist(), t.requires_grad, t.dtype) for t in env_py.tensors] == \
            [(t.tolist(), t.requires_grad, t.dtype) for t in env_c.tensors]


@pytest.mark.parametrize("frame_type", [bytes, bytearray])
def test_a_decoded_payload_is_a_one_dimensional_view_of_its_frame_as_in_python(codec,
                                                                             frame_type):
    """The C decoder narrows a fresh view of the frame in place instead of slicing it: the
    payload must be what Python's ``memoryview(frame)[a:b]`` is, for each decoder (its
    bytes, length, shape, format, read-only flag, the frame as its object, slicing and
    ``release``), and once released the frame is free again (a bytearray can grow)."""
    env = Envelope(kind=1, request_id=9, payload=b"0123456789abcdef", tensors=[])
    frame0, _ = frames.encode_python(env, [], 5)
    decoders = [frames.decode_header_python, frames.decode_message_python]
    if codec != "python":
        decoders += [frames.compiled_codec().decode_header,
                     frames.compiled_codec().decode_message]
    for decode in decoders:
        frame = frame_type(frame0)
        payload = decode(frame)[0].payload
        expected = memoryview(frame)[frames.HEADER.size:frames.HEADER.size + 16]
        assert isinstance(payload, memoryview) and payload.obj is frame
        assert (bytes(payload), len(payload), payload.nbytes, payload.shape, payload.strides,
                payload.format, payload.readonly, payload.c_contiguous) == \
            (bytes(expected), len(expected), expected.nbytes, expected.shape,
             expected.strides, expected.format, expected.readonly, expected.c_contiguous)
        assert bytes(payload[2:5]) == b"234" and payload[-1] == ord("f")
        assert payload.tobytes() == b"0123456789abcdef"
        expected.release()
        payload.release()
        if frame_type is bytearray:
            frame.extend(b"more")  # no export of the frame is left


def test_inline_tensors_of_a_decoded_message_are_views_of_its_frame_0(codec):
    env = Envelope(kind=1, payload=b"x", tensors=[torch.arange(4.0), torch.ones(2, 3)])
    frame0 = bytearray(frames.encode(env, ["cpu", "cpu"], 1)[0])
    out, header = frames.decode_message(frame0)
    assert header is None
    out.tensors[0][0] = 42.0  # the bytes of frame 0 (no copy made)
    assert frames.decode_message(frame0)[0].tensors[0].tolist() == [42.0, 1.0, 2.0, 3.0]


def test_the_c_codec_refuses_what_python_refuses_with_the_same_errors(codec):
    with pytest.raises(Exception, match="ubyte format") as info:
        frames.encode(Envelope(kind=300), [], 0)
    assert info.type.__name__ == "error"  # struct.error, from the Python encoder
    with pytest.raises(ValueError, match="zip"):
        frames.encode(Envelope(kind=1, tensors=[torch.ones(2)]), ["cpu", "cpu"], 1)
    with pytest.raises(TypeError, match="cannot be sent over RPC"):
        frames.encode(Envelope(kind=1, tensors=[torch.ones(2, 2).to_sparse_csr()]), ["cpu"], 1)
    with pytest.raises((ValueError, struct.error)):
        frames.decode_header(bytearray(b"short"))


def sample(dtype, shape=(3, 5)):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


def roundtrip(obj):
    """Encode and decode as the transport does, with separate frames copied by hand."""
    payload, tensors = frames.dumps(obj)
    env = Envelope(kind=1, request_id=7, payload=payload, tensors=tensors, context_id=11,
                   message_id=13)
    frame0, separate = frames.encode(env, ["cpu"] * len(tensors), data_tag=5)
    frame0 = bytearray(frame0)
    out, header = frames.decode_header(frame0)
    specs, inline_start = header.specs, header.inline_start
    assert (out.kind, out.request_id, out.context_id, out.message_id) == (1, 7, 11, 13)
    received = []
    sep = iter(separate)
    for spec in specs:
        if spec.nbytes == 0:
            t = torch.empty(spec.shape, dtype=spec.dtype)
        elif spec.inline_offset >= 0:
            t = frames.inline_tensor(frame0, inline_start, spec)
        else:
            src = next(sep)
            t = torch.empty(spec.shape, dtype=spec.dtype)
            t.view(-1).view(torch.uint8).copy_(frames.byte_view(src))
        received.append(frames.finish_tensor(t, spec))
    if header.sparse:
        received = frames.assemble_sparse(received, header.sparse)
    return frames.loads(out.payload, received), header.data_tag, specs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_roundtrips_inline_and_separate(dtype):
    small, big = sample(dtype), sample(dtype, (frames.INLINE_LIMIT // 100 + 1, 120))
    (a, b), tag, specs = roundtrip((small, big))
    assert tag == 5
    assert specs[0].inline_offset >= 0 and specs[1].inline_offset == -1
    for sent, got in ((small, a), (big, b)):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got.view(torch.uint8), sent.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_message_makes_every_dtype_and_shape_as_python_does(codec, dtype):
    """The C codec makes inline tensors through _mpidag_torch's frame_tensor where built
    (torch.frombuffer otherwise): the same bytes, shapes, strides and grad flags."""
    grad = dtype.is_floating_point or dtype.is_complex
    sent = [sample(dtype, shape) for shape in ((), (7,), (2, 3), (1, 2, 1, 3))]
    sent = [t.requires_grad_(grad) for t in sent]
    frame0, _ = frames.encode(Envelope(kind=1, payload=b"p", tensors=sent), ["cpu"] * 4, 5)
    out, header = frames.decode_message(bytearray(frame0))
    expected, _ = frames.decode_message_python(bytearray(frame0))
    assert header is None
    for got, python, original in zip(out.tensors, expected.tensors, sent, strict=True):
        assert (got.dtype, got.shape, got.stride(), got.requires_grad, got.is_leaf) == \
            (python.dtype, python.shape, python.stride(), python.requires_grad, True)
        assert torch.equal(got.detach().reshape(-1).view(torch.uint8),
                           original.detach().reshape(-1).view(torch.uint8))


def test_the_c_codec_without_torch_native_makes_the_same_tensors_with_frombuffer(codec):
    """Where _mpidag_frames is built but _mpidag_torch is not, the C codec makes inline
    tensors with torch.frombuffer, .view and .requires_grad_ from C."""
    c = frames.compiled_codec()
    if codec == "python" or c is None:
        pytest.skip("the C codec's own branch (run under the compiled parameter)")
    sent = [sample(dtype, shape).requires_grad_(dtype.is_floating_point)
            for dtype, shape in ((torch.float32, ()), (torch.float64, (7,)),
                                 (torch.int32, (2, 3)), (torch.bfloat16, (1, 2, 1, 3)))]
    frame0, _ = frames.encode(Envelope(kind=1, payload=b"p", tensors=sent), ["cpu"] * 4, 5)
    frames.configure_codec(c, use_torch_native=False)
    try:
        assert not c.uses_torch_native()
        out, header = c.decode_message(bytearray(frame0))
    finally:
        frames.configure_codec(c, use_torch_native=True)
    expected, _ = frames.decode_message_python(bytearray(frame0))
    assert header is None
    for got, python in zip(out.tensors, expected.tensors, strict=True):
        assert (got.dtype, got.shape, got.stride(), got.requires_grad) == \
            (python.dtype, python.shape, python.stride(), python.requires_grad)
        assert torch.equal(got.detach(), python.detach())


@pytest.mark.parametrize("index", range(len(messages())))
def test_the_c_codec_writes_the_same_bytes_whether_it_reads_tensors_in_cpp_or_python(
        codec, index):
    """The encoder reads a sent tensor through ``_mpidag_torch``'s ``tensor_facts`` where it
    is built, through the tensor's Python attributes where not: the same frames."""
    c = frames.compiled_codec()
    if codec == "python" or c is None or not c.uses_torch_native():
        pytest.skip("the C codec's two ways to read a tensor (run under the compiled one)")
    env = messages()[index]
    devices = ["cpu"] * len(env.tensors)
    frame_cpp, separate_cpp = c.encode(env, devices, 5)
    frames.configure_codec(c, use_torch_native=False)
    try:
        frame_py, separate_py = c.encode(env, devices, 5)
    finally:
        frames.configure_codec(c, use_torch_native=True)
    assert bytes(frame_cpp) == bytes(frame_py)
    assert [bytes(x) if isinstance(x, memoryview) else id(x) for x in separate_cpp] == \
        [bytes(x) if isinstance(x, memoryview) else id(x) for x in separate_py]


class DuckEnvelope:
    """Not an ``Envelope``: the fields by name, as the Python encoder reads them."""

    def __init__(self, env: Envelope) -> None:
        for name in ("kind", "request_id", "flags", "context_id", "message_id", "payload",
                     "tensors", "src"):
            setattr(self, name, getattr(env, name))


class SubEnvelope(Envelope):
    __slots__ = ("note",)


@pytest.mark.parametrize("index", range(len(messages())))
def test_the_c_codec_reads_an_envelope_at_its_slots_and_anything_else_by_name(codec, index):
    """``_mpidag_frames`` reads an Envelope's (or a subclass's) fields straight at their
    slots' offsets (``slots.h``) and any other object's by name: the same frames as the
    Python encoder's, for each message."""
    c = frames.compiled_codec()
    if codec == "python" or c is None:
        pytest.skip("the C codec's slot reads (run under the compiled parameter)")
    env = messages()[index]
    devices = ["cpu"] * len(env.tensors)
    expected, expected_rest = frames.encode_python(env, devices, 5)
    sub = SubEnvelope(**{name: getattr(env, name) for name in Envelope.__slots__})
    for given in (env, sub, DuckEnvelope(env)):
        frame0, rest = c.encode(given, devices, 5)
        assert bytes(frame0) == bytes(expected), type(given)
        assert len(rest) == len(expected_rest), type(given)


def test_an_unset_slot_and_a_class_without_slots_are_errors_that_say_what(codec):
    """An Envelope whose slot was deleted raises the AttributeError Python raises; a class
    whose field is not a ``__slots__`` entry is refused at ``configure`` (the C code would
    write at its offset) with a TypeError that says to rebuild, and the codec keeps the
    classes it had."""
    c = frames.compiled_codec()
    if codec == "python" or c is None:
        pytest.skip("the C codec's slot reads (run under the compiled parameter)")
    env = Envelope(kind=1, payload=b"x", tensors=[torch.ones(2)])
    good, _ = c.encode(env, ["cpu"], 5)
    del env.payload
    with pytest.raises(AttributeError) as python_error:
        env.payload  # noqa: B018 - the error Python raises
    with pytest.raises(AttributeError) as c_error:
        c.encode(env, ["cpu"], 5)
    assert str(c_error.value) == str(python_error.value) == \
        "'Envelope' object has no attribute 'payload'"

    class PlainEnvelope:  # the same fields, in a __dict__
        kind = request_id = flags = context_id = message_id = src = 0
        payload, tensors = b"", []

    header = dict(envelope=PlainEnvelope, header=frames.Header, spec=frames.TensorSpec)
    with pytest.raises(TypeError, match=r"PlainEnvelope\.kind is not a writable __slots__ "
                                        r"entry .*rebuild mpidag's compiled modules"):
        c.configure(**header, dtypes=frames.DTYPES, dtype_codes=frames.DTYPE_CODE,
                    device_name=frames._device_name, device_codes=frames._device_codes,
                    strided=frames._STRIDED, encode=frames.encode_python,
                    decode=frames.decode_header_python,
                    decode_message=frames.decode_message_python, frombuffer=torch.frombuffer,
                    grad_dtypes=[True] * len(frames.DTYPES), inline_limit=frames.INLINE_LIMIT,
                    payload_frame_limit=frames.PAYLOAD_FRAME_LIMIT)
    # as it was: the same frames, and the same tensor maker and reader (_mpidag_torch's)
    assert c.uses_torch_native() == (frames.torch_module() is not None)
    again = Envelope(kind=1, payload=b"x", tensors=[torch.ones(2)])
    assert bytes(c.encode(again, ["cpu"], 5)[0]) == bytes(good)
    decoded, _ = c.decode_message(bytearray(good))
    assert type(decoded) is Envelope and decoded.payload == b"x"


def test_non_contiguous_views_and_zero_size():
    base = torch.arange(60.0).reshape(6, 10)
    obj = {"t": base.t(), "slice": base[1:4, ::3], "empty": torch.empty(0, 4),
           "neg": base.neg().conj(), "conj": torch.randn(3, dtype=torch.complex64).conj()}
    got, _, _ = roundtrip(obj)
    for key, sent in obj.items():
        torch.testing.assert_close(got[key], sent.resolve_conj().resolve_neg())


def test_same_tensor_twice_arrives_once_and_no_tensor_bytes_in_pickle():
    t = torch.full((1000,), 3.25)
    payload, tensors = frames.dumps([t, t, {"again": t}])
    assert len(tensors) == 1
    assert t.numpy().tobytes()[:64] not in payload
    assert len(payload) < 200
    (a, b, c), _, _ = roundtrip([t, t, {"again": t}])
    assert a is b is c["again"]


def test_requires_grad_and_parameters_survive():
    p = torch.nn.Parameter(torch.randn(2, 2))
    x = torch.randn(3, requires_grad=True)
    (gp, gx, gy), _, _ = roundtrip((p, x, torch.ones(2)))
    assert isinstance(gp, torch.nn.Parameter) and gp.requires_grad
    assert gx.requires_grad and gx.is_leaf and not gy.requires_grad
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    (gf,), _, _ = roundtrip((frozen,))
    assert isinstance(gf, torch.nn.Parameter) and not gf.requires_grad


def test_parameters_travel_detached_like_torch_pickles_them():
    """torch's Parameter.__reduce_ex__ sends `.data`: no autograd edge leaves with it."""
    p = torch.nn.Parameter(torch.randn(2, 2))
    _, tensors = frames.dumps({"p": p, "again": p})
    assert len(tensors) == 1 and not tensors[0].requires_grad
    assert tensors[0].data_ptr() == p.data_ptr()  # the same memory, not a copy


def test_a_lone_parameter_travels_as_its_rule_says():
    """A lone ``nn.Parameter`` that travels as the tensor it is (an RRef's value: the rule
    says "do not detach") is a lone tensor, as a plain tensor is (no pickler), and arrives as
    the tensor with its ``requires_grad``; one that the rule detaches arrives as a new leaf
    ``Parameter``, the rule asked once either way."""
    p = torch.nn.Parameter(torch.randn(3, 2))
    asked = []

    def rule(answer):
        return lambda: asked.append(answer) or answer

    payload, tensors = frames.dumps(p, rule(False))
    assert payload == frames.LONE_TENSOR_PAYLOAD and tensors[0] is p
    got = frames.loads(payload, [tensors[0].detach().requires_grad_()])
    assert type(got) is torch.Tensor and got.requires_grad and torch.equal(got, p)
    payload, tensors = frames.dumps(p, rule(True))
    assert payload != frames.LONE_TENSOR_PAYLOAD and not tensors[0].requires_grad
    got = frames.loads(payload, [tensors[0]])
    assert type(got) is torch.nn.Parameter and got.requires_grad and got.is_leaf
    assert torch.equal(got, p) and got.data_ptr() == tensors[0].data_ptr()
    assert asked == [False, True]


@pytest.mark.parametrize("requires_grad", [True, False])
def test_a_lone_detached_parameter_is_the_picklers_own_payload(requires_grad, monkeypatch):
    """A function's lone ``Parameter`` result skips the pickler: its payload is the bytes
    the pickler writes for it (so any receiver reads it), and ``loads`` makes the new leaf
    ``Parameter`` without unpickling, with its ``requires_grad``."""
    p = torch.nn.Parameter(torch.randn(4), requires_grad=requires_grad)
    payload, tensors = frames.dumps(p)
    with monkeypatch.context() as patch:
        patch.setattr(frames, "_LONE_PARAMETER", {})
        pickled, _ = frames.dumps(p)
    assert payload == pickled
    got = frames.loads(payload, tensors)
    assert type(got) is torch.nn.Parameter and got.requires_grad == requires_grad
    assert torch.equal(got, p) and got is not p


def test_no_tensor_message_is_header_plus_pickle():
    payload, tensors = frames.dumps(("hello", 3))
    frame0, separate = frames.encode(Envelope(kind=2, payload=payload), [], 0)
    assert not separate and len(frame0) == frames.HEADER.size + len(payload)
    env, header = frames.decode_header(bytearray(frame0))
    assert header is None and pickle.loads(env.payload) == ("hello", 3)


class Celsius(torch.Tensor):
    """A tensor subclass with state of its own."""


def test_tensor_subclass_travels_out_of_band_and_arrives_as_its_class():
    t = torch.arange(4.0).as_subclass(Celsius)
    t.note = "room"
    payload, tensors = frames.dumps({"t": t})
    assert len(tensors) == 1 and type(tensors[0]) is torch.Tensor  # its bytes: not pickled
    assert tensors[0].data_ptr() == t.data_ptr()
    back = frames.loads(payload, [tensors[0].clone()])["t"]
    assert type(back) is Celsius and back.note == "room" and torch.equal(back, t)


def test_numpy_arrays_travel_out_of_band_other_arrays_in_the_pickle():
    plain = np.arange(10, dtype=np.float32)[::3]  # strided: sent as its values
    objects = np.array([{"a": 1}, None], dtype=object)
    swapped = np.arange(3, dtype=">i4")  # not native byte order: pickled
    payload, tensors = frames.dumps([plain, objects, swapped])
    assert len(tensors) == 1 and tensors[0].numel() == plain.size
    got = frames.loads(payload, [tensors[0].contiguous()])
    assert isinstance(got[0], np.ndarray) and np.array_equal(got[0], plain)
    assert got[1][0] == {"a": 1} and np.array_equal(got[2], swapped)


def test_large_payload_is_a_frame_of_its_own_with_a_64_bit_length():
    payload = bytes(frames.PAYLOAD_FRAME_LIMIT + 1)
    frame0, separate = frames.encode(Envelope(kind=2, payload=payload), [], data_tag=3)
    assert len(frame0) == frames.HEADER.size  # the payload is not copied into frame 0
    assert len(separate) == 1 and separate[0].nbytes == len(payload)
    env, header = frames.decode_header(bytearray(frame0))
    assert header.payload_separate and header.payload_length == len(payload)
    assert header.data_tag == 3 and env.payload == b""
    # lengths past 4 GiB fit the header (a 32-bit field raised struct.error before)
    huge = frames.HEADER.pack(2, 0, frames.WIRE_PAYLOAD_FRAME, 0, 3, 0, 0, 0, 5 << 30, 0, 0)
    assert frames.decode_header(bytearray(huge))[1].payload_length == 5 << 30
    with pytest.raises(ValueError, match="data tag"):
        frames.encode(Envelope(kind=2, payload=payload), [], data_tag=0)


def test_plain_values_a_lone_tensor_and_mixed_calls_take_their_fast_paths():
    # plain values (and short tuples of them) are plain pickles
    payload, tensors = frames.dumps((1, "a", None, 2.5))
    assert tensors == [] and pickle.loads(payload) == (1, "a", None, 2.5)
    assert frames.is_plain((1, b"x")) and not frames.is_plain((torch.ones(1),))
    assert not frames.is_plain(tuple(range(9))) and not frames.is_plain([1])
    # a lone plain tensor: a constant payload, the tensor in the table
    t = torch.arange(4.0)
    payload, tensors = frames.dumps(t)
    assert tensors == [t] and len(payload) < 16
    assert frames.loads(payload, tensors) is t
    (back,), _, _ = roundtrip((t,))
    assert torch.equal(back, t)
    # tensors, a Parameter and plain values together, with a prefix before the pickle
    p = torch.nn.Parameter(torch.ones(2))
    payload, tensors = frames.dumps(((t, p, 3), {"k": t}), prefix=b"REF")
    assert payload[:3] == b"REF" and len(tensors) == 2
    (a, q, n), kw = frames.loads(memoryview(payload)[3:], tensors)
    assert a is kw["k"] and torch.equal(a, t) and n == 3
    assert type(q) is torch.nn.Parameter and q.requires_grad


class Token:
    def __init__(self, name):
        self.name = name


def test_codecs_see_the_context_and_undo_their_side_effects_when_pickling_fails():
    codecs = frames.Codecs()
    started, undone = [], []

    def reduce(token, scope):
        started.append((token.name, scope.context))
        scope.on_failure(lambda: undone.append(token.name))
        return token.name

    codecs.register(Token, "token", reduce, Token)
    payload, tensors = frames.dumps([Token("a")], codecs=codecs, context=3)
    assert started == [("a", 3)] and undone == []
    assert frames.loads(payload, tensors, codecs)[0].name == "a"
    with pytest.raises((AttributeError, pickle.PicklingError)):  # a lambda cannot be pickled
        frames.dumps([Token("b"), Token("c"), lambda: 0], codecs=codecs, context=4)
    assert started[1:] == [("b", 4), ("c", 4)] and undone == ["c", "b"]
    # the next pickle in this thread starts clean
    frames.dumps([Token("d")], codecs=codecs, context=5)
    assert undone == ["c", "b"]


def build_sparse(coalesce=False, requires_grad=False, dtype=torch.float32):
    """torch's dist_autograd_test ``build_sparse_tensor``: uncoalesced unless asked."""
    tensor = torch.sparse_coo_tensor([[0, 1, 1, 0], [2, 0, 2, 2]], [3.2, 4.1, 5.3, 1.0],
                                     (3, 3), requires_grad=requires_grad, dtype=dtype)
    return tensor.coalesce() if coalesce else tensor


def assert_same_sparse(got, sent):
    assert got.layout is torch.sparse_coo and got.shape == sent.shape
    assert got.dtype == sent.dtype and got.is_coalesced() == sent.is_coalesced()
    assert got.sparse_dim() == sent.sparse_dim() and got.dense_dim() == sent.dense_dim()
    assert torch.equal(got._indices(), sent._indices())   # as sent: not coalesced on the way
    assert torch.equal(got._values(), sent._values().detach())


def test_sparse_coo_tensors_roundtrip_with_size_coalesced_flag_and_requires_grad():
    uncoalesced, coalesced = build_sparse(), build_sparse(coalesce=True)
    assert not uncoalesced.is_coalesced() and coalesced.is_coalesced()
    leaf = build_sparse(requires_grad=True, dtype=torch.float64)
    hybrid = torch.sparse_coo_tensor([[0, 4]], torch.arange(6.0).reshape(2, 3), (5, 3))
    empty = torch.sparse_coo_tensor(torch.empty(2, 0, dtype=torch.long), [], (4, 7))
    ints = torch.sparse_coo_tensor([[1, 3]], torch.tensor([7, -2], dtype=torch.int32), (6,))
    big = torch.randn(frames.INLINE_LIMIT // 4 + 10, 2).to_sparse()  # parts in own frames
    dense = torch.arange(4.0)
    sent = {"plain": [uncoalesced, coalesced], "nested": ({"leaf": leaf}, [hybrid, empty]),
            "ints": ints, "big": big, "dense": dense}
    got, _, specs = roundtrip(sent)
    pairs = [(got["plain"][0], uncoalesced), (got["plain"][1], coalesced),
             (got["nested"][0]["leaf"], leaf), (got["nested"][1][0], hybrid),
             (got["nested"][1][1], empty), (got["ints"], ints), (got["big"], big)]
    for received, original in pairs:
        assert_same_sparse(received, original)
        assert received.requires_grad == original.requires_grad
    assert got["nested"][0]["leaf"].is_leaf and got["nested"][1][0].dense_dim() == 1
    assert torch.equal(got["dense"], dense) and got["dense"].layout is torch.strided
    # on the wire: the indices and values of each sparse tensor (two specs each), no
    # requires_grad on the parts (the rebuilt sparse tensor carries it)
    assert len(specs) == 2 * 7 + 1 and not any(spec.requires_grad for spec in specs)
    assert any(spec.inline_offset == -1 for spec in specs)  # big's values: a frame of its own


def test_the_same_sparse_tensor_twice_arrives_once_and_its_bytes_stay_out_of_the_pickle():
    s = build_sparse(coalesce=True)
    payload, tensors = frames.dumps([s, {"again": s}])
    assert tensors == [s]                     # one table entry: autograd records it whole
    assert s._values().numpy().tobytes() not in payload
    (a, b), _, _ = roundtrip([s, {"again": s}])
    assert a is b["again"]
    assert_same_sparse(a, s)


def test_other_layouts_are_refused_with_a_type_error_naming_the_layout():
    dense = torch.eye(3)
    for tensor, name in ((dense.to_sparse_csr(), "sparse_csr"),
                         (dense.to_sparse_csc(), "sparse_csc"),
                         (dense.to_sparse_bsr((1, 1)), "sparse_bsr")):
        payload, tensors = frames.dumps([tensor])
        env = Envelope(kind=1, payload=payload, tensors=tensors)
        with pytest.raises(TypeError, match=rf"layout torch\.{name} cannot be sent over RPC"
                                            r".*sparse COO"):
            frames.encode(env, ["cpu"], data_tag=5)
    with pytest.raises(TypeError, match="only CPU and CUDA tensors"):
        frames.encode(Envelope(kind=1, tensors=[build_sparse().to("meta")]), ["cpu"], 5)


def test_make_spec_of_a_sparse_tensor_counts_its_parts():
    s = build_sparse(requires_grad=True)
    spec = frames.make_spec(s, "cpu", -1)
    assert spec.shape == (3, 3) and spec.requires_grad and spec.dtype == torch.float32
    assert spec.nbytes == s._indices().nbytes + s._values().nbytes


def test_non_contiguous_tensors_arrive_with_their_strides_like_torch():
    """torch's RPC sends a view's storage: the receiver's tensor has the same strides
    (rpc_test.py test_non_cont_tensors); a small view of a big storage is copied (torch's
    cloneSparseTensors rule) and arrives contiguous."""
    base = torch.arange(25.0).reshape(5, 5)
    narrow, strided = base.narrow(1, 2, 2), torch.arange(120.0).reshape(10, 12)[::3, 1::4]
    expanded = torch.tensor([1.5, 2.5]).expand(300, 2)
    big_view = torch.rand(100, 100)[:, :3]  # 40,000 bytes of storage for 1,200 used
    obj = {"narrow": narrow, "t": base.t(), "strided": strided, "expanded": expanded,
           "again": narrow, "big_view": big_view, "contiguous": base}
    payload, tensors = frames.dumps(obj)
    assert len(tensors) == 6  # "again" is the same tensor: sent once
    assert tensors[0].shape == (22,) and tensors[0].is_contiguous()  # narrow's span only
    got, _, _ = roundtrip(obj)
    for key in ("narrow", "t", "strided", "expanded"):
        assert not got[key].is_contiguous(), key
        assert got[key].stride() == obj[key].stride(), key
        assert torch.equal(got[key], obj[key]), key
    assert got["again"] is got["narrow"]
    assert got["big_view"].is_contiguous() and torch.equal(got["big_view"], big_view)
    assert got["contiguous"].stride() == (5, 1)
    alone, _, _ = roundtrip(narrow)  # a lone tensor (a result) too
    assert alone.stride() == (5, 1) and torch.equal(alone, narrow)
    grad = torch.rand(4, 4, requires_grad=True).t()  # autograd leaves stay as they were
    got_grad, _, _ = roundtrip(grad)
    assert got_grad.requires_grad and torch.equal(got_grad, grad)


def test_the_c_decoder_survives_any_frame_and_agrees_with_python_where_both_decode(codec):
    """Frame 0 comes from the network: cut, bit-flipped or random frames make the C
    decoder raise (or decode what the Python one decodes), never crash the process."""
    if codec == "python":
        pytest.skip("checks the C decoder against the Python one")
    c = frames.compiled_codec()
    rng = np.random.default_rng(7)
    valid = [bytes(frames.encode_python(env, ["cpu"] * len(env.tensors), 5)[0])
             for env in messages()[:4]]
    fields = ("kind", "request_id", "flags", "context_id", "message_id", "src")
    agreed = failed = 0
    for i in range(3000):
        base = bytearray(valid[i % len(valid)])
        kind = i % 3
        if kind == 0:  # cut short
            base = base[:rng.integers(0, len(base))]
        elif kind == 1:  # a few bytes of the header and specs changed
            for _ in range(rng.integers(1, 4)):
                base[rng.integers(0, min(len(base), 120))] = rng.integers(0, 256)
        else:  # random bytes
            base = bytearray(rng.integers(0, 256, rng.integers(0, 200), dtype=np.uint8))
        try:
            env_py, header_py = frames.decode_header_python(bytearray(base))
        except Exception:  # noqa: BLE001 - any error of Python's is fine here
            env_py = None
        try:
            env_c, header_c = c.decode_header(bytearray(base))
        except Exception:  # noqa: BLE001 - so is any of C's; a crash would end the test run
            failed += 1
            continue
        if env_py is not None and len(bytes(env_py.payload)) == len(bytes(env_c.payload)):
            assert [getattr(env_c, f) for f in fields] == [getattr(env_py, f) for f in fields]
            assert header_c == header_py
            agreed += 1
    assert agreed > 100 and failed > 100  # both branches were taken
