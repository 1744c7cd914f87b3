"""The floor of a tensor echo: mpidag's ``rpc_sync`` beside two hand-written mpi4py loops.

Run on exactly two ranks::

    python -m mpidag.run -n 2 benchmarks/tensor_floor.py [--sizes 262144,1048576]
        [--calls 400] [--rounds 3] [--out FILE]

For each size (bytes of a float32 tensor), in one job, rounds alternating, three columns of
median µs per round trip:

* ``raw``: the blocking ``Send``/``Recv`` echo of ``bench_rpc.py``'s raw row: one buffer
  reused on each rank, each receive posted before the bytes leave;
* ``pattern``: the messages mpidag sends, written by hand: a 64-byte header (frame 0) and
  the tensor (a data frame) sent at once with ``Isend``; the receiver probes for the
  header, makes a new tensor (an RPC must hand out a new one) and receives into it;
* ``mpidag``: ``rpc_sync`` of a function that returns its argument.

Both hand-written loops run on rank 1 inside an RPC (a pool thread), in the same processes
as mpidag, so the three columns share the processes' threads and settings. ``pattern``
over ``raw`` is what the message pattern and the new memory cost; ``mpidag`` over
``pattern`` is mpidag's own cost around them. Rank 0 prints a table and, with ``--out``,
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

import mpidag.rpc as rpc

_TAG_RAW, _TAG_HEADER, _TAG_DATA = 5, 6, 7
_HEADER = np.zeros(64, np.uint8)
_comm = None
_stopped = threading.Event()


def echo(x: torch.Tensor) -> torch.Tensor:
    return x


def stop() -> None:
    _stopped.set()


def _recv_header(src: int) -> None:
    header = np.empty(64, np.uint8)
    while True:
        message = _comm.improbe(src, _TAG_HEADER)
        if message is not None:
            message.Recv([header, MPI.BYTE])
            return


def _send_pattern(dst: int, tensor: torch.Tensor) -> None:
    MPI.Request.Waitall([_comm.Isend([_HEADER, MPI.BYTE], dst, _TAG_HEADER),
                         _comm.Isend([tensor.numpy(), MPI.BYTE], dst, _TAG_DATA)])


def _recv_pattern(src: int, numel: int) -> torch.Tensor:
    _recv_header(src)
    tensor = torch.empty(numel)
    _comm.Irecv([tensor.numpy(), MPI.BYTE], src, _TAG_DATA).Wait()
    return tensor


def raw_server(calls: int, numel: int) -> None:
    """Rank 1: the blocking echo into one reused buffer."""
    buffer = torch.empty(numel)
    for _ in range(calls):
        _comm.Recv([buffer.numpy(), MPI.BYTE], 0, _TAG_RAW)
        _comm.Send([buffer.numpy(), MPI.BYTE], 0, _TAG_RAW)


def pattern_server(calls: int, numel: int) -> None:
    """Rank 1: header and data frame in, a new tensor, the same back."""
    for _ in range(calls):
        _send_pattern(0, _recv_pattern(0, numel))


def _timed(step, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure_raw(x: torch.Tensor, calls: int) -> float:
    buffer = torch.empty_like(x)
    served = rpc.rpc_async(1, raw_server, args=(calls, x.numel()))

    def step() -> None:
        _comm.Send([x.numpy(), MPI.BYTE], 1, _TAG_RAW)
        _comm.Recv([buffer.numpy(), MPI.BYTE], 1, _TAG_RAW)

    median = _timed(step, calls)
    served.wait()
    return median


def measure_pattern(x: torch.Tensor, calls: int) -> float:
    served = rpc.rpc_async(1, pattern_server, args=(calls, x.numel()))

    def step() -> None:
        _send_pattern(1, x)
        _recv_pattern(1, x.numel())

    median = _timed(step, calls)
    served.wait()
    return median


def measure_mpidag(x: torch.Tensor, calls: int) -> float:
    return _timed(lambda: rpc.rpc_sync(1, echo, args=(x,)), calls)


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes takes byte counts separated by commas, "
                                         f"not {text!r}") from None
    if not sizes or any(size < 4 or size % 4 for size in sizes):
        raise argparse.ArgumentTypeError("--sizes: each size a multiple of 4 bytes (float32)")
    return sizes


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    global _comm
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sizes", type=_sizes, default=[256 << 10, 1 << 20],
                        help="tensor sizes in bytes, comma-separated (default 262144,1048576)")
    parser.add_argument("--calls", type=_positive, default=400,
                        help="round trips per column and round (default 400)")
    parser.add_argument("--rounds", type=_positive, default=3,
                        help="rounds of the three columns, alternating (default 3)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (rank 0)")
    args = parser.parse_args(argv)
    if MPI.COMM_WORLD.Get_size() != 2:
        print("run on 2 ranks: python -m mpidag.run -n 2 benchmarks/tensor_floor.py",
              file=sys.stderr)
        return 2
    _comm = MPI.COMM_WORLD.Dup()  # the hand-written loops' own messages
    rpc.init_rpc()
    results = {}
    if MPI.COMM_WORLD.Get_rank() == 0:
        for size in args.sizes:
            x = torch.randn(size // 4)
            columns: dict[str, list[float]] = {"raw": [], "pattern": [], "mpidag": []}
            for _ in range(args.rounds):
                columns["raw"].append(measure_raw(x, args.calls))
                columns["pattern"].append(measure_pattern(x, args.calls))
                columns["mpidag"].append(measure_mpidag(x, args.calls))
            medians = {name: statistics.median(values) for name, values in columns.items()}
            results[size] = {"median_us": medians, "rounds_us": columns,
                             "pattern_vs_raw": medians["pattern"] / medians["raw"],
                             "mpidag_vs_pattern": medians["mpidag"] / medians["pattern"]}
            print(f"{size:>10} bytes: raw {medians['raw']:8.1f} us, pattern "
                  f"{medians['pattern']:8.1f} us, mpidag {medians['mpidag']:8.1f} us "
                  f"(pattern/raw {results[size]['pattern_vs_raw']:.2f}x, mpidag/pattern "
                  f"{results[size]['mpidag_vs_pattern']:.2f}x)", flush=True)
        rpc.rpc_sync(1, stop)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                            "calls": args.calls, "rounds": args.rounds,
                                            "sizes": results}, indent=2))
    else:
        while not _stopped.wait(0.05):
            pass
    rpc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
