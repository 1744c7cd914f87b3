"""The transport interface, and the framing path every transport shares.

A transport moves :class:`~mpidag.transport.frames.Envelope` objects between the ranks of
one job. The agent above uses only :class:`Transport`'s methods, so the same agent, RRef
and autograd code runs over MPI (:class:`~mpidag.transport.mpi.MPITransport`, the
product) and over threads of one process (:class:`~mpidag.transport.inproc.InProcWorld`,
for fast protocol tests), as dask's ``tcp`` and ``inproc`` comms do.

:class:`FramedTransport` turns envelopes into frames and back (:mod:`.frames`), allocates
received tensors (recycled buffers, CUDA placement) and keeps the loopback queue; a
subclass only moves bytes: frame 0 of a message, and the frames that follow it on the
message's data tag.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch

from mpidag.errors import WorkerFailedError
from mpidag.transport import frames
from mpidag.transport.buffers import ReceiveBufferCache
from mpidag.transport.frames import Envelope, TensorSpec

__all__ = ["CHUNK", "PEER_FAILED", "FramedTransport", "Transport"]

log = logging.getLogger(__name__)

#: largest single transfer of a frame, in bytes (MPI counts stay below 2**31)
CHUNK = 1 << 30

#: kind of the local envelope :meth:`Transport.poll` returns, once, for each peer found to
#: have failed (``src`` is that rank); never on the wire (fault-tolerant jobs only)
PEER_FAILED = 64

#: ``hook(dst, envelope, devices)``; returning True means the hook took the message and
#: will call ``send_now`` itself (tests: delays, reordering)
SendHook = Callable[[int, Envelope, list[str]], bool]


class Transport:
    """What the agent needs from a transport.

    ``send`` may be called from any thread at once; ``poll`` by one thread at a time (the
    progress engine's leader).

    Example::

        >>> world = InProcWorld(2)                  # or MPITransport() under mpirun
        >>> t0, t1 = world.transports
        >>> t0.send(1, Envelope(kind=1, payload=b"hi"), [])
        >>> bytes(t1.poll().payload)
        b'hi'
    """

    rank: int
    size: int
    send_hook: SendHook | None = None
    #: ``poll_wait(seconds)``: :meth:`poll` that waits up to ``seconds`` for a message
    #: outside Python (without the GIL), where the transport can; ``None`` where it cannot
    poll_wait: Callable[[float], Envelope | None] | None = None

    def interrupt_wait(self) -> None:
        """End a :attr:`poll_wait` under way in another thread at once (no-op here)."""

    def send(self, dst: int, env: Envelope, devices: list[str]) -> None:
        """Send ``env`` to rank ``dst``; ``devices[i]`` is where tensor ``i`` lands there."""
        hook = self.send_hook
        if hook is not None and hook(dst, env, devices):
            return
        self.send_now(dst, env, devices)

    def send_now(self, dst: int, env: Envelope, devices: list[str]) -> None:
        """:meth:`send` without the test hook."""
        raise NotImplementedError

    def poll(self) -> Envelope | None:
        """Receive one message if one is waiting, else return ``None`` at once."""
        raise NotImplementedError

    def allgather(self, obj: Any) -> list[Any]:
        """Collective, blocking: ``obj`` of every rank, by rank (used at start only)."""
        raise NotImplementedError

    def allreduce_sum(self, values: list[int], wait: Callable[[Callable[[], bool]], None]
                      ) -> list[int]:
        """Collective: sum ``values`` over all ranks; ``wait(done)`` waits for the result
        (the caller's waiter keeps serving requests meanwhile)."""
        raise NotImplementedError

    def abort(self, code: int = 1) -> None:
        """End the whole job (every rank) with ``code``."""
        raise NotImplementedError

    def close(self, collective: bool) -> None:
        """Release the transport (``collective``: every rank calls this now)."""
        raise NotImplementedError


class FramedTransport(Transport):
    """Framing, tensor allocation and loopback; subclasses move the bytes.

    Subclasses implement :meth:`send_frame0`, :meth:`_send_frame`, :meth:`_probe` and
    :meth:`_recv_frame`, pass ``rank``, ``size`` and ``n_data_tags`` to ``__init__`` (and
    ``compiled=False`` for the Python receive cache of ``MPIDAG_COMPILED=0``), and set
    ``cuda_aware`` when their transfers can read and write device memory.
    """

    cuda_aware: bool = False

    def __init__(self, rank: int, size: int, n_data_tags: int, recv_cache_bytes: int,
                 compiled: bool = True) -> None:
        self.rank = rank
        self.size = size
        self._n_data_tags = n_data_tags  # data tags are 1..n_data_tags
        self._tag_counter = itertools.count()
        #: messages to this rank itself, failed peers' notices and requeued messages, which
        #: :meth:`poll` returns before probing the wire (a leader pops them; anyone appends)
        self.loopback: collections.deque[Envelope] = collections.deque()
        #: ``probe_frame0(seconds)``: the next frame 0 as ``(source, frame)``, waiting up to
        #: ``seconds`` (0: one probe), or ``None``; published where a leader may call it
        #: without the transport's lock (the agent's compiled step polls through it, then
        #: :func:`frames.decode_message` and :meth:`receive_rest`), else ``None``
        self.probe_frame0: Callable[[float], tuple[int, bytearray] | None] | None = None
        #: ``send_tensor(dst, tag, tensor) -> bool`` and ``recv_tensor(src, tag, tensor) ->
        #: bool``: a data frame sent from, or received into, a tensor's own memory in one
        #: call (the compiled wire's), where the transport has them; ``False`` (nothing
        #: moved) for a tensor that is not dense on the CPU, which then travels by
        #: :meth:`_send_frame` / :meth:`_recv_frame`
        self.send_tensor: Callable[[int, int, torch.Tensor], bool] | None = None
        self.recv_tensor: Callable[[int, int, torch.Tensor], bool] | None = None
        #: ranks found to have failed (fault-tolerant jobs); messages to them raise
        self.failed: set[int] = set()
        #: the memory of received tensors (``compiled``: the C++ pool where it is built)
        self.recv_cache = ReceiveBufferCache(recv_cache_bytes, native=compiled)
        self.closed = False
        self.send_hook = None

    # ------------------------------------------------------- moving bytes
    def send_frame0(self, dst: int, frame0: bytes | bytearray) -> None:
        """Hand frame 0 of a message to the wire (it may stay in flight after this returns);
        a failed ``dst`` raises ``WorkerFailedError``. The one call per message of the hot
        path: :meth:`send_now` makes it, and so does the agent's compiled call path
        (:mod:`mpidag.agent.fastpath`) for a message all inside frame 0. A transport may
        replace it per instance with a faster callable of the same meaning."""
        raise NotImplementedError

    def _send_frame(self, dst: int, tag: int, buffer: Any) -> None:
        """Send one frame (a byte buffer, or a CUDA ``uint8`` tensor with a CUDA-aware
        transport), whole: it is complete when this returns."""
        raise NotImplementedError

    def _probe(self) -> tuple[int, bytearray] | None:
        """Frame 0 of the next message and its source, or ``None`` at once."""
        raise NotImplementedError

    def _recv_frame(self, src: int, tag: int, buffer: Any) -> None:
        """Receive the next frame from ``src`` on ``tag`` into ``buffer``, whole."""
        raise NotImplementedError

    # ------------------------------------------------------------ sending
    def _peer_failed(self, rank: int) -> None:
        """Note a failed peer: later sends to it raise, and poll() reports it once."""
        if rank not in self.failed and rank != self.rank:
            self.failed.add(rank)
            self.loopback.append(Envelope(kind=PEER_FAILED, src=rank))
            self.interrupt_wait()  # a poll_wait under way sees it at once

    def send_now(self, dst: int, env: Envelope, devices: list[str]) -> None:
        if self.failed and dst in self.failed:  # (the agent names the worker)
            raise WorkerFailedError(f"rank {dst} failed", dst)
        if dst == self.rank:
            self.loopback.append(self._loopback_copy(env, devices))
            self.interrupt_wait()  # a poll_wait under way sees it at once
            return
        needs_tag = env.tensors or len(env.payload) > frames.PAYLOAD_FRAME_LIMIT
        data_tag = 1 + next(self._tag_counter) % self._n_data_tags if needs_tag else 0
        frame0, separate = frames.encode(env, devices, data_tag)
        self.send_frame0(dst, frame0)
        send_tensor = self.send_tensor
        for item in separate:
            if isinstance(item, memoryview):
                self._send_frame(dst, data_tag, item)
            elif send_tensor is None or not send_tensor(dst, data_tag, item):
                self._send_frame(dst, data_tag, self._tensor_buffer(item))

    def _tensor_buffer(self, tensor: torch.Tensor) -> Any:
        """The bytes of a tensor to send: a numpy view, or a CUDA tensor when the
        transport moves device memory itself."""
        src = frames.byte_view(tensor)
        if src.is_cuda:
            if self.cuda_aware:
                torch.cuda.current_stream(src.device).synchronize()
                return src
            src = src.cpu()
        return src.numpy()

    def _loopback_copy(self, env: Envelope, devices: list[str]) -> Envelope:
        tensors = []
        for tensor, device in zip(env.tensors, devices, strict=True):
            spec = frames.make_spec(tensor, device, -1)
            copy = tensor.detach().to(device, copy=True)
            tensors.append(frames.finish_tensor(copy, spec))
        return Envelope(kind=env.kind, request_id=env.request_id, flags=env.flags,
                        context_id=env.context_id, message_id=env.message_id,
                        payload=bytes(env.payload), tensors=tensors, src=self.rank)

    # ---------------------------------------------------------- receiving
    def requeue(self, env: Envelope) -> None:
        """Put back a message that :meth:`poll` gave: the next poll (or ``poll_wait``)
        returns it first. For the leader that took it, and no one else (the agent's
        compiled path polls for the answers that follow one, and puts back the first
        message it does not handle)."""
        self.loopback.appendleft(env)

    def poll(self) -> Envelope | None:
        if self.loopback:
            return self.loopback.popleft()
        got = self._probe()
        if got is None:
            return None
        return self._open(got)

    def _open(self, got: tuple[int, bytearray]) -> Envelope | None:
        """The message whose frame 0 ``got`` (source, frame) is: its frames after frame 0
        received, its tensors made (``None``: its sender failed meanwhile)."""
        src, frame0 = got
        env, header = frames.decode_message(frame0, src)
        if header is None:
            return env
        return self.receive_rest(env, header, frame0, src)

    def receive_rest(self, env: Envelope, header: frames.Header, frame0: bytearray,
                     src: int) -> Envelope | None:
        """Finish a message whose frame 0 says more follows (``frames.decode_message`` gave
        ``header``): receive its payload frame and tensors from ``src`` into ``env``; returns
        ``env``, or ``None`` when the sender failed meanwhile (the message is dropped)."""
        try:
            if header.payload_separate:
                payload = bytearray(header.payload_length)
                self._recv_frame(src, header.data_tag, memoryview(payload))
                env.payload = memoryview(payload)
            if header.specs:
                env.tensors = [self._receive_tensor(frame0, header, spec, src)
                               for spec in header.specs]
                if header.sparse:  # sparse COO tensors arrive as indices and values
                    env.tensors = frames.assemble_sparse(env.tensors, header.sparse)
        except WorkerFailedError:  # the sender died mid-message: drop it (reported)
            log.warning("rank %d failed while sending a message to rank %d; dropped",
                        src, self.rank)
            return None
        return env

    def _receive_tensor(self, frame0: bytearray, header: frames.Header, spec: TensorSpec,
                        src: int) -> torch.Tensor:
        device = spec.device
        on_gpu = device.startswith("cuda")
        if on_gpu and not torch.cuda.is_available():
            log.error("a CUDA tensor for %s arrived from rank %d but this rank has no GPU; "
                      "keeping it on the CPU (set a device map for this peer)", device, src)
            device, on_gpu = "cpu", False
        if spec.nbytes == 0:
            t = torch.empty(spec.shape, dtype=spec.dtype, device=device)
        elif spec.inline_offset >= 0:
            t = frames.inline_tensor(frame0, header.inline_start, spec)
            if on_gpu:
                t = t.to(device)
        elif on_gpu and self.cuda_aware:
            t = torch.empty(spec.shape, dtype=spec.dtype, device=device)
            self._recv_frame(src, header.data_tag, t.view(-1).view(torch.uint8))
        else:
            t = self.recv_cache.empty_tensor(spec.shape, spec.dtype, spec.nbytes)
            recv_tensor = self.recv_tensor
            if recv_tensor is None or not recv_tensor(src, header.data_tag, t):
                self._recv_frame(src, header.data_tag, frames.byte_view(t).numpy())
            if on_gpu:
                t = t.to(device)
        return frames.finish_tensor(t, spec)

    def close(self, collective: bool) -> None:
        self.closed = True
        self.recv_cache.clear()
