"""benchmarks/compare_revisions.py: the table it prints from the runs' JSON files; and the
hand-written raw mpi4py columns that the benchmarks report: bench_optim.py's parameter
server (the floor) and bench_rpc.py's ``rpc_async`` row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import compare_revisions  # noqa: E402


def write_run(out: Path, stem: str, rows: dict) -> None:
    (out / f"{stem}.json").write_text(json.dumps({"rows": rows}))


def rpc_row(mpidag: float, torch: float, raw: float) -> dict:
    return {"rtt_noop_us": {"mpidag": mpidag, "torch_rpc": torch, "raw_mpi": raw,
                            "mpidag_vs_torch": mpidag / torch, "mpidag_vs_raw": mpidag / raw}}


def test_table_gives_medians_ranges_and_the_change_per_row(tmp_path):
    for side, values in (("old", (40.0, 30.0, 50.0)), ("new", (20.0, 22.0, 24.0))):
        for i, value in enumerate(values, 1):
            write_run(tmp_path, f"rpc_{side}_{i}", rpc_row(value, 200.0, 2.0))
    # autograd rows carry the interleaved engine overhead as samples; optim rows no raw
    write_run(tmp_path, "autograd_old_1", {"autograd_ops_1000_ms": {
        "mpidag": 14.0, "torch_rpc": 12.0, "samples": {"mpidag_vs_local_interleaved": [1.3, 1.5],
                                                       "mpidag_vs_split_interleaved": [1.25],
                                                       "mpidag_vs_torch_interleaved": [1.1]}}})
    write_run(tmp_path, "autograd_new_1", {"autograd_ops_1000_ms": {
        "mpidag": 12.0, "torch_rpc": 12.0, "samples": {"mpidag_vs_local_interleaved": [1.2],
                                                       "mpidag_vs_split_interleaved": [1.0],
                                                       "mpidag_vs_torch_interleaved": [0.99]}}})
    text = compare_revisions.table(tmp_path, ("old (a)", "new (b)"))
    lines = text.splitlines()
    assert lines[0] == "| row | figure | old (a) | new (b) | new/old |"
    assert "| `rtt_noop_us` | mpidag | 40.0 (30.0-50.0) | 22.0 (20.0-24.0) | 0.55 |" in lines
    assert "| `rtt_noop_us` | mpidag_vs_raw | 20.0 (15.0-25.0) | 11.0 (10.0-12.0) | 0.55 |" in lines
    # a ratio to torch is computed when the row has none, and the interleaved median is kept
    assert "| `autograd_ops_1000_ms` | mpidag_vs_torch | 1.17 (1.17-1.17) | 1.00 (1.00-1.00) " \
           "| 0.86 |" in lines
    assert "| `autograd_ops_1000_ms` | interleaved | 1.40 (1.40-1.40) | 1.20 (1.20-1.20) " \
           "| 0.86 |" in lines
    assert "| `autograd_ops_1000_ms` | vs_split_interleaved | 1.25 (1.25-1.25) | " \
           "1.00 (1.00-1.00) | 0.80 |" in lines
    assert "| `autograd_ops_1000_ms` | vs_torch_interleaved | 1.10 (1.10-1.10) | " \
           "0.99 (0.99-0.99) | 0.90 |" in lines


def test_interleaved_blocks_rotate_the_kinds_and_time_each_block():
    """bench_autograd's interleaving: every kind once per repetition, the order rotated, a
    ``split`` block called once (it runs its iterations itself), the others ``calls``
    times."""
    import bench_autograd

    order: list[str] = []
    blocks = {name: (lambda name=name: order.append(name)) for name in ("mpidag", "split",
                                                                        "local")}
    times = bench_autograd.interleaved_blocks(blocks, {"reps": 3, "calls": 2})
    assert order == ["mpidag", "mpidag", "split", "local", "local",
                     "split", "local", "local", "mpidag", "mpidag",
                     "local", "local", "mpidag", "mpidag", "split"]
    assert {name: len(v) for name, v in times.items()} == {"mpidag": 3, "split": 3, "local": 3}
    assert all(t >= 0 for v in times.values() for t in v)


def test_a_row_measured_on_one_side_only_is_left_out(tmp_path):
    write_run(tmp_path, "rpc_old_1", rpc_row(40.0, 200.0, 2.0))
    write_run(tmp_path, "rpc_new_1", {"seed_unused_ms": {"mpidag": 1.0}})
    assert compare_revisions.table(tmp_path, ("old", "new")).count("\n") == 1  # header only


@pytest.mark.parametrize("args, message", [
    (["a", "b", "--rounds", "0"], "--rounds must be at least 1"),
    (["a", "b", "--table-only"], "--table-only needs --out"),
])
def test_bad_arguments_are_named(args, message):
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "compare_revisions.py"), *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr


def test_a_new_comparison_removes_the_rounds_of_an_earlier_run(tmp_path):
    for name in ("rpc_old_5.json", "rpc_new_5.log", "autograd_old_1.json", "notes.txt",
                 "revisions.json"):
        (tmp_path / name).write_text("{}")
    assert compare_revisions.clear_earlier_run(tmp_path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "revisions.json"]


@pytest.mark.mpi(min_size=2)
def test_the_hand_written_parameter_server_trains_as_local_autograd():
    """bench_optim.py's raw mpi4py floor does the same work as the RPC stacks: after three
    steps of each trainer (each on its own model), the server's parameters equal those of
    the same steps run locally with autograd and ``SGD(lr=0.05, momentum=0.9)``."""
    import bench_optim
    import torch
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    trainers = comm.Split(1 if rank > 0 else MPI.UNDEFINED, rank)
    steps = 3
    try:
        if rank == 0:
            server = bench_optim.RawServer(comm)
            server.serve(trainers=comm.Get_size() - 1)
            for trainer in range(comm.Get_size() - 1):
                model = 1 + trainer
                ref = bench_optim.Shard(model)
                optimizer = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
                gen = torch.Generator().manual_seed(trainer)
                for _ in range(steps):
                    idx = torch.randint(0, bench_optim.ROWS_, (bench_optim.BATCH,),
                                        generator=gen)
                    target = torch.randint(0, bench_optim.CLASSES, (bench_optim.BATCH,),
                                           generator=gen)
                    loss = torch.nn.functional.cross_entropy(ref.fc(ref.emb(idx)), target)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                got = server.shard(model)
                initial = bench_optim.Shard(model)
                for (name, want), have, before in zip(ref.named_parameters(),
                                                      got.parameters(), initial.parameters(),
                                                      strict=True):
                    assert not torch.equal(want, before), name  # the steps changed it
                    torch.testing.assert_close(have, want, msg=name)
        else:
            me = trainers.Get_rank()
            bench_optim.raw_train(comm, 1 + me, steps - 1, 1, trainers)  # 1 warm-up + 2
            comm.Send(torch.zeros(1, dtype=torch.int64).numpy(), 0, bench_optim.STOP)
    finally:
        if trainers != MPI.COMM_NULL:
            trainers.Free()
        comm.Free()


@pytest.mark.mpi(min_size=2)
def test_the_hand_written_rpc_async_row_completes_one_future_per_call(monkeypatch):
    """bench_rpc.py's raw column of ``rpc_async``: every one of the ``n`` calls gets its own
    torch ``Future``, completed by the answer to its own request id (an id answered twice,
    or never sent, raises), and rank 1's server loop ends when told to."""
    import bench_rpc
    import torch
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Split(0 if MPI.COMM_WORLD.Get_rank() < 2 else MPI.UNDEFINED, 0)
    if comm == MPI.COMM_NULL:
        return  # ranks past the first two take no part
    made: list[torch.futures.Future] = []

    class Recorded(torch.futures.Future):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    raw = bench_rpc.RawMPI(comm, bench_rpc.Config())
    try:
        if comm.Get_rank() == 1:
            raw.serve()
            return
        monkeypatch.setattr(torch.futures, "Future", Recorded)
        for n in (1, 300):
            made.clear()
            elapsed = raw.async_noop_batch(n)
            assert elapsed is not None and elapsed > 0
            assert len(made) == n and all(f.done() and f.value() is None for f in made)
        raw.stop()
    finally:
        comm.Free()


