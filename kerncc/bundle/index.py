"""bundle.json's fields and their types (docs/bundle.md), checked in one place.

The runtime (`kerncc.runtime.bundle`), `kerncc check` and `kerncc report` all read bundle.json;
each used to check the fields it read, so a bundle one accepted another refused (an integer
`kerncc` passed check and failed report). `index_problems` is the one check they share: every
field docs/bundle.md gives, typed, every problem found (not only the first) as a JSON pointer
and a message.

Required are `format`, a non-empty `stages`, each stage's `dir` and every field of an edge;
every other field may be left out (a hand-written bundle may, and a sha256 not recorded is
not checked: docs/bundle.md), but when present it has its documented type.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import PurePosixPath
from typing import Any

from kerncc.bundle.format import TOKENIZER_FILES
from kerncc.diagnostics import pointer

Problem = tuple[str, str]  # (JSON pointer, message)

_WORDS = {dict: "an object", list: "a list", int: "an integer", str: "a string",
          bool: "a boolean", type(None): "null"}

# A type spec: a Python type (or a tuple of them), or one of the shapes below.
STR_OR_NULL = (str, type(None))


class ListOf:
    def __init__(self, item: Any) -> None:
        self.item = item


class MapOf(ListOf):
    """An object whose keys are names and whose values are all `item`."""


class Obj:
    """An object with known fields: `fields` name -> (spec, required). Unknown keys pass (a
    later kerncc may add fields)."""

    def __init__(self, **fields: tuple[Any, bool]) -> None:
        self.fields = fields


def _opt(spec: Any) -> tuple[Any, bool]:
    return spec, False


def _req(spec: Any) -> tuple[Any, bool]:
    return spec, True


STAGE = Obj(index=_opt(int), dir=_req(str), manifest_sha256=_opt(STR_OR_NULL),
            plan_sha256=_opt(STR_OR_NULL), stage_py_sha256=_opt(STR_OR_NULL),
            calls=_opt(MapOf(int)), host_inputs=_opt(ListOf(str)))
TOKENIZER_FILE = Obj(name=_req(str), bytes=_req(int), sha256=_req(str))
EDGE = Obj(**{"buffer": _req(str), "from": _req(int), "to": _req(int), "bytes": _req(int)})
INDEX = Obj(
    format=_req(str), kerncc=_opt(STR_OR_NULL), pipeline=_opt(str),
    input=_opt((Obj(path=_opt(STR_OR_NULL), sha256=_opt(STR_OR_NULL)), type(None))),
    checkpoint=_opt(STR_OR_NULL),
    checkpoint_identity=_opt((Obj(bytes=_req(int), header_sha256=_req(str)), type(None))),
    tokenizer=_opt((ListOf(TOKENIZER_FILE), type(None))),
    cut=_opt((Obj(id=_opt(str), points=_opt(MapOf(ListOf(int)))), type(None))),
    stages=_req(ListOf(STAGE)), edges=_opt(ListOf(EDGE)),
    proof=_opt(Obj(checked=_req(bool), programs=_opt(ListOf(str)), outputs=_opt(int),
                   carries=_opt(int), state_regions=_opt(int))))


def index_problems(index: Any) -> list[Problem]:
    """Every way `index` (bundle.json, parsed) departs from docs/bundle.md's fields."""
    problems = list(_check(index, INDEX, ""))
    stages = index.get("stages") if isinstance(index, dict) else None
    if isinstance(stages, list):
        if not stages:
            problems.append(("/stages", "a bundle has at least one stage"))
        for k, entry in enumerate(stages):
            folder = entry.get("dir") if isinstance(entry, dict) else None
            if isinstance(folder, str) and not _inside(folder):
                problems.append((f"/stages/{k}/dir", f"stage directory `{folder}` is not "
                                 "inside the bundle"))
    problems += _tokenizer_problems(index.get("tokenizer") if isinstance(index, dict) else None)
    return problems


def _tokenizer_problems(files: Any) -> list[Problem]:
    """A recorded tokenizer file is one of the names the codec reads, each named once: the
    record names which files are looked at, never a path."""
    problems, seen = [], set()
    for k, entry in enumerate(files if isinstance(files, list) else ()):
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str):
            continue
        if name not in TOKENIZER_FILES or name in seen:
            word = "is recorded twice" if name in seen else "is not a tokenizer file kerncc reads"
            problems.append((f"/tokenizer/{k}/name", f"`{name[:80]}` {word} (one of "
                             f"{', '.join(TOKENIZER_FILES)})"))
        seen.add(name)
    return problems


def _inside(folder: str) -> bool:
    path = PurePosixPath(folder.replace("\\", "/"))
    return bool(folder) and not path.is_absolute() and ".." not in path.parts


def _check(value: Any, spec: Any, ptr: str) -> Iterator[Problem]:
    if isinstance(spec, tuple) and any(isinstance(s, (Obj, ListOf)) for s in spec):
        # a shape or a plain type (`cut`: an object or null): the first that fits
        plain = tuple(s for s in spec if isinstance(s, type))
        if _fits(value, plain):
            return
        shape = next(s for s in spec if not isinstance(s, type))
        yield from _check(value, shape, ptr)
        return
    if isinstance(spec, Obj):
        if not isinstance(value, dict):
            yield ptr, f"expected an object, found {_json_type(value)}"
            return
        for name, (field, required) in spec.fields.items():
            if name in value:
                yield from _check(value[name], field, ptr + pointer(name))
            elif required:
                yield ptr + pointer(name), f"the required field `{name}` is missing"
        return
    if isinstance(spec, ListOf):  # or a MapOf
        kind = dict if isinstance(spec, MapOf) else list
        if not isinstance(value, kind):
            yield ptr, f"expected {_WORDS[kind]}, found {_json_type(value)}"
            return
        for key, item in value.items() if kind is dict else enumerate(value):
            yield from _check(item, spec.item, ptr + pointer(key))
        return
    kinds = spec if isinstance(spec, tuple) else (spec,)
    if not _fits(value, kinds):
        yield ptr, f"expected {' or '.join(_WORDS[k] for k in kinds)}, found {_json_type(value)}"


def _fits(value: Any, kinds: tuple[type, ...]) -> bool:
    """`value` is one of `kinds` (a boolean is no integer, as in JSON)."""
    if isinstance(value, bool):
        return bool in kinds
    return isinstance(value, kinds)


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    return next((word for k, word in _WORDS.items() if isinstance(value, k)), "a number")
