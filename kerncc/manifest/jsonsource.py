"""Strict JSON text: parse like serde_json does, and map JSON pointers back to line:col.

Python's `json` keeps the last of duplicate keys and accepts `NaN`; kern's parser refuses both.
`parse_json` uses the fast C decoder and flags duplicates through `object_pairs_hook`; numbers
serde_json refuses (`NaN`, `1e400`, integers past Python's digit limit) stay in the value as
markers, so that each is reported at its JSON pointer like a duplicate. Only when a
diagnostic needs a file position does `PositionIndex` scan the text once (a small
position-tracking scanner) to map every JSON pointer to its line and column.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import attrs

from kerncc.diagnostics import Diagnostic, KernccError, Location, pointer

PARSE_HEADLINE = "manifest failed to parse:"
MAX_DEPTH = 128  # serde_json's recursion limit: kern refuses documents nested deeper
TOO_DEEP = f"recursion limit exceeded (nested deeper than {MAX_DEPTH})"


class _DuplicateKeys(dict):
    """A dict that remembers the keys it saw twice (kern refuses them)."""

    duplicates: list[str]


def _pairs_hook(pairs: list[tuple[str, Any]]) -> dict:
    out = _DuplicateKeys(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        out.duplicates = [k for k, _ in pairs if k in seen or seen.add(k)]  # type: ignore[func-returns-value]
    return out


@attrs.frozen
class _Refused:
    """A number serde_json refuses, left in place so that the error can point at it."""

    message: str


def _reject_constant(name: str) -> _Refused:
    return _Refused(f"`{name}` is not JSON")


def _finite_float(text: str) -> float | _Refused:
    value = float(text)
    if not math.isfinite(value):
        return _Refused(f"number out of range `{text}`")
    return value


def _integer(text: str) -> int | _Refused:
    try:
        return int(text)
    except ValueError:  # more digits than Python converts (sys.set_int_max_str_digits)
        return _Refused(f"number out of range `{text[:16]}...` ({len(text)} digits)")


def parse_json(text: str, file: str | None = None) -> Any:
    """Decode strict JSON; raise KernccError (with line:col) for anything serde_json refuses."""
    try:
        value = json.loads(text, object_pairs_hook=_pairs_hook, parse_constant=_reject_constant,
                           parse_float=_finite_float, parse_int=_integer)
    except json.JSONDecodeError as err:
        loc = Location("", file, err.lineno, err.colno)
        raise KernccError(PARSE_HEADLINE, [Diagnostic(err.msg, loc)]) from None
    except RecursionError:
        raise KernccError(PARSE_HEADLINE, [Diagnostic(TOO_DEEP, _deepest(text, file))]) from None
    problems = list(value_problems(value))
    if problems:
        diags = [Diagnostic(message, Location(ptr)) for ptr, message in problems]
        raise KernccError(PARSE_HEADLINE, diags).located(PositionIndex.locator(text, file))
    return value


def value_problems(value: Any):
    """(pointer, message) for every duplicated key, refused number and string holding a lone
    surrogate (`"\\ud800"`: not text, so nothing can write it out), and for the first object
    or array nested deeper than MAX_DEPTH (whose contents are not looked at). Everything after
    parsing (the typed reader, printers, expression evaluation) recurses over nested values;
    bounding the depth here, as serde_json does, bounds theirs."""
    stack: list[tuple[Any, str, int]] = [(value, "", 1)]
    deep_seen = False
    while stack:
        node, where, depth = stack.pop()
        if isinstance(node, _Refused):
            yield where, node.message
        if isinstance(node, str) and _SURROGATE.search(node):
            yield where, _lone_surrogate(node)
        if not isinstance(node, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            if not deep_seen:
                yield where, TOO_DEEP
            deep_seen = True
            continue
        for key in getattr(node, "duplicates", ()):
            yield where + pointer(key), f"duplicate name `{key}`"  # located at its last use
        for key in node if isinstance(node, dict) else ():
            if _SURROGATE.search(key):
                yield where + pointer(key), _lone_surrogate(key)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        stack.extend((v, where + pointer(k), depth + 1) for k, v in items)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(text: str) -> str:
    char = _SURROGATE.search(text).group()  # type: ignore[union-attr]
    return f"lone surrogate `\\u{ord(char):04x}` in a string (serde_json refuses it)"


def _deepest(text: str, file: str | None) -> Location:
    """Where the nesting is deepest (the first bracket at the greatest depth), strings skipped."""
    depth = best = best_at = 0
    for match in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[{]|[\]}]', text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > best:
                best, best_at = depth, match.start()
        elif token in "]}":
            depth -= 1
    line_start = text.rfind("\n", 0, best_at) + 1
    return Location("", file, text.count("\n", 0, best_at) + 1, best_at - line_start + 1)


_WS = re.compile(r"[ \t\n\r]*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_SCALAR = re.compile(r"-?[0-9][0-9.eE+-]*|true|false|null|NaN|-?Infinity")


@attrs.define
class PositionIndex:
    """JSON pointer -> (line, column) of the value (and of each object key) in one text."""

    text: str
    positions: dict[str, int] = attrs.field(factory=dict)
    key_positions: dict[str, int] = attrs.field(factory=dict)
    _line_starts: list[int] = attrs.field(factory=list)

    @classmethod
    def build(cls, text: str) -> PositionIndex:
        index = cls(text)
        index._line_starts = [0] + [m.end() for m in re.finditer("\n", text)]
        try:
            index._value(0, "")
        except (IndexError, ValueError, RecursionError):
            pass  # a broken text still maps the part before the break
        return index

    @classmethod
    def locator(cls, text: str, file: str | None):
        index: list[PositionIndex] = []

        def locate(ptr: str) -> Location:
            if not index:
                index.append(cls.build(text))
            return index[0].location(ptr, file)
        return locate

    def location(self, ptr: str, file: str | None = None) -> Location:
        """The position of the deepest prefix of `ptr` that exists (missing keys point at their object)."""
        probe = ptr
        while probe and probe not in self.positions:
            probe = probe.rsplit("/", 1)[0]
        offset = self.key_positions.get(probe, self.positions.get(probe, 0))
        line, col = self.line_col(offset)
        return Location(ptr, file, line, col)

    def line_col(self, offset: int) -> tuple[int, int]:
        lo, hi = 0, len(self._line_starts) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._line_starts[mid] <= offset:
                lo = mid
            else:
                hi = mid - 1
        return lo + 1, offset - self._line_starts[lo] + 1

    def _skip(self, i: int) -> int:
        return _WS.match(self.text, i).end()

    def _value(self, i: int, ptr: str) -> int:
        i = self._skip(i)
        self.positions[ptr] = i
        ch = self.text[i]
        if ch == "{":
            return self._object(i + 1, ptr)
        if ch == "[":
            return self._array(i + 1, ptr)
        match = (_STRING if ch == '"' else _SCALAR).match(self.text, i)
        if match is None:
            raise ValueError(i)
        return match.end()

    def _object(self, i: int, ptr: str) -> int:
        i = self._skip(i)
        if self.text[i] == "}":
            return i + 1
        while True:
            i = self._skip(i)
            match = _STRING.match(self.text, i)
            if match is None:
                raise ValueError(i)
            child = ptr + pointer(json.loads(match.group()))
            # A repeated key maps to its last use: the value a dict keeps, and the one a
            # `duplicate name` error points at (a text with one parses no further).
            self.key_positions[child] = i
            i = self._skip(match.end())
            i = self._value(i + 1, child)  # past the ':'
            i = self._skip(i)
            if self.text[i] == "}":
                return i + 1
            i += 1  # the ','

    def _array(self, i: int, ptr: str) -> int:
        i = self._skip(i)
        if self.text[i] == "]":
            return i + 1
        index = 0
        while True:
            i = self._skip(self._value(i, ptr + pointer(index)))
            index += 1
            if self.text[i] == "]":
                return i + 1
            i += 1