def test_the_async_floor_carries_every_call_through_both_columns(tmp_path):
    """benchmarks/async_floor.py: both columns complete every call of every burst (each
    raises otherwise) and report each step's time, the caller's share their sum."""
    out = tmp_path / "floor.json"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "async_floor.py"), "--calls", "200",
                           "--bursts", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert set(result) == {"mpidag", "hand-written"}
    for steps in result.values():
        assert set(steps) == {"issue", "callee", "answers", "wait_all", "caller"}
        assert all(value > 0 for value in steps.values())
        assert steps["caller"] == pytest.approx(
            steps["issue"] + steps["answers"] + steps["wait_all"])
    assert "caller" in proc.stdout and "hand-written" in proc.stdout


def test_the_async_floor_names_bad_arguments():
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "async_floor.py"), "--calls", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--calls and --bursts must be at least 1, got 0" in \
        proc.stderr


def test_the_tensor_floor_echoes_through_all_three_columns(tmp_path):
    """benchmarks/tensor_floor.py on two ranks: the blocking echo, the hand-written pattern of
    mpidag's messages and rpc_sync each complete their round trips and report a time."""
    out = tmp_path / "tensor_floor.json"
    proc = subprocess.run([sys.executable, "-m", "mpidag.run", "-n", "2",
                           str(BENCHMARKS / "tensor_floor.py"), "--sizes", "262144",
                           "--calls", "20", "--rounds", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())["sizes"]["262144"]
    assert set(result["median_us"]) == {"raw", "pattern", "mpidag"}
    assert all(value > 0 for value in result["median_us"].values())
    assert result["mpidag_vs_pattern"] == pytest.approx(
        result["median_us"]["mpidag"] / result["median_us"]["pattern"])
    assert "pattern/raw" in proc.stdout


def test_the_tensor_floor_names_bad_arguments():
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "tensor_floor.py"),
                           "--sizes", "5"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "each size a multiple of 4 bytes" in proc.stderr


