"""Diagnostics: where a problem is (Location), what it is (Diagnostic), and the one exception.

Every error kerncc reports about its input is a `Diagnostic` carrying kern's message text and a
`Location`: a JSON pointer always, plus file, line and column when the input came from text.
Loading and verifying collect diagnostics (`Diagnostics`) and raise them together as a
`KernccError`; passes raise a `KernccError` with one diagnostic naming the pass, program and call.
The CLI turns a `KernccError` into exit code 1 and readable lines, never a traceback:
`render_error` prints them like a compiler's (`file:line:col: /pointer: message`, the source
line, a caret).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Callable

import attrs


def escape_pointer_token(token: str | int) -> str:
    """One reference token of a JSON pointer (RFC 6901): `~` and `/` escaped."""
    return str(token).replace("~", "~0").replace("/", "~1")


def pointer(*tokens: str | int) -> str:
    """A JSON pointer from its tokens: pointer("ops", "a/b", 0) == "/ops/a~1b/0"."""
    return "".join("/" + escape_pointer_token(t) for t in tokens)


def split_pointer(ptr: str) -> list[str]:
    """The unescaped tokens of a JSON pointer."""
    if not ptr:
        return []
    return [t.replace("~1", "/").replace("~0", "~") for t in ptr[1:].split("/")]


@attrs.frozen
class Location:
    """Where a diagnostic points: a JSON pointer, and the file position when known."""

    pointer: str = ""
    file: str | None = None
    line: int | None = None
    column: int | None = None
    elsewhere: bool = False  # not in the input (a flag, a path, a pass option): never located

    def render(self) -> str:
        """`file:line:col: /pointer`, leaving out what is unknown."""
        parts: list[str] = []
        if self.file is not None:
            where = self.file
            if self.line is not None:
                where += f":{self.line}:{self.column or 1}"
            parts.append(where)
        if self.pointer:
            parts.append(self.pointer)
        return ": ".join(parts)


@attrs.frozen
class Diagnostic:
    """One problem: kern's message text, where it is, and an optional hint."""

    message: str
    location: Location = Location()
    severity: str = "error"
    hint: str | None = None

    def render(self) -> str:
        where = self.location.render()
        text = f"{where}: {self.message}" if where else self.message
        if self.severity != "error":
            text = f"{self.severity}: {text}"
        if self.hint:
            text += f" (hint: {self.hint})"
        return text

    def to_json(self) -> dict:
        loc = self.location
        out: dict = {"severity": self.severity, "message": self.message, "pointer": loc.pointer}
        for key in ("file", "line", "column"):
            value = getattr(loc, key)
            if value is not None:
                out[key] = value
        if self.hint:
            out["hint"] = self.hint
        return out


class KernccError(Exception):
    """The one exception kerncc raises for bad input: a headline and the diagnostics behind it.

    `headline` follows kern's displays (`manifest failed verification:`, `manifest cannot be
    cut:` ...); `str()` gives the headline and one `  - ` line per diagnostic, as kern prints.
    """

    def __init__(self, headline: str, diagnostics: Iterable[Diagnostic] = ()) -> None:
        self.headline = headline
        self.diagnostics = list(diagnostics)
        super().__init__(self.__str__())

    @classmethod
    def single(cls, message: str, pointer: str = "", hint: str | None = None) -> KernccError:
        return cls(message, [Diagnostic(message, Location(pointer), hint=hint)])

    @classmethod
    def elsewhere(cls, message: str, hint: str | None = None) -> KernccError:
        """A problem outside the input manifest (an output path, a flag, a pass option): no
        `located` puts it at the manifest's first character."""
        return cls(message, [Diagnostic(message, Location(elsewhere=True), hint=hint)])

    def __str__(self) -> str:
        if not self.diagnostics:
            return self.headline
        lines = [self.headline] + [f"  - {d.render()}" for d in self.diagnostics]
        return "\n".join(lines)

    def messages(self) -> list[str]:
        return [d.message for d in self.diagnostics]

    def located(self, locate: Callable[[str], Location]) -> KernccError:
        """The same error with file positions filled in by `locate(pointer)`."""
        diags = [attrs.evolve(d, location=_merge(d.location, locate(d.location.pointer)))
                 for d in self.diagnostics]
        return type(self)(self.headline, diags)


