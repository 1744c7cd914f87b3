"""The package's import structure, checked from its source so that it stays a stack of layers.

* No import cycle among mpidag's modules. Every import counts, at module level or inside a
  function (a function-level import only postpones the cycle to the first call), except those
  under ``if TYPE_CHECKING:``, which never run. Importing ``mpidag.x.y`` also runs
  ``mpidag/x/__init__.py``, so that is an edge too (unless the importer is inside ``mpidag/x/``).
* Each module sits in one layer of ``LAYERS`` and imports only from its own layer or lower ones,
  so that each layer can be understood, and tested, without the ones above it. A new module
  fails the test until it is placed in the table.
* No module reads another layer's private fields: an attribute named ``_x`` (not a dunder)
  that only other layers define (``self._x = ...``, ``def _x``, a class-level ``_x``) is
  read only there, through an object that is not ``self``/``cls`` (layers read each other
  through published snapshots and methods).
* ``MPIDAG_*`` environment variables are read only by ``mpidag/_config.py``, so that there is
  one list of the settings, with their defaults and parsing.
* Importing any module reads no ``MPIDAG_*`` variable (a setting read at import time ignores a
  later change of the environment, e.g. by a test) and does not load ``mpi4py.MPI`` (that
  initialises MPI, which only ``init_rpc`` may do).

The helpers take the directory holding the package, its name and a layer table, so the
``test_self_check_*`` tests run them on small fake packages to show that each check can fail.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "mpidag"
ENV_PREFIX = "MPIDAG_"
CONFIG_MODULE = "mpidag._config"  # the one module that may read MPIDAG_* variables


# --------------------------------------------------------------------------- modules, imports


@dataclass(frozen=True)
class Module:
    name: str  # dotted; a package is named by its directory (its __init__.py)
    path: Path
    is_package: bool

    @property
    def enclosing_packages(self) -> set[str]:
        """The packages already being imported while this module runs: its parents (and
        itself, for a package's ``__init__``)."""
        parts = self.name.split(".")
        own = parts if self.is_package else parts[:-1]
        return {".".join(own[:i]) for i in range(1, len(own) + 1)}


@dataclass(frozen=True)
class Import:
    """One edge of the import graph: running ``source`` imports ``target``."""

    source: str
    target: str
    path: Path  # the file of ``source``
    line: int
    named: str  # the module the statement names; if not ``target``, ``target`` is its parent
    missing: bool = False  # ``named`` is not a module of the package

    @property
    def implied(self) -> bool:
        return self.named != self.target

    @property
    def reason(self) -> str:
        if self.missing:
            return f" (for {self.named}, which does not exist)"
        return f" (importing {self.named} runs its package's __init__)" if self.implied else ""

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root).as_posix()}:{self.line}"

    def describe(self, root: Path) -> str:
        return f"{self.where(root)}: {self.source} imports {self.target}{self.reason}"


def find_modules(root: Path, package: str) -> dict[str, Module]:
    """Every importable module of ``root/package``, by dotted name."""
    modules: dict[str, Module] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        if all(part.isidentifier() for part in parts):
            modules[".".join(parts)] = Module(".".join(parts), path, is_package)
    return modules


def is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING`` (also ``typing_extensions.``)."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
            and isinstance(test.value, ast.Name)
            and test.value.id in {"typing", "typing_extensions"})


