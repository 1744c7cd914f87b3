"""Where the time of one RPC goes: time stamps along the path of a message, on both ranks.

Run on 2 ranks (one host: ``time.perf_counter_ns`` is ``CLOCK_MONOTONIC``, the same clock
in every process)::

    python -m mpidag.run -n 2 benchmarks/profile_message_path.py [--calls 3000]

Rank 0 calls rank 1; for every call the script stamps, without changing mpidag itself
(it wraps the MPI transport's ``send_frame0``, ``_probe``, ``_probe_wait`` and
``probe_frame0``, and the called function):

    T0 caller enters rpc_sync / to_here          T3 callee's reply leaves (MPI_Send done)
    T1 request leaves the caller (MPI_Send done)  T4 caller's leader has the reply frame
    T2 callee's leader has the request frame      T5 the caller's call returns
    F0/F1 the called function starts / returns (on the callee)

and prints the median of each step, per workload: a no-op ``rpc_sync``, a 1 KiB tensor
echo, ``to_here()`` of a 1 KiB tensor RRef, and a 1 MiB tensor echo, whose tensor travels
in a data frame after frame 0: for it the script also times each data frame's send (``D``
rows: from posting the send to its end, per direction) and, where Python receives it, its
receive (from posting the receive to the end of the transfer). Where the compiled wire is
built the frames after frame 0 are received inside its C ``receive_rest``, which no wrapper
sees: the receive rows are then empty, and the callee's "frame to function start" and the
caller's "reply frame to call returns" include the transfer.
The stamps cost about 0.3 us each; the "wire" steps include the time until the receiving
leader's next poll finds the message (its polling loop), not only MPI's own latency.
Results: ``--out`` JSON (``benchmarks/results/message_path.json``) and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from mpi4py import MPI

import mpidag.rpc as rpc
from mpidag import _runtime, testing
from mpidag.transport import frames

KIND_CALL, KIND_RESULT = 1, 2
_clock = time.perf_counter_ns
#: request_id -> {stamp name: ns}; filled on both ranks, gathered at the end
stamps: dict[int, dict[str, int]] = {}
_function_stamps: list[tuple[int, int]] = []
#: (direction, start ns, end ns) of every data frame this rank sent or received
data_frames: list[tuple[str, int, int]] = []
#: the request id of the last request this rank sent
_last_call = [0]


def _header(frame0) -> tuple[int, int]:
    fields = frames.HEADER.unpack_from(frame0, 0)
    return fields[0], fields[5]  # kind, request_id


def instrument(transport) -> None:
    """Wrap this rank's transport so each request and reply frame is stamped."""
    send_frame0, probe = transport.send_frame0, transport._probe

    def stamped_send(dst, frame0):
        send_frame0(dst, frame0)
        now = _clock()
        kind, request_id = _header(frame0)
        name = "T1" if kind == KIND_CALL else "T3"
        stamps.setdefault(request_id, {})[name] = now
        if kind == KIND_CALL:
            _last_call[0] = request_id

    def stamp_received(got):
        if got is not None:
            now = _clock()
            kind, request_id = _header(got[1])
            name = "T2" if kind == KIND_CALL else "T4"
            stamps.setdefault(request_id, {})[name] = now
        return got

    def stamped_probe():
        return stamp_received(probe())

    probe_wait = getattr(transport, "_probe_wait", None)  # the compiled path's waiting poll
    if probe_wait is not None:
        transport._probe_wait = lambda seconds: stamp_received(probe_wait(seconds))
    probe_frame0 = transport.probe_frame0  # the agent's compiled leader step polls here
    if probe_frame0 is not None:
        transport.probe_frame0 = lambda seconds: stamp_received(probe_frame0(seconds))

    send_frame, recv_frame = transport._send_frame, transport._recv_frame

    def timed_send_frame(*args):
        start = _clock()
        send_frame(*args)
        data_frames.append(("send", start, _clock()))

    def timed_recv_frame(*args):
        start = _clock()
        recv_frame(*args)
        data_frames.append(("recv", start, _clock()))

    transport.send_frame0 = stamped_send
    transport._probe = stamped_probe
    transport._send_frame = timed_send_frame
    transport._recv_frame = timed_recv_frame
    # the compiled wire's sends and receives of a tensor's own memory (looked up per frame)
    for name, direction in (("send_tensor", "send"), ("recv_tensor", "recv")):
        moved = getattr(transport, name, None)
        if moved is not None:
            setattr(transport, name, _timed_tensor_frame(moved, direction))


def _timed_tensor_frame(moved, direction: str):
    def timed(*args):
        start = _clock()
        done = moved(*args)
        if done:
            data_frames.append((direction, start, _clock()))
        return done
    return timed


def noop():
    start = _clock()
    _function_stamps.append((start, _clock()))


def echo(t):
    start = _clock()
    _function_stamps.append((start, _clock()))
    return t


def ones_kib():
    return torch.ones(256)


