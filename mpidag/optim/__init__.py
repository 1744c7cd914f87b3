"""``mpidag.optim``: ``torch.distributed.optim.DistributedOptimizer`` on MPI.

Port a program by changing its imports::

    from mpidag.optim import DistributedOptimizer   # was: torch.distributed.optim

    with dist_autograd.context() as context_id:
        loss = model(batch).sum()                    # parameters live on other ranks
        dist_autograd.backward(context_id, [loss])
        dist_optim.step(context_id)

Steps that share no parameter run at the same time on an owner (one lock per parameter,
taken in one global order); see :mod:`mpidag.optim.optimizer`.
"""

from mpidag.optim.optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
