"""Diagnostics rendered like a compiler's: `file:line:col: /pointer: message`, the line, a caret.

The source line is read back from the file named in the location (once per file); a diagnostic
whose message already carries its own caret rendering (pipeline specs, .kir parse errors) is
printed as it is.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from kerncc.diagnostics import Diagnostic, KernccError


@lru_cache(maxsize=16)
def _lines(path: str) -> tuple[str, ...]:
    try:
        return tuple(Path(path).read_text(encoding="utf-8").splitlines())
    except (OSError, UnicodeDecodeError):
        return ()


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
    text = lines[loc.line - 1]
    col = max(1, loc.column or 1)
    return f"{head}\n  {text}\n  {' ' * (col - 1)}^"


def render_error(err: KernccError, default_file: str | None = None) -> str:
    lone = err.diagnostics[0] if len(err.diagnostics) == 1 else None
    if not err.diagnostics or (lone is not None and lone.message == err.headline
                               and not lone.location.render()):
        return f"error: {err.headline}"
    body = "\n".join(render_diagnostic(d, default_file) for d in err.diagnostics)
    return f"error: {err.headline}\n{body}"
