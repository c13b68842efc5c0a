"""The generated pass reference, docs/passes.md, written from the registered pass classes.

Everything in it comes from the classes the registry holds (kerncc.passes): each pass's
kebab-case name, its docstring (the first line is the summary `kerncc passes` shows), its
Python class, the passes it `requires` and those that require it, its options (key, type,
default, help, from the attrs fields), and the docstring of the module that defines it. Passes
come in registration order, which for the real registry is `PASS_MODULES` order: the order a
pipeline runs them. The named pipelines come first.

    python -m kerncc.pipeline.docgen            # rewrite docs/passes.md (from the repository root)
    python -m kerncc.pipeline.docgen --check    # exit 1 when docs/passes.md is stale
    kerncc passes --markdown           # the same text on stdout

tests/test_docs.py fails when the committed file differs from what the classes say now.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

from kerncc.passes import PassRegistry, pass_options, pass_summary, registry
from kerncc.pipeline.runner import default_text

DEFAULT_PATH = "docs/passes.md"
REGENERATE = "python -m kerncc.pipeline.docgen"

INTRO = """\
A pipeline names passes in order, each with optional `{key=value,...}` options:
`kerncc lower FILE -p 'cut{at=218,290},emit{out=DIR}'`. A list value is comma separated
(`at=218,290`); a string that is not a plain word is quoted (`at-label="a b"`); `true`/`false`
are booleans. The passes a pass requires run first when the pipeline leaves them out, and the
IR is verified after every pass (`--no-verify` skips that). `kerncc passes` lists the same in
short; `kerncc dump FILE --pass NAME` runs up to a pass and prints the report it files, if any.
Driven, once and derive programs, state regions, crossings and the other words used below are
explained in [concepts](concepts.md).
"""


def pass_reference_markdown(reg: PassRegistry | None = None) -> str:
    """docs/passes.md: the reference of every registered pass."""
    reg = registry() if reg is None else reg
    parts = ["# Pass reference\n",
             f"<!-- Generated from the pass classes by `{REGENERATE}`; do not edit. -->\n",
             INTRO]
    if reg.pipelines:
        parts.append(_named_pipelines(reg))
    classes = reg.in_order()
    parts.append(_index(classes))
    seen_modules: dict[str, str] = {}
    parts += [_pass_section(cls, classes, seen_modules) for cls in classes]
    return "\n".join(parts)


def _named_pipelines(reg: PassRegistry) -> str:
    rows = [f"| `{name}` | `{text}` |" for name, text in sorted(reg.pipelines.items())]
    return "\n".join(["## Named pipelines\n", "| name | expands to |", "| --- | --- |"]
                     + rows) + "\n"


def _index(classes: list[type]) -> str:
    rows = [f"| [`{cls.name}`](#{_anchor(cls.name)}) | {_cell(pass_summary(cls))} |"
            for cls in classes]
    return "\n".join(["## Passes\n", "| pass | summary |", "| --- | --- |"] + rows) + "\n"


def _anchor(name: str) -> str:
    """GitHub's anchor of a heading `` `name` ``: lower case, punctuation but `-` dropped."""
    return "".join(c for c in name.lower() if c.isalnum() or c in "-_")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _pass_section(cls: type, classes: list[type], seen_modules: dict[str, str]) -> str:
    lines = [f"## `{cls.name}`\n", inspect.cleandoc(cls.__doc__ or "") + "\n",
             f"Class `{cls.__module__}.{cls.__qualname__}`.\n"]
    lines += _dependencies(cls, classes)
    lines += _options_table(cls)
    lines += _module_notes(cls, seen_modules)
    return "\n".join(lines)


def _dependencies(cls: type, classes: list[type]) -> list[str]:
    lines = []
    requires = getattr(cls, "requires", ())
    if requires:
        lines.append("Requires: " + ", ".join(f"`{r}`" for r in requires) + ".\n")
    required_by = [c.name for c in classes if cls.name in getattr(c, "requires", ())]
    if required_by:
        lines.append("Required by: " + ", ".join(f"`{r}`" for r in required_by) + ".\n")
    return lines


def _options_table(cls: type) -> list[str]:
    infos = pass_options(cls)
    if not infos:
        return ["Options: none.\n"]
    rows = [f"| `{i.key}` | `{i.type_text}` | `{default_text(i)}` | {_cell(i.help)} |"
            for i in infos]
    return ["| option | type | default | help |", "| --- | --- | --- | --- |", *rows, ""]


def _module_notes(cls: type, seen_modules: dict[str, str]) -> list[str]:
    """The defining module's docstring, once per module (later passes point back to it)."""
    module = inspect.getmodule(cls)
    doc = inspect.cleandoc(module.__doc__ or "") if module is not None else ""
    if not doc:
        return []
    first = seen_modules.setdefault(cls.__module__, cls.name)
    if first != cls.name:
        return [f"Module notes: see [`{first}`](#{_anchor(first)}).\n"]
    quoted = "\n".join(f"> {line}".rstrip() for line in doc.splitlines())
    return [f"From the module `{cls.__module__}`:\n", quoted + "\n"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kerncc.pipeline.docgen",
                                     description="Write docs/passes.md from the pass classes.")
    parser.add_argument("path", nargs="?", default=DEFAULT_PATH,
                        help=f"the file to write or check (default: {DEFAULT_PATH})")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when the file is not current")
    args = parser.parse_args(argv)
    text = pass_reference_markdown()
    path = Path(args.path)
    if args.check:
        current = path.read_text(encoding="utf-8") if path.is_file() else None
        if current != text:
            print(f"{path} is stale: run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
