"""``mpidag.nn.api``: where :class:`~mpidag.nn.RemoteModule` lives (torch:
``torch.distributed.nn.api``).

Example::

    from mpidag.nn.api.remote_module import RemoteModule   # also: from mpidag.nn import ...
"""
