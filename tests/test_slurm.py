"""The sbatch templates of slurm/, each run by a real Slurm started for this module.

The fixture starts a throwaway Slurm from Debian's slurmctld and slurmd (installed by
scripts/install_slurm.sh): configured under a temp dir, no munge (``auth/none``), no
systemd, no cgroups. It has two nodes, ``n1`` and ``n2``, both served by slurmd daemons on
this machine (``slurmd -N``), so that the multi-node template really spans two Slurm nodes;
each node declares this machine's cores and two placeholder GPUs (gres files that point at
``/dev/null``: Slurm schedules ``--gpus-per-task``, torch finds no GPU and gpu_check.py takes
its CPU path). Every test submits one template with ``sbatch --wait`` and checks the job's
exit status and its output file, which names the MPI world size the program saw.

Where Slurm cannot run (not root, no slurmctld) the tests skip, except under ``CI=true``,
where they fail.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLURM_DIR = REPO / "slurm"
NODES = ("n1", "n2")
JOB_TIMEOUT = 150  # seconds for one sbatch --wait, queueing included
PLUGIN_DIRS = (Path("/usr/lib/x86_64-linux-gnu/slurm-wlm"), Path("/usr/lib/slurm-wlm"),
               Path("/usr/lib64/slurm"), Path("/usr/lib/slurm"))


@dataclass
class Job:
    """A finished batch job: sbatch's exit status, its output file's text, sbatch's stderr."""

    returncode: int
    output: str
    stderr: str

    def describe(self) -> str:
        """Everything about the job, for an assertion message."""
        return (f"sbatch exit status {self.returncode}\n--- job output ---\n{self.output}"
                f"\n--- sbatch stderr ---\n{self.stderr}")


@dataclass
class SlurmCluster:
    """A running throwaway Slurm: its directory, environment and daemon processes."""

    root: Path
    env: dict[str, str]
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def submit(self, name: str, template: str, *args: str, options: tuple[str, ...] = (),
               env: dict[str, str] | None = None) -> Job:
        """``sbatch --wait`` ``slurm/<template>`` with ``options`` and program ``args``."""
        output = self.root / f"{name}.out"
        cmd = ["timeout", "--kill-after=10", str(JOB_TIMEOUT), "sbatch", "--wait",
               "--parsable", f"--job-name={name}", f"--output={output}", "--time=3",
               *options, str(SLURM_DIR / template), *args]
        try:
            done = subprocess.run(cmd, cwd=REPO, env={**self.env, **(env or {})},
                                  capture_output=True, text=True, timeout=JOB_TIMEOUT + 30,
                                  check=False)
        finally:
            self.cancel_all()
        text = output.read_text(errors="replace") if output.exists() else "(no output file)"
        return Job(done.returncode, text, done.stderr)

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster."""
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=False)

    def cancel_all(self) -> None:
        """Cancel whatever is still queued or running (after a timeout or a failure)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.run("scancel", "--quiet", "--user=root", timeout=15)

    def logs(self) -> str:
        """The tails of the daemons' logs, for failure messages."""
        parts = []
        for log in sorted((self.root / "log").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {log.name} ---\n" + "\n".join(lines))
        return "\n".join(parts)


def _search_path() -> str:
    """``$PATH`` plus the sbin directories where Debian puts the daemons."""
    return os.pathsep.join([os.environ.get("PATH", os.defpath), "/usr/sbin", "/sbin"])


def _unavailable_reason() -> str | None:
    """Why a Slurm cannot be started here, or None when it can."""
    if os.geteuid() != 0:
        return "the throwaway Slurm runs its daemons as root (SlurmUser=root); not root"
    for tool in ("slurmctld", "slurmd", "sbatch", "sinfo", "scancel", "srun"):
        if shutil.which(tool, path=_search_path()) is None:
            return f"no {tool} on PATH: run `bash scripts/install_slurm.sh` (as root)"
    if not any((d / "mpi_pmix.so").exists() for d in PLUGIN_DIRS):
        return "Slurm has no mpi/pmix plugin (Debian: slurm-wlm-basic-plugins + libpmix2)"
    return None


def _skip_or_fail(reason: str) -> None:
    """Skip with ``reason``, or fail under CI=true, where the Slurm tests must run."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"Slurm tests cannot run under CI=true: {reason}")
    pytest.skip(reason)


def _free_ports(count: int) -> list[int]:
    """``count`` TCP ports that are free on 127.0.0.1 right now."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _write_config(root: Path) -> Path:
    """Write slurm.conf and gres.conf for nodes n1 and n2 under ``root``; return slurm.conf."""
    host = socket.gethostname().split(".")[0]
    cpus = os.cpu_count() or 1
    ctld_port, *node_ports = _free_ports(1 + len(NODES))
    for sub in ("state", "log", "dev", *(f"spool-{n}" for n in NODES),
                *(f"tmp-{n}" for n in NODES)):
        (root / sub).mkdir(exist_ok=True)
    for i in range(2):  # placeholder GPU device files (Slurm wants character devices)
        (root / "dev" / f"gpu{i}").symlink_to("/dev/null")
    nodes = "\n".join(
        f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} "
        f"Gres=gpu:2 State=UNKNOWN" for n, port in zip(NODES, node_ports, strict=True))
    conf = f"""\
ClusterName=mpidagtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
KillWait=5
MinJobAge=4
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
TmpFS={root}/tmp-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
GresTypes=gpu
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=10 State=UP
"""
    # MinJobAge=4: sbatch --wait polls every 2 s while that is under MinJobAge / 2, else
    # with sleeps growing to 32 s (22.05's _job_wait), which made a 4 s job take 42 s.
    # TmpFS per node: Slurm's PMIx plugin makes its per-step client directory there, and
    # two slurmd daemons of one machine would otherwise collide in /tmp.
    (root / "slurm.conf").write_text(conf)
    (root / "gres.conf").write_text(f"Name=gpu File={root}/dev/gpu[0-1]\n")
    return root / "slurm.conf"