def runtime_import_statements(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: anywhere, except in ``if TYPE_CHECKING:`` bodies
    (their ``else:`` branches do run)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def named_modules(node: ast.Import | ast.ImportFrom, module: Module,
                  modules: dict[str, Module]) -> list[str]:
    """The modules of ``module``'s package that ``node``, in ``module``, imports: for
    ``from a.b import c``, ``a.b.c`` if that is a module, else ``a.b``. A name may be of a
    module that does not exist (e.g. one moved away)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:  # relative: from the module's package, ``level - 1`` levels up
            parts = module.name.split(".")
            package = parts if module.is_package else parts[:-1]
            package = package[:len(package) - (node.level - 1)]
            base = ".".join([*package, *([node.module] if node.module else [])])
        else:
            base = node.module or ""
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                 for alias in node.names]
    package = module.name.split(".")[0]
    return [name for name in dict.fromkeys(names)
            if name == package or name.startswith(package + ".")]


def import_graph(root: Path, package: str) -> tuple[dict[str, Module], list[Import]]:
    """The package's modules and the imports between them, sorted by file and line; an import
    of ``a.b.c`` gives an edge to ``a.b.c`` and one to each parent package's ``__init__`` that
    is not already being imported (see ``Module.enclosing_packages``). A missing ``a.b.c``
    gives only the edges to its parent packages."""
    modules = find_modules(root, package)
    imports: list[Import] = []
    for module in modules.values():
        tree = ast.parse(module.path.read_text(encoding="utf-8"), str(module.path))
        for node in runtime_import_statements(tree):
            for named in named_modules(node, module, modules):
                parts = named.split(".")
                parents = [".".join(parts[:end]) for end in range(len(parts) - 1, 0, -1)]
                targets = [named] * (named in modules) + [
                    parent for parent in parents
                    if parent in modules and parent not in module.enclosing_packages]
                imports += [Import(module.name, target, module.path, node.lineno, named,
                                   missing=named not in modules)
                            for target in targets if target != module.name]
    imports.sort(key=lambda imp: (imp.source, imp.line, imp.implied, imp.target))
    return modules, imports


# --------------------------------------------------------------------------- cycles


def strongly_connected(nodes: list[str], edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's strongly connected components of the graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in edges.get(node, {}):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(sorted(component))

    for node in nodes:
        if node not in index:
            visit(node)
    return components


def shortest_cycle(start: str, members: set[str],
                   edges: dict[str, dict[str, Import]]) -> list[Import] | None:
    """The edges of a shortest cycle through ``start`` within ``members`` (breadth first)."""
    came_by: dict[str, Import] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if start in edges.get(node, {}):
            cycle = [edges[node][start]]
            while cycle[0].source != start:
                cycle.insert(0, came_by[cycle[0].source])
            return cycle
        for succ, imp in sorted(edges.get(node, {}).items()):
            if succ in members and succ != start and succ not in came_by:
                came_by[succ] = imp
                queue.append(succ)
    return None


def find_cycles(modules: dict[str, Module], imports: list[Import]) -> list[list[Import]]:
    """For each group of modules that import each other, a shortest cycle through each of its
    modules (each distinct cycle once), as the imports that make it."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in imports:  # the first import of each pair, a direct one before an implied one
        edges.setdefault(imp.source, {}).setdefault(imp.target, imp)
    cycles: list[list[Import]] = []
    seen: set[frozenset[tuple[str, str]]] = set()
    for component in strongly_connected(sorted(modules), edges):
        for start in component if len(component) > 1 else []:
            cycle = shortest_cycle(start, set(component), edges)
            key = frozenset((imp.source, imp.target) for imp in cycle or [])
            if cycle and key not in seen:
                seen.add(key)
                cycles.append(cycle)
    return cycles


def format_cycle(cycle: list[Import], root: Path) -> str:
    chain = " -> ".join([imp.source for imp in cycle] + [cycle[0].source])
    return "\n".join([chain, *(f"    {imp.describe(root)}" for imp in cycle)])


# --------------------------------------------------------------------------- layers


@dataclass(frozen=True)
class Layer:
    name: str
    modules: tuple[str, ...] = ()  # these modules
    packages: tuple[str, ...] = ()  # these packages and every module under them
    may_import: tuple[str, ...] = ()  # the other layers (by name) its modules may import
    rank: int | None = None  # position in the stack; None for a standalone layer

    def covers(self, module: str) -> bool:
        return module in self.modules or any(
            module == package or module.startswith(package + ".") for package in self.packages)

    def allows(self, other: Layer) -> bool:
        return other.name == self.name or other.name in self.may_import

    def __str__(self) -> str:
        return f'layer {self.rank} "{self.name}"' if self.rank is not None else f'"{self.name}"'


def stacked(*layers: Layer) -> tuple[Layer, ...]:
    """Number ``layers``, lowest first; each may import the ones below it."""
    return tuple(replace(layer, rank=rank, may_import=tuple(low.name for low in layers[:rank]))
                 for rank, layer in enumerate(layers))


LAYERS: tuple[Layer, ...] = (
    *stacked(
        Layer("foundation", modules=("mpidag", "mpidag.errors", "mpidag._ids", "mpidag._config",
                                     "mpidag._profiling", "mpidag._remote_profiling",
                                     "mpidag._backoff", "mpidag._locks")),
        Layer("transport", packages=("mpidag.transport",)),
        Layer("agent", packages=("mpidag.agent",)),
        Layer("autograd protocol", packages=("mpidag.dist_autograd",)),
        Layer("rref protocol", packages=("mpidag.rref",)),
        Layer("runtime", modules=("mpidag._runtime", "mpidag._debug")),
        Layer("facades", packages=("mpidag.rpc", "mpidag.autograd", "mpidag.optim", "mpidag.nn",
                                   "mpidag.distributed")),
        Layer("tools", modules=("mpidag.testing", "mpidag.pytest_plugin", "mpidag.trace")),
    ),
    Layer("launcher", modules=("mpidag.run", "mpidag.__main__", "mpidag.inspect"),
          may_import=("foundation",)),
)


def layers_of(module: str, layers: tuple[Layer, ...]) -> list[Layer]:
    return [layer for layer in layers if layer.covers(module)]


def placement_problems(modules: dict[str, Module], layers: tuple[Layer, ...],
                       root: Path) -> list[str]:
    """Modules in no layer, or in more than one."""
    problems = []
    for name, module in sorted(modules.items()):
        found = layers_of(name, layers)
        where = module.path.relative_to(root).as_posix()
        if not found:
            problems.append(f"{name} ({where}) is in no layer: add it to LAYERS in "
                            f"tests/test_layers.py, in the lowest layer it fits")
        elif len(found) > 1:
            problems.append(f"{name} ({where}) is in several layers: "
                            f"{', '.join(map(str, found))}; fix LAYERS in tests/test_layers.py")
    return problems


def layer_violations(imports: list[Import], layers: tuple[Layer, ...], root: Path) -> list[str]:
    """Imports of a module in a layer that the importer's layer may not import. The package
    ``__init__`` an import runs is checked only if the module it names is allowed (one report
    per statement); modules in no layer or several are left to ``placement_problems``."""
    violations: list[str] = []
    reported: set[tuple[str, int, str]] = set()
    for imp in imports:  # direct edges come before the implied ones of the same statement
        source, target = layers_of(imp.source, layers), layers_of(imp.target, layers)
        if len(source) != 1 or len(target) != 1 or source[0].allows(target[0]):
            continue
        statement = (imp.source, imp.line, imp.named)
        if statement not in reported:
            reported.add(statement)
            violations.append(f"{imp.where(root)}: {imp.source} ({source[0]}) imports "
                              f"{imp.target} ({target[0]}){imp.reason}")
    return violations


# --------------------------------------------------------------------------- environment


def _leading_text(node: ast.expr, constants: dict[str, str]) -> str | None:
    """What a string expression is known to start with: a literal, an f-string's literal
    head, or a module-level string constant."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        head = ""
        for part in node.values:
            if not (isinstance(part, ast.Constant) and isinstance(part.value, str)):
                break
            head += part.value
        return head
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def _is_environ(node: ast.expr) -> bool:
    """``os.environ`` or ``environ`` (``from os import environ``)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def _read_keys(node: ast.AST) -> list[ast.expr]:
    """The variable names read by ``node`` if it is a read of the environment."""
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in {"get", "setdefault"} \
                and _is_environ(func.value):
            return [node.args[0]]
        if (isinstance(func, ast.Attribute) and func.attr == "getenv") or (
                isinstance(func, ast.Name) and func.id == "getenv"):
            return [node.args[0]]
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
            and _is_environ(node.value):
        return [node.slice]
    if isinstance(node, ast.Compare):
        lefts = [node.left, *node.comparators[:-1]]
        return [left for left, op, right in zip(lefts, node.ops, node.comparators, strict=True)
                if isinstance(op, ast.In | ast.NotIn) and _is_environ(right)]
    return []


def env_reads(root: Path, package: str, prefix: str) -> list[tuple[str, str, str]]:
    """``(module, "file:line", variable)`` for each read of a ``prefix*`` variable."""
    reads: list[tuple[Path, int, str, str]] = []
    for name, module in find_modules(root, package).items():
        tree = ast.parse(module.path.read_text(encoding="utf-8"), str(module.path))
        constants = {target.id: stmt.value.value for stmt in tree.body
                     if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant)
                     and isinstance(stmt.value.value, str)
                     for target in stmt.targets if isinstance(target, ast.Name)}
        for node in ast.walk(tree):
            for key in _read_keys(node):
                text = _leading_text(key, constants)
                if text is not None and text.startswith(prefix):
                    reads.append((module.path, key.lineno, name, text))
    return [(name, f"{path.relative_to(root).as_posix()}:{line}", variable)
            for path, line, name, variable in sorted(reads)]


