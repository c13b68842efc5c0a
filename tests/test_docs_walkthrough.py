"""docs/getting-started.md, run as written: every `$ ` command of its ```console blocks, in order,
in one empty directory, with bash, as a newcomer would paste them.

A command must exit 0 and print (stdout and stderr together) exactly the lines that follow it
in the page, up to the next command or the end of the block; `...` inside a line matches any
text, and a line that is only `...` any number of lines (doctest's ELLIPSIS). So the page fails
this test as soon as it drifts from the tool, and the tool as soon as it drifts from the page.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

PAGE = Path(__file__).resolve().parent.parent / "docs" / "getting-started.md"
PROMPT = "$ "
ELLIPSIS = "..."

# What the page must walk a newcomer through (the brief of docs/getting-started.md).
REQUIRED = (
    "kerncc example qwen --size tiny",
    "kerncc dump qwen/model.json --pass liveness",
    "kerncc lower qwen/model.json -p cut,slice-derive,emit -o qwen/out",
    "kerncc check qwen/out",
    "kerncc report qwen/out",
    "kerncc run qwen/out --backend cpu",
)


@attrs.frozen
class Step:
    line: int  # 1-based line of the command in the page
    command: str
    expected: tuple[str, ...]


def console_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of every ```console block."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(text.splitlines(), 1):
        if current is None and line.strip() == "```console":
            current, start = [], number + 1
        elif current is not None and line.strip() == "```":
            blocks.append((start, current))
            current = None
        elif current is not None:
            current.append(line)
    assert current is None, f"{PAGE.name}: a ```console block is not closed"
    return blocks


def steps(text: str) -> list[Step]:
    out: list[Step] = []
    for start, lines in console_blocks(text):
        assert not lines or lines[0].startswith(PROMPT), (
            f"{PAGE.name}:{start}: a console block starts with a `$ ` command")
        for offset, line in enumerate(lines):
            if line.startswith(PROMPT):
                out.append(Step(start + offset, line[len(PROMPT):], ()))
            else:
                last = out[-1]
                out[-1] = attrs.evolve(last, expected=last.expected + (line,))
    return out


def pattern(expected: tuple[str, ...]) -> re.Pattern[str]:
    """The expected lines as a regex over the whole output (a newline after each line)."""
    parts = []
    for line in expected:
        if line == ELLIPSIS:
            parts.append(r"(?:[^\n]*\n)*?")
            continue
        pieces = [re.escape(p) for p in line.split(ELLIPSIS)]
        parts.append("[^\n]*".join(pieces) + r"\n")
    return re.compile("".join(parts))


def matches(expected: tuple[str, ...], output: str) -> bool:
    if output and not output.endswith("\n"):
        output += "\n"
    return pattern(expected).fullmatch(output) is not None


def environment(bin_dir: Path) -> dict[str, str]:
    """`kerncc` on PATH runs this interpreter's kerncc (what the console script runs:
    `kerncc.cli.main:main`), whatever else is installed; unbuffered, so stdout and stderr interleave
    as on a terminal; no progress bars; a fixed width and locale."""
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "kerncc"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m kerncc "$@"\n')
    script.chmod(0o755)
    env = dict(os.environ, PYTHONUNBUFFERED="1", KERNCC_NO_PROGRESS="1", COLUMNS="100",
               LC_ALL="C", PATH=os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]))
    env.pop("KERNCC_BACKEND", None)
    return env


def run(step: Step, cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    done = subprocess.run(["bash", "-c", step.command], check=False, cwd=cwd, env=env,
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=120)
    return done.returncode, done.stdout


def test_the_page_walks_through_what_it_must() -> None:
    commands = [s.command for s in steps(PAGE.read_text(encoding="utf-8"))]
    for required in REQUIRED:
        assert any(c.startswith(required) for c in commands), (
            f"{PAGE.name} no longer runs `{required} ...`")


def test_getting_started_runs_as_written(tmp_path: Path) -> None:
    env = environment(tmp_path / "bin")
    work = tmp_path / "work"
    work.mkdir()
    for step in steps(PAGE.read_text(encoding="utf-8")):
        code, output = run(step, work, env)
        where = f"{PAGE.name}:{step.line}: `{step.command}`"
        assert code == 0, f"{where} exited {code}:\n{output}"
        assert matches(step.expected, output), (
            f"{where} printed something else than the page says.\n--- the page:\n"
            + "\n".join(step.expected) + "\n--- the tool:\n" + output)


@pytest.mark.parametrize(("expected", "output", "ok"), [
    (("a", "b"), "a\nb\n", True),
    (("a", "b"), "a\nb", True),
    (("a",), "a\nb\n", False),
    (("a ... c",), "a xyz c\n", True),
    (("a ... c",), "a x\ny c\n", False),
    (("a", "...", "d"), "a\nb\nc\nd\n", True),
    (("a", "...", "d"), "a\nd\n", True),
    (("...",), "", True),
    ((), "", True),
    ((), "noise\n", False),
])
def test_matching(expected: tuple[str, ...], output: str, ok: bool) -> None:
    assert matches(expected, output) is ok


def test_steps_are_read_from_console_blocks_only() -> None:
    text = ("```bash\n$ not run\n```\n\n```console\n$ echo a\na\n$ true\n```\n")
    assert steps(text) == [Step(6, "echo a", ("a",)), Step(8, "true", ())]
