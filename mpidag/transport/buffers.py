"""A cache of page-backed host buffers for large received tensors.

Receiving into freshly allocated memory costs a page fault per 4 KiB page; measured here a
64 MiB echo with raw mpi4py drops from 9.0 GB/s (reused buffer) to 1.07 GB/s (fresh
buffer). Every RPC must hand the user a fresh tensor, so large tensors are received into
blocks of private anonymous memory (huge pages where the kernel allows) that come back to this
cache when the last tensor or view using them is freed, and are reused by later messages
of the same size class. Blocks below :data:`MIN_CACHED` bytes use the ordinary allocator.

Received tensors backed by a cached block are not resizable (``resize_`` raises), like
tensors made by ``torch.from_numpy``.

Where ``_mpidag_torch`` is built, its ``ReceivePool`` (C++) does all of this: a tensor comes
from ``at::from_blob`` over the block in one call, and its storage's deleter gives the block
back; else an ``mmap`` block, a numpy array over it with a ``weakref.finalize``, and
``torch.from_numpy``. Making and freeing a 1 MiB tensor, in one thread: 13.1 us in Python,
1.1 us in C++ (256 KiB, ``torch.empty`` against ``at::empty``: 3.3 us and 1.5 us); stamped in
a 1 MiB echo, on the path of every large message on both ends, the Python hit took 16-18 us.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import threading
import weakref

import numpy as np
import torch

from mpidag.transport.torch_native import torch_module

__all__ = ["ReceiveBufferCache", "MIN_CACHED"]

MIN_CACHED = 1 << 20
SIZE_CLASS = 2 << 20  # one x86 huge page


class ReceiveBufferCache:
    """Hands out writable ``uint8`` tensors of exactly ``nbytes``, recycling their memory.

    ``limit`` bounds the bytes kept in free blocks (``MPIDAG_RECV_CACHE_MB``, 1 GiB by
    default).

    Example::

        >>> cache = ReceiveBufferCache()
        >>> t = cache.empty(64 << 20)          # page faults the first time only
        >>> del t                              # the block goes back to the cache
        >>> cache.empty(64 << 20).shape
        torch.Size([67108864])
    """

    def __init__(self, limit: int = 1 << 30, native: bool = True) -> None:
        self.limit = limit
        native_module = torch_module() if native else None
        #: the C++ pool where ``_mpidag_torch`` is built (``native=False``: the Python one)
        self.pool = None if native_module is None else \
            native_module.ReceivePool(limit, MIN_CACHED, SIZE_CLASS)
        # free blocks by size class, each an LRU (oldest first) keyed by id(block)
        self._free: dict[int, collections.OrderedDict[int, mmap.mmap]] = {}
        self._lru: collections.OrderedDict[int, int] = collections.OrderedDict()  # id -> size
        self._free_bytes = 0
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    @property
    def hits(self) -> int:
        """Tensors made from a free block."""
        return self._hits if self.pool is None else self.pool.hits

    @property
    def misses(self) -> int:
        """Tensors that needed a new block."""
        return self._misses if self.pool is None else self.pool.misses

    def empty(self, nbytes: int) -> torch.Tensor:
        """An uninitialized ``uint8`` tensor of ``nbytes`` bytes."""
        if self.pool is not None:
            return self.pool.empty((nbytes,), torch.uint8)
        if nbytes < MIN_CACHED or self.limit <= 0:
            return torch.empty(nbytes, dtype=torch.uint8)
        size = -(-nbytes // SIZE_CLASS) * SIZE_CLASS
        block = None
        with self._lock:
            free = self._free.get(size)
            if free:
                key, block = free.popitem()  # the most recently freed: warmest in cache
                del self._lru[key]
                self._free_bytes -= size
                self._hits += 1
        if block is None:
            self._misses += 1
            # private, not Python's default MAP_SHARED: shmem-backed pages made a 64 MiB
            # MPI echo 2.6x slower here (21 ms vs 8 ms), and huge pages need private memory
            block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                with contextlib.suppress(OSError):
                    block.madvise(mmap.MADV_HUGEPAGE)
        array = np.frombuffer(block, dtype=np.uint8, count=nbytes)
        weakref.finalize(array, self._release, size, block)
        return torch.from_numpy(array)

    def empty_tensor(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
                     nbytes: int) -> torch.Tensor:
        """An uninitialized contiguous tensor of ``shape`` and ``dtype`` (``nbytes`` bytes),
        from a recycled block when it is large enough for one (see :meth:`empty`).

        Example::

            >>> ReceiveBufferCache().empty_tensor((2, 3), torch.float32, 24).shape
            torch.Size([2, 3])
        """
        if self.pool is not None:
            return self.pool.empty(shape, dtype)
        if nbytes < MIN_CACHED or self.limit <= 0:
            return torch.empty(shape, dtype=dtype)  # one call: no views to make
        return self.empty(nbytes).view(dtype).view(shape)

    def _release(self, size: int, block: mmap.mmap) -> None:
        with self._lock:
            if self.limit <= 0:
                return
            key = id(block)
            self._free.setdefault(size, collections.OrderedDict())[key] = block
            self._lru[key] = size
            self._free_bytes += size
            while self._free_bytes > self.limit and self._lru:
                old_key, old_size = self._lru.popitem(last=False)  # least recently freed
                del self._free[old_size][old_key]
                self._free_bytes -= old_size

    @property
    def free_bytes(self) -> int:
        """Bytes in free blocks."""
        return self._free_bytes if self.pool is None else self.pool.free_bytes

    def clear(self) -> None:
        """Unmap the free blocks (blocks still in use come back when their tensors die)."""
        if self.pool is not None:
            self.pool.clear()
        with self._lock:
            self._free.clear()
            self._lru.clear()
            self._free_bytes = 0
