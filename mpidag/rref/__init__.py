"""Remote references: :class:`RRef`, :func:`remote` and the owner/user protocol."""

from mpidag.rref.rref import RRef, remote

__all__ = ["RRef", "remote"]