def _cluster_env(conf: Path) -> dict[str, str]:
    """The environment of Slurm commands and jobs: this cluster, this Python, root OK."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.update(SLURM_CONF=str(conf), PATH=_search_path(), MPIDAG_PYTHON=sys.executable,
               PYTHONUNBUFFERED="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("MPIDAG_SRUN_MPI", None)
    return env


def _process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (``kill -0`` succeeds on zombies)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _stop(daemons: list[subprocess.Popen[bytes]]) -> None:
    """Stop the daemons: SIGTERM, then SIGKILL what is still alive after 10 s."""
    for proc in daemons:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for proc in daemons:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            if _process_alive(proc.pid):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


def _wait_idle(cluster: SlurmCluster, timeout: float = 60) -> None:
    """Wait until every node is idle; fail with the daemons' logs otherwise."""
    deadline = time.monotonic() + timeout
    states = ""
    while time.monotonic() < deadline:
        for proc in cluster.daemons:
            if proc.poll() is not None:
                pytest.fail(f"a Slurm daemon exited ({proc.args}):\n{cluster.logs()}")
        try:
            states = cluster.run("sinfo", "--noheader", "--Node", "--format=%N %t",
                                 timeout=10).stdout
        except subprocess.TimeoutExpired:
            states = "(sinfo timed out)"
        if sorted(line.split()[1] for line in states.splitlines() if line.strip()) == \
                ["idle"] * len(NODES):
            return
        time.sleep(0.5)
    pytest.fail(f"Slurm nodes not idle after {timeout} s: {states!r}\n{cluster.logs()}")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A running two-node Slurm on this machine, stopped at the end of the module."""
    reason = _unavailable_reason()
    if reason:
        _skip_or_fail(reason)
    root = tmp_path_factory.mktemp("slurm")
    cluster = SlurmCluster(root, _cluster_env(_write_config(root)))
    try:
        with open(root / "log" / "daemons.out", "ab") as out:
            cluster.daemons.append(subprocess.Popen(
                ["slurmctld", "-D", "-i"], env=cluster.env, stdout=out, stderr=out))
            for node in NODES:
                cluster.daemons.append(subprocess.Popen(
                    ["slurmd", "-D", "-N", node], env=cluster.env, stdout=out, stderr=out))
        _wait_idle(cluster)
        yield cluster
    finally:
        cluster.cancel_all()
        _stop(cluster.daemons)
    alive = [p.pid for p in cluster.daemons if _process_alive(p.pid)]
    assert not alive, f"Slurm daemons still running after the stop: {alive}"


def ok_line(job: Job, program: str) -> str:
    """The job's ``OK <program>:`` line; fails the test with the whole job if missing."""
    lines = [ln for ln in job.output.splitlines() if ln.startswith(f"OK {program}:")]
    assert job.returncode == 0 and lines, job.describe()
    return lines[-1]


def test_single_node(slurm: SlurmCluster) -> None:
    """single_node.sbatch runs hello.py on 2 ranks of one node, with the detected plugin."""
    job = slurm.submit("single", "single_node.sbatch", options=("--ntasks=2",))
    line = ok_line(job, "hello")
    assert "world_size=2 nodes=1 " in line, job.describe()
    assert "MPI library: Open MPI" in job.output, job.describe()
    assert "srun --mpi=pmix" in job.output, job.describe()  # detected: Open MPI wheel
    assert "[world-check] MPI world of 2 rank(s): as many as the Slurm tasks" in job.output


def test_multi_node_one_rank_per_core(slurm: SlurmCluster) -> None:
    """multi_node.sbatch, layout A: 2 nodes x 1 rank per core (its #SBATCH defaults)."""
    cpus = os.cpu_count() or 1
    job = slurm.submit("multi-core", "multi_node.sbatch",
                       options=(f"--ntasks-per-node={cpus}",))
    line = ok_line(job, "hello")
    assert f"world_size={2 * cpus} nodes=2 ranks_per_node=n1:{cpus},n2:{cpus}" in line, \
        job.describe()