def run_workload(call, calls: int) -> list[dict[str, int]]:
    """Rank 0: ``calls`` calls, each stamped T0/T5 around it; returns per-call stamps."""
    for _ in range(200):  # warm-up
        call()
    records = []
    for _ in range(calls):
        t0 = _clock()
        call()
        t5 = _clock()
        records.append({"request_id": _last_call[0], "T0": t0, "T5": t5})
    return records


STEPS = [
    ("caller: rpc_sync to request sent", "T0", "T1"),
    ("wire + callee poll: request", "T1", "T2"),
    ("callee: frame to function start", "T2", "F0"),
    ("callee: function", "F0", "F1"),
    ("callee: function end to reply sent", "F1", "T3"),
    ("wire + caller poll: reply", "T3", "T4"),
    ("caller: reply frame to call returns", "T4", "T5"),
    ("round trip", "T0", "T5"),
]


DATA_STEPS = [
    "D request: send posted to done",
    "D request: receive posted after send posted",
    "D request: transfer (receive posted to done)",
    "D reply: send posted to done",
    "D reply: receive posted after send posted",
    "D reply: transfer (receive posted to done)",
]


def _data_frame_steps(caller: list[tuple[str, int, int]], callee: list[tuple[str, int, int]]
                      ) -> dict[str, float]:
    """Medians of the data frames' timing: the request's frames go caller -> callee, the
    reply's callee -> caller; the n-th send of one side pairs with the n-th receive of the
    other (one data frame per message, messages in order)."""
    out = {}
    for label, sends, recvs in (("request", caller, callee), ("reply", callee, caller)):
        sent = [f for f in sends if f[0] == "send"]
        if sent:
            out[f"D {label}: send posted to done"] = statistics.median(
                (f[2] - f[1]) / 1000 for f in sent)
        pairs = list(zip(sent, [f for f in recvs if f[0] == "recv"], strict=False))
        if not pairs:
            continue
        out[f"D {label}: receive posted after send posted"] = statistics.median(
            (r[1] - s[1]) / 1000 for s, r in pairs)
        out[f"D {label}: transfer (receive posted to done)"] = statistics.median(
            (r[2] - r[1]) / 1000 for s, r in pairs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--out", default="benchmarks/results/message_path.json")
    args = parser.parse_args()
    rpc.init_rpc()
    comm = MPI.COMM_WORLD
    me = comm.Get_rank()
    if comm.Get_size() != 2:
        raise SystemExit("run on 2 ranks: python -m mpidag.run -n 2 "
                         "benchmarks/profile_message_path.py")
    instrument(_runtime.current().transport)
    results = {}
    payload = torch.ones(256)  # 1 KiB
    big = torch.ones(1 << 18)  # 1 MiB: above the inline limit, so in a data frame
    for workload in ("noop", "echo_1KiB", "to_here_1KiB", "echo_1MiB"):
        # rank 1 waits in mpidag's quiescence test, which sleeps: a thread blocked in a
        # busy-polling MPI_Barrier took a core from the serving threads (ms-long stalls)
        testing.quiesce()
        stamps.clear()
        _function_stamps.clear()
        data_frames.clear()
        records = []
        if me == 0:
            if workload == "noop":
                records = run_workload(lambda: rpc.rpc_sync(1, noop), args.calls)
            elif workload in ("echo_1KiB", "echo_1MiB"):
                tensor = payload if workload == "echo_1KiB" else big
                records = run_workload(lambda t=tensor: rpc.rpc_sync(1, echo, args=(t,)),
                                       args.calls)
            else:
                rref = rpc.remote(1, ones_kib)
                rref.to_here()
                records = run_workload(rref.to_here, args.calls)
                del rref
        testing.quiesce()
        theirs = comm.gather((dict(stamps), list(_function_stamps), list(data_frames)),
                             root=0)
        if me == 0:
            callee_stamps, functions, callee_frames = theirs[1]
            rows = []
            functions = sorted(functions)
            for rec in records:
                merged = {**stamps.get(rec["request_id"], {}),
                          **callee_stamps.get(rec["request_id"], {}), **rec}
                if not all(k in merged for k in ("T1", "T2", "T3", "T4")):
                    continue
                inside = [f for f in functions if merged["T2"] <= f[0] <= merged["T3"]]
                if inside:
                    merged["F0"], merged["F1"] = inside[0]
                else:  # to_here: no user function; the fetch handler is the "function"
                    merged["F0"] = merged["F1"] = merged["T2"]
                rows.append(merged)
            table = {}
            for label, a, b in STEPS:
                values = [(r[b] - r[a]) / 1000 for r in rows]
                table[label] = statistics.median(values) if values else None
            if data_frames:
                table.update(_data_frame_steps(data_frames, callee_frames))
            results[workload] = {"calls": len(rows), "median_us": table}
    if me == 0:
        labels = [label for label, _, _ in STEPS] + [label for label in DATA_STEPS]
        print(f"{'step':46s}" + "".join(f"{w:>16s}" for w in results))
        for label in labels:
            print(f"{label:46s}" + "".join(
                f"{results[w]['median_us'].get(label, float('nan')):16.1f}" for w in results))
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                   "calls": args.calls, "workloads": results}, indent=2))
        print(f"wrote {out}")
    rpc.shutdown()


if __name__ == "__main__":
    main()
