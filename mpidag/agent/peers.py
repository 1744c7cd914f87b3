"""The workers of a session as one rank sees them: names, and which ones are gone."""

from __future__ import annotations

from mpidag.agent.options import WorkerInfo
from mpidag.errors import WorkerFailedError

__all__ = ["Peers"]


class Peers:
    """The workers by rank and name, and the ranks that failed or left.

    Example::

        >>> peers = Peers([WorkerInfo("trainer", 0), WorkerInfo("ps", 1)], rank=0)
        >>> peers.where(), peers.by_name["ps"].id
        ('trainer (rank 0 of 2)', 1)
    """

    def __init__(self, workers: list[WorkerInfo], rank: int) -> None:
        self.workers = workers
        self.rank = rank
        self.world_size = len(workers)
        self.info = workers[rank]
        self.by_name = {w.name: w for w in workers}
        #: the worker name of each rank (what messages' names read: no call per name)
        self.names: tuple[str, ...] = tuple(w.name for w in workers)
        #: ranks that failed (fault-tolerant jobs): calls to them raise WorkerFailedError
        self.failed: set[int] = set()
        #: ranks that shut down alone (graceful=False); also in ``failed``
        self.left: set[int] = set()

    def where(self) -> str:
        """This rank as errors and logs name it."""
        return f"{self.info.name} (rank {self.rank} of {self.world_size})"

    def name(self, rank: int) -> str:
        """The worker name of ``rank``."""
        return self.names[rank]

    def failed_error(self, rank: int, what: str = "") -> WorkerFailedError:
        """The error of a call to (or that needed) a failed rank.

        Example::

            >>> peers = Peers([WorkerInfo("a", 0), WorkerInfo("b", 1)], rank=0)
            >>> peers.failed_error(1, "the call of f").worker_name
            'b'
        """
        name = self.names[rank]
        prefix = f"{what} to {name}" if what else f"a call to {name}"
        return WorkerFailedError(
            f"{prefix} could not complete: worker {name} (rank {rank}) failed; the other "
            f"workers go on (see mpidag.rpc.failed_workers())", rank, name)