# The probe run by ``import_time_probe`` in a fresh interpreter. argv: the result file, the
# directory holding the package, the package, the variable prefix, then the modules to import.
PROBE = textwrap.dedent('''
    import collections.abc, importlib, json, os, sys, traceback

    out, root, package, prefix, names = *sys.argv[1:5], sys.argv[5:]
    sys.path.insert(0, root)  # before the site-packages' finders (an editable install's)
    package_dir = os.path.join(root, package) + os.sep
    importing = None

    class RecordingEnviron(collections.abc.MutableMapping):
        """os.environ, recording each look-up of a variable named ``prefix*``."""

        def __init__(self, inner):
            self._inner = inner
            self.reads = []

        def _record(self, key):
            if isinstance(key, str) and key.startswith(prefix):
                frames = [f"{os.path.relpath(f.filename, root)}:{f.lineno}"
                          for f in traceback.extract_stack() if f.filename.startswith(package_dir)]
                self.reads.append({"variable": key, "importing": importing,
                                   "at": frames[-1] if frames else "?"})

        def __getitem__(self, key):
            self._record(key)
            return self._inner[key]

        def get(self, key, default=None):
            self._record(key)
            return self._inner.get(key, default)

        def __contains__(self, key):
            self._record(key)
            return key in self._inner

        def __setitem__(self, key, value):
            self._inner[key] = value

        def __delitem__(self, key):
            del self._inner[key]

        def __iter__(self):
            return iter(self._inner)

        def __len__(self):
            return len(self._inner)

        def copy(self):
            return self._inner.copy()

        def __getattr__(self, name):  # the rest of os._Environ (encodekey, ...)
            return getattr(self._inner, name)

    os.environ = recording = RecordingEnviron(os.environ)
    os.getenv = lambda key, default=None: os.environ.get(key, default)

    errors = {}
    for importing in names:
        try:
            importlib.import_module(importing)
        except BaseException:
            errors[importing] = traceback.format_exc()
    with open(out, "w") as f:
        json.dump({"reads": recording.reads, "errors": errors,
                   "mpi4py.MPI loaded": "mpi4py.MPI" in sys.modules}, f)
''')


