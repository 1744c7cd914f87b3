"""Every ``MPIDAG_*`` environment variable, read in one place.

:meth:`Config.from_env` reads the variables of a running job once, when ``init_rpc``
starts (never at import time), checks each value and turns it into a typed field of one
frozen :class:`Config`, which the runtime hands down to the layers that need it. A bad value
raises :class:`ConfigError` naming the variable, the value and what is accepted. The
launcher's own variables (read by ``python -m mpidag.run`` before MPI exists) are parsed
here too, by :meth:`LaunchConfig.from_env`.

=========================  =====================  =========  ==================================
variable                   field                  default    meaning
=========================  =====================  =========  ==================================
``MPIDAG_LOG``             ``log_level``          none       debug/info/warning/error log lines
``MPIDAG_GC_FREEZE``       ``gc_freeze``          1          ``gc.freeze()`` at ``init_rpc``
``MPIDAG_ABORT_ON_ERROR``  ``abort_on_error``     1          uncaught exception aborts the job
``MPIDAG_BACKOFF_MAX``     ``backoff_max``        1e-3       longest idle sleep of a poller, s
``MPIDAG_POLL_SPIN_S``     ``poll_spin``          50e-3      idle time a poller yields, s
``MPIDAG_SENTINEL_S``      ``sentinel_interval``  5e-3       longest leader vacancy, s
``MPIDAG_CUDA_AWARE``      ``cuda_aware``         detect     1/0: force CUDA-aware MPI
``MPIDAG_RECV_CACHE_MB``   ``recv_cache_bytes``   1024       MiB of recycled receive buffers
``MPIDAG_OPTIM_LOCKS``     ``optim_locks``        parameter  ``parameter`` or ``global``
``MPIDAG_FT``              ``ft``                 0          1: fault-tolerant (ULFM) session
``MPIDAG_INSPECT_DIR``     ``inspect_dir``        tmp dir    state files for mpidag.inspect
``MPIDAG_COMPILED``        ``compiled``           1          0: the Python paths (frame 0, calls)
``MPIDAG_GLIBC_FASTBINS``  ``glibc_fastbins``     0          1: keep glibc's fastbins (see below)
=========================  =====================  =========  ==================================

``init_rpc`` turns glibc's fastbins off (``mallopt(M_MXFAST, 0)``) unless
``MPIDAG_GLIBC_FASTBINS=1``: with them, the first allocation of 1 KiB or more after a
backward pass freed its graph consolidates every small chunk freed since (55-60 µs
measured after 500 ops), on the critical path of the next message or plan. Without them
those chunks are merged as they are freed; the one-rank 1,000-op loop was no slower.

The launcher's variables (:class:`LaunchConfig`): ``MPIDAG_MPIRUN`` (the ``mpirun`` to
use), ``MPIDAG_SRUN_MPI`` (``srun --mpi=`` plugin), ``MPIDAG_OVERSUBSCRIBE`` (1/0: force or
forbid ``--oversubscribe``), ``MPIDAG_FT`` (``--ft``) and ``MPIDAG_KEEP_FREED_MEMORY``
(``--keep-freed-memory``: glibc's allocator settings that keep freed memory in the ranks,
:data:`mpidag.run.KEEP_FREED_MEMORY`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

__all__ = ["Config", "ConfigError", "LaunchConfig"]

T = TypeVar("T")

LOG_LEVELS = ("debug", "info", "warning", "error")
OPTIM_LOCK_MODES = ("parameter", "global")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class ConfigError(ValueError):
    """An ``MPIDAG_*`` variable has a value mpidag cannot use (a ``ValueError``).

    Example::

        >>> Config.from_env({"MPIDAG_BACKOFF_MAX": "fast"})
        Traceback (most recent call last):
        mpidag._config.ConfigError: MPIDAG_BACKOFF_MAX='fast' is not a number of seconds >= 0
        (e.g. 1e-3)
    """


def _flag(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={text!r} is not a switch; use 1 or 0 (also true/false, "
                      f"yes/no, on/off)")


def _number(what: str, example: str, scale: float = 1.0) -> Callable[[str, str], Any]:
    """A parser of a number >= 0 (``what``, e.g. "a number of seconds"), times ``scale``."""
    def parse(name: str, text: str) -> Any:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{name}={text!r} is not {what} >= 0 (e.g. {example})")
        return value if scale == 1.0 else int(value * scale)
    return parse


_seconds = _number("a number of seconds", "1e-3")


def _choice(choices: tuple[str, ...], what: str) -> Callable[[str, str], str]:
    def parse(name: str, text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ConfigError(f"{name}={text!r} is not {what}; use one of {list(choices)}")
        return value
    return parse


def _text(name: str, text: str) -> str:
    return text.strip()


#: field name -> (variable, parser); fields not set in the environment keep their default
_JOB_VARIABLES: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "log_level": ("MPIDAG_LOG", _choice(LOG_LEVELS, "a log level")),
    "gc_freeze": ("MPIDAG_GC_FREEZE", _flag),
    "abort_on_error": ("MPIDAG_ABORT_ON_ERROR", _flag),
    "backoff_max": ("MPIDAG_BACKOFF_MAX", _seconds),
    "poll_spin": ("MPIDAG_POLL_SPIN_S", _seconds),
    "sentinel_interval": ("MPIDAG_SENTINEL_S", _seconds),
    "cuda_aware": ("MPIDAG_CUDA_AWARE", _flag),
    "recv_cache_bytes": ("MPIDAG_RECV_CACHE_MB", _number("a size in MiB", "1024", 1 << 20)),
    "optim_locks": ("MPIDAG_OPTIM_LOCKS", _choice(OPTIM_LOCK_MODES, "a lock mode")),
    "ft": ("MPIDAG_FT", _flag),
    "inspect_dir": ("MPIDAG_INSPECT_DIR", _text),
    "compiled": ("MPIDAG_COMPILED", _flag),
    "glibc_fastbins": ("MPIDAG_GLIBC_FASTBINS", _flag),
}

_LAUNCH_VARIABLES: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "mpirun": ("MPIDAG_MPIRUN", _text),
    "srun_mpi": ("MPIDAG_SRUN_MPI", _text),
    "oversubscribe": ("MPIDAG_OVERSUBSCRIBE", _flag),
    "ft": ("MPIDAG_FT", _flag),
    "keep_freed_memory": ("MPIDAG_KEEP_FREED_MEMORY", _flag),
}


def _read(cls: type[T], table: dict[str, tuple[str, Callable[[str, str], Any]]],
          environ: Mapping[str, str] | None) -> T:
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for name, (variable, parse) in table.items():
        text = env.get(variable)
        if text is not None and text.strip():  # set but empty: as if unset
            values[name] = parse(variable, text)
    return cls(**values)


@dataclass(frozen=True, slots=True)
class Config:
    """The settings of one RPC session, read from ``MPIDAG_*`` variables at ``init_rpc``.

    Example::

        >>> Config.from_env({"MPIDAG_LOG": "info", "MPIDAG_GC_FREEZE": "0"})
        Config(log_level='info', gc_freeze=False, ...)
    """

    log_level: str | None = None
    gc_freeze: bool = True
    abort_on_error: bool = True
    backoff_max: float = 1e-3
    poll_spin: float = 50e-3
    sentinel_interval: float = 5e-3
    cuda_aware: bool | None = None  # None: ask the MPI library
    recv_cache_bytes: int = 1 << 30
    optim_locks: str = "parameter"
    ft: bool = False  # MPIDAG_FT: survive failed ranks (set by ``mpidag.run --ft``)
    #: MPIDAG_INSPECT_DIR: where ranks answer ``python -m mpidag.inspect`` (None: a
    #: per-user directory under the system's temporary directory; a shared file system
    #: for jobs over several nodes)
    inspect_dir: str | None = None
    #: MPIDAG_COMPILED: use the compiled frame-0 path and call path when they are built (0: the
    #: Python ones)
    compiled: bool = True
    #: MPIDAG_GLIBC_FASTBINS: keep glibc's fastbins (False: ``init_rpc`` turns them off)
    glibc_fastbins: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """Read and check every job variable (``environ`` defaults to ``os.environ``)."""
        return _read(cls, _JOB_VARIABLES, environ)

    @staticmethod
    def variables() -> dict[str, str]:
        """``{field: variable}`` of every job variable (for documentation and tests).

        Example::

            >>> Config.variables()["backoff_max"]
            'MPIDAG_BACKOFF_MAX'
        """
        return {name: variable for name, (variable, _) in _JOB_VARIABLES.items()}

    @property
    def inspect_base(self) -> str:
        """The directory of the job directories that ``python -m mpidag.inspect`` reads.

        Example::

            >>> Config(inspect_dir="/scratch/me/mpidag").inspect_base
            '/scratch/me/mpidag'
        """
        if self.inspect_dir:
            return self.inspect_dir
        import getpass
        import tempfile

        return os.path.join(tempfile.gettempdir(), f"mpidag-{getpass.getuser()}")


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """The launcher's settings (``python -m mpidag.run``), read when it starts.

    Example::

        >>> LaunchConfig.from_env({"MPIDAG_OVERSUBSCRIBE": "1"}).oversubscribe
        True
    """

    mpirun: str | None = None  # MPIDAG_MPIRUN: the mpirun to use
    srun_mpi: str | None = None  # MPIDAG_SRUN_MPI: srun's --mpi plugin
    oversubscribe: bool | None = None  # MPIDAG_OVERSUBSCRIBE: None decides from the cores
    ft: bool = False  # MPIDAG_FT: start the job with fault tolerance (as ``--ft``)
    #: MPIDAG_KEEP_FREED_MEMORY: start the ranks with glibc keeping freed memory (as
    #: ``--keep-freed-memory``)
    keep_freed_memory: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LaunchConfig:
        """Read and check the launcher's variables (``environ``: default ``os.environ``)."""
        return _read(cls, _LAUNCH_VARIABLES, environ)


assert {f.name for f in fields(Config)} == set(_JOB_VARIABLES)  # noqa: S101 - table in sync
