"""``rpc_async`` bursts one by one: how rank 0's two threads share its core.

Run on two ranks::

    python -m mpidag.run -n 2 benchmarks/async_bursts.py
    python -m mpidag.run -n 2 benchmarks/async_bursts.py --calls 5000 --seconds 5

Rank 0's main thread issues ``--calls`` ``rpc_async`` no-ops to rank 1 and waits for them
with ``torch.futures.wait_all``, again and again for ``--seconds`` (after a warm-up). For
every burst it records the rate, the µs per call of issuing alone, and how many answers
rank 0's progress leader had completed by the time the last call was issued. It prints the
distribution of the rates and the slowest and fastest bursts with those two figures: how
much the rate moves from burst to burst, and whether a slow burst is slow in its issuing
or in its end (``docs/design.md``, "The floor, step by step", under ``rpc_async``).
``--json`` writes every burst.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import mpidag.rpc as rpc


def noop() -> None:
    """The no-op remote function."""


def bursts(calls: int, seconds: float, warmup: int = 20) -> list[dict[str, float]]:
    """Rank 0's bursts: ``rate`` (calls/s), ``issue_us`` (µs per call to issue them all)
    and ``done_at_issue_end`` (answers already completed then)."""
    for _ in range(warmup):
        torch.futures.wait_all([rpc.rpc_async("worker1", noop) for _ in range(calls)])
    out = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or not out:
        t0 = time.perf_counter()
        futures = [rpc.rpc_async("worker1", noop) for _ in range(calls)]
        t1 = time.perf_counter()
        done = sum(f.done() for f in futures)
        torch.futures.wait_all(futures)
        t2 = time.perf_counter()
        out.append({"rate": calls / (t2 - t0), "issue_us": (t1 - t0) / calls * 1e6,
                    "done_at_issue_end": done})
    return out


def report(samples: list[dict[str, float]], calls: int) -> str:
    """The distribution of the rates, and the slowest and fastest three bursts."""
    rates = sorted(s["rate"] for s in samples)
    lines = [f"{len(samples)} bursts of {calls} calls: median {statistics.median(rates):,.0f}"
             f" calls/s, min {rates[0]:,.0f}, max {rates[-1]:,.0f}"]
    if len(rates) >= 4:
        q1, _, q3 = statistics.quantiles(rates, n=4)
        lines[0] += f", quartiles {q1:,.0f} / {q3:,.0f}"
    ordered = sorted(samples, key=lambda s: s["rate"])
    for name, chosen in (("slowest", ordered[:3]), ("fastest", ordered[-3:])):
        lines.append(f"{name}: " + "; ".join(
            f"{s['rate']:,.0f}/s, issuing {s['issue_us']:.2f} us a call, "
            f"{s['done_at_issue_end']} answered meanwhile" for s in chosen))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000, help="calls a burst (1,000)")
    parser.add_argument("--seconds", type=float, default=3.0, help="how long to run (3 s)")
    parser.add_argument("--json", type=Path, help="also write every burst here (rank 0)")
    args = parser.parse_args(argv)
    if args.calls < 1 or not args.seconds > 0:
        parser.error(f"--calls must be at least 1 and --seconds positive, got {args.calls} "
                     f"and {args.seconds}")
    rpc.init_rpc()
    try:
        if rpc.get_worker_info().id == 0:
            samples = bursts(args.calls, args.seconds)
            print(report(samples, args.calls), flush=True)
            if args.json:
                args.json.write_text(json.dumps(samples))
    finally:
        rpc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
