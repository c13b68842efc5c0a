"""The rows a bench measures, and where they go: printed as they come, as one table at the end,
to --out/results.json, and with --doc into docs/benchmarks.md between the bench's markers,
headed by the command that measures them again, the commit, the device and the date.

Every bench uses one `Report`:

    report = Report("decode")
    report.add_options(parser)          # --out, --doc, --commit
    with report.section("copy"):        # a failing section is a row; the others still run
        report.row("copy", "device-to-device copy of 4 GiB, TB/s", "4.26")
    return report.finish(args, device)  # the table, results.json, the --doc rows
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

UNSHOWN = ("--doc", "--commit", "--out")  # options of the run, not of what it measures


class DocError(Exception):
    """A --doc file the rows cannot go into (missing, or its markers broken)."""


def say(*parts: object) -> None:
    print(*parts, flush=True)


class Report:
    """One bench run's rows (section, measure, value) and its results for results.json."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.rows: list[tuple[str, str, str]] = []
        self.results: dict = {}

    def row(self, section: str, what: str, value: str) -> None:
        self.rows.append((section, what, value))
        say(f"  [{section}] {what}: {value}")

    @contextlib.contextmanager
    def section(self, name: str, limit: float = 240) -> Iterator[None]:
        """A guarded section: a failure is printed and becomes a FAILED row; a section stuck
        past `limit` seconds dumps every thread's stack (and goes on)."""
        say(f"== {name}")
        started = time.perf_counter()
        faulthandler.dump_traceback_later(limit, exit=False)
        try:
            yield
        except Exception as err:  # noqa: BLE001 - a bench reports and goes on
            traceback.print_exc()
            self.row(name, "FAILED", f"{type(err).__name__}: {err}"[:300])
        finally:
            faulthandler.cancel_dump_traceback_later()
        say(f"== {name} took {time.perf_counter() - started:.1f} s")

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--out", default=os.environ.get("OUT") or f"{self.name}-bench",
                            help="folder for results.json (default $OUT or ./NAME-bench)")
        parser.add_argument("--doc", type=Path, default=None,
                            help="also write the rows into this markdown file "
                            f"(docs/benchmarks.md), between its `{self.name}` markers")
        parser.add_argument("--commit", default="",
                            help="the commit the --doc rows name (default: git's HEAD)")

    def table(self) -> str:
        lines = ["| section | measure | value |", "| --- | --- | --- |"]
        lines += [f"| {sec} | {what} | {value} |" for sec, what, value in self.rows]
        return "\n".join(lines)

    def finish(self, args: argparse.Namespace, device: str, argv: list[str] | None = None) -> int:
        """Print the table, write results.json under --out and, with --doc, the rows; 1 when
        the rows could not go into --doc."""
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(self.results, indent=1, default=str) + "\n")
        say("\n" + self.table())
        if args.doc is None:
            return 0
        header = doc_header(self.name, args.commit, device, sys.argv[1:] if argv is None else argv)
        try:
            write_rows(args.doc, self.name, self.rows, header)
        except DocError as err:
            say(f"{self.name}: --doc: {err}")
            return 1
        say(f"rows written into {args.doc}")
        return 0


def shown_command(name: str, argv: list[str]) -> str:
    """The command that measures the same again: `argv` without UNSHOWN's options (given as
    `--doc X` or `--doc=X`)."""
    shown, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in UNSHOWN:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in UNSHOWN)):
            shown.append(arg)
    return " ".join([f"python -m bench.{name}", *shown])


def doc_header(name: str, commit: str, device: str, argv: list[str]) -> str:
    """The line above the rows: how to get them again, from which commit, on what, when."""
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = "an unknown commit"
    return (f"`{shown_command(name, argv)}` at {commit} on {device}, "
            f"{time.strftime('%Y-%m-%d')}:")


def write_rows(doc: Path, name: str, rows: list[tuple[str, str, str]], header: str) -> None:
    """The rows as a markdown table in `doc` between the markers of `name`: what stood between
    them is replaced, else the block goes at the end. `header` heads the table. The file is
    rewritten whole (a temporary file renamed over it), so a failure leaves it as it was."""
    begin = f"<!-- {name} rows: begin (written by the bench; edit the bench, not these lines) -->"
    end = f"<!-- {name} rows: end -->"
    try:
        text = doc.read_text()
    except OSError as err:
        raise DocError(f"{doc}: {err.strerror or err}") from None
    table = "\n".join([begin, header, "", "| section | measure | value |", "| --- | --- | --- |",
                       *(f"| {sec} | {what} | {value} |" for sec, what, value in rows), end])
    starts, ends = text.count(begin), text.count(end)
    if (starts, ends) == (1, 1) and text.index(begin) < text.index(end):
        head, rest = text.split(begin, 1)
        text = head + table + rest.split(end, 1)[1]
    elif (starts, ends) != (0, 0):
        raise DocError(f"{doc}: the `{name}` markers are broken ({starts} begin, {ends} end); "
                       "fix them by hand, nothing was written")
    else:
        text = text.rstrip("\n") + "\n\n" + table + "\n"
    temporary = doc.with_name(f".{doc.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text)
        os.replace(temporary, doc)
    except OSError as err:
        temporary.unlink(missing_ok=True)
        raise DocError(f"{doc}: {err.strerror or err}") from None
