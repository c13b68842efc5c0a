r"""The `-p` pipeline spec: parsed into values that print back.

`parse_pipeline("cut{at=218,290},slice-derive")` gives a `PipelineSpec` of `PassSpec`s (names,
options, and the spans of the text they came from), which `str()` prints back to an equal
spec. Syntax errors are `KernccError`s with a caret under the text; resolving names and
options against the registry is kerncc.pipeline's job. The grammar (LALR(1)):

    pipeline: [pass ("," pass)*]
    pass: WORD [options]
    options: "{" [item ("," item)*] "}"
    item: WORD "=" [value]  -> keyed
        | value             -> extra
    value: WORD | STRING

    WORD: /[A-Za-z0-9_.\/:+@~-]+/      STRING: a JSON string      whitespace: /[ \t\f\r\n]+/

A comma separates both options and the items of one option's value list (`at=218,290`); one
token of lookahead cannot tell those apart, so the grammar keeps a flat list of items, each
`key=value` or one more value, and a bare item joins the option before it. `key=` with nothing
after it is the empty list. WORD is every unquoted name and value: pass names, option keys,
integers, true/false, labels (`l18.qkv_proj`) and paths (`/tmp/out`); printing reuses its
pattern to decide when a string needs quotes.

The parser is written out by hand (a state per position in the grammar) rather than built by
lark: building lark's tables took longer than the rest of resolving a spec, on every
`kerncc lower`. It reports what lark's LALR parser with its contextual lexer reported, word
for word: at a token the position does not take, the terminals it takes (`$END` only when the
input ends there); at a character no terminal matches, that character.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any, NamedTuple

import attrs

from kerncc.diagnostics import SOURCE_WINDOW, Diagnostic, KernccError, Location, source_window
from kerncc.passes.base import pass_options

INVALID_PIPELINE = "invalid pass pipeline:"


# The spec: option values, passes, pipelines, and their printed form.

Scalar = int | bool | str
Value = Scalar | tuple[Scalar, ...]
Span = tuple[int, int]  # [start, end) offsets into the spec text

_INT_WORD = re.compile(r"-?[0-9]+")


# The grammar's WORD terminal, so printing quotes exactly what parsing would not read bare.
_WORD = re.compile(r"[A-Za-z0-9_.\/:+@~-]+")


def _classify_word(word: str) -> Scalar:
    """A bare word's value: an integer, true/false, or the word itself."""
    if _INT_WORD.fullmatch(word):
        return int(word)
    if word in ("true", "false"):
        return word == "true"
    return word


def _format_scalar(value: Scalar) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if _WORD.fullmatch(value) and _classify_word(value) == value:
        return value
    return json.dumps(value, ensure_ascii=False)


def format_value(value: Value) -> str:
    """An option value as a spec writes it: `218`, `218,290`, `l18.qkv_proj`, `"a b"`."""
    if isinstance(value, tuple):
        return ",".join(_format_scalar(v) for v in value)
    return _format_scalar(value)


def _normalize_value(value: Value | list) -> Value:
    # One spelling per value, so that parse(str(spec)) == spec: a one-item list prints and
    # parses back as its item.
    if isinstance(value, (tuple, list)):
        items = tuple(value)
        return items[0] if len(items) == 1 else items
    return value


def _normalize_options(options: Iterable[tuple[str, Value]]) -> tuple[tuple[str, Value], ...]:
    return tuple((key, _normalize_value(value)) for key, value in options)