def import_time_probe(root: Path, package: str, prefix: str, out: Path) -> dict:
    """Import every module of the package (but ``__main__``) in a fresh interpreter whose
    ``os.environ`` records look-ups; the ``prefix*`` variables read, the modules that failed to
    import, and whether ``mpi4py.MPI`` got loaded. The ``prefix*`` variables of this process
    are not passed on, so that copying the whole environment does not count as a read."""
    names = [name for name in find_modules(root, package) if name.split(".")[-1] != "__main__"]
    env = {key: value for key, value in os.environ.items() if not key.startswith(prefix)}
    command = [sys.executable, "-c", PROBE, str(out), str(root), package, prefix, *names]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert done.returncode == 0 and out.exists(), f"the probe failed:\n{done.stderr}"
    return json.loads(out.read_text())


def probe_problems(result: dict) -> list[str]:
    problems = []
    shown: set[str] = set()
    for name, text in result["errors"].items():
        error = text.strip().splitlines()[-1]
        problems.append(f"importing {name} fails: {error}" if error in shown
                        else f"importing {name} fails:\n{text}")
        shown.add(error)
    problems += [f"{read['at']}: {read['variable']} is read while importing {read['importing']}"
                 for read in result["reads"]]
    if result["mpi4py.MPI loaded"]:
        problems.append("mpi4py.MPI is imported (which initialises MPI) by importing the package")
    return problems


# --------------------------------------------------------------------------- the package


