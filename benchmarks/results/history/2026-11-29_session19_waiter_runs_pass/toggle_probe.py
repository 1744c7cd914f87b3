import statistics, sys, time
sys.path.insert(0, "/work/main/benchmarks")
import torch
from mpi4py import MPI
import bench_autograd as ba
import mpidag.autograd as dist_autograd
import mpidag.rpc as rpc
from mpidag import _runtime
import mpidag.transport.progress as pg

def set_mode(m):
    ag = _runtime.current().autograd
    pg._KEEP_LEAD = m == "keep"
    if m == "off":
        ag._runs_while_waiting = lambda work: False
    else:
        ag.__dict__.pop('_runs_while_waiting', None)

def main():
    torch.set_num_threads(1)
    rank = MPI.COMM_WORLD.Get_rank()
    rpc.init_rpc(f"worker{rank}")
    if rank == 0:
        for w, calls, blocks in [(x, int(y), int(z)) for x, y, z in (a.split(":") for a in sys.argv[1:])]:
            for _ in range(calls): ba.distributed_step(rpc, dist_autograd, w)
            modes = ("off", "vacate", "keep")
            t = {m: [] for m in modes}
            for b in range(blocks):
                order = modes[b % 3:] + modes[:b % 3]
                for m in order:
                    set_mode(m)
                    t0 = time.perf_counter()
                    for _ in range(calls): ba.distributed_step(rpc, dist_autograd, w)
                    t[m].append((time.perf_counter() - t0) / calls * 1e3)
            for m in ("vacate", "keep"):
                r = sorted(a / b for a, b in zip(t[m], t["off"]))
                print(f"{w}: {m}/off median {statistics.median(r):.3f} (q1 {r[len(r)//4]:.3f}, q3 {r[3*len(r)//4]:.3f}); "
                      f"{m} {statistics.median(t[m]):.3f} off {statistics.median(t['off']):.3f} ms", flush=True)
    rpc.shutdown()

main()
