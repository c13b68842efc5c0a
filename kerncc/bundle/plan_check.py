"""plan.json checked against its stage's manifest before anything is allocated (docs/bundle.md).

The loader (`kerncc.runtime.bundle`) hands memory, staging and launch parsing a plan whose
containers have the types they index and whose contents agree with the manifest: `memory` is
exactly what the manifest gives (kerncc.bundle.plan.memory_json), the arena holds every
program's workspaces, each staging window lies inside the staging and holds its source, and
the launch records are exactly the ones the manifest and the arena's offsets give
(kerncc.bundle.plan.program_records), so that kerncc.runtime.launch parses what emit wrote.
"""

from __future__ import annotations

import json
from typing import Any

from kerncc import manifest as m
from kerncc.bundle.plan import memory_json, program_records
from kerncc.diagnostics import escape_pointer_token, pointer, split_pointer


class MalformedPlan(Exception):
    """What is wrong with plan.json, and where (a JSON pointer into it)."""

    def __init__(self, message: str, ptr: str) -> None:
        super().__init__(message)
        self.ptr = ptr


def check_plan(plan: Any, man: m.Manifest) -> None:
    """Raise MalformedPlan at the first part of `plan` the runtime could not use as it is
    (the runtime's loader, `kerncc check` and `kerncc report` all ask this)."""
    _check_shape(plan)
    if set(plan["programs"]) != set(man.programs):
        raise MalformedPlan(f"plans programs {sorted(plan['programs'])}, but manifest.json has "
                            f"{sorted(man.programs)}", "/programs")
    _check_memory(plan, man)
    _check_arena(plan)
    _check_staging(plan, man)
    _check_programs(plan, man)


_TYPE_WORDS = {dict: "an object", list: "a list", str: "a string", int: "an integer"}


def _typed(value: Any, kind: type, ptr: str) -> Any:
    if isinstance(value, kind) and not isinstance(value, bool):
        return value
    raise MalformedPlan(f"expected {_TYPE_WORDS[kind]}, found {_short(value)}", ptr)


def _count(value: Any, ptr: str) -> int:
    if _typed(value, int, ptr) < 0:
        raise MalformedPlan(f"expected a byte count or index, found {value}", ptr)
    return value


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_shape(plan: Any) -> None:
    """The containers and counts docs/bundle.md gives plan.json, whoever reads them."""
    _typed(plan, dict, "")
    for key in ("arena", "memory", "programs"):
        if key not in plan:
            raise MalformedPlan(f"the required field `{key}` is missing", f"/{key}")
        _typed(plan[key], dict, f"/{key}")
    for name, record in _typed(plan["arena"].get("programs", {}), dict,
                               "/arena/programs").items():
        ptr = pointer("arena", "programs", name)
        for key in ("bytes", "lower_bound", "naive"):
            _count(_typed(record, dict, ptr).get(key), f"{ptr}/{key}")
    if "staging" in plan:
        staging = _typed(plan["staging"], dict, "/staging")
        for key in ("total", "derived_bytes", "widest_live", "peak"):
            _count(staging.get(key, 0), f"/staging/{key}")
    for sha, module in _typed(plan.get("modules", {}), dict, "/modules").items():
        ptr = pointer("modules", sha)
        for i, name in enumerate(_typed(_typed(module, dict, ptr).get("names", []), list,
                                        f"{ptr}/names")):
            _typed(name, str, f"{ptr}/names/{i}")
        for key in ("source", "file"):
            if module.get(key) is not None:
                _typed(module[key], str, f"{ptr}/{key}")


def _check_memory(plan: dict, man: m.Manifest) -> None:
    """Every buffer and state record is the one manifest.json gives."""
    expected = memory_json(man)
    for section in ("buffers", "states"):
        found = _typed(plan["memory"].get(section, {}), dict, f"/memory/{section}")
        for name in sorted(set(found) | set(expected[section])):
            want = expected[section].get(name)
            if found.get(name) != want:
                raise MalformedPlan(f"{section[:-1]} `{name}` is {_short(found.get(name))}, "
                                    f"but manifest.json gives {_short(want)}",
                                    pointer("memory", section, name))


