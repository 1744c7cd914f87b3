"""MPI point-to-point transport on a private duplicate of ``COMM_WORLD``.

Every message starts with frame 0 on tag 0 (header, payload, tensor specs, small tensors
inline). Larger tensors follow as frames of their own on a data tag that is unique per
message and named in the header, so frames of messages sent concurrently by several threads
never mix. The receiver takes frame 0 with a matched probe (``improbe``, safe with several
threads), allocates each tensor once and receives straight into it. Frames above
:data:`CHUNK` bytes go in chunks, so tensors over 2**31 bytes work on any MPI.

CUDA tensors: with a CUDA-aware MPI (detected at start, or forced by ``MPIDAG_CUDA_AWARE=0/1``)
device buffers are sent and received directly; otherwise they are staged through host memory.
The wire format is the same either way, so the two ends decide independently.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable

import torch

from mpidag.transport import frames
from mpidag.transport.buffers import ReceiveBufferCache
from mpidag.transport.frames import Envelope, TensorSpec

__all__ = ["MPITransport", "CHUNK", "detect_cuda_aware"]

log = logging.getLogger(__name__)

HEADER_TAG = 0
#: largest single MPI transfer of a tensor frame, in bytes (counts stay below 2**31)
CHUNK = 1 << 30


def _libmpi_paths() -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if "libmpi" in line and "/" in line})
    except OSError:
        return []


def detect_cuda_aware() -> bool:
    """Whether the MPI library can send and receive CUDA device buffers.

    ``MPIDAG_CUDA_AWARE=1`` or ``0`` decides; otherwise ask the library
    (``MPIX_Query_cuda_support`` of Open MPI and MPICH); without CUDA, ``False``.

    Example::

        >>> detect_cuda_aware()  # on a machine without a GPU
        False
    """
    forced = os.environ.get("MPIDAG_CUDA_AWARE")
    if forced is not None:
        return forced.strip().lower() in ("1", "true", "yes", "on")
    if not torch.cuda.is_available():
        return False
    for path in _libmpi_paths():
        try:
            lib = ctypes.CDLL(path)
            query = lib.MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        query.restype = ctypes.c_int
        return bool(query())
    return False


class MPITransport:
    """Moves :class:`~mpidag.transport.frames.Envelope` objects between ranks.

    ``send`` may be called from any thread at once; ``poll`` by one thread at a time (the
    progress engine's leader). Calls to the own rank never touch MPI.

    Example::

        >>> t = MPITransport()                      # collective over COMM_WORLD
        >>> t.send(t.rank, Envelope(kind=1, payload=b"hi"), [])
        >>> t.poll().payload
        b'hi'
    """

    def __init__(self, base_comm=None) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        base = MPI.COMM_WORLD if base_comm is None else base_comm
        self.comm = base.Dup()
        self.comm.Set_name("mpidag")
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
        self.thread_multiple = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self._mpi_lock: contextlib.AbstractContextManager = (
            contextlib.nullcontext() if self.thread_multiple else threading.RLock()
        )
        tag_ub = self.comm.Get_attr(MPI.TAG_UB) or 32767
        self._n_data_tags = int(tag_ub) - 1  # data tags are 1..tag_ub
        self._tag_counter = itertools.count()
        self._loopback: collections.deque[Envelope] = collections.deque()
        self._status = MPI.Status()
        self.cuda_aware = detect_cuda_aware()
        self.recv_cache = ReceiveBufferCache()
        self.closed = False
        #: test hook: ``hook(dst, envelope, devices)``; returning True means the hook took
        #: the message and will call :meth:`send_now` itself (later: delays, reordering)
        self.send_hook: Callable[[int, Envelope, list[str]], bool] | None = None

    # ------------------------------------------------------------------ sending
    def send(self, dst: int, env: Envelope, devices: list[str]) -> None:
        """Send ``env`` to rank ``dst``; ``devices[i]`` is where tensor ``i`` lands there."""
        hook = self.send_hook
        if hook is not None and hook(dst, env, devices):
            return
        self.send_now(dst, env, devices)

    def send_now(self, dst: int, env: Envelope, devices: list[str]) -> None:
        """:meth:`send` without the test hook."""
        if dst == self.rank:
            self._loopback.append(self._loopback_copy(env, devices))
            return
        data_tag = 1 + next(self._tag_counter) % self._n_data_tags if env.tensors else 0
        frame0, separate = frames.encode(env, devices, data_tag)
        MPI = self._MPI
        with self._mpi_lock:
            self.comm.Send([frame0, MPI.BYTE], dst, HEADER_TAG)
        for tensor in separate:
            self._send_tensor(tensor, dst, data_tag)

    def _send_tensor(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        src = frames.byte_view(tensor)
        if src.is_cuda:
            if self.cuda_aware:
                torch.cuda.current_stream(src.device).synchronize()
            else:
                src = src.cpu()
        buf = src.numpy() if src.device.type == "cpu" else src
        total = src.numel()
        for start in range(0, total, CHUNK):
            self._wait(self.comm.Isend(buf[start:start + CHUNK], dst, tag))

    def _wait(self, request) -> None:
        if self.thread_multiple:
            request.Wait()
            return
        while True:
            with self._mpi_lock:
                if request.Test():
                    return
            time.sleep(0)

    def _loopback_copy(self, env: Envelope, devices: list[str]) -> Envelope:
        tensors = []
        for tensor, device in zip(env.tensors, devices, strict=True):
            spec = frames.make_spec(tensor, device, -1)
            copy = tensor.detach().to(device, copy=True)
            tensors.append(frames.finish_tensor(copy, spec))
        return Envelope(kind=env.kind, request_id=env.request_id, flags=env.flags,
                        context_id=env.context_id, message_id=env.message_id,
                        payload=bytes(env.payload), tensors=tensors, src=self.rank)

    # ---------------------------------------------------------------- receiving
    def poll(self) -> Envelope | None:
        """Receive one message if one is waiting, else return ``None`` at once."""
        if self._loopback:
            return self._loopback.popleft()
        MPI = self._MPI
        status = self._status
        with self._mpi_lock:
            message = self.comm.improbe(MPI.ANY_SOURCE, HEADER_TAG, status)
            if message is None:
                return None
            frame0 = bytearray(status.Get_count(MPI.BYTE))
            message.Recv([frame0, MPI.BYTE])
        src = status.Get_source()
        env, data_tag, specs, inline_start = frames.decode_header(frame0)
        env.src = src
        if specs:
            env.tensors = [self._receive_tensor(frame0, inline_start, spec, src, data_tag)
                           for spec in specs]
        return env

    def _receive_tensor(self, frame0: bytearray, inline_start: int, spec: TensorSpec,
                        src: int, tag: int) -> torch.Tensor:
        device = spec.device
        on_gpu = device.startswith("cuda")
        if on_gpu and not torch.cuda.is_available():
            log.error("a CUDA tensor for %s arrived from rank %d but this rank has no GPU; "
                      "keeping it on the CPU (set a device map for this peer)", device, src)
            device, on_gpu = "cpu", False
        if spec.nbytes == 0:
            t = torch.empty(spec.shape, dtype=spec.dtype, device=device)
        elif spec.inline_offset >= 0:
            t = frames.inline_tensor(frame0, inline_start, spec)
            if on_gpu:
                t = t.to(device)
        else:
            if on_gpu and self.cuda_aware:
                t = torch.empty(spec.shape, dtype=spec.dtype, device=device)
                raw = buf = t.view(-1).view(torch.uint8)
            else:
                raw = self.recv_cache.empty(spec.nbytes)
                buf = raw.numpy()
            for start in range(0, spec.nbytes, CHUNK):
                self._wait(self.comm.Irecv(buf[start:start + CHUNK], src, tag))
            if not (on_gpu and self.cuda_aware):
                t = raw.view(spec.dtype).view(spec.shape)
                if on_gpu:
                    t = t.to(device)
        return frames.finish_tensor(t, spec)

    # ------------------------------------------------------------- collectives
    def allreduce_sum(self, values: list[int], wait: Callable[[Callable[[], bool]], None]
                      ) -> list[int]:
        """Sum ``values`` over all ranks with a nonblocking reduction; ``wait(done)`` waits."""
        import numpy as np

        send = np.asarray(values, dtype=np.int64)
        recv = np.zeros_like(send)
        with self._mpi_lock:
            request = self.comm.Iallreduce(send, recv, op=self._MPI.SUM)
        wait(lambda: self._test(request))
        return recv.tolist()

    def _test(self, request) -> bool:
        with self._mpi_lock:
            return bool(request.Test())

    def abort(self, code: int = 1) -> None:
        """Abort the whole MPI job (every rank) with ``code``."""
        self._MPI.COMM_WORLD.Abort(code)

    def close(self, collective: bool) -> None:
        """Release the communicator (``collective``: every rank calls this now)."""
        if self.closed:
            return
        self.closed = True
        self.recv_cache.clear()
        if collective:
            with self._mpi_lock:
                self.comm.Free()
