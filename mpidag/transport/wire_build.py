"""Build mpidag's compiled modules for this virtual environment: ``_mpidag_wire``
(``wire.c``, the MPI frame-0 path), ``_mpidag_frames`` (``frames.c``, frame 0's codec) and
``_mpidag_fastpath`` (``mpidag/agent/fastpath.c``, the agent's path of a plain call), and
``_mpidag_torch`` (``torch_native.cpp``, C++ against this environment's torch: frame-0
tensors for the C codec and the per-message records of distributed autograd).

``_mpidag_wire`` calls MPI directly, so it must be compiled against the very MPI library that
mpi4py uses here (Open MPI's and MPICH's handles and status layouts differ): the wheel's or
the system's ``mpicc``, and it goes into this interpreter's ``site-packages``, one build per
virtual environment (an editable checkout shared by several environments keeps none).
``scripts/setup.sh`` runs it; by hand::

    python -m mpidag.transport.wire_build          # build, check, say where it went
    python -m mpidag.transport.wire_build --check  # only say whether it is there and loads
    python -m mpidag.transport.wire_build --into DIR  # into DIR (first on PYTHONPATH)

The compiler is ``$MPICC``, else the environment's own ``bin/mpicc`` (the Open MPI and
MPICH wheels ship one), else ``mpicc`` on ``PATH`` (a system MPI). After building, a fresh
interpreter loads the module and compares its ``MPI_Get_library_version`` with mpi4py's; a
build that does not match is removed. ``_mpidag_frames`` and ``_mpidag_fastpath`` need no
MPI: ``$CC``, else ``cc`` or ``gcc`` on ``PATH``, else the MPI wrapper. ``_mpidag_torch``
is C++ (``$CXX``, else ``c++`` or ``g++``) against the headers and libraries of the torch
this interpreter imports (a new torch needs a new build; an old build is not used). Exit
status 1 with the reason when a module cannot be built; mpidag then runs the Python code it
replaces (``mpidag.transport.wire``, ``mpidag.transport.frames``, the agent's Python call
path, ``torch.frombuffer`` in the codec, the Python records of
``mpidag.dist_autograd.context``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

MODULE = "_mpidag_wire"
SOURCE = Path(__file__).with_name("wire.c")
CODEC = "_mpidag_frames"
CODEC_SOURCE = Path(__file__).with_name("frames.c")
FASTPATH = "_mpidag_fastpath"
FASTPATH_SOURCE = Path(__file__).resolve().parent.parent / "agent" / "fastpath.c"
TORCH_NATIVE = "_mpidag_torch"
#: the translation units of ``_mpidag_torch`` (sharing ``torch_records.h``)
TORCH_NATIVE_SOURCES = [Path(__file__).with_name("torch_native.cpp"),
                        Path(__file__).with_name("torch_recorder.cpp"),
                        Path(__file__).with_name("torch_plan.cpp"),
                        Path(__file__).with_name("torch_pass.cpp")]

_CHECK = """
import sys
from mpi4py import MPI
import _mpidag_wire
ours = _mpidag_wire.library_version().splitlines()[0].strip()
theirs = MPI.Get_library_version().splitlines()[0].strip()
if ours != theirs:
    sys.exit(f"built against {ours!r} but mpi4py uses {theirs!r}")
import _mpidag_frames
import mpidag.transport.frames as frames
assert frames.compiled_codec() is not None, "frames.py did not take _mpidag_frames"
import mpidag.agent.fastpath as fastpath
assert fastpath.compiled_module() is not None, "fastpath.py did not take _mpidag_fastpath"
built = [_mpidag_wire.__file__, _mpidag_frames.__file__, fastpath.compiled_module().__file__]
if "--torch" in sys.argv:
    import mpidag.transport.torch_native as torch_native
    assert torch_native.torch_module() is not None, torch_native.problem()
    assert frames.compiled_codec().uses_torch_native(), "frames.c did not take frame_tensor"
    built.append(torch_native.torch_module().__file__)
print(*built)
"""


def target(module: str = MODULE, into: Path | None = None) -> Path:
    """Where a built module goes: ``into``, else this interpreter's ``site-packages``."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    return Path(into or sysconfig.get_paths()["platlib"]) / (module + suffix)


def _find(env: os._Environ | dict | None, variable: str, candidates: list[str]) -> str | None:
    """``$variable``, else the first candidate that exists (a path, or a name on ``PATH``)."""
    env = os.environ if env is None else env
    if env.get(variable):
        return env[variable]
    for candidate in candidates:
        found = candidate if os.path.isabs(candidate) and os.path.exists(candidate) \
            else shutil.which(candidate, path=env.get("PATH"))
        if found:
            return found
    return None


def find_mpicc(environ: os._Environ | dict | None = None) -> str | None:
    """The MPI compiler wrapper to build with (see the module's doc), or ``None``.

    Example::

        >>> find_mpicc({"MPICC": "/opt/mpi/bin/mpicc"})
        '/opt/mpi/bin/mpicc'
    """
    return _find(environ, "MPICC", [str(Path(sys.prefix) / "bin" / "mpicc"), "mpicc"])


def find_cc(environ: os._Environ | dict | None = None) -> str | None:
    """A C compiler for the MPI-free codec: ``$CC``, ``cc``, ``gcc``, else the MPI wrapper.

    Example::

        >>> find_cc({"CC": "/usr/bin/clang"})
        '/usr/bin/clang'
    """
    return _find(environ, "CC", ["cc", "gcc"]) or find_mpicc(environ)


