"""How the way a program waits for mpidag futures changes the cost of a call (2 ranks).

    python -m mpidag.run -n 2 benchmarks/bench_wait_modes.py [--reps 5]

Rank 0 calls a no-op on rank 1:

* one call at a time, waited with ``fut.wait()`` (mpidag's own wait: the waiting thread
  drives progress) or with ``torch.futures.wait_all([fut])`` (torch's C++ wait, as torch's
  RPC tutorials write it: mpidag's leader thread must notice that the main thread waits);
* 3,000 calls in flight, waited with ``wait()`` each, ``wait_all``, or
  ``collect_all(...).wait()``.

Prints medians over ``--reps`` repetitions: µs per call, and calls/s.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mpidag.rpc as rpc


def noop() -> None:
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    rpc.init_rpc()
    if rpc.get_worker_info().id == 0:
        single = {"fut.wait()": [], "torch.futures.wait_all([fut])": []}
        for _ in range(args.reps):
            for mode, samples in single.items():
                n = 2000
                start = time.perf_counter()
                for _ in range(n):
                    fut = rpc.rpc_async(1, noop)
                    if mode == "fut.wait()":
                        fut.wait()
                    else:
                        torch.futures.wait_all([fut])
                samples.append((time.perf_counter() - start) / n * 1e6)
        many = {"wait() each": [], "wait_all": [], "collect_all().wait()": []}
        for _ in range(args.reps):
            for mode, samples in many.items():
                n = 3000
                start = time.perf_counter()
                futs = [rpc.rpc_async(1, noop) for _ in range(n)]
                if mode == "wait() each":
                    for fut in futs:
                        fut.wait()
                elif mode == "wait_all":
                    torch.futures.wait_all(futs)
                else:
                    torch.futures.collect_all(futs).wait()
                samples.append(n / (time.perf_counter() - start))
        for mode, samples in single.items():
            print(f"one call at a time, {mode:32s} {statistics.median(samples):8.1f} us/call")
        for mode, samples in many.items():
            print(f"3,000 in flight, {mode:36s} {statistics.median(samples):8.0f} calls/s")
    rpc.shutdown()


if __name__ == "__main__":
    main()