def _check_arena(plan: dict) -> None:
    """The arena is as large as the largest program's workspaces; offsets lie inside them."""
    arena = plan["arena"]
    total = _count(arena.get("bytes", 0), "/arena/bytes")
    programs = _typed(arena.get("programs", {}), dict, "/arena/programs")
    for name, record in programs.items():
        ptr = pointer("arena", "programs", name)
        need = _count(_typed(record, dict, ptr).get("bytes", 0), f"{ptr}/bytes")
        if need > total:
            raise MalformedPlan(f"program `{name}` needs {need} arena bytes; the arena has "
                                f"{total}", f"{ptr}/bytes")
        for key, offset in _typed(record.get("offsets", {}), dict, f"{ptr}/offsets").items():
            if _count(offset, pointer("arena", "programs", name, "offsets", key)) > need:
                raise MalformedPlan(f"`{key}` starts at byte {offset} of the program's {need}",
                                    pointer("arena", "programs", name, "offsets", key))


def _check_staging(plan: dict, man: m.Manifest) -> None:
    """Each window holds a source buffer of the manifest, inside the staging allocation."""
    if "staging" not in plan:
        return
    staging = _typed(plan["staging"], dict, "/staging")
    total = _count(staging.get("total", 0), "/staging/total")
    for i, window in enumerate(_typed(staging.get("windows", []), list, "/staging/windows")):
        ptr = f"/staging/windows/{i}"
        source = _typed(_typed(window, dict, ptr).get("source"), str, f"{ptr}/source")
        buf = man.buffers.get(source)
        if buf is None or buf.kind != "source":
            raise MalformedPlan(f"`{source}` is not a source buffer of manifest.json",
                                f"{ptr}/source")
        first, last, nbytes, offset = (_count(window.get(k), f"{ptr}/{k}")
                                       for k in ("first", "last", "bytes", "offset"))
        if nbytes != buf.nbytes(man.vars_max()) or first > last:
            raise MalformedPlan(f"window of `{source}`: bytes {nbytes} (the buffer has "
                                f"{buf.nbytes(man.vars_max())}), calls {first}..{last}", ptr)
        if offset + nbytes > total:
            raise MalformedPlan(f"window of `{source}` ends at byte {offset + nbytes} of the "
                                f"staging's {total}", ptr)


def _check_programs(plan: dict, man: m.Manifest) -> None:
    """The launch records are the ones the manifest and the arena's offsets give."""
    offsets = {name: record.get("offsets", {})
               for name, record in plan["arena"].get("programs", {}).items()}
    try:
        expected = json.loads(json.dumps(program_records(man, offsets)))
    except KeyError as err:
        raise MalformedPlan(f"the arena places no `{err.args[0]}`", "/arena/programs") from None
    for name in sorted(set(plan["programs"]) | set(expected), key=str.encode):
        ptr = _first_difference(plan["programs"].get(name), expected.get(name),
                                pointer("programs", name))
        if ptr is not None:
            raise MalformedPlan(_difference(plan["programs"], expected, ptr), ptr)


def _difference(found: dict, expected: dict, ptr: str) -> str:
    """What differs at `ptr`, the launch named as the runtime names it."""
    tokens = split_pointer(ptr)[1:]
    where = "the value"
    if len(tokens) >= 5 and tokens[1] == "calls" and tokens[3] == "launches":
        call = expected[tokens[0]]["calls"][int(tokens[2])]
        what = " ".join(f"`{t}`" for t in tokens[5:]) or "the record"
        where = (f"program `{tokens[0]}` call {tokens[2]} (`{call['label']}`, op `{call['op']}`)"
                 f" launch {tokens[4]}: {what}")
    return (f"{where} is {_short(_at(found, tokens))}, but manifest.json and the arena give "
            f"{_short(_at(expected, tokens))}")


def _at(value: Any, tokens: list[str]) -> Any:
    for token in tokens:
        if isinstance(value, list) and token.isdigit() and int(token) < len(value):
            value = value[int(token)]
        elif isinstance(value, dict) and token in value:
            value = value[token]
        else:
            return None
    return value


def _first_difference(found: Any, expected: Any, ptr: str) -> str | None:
    """The pointer of the first place where `found` differs from `expected`, if any."""
    if found == expected:
        return None
    dicts = isinstance(found, dict) and isinstance(expected, dict)
    lists = isinstance(found, list) and isinstance(expected, list)
    if not (dicts and set(found) == set(expected) or lists and len(found) == len(expected)):
        return ptr
    keys = list(found) if isinstance(found, dict) else list(range(len(found)))
    for key in keys:
        deeper = _first_difference(found[key], expected[key],
                                   f"{ptr}/{escape_pointer_token(key)}")
        if deeper is not None:
            return deeper
    return ptr