@contextlib.contextmanager
def placed(locate: Callable[[str], Location]) -> Iterator[None]:
    """A KernccError raised inside, its pointers placed in a file by `locate` (the file they
    point into: the input manifest, a stage's manifest.json)."""
    try:
        yield
    except KernccError as err:
        raise err.located(locate) from None


def _merge(old: Location, new: Location) -> Location:
    if old.line is not None or old.file is not None or old.elsewhere:  # placed already
        return old
    return attrs.evolve(old, file=new.file, line=new.line, column=new.column)


class Diagnostics:
    """A collector: rules add diagnostics as they find them; `raise_if_any` ends the phase."""

    def __init__(self) -> None:
        self.items: list[Diagnostic] = []

    def error(self, message: str, pointer: str = "", hint: str | None = None) -> None:
        self.items.append(Diagnostic(message, Location(pointer), hint=hint))

    def add(self, diagnostic: Diagnostic) -> None:
        self.items.append(diagnostic)

    def extend(self, diagnostics: Iterable[Diagnostic]) -> None:
        self.items.extend(diagnostics)

    def __bool__(self) -> bool:
        return bool(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Diagnostic]:
        return iter(self.items)

    def raise_if_any(self, headline: str) -> None:
        if self.items:
            raise KernccError(headline, self.items)


# ---------------------------------------------------------------------------------------------
# Rendering, like a compiler: the source line is read back from the file named in the location
# (once per file); a message that carries its own caret rendering is printed as it is.

@lru_cache(maxsize=16)
def _lines(path: str) -> tuple[str, ...]:
    """The file's lines, read only when it is a regular file of sane size (a FIFO named in a
    diagnostic must not hang the printing of it)."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_SHOWN_FILE:
            return ()
        return tuple(Path(path).read_text(encoding="utf-8").splitlines())
    except (OSError, UnicodeDecodeError):
        return ()


_MAX_SHOWN_FILE = 1 << 30


# A source line longer than this is shown as a window around the column: a minified manifest
# is one line of megabytes, and each diagnostic printing it whole took gigabytes.
SOURCE_WINDOW = 120
# Diagnostics printed before the rest are only counted (`--max-errors N`).
MAX_ERRORS = 50


def source_window(text: str, col: int, width: int = SOURCE_WINDOW) -> tuple[str, int]:
    """The part of `text` shown for column `col` (1-based), and the column within it: the
    whole line when short, else `width` characters around `col`, cut ends marked `...`."""
    if len(text) <= width:
        return text, col
    start = max(0, min(col - 1 - width // 2, len(text) - width))
    piece = text[start:start + width]
    head = "..." if start > 0 else ""
    tail = "..." if start + width < len(text) else ""
    return head + piece + tail, col - start + len(head)


def render_diagnostic(diag: Diagnostic, default_file: str | None = None) -> str:
    loc = diag.location
    head = diag.render()
    if loc.file is None and default_file and not head.startswith(default_file):
        head = f"{default_file}: {head}"
    if "\n" in diag.message or loc.file is None or loc.line is None:
        return head
    lines = _lines(loc.file)
    if not 0 < loc.line <= len(lines):
        return head
    text, col = source_window(lines[loc.line - 1], max(1, loc.column or 1))
    return f"{head}\n  {text}\n  {' ' * (col - 1)}^"


def render_error(err: KernccError, default_file: str | None = None,
                 max_errors: int | None = None) -> str:
    """The error as a compiler prints it: at most `max_errors` (default MAX_ERRORS)
    diagnostics, then how many more there were."""
    lone = err.diagnostics[0] if len(err.diagnostics) == 1 else None
    if not err.diagnostics or (lone is not None and lone.message == err.headline
                               and not lone.location.render()):
        return f"error: {err.headline}"
    cap = MAX_ERRORS if max_errors is None else max_errors
    shown = err.diagnostics[:cap]
    body = [render_diagnostic(d, default_file) for d in shown]
    rest = len(err.diagnostics) - len(shown)
    if rest:
        body.append(f"... and {rest} more error{'s' if rest != 1 else ''} "
                    f"(--max-errors N prints more)")
    return f"error: {err.headline}\n" + "\n".join(body)
