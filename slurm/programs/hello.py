"""Check an mpidag job end to end: MPI world, where ranks run, RPC around the ring, RRefs.

Every rank prints ``rank=R world_size=N``; worker0 asks every worker where it runs (Slurm
node, local rank, cores) and sends a tensor around the ring; every worker reads an RRef
owned by the next one. worker0 prints ``OK hello: world_size=N nodes=K ...`` when all of it
checks out; otherwise the job exits with status 1.

Run:  srun --mpi=pmix -n 2 python slurm/programs/hello.py
  or  python -m mpidag.run -n 2 slurm/programs/hello.py
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch
from _common import all_ranks_ok, check_world, node_name, slurm_summary

import mpidag.rpc as rpc


def where() -> dict[str, str | int]:
    """Where this worker runs (called over RPC)."""
    return {
        "rank": rpc.get_worker_info().id,
        "node": node_name(),
        "pid": os.getpid(),
        "local_rank": os.environ.get("SLURM_LOCALID", "-"),
        "cpus": ",".join(map(str, sorted(os.sched_getaffinity(0)))),
    }


def add_my_rank(t: torch.Tensor) -> torch.Tensor:
    """Runs on each worker of the ring: add its rank."""
    return t + rpc.get_worker_info().id


def rref_from_next(rank: int, size: int) -> bool:
    """Every rank: create a tensor on the next worker, fetch it back through an RRef."""
    owner = f"worker{(rank + 1) % size}"
    rref = rpc.remote(owner, torch.full, args=((3,), float(rank)))
    return rref.owner_name() == owner and torch.equal(rref.to_here(), torch.full((3,), rank))


def survey(size: int) -> tuple[bool, str]:
    """worker0: where every worker runs and a tensor around the ring; (ok, layout)."""
    print(f"[hello] {slurm_summary()}", flush=True)
    infos = [fut.wait() for fut in
             [rpc.rpc_async(f"worker{r}", where, timeout=60) for r in range(size)]]
    for info in infos:
        print(f"[hello] worker{info['rank']}: node={info['node']} pid={info['pid']} "
              f"local_rank={info['local_rank']} cpus={info['cpus']}", flush=True)
    # Each worker adds its rank, so the sum is 0+1+...+(N-1).
    t = torch.zeros(4)
    for r in range(1, size):
        t = rpc.rpc_sync(f"worker{r}", add_my_rank, args=(t,), timeout=60)
    ring_ok = torch.equal(t, torch.full((4,), float(size * (size - 1) // 2)))
    ranks_ok = sorted(int(info["rank"]) for info in infos) == list(range(size))
    nodes = Counter(str(info["node"]) for info in infos)
    layout = f"nodes={len(nodes)} ranks_per_node=" + ",".join(
        f"{node}:{n}" for node, n in sorted(nodes.items()))
    if not (ring_ok and ranks_ok):
        print(f"[hello] ring_ok={ring_ok} ranks_ok={ranks_ok}", flush=True)
    return ring_ok and ranks_ok, layout


def main() -> int:
    rank, size = check_world("hello")
    rpc.init_rpc()  # rank and world size come from srun / mpirun
    ok, layout = survey(size) if rank == 0 else (True, "")
    ok = rref_from_next(rank, size) and ok
    all_ok = all_ranks_ok(ok)
    rpc.shutdown()
    if rank == 0:
        verdict = "OK" if all_ok else "FAILED"
        print(f"{verdict} hello: world_size={size} {layout}", flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
