"""The floor plan (docs/architecture.md) holds: no import cycles, a small top level, and a
runtime that loads nothing of the compiler when it runs a bundle.

The import graph is read from the sources with `ast`: every import statement, also those inside
functions and under TYPE_CHECKING (a lazy import hides a cycle, it does not remove it).
`from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
# Import package -> source folder, as pyproject's package-dir maps them.
PACKAGE_DIRS = {"kerncc": ROOT / "kerncc", "kerncc.passes": ROOT / "passes",
                "kerncc.runtime": ROOT / "runtime", "kerncc.grammar": ROOT / "grammar",
                "kerncc.kernels": ROOT / "kernels"}
MAX_TOP_LEVEL_MODULES = 15
COMPILER = ("kerncc.passes", "kerncc.pipeline", "kerncc.symbolic", "kerncc.kir", "kerncc.lower",
            "kerncc.ir", "lark")


def source_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _imported_names(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


@dataclasses.dataclass(frozen=True)
class DynamicImport:
    """An `importlib.import_module(...)` or `__import__(...)` call: the modules it may load
    (`prefix*` when part of the name is computed), or `unread` when the test cannot tell."""

    names: tuple[str, ...] = ()
    prefix: str | None = None
    unread: str | None = None


def _dynamic_imports(tree: ast.AST, module: str, path: Path) -> list[DynamicImport]:
    """Every call that imports by name. A literal name is an edge; an f-string's literal head
    (`__name__` read as the module) stands for every module it may complete to; a loop variable
    over a literal tuple stands for each item; anything else is `unread` (and fails a test)."""
    loops: dict[str, tuple[str, ...]] = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.For) and isinstance(node.target, ast.Name)
                and isinstance(node.iter, (ast.Tuple, ast.List))
                and all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                        for e in node.iter.elts)):
            loops[node.target.id] = tuple(e.value for e in node.iter.elts)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_import_call(node.func) and node.args:
            found.append(_dynamic_target(node.args[0], module, loops,
                                         f"{_shown(path)}:{node.lineno}"))
    return found


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _is_import_call(func: ast.expr) -> bool:
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module"
    return isinstance(func, ast.Name) and func.id in ("import_module", "__import__")


def _dynamic_target(arg: ast.expr, module: str, loops: dict[str, tuple[str, ...]],
                    where: str) -> DynamicImport:
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return DynamicImport(names=(arg.value,))
    if isinstance(arg, ast.Name) and arg.id in loops:
        return DynamicImport(names=loops[arg.id])
    if isinstance(arg, ast.JoinedStr):
        head = ""
        for part in arg.values:
            if isinstance(part, ast.Constant):
                head += str(part.value)
            elif isinstance(part.value, ast.Name) and part.value.id == "__name__":
                head += module
            else:
                return DynamicImport(prefix=head)
        return DynamicImport(names=(head,))
    return DynamicImport(unread=f"{where}: {ast.unparse(arg)}")


def _packages_above(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _module_edges(module: str, path: Path, modules: dict[str, Path]
                  ) -> tuple[set[str], set[str], list[str]]:
    """(what importing `module` runs, the packages it names itself, unread dynamic imports).

    Importing `a.b.c` also runs `a/__init__` and `a/b/__init__`: an edge to each package above
    the target, except the module's own packages (already running when it is imported). A
    package `module` names itself (`from kerncc.passes import register`) is an edge too."""
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    named: set[str] = set()
    unread: list[str] = []
    for node in ast.walk(tree):
        names = _imported_names(node, module, path.name == "__init__.py")
        if isinstance(node, ast.ImportFrom):  # `from pkg import mod` names the module only
            names = [n for n in names[:-1] if n in modules] or names[-1:]
        named.update(t for t in map(resolve, names) if t is not None)
    for dynamic in _dynamic_imports(tree, module, path):
        if dynamic.unread:
            unread.append(dynamic.unread)
        named.update(t for t in map(resolve, dynamic.names) if t is not None)
        if dynamic.prefix is not None:
            named.update(m for m in modules if m.startswith(dynamic.prefix))
    named.discard(module)
    own = set(_packages_above(module))
    runs = set(named)
    for target in named:
        runs.update(p for p in _packages_above(target) if p in modules and p not in own)
    return runs, named & own, unread


@functools.cache
def _read_graph() -> tuple[nx.DiGraph, dict[str, set[str]], tuple[str, ...]]:
    modules = source_modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    own_packages: dict[str, set[str]] = {}
    unread: list[str] = []
    for module, path in modules.items():
        runs, own, lost = _module_edges(module, path, modules)
        graph.add_edges_from((module, target) for target in runs)
        if own:
            own_packages[module] = own
        unread += lost
    return graph, own_packages, tuple(unread)


def import_graph() -> nx.DiGraph:
    """module -> every module importing it runs (package `__init__`s and dynamic imports
    included); a fresh copy, so a test may change it."""
    return _read_graph()[0].copy()


def test_the_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert cycles == [], "import cycles (each a set of modules that import one another): " + (
        "; ".join(", ".join(c) for c in cycles))


def test_no_module_imports_its_own_package() -> None:
    """A module imports its siblings, never the `__init__` of a package it sits in: that
    `__init__` is still running when the module is imported (a half-made package). The one
    exception is `kerncc` itself for `__version__`: its `__init__` imports nothing, so it has
    run to its end before any module below it starts."""
    init = (ROOT / "kerncc" / "__init__.py").read_text(encoding="utf-8")
    assert not any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(ast.parse(init)))
    own = {m: p - {"kerncc"} for m, p in _read_graph()[1].items() if p - {"kerncc"}}
    assert own == {}, "\n".join(f"{m} imports {', '.join(sorted(p))}: import the sibling "
                                "module that defines the name instead" for m, p in own.items())


def test_every_dynamic_import_is_read() -> None:
    """`importlib.import_module(x)` is an edge only if the test can read x: a literal, an
    f-string's literal head, or a loop over a literal tuple."""
    assert _read_graph()[2] == ()


