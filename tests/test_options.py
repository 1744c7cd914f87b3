"""Backend options, WorkerInfo and the launcher's command line (one test starts a small MPI
job: the launcher's allocator settings as the ranks' glibc sees them)."""

import ctypes
import types
from pathlib import Path

import pytest
import torch

from mpidag.rpc.options import MPIRpcBackendOptions, TensorPipeRpcBackendOptions, WorkerInfo
from mpidag.run import (
    KEEP_FREED_MEMORY,
    _split_program,
    build_command,
    mpi_library_version,
    srun_mpi_plugin,
)


def test_options_defaults_match_torch():
    opts = MPIRpcBackendOptions()
    assert opts.num_worker_threads == 16 and opts.rpc_timeout == 60.0
    assert TensorPipeRpcBackendOptions is MPIRpcBackendOptions


def test_device_maps_normalized_and_checked():
    opts = MPIRpcBackendOptions(device_maps={"worker1": {0: "cuda:1", "cuda:1": 0}})
    assert opts.device_maps["worker1"] == {torch.device("cuda", 0): torch.device("cuda", 1),
                                           torch.device("cuda", 1): torch.device("cuda", 0)}
    with pytest.raises(ValueError, match="same remote device"):
        opts.set_device_map("worker2", {0: 1, 1: 1})


def test_options_validation():
    with pytest.raises(ValueError, match="num_worker_threads"):
        MPIRpcBackendOptions(num_worker_threads=0)
    with pytest.raises(ValueError, match="rpc_timeout"):
        MPIRpcBackendOptions(rpc_timeout=-5)
    with pytest.raises(TypeError, match="rpc_backend_options must be"):
        MPIRpcBackendOptions.from_any(object())


def test_torch_options_object_is_accepted():
    theirs = types.SimpleNamespace(num_worker_threads=4, rpc_timeout=7.5,
                                   device_maps={"w1": {0: 1}}, devices=[0])
    ours = MPIRpcBackendOptions.from_any(theirs)
    assert ours.num_worker_threads == 4 and ours.rpc_timeout == 7.5
    assert ours.device_maps["w1"] == {torch.device("cuda", 0): torch.device("cuda", 1)}


def test_worker_info_is_hashable_and_reprs_like_torch():
    info = WorkerInfo("worker3", 3)
    assert {info: 1}[WorkerInfo("worker3", 3)] == 1
    assert repr(info) == "WorkerInfo(id=3, name=worker3)"


def test_launcher_splits_its_options_from_the_program():
    own, program = _split_program(["-n", "2", "-m", "pytest", "-x"])
    assert own == ["-n", "2"] and program == ["-m", "pytest", "-x"]
    assert _split_program(["-n2", "--dry-run", "s.py", "-n", "5"]) == (["-n2", "--dry-run"],
                                                                       ["s.py", "-n", "5"])
    assert _split_program(["-n", "2", "--", "--weird.py"]) == (["-n", "2"], ["--weird.py"])


def test_launcher_command(monkeypatch):
    monkeypatch.delenv("MPIDAG_OVERSUBSCRIBE", raising=False)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.delenv("MPIDAG_SRUN_MPI", raising=False)
    argv, _ = build_command(2, ["s.py"], use_srun=True)  # mpi4py uses the Open MPI wheel
    assert argv[:4] == ["srun", "--mpi=pmix", "-n", "2"] and argv[-1] == "s.py"
    with pytest.raises(ValueError, match="at least 1"):
        build_command(0, ["s.py"], use_srun=True)


def test_keep_freed_memory_is_passed_to_every_rank_and_a_users_own_value_wins(monkeypatch):
    for name in KEEP_FREED_MEMORY:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    argv, env = build_command(2, ["s.py"], use_srun=False)
    assert not set(KEEP_FREED_MEMORY) & set(env) and "-x" not in argv
    argv, env = build_command(2, ["s.py"], use_srun=False, keep_freed_memory=True)
    assert {k: env[k] for k in KEEP_FREED_MEMORY} == KEEP_FREED_MEMORY
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(32 * 2**20)
    named = [argv[i + 1] for i, arg in enumerate(argv) if arg == "-x"]  # Open MPI's mpirun
    assert named == list(KEEP_FREED_MEMORY) and argv.index("-x") < argv.index("-n")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")  # the user's: kept, and still passed on
    monkeypatch.setenv("MALLOC_TOP_PAD_", "")  # no setting for glibc: replaced
    argv, env = build_command(2, ["s.py"], use_srun=False, keep_freed_memory=True)
    assert "MALLOC_ARENA_MAX" not in env and env["MALLOC_TOP_PAD_"] == str(64 * 2**20)
    assert [argv[i + 1] for i, arg in enumerate(argv) if arg == "-x"] == list(KEEP_FREED_MEMORY)
    argv, env = build_command(2, ["s.py"], use_srun=True, keep_freed_memory=True)
    assert "-x" not in argv and "MALLOC_TOP_PAD_" in env  # srun passes the environment
    assert _split_program(["--keep-freed-memory", "-n", "2", "s.py"]) == (
        ["--keep-freed-memory", "-n", "2"], ["s.py"])


