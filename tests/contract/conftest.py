"""Makes each contract test (a test with a ``world`` argument in this package) into one item
per transport: ``[inproc2]`` and ``[inproc3]`` (threads of this process, plain pytest) and
``[mpi]`` (marked ``mpi``: every rank of ``python -m mpidag.run -n N -m pytest --with-mpi``).

``@pytest.mark.world(min_size=3)`` drops the worlds smaller than 3 ranks; see
``harness.py`` and docs/testing.md.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.contract.harness import InProcGroup, World

IN_PROCESS_SIZES = (2, 3)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "world(min_size=2): a contract test needing at least min_size ranks")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "world" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("world")
    min_size = marker.kwargs.get("min_size", 2) if marker else 2
    params = [pytest.param(("inproc", n), id=f"inproc{n}")
              for n in IN_PROCESS_SIZES if n >= min_size]
    params.append(pytest.param(("mpi", min_size), id="mpi",
                               marks=pytest.mark.mpi(min_size=min_size)))
    # module scope: pytest runs a module's items grouped by transport, one world at a time
    metafunc.parametrize("transport", params, indirect=True, scope="module")


@pytest.fixture(scope="module")
def transport(request: pytest.FixtureRequest) -> Iterator[InProcGroup | None]:
    """The module's in-process world of the item's size (``None`` for ``[mpi]``); its
    teardown checks on every rank that nothing leaked, then shuts it down."""
    kind, size = request.param
    if kind == "mpi":
        yield None
        return
    group = InProcGroup(size)
    try:
        yield group
    finally:
        group.close()


@pytest.fixture
def world(request: pytest.FixtureRequest, transport: InProcGroup | None
          ) -> World | InProcGroup:
    """This rank's :class:`World` under MPI; in-process, the group whose ranks
    :func:`pytest_pyfunc_call` runs the test on (each gets its own ``World``)."""
    if transport is not None:
        return transport
    rpc_world = request.getfixturevalue("rpc_world")
    return World(rpc_world.rank, rpc_world.size, "mpi")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    group = pyfuncitem.funcargs.get("world")
    if not isinstance(group, InProcGroup):
        return None  # pytest calls it: the MPI rank is the world
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    group.run(pyfuncitem.obj, kwargs)
    return True
