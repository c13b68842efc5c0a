"""docs/ stays true to the code: the generated pass reference is current, every page is linked
from the index, and every relative link points at a file that exists.
(The walkthrough of docs/getting-started.md runs in tests/test_docs_walkthrough.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kerncc.pipeline import docgen
from kerncc.cli.main import main as kerncc_main

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_passes_md_is_current() -> None:
    current = (DOCS / "passes.md").read_text(encoding="utf-8")
    assert current == docgen.pass_reference_markdown(), (
        f"docs/passes.md is stale: run `{docgen.REGENERATE}` from the repository root")


def test_passes_come_in_pipeline_order_whatever_was_imported_first() -> None:
    from kerncc.passes import PASS_MODULES, registry

    classes = registry().in_order()
    modules = [cls.__module__.rpartition(".")[2] for cls in classes]
    assert modules == sorted(modules, key=PASS_MODULES.index)
    assert [cls.name for cls in classes][:2] == ["liveness", "cut"]


def test_docgen_check_says_when_the_file_is_stale(tmp_path: Path) -> None:
    target = tmp_path / "passes.md"
    assert docgen.main(["--check", str(target)]) == 1  # missing
    assert docgen.main([str(target)]) == 0
    assert docgen.main(["--check", str(target)]) == 0
    target.write_text(target.read_text() + "edited by hand\n")
    assert docgen.main(["--check", str(target)]) == 1


def test_kerncc_passes_markdown_prints_the_reference(capsys: pytest.CaptureFixture) -> None:
    assert kerncc_main(["passes", "--markdown"]) == 0
    assert capsys.readouterr().out == docgen.pass_reference_markdown()


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, code) of every ```python block."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(text.splitlines(), 1):
        if current is None and line.strip() == "```python":
            current, start = [], number + 1
        elif current is not None and line.strip() == "```":
            blocks.append((start, "\n".join(current)))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_the_runtime_page_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/runtime.md's examples, in order, in one namespace, in an empty directory."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "runtime_md"}
    page = DOCS / "runtime.md"
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    assert blocks, "docs/runtime.md has no python example"
    for start, code in blocks:
        # Padded so that a traceback points at the page's own line numbers.
        exec(compile("\n" * (start - 1) + code, str(page), "exec"), namespace)  # noqa: S102


def test_every_page_is_linked_from_the_index() -> None:
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    linked = set(LINK.findall(index))
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    assert pages <= linked, f"not linked from docs/index.md: {sorted(pages - linked)}"


@pytest.mark.parametrize("page", sorted([*DOCS.glob("*.md"), ROOT / "README.md"]),
                         ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (page.parent / target).exists(), f"{page.name}: broken link `{target}`"
