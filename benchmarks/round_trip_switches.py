"""No-op ``rpc_sync`` round trips with what each one costs the two processes: wall time,
CPU time and context switches (voluntary / involuntary) per call, on both ranks.

A change that adds a thread hand-off to the message path shows as more voluntary switches
per call whatever the VM's speed; wall time alone moves by +-30 % between runs of one tree
on the 2-core VM. Uses the public API only, so one copy of it measures any revision::

    python -m mpidag.run -n 2 benchmarks/round_trip_switches.py [--calls 5000]
    cd /tmp/old-tree && PYTHONPATH=$PWD python -m mpidag.run -n 2 \\
        /work/main/benchmarks/round_trip_switches.py          # another revision's mpidag
"""

from __future__ import annotations

import argparse
import resource
import time

import mpidag.rpc as rpc


def noop() -> None:
    return None


def usage() -> tuple[int, int, float]:
    """(voluntary switches, involuntary switches, CPU seconds) of this whole process."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_nvcsw, r.ru_nivcsw, time.process_time()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    rpc.init_rpc()
    if rpc.get_worker_info().id == 0:
        for _ in range(500):  # warm-up
            rpc.rpc_sync("worker1", noop)
        mine, theirs = usage(), rpc.rpc_sync("worker1", usage)
        began = time.perf_counter()
        for _ in range(args.calls):
            rpc.rpc_sync("worker1", noop)
        wall = (time.perf_counter() - began) / args.calls * 1e6
        mine_after, theirs_after = usage(), rpc.rpc_sync("worker1", usage)

        def per_call(before: tuple, after: tuple) -> str:
            vol, invol, cpu = (b - a for a, b in zip(before, after, strict=True))
            n = args.calls
            return f"{vol / n:.2f} / {invol / n:.2f} switches, {cpu / n * 1e6:.1f} us CPU"

        print(f"no-op round trip {wall:.1f} us; per call: caller {per_call(mine, mine_after)}; "
              f"callee {per_call(theirs, theirs_after)}", flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    main()