# ------------------------------------------------------------------- private fields


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_definitions(modules: dict[str, Module]) -> dict[str, set[str]]:
    """``{module: private attribute names its classes define}``: ``self._x = ...`` (also
    annotated or augmented), methods ``def _x``, class-level ``_x = ...``, ``__slots__``."""
    defined: dict[str, set[str]] = {}
    for name, module in modules.items():
        names: set[str] = set()
        for node in ast.walk(ast.parse(module.path.read_text(), str(module.path))):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        names.add(item.name)
                    elif isinstance(item, ast.Assign | ast.AnnAssign):
                        targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                        names.update(t.id for t in targets if isinstance(t, ast.Name))
                        slots = [t for t in targets
                                 if isinstance(t, ast.Name) and t.id == "__slots__"]
                        if slots and isinstance(item.value, ast.Tuple | ast.List):
                            names.update(e.value for e in item.value.elts
                                         if isinstance(e, ast.Constant)
                                         and isinstance(e.value, str))
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                targets = [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) \
                            and sub.value.id in {"self", "cls"}:
                        names.add(sub.attr)
        defined[name] = {n for n in names if _is_private(n)}
    return defined


def private_reads(root: Path, package: str, layers: tuple[Layer, ...]) -> list[str]:
    """Reads of ``obj._x`` (``obj`` not ``self``/``cls``) where ``_x`` is a private field
    that only modules of other layers define."""
    modules = find_modules(root, package)
    defined = private_definitions(modules)
    by_layer: dict[str, set[str]] = {}
    for name, names in defined.items():
        found = layers_of(name, layers)
        if len(found) == 1:
            by_layer.setdefault(found[0].name, set()).update(names)
    problems = []
    for name, module in sorted(modules.items()):
        found = layers_of(name, layers)
        if len(found) != 1:
            continue
        own = by_layer.get(found[0].name, set())
        others = {layer: names for layer, names in by_layer.items() if layer != found[0].name}
        for node in ast.walk(ast.parse(module.path.read_text(), str(module.path))):
            if not isinstance(node, ast.Attribute) or not _is_private(node.attr) \
                    or node.attr in own:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"}:
                continue
            owners = sorted(layer for layer, names in others.items() if node.attr in names)
            if owners:
                where = module.path.relative_to(root).as_posix()
                problems.append(f"{where}:{node.lineno}: {name} ({found[0]}) reads "
                                f"{ast.unparse(node)}, a private field of {', '.join(owners)}")
    return problems


def fail_if(problems: list[str], heading: str) -> None:
    if problems:
        pytest.fail("\n".join([heading, *problems]), pytrace=False)


def test_no_import_cycles():
    cycles = find_cycles(*import_graph(ROOT, PACKAGE))
    fail_if([format_cycle(cycle, ROOT) for cycle in cycles],
            f"{len(cycles)} import cycles; break each (TYPE_CHECKING imports do not count):")


def test_every_module_is_in_one_layer():
    fail_if(placement_problems(find_modules(ROOT, PACKAGE), LAYERS, ROOT),
            "modules not placed in exactly one layer:")


def test_layers_import_only_downwards():
    _, imports = import_graph(ROOT, PACKAGE)
    fail_if(layer_violations(imports, LAYERS, ROOT),
            "imports of a higher layer (a module may import only its own layer and lower ones):")


def test_no_module_reads_another_layers_private_fields():
    fail_if(private_reads(ROOT, PACKAGE, LAYERS),
            "reads of another layer's private fields (publish a method or a snapshot):")


def test_self_check_finds_a_private_read_across_layers(tmp_path):
    root = write_tree(tmp_path, {
        "fakepkg/__init__.py": "",
        "fakepkg/low.py": "class Engine:\n    def __init__(self):\n        self._queue = []\n",
        "fakepkg/high.py": "def peek(engine):\n    return len(engine._queue)\n",
        "fakepkg/same.py": "class Other:\n    def __init__(self):\n        self._own = 1\n"
                           "def peek(o):\n    return o._own\n",  # its own layer's: fine
    })
    layers = stacked(Layer("low", modules=("fakepkg", "fakepkg.low")),
                     Layer("high", modules=("fakepkg.high", "fakepkg.same")))
    problems = private_reads(root, "fakepkg", layers)
    assert len(problems) == 1 and "fakepkg/high.py:2" in problems[0], problems


def test_environment_is_read_only_by_config():
    reads = [read for read in env_reads(ROOT, PACKAGE, ENV_PREFIX) if read[0] != CONFIG_MODULE]
    fail_if([f"{where}: {variable}" for _, where, variable in reads],
            f"{ENV_PREFIX}* variables read outside {CONFIG_MODULE} (read them there):")


def test_importing_reads_no_setting_and_does_not_start_mpi(tmp_path):
    fail_if(probe_problems(import_time_probe(ROOT, PACKAGE, ENV_PREFIX, tmp_path / "probe")),
            "importing the package's modules (in a fresh interpreter):")


