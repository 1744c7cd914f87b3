"""mpidag's C++ against torch (``_mpidag_torch``, ``torch_native.cpp``): loads it, or says
why the Python code it replaces runs.

The module is built per virtual environment against that environment's torch by
``python -m mpidag.transport.wire_build`` (``scripts/setup.sh`` runs it). Four parts use it:

* the C codec (:mod:`mpidag.transport.frames`): the tensors of a message whose tensors lie
  inline in frame 0 are made in one C++ step (``at::from_blob`` over the frame's bytes)
  instead of ``torch.frombuffer``, ``.view`` and ``.requires_grad_`` from C;
* the records of distributed autograd (:mod:`mpidag.dist_autograd.native`);
* the compiled call path (:mod:`mpidag.agent.compiled`): ``rpc_async``'s futures made and
  completed in C++ (its ``futures_api`` capsule);
* the receive cache (:mod:`mpidag.transport.buffers`): received tensors made by its
  ``ReceivePool`` in one call, their memory recycled by their storage's deleter.

:func:`torch_module` gives it, or ``None``: not built, built from other sources, or built
against another torch (a ``pip install torch==...`` after set-up: the build leaves the
version it was built against in ``_mpidag_torch...so.torch`` beside it, read before the
module is imported); :func:`problem` says which.

Example::

    >>> torch_module() is None or torch_module().VERSION == TORCH_NATIVE_VERSION
    True
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from mpidag.transport.wire import import_built

__all__ = ["TORCH_NATIVE_VERSION", "problem", "torch_module"]

#: the ``VERSION`` of ``torch_native.cpp`` this code calls (an older build is not used)
TORCH_NATIVE_VERSION = 14


def _built_against() -> str | None:
    """The torch version the built module's stamp file names (``None``: no stamp)."""
    spec = importlib.util.find_spec("_mpidag_torch")
    if spec is None or spec.origin is None:
        return None
    try:
        return Path(spec.origin + ".torch").read_text().strip()
    except OSError:
        return None


def _load() -> tuple[Any, str]:
    stamp = _built_against()
    if stamp is not None and stamp != torch.__version__:  # not even imported: another ABI
        return None, (f"Python torch calls: _mpidag_torch was built against torch {stamp}, "
                      f"this environment has {torch.__version__}; rebuild it with "
                      f"'python -m mpidag.transport.wire_build'")
    module, why = import_built("_mpidag_torch", TORCH_NATIVE_VERSION, "Python torch calls")
    if module is None:
        return None, why
    if torch.__version__ != module.TORCH_VERSION:
        return None, (f"Python torch calls: {module.__file__} was built against torch "
                      f"{module.TORCH_VERSION}, this environment has {torch.__version__}; "
                      f"rebuild it with 'python -m mpidag.transport.wire_build'")
    return module, f"C++ against torch ({module.__file__})"


_module, _status = _load()


def torch_module() -> Any:
    """The C++ module, or ``None`` (see :func:`problem`).

    Example::

        >>> torch_module() is None or hasattr(torch_module(), "record_recv")
        True
    """
    return _module


def problem() -> str:
    """Which code runs and why: the module's file, or why it is not used.

    Example::

        >>> problem().split(" ")[0] in ("C++", "Python")
        True
    """
    return _status