GLIBC_CHECK = Path(__file__).resolve().parents[1] / "slurm" / "programs" / "glibc_check.py"


@pytest.mark.parametrize("how", ["flag", "variable"])
def test_keep_freed_memory_reaches_glibc_on_every_rank(job, how, monkeypatch):
    """A 5 MiB block, which glibc's defaults map fresh and unmap at its free (the parameter
    server's page faults), comes from the heap and stays there once freed."""
    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("not glibc 2.33 or later")
    probe = GLIBC_CHECK.read_text()
    for name in KEEP_FREED_MEMORY:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("MPIDAG_KEEP_FREED_MEMORY", raising=False)
    if how == "flag":
        done = job(probe, launcher=("--keep-freed-memory",), timeout=60)
    else:
        done = job(probe, env={"MPIDAG_KEEP_FREED_MEMORY": "1"}, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    assert lines == [f"rank {r}: MALLOC_ARENA_MAX=1 mapped=0 kept=True" for r in (0, 1)], (
        done.stdout + done.stderr)
    assert "OK glibc: world_size=2 keeps_freed_memory=True" in done.stdout
    default = job(probe, timeout=60)
    assert default.returncode == 0, default.stderr
    assert "rank 0: MALLOC_ARENA_MAX=None mapped=1 kept=False" in default.stdout, default.stdout
    assert "OK glibc: world_size=2 keeps_freed_memory=False" in default.stdout


def test_srun_plugin_follows_the_mpi_library(monkeypatch):
    monkeypatch.delenv("MPIDAG_SRUN_MPI", raising=False)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    for version, plugin in [("Open MPI v5.0.11, package: Open MPI", "pmix"),
                            ("MPICH Version:      4.2.3", "pmi2"),
                            ("Intel(R) MPI Library 2021.13 for Linux* OS", "pmi2"),
                            ("MPI VERSION    : CRAY MPICH version 8.1.28", "pmi2"),
                            ("", "pmix")]:
        assert srun_mpi_plugin(version) == plugin, version
    assert "Open MPI" in mpi_library_version()  # the wheel this project installs
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "4")
    assert "--cpus-per-task=4" in build_command(2, ["s.py"], use_srun=True)[0]
    assert "--cpus-per-task=4" not in build_command(2, ["s.py"], use_srun=True,
                                                    extra=["-c", "2"])[0]
    monkeypatch.setenv("MPIDAG_SRUN_MPI", "pmi2")
    assert srun_mpi_plugin("Open MPI v5") == "pmi2"
    assert build_command(2, ["s.py"], use_srun=True)[0][1] == "--mpi=pmi2"


def test_cuda_awareness_detection_without_a_gpu(monkeypatch):
    from mpidag._config import Config
    from mpidag.transport.mpi import detect_cuda_aware

    monkeypatch.delenv("MPIDAG_CUDA_AWARE", raising=False)
    if not torch.cuda.is_available():
        assert detect_cuda_aware(Config.from_env().cuda_aware) is False  # host staging
    monkeypatch.setenv("MPIDAG_CUDA_AWARE", "off")
    assert detect_cuda_aware(Config.from_env().cuda_aware) is False