def _check_word(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not _WORD.fullmatch(value):
        raise ValueError(f"`{value}` cannot be a pass name or option key")


def _check_options(instance: object, attribute: attrs.Attribute, options: tuple) -> None:
    for key, value in options:
        _check_word(instance, attribute, key)
        for item in value if isinstance(value, tuple) else (value,):
            if not isinstance(item, (int, str)):
                raise TypeError(f"option `{key}`: {item!r} is not an int, bool or str")


@attrs.frozen
class PassSpec:
    """One pass of a spec as written: its name and options; spans locate them in the text."""

    name: str = attrs.field(validator=_check_word)
    options: tuple[tuple[str, Value], ...] = attrs.field(
        default=(), converter=_normalize_options, validator=_check_options)
    span: Span | None = attrs.field(default=None, eq=False)
    name_span: Span | None = attrs.field(default=None, eq=False)
    # Per option: (key span, value span).
    option_spans: tuple[tuple[Span, Span], ...] = attrs.field(default=(), eq=False)

    def __str__(self) -> str:
        if not self.options:
            return self.name
        body = ",".join(f"{key}={format_value(value)}" for key, value in self.options)
        return f"{self.name}{{{body}}}"


@attrs.frozen
class PipelineSpec:
    """A parsed pipeline: its passes in order, and the text it came from (None when built)."""

    passes: tuple[PassSpec, ...] = attrs.field(default=(), converter=tuple)
    source: str | None = attrs.field(default=None, eq=False)

    def __str__(self) -> str:
        return ",".join(str(p) for p in self.passes)


def pass_spec(pass_: Any) -> PassSpec:
    """A pass instance printed back: its name and the options that differ from the defaults."""
    options = []
    for info in pass_options(type(pass_)):
        value = getattr(pass_, info.field)
        # None is "not given" and has no spelling; it can only differ from a non-None default.
        if value != info.default and value is not None:
            options.append((info.key, value))
    return PassSpec(pass_.name, tuple(options))


# ---------------------------------------------------------------------------------------------
# Carets and parse errors.

def _position(text: str, offset: int) -> tuple[int, int, str]:
    """(line, column, the line's text) of an offset; both numbers 1-based."""
    start = text.rfind("\n", 0, offset) + 1
    end = text.find("\n", offset)
    line_text = text[start:] if end < 0 else text[start:end]
    return text.count("\n", 0, offset) + 1, offset - start + 1, line_text


def caret_diagnostic(text: str, span: Span, message: str) -> Diagnostic:
    """A diagnostic at `span` of a spec, its message followed by the line and a caret under it."""
    line, column, line_text = _position(text, span[0])
    width = max(1, min(span[1], span[0] + len(line_text) - column + 1) - span[0])
    # A long spec shows a window around the column, so that each diagnostic stays short.
    shown, at = source_window(line_text, column)
    width = min(width, len(shown) - at + 1, SOURCE_WINDOW)
    line_text, caret = shown, " " * (at - 1) + "^" + "~" * (max(1, width) - 1)
    return Diagnostic(f"{message}\n{line_text}\n{caret}",
                      Location("", "pipeline", line, column))


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    import difflib  # only when a name is wrong: not on every lowering's path

    match = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean `{match[0]}`?)" if match else ""


# What a parse error says it expected, in this order.
_TERMINAL_WORDS = {
    "WORD": "a name", "STRING": "a quoted string", "EQ": "`=`", "LBRACE": "`{`",
    "COMMA": "`,`", "RBRACE": "`}`", "$END": "the end of the pipeline",
}


def _expected(words: list[str]) -> str:
    if not words:
        return ""
    if len(words) == 1:
        return f" (expected {words[0]})"
    return f" (expected {', '.join(words[:-1])} or {words[-1]})"


def _invalid(text: str, span: Span, message: str) -> KernccError:
    return KernccError(INVALID_PIPELINE, [caret_diagnostic(text, span, message)])


# ---------------------------------------------------------------------------------------------
# Tokens: every terminal starts with a character no other one starts with, so the one that can
# match at a position is known from its first character.

class _Token(NamedTuple):
    type: str  # WORD, STRING, EQ, LBRACE, RBRACE, COMMA
    text: str
    start: int
    end: int


_TOKEN = re.compile("|".join((
    r"(?P<WS>[ \t\f\r\n]+)", f"(?P<WORD>{_WORD.pattern})", r'(?P<STRING>"(?:[^"\\]|\\.)*")',
    r"(?P<EQ>=)", r"(?P<LBRACE>\{)", r"(?P<RBRACE>\})", r"(?P<COMMA>,)")), re.DOTALL)
_END = "$END"


