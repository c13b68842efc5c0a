"""The floor plan (docs/architecture.md) holds: no import cycles, a small top level, and a
runtime that loads nothing of the compiler when it runs a bundle.

The import graph is read from the sources with `ast`: every import statement, also those inside
functions and under TYPE_CHECKING (a lazy import hides a cycle, it does not remove it).
`from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg`.
"""

from __future__ import annotations

import ast
import json
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


def import_graph() -> nx.DiGraph:
    modules = source_modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            names = _imported_names(node, module, path.name == "__init__.py")
            if isinstance(node, ast.ImportFrom):  # `from pkg import mod` names the module only
                names = [n for n in names[:-1] if n in modules] or names[-1:]
            for name in names:
                target = resolve(name)
                if target is not None and target != module:
                    graph.add_edge(module, target)
    return graph


def test_the_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert cycles == []


def test_the_graph_reader_sees_lazy_imports(tmp_path: Path) -> None:
    """The reader must see an import inside a function (else the cycle test cannot fail)."""
    tree = ast.parse("def f():\n    from kerncc.manifest import reader\n")
    names = [n for node in ast.walk(tree) for n in _imported_names(node, "kerncc.x", False)]
    assert "kerncc.manifest.reader" in names
    assert ("kerncc.manifest.reader", "kerncc.manifest.model") in import_graph().edges


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
