"""``mpidag.trace``: each rank's torch.profiler trace merged into one Chrome trace of the job,
ranks as processes on rank 0's clock, each caller's RPC range linked to its serving range."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

import mpidag.autograd as dist_autograd
import mpidag.rpc as rpc
from mpidag import _runtime, testing, trace
from tests import autograd_funcs as af

pytestmark = pytest.mark.mpi(min_size=2)


def test_merged_trace_of_a_distributed_step(rpc_world):
    job_dir = Path(tempfile.gettempdir()) / f"mpidag-trace-{_runtime.current().job_id}"
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    x = torch.ones(4, requires_grad=True)
    testing.quiesce()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                experimental_config=every_thread) as prof:
        testing.quiesce()
        for _ in range(3):
            with dist_autograd.context() as context_id:
                y = rpc.rpc_sync(rpc_world.next, af.mul_sin, args=(x, x))
                dist_autograd.backward(context_id, [y.sum()])
        testing.quiesce()
    path = trace.export_rank_trace(prof, job_dir / f"rank{rpc_world.rank}.json")
    assert trace.clock_offset_ns() == 0  # every rank of this job is on rank 0's host
    testing.quiesce()  # every rank's file is written
    if rpc_world.rank == 0:
        files = sorted(job_dir.glob("rank*.json"))
        assert len(files) == rpc_world.size
        merged = trace.merge_traces(files, job_dir / "job.json")
        events = merged["traceEvents"]
        names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
        assert names == {f"worker{r} (rank {r})" for r in range(rpc_world.size)}
        starts = {e["id"]: e for e in events if e.get("ph") == "s"}
        finishes = {e["id"]: e for e in events if e.get("ph") == "f"}
        assert starts.keys() == finishes.keys()
        for flow_id, start in starts.items():  # served after it was called, on one clock
            assert finishes[flow_id]["ts"] >= start["ts"]
        calls = [e for e in events if e.get("ph") == "X"
                 and e["name"].startswith("mpidag.rpc#tests.autograd_funcs.mul_sin")]
        assert len(calls) == 3 * rpc_world.size  # 3 per rank, each to its next rank
        by_start = {(s["pid"], s["tid"], s["ts"]): finishes[i] for i, s in starts.items()}
        for call in calls:  # linked to the serving range on the next rank
            finish = by_start[(call["pid"], call["tid"], call["ts"])]
            assert finish["pid"] == (call["pid"] + 1) % rpc_world.size
        # gradient messages of the backward passes are linked too
        assert len(starts) > len(calls)
        assert (job_dir / "job.json").stat().st_size > 0
    testing.quiesce()
    path.unlink()


def test_merge_refuses_a_trace_without_rank(tmp_path):
    plain = tmp_path / "plain.json"
    plain.write_text('{"traceEvents": []}')
    with pytest.raises(ValueError, match="export_rank_trace"):
        trace.merge_traces([plain])


def _range(name: str, pid: int, ts: float, dur: float) -> dict:
    return {"ph": "X", "name": name, "pid": pid, "tid": 1, "ts": ts, "dur": dur}


def test_a_serving_range_is_linked_within_the_clocks_error_bounds():
    call = _range("mpidag.rpc#f(worker0 -> worker1)", 0, 100.0, 50.0)
    early = _range("mpidag.rpc.serve#f(worker0 -> worker1)", 1, 95.0, 10.0)  # 5 us early
    assert trace._rpc_flows([call, early], {0: 0.0, 1: 0.0}) == []  # one clock: no link
    flows = trace._rpc_flows([call, early], {0: 0.0, 1: 10.0})  # rank 1's offset +-10 us
    assert [(f["ph"], f["pid"], f["ts"]) for f in flows] == [("s", 0, 100.0), ("f", 1, 95.0)]
    late = _range("mpidag.rpc.serve#f(worker0 -> worker1)", 1, 170.0, 10.0)  # 20 us late
    assert trace._rpc_flows([call, late], {0: 0.0, 1: 10.0}) == []
