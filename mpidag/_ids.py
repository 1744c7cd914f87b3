"""Globally unique 64-bit ids built from rank bits.

``id = rank << counter_bits | counter``. The rank field is at least 16 bits wide (as in
PyTorch) and wider when the world needs it, so worlds beyond 65,536 ranks still get unique
ids; the counter takes the remaining bits. Up to 32,768 ranks the layout is torch's exactly
(48 counter bits: ``id >> 48`` is the creator's rank, as torch's tests and tools decode
it); beyond, ids stay positive in a signed int64 (63 bits), where torch's turn negative.
Any rank can decode the creator of an id.
Context ids, autograd message ids, RRef ids and fork ids all come from here.
"""

from __future__ import annotations

import itertools

__all__ = ["IdGenerator", "counter_bits_for", "rank_bits_for"]

ID_BITS = 63  # ids stay positive in a signed int64 (torch tensors, MPI headers)
MIN_RANK_BITS = 16
TORCH_COUNTER_BITS = 48  # torch's layout: a 16-bit worker id above a 48-bit counter


def counter_bits_for(world_size: int) -> int:
    """Width of the counter field: torch's 48 bits while ``rank << 48`` stays positive
    (up to 32,768 ranks), else what the positive 63 bits leave beside the rank field.

    Example::

        >>> counter_bits_for(8), counter_bits_for(65_536), counter_bits_for(100_000)
        (48, 47, 46)
    """
    if world_size <= 1 << (ID_BITS - TORCH_COUNTER_BITS):
        return TORCH_COUNTER_BITS
    return ID_BITS - rank_bits_for(world_size)


def rank_bits_for(world_size: int) -> int:
    """Width of the rank field for a world of ``world_size`` ranks.

    Example::

        >>> rank_bits_for(8), rank_bits_for(100_000)
        (16, 17)
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    return max(MIN_RANK_BITS, (world_size - 1).bit_length())


class IdGenerator:
    """Thread-safe source of unique ids for one rank.

    Example::

        >>> gen = IdGenerator(rank=3, world_size=4)
        >>> i = gen.next()
        >>> gen.creator(i), gen.local_counter(i)
        (3, 1)
    """

    def __init__(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank!r} is outside the world of size {world_size!r}")
        self.rank = rank
        self.rank_bits = rank_bits_for(world_size)
        self.counter_bits = counter_bits_for(world_size)
        #: the largest per-rank counter, and this rank's bits of every id
        self.max_counter = (1 << self.counter_bits) - 1
        self.base = rank << self.counter_bits
        #: the per-rank counter (``next()`` on an ``itertools.count`` is atomic under the
        #: GIL; the compiled call path draws from it too)
        self.counter = itertools.count(1)

    def next(self) -> int:
        """Return a new id, never returned before in this job."""
        value = next(self.counter)
        if value > self.max_counter:
            raise OverflowError(
                f"id counter of rank {self.rank} exhausted after {self.max_counter} ids "
                f"({self.counter_bits} counter bits)"
            )
        return self.base | value

    def creator(self, any_id: int) -> int:
        """The rank that created ``any_id``."""
        return any_id >> self.counter_bits

    def local_counter(self, any_id: int) -> int:
        """The per-rank counter part of ``any_id``."""
        return any_id & self.max_counter
