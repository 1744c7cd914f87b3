"""``mpidag.nn``: ``torch.distributed.nn`` on MPI, and DDP for hybrid RPC jobs.

Port a program by changing its imports::

    from mpidag.nn import RemoteModule     # was: from torch.distributed.nn import RemoteModule
    from mpidag.nn.parallel import DistributedDataParallel   # was: torch.nn.parallel

    emb = RemoteModule("ps/cpu", torch.nn.EmbeddingBag, args=(100, 16), kwargs={"mode": "sum"})
    with dist_autograd.context() as context_id:
        loss = dense(emb(indices, offsets)).sum()
        dist_autograd.backward(context_id, [loss])
        DistributedOptimizer(torch.optim.SGD, emb.remote_parameters(), lr=0.05
                             ).step(context_id)
"""

from mpidag.nn.api.remote_module import RemoteModule

__all__ = ["RemoteModule"]
