"""The `.kir` reader: text -> lark tree -> raw JSON (a position per JSON pointer) -> Manifest.

The grammar (`grammar/kir.lark`) fixes the shape of each line and its lexical words (which names
print bare, which are keywords); syntax errors become diagnostics with the offending line, a
caret and the expected tokens in words. `kerncc.kir.build` turns the tree into the manifest's raw
JSON and records where each pointer is written; the typed parse is then `kerncc.manifest.reader`'s, the
one JSON goes through, so kir and JSON accept the same values with the same messages (ranges,
vocabulary, param types, unknown fields), here located at kir line:col.
"""

from __future__ import annotations

import functools
import importlib.resources
import math
import re
import sys
from collections.abc import Callable

import lark

from kerncc import manifest as m
from kerncc.diagnostics import Diagnostic, KernccError, Location
from kerncc.manifest.jsonsource import PARSE_HEADLINE, value_problems
from kerncc.kir.build import Position, build
from kerncc.manifest.reader import from_raw

NAME_RE = re.compile(r"[A-Za-z_](?:[A-Za-z0-9_.:-]|/(?!/))*")
DECLARATIONS = frozenset({"schema_version", "model", "topology", "cut", "var", "state", "buffer",
                          "module", "op", "program"})
FLAGS = frozenset({"export", "monotone", "oob_nan", "wrap", "pdl", "once", "derive", "graph"})
_EXCERPT_INDENT = "    "
_TOKEN_WORDS = {"NAME": "a name", "STRING": "a name", "INT": "a number", "FLOAT": "a number",
                "PARAM": "an interface param (`%0`)", "CALLNO": "a call number (`#0`)",
                "$END": "end of input"}

Locate = Callable[[str], Location]


@functools.cache
def parser() -> lark.Lark:
    grammar = (importlib.resources.files("kerncc.grammar") / "kir.lark").read_text("utf-8")
    return lark.Lark(grammar, parser="lalr", lexer="contextual", propagate_positions=True,
                     maybe_placeholders=True)


@functools.cache
def keywords() -> frozenset[str]:
    """Every keyword of the grammar that a bare name could spell: such names are quoted."""
    return frozenset(t.pattern.value for t in parser().terminals
                     if isinstance(t.pattern, lark.lexer.PatternStr)
                     and NAME_RE.fullmatch(t.pattern.value))


def loads_with_locator(text: str, file: str | None = None) -> tuple[m.Manifest, Locate]:
    """Parse kir text; a KernccError carries every problem at its kir line:col."""
    raw, positions = parse_raw(text, file)
    locate = locator(positions, file)
    try:
        return from_raw(raw), locate
    except KernccError as err:
        located = err.located(locate)
        # kir readers scan top to bottom; kern's reader walks the JSON structure
        located.diagnostics.sort(key=lambda d: (d.location.line or 0, d.location.column or 0))
        raise KernccError(located.headline, located.diagnostics) from None


def locator(positions: dict[str, Position], file: str | None) -> Locate:
    """JSON pointer -> where it is written; a pointer never written falls back to its parent."""
    def locate(ptr: str) -> Location:
        probe = ptr
        while probe and probe not in positions:
            probe = probe.rsplit("/", 1)[0]
        line, col = positions.get(probe, (1, 1))
        return Location(ptr, file, line, col)
    return locate


def parse_raw(text: str, file: str | None = None) -> tuple[dict, dict[str, Position]]:
    """The manifest's raw JSON and the position of each pointer, or a located KernccError."""
    accepts: list[set[str]] = []
    try:
        tree = parser().parse(text, on_error=lambda err: _stop(err, accepts))
    except lark.exceptions.UnexpectedInput as err:
        expected = accepts[0] if accepts else getattr(err, "expected", set())
        raise KernccError(PARSE_HEADLINE, [syntax_diagnostic(err, expected, text, file)]) from None
    problems = number_problems(tree, file)
    if problems:
        raise KernccError(PARSE_HEADLINE, problems)
    raw, positions, problems = build(tree, file)
    if problems:
        raise KernccError(PARSE_HEADLINE, problems)
    deep = [Diagnostic(message, Location(ptr)) for ptr, message in value_problems(raw)]
    if deep:  # the builder keeps every value within JSON's depth limit but the document's own
        raise KernccError(PARSE_HEADLINE, deep).located(locator(positions, file))
    return raw, positions