def test_the_interleaved_parameter_server_reports_ratios_of_neighbouring_runs(tmp_path, capsys):
    """bench_optim.py --interleaved: the ratio is the median of mpidag / torch run by run
    (not the ratio of the medians), and summarize.py judges the goal on it."""
    import bench_optim
    import summarize

    measured = {}
    for row in ("ps_shared_steps_per_s", "ps_disjoint_steps_per_s"):
        measured[f"{row}/mpidag"] = [300.0, 100.0, 200.0]
        measured[f"{row}/torch_rpc"] = [200.0, 100.0, 100.0]  # ratios 1.5, 1.0, 2.0
    out = tmp_path / "optim_interleaved_1.json"
    bench_optim.write_interleaved(measured, steps=150, warmup=10, reps=3, out=out)
    row = json.loads(out.read_text())["rows"]["ps_shared_steps_per_s"]
    assert row["mpidag_vs_torch_interleaved"] == 1.5
    assert row["samples"]["mpidag_vs_torch_interleaved"] == [1.5, 1.0, 2.0]
    assert (row["mpidag"], row["torch_rpc"]) == (200.0, 100.0)
    capsys.readouterr()
    summarize.main(["--optim-interleaved", str(out)])
    assert "| `ps_shared_steps_per_s` | 100 | 200 | 1.50x | interleaved >= 1.3x torch: met |" \
        in capsys.readouterr().out


def test_the_backward_profile_pairs_the_hand_written_hops_iteration_by_iteration():
    """profile_backward_path.py: the hand-written split's hops between the ranks come from
    both ranks' absolute stamps, paired iteration by iteration (not medians subtracted)."""
    import profile_backward_path as profile

    rank0 = {"@rank 0 forward end": [10, 1010], "@rank 0 result received": [90, 1200],
             "@rank 0 loss's backward end": [100, 1210], "@rank 0 backward start": [300, 1500],
             "rank 0: forward": [7, 7]}
    rank1 = {"@rank 1 forward start": [15, 1030], "@rank 1 forward end": [80, 1100],
             "@rank 1 backward start": [110, 1300], "@rank 1 backward end": [290, 1400]}
    hops = profile.split_hops([rank0, rank1])
    assert hops == {
        "raw mpi4py split: rank 0's forward end to rank 1's forward start": [5, 20],
        "raw mpi4py split: rank 1's forward end to its result received": [10, 100],
        "raw mpi4py split: loss's grad() end to rank 1's grad() start": [10, 90],
        "raw mpi4py split: rank 1's grad() end to rank 0's grad() start": [10, 100]}
    with pytest.raises(ValueError):  # a rank that stamped one iteration less
        profile.split_hops([rank0, {k: v[:1] for k, v in rank1.items()}])


def test_the_backward_profile_times_a_step_in_thread_cpu_and_wall_time():
    """profile_backward_path.py: a wrapped step records one entry of its label per call
    (thread CPU and wall ns, not judged here) and keeps its result and its errors."""
    import profile_backward_path as profile

    def compute(n: int) -> int:
        if n < 0:
            raise ValueError("negative")
        return sum(range(n))

    del profile.step_costs[:]
    stamped = profile.cpu_stamped(compute, "compute")
    assert stamped(100_000) == sum(range(100_000))
    with pytest.raises(ValueError, match="negative"):
        stamped(-1)
    (label, cpu, wall), (_, _, _) = profile.step_costs
    assert label == "compute" and isinstance(cpu, int) and isinstance(wall, int)
    del profile.step_costs[:]


def test_the_inproc_harness_runs_a_whole_distributed_backward_in_one_thread():
    """benchmarks/inproc_cost.py's backward row: the design document's example, forward,
    backward and release, driven by hand through both ranks' real agents and engine, gives
    local autograd's gradients every iteration and leaves no context behind on either
    rank; a wait that can never end raises instead of spinning."""
    import inproc_cost
    import torch

    ranks = inproc_cost.TwoRanks()
    try:
        t1, t2, t4 = leaves = inproc_cost.example_leaves()
        ranks.drive_waits()
        expected = torch.autograd.grad(((t1 + t2) * t4).sum(), leaves)
        for _ in range(3):
            grads = ranks.backward_example(t1, t2, t4)
            assert set(grads) == set(leaves)
            for leaf, want in zip(leaves, expected, strict=True):
                assert torch.equal(grads[leaf], want)
        for runtime in ranks.runtimes:
            assert not runtime.autograd.container.contexts
        with pytest.raises(RuntimeError, match="can never end: no message is queued"):
            ranks.agents[0].engine.wait_until(lambda: False, None)
    finally:
        ranks.close()