def find_cxx(environ: os._Environ | dict | None = None) -> str | None:
    """A C++ compiler for the torch extension: ``$CXX``, else ``c++`` or ``g++``.

    Example::

        >>> find_cxx({"CXX": "/usr/bin/clang++"})
        '/usr/bin/clang++'
    """
    return _find(environ, "CXX", ["c++", "g++"])


def check(into: Path | None = None, with_torch: bool = True) -> tuple[bool, str]:
    """Whether the built modules load in a fresh interpreter (with ``into`` first on its
    path) and match mpi4py's MPI (and torch, ``with_torch``)."""
    env = dict(os.environ)
    if into is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(into), env.get("PYTHONPATH")]))
    command = [sys.executable, "-c", _CHECK] + (["--torch"] if with_torch else [])
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    text = (result.stdout + result.stderr).strip().splitlines()
    return result.returncode == 0, text[-1] if text else f"exit status {result.returncode}"


def compile_module(compiler: str, source: Path, out: Path) -> str | None:
    """Compile one module into ``out``; ``None``, or what went wrong."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    command = [compiler, "-O2", "-shared", "-fPIC", "-Wall", "-Werror",
               f"-I{sysconfig.get_paths()['include']}", str(source), "-o", str(partial)]
    failure = _run_compiler(command, 300)
    if failure is None:
        partial.replace(out)
    return failure


def _run_compiler(command: list[str], timeout: float) -> str | None:
    """Run one compiler command; ``None``, or what went wrong."""
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except OSError as exc:
        return f"{command[0]} could not run: {exc}"
    if result.returncode != 0:
        return f"{' '.join(command)} failed:\n{result.stdout}{result.stderr}"
    return None


def compile_torch_module(compiler: str, sources: list[Path], out: Path) -> str | None:
    """Compile a C++ module against the torch this interpreter imports (its headers,
    libraries and C++ ABI, as ``torch.utils.cpp_extension`` would) into ``out``; ``None``,
    or what went wrong."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        return f"torch does not import here ({exc})"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    libraries = cpp_extension.library_paths()
    flags = [f"-I{path}" for path in cpp_extension.include_paths()]
    flags += [f"-L{path}" for path in libraries] + [f"-Wl,-rpath,{path}" for path in libraries]
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    # -Wall without -Werror: torch's own headers warn under some compilers
    command = [compiler, "-O2", "-std=c++20", "-shared", "-fPIC", "-Wall",
               f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               f'-DMPIDAG_TORCH_VERSION="{torch.__version__}"',
               f"-I{sysconfig.get_paths()['include']}", *flags, *map(str, sources),
               "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python", "-o", str(partial)]
    failure = _run_compiler(command, 600)
    if failure is not None:
        return failure
    # the torch it was built against, read before the module is imported (a module built
    # for another torch may not even load safely): mpidag.transport.torch_native
    out.with_name(out.name + ".torch").write_text(torch.__version__ + "\n")
    partial.replace(out)
    return None


def build(into: Path | None = None) -> tuple[bool, str]:
    """Compile both modules into ``into`` (else ``site-packages``) and check them;
    ``(ok, what happened)``."""
    mpicc, cc, cxx = find_mpicc(), find_cc(), find_cxx()
    if mpicc is None or cc is None:
        return False, ("no MPI C compiler wrapper found (set MPICC, or put an MPI's mpicc on "
                       "PATH, e.g. 'module load openmpi' or Debian's libopenmpi-dev)")
    if cxx is None:
        return False, "no C++ compiler found (set CXX, or install g++)"
    for compiler, source, module in ((mpicc, SOURCE, MODULE), (cc, CODEC_SOURCE, CODEC),
                                     (cc, FASTPATH_SOURCE, FASTPATH)):
        failure = compile_module(compiler, source, target(module, into))
        if failure is not None:
            return False, failure
    # C++ against torch: where that fails, the C modules still serve
    torch_failure = compile_torch_module(cxx, TORCH_NATIVE_SOURCES, target(TORCH_NATIVE, into))
    if torch_failure is not None:
        target(TORCH_NATIVE, into).unlink(missing_ok=True)
        stamp = target(TORCH_NATIVE, into)
        stamp.with_name(stamp.name + ".torch").unlink(missing_ok=True)
    ok, said = check(into, with_torch=torch_failure is None)
    if not ok:
        for module in (MODULE, CODEC, FASTPATH, TORCH_NATIVE):
            target(module, into).unlink(missing_ok=True)
        return False, f"the built modules do not load or match mpi4py's MPI and torch: {said}"
    if torch_failure is not None:
        return False, (f"built the C modules, but not {TORCH_NATIVE} (its Python code runs "
                       f"instead): {torch_failure}")
    return True, (f"built {target(MODULE, into)} with {mpicc}, {target(CODEC, into)} and "
                  f"{target(FASTPATH, into)} with {cc}, {target(TORCH_NATIVE, into)} with {cxx}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="only check that the module is built and matches mpi4py's MPI")
    parser.add_argument("--into", type=Path, default=None,
                        help="build into this directory instead of site-packages (put it "
                             "first on PYTHONPATH; benchmarks/compare_revisions.py does)")
    args = parser.parse_args(argv)
    ok, said = check(args.into) if args.check else build(args.into)
    print(f"mpidag wire: {said}" if ok else f"mpidag wire: not built: {said}",
          file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
