"""Globally unique 64-bit ids built from rank bits.

``id = rank << counter_bits | counter``. The rank field is at least 16 bits wide (as in
PyTorch) and wider when the world needs it, so worlds beyond 65,536 ranks still get unique
ids; the counter takes the remaining bits. Any rank can decode the creator of an id.
Context ids, autograd message ids, RRef ids and fork ids all come from here.
"""

from __future__ import annotations

import itertools

__all__ = ["IdGenerator", "rank_bits_for"]

ID_BITS = 63  # ids stay positive in a signed int64 (torch tensors, MPI headers)
MIN_RANK_BITS = 16


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
        self.counter_bits = ID_BITS - self.rank_bits
        self._max_counter = (1 << self.counter_bits) - 1
        self._base = rank << self.counter_bits
        self._counter = itertools.count(1)  # next() on itertools.count is atomic under the GIL

    def next(self) -> int:
        """Return a new id, never returned before in this job."""
        value = next(self._counter)
        if value > self._max_counter:
            raise OverflowError(
                f"id counter of rank {self.rank} exhausted after {self._max_counter} ids "
                f"({self.counter_bits} counter bits)"
            )
        return self._base | value

    def creator(self, any_id: int) -> int:
        """The rank that created ``any_id``."""
        return any_id >> self.counter_bits

    def local_counter(self, any_id: int) -> int:
        """The per-rank counter part of ``any_id``."""
        return any_id & self._max_counter