def test_multi_node_one_rank_per_node(slurm: SlurmCluster) -> None:
    """multi_node.sbatch, layout B: one rank per node with all of its cores."""
    cpus = os.cpu_count() or 1
    job = slurm.submit("multi-node", "multi_node.sbatch",
                       options=("--ntasks-per-node=1", f"--cpus-per-task={cpus}"))
    line = ok_line(job, "hello")
    assert "world_size=2 nodes=2 ranks_per_node=n1:1,n2:1" in line, job.describe()
    assert f"{cpus} cpu(s) per task" in job.output, job.describe()


def test_gpu(slurm: SlurmCluster) -> None:
    """gpu.sbatch: one rank per (placeholder) GPU; torch has none, so the CPU path runs."""
    job = slurm.submit("gpu", "gpu.sbatch",
                       options=("--ntasks-per-node=2", "--cpus-per-task=1"))
    line = ok_line(job, "gpu")
    assert "world_size=2 path=cpu" in line, job.describe()
    assert "GPUs on the batch node: 2" in job.output, job.describe()


def test_param_server(slurm: SlurmCluster) -> None:
    """param_server.sbatch: 1 server + 2 trainers over the two nodes."""
    job = slurm.submit("ps", "param_server.sbatch", "--steps", "2", "--batch", "8",
                       options=("--ntasks=3",))
    line = ok_line(job, "parameter_server")
    assert "world_size=3" in line, job.describe()
    assert "parameter server = rank 0, trainers = ranks 1..2" in job.output


def test_keep_freed_memory_reaches_every_rank(slurm: SlurmCluster) -> None:
    """MPIDAG_KEEP_FREED_MEMORY=1: the templates start the ranks with glibc keeping freed
    memory (glibc_check.py: a 5 MiB block from the heap, kept after its free, on both
    nodes' ranks), as ``python -m mpidag.run --keep-freed-memory`` does."""
    job = slurm.submit("glibc", "multi_node.sbatch",
                       str(SLURM_DIR / "programs" / "glibc_check.py"),
                       options=("--ntasks-per-node=1",), env={"MPIDAG_KEEP_FREED_MEMORY": "1"})
    assert job.returncode == 0, job.describe()
    assert "mpidag: glibc keeps freed memory: MALLOC_ARENA_MAX=1" in job.output, job.describe()
    for rank in (0, 1):
        assert f"rank {rank}: MALLOC_ARENA_MAX=1 mapped=0 kept=True" in job.output, (
            job.describe())
    assert "OK glibc: world_size=2 keeps_freed_memory=True" in job.output, job.describe()


def test_failing_program_fails_the_job(slurm: SlurmCluster, tmp_path: Path) -> None:
    """A user program that fails on one rank makes the job (and sbatch --wait) fail."""
    program = tmp_path / "fail_on_rank1.py"
    program.write_text(
        "import sys\nfrom mpi4py import MPI\nrank = MPI.COMM_WORLD.Get_rank()\n"
        "print(f'user program rank={rank}', flush=True)\nsys.exit(3 if rank == 1 else 0)\n")
    job = slurm.submit("fail", "single_node.sbatch", str(program), options=("--ntasks=2",))
    assert job.returncode != 0, job.describe()
    assert "user program rank=1" in job.output, job.describe()
    assert "mpidag: exit status 3" in job.output, job.describe()


def test_wrong_mpi_plugin_fails_the_job(slurm: SlurmCluster) -> None:
    """--mpi=pmi2 with the Open MPI wheel: 2 singletons, caught by the world check."""
    job = slurm.submit("pmi2", "single_node.sbatch", options=("--ntasks=2",),
                       env={"MPIDAG_SRUN_MPI": "pmi2"})
    assert job.returncode != 0, job.describe()
    assert "srun --mpi=pmi2" in job.output, job.describe()
    assert "wrong srun --mpi plugin" in job.output, job.describe()
    assert "OK hello" not in job.output, job.describe()


#: PyPI's MPICH wheel, installed at set-up by scripts/test.sh into the matrix's MPICH venv;
#: mpi4py >= 4 loads it through MPI4PY_LIBMPI
MPICH_VENV = Path(__file__).resolve().parent.parent / ".venv-mpich"


@pytest.fixture(scope="module")
def mpich_libmpi() -> Path:
    """The path of the MPICH venv's libmpi.so.12 (made by the test matrix's set-up)."""
    libmpi = MPICH_VENV / "lib" / "libmpi.so.12"
    if not libmpi.exists():
        _skip_or_fail(f"no {libmpi}: make the MPICH venv first with `MPIDAG_VENV=.venv-mpich "
                      f"MPIDAG_MPI=mpich bash scripts/setup.sh` (scripts/test.sh does)")
    return libmpi


def test_mpich_pmi2(slurm: SlurmCluster, mpich_libmpi: Path) -> None:
    """With MPICH the template picks --mpi=pmi2 by itself and gets a real 2-rank world."""
    job = slurm.submit("mpich", "single_node.sbatch", options=("--ntasks=2",),
                       env={"MPI4PY_LIBMPI": str(mpich_libmpi)})
    line = ok_line(job, "hello")
    assert "world_size=2 nodes=1 " in line, job.describe()
    assert "MPI library: MPICH" in job.output, job.describe()
    assert "srun --mpi=pmi2" in job.output, job.describe()
