"""A tour of mpidag.rpc: calls, futures, a remote exception and measured latencies.

Run:  python -m mpidag.run -n 2 examples/rpc_tour.py
"""

from __future__ import annotations

import statistics
import time

import torch

import mpidag.rpc as rpc


def add(a, b):
    return a + b


def noop():
    return None


def identity(x):
    return x


def divide(a, b):
    if b == 0:
        raise ZeroDivisionError(f"cannot divide {a} by zero on {rpc.get_worker_info().name}")
    return a / b


def median_us(fn, n: int, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(times)


def main() -> None:
    rpc.init_rpc()  # rank and world size come from mpirun / srun
    me = rpc.get_worker_info()
    if me.id == 0:
        peer = "worker1"
        print(f"[{me.name}] world: {[rpc.get_worker_info(f'worker{i}').name for i in range(2)]}")
        x = torch.arange(6.0).reshape(2, 3)
        y = rpc.rpc_sync(peer, add, args=(x, 10))
        print(f"[{me.name}] rpc_sync({peer}, add, x, 10) ->\n{y}")
        futs = [rpc.rpc_async(peer, add, args=(i, i)) for i in range(5)]
        print(f"[{me.name}] rpc_async x5 -> {[f.wait() for f in futs]}")
        try:
            rpc.rpc_sync(peer, divide, args=(1, 0))
        except ZeroDivisionError as exc:
            print(f"[{me.name}] remote exception re-raised with its type: "
                  f"{type(exc).__name__}: {exc}")
            print(f"[{me.name}] its remote traceback ends with: "
                  f"{str(exc.__cause__).strip().splitlines()[-1]}")
        for _ in range(500):
            rpc.rpc_sync(peer, noop)
        rtt = median_us(lambda: rpc.rpc_sync(peer, noop), 2000)
        print(f"[{me.name}] rpc_sync no-op round trip: {rtt:.1f} us (median of 5 x 2000)")
        start = time.perf_counter()
        torch.futures.wait_all([rpc.rpc_async(peer, noop) for _ in range(5000)])
        print(f"[{me.name}] rpc_async: {5000 / (time.perf_counter() - start):,.0f} calls/s "
              f"with 5000 in flight")
        for nbytes in (1 << 10, 1 << 20, 64 << 20):
            t = torch.randn(nbytes // 4)
            rpc.rpc_sync(peer, identity, args=(t,))
            us = median_us(lambda t=t: rpc.rpc_sync(peer, identity, args=(t,)),
                           max(3, min(200, (256 << 20) // nbytes)), reps=3)
            print(f"[{me.name}] echo {nbytes >> 10:>6} KiB: {us:10.1f} us  "
                  f"({2 * nbytes / us / 1e3:.2f} GB/s)")
    rpc.shutdown()
    print(f"[{me.name}] shut down cleanly")


if __name__ == "__main__":
    main()