def test_the_graph_reader_sees_lazy_imports(tmp_path: Path) -> None:
    """The reader must see an import inside a function (else the cycle test cannot fail)."""
    tree = ast.parse("def f():\n    from kerncc.manifest import reader\n")
    names = [n for node in ast.walk(tree) for n in _imported_names(node, "kerncc.x", False)]
    assert "kerncc.manifest.reader" in names
    assert ("kerncc.manifest.reader", "kerncc.manifest.model") in import_graph().edges


def test_the_graph_reader_sees_dynamic_imports_and_package_inits(tmp_path: Path) -> None:
    """The edges a plain `import` reader misses, each of which once hid a cycle."""
    source = tmp_path / "x.py"
    source.write_text(
        "import importlib\n"
        "def f(name):\n"
        "    importlib.import_module('kerncc.a.b')\n"
        "    importlib.import_module(f'{__name__}s.{name}')\n"
        "    for m in ('kerncc.c', 'kerncc.d'):\n"
        "        __import__(m)\n"
        "    importlib.import_module(name)\n"
        "    from kerncc.a import thing\n")
    modules = {m: source for m in ("kerncc", "kerncc.a", "kerncc.a.b", "kerncc.c", "kerncc.d",
                                   "kerncc.a.xs", "kerncc.a.xs.p", "kerncc.a.x")}
    runs, own, unread = _module_edges("kerncc.a.x", source, modules)
    # kerncc and kerncc.a are the module's own packages: importing it already ran them.
    assert runs == {"kerncc.a", "kerncc.a.b", "kerncc.a.xs", "kerncc.a.xs.p", "kerncc.c",
                    "kerncc.d"}
    assert own == {"kerncc.a"}  # `from kerncc.a import thing`: a name of its own package
    assert len(unread) == 1 and unread[0].endswith(":7: name")
    runs, _, _ = _module_edges("kerncc.c", source, modules)
    assert "kerncc.a" in runs  # importing kerncc.a.b runs kerncc/a/__init__


def test_every_source_compiles_without_a_warning() -> None:
    """An invalid escape in a string (a docstring's regex) is a SyntaxWarning at import on
    Python 3.12 and an error later; compiled here with warnings as errors, every module."""
    import warnings

    for module, path in sorted(source_modules().items()):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compile(path.read_text(), str(path), "exec")