def test_config_reads_every_variable_and_names_bad_values():
    from mpidag._config import Config, ConfigError, LaunchConfig

    assert Config.from_env({}) == Config()
    config = Config.from_env({"MPIDAG_LOG": "INFO", "MPIDAG_GC_FREEZE": "off",
                              "MPIDAG_BACKOFF_MAX": "2e-3", "MPIDAG_RECV_CACHE_MB": "3",
                              "MPIDAG_CUDA_AWARE": "1", "MPIDAG_OPTIM_LOCKS": "global",
                              "MPIDAG_ABORT_ON_ERROR": "0", "MPIDAG_POLL_SPIN_S": "0",
                              "MPIDAG_SENTINEL_S": "2e-2", "MPIDAG_FT": "1",
                              "MPIDAG_COMPILED": "0", "MPIDAG_GLIBC_FASTBINS": "1"})
    assert (config.log_level, config.gc_freeze, config.backoff_max) == ("info", False, 2e-3)
    assert (config.recv_cache_bytes, config.cuda_aware, config.optim_locks) == (3 << 20, True,
                                                                               "global")
    assert (config.abort_on_error, config.poll_spin, config.sentinel_interval) == (False, 0.0,
                                                                                  2e-2)
    assert config.ft and not Config().ft
    assert not config.compiled and Config().compiled
    assert config.glibc_fastbins and not Config().glibc_fastbins
    assert set(Config.variables().values()) == {
        "MPIDAG_LOG", "MPIDAG_GC_FREEZE", "MPIDAG_ABORT_ON_ERROR", "MPIDAG_BACKOFF_MAX",
        "MPIDAG_POLL_SPIN_S", "MPIDAG_SENTINEL_S", "MPIDAG_CUDA_AWARE",
        "MPIDAG_RECV_CACHE_MB", "MPIDAG_OPTIM_LOCKS", "MPIDAG_FT",
        "MPIDAG_INSPECT_DIR", "MPIDAG_COMPILED", "MPIDAG_GLIBC_FASTBINS"}
    for variable, value, words in [("MPIDAG_BACKOFF_MAX", "fast", "number of seconds"),
                                   ("MPIDAG_SENTINEL_S", "-1", "number of seconds"),
                                   ("MPIDAG_GC_FREEZE", "maybe", "switch"),
                                   ("MPIDAG_OPTIM_LOCKS", "none", "['parameter', 'global']"),
                                   ("MPIDAG_RECV_CACHE_MB", "lots", "size in MiB")]:
        with pytest.raises(ConfigError, match=f"{variable}='{value}'") as info:
            Config.from_env({variable: value})
        assert words in str(info.value) and isinstance(info.value, ValueError)
    launch = LaunchConfig.from_env({"MPIDAG_OVERSUBSCRIBE": "0", "MPIDAG_MPIRUN": "/x/mpirun"})
    assert LaunchConfig.from_env({"MPIDAG_FT": "yes"}).ft
    assert (launch.oversubscribe, launch.mpirun, launch.srun_mpi) == (False, "/x/mpirun", None)
    assert LaunchConfig.from_env({"MPIDAG_MPIRUN": " "}).mpirun is None  # empty: unset


@pytest.mark.parametrize(("name", "words"), [
    ("abc*", "Worker name must match"), (" ", "Worker name must match"),
    ("", "must be non-empty"), ("a" * 500, "shorter than 128"),
])
def test_worker_names_follow_torchs_rules_with_torchs_words(name, words):
    from mpidag.rpc import WorkerInfo

    with pytest.raises(RuntimeError, match=words):
        WorkerInfo(name, 0)


def test_valid_worker_names_are_accepted():
    from mpidag.rpc import WorkerInfo

    for name in ("worker0", "trainer:1", "ps-a_b", "x" * 127):
        assert WorkerInfo(name, 3).name == name


def test_rpc_before_init_says_so_in_both_of_torchs_wordings():
    import re

    import mpidag.rpc as rpc

    with pytest.raises(RuntimeError) as info:
        rpc.rpc_sync("worker1", len, args=("ab",))
    assert re.match("^RPC has not been initialized", str(info.value))
    assert "Current RPC agent is not set! Did you initialize the RPC framework" in str(info.value)


def test_options_refuse_a_timedelta_timeout_with_torchs_words():
    from datetime import timedelta

    with pytest.raises(TypeError, match="incompatible constructor arguments"):
        MPIRpcBackendOptions(rpc_timeout=timedelta(seconds=3))


def test_glibc_fastbins_are_turned_off():
    """What ``init_rpc`` does unless ``MPIDAG_GLIBC_FASTBINS=1``: afterwards small freed
    chunks are merged at once instead of kept in fastbins (glibc's own count of bytes in
    them stays 0), so no later allocation consolidates a backward pass's worth of them."""
    import ctypes

    from mpidag.rpc import api

    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2") or not hasattr(libc, "mallopt"):
        pytest.skip("not glibc 2.33 or later")

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype = Mallinfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def fastbin_bytes_added_by_freeing_small_blocks() -> int:
        before = libc.mallinfo2().fsmblks  # (over every arena: other threads' chunks too)
        blocks = [libc.malloc(24) for _ in range(64)]  # (7 of a size fit glibc's tcache)
        for block in blocks:
            libc.free(block)
        return libc.mallinfo2().fsmblks - before

    assert api._without_fastbins() is True
    assert fastbin_bytes_added_by_freeing_small_blocks() <= 0  # with fastbins: ~1.9 KB