def number_problems(tree: lark.Tree, file: str | None) -> list[Diagnostic]:
    """Numbers JSON refuses too (kerncc.manifest.jsonsource): a float past f64 (`1e400`), an integer
    with more digits than Python converts; each at its token."""
    limit = sys.get_int_max_str_digits() or None
    out = []
    for token in _tokens(tree):
        if token.type not in _NUMBERS:
            continue
        if token.type == "FLOAT":
            bad = not math.isfinite(float(token))
        else:
            bad = limit is not None and len(token.lstrip("-%#")) > limit
        if bad:
            out.append(Diagnostic(f"number out of range `{_clip(token)}`",
                                  Location("", file, token.line, token.column)))
    return out


_NUMBERS = frozenset({"INT", "FLOAT", "PARAM", "CALLNO"})


def _tokens(tree: lark.Tree):
    """Every token of the tree in text order, without recursion (expressions nest deep)."""
    stack: list = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, lark.Tree):
            stack.extend(reversed(node.children))
        elif isinstance(node, lark.Token):
            yield node


def _clip(text: str) -> str:
    return text if len(text) <= 24 else f"{text[:16]}... ({len(text)} characters)"

# ---------------------------------------------------------------------------- syntax errors


def _stop(err: lark.exceptions.UnexpectedInput, accepts: list[set[str]]) -> bool:
    """lark's error hook: note what the parser would have taken there, then stop.

    The exception's own `expected` is the LALR state's lookahead set, which merges the contexts
    of a shared state; `accepts()` tries each terminal and keeps only those that really fit.
    """
    interactive = getattr(err, "interactive_parser", None)
    if interactive is not None:
        accepts.append(interactive.accepts())
    return False


def syntax_diagnostic(err: lark.exceptions.UnexpectedInput, expected: set[str], text: str,
                      file: str | None) -> Diagnostic:
    """lark's error as a located diagnostic: what came, what was expected, line and caret."""
    token = getattr(err, "token", None)
    if isinstance(err, lark.exceptions.UnexpectedCharacters):
        what, width = f"unexpected character `{err.char}`", 1
    else:
        what, width = _describe_token(token), max(1, len(token or ""))
    line, col = _error_position(err, token, text)
    message = f"{what}; expected {describe_expected(expected)}"
    message += _excerpt(text, line, col, width)
    return Diagnostic(message, Location("", file, line, col))


def _describe_token(token: lark.Token | None) -> str:
    if token is None or token.type == "$END":
        return "unexpected end of input"
    if token.type in ("NAME", "STRING"):
        return f"unexpected name `{token}`"
    if token.type in ("INT", "FLOAT"):
        return f"unexpected number `{token}`"
    return f"unexpected '{token}'"


def _error_position(err: lark.exceptions.UnexpectedInput, token: lark.Token | None,
                    text: str) -> Position:
    at_end = token is not None and token.type == "$END"
    if at_end or getattr(err, "line", -1) in (None, -1):
        lines = text.rstrip().split("\n")
        return len(lines), len(lines[-1]) + 1
    return err.line, err.column


def describe_expected(names: set[str] | frozenset[str]) -> str:
    """lark terminal names in words: `a name, a number or '{'`."""
    patterns = {t.name: t.pattern.value for t in parser().terminals
                if isinstance(t.pattern, lark.lexer.PatternStr)}
    literals = {patterns[n] for n in names if n in patterns}
    words = [w for n, w in _TOKEN_WORDS.items() if n in names and n != "$END"]
    if literals & DECLARATIONS:
        words.append("a declaration")
    if literals & FLAGS:
        words.append("a flag")
    literals -= DECLARATIONS | FLAGS
    words = list(dict.fromkeys(words)) + [f"'{v}'" for v in sorted(literals)]
    if "$END" in names:
        words.append("end of input")
    if len(words) < 2:
        return words[0] if words else "nothing more"
    return ", ".join(words[:-1]) + " or " + words[-1]


def _excerpt(text: str, line: int, col: int, width: int) -> str:
    """The offending line and a caret under the offending text (tabs kept, so they align)."""
    lines = text.split("\n")
    source = lines[line - 1].rstrip("\r") if 0 < line <= len(lines) else ""
    pad = "".join("\t" if ch == "\t" else " " for ch in source[:col - 1])
    width = max(1, min(width, len(source) - col + 1))
    return f"\n{_EXCERPT_INDENT}{source}\n{_EXCERPT_INDENT}{pad}{'^' * width}"
