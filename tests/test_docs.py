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


# --------------------------------------------------------------------------- the docs stand alone


def _fenced_after(text: str, heading: str) -> list[str]:
    """The lines of the first fenced block after `heading`."""
    lines = text.split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("```"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    return lines[start + 1:end]


def test_the_kir_example_verifies_as_printed(tmp_path: Path, capsys) -> None:
    page = (DOCS / "kir.md").read_text(encoding="utf-8")
    example = tmp_path / "example.kir"
    example.write_text("\n".join(_fenced_after(page, "## Example: one op")) + "\n")
    assert kerncc_main(["verify", str(example)]) == 0, capsys.readouterr().err


def test_the_kir_error_example_is_what_kerncc_prints(tmp_path: Path, monkeypatch,
                                                     capsys) -> None:
    page = (DOCS / "kir.md").read_text(encoding="utf-8")
    command, *expected = _fenced_after(page, "## Errors and locations")
    assert command == "$ kerncc verify m.kir"
    monkeypatch.chdir(tmp_path)
    Path("m.kir").write_text('schema_version 5\nmodel "m"\nbuffer x bf16[4) input\n')
    assert kerncc_main(["verify", "m.kir"]) == 1
    assert capsys.readouterr().err.splitlines() == expected


SELF_CONTAINED = ("runtime.md", "passes.md", "bundle.md", "kir.md", "getting-started.md",
                  "index.md", "concepts.md", "adding-a-kernel.md", "benchmarks.md",
                  "architecture.md", "serving.md", "hf-import.md", "design-notes.md")


@pytest.mark.parametrize("page", SELF_CONTAINED)
def test_pages_cite_nothing_outside_the_repository(page: str) -> None:
    text = (DOCS / page).read_text(encoding="utf-8")
    assert "ARCHITECTURE" not in text and not re.search(r"spec §|§\d", text)


TERMS = ("row", "groups", "fill", "page", "forward", "driven program", "once program",
         "derive program", "state region", "cut id", "carry")


def test_concepts_defines_the_terms_the_pages_use() -> None:
    concepts = (DOCS / "concepts.md").read_text(encoding="utf-8")
    defined = re.findall(r"^\* \*\*([^*]+)\*\*", concepts, flags=re.MULTILINE)
    assert set(TERMS) <= set(defined), set(TERMS) - set(defined)
    for page in ("runtime.md", "bundle.md", "passes.md", "getting-started.md", "index.md"):
        assert "(concepts.md)" in (DOCS / page).read_text(encoding="utf-8"), page
