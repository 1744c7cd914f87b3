"""What a parameter costs to fetch against a plain tensor: ``rpc_sync`` results and
``to_here()`` of RRefs (16x64 float32), alone and in distributed autograd contexts, in µs,
medians of ``--calls`` round trips after a quarter of them as warm-up.

A parameter server fetches parameters on every step; ``nn.Parameter`` is a subclass of
``torch.Tensor`` that the compiled codec does not take, so its cost shows here beside a
plain tensor's. Public API only, so one copy measures any revision::

    python -m mpidag.run -n 2 benchmarks/parameter_fetch.py [--calls 3000]
    cd /tmp/old-tree && PYTHONPATH=$PWD python -m mpidag.run -n 2 \\
        /work/main/benchmarks/parameter_fetch.py              # another revision's mpidag
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import mpidag.autograd as dist_autograd
import mpidag.rpc as rpc

#: on the owner (worker1): the values fetched, by name
VALUES: dict[str, torch.Tensor] = {}


def make_values() -> list:
    """On worker1: a parameter, a plain tensor and a leaf that requires grad, and an RRef
    of each (in that order)."""
    gen = torch.Generator().manual_seed(0)
    VALUES["parameter"] = torch.nn.Parameter(torch.randn(16, 64, generator=gen))
    VALUES["tensor"] = torch.randn(16, 64, generator=gen)
    VALUES["leaf"] = torch.randn(16, 64, generator=gen).requires_grad_()
    return [rpc.RRef(VALUES[name]) for name in ("parameter", "tensor", "leaf")]


def get(name: str) -> torch.Tensor:
    return VALUES[name]


def noop() -> None:
    return None


def median_us(call: Callable[[], object], calls: int) -> float:
    """The median µs of ``call()`` over ``calls`` timed calls after ``calls // 4`` others."""
    for _ in range(calls // 4):
        call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def in_context(*fetches: Callable[[], object]) -> Callable[[], None]:
    """One new distributed autograd context that runs ``fetches`` (then is released)."""
    def run() -> None:
        with dist_autograd.context():
            for fetch in fetches:
                fetch()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    rpc.init_rpc()
    if rpc.get_worker_info().id == 0:
        param, tensor, leaf = rpc.rpc_sync("worker1", make_values)
        rows = [
            ("rpc_sync of a no-op", lambda: rpc.rpc_sync("worker1", noop)),
            ("rpc_sync returning a tensor", lambda: rpc.rpc_sync("worker1", get, ("tensor",))),
            ("rpc_sync returning a parameter",
             lambda: rpc.rpc_sync("worker1", get, ("parameter",))),
            ("to_here() of a tensor", tensor.to_here),
            ("to_here() of a leaf that requires grad", leaf.to_here),
            ("to_here() of a parameter", param.to_here),
            ("a new context, nothing in it", in_context()),
            ("a new context, to_here() of a parameter", in_context(param.to_here)),
            ("a new context, two parameters fetched", in_context(param.to_here, param.to_here)),
        ]
        width = max(len(name) for name, _ in rows)
        for name, call in rows:
            print(f"{name:<{width}}  {median_us(call, args.calls):8.1f} us", flush=True)
        del rows, call, param, tensor, leaf  # the RRefs are released before the shutdown
    rpc.shutdown()


if __name__ == "__main__":
    main()