# --------------------------------------------------------------------------- the checks


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def edges(root: Path, package: str = "fakepkg") -> set[tuple[str, str]]:
    return {(imp.source, imp.target) for imp in import_graph(root, package)[1]}


def test_self_check_finds_a_cycle_through_a_function_level_import(tmp_path):
    write_tree(tmp_path, {
        "fakepkg/__init__.py": "",
        "fakepkg/a.py": "from fakepkg import b\n",
        "fakepkg/b.py": "def f():\n    from .c import thing\n",
        "fakepkg/c.py": "import os\nimport fakepkg.a as a\n",
        "fakepkg/d.py": "from fakepkg.a import name\n",  # into the cycle, not part of it
    })
    modules, imports = import_graph(tmp_path, "fakepkg")
    cycles = find_cycles(modules, imports)
    assert [format_cycle(cycle, tmp_path) for cycle in cycles] == [
        "fakepkg.a -> fakepkg.b -> fakepkg.c -> fakepkg.a\n"
        "    fakepkg/a.py:1: fakepkg.a imports fakepkg.b\n"
        "    fakepkg/b.py:2: fakepkg.b imports fakepkg.c\n"
        "    fakepkg/c.py:2: fakepkg.c imports fakepkg.a"]


def test_self_check_ignores_type_checking_imports(tmp_path):
    write_tree(tmp_path, {
        "fakepkg/__init__.py": "",
        "fakepkg/a.py": "import fakepkg.b\n",
        "fakepkg/b.py": """\
            import typing
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from fakepkg.a import A
            else:
                from fakepkg import c
            if typing.TYPE_CHECKING:
                import fakepkg.a
            """,
        "fakepkg/c.py": "",
    })
    assert edges(tmp_path) == {("fakepkg.a", "fakepkg.b"), ("fakepkg.b", "fakepkg.c")}
    assert find_cycles(*import_graph(tmp_path, "fakepkg")) == []


def test_self_check_resolves_names_relative_imports_and_package_inits(tmp_path):
    write_tree(tmp_path, {
        "fakepkg/__init__.py": "from . import util\n",
        "fakepkg/util.py": "from fakepkg.sub import leaf\nfrom fakepkg.sub.leaf import x\n",
        "fakepkg/sub/__init__.py": "from .leaf import NAME\nfrom .. import util\n",
        "fakepkg/sub/leaf.py": "import fakepkg.sub.other\nfrom fakepkg.sub import other\n",
        "fakepkg/sub/other.py": "import json\n",
        "fakepkg/mover.py": "from fakepkg.sub.gone import x\nfrom .sub import gone\n",
    })
    assert edges(tmp_path) == {
        ("fakepkg.mover", "fakepkg.sub"),  # twice: gone is a name of sub, or no module at all
        ("fakepkg", "fakepkg.util"),
        ("fakepkg.util", "fakepkg.sub.leaf"), ("fakepkg.util", "fakepkg.sub"),
        ("fakepkg.sub", "fakepkg.sub.leaf"), ("fakepkg.sub", "fakepkg.util"),
        ("fakepkg.sub.leaf", "fakepkg.sub.other"),  # no edge to its own package fakepkg.sub
    }
    modules, imports = import_graph(tmp_path, "fakepkg")
    [cycle] = find_cycles(modules, imports)  # importing sub.leaf runs sub/__init__
    assert format_cycle(cycle, tmp_path) == (
        "fakepkg.sub -> fakepkg.util -> fakepkg.sub\n"
        "    fakepkg/sub/__init__.py:2: fakepkg.sub imports fakepkg.util\n"
        "    fakepkg/util.py:1: fakepkg.util imports fakepkg.sub "
        "(importing fakepkg.sub.leaf runs its package's __init__)")
    # the second import of sub.leaf by util also runs sub/__init__:
    assert Import("fakepkg.util", "fakepkg.sub", tmp_path / "fakepkg/util.py", 2,
                  "fakepkg.sub.leaf") in imports
    assert [imp.describe(tmp_path) for imp in imports if imp.source == "fakepkg.mover"] == [
        "fakepkg/mover.py:1: fakepkg.mover imports fakepkg.sub "
        "(for fakepkg.sub.gone, which does not exist)",
        "fakepkg/mover.py:2: fakepkg.mover imports fakepkg.sub"]


