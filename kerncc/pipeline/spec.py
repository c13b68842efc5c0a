"""The `-p` pipeline spec: its grammar's parse tree turned into values that print back.

`parse_pipeline("cut{at=218,290},slice-derive")` gives a `PipelineSpec` of `PassSpec`s (names,
options, and the spans of the text they came from), which `str()` prints back to an equal
spec. Syntax errors are `KernccError`s with a caret under the text (grammar/pipeline.lark);
resolving names and options against the registry is kerncc.pipeline's job.
"""

from __future__ import annotations

import difflib
import functools
import importlib.resources
import json
import re
from collections.abc import Iterable
from typing import Any

import attrs
import lark

from kerncc.diagnostics import SOURCE_WINDOW, Diagnostic, KernccError, Location, source_window
from kerncc.passes import pass_options

INVALID_PIPELINE = "invalid pass pipeline:"


# The spec: option values, passes, pipelines, and their printed form.

Scalar = int | bool | str
Value = Scalar | tuple[Scalar, ...]
Span = tuple[int, int]  # [start, end) offsets into the spec text

_INT_WORD = re.compile(r"-?[0-9]+")


@functools.cache
def _parser() -> lark.Lark:
    grammar = (importlib.resources.files("kerncc.grammar") / "pipeline.lark").read_text()
    return lark.Lark(grammar, start="pipeline", parser="lalr", propagate_positions=True,
                     maybe_placeholders=True)


@functools.cache
def _word_pattern() -> re.Pattern[str]:
    # The grammar's WORD terminal, so printing quotes exactly what parsing would not read bare.
    return re.compile(_parser().get_terminal("WORD").pattern.to_regexp())


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
    if _word_pattern().fullmatch(value) and _classify_word(value) == value:
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
    if not _word_pattern().fullmatch(value):
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
    match = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean `{match[0]}`?)" if match else ""


# What a parse error says it expected, in this order.
_TERMINAL_WORDS = {
    "WORD": "a name", "STRING": "a quoted string", "EQ": "`=`", "LBRACE": "`{`",
    "COMMA": "`,`", "RBRACE": "`}`", "$END": "the end of the pipeline",
}


def _syntax_error(text: str, error: lark.exceptions.UnexpectedInput) -> KernccError:
    if isinstance(error, lark.exceptions.UnexpectedCharacters):
        offset = error.pos_in_stream
        char = text[offset]
        what = "unterminated string" if char == '"' else f"unexpected character `{char}`"
        return _invalid(text, (offset, offset + 1), what)
    token = getattr(error, "token", None)
    if token is None or token.type == "$END":
        found, span = "end of the pipeline", (len(text), len(text) + 1)
    else:
        found, span = f"`{token}`", (token.start_pos, token.end_pos)
    expected = [word for name, word in _TERMINAL_WORDS.items()
                if name in getattr(error, "expected", ())]
    return _invalid(text, span, f"unexpected {found}" + _expected(expected))


def _expected(words: list[str]) -> str:
    if not words:
        return ""
    if len(words) == 1:
        return f" (expected {words[0]})"
    return f" (expected {', '.join(words[:-1])} or {words[-1]})"


def _invalid(text: str, span: Span, message: str) -> KernccError:
    return KernccError(INVALID_PIPELINE, [caret_diagnostic(text, span, message)])


# ---------------------------------------------------------------------------------------------
# Parsing: text -> PipelineSpec.

def parse_pipeline(text: str) -> PipelineSpec:
    """Parse a pipeline spec; a syntax error raises KernccError with a caret."""
    try:
        tree = _parser().parse(text)
    except lark.exceptions.UnexpectedInput as error:
        raise _syntax_error(text, error) from None
    passes = [_pass_from_tree(text, node) for node in tree.children if node is not None]
    return PipelineSpec(tuple(passes), text)


def _pass_from_tree(text: str, node: lark.Tree) -> PassSpec:
    name, options = node.children
    items = [] if options is None else [i for i in options.children if i is not None]
    grouped = _group_items(text, items)
    return PassSpec(
        str(name), tuple((key, values) for key, values, _ in grouped),
        span=(node.meta.start_pos, node.meta.end_pos),
        name_span=(name.start_pos, name.end_pos),
        option_spans=tuple(spans for _, _, spans in grouped))


def _group_items(text: str, items: list[lark.Tree]) -> list[tuple[str, list, tuple[Span, Span]]]:
    """Options from the flat item list: each bare item joins the option before it."""
    grouped: list[tuple[str, list, tuple[Span, Span]]] = []
    for item in items:
        if item.data == "keyed":
            grouped.append(_keyed_item(text, item))
            continue
        if not grouped:
            raise _item_error(text, item, "expected `key=value`")
        key, values, (key_span, value_span) = grouped[-1]
        value, span = _value(text, item.children[0])
        start = value_span[0] if values else span[0]
        grouped[-1] = (key, values + [value], (key_span, (start, span[1])))
    return grouped


def _keyed_item(text: str, item: lark.Tree) -> tuple[str, list, tuple[Span, Span]]:
    key, equals, value_node = item.children
    key_span = (key.start_pos, key.end_pos)
    if value_node is None:  # `key=`: the empty list
        return str(key), [], (key_span, (equals.end_pos, equals.end_pos))
    value, value_span = _value(text, value_node)
    return str(key), [value], (key_span, value_span)


def _value(text: str, node: lark.Tree) -> tuple[Scalar, Span]:
    token = node.children[0]
    span = (token.start_pos, token.end_pos)
    if token.type == "WORD":
        return _classify_word(str(token)), span
    try:
        return json.loads(str(token), strict=False), span
    except json.JSONDecodeError as error:
        raise _invalid(text, span, f"bad string: {error.msg}") from None


def _item_error(text: str, item: lark.Tree, message: str) -> KernccError:
    token = item.children[0].children[0]
    return _invalid(text, (token.start_pos, token.end_pos), message)