def test_the_top_level_is_small() -> None:
    top = sorted(p.name for p in (ROOT / "kerncc").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_nothing_imports_the_command_line() -> None:
    graph = import_graph()
    users = {a for a, b in graph.edges if b.startswith("kerncc.cli") and not a.startswith("kerncc.cli")}
    assert users == {"kerncc.__main__"}


def test_the_runtime_imports_nothing_of_the_compiler() -> None:
    graph = import_graph()
    runtime = [m for m in graph if m.startswith("kerncc.runtime")]
    reached = set().union(*(nx.descendants(graph, m) for m in runtime))
    assert sorted(m for m in reached if m.startswith(COMPILER)) == []


def test_passes_and_runtime_stay_apart() -> None:
    graph = import_graph()
    assert [(a, b) for a, b in graph.edges
            if a.startswith("kerncc.passes") and b.startswith("kerncc.runtime")] == []


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from kerncc.example import generate
    return generate(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory, tiny_model) -> Path:
    from kerncc.cli.main import main
    out = tmp_path_factory.mktemp("arch") / "bundle"
    assert main(["lower", str(tiny_model[0]), "-p", "cut,slice-derive,emit", "-o", str(out)]) == 0
    return out


def test_running_a_bundle_loads_no_compiler_module(bundle: Path, tiny_model) -> None:
    script = (
        "import json, sys\n"
        "from kerncc.runtime import Chain\n"
        "from kerncc.runtime.bundle import Bundle\n"
        "from kerncc.serve.engine import serve_prompts\n"
        f"b = Bundle({str(bundle)!r}); b.checkpoint = {str(tiny_model[1])!r}\n"
        "tokens = serve_prompts(Chain(b), [[1, 2, 3]], 2)[0][0].generated\n"
        "print(json.dumps([tokens, sorted(sys.modules)]))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True)
    tokens, loaded = json.loads(done.stdout)
    assert len(tokens) == 2
    assert [m for m in loaded if m.startswith(COMPILER)] == []


# ---------------------------------------------------------------------------------------------
# docs/architecture.md's folder table, read and held against the import graph.

PAGE = ROOT / "docs" / "architecture.md"
_TICKED = re.compile(r"`([^`]+)`")


@dataclasses.dataclass
class Row:
    """One row of the folder table: its units (folders or files, as the first cell names them),
    the module files its job cell names, and the units its "imports from" cell names."""

    line: int
    first: str
    units: tuple[str, ...]
    named: frozenset[str]
    imports: frozenset[str] | None  # None: the cell names something that is no unit


def unit_paths() -> dict[str, str]:
    """unit short name -> its path as the table writes it: `kerncc/manifest/` is `manifest`,
    `kerncc/ir.py` is `ir`, `passes/` is `passes`, `kerncc/__init__.py` is `kerncc`."""
    units = {"kerncc": "kerncc/__init__.py"}
    for package, folder in PACKAGE_DIRS.items():
        if package != "kerncc":
            units[package.rpartition(".")[2]] = f"{folder.relative_to(ROOT)}/"
    for path in (ROOT / "kerncc").iterdir():
        if path.is_dir() and (path / "__init__.py").exists():
            units[path.name] = f"kerncc/{path.name}/"
        elif path.suffix == ".py" and path.name != "__init__.py":
            units[path.stem] = f"kerncc/{path.name}"
    return units


def unit_of(module: str) -> str:
    """The unit a module belongs to: `kerncc.manifest.reader` -> `manifest`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kerncc"


def unit_modules(unit: str, paths: dict[str, str]) -> dict[str, Path]:
    """module -> file, for every module of the unit."""
    return {m: p for m, p in source_modules().items() if unit_of(m) == unit}


def read_table(text: str, paths: dict[str, str]) -> list[Row]:
    by_path = {path: unit for unit, path in paths.items()}
    rows = []
    lines = text.splitlines()
    start = lines.index("| folder | its one job | imports from |")
    for number, line in enumerate(lines[start + 2:], start + 3):
        if not line.startswith("|"):
            break
        first, job, imports = (cell.strip() for cell in line.strip("|").split("|"))
        units = tuple(by_path[t] for t in _TICKED.findall(first) if t in by_path)
        named = frozenset(t for t in _TICKED.findall(job) if t.endswith(".py"))
        words = {w.strip() for w in re.sub(r"\([^)]*\)", "", imports).split(",") if w.strip()}
        imported = None if not words <= set(paths) | {"nothing"} else frozenset(words - {"nothing"})
        rows.append(Row(number, first, units, named, imported))
    return rows


def _cell(units: set[str] | frozenset[str]) -> str:
    return ", ".join(sorted(units)) or "nothing"


def floor_plan_problems(text: str, graph: nx.DiGraph) -> list[str]:
    """What to change in the table, a line per row: the page is wrong where this is not empty."""
    paths = unit_paths()
    rows = read_table(text, paths)
    problems = []
    placed = {unit for row in rows for unit in row.units}
    for unit in sorted(set(paths) - placed):
        problems.append(f"`{paths[unit]}` is in no row: add a row `{paths[unit]}` | its job | "
                        f"{_cell(_imports_of({unit}, graph))} |, or name it in a row's first cell")
    for row in rows:
        problems += _row_problems(row, paths, graph)
    return problems


def _imports_of(units: set[str], graph: nx.DiGraph) -> set[str]:
    return {unit_of(b) for a, b in graph.edges if unit_of(a) in units} - units


def _row_problems(row: Row, paths: dict[str, str], graph: nx.DiGraph) -> list[str]:
    where = f"docs/architecture.md:{row.line}, row {row.first}"
    actual = _imports_of(set(row.units), graph)
    problems = []
    if row.units and row.imports != actual:
        if row.imports is None:
            change = "it names something that is no module or folder of kerncc"
        else:
            change = "; ".join(filter(None, [
                f"add {_cell(actual - row.imports)}" if actual - row.imports else "",
                f"drop {_cell(row.imports - actual)}" if row.imports - actual else ""]))
        problems.append(f"{where}: set \"imports from\" to `{_cell(actual)}` ({change})")
    for unit in row.units:
        if paths[unit].endswith("/"):
            problems += _named_problems(where, row, paths[unit], unit_modules(unit, paths))
    return problems


def _named_problems(where: str, row: Row, folder: str, modules: dict[str, Path]) -> list[str]:
    """A folder's row names each of its modules (`cpu.py` or `backends/cpu.py`; a package's
    `__init__.py` may go unnamed) and names no module the folder lacks."""
    files = {p.relative_to(ROOT / folder).as_posix() for p in modules.values()}
    spoken = {f for f in files if f in row.named or f.rpartition("/")[2] in row.named}
    problems = [f"{where}: name `{name}` in its job cell (a module of {folder})"
                for name in sorted(files - spoken) if not name.endswith("__init__.py")]
    known = files | {f.rpartition("/")[2] for f in files}
    if len(row.units) == 1:
        problems += [f"{where}: drop `{name}` from its job cell ({folder} has no such module)"
                     for name in sorted(row.named - known)]
    return problems


def test_the_floor_plan_is_the_import_graph() -> None:
    """docs/architecture.md's table names every module, and each row's "imports from" is what
    its modules import (other rows' units, package `__init__`s and dynamic imports counted)."""
    problems = floor_plan_problems(PAGE.read_text(encoding="utf-8"), import_graph())
    assert problems == [], "docs/architecture.md is out of date:\n" + "\n".join(problems)


def test_the_floor_plan_test_says_which_row_to_change_and_how() -> None:
    """What the lead reads when a module comes, goes or gains an import."""
    text = PAGE.read_text(encoding="utf-8")
    line = next(n for n, t in enumerate(text.splitlines(), 1)
                if t.startswith("| `kerncc/dot.py`"))
    graph = import_graph()
    graph.add_edge("kerncc.dot", "kerncc.symbolic")
    graph.remove_edge("kerncc.dot", "kerncc.ir")
    text = text.replace("`weights.py`, ", "`gone.py`, ")
    problems = floor_plan_problems(text, graph)
    runtime = next(n for n, t in enumerate(text.splitlines(), 1) if t.startswith("| `runtime/`"))
    assert problems == [
        f"docs/architecture.md:{line}, row `kerncc/dot.py`: set \"imports from\" to "
        "`diagnostics, manifest, symbolic` (add symbolic; drop ir)",
        f"docs/architecture.md:{runtime}, row `runtime/` (`kerncc.runtime`): name `weights.py` "
        "in its job cell (a module of runtime/)",
        f"docs/architecture.md:{runtime}, row `runtime/` (`kerncc.runtime`): drop `gone.py` "
        "from its job cell (runtime/ has no such module)"]
    text = text.replace("| `kerncc/progress.py` |", "| progress |")
    assert floor_plan_problems(text, graph)[0] == (
        "`kerncc/progress.py` is in no row: add a row `kerncc/progress.py` | its job | config |, "
        "or name it in a row's first cell")