def test_self_check_reports_upward_imports_and_unplaced_modules(tmp_path):
    write_tree(tmp_path, {
        "fakepkg/__init__.py": "",
        "fakepkg/low.py": "import fakepkg\n\ndef f():\n    from fakepkg.high import api\n",
        "fakepkg/high/__init__.py": "",
        "fakepkg/high/api.py": "from fakepkg import low\n",
        "fakepkg/tool.py": "from fakepkg.low import f\n",
        "fakepkg/stray.py": "",
    })
    layers = (*stacked(Layer("base", modules=("fakepkg", "fakepkg.low")),
                       Layer("top", packages=("fakepkg.high",))),
              Layer("tool", modules=("fakepkg.tool",)))
    modules, imports = import_graph(tmp_path, "fakepkg")
    assert layer_violations(imports, layers, tmp_path) == [
        'fakepkg/low.py:4: fakepkg.low (layer 0 "base") imports fakepkg.high.api (layer 1 "top")',
        'fakepkg/tool.py:1: fakepkg.tool ("tool") imports fakepkg.low (layer 0 "base")',
    ]
    assert placement_problems(modules, layers, tmp_path) == [
        "fakepkg.stray (fakepkg/stray.py) is in no layer: add it to LAYERS in "
        "tests/test_layers.py, in the lowest layer it fits"]
    assert placement_problems(modules, (*layers, Layer("again", packages=("fakepkg.high",))),
                              tmp_path)[0].startswith("fakepkg.high (fakepkg/high/__init__.py) is "
                                                      'in several layers: layer 1 "top", "again"')


def test_self_check_finds_environment_reads(tmp_path):
    write_tree(tmp_path, {
        "fakepkg/__init__.py": '''\
            """Set FAKE_DOC to ... (only a mention)."""
            import os
            from os import environ, getenv
            NAME = "FAKE_CONST"
            a = os.environ.get("FAKE_GET")
            b = os.environ["FAKE_ITEM"]
            c = os.getenv("FAKE_GETENV", "1")
            d = "FAKE_IN" in os.environ
            e = environ.get(NAME)
            f = getenv(f"FAKE_{a}")
            os.environ["FAKE_WRITTEN"] = "1"
            g = os.environ.get("OTHER")
            h = "FAKE_TEXT"
            ''',
    })
    assert env_reads(tmp_path, "fakepkg", "FAKE_") == [
        ("fakepkg", "fakepkg/__init__.py:5", "FAKE_GET"),
        ("fakepkg", "fakepkg/__init__.py:6", "FAKE_ITEM"),
        ("fakepkg", "fakepkg/__init__.py:7", "FAKE_GETENV"),
        ("fakepkg", "fakepkg/__init__.py:8", "FAKE_IN"),
        ("fakepkg", "fakepkg/__init__.py:9", "FAKE_CONST"),
        ("fakepkg", "fakepkg/__init__.py:10", "FAKE_"),
    ]


def test_self_check_probe_sees_import_time_reads(tmp_path):
    write_tree(tmp_path, {
        "fakepkg/__init__.py": 'import os\nA = os.environ.get("FAKE_A")\n',
        "fakepkg/m.py": """\
            import os, sys, types
            B = "FAKE_B" in os.environ
            C = os.getenv("FAKE_C")
            def later():
                return os.environ["FAKE_LATER"]
            sys.modules["mpi4py.MPI"] = types.ModuleType("mpi4py.MPI")
            """,
        "fakepkg/broken.py": "raise RuntimeError('half moved')\n",
        "fakepkg/__main__.py": 'import os\nos.environ["FAKE_MAIN"]\n',
    })
    result = import_time_probe(tmp_path, "fakepkg", "FAKE_", tmp_path / "probe")
    problems = probe_problems(result)
    assert problems[0].startswith("importing fakepkg.broken fails:\nTraceback")
    assert "RuntimeError: half moved" in problems[0]
    assert problems[1:] == [
        "fakepkg/__init__.py:2: FAKE_A is read while importing fakepkg",
        "fakepkg/m.py:2: FAKE_B is read while importing fakepkg.m",
        "fakepkg/m.py:3: FAKE_C is read while importing fakepkg.m",
        "mpi4py.MPI is imported (which initialises MPI) by importing the package",
    ]