class _Tokens:
    """The tokens of a spec, one at a time, each checked against what its position takes."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def take(self, allowed: frozenset[str]) -> _Token | None:
        """The next token, whose type must be in `allowed` (`$END` in it: None at the end)."""
        found = self._next()
        if found is None:
            if _END not in allowed:
                raise _unexpected(self.text, None, allowed)
            return None
        if found.type not in allowed:
            # A terminal the position does not take: what it takes, but never the end (the
            # contextual lexer's words for it).
            raise _unexpected(self.text, found, allowed - {_END})
        return found

    def _next(self) -> _Token | None:
        while self.pos < len(self.text):
            match = _TOKEN.match(self.text, self.pos)
            if match is None:
                offset = self.pos
                char = self.text[offset]
                what = "unterminated string" if char == '"' else f"unexpected character `{char}`"
                raise _invalid(self.text, (offset, offset + 1), what)
            self.pos = match.end()
            if match.lastgroup != "WS":
                return _Token(match.lastgroup, match.group(), match.start(), match.end())
        return None


def _unexpected(text: str, token: _Token | None, expected: Iterable[str]) -> KernccError:
    if token is None:
        found, span = "end of the pipeline", (len(text), len(text) + 1)
    else:
        found, span = f"`{token.text}`", (token.start, token.end)
    words = [word for name, word in _TERMINAL_WORDS.items() if name in expected]
    return _invalid(text, span, f"unexpected {found}" + _expected(words))


# What each position of the grammar takes next.
_START = frozenset({"WORD", _END})                 # a pipeline's first pass, or nothing
_AFTER_NAME = frozenset({"LBRACE", "COMMA", _END})  # a pass's name: its options, or the next
_AFTER_LBRACE = frozenset({"WORD", "STRING", "RBRACE"})
_AFTER_ITEM_WORD = frozenset({"EQ", "COMMA", "RBRACE"})  # `key=`, or a bare value
_AFTER_EQ = frozenset({"WORD", "STRING", "COMMA", "RBRACE"})
_AFTER_VALUE = frozenset({"COMMA", "RBRACE"})
_AFTER_ITEM_COMMA = frozenset({"WORD", "STRING"})
_AFTER_OPTIONS = frozenset({"COMMA", _END})
_AFTER_PASS_COMMA = frozenset({"WORD"})


class _Item(NamedTuple):
    """One item inside braces: `key=value` (keyed; value None for `key=`) or a bare value."""

    key: _Token | None
    equals: _Token | None
    value: _Token | None


class _Pass(NamedTuple):
    name: _Token
    items: list[_Item]
    end: int  # the end of its last token: the name, or the closing brace


# ---------------------------------------------------------------------------------------------
# Parsing: text -> PipelineSpec.

def parse_pipeline(text: str) -> PipelineSpec:
    """Parse a pipeline spec; a syntax error raises KernccError with a caret."""
    # Syntax first, over the whole text; then values (a bad string, a bare first item), so a
    # syntax error anywhere is the one reported.
    passes = [_pass_spec(text, p) for p in _parse(_Tokens(text))]
    return PipelineSpec(tuple(passes), text)


def _parse(tokens: _Tokens) -> list[_Pass]:
    passes: list[_Pass] = []
    name = tokens.take(_START)
    while name is not None:
        token = tokens.take(_AFTER_NAME)
        items: list[_Item] = []
        end = name.end
        if token is not None and token.type == "LBRACE":
            items, end = _options(tokens)
            token = tokens.take(_AFTER_OPTIONS)
        passes.append(_Pass(name, items, end))
        name = None if token is None else tokens.take(_AFTER_PASS_COMMA)
    return passes


def _options(tokens: _Tokens) -> tuple[list[_Item], int]:
    """The items after `{`, through `}`; and the end of the `}`."""
    items: list[_Item] = []
    token = tokens.take(_AFTER_LBRACE)
    while token.type != "RBRACE":
        item, token = _item(tokens, token)
        items.append(item)
        if token.type == "COMMA":
            token = tokens.take(_AFTER_ITEM_COMMA)
    return items, token.end


def _item(tokens: _Tokens, first: _Token) -> tuple[_Item, _Token]:
    """The item starting at `first`, and the token after it (`,` or `}`)."""
    if first.type == "STRING":
        return _Item(None, None, first), tokens.take(_AFTER_VALUE)
    after = tokens.take(_AFTER_ITEM_WORD)
    if after.type != "EQ":
        return _Item(None, None, first), after
    value = tokens.take(_AFTER_EQ)
    if value.type in ("COMMA", "RBRACE"):  # `key=`: the empty list
        return _Item(first, after, None), value
    return _Item(first, after, value), tokens.take(_AFTER_VALUE)


def _pass_spec(text: str, p: _Pass) -> PassSpec:
    grouped = _group_items(text, p.items)
    return PassSpec(
        p.name.text, tuple((key, values) for key, values, _ in grouped),
        span=(p.name.start, p.end), name_span=(p.name.start, p.name.end),
        option_spans=tuple(spans for _, _, spans in grouped))


def _group_items(text: str, items: list[_Item]) -> list[tuple[str, list, tuple[Span, Span]]]:
    """Options from the flat item list: each bare item joins the option before it."""
    grouped: list[tuple[str, list, tuple[Span, Span]]] = []
    for item in items:
        if item.key is not None:
            grouped.append(_keyed_item(text, item))
            continue
        if not grouped:
            raise _invalid(text, (item.value.start, item.value.end), "expected `key=value`")
        key, values, (key_span, value_span) = grouped[-1]
        value, span = _value(text, item.value)
        start = value_span[0] if values else span[0]
        grouped[-1] = (key, values + [value], (key_span, (start, span[1])))
    return grouped


def _keyed_item(text: str, item: _Item) -> tuple[str, list, tuple[Span, Span]]:
    key, equals = item.key, item.equals
    key_span = (key.start, key.end)
    if item.value is None:  # `key=`: the empty list
        return key.text, [], (key_span, (equals.end, equals.end))
    value, value_span = _value(text, item.value)
    return key.text, [value], (key_span, value_span)


def _value(text: str, token: _Token) -> tuple[Scalar, Span]:
    span = (token.start, token.end)
    if token.type == "WORD":
        return _classify_word(token.text), span
    try:
        return json.loads(token.text, strict=False), span
    except json.JSONDecodeError as error:
        raise _invalid(text, span, f"bad string: {error.msg}") from None
