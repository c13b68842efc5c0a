"""Mutations of valid inputs, drawn by hypothesis: bytes, tokens, and JSON values at pointers.

Byte mutations (`mutate_bytes`) flip, overwrite, insert, delete, splice and truncate. Token
mutations (`mutate_tokens`) delete, repeat, swap and replace the tokens of a text (kir, pipeline
specs) so that most results still lex. JSON mutations (`mutate_json`) pick a node by its JSON
pointer and replace it (wrong types, huge or negative numbers, names taken from elsewhere in the
document, other subtrees), delete it, add or rename fields, repeat a key, or splice in raw text
JSON cannot hold as a Python value (`NaN`, `1e400`, 5000-digit integers, deep nesting). `dumps`
writes the result, with repeated keys and raw splices, indented or compact.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import attrs
from hypothesis import strategies as st

Path_ = tuple[str | int, ...]

INTERESTING_INTS = (0, 1, -1, 2, 3, 4, 7, 8, 16, 255, 256, 65535, 65536, 2**31 - 1, 2**31,
                    2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -2**31 - 1,
                    -2**63, -2**63 - 1, 10**30, -10**30)
SPECIAL_STRINGS = ("", " ", "tokens", "seqs", "rows", "groups", "in buffer<bf16>", "out state",
                   "inout buffer<f32>", "bytes<0>", "bytes<16>", "bytes<99999999999999999999>",
                   "i32", "bf16", "extern:x", "a/b", "~1", "%0", "#0", "\n", "\t", "\u0000",
                   "名前", "\u200b", "\ud800", "x" * 300, "buffer<", '"', "\\", "weight", "carry",
                   "workspace", "input", "output", "inout", "source", "token", "position",
                   "ceil_div", "mul", "add", "state", "buf", "offset", "label", "{", "}")
RAW_TOKENS = ("NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1" * 5000, "-0", "0.0",
              "1E2", "1e-400", "00", "[" * 400 + "]" * 400, "[" * 5000 + "]" * 5000,
              '{"a":' * 3000 + "0" + "}" * 3000, '"\\ud800"', '"\\udfff\\ud800"', '"\\u0000"')


@attrs.frozen
class Raw:
    """Text written into the JSON as it is: values a Python object cannot stand for."""

    text: str


@attrs.frozen
class Pairs:
    """A JSON object written with these (key, value) pairs, repeats allowed."""

    items: tuple[tuple[str, Any], ...]


# ------------------------------------------------------------------------------ writing

def dumps(value: Any, indent: int | None = 2) -> str:
    """JSON text of `value`, where `Raw` and `Pairs` may appear at any depth."""
    return "".join(_chunks(value, indent, 0))


def _chunks(value: Any, indent: int | None, depth: int):
    if isinstance(value, Raw):
        yield value.text
    elif isinstance(value, (dict, Pairs)):
        items = value.items if isinstance(value, Pairs) else tuple(value.items())
        yield from _container("{", "}", [(json.dumps(k), v) for k, v in items], indent, depth)
    elif isinstance(value, list):
        yield from _container("[", "]", [(None, v) for v in value], indent, depth)
    else:
        yield json.dumps(value)


def _container(open_: str, close: str, items: list, indent: int | None, depth: int):
    if not items:
        yield open_ + close
        return
    pad = "" if indent is None else "\n" + " " * (indent * (depth + 1))
    yield open_
    for i, (key, item) in enumerate(items):
        yield ("," if i else "") + pad
        if key is not None:
            yield key + (": " if indent is not None else ":")
        yield from _chunks(item, indent, depth + 1)
    yield "" if indent is None else "\n" + " " * (indent * depth)
    yield close


# ------------------------------------------------------------------------------ pointers

def node_paths(doc: Any) -> list[Path_]:
    """The path (tuple of keys and indices) of every node, the root first."""
    out: list[Path_] = []
    stack: list[tuple[Any, Path_]] = [(doc, ())]
    while stack:
        node, path = stack.pop()
        out.append(path)
        if isinstance(node, dict):
            stack.extend((v, path + (k,)) for k, v in reversed(list(node.items())))
        elif isinstance(node, list):
            stack.extend((v, path + (i,)) for i, v in reversed(list(enumerate(node))))
    return out


def strings_of(doc: Any) -> list[str]:
    """Every key and string value of the document: names to put where other names were."""
    found: set[str] = set()
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            found.update(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str):
            found.add(node)
    return sorted(found)


def get_at(doc: Any, path: Path_) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _set_at(doc: Any, path: Path_, value: Any) -> Any:
    if not path:
        return value
    get_at(doc, path[:-1])[path[-1]] = value
    return doc


# ------------------------------------------------------------------------------ values

def weird_values(names: list[str]) -> st.SearchStrategy[Any]:
    """Values to put anywhere: wrong types, edge numbers, other names, raw JSON text."""
    scalars = st.one_of(st.sampled_from(INTERESTING_INTS), st.integers(),
                        st.floats(allow_nan=False, allow_infinity=False), st.booleans(),
                        st.none(), st.text(max_size=8), st.sampled_from(SPECIAL_STRINGS))
    named = st.sampled_from(names) if names else st.just("x")
    return st.one_of(
        scalars, named, named, st.builds(Raw, st.sampled_from(RAW_TOKENS)),
        st.lists(st.one_of(scalars, named), max_size=4),
        st.dictionaries(st.one_of(named, st.text(max_size=4)), st.one_of(scalars, named),
                        max_size=3))


def _tweak_number(value: float, data: st.DataObject) -> Any:
    how = data.draw(st.sampled_from(("plus", "times", "negate", "float", "string", "edge")))
    if how == "plus":
        return value + data.draw(st.sampled_from((-1, 1, 2, 1000, 2**32)))
    if how == "times":
        return value * data.draw(st.sampled_from((0, 2, 1 << 20, 10**20)))
    if how == "negate":
        return -value
    if how == "float":
        return float(value) + data.draw(st.sampled_from((0.0, 0.5)))
    if how == "string":
        return str(value)
    return data.draw(st.sampled_from(INTERESTING_INTS))


def _deep_expr(depth: int, op: str) -> Raw:
    """`{"add": [{"add": [... "tokens" ..., 1]}, 1]}`, as text (too deep to build as a value)."""
    return Raw(f'{{"{op}": [' * depth + '"tokens"' + ", 2]}" * depth)


# ------------------------------------------------------------------------------ JSON mutations

JSON_MUTATIONS = ("replace", "delete", "add_key", "rename_key", "graft", "swap_name", "tweak",
                  "wrap", "duplicate_key", "deep_expr", "raw")


def mutate_json(doc: Any, data: st.DataObject, count: int | None = None) -> Any:
    """`doc` after 1-3 drawn mutations (a copy; `doc` itself is not touched)."""
    doc = copy.deepcopy(doc)
    names = strings_of(doc)
    for _ in range(count or data.draw(st.integers(1, 3), label="mutations")):
        paths = node_paths(doc)
        path = data.draw(st.sampled_from(paths), label="at")
        kind = data.draw(st.sampled_from(JSON_MUTATIONS), label="mutation")
        doc = _apply(doc, path, kind, names, paths, data)
    return doc


def _apply(doc: Any, path: Path_, kind: str, names: list[str], paths: list[Path_],
           data: st.DataObject) -> Any:
    node = get_at(doc, path)
    if kind == "replace":
        return _set_at(doc, path, data.draw(weird_values(names), label="value"))
    if kind == "delete" and path:
        parent = get_at(doc, path[:-1])
        del parent[path[-1]]
        return doc
    if kind == "add_key" and isinstance(node, dict):
        key = data.draw(st.one_of(st.sampled_from(names or ["x"]), st.text(max_size=6)))
        node[key] = data.draw(weird_values(names))
        return doc
    if kind == "rename_key" and path and isinstance(get_at(doc, path[:-1]), dict):
        parent = get_at(doc, path[:-1])
        new = data.draw(st.one_of(st.sampled_from(names or ["x"]), st.text(max_size=6)))
        parent[new] = parent.pop(path[-1])
        return doc
    if kind == "graft":
        other = data.draw(st.sampled_from(paths), label="from")
        return _set_at(doc, path, copy.deepcopy(get_at(doc, other)))
    if kind == "swap_name" and isinstance(node, str):
        return _set_at(doc, path, data.draw(st.sampled_from(names or ["x"])))
    if kind == "tweak" and isinstance(node, (int, float)) and not isinstance(node, bool):
        return _set_at(doc, path, _tweak_number(node, data))
    if kind == "wrap":
        return _set_at(doc, path, data.draw(st.sampled_from(([node], {"x": node}))))
    if kind == "duplicate_key" and isinstance(node, dict) and node:
        key = data.draw(st.sampled_from(sorted(node)))
        again = data.draw(st.one_of(st.just(node[key]), weird_values(names)))
        return _set_at(doc, path, Pairs((*node.items(), (key, again))))
    if kind == "deep_expr":
        depth = data.draw(st.sampled_from((50, 400, 1000, 3000)))
        op = data.draw(st.sampled_from(("add", "mul", "ceil_div")))
        return _set_at(doc, path, _deep_expr(depth, op))
    if kind == "raw":
        return _set_at(doc, path, Raw(data.draw(st.sampled_from(RAW_TOKENS))))
    return doc  # the mutation does not apply here; the next one may


# ------------------------------------------------------------------------------ bytes

BYTE_MUTATIONS = ("flip", "set", "insert", "delete", "splice", "truncate", "bad_utf8")
BAD_UTF8 = (b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x00", b"\xef\xbb\xbf")


def mutate_bytes(data_: bytes, data: st.DataObject, count: int | None = None) -> bytes:
    """`data_` after 1-4 drawn byte mutations."""
    out = bytearray(data_)
    for _ in range(count or data.draw(st.integers(1, 4), label="byte mutations")):
        kind = data.draw(st.sampled_from(BYTE_MUTATIONS), label="byte mutation")
        out = _apply_bytes(out, kind, data)
    return bytes(out)


def _apply_bytes(out: bytearray, kind: str, data: st.DataObject) -> bytearray:
    at = data.draw(st.integers(0, max(0, len(out) - 1)), label="offset")
    if kind == "flip" and out:
        out[at] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "set" and out:
        out[at] = data.draw(st.integers(0, 255))
    elif kind == "insert":
        out[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    elif kind == "delete":
        del out[at:at + data.draw(st.integers(1, 64))]
    elif kind == "splice" and out:
        start = data.draw(st.integers(0, len(out) - 1))
        out[at:at] = out[start:start + data.draw(st.integers(1, 200))]
    elif kind == "truncate":
        del out[at:]
    elif kind == "bad_utf8":
        out[at:at] = data.draw(st.sampled_from(BAD_UTF8))
    return out


# ------------------------------------------------------------------------------ tokens

TOKEN_MUTATIONS = ("delete", "repeat", "swap", "replace", "insert", "join")


def mutate_tokens(tokens: list[str], extra: tuple[str, ...], data: st.DataObject,
                  count: int | None = None) -> str:
    """The text of `tokens` after 1-3 drawn token mutations; `extra` are tokens to put in."""
    out = list(tokens)
    for _ in range(count or data.draw(st.integers(1, 3), label="token mutations")):
        if not out:
            out.append(data.draw(st.sampled_from(extra)))
            continue
        kind = data.draw(st.sampled_from(TOKEN_MUTATIONS), label="token mutation")
        at = data.draw(st.integers(0, len(out) - 1), label="token")
        _apply_token(out, at, kind, tokens, extra, data)
    return "".join(out)


def _apply_token(out: list[str], at: int, kind: str, original: list[str],
                 extra: tuple[str, ...], data: st.DataObject) -> None:
    if kind == "delete":
        del out[at]
    elif kind == "repeat":
        out.insert(at, out[at])
    elif kind == "swap":
        other = data.draw(st.integers(0, len(out) - 1))
        out[at], out[other] = out[other], out[at]
    elif kind == "replace":
        out[at] = data.draw(st.sampled_from(extra + tuple(original)))
    elif kind == "insert":
        out.insert(at, data.draw(st.sampled_from(extra)))
    elif kind == "join" and at + 1 < len(out):
        out[at:at + 2] = [out[at] + out[at + 1]]


def tokenize(text: str, pattern: re.Pattern[str]) -> list[str]:
    """`text` cut into the matches of `pattern` and the text between them (lossless)."""
    out: list[str] = []
    last = 0
    for match in pattern.finditer(text):
        if match.start() > last:
            out.append(text[last:match.start()])
        out.append(match.group())
        last = match.end()
    if last < len(text):
        out.append(text[last:])
    return out


# ------------------------------------------------------------------------------ manifest edits

MANIFEST_EDITS = ("call_delete", "call_repeat", "call_move", "arg_rename", "arg_offset",
                  "buffer_kind", "buffer_dtype", "shape", "var_max", "state_size", "batch",
                  "flag", "param", "label", "drop_decl", "fill", "domain", "expr", "pointer")


def edit_manifest(doc: dict, data: st.DataObject, count: int | None = None) -> Any:
    """`doc` (a manifest) after 1-3 edits that keep its shape: calls deleted, repeated or moved,
    arguments renamed to other declared names, kinds, dtypes, shapes, sizes, batches, flags,
    params and labels changed, declarations dropped. Most results still parse, so they reach
    the verifier's rules and the passes; `pointer` falls back to one `mutate_json` mutation."""
    doc = copy.deepcopy(doc)
    for _ in range(count or data.draw(st.integers(1, 3), label="edits")):
        kind = data.draw(st.sampled_from(MANIFEST_EDITS), label="edit")
        if kind == "pointer":
            return mutate_json(doc, data, count=1)
        if kind == "expr":
            return _expr(doc, data)
        _EDITS[kind](doc, data)
    return doc


def _pick(data: st.DataObject, items: Any, label: str) -> Any:
    items = sorted(items) if isinstance(items, (set, dict)) else list(items)
    return data.draw(st.sampled_from(items), label=label) if items else None


def _section(doc: dict, key: str) -> dict:
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def _calls(doc: dict, data: st.DataObject) -> list | None:
    program = _pick(data, _section(doc, "programs"), "program")
    calls = _section(doc, "programs").get(program, {}).get("calls") if program else None
    return calls if isinstance(calls, list) and calls else None


def _call_delete(doc: dict, data: st.DataObject) -> None:
    calls = _calls(doc, data)
    if calls:
        del calls[data.draw(st.integers(0, len(calls) - 1))]


def _call_repeat(doc: dict, data: st.DataObject) -> None:
    calls = _calls(doc, data)
    if calls:
        call = copy.deepcopy(calls[data.draw(st.integers(0, len(calls) - 1))])
        calls.insert(data.draw(st.integers(0, len(calls))), call)


def _call_move(doc: dict, data: st.DataObject) -> None:
    calls = _calls(doc, data)
    if calls:
        call = calls.pop(data.draw(st.integers(0, len(calls) - 1)))
        calls.insert(data.draw(st.integers(0, len(calls))), call)


def _args(doc: dict, data: st.DataObject) -> list | None:
    calls = _calls(doc, data)
    call = calls[data.draw(st.integers(0, len(calls) - 1))] if calls else None
    args = call.get("args") if isinstance(call, dict) else None
    return args if isinstance(args, list) and args else None


def _arg_rename(doc: dict, data: st.DataObject) -> None:
    args = _args(doc, data)
    arg = _pick(data, range(len(args)), "arg") if args else None
    if arg is None or not isinstance(args[arg], dict):
        return
    for key, section in (("buf", "buffers"), ("state", "states"), ("var", "vars")):
        if key in args[arg]:
            args[arg][key] = _pick(data, _section(doc, section), "name") or "x"
            return


def _arg_offset(doc: dict, data: st.DataObject) -> None:
    args = _args(doc, data)
    arg = _pick(data, range(len(args)), "arg") if args else None
    if arg is not None and isinstance(args[arg], dict):
        args[arg]["offset"] = data.draw(st.sampled_from((0, 1, 16, 64, 100, 4096, 2**40)))


def _in_declaration(doc: dict, section: str, data: st.DataObject) -> dict | None:
    name = _pick(data, _section(doc, section), section)
    decl = _section(doc, section).get(name) if name else None
    return decl if isinstance(decl, dict) else None


def _buffer_kind(doc: dict, data: st.DataObject) -> None:
    buf = _in_declaration(doc, "buffers", data)
    if buf is not None:
        buf["kind"] = data.draw(st.sampled_from(("input", "output", "inout", "weight", "source",
                                                 "workspace", "carry", "peer")))


def _buffer_dtype(doc: dict, data: st.DataObject) -> None:
    buf = _in_declaration(doc, "buffers", data)
    if buf is not None:
        buf["dtype"] = data.draw(st.sampled_from(("bf16", "f16", "f32", "i8", "i32", "u32",
                                                  "i64", "u64", "u8", "fp8e4m3")))


def _shape(doc: dict, data: st.DataObject) -> None:
    buf = _in_declaration(doc, "buffers", data)
    shape = buf.get("shape") if buf else None
    if not isinstance(shape, list):
        return
    dims = [*_section(doc, "vars"), 0, 1, 3, 64, 2**20, 2**40]
    how = data.draw(st.sampled_from(("set", "add", "drop")), label="shape edit")
    if how == "add" or not shape:
        shape.insert(data.draw(st.integers(0, len(shape))), _pick(data, map(str, dims), "dim"))
        shape[:] = [int(d) if isinstance(d, str) and d.isdigit() else d for d in shape]
    elif how == "drop":
        del shape[data.draw(st.integers(0, len(shape) - 1))]
    else:
        shape[data.draw(st.integers(0, len(shape) - 1))] = data.draw(st.sampled_from(dims))


def _var_max(doc: dict, data: st.DataObject) -> None:
    var = _in_declaration(doc, "vars", data)
    if var is not None:
        var["max"] = data.draw(st.sampled_from((0, 1, 2, 3, 5, 16, 4096, 2**32, 2**63)))


def _state_size(doc: dict, data: st.DataObject) -> None:
    state = _in_declaration(doc, "states", data)
    if state is not None:
        key = data.draw(st.sampled_from(("bytes_per_token", "bytes", "bytes_per_seq")))
        state[key] = data.draw(st.sampled_from((0, 1, 8, 16, 64, 2**32, 2**62)))


def _batch(doc: dict, data: st.DataObject) -> None:
    program = _in_declaration(doc, "programs", data)
    if program is None:
        return
    rows = [*_section(doc, "vars"), 1, 0, 7]
    groups = data.draw(st.sampled_from((0, 1, 2, 4, 5, 2**32)))
    program["batch"] = data.draw(st.sampled_from((
        {"groups": groups, "rows": _pick(data, map(str, rows), "rows")},
        {"groups": groups, "rows": 1}, None)))
    if program["batch"] is None:
        del program["batch"]


def _flag(doc: dict, data: st.DataObject) -> None:
    program = _in_declaration(doc, "programs", data)
    if program is not None:
        flag = data.draw(st.sampled_from(("once", "derive", "graph")))
        program[flag] = not program.get(flag, False)


def _param(doc: dict, data: st.DataObject) -> None:
    op = _in_declaration(doc, "ops", data)
    params = op.get("params") if op else None
    if isinstance(params, list) and params:
        params[data.draw(st.integers(0, len(params) - 1))] = data.draw(st.sampled_from((
            "in buffer<bf16>", "out buffer<bf16>", "inout buffer<bf16>", "in buffer<i32>",
            "out buffer<f32>", "in state", "inout state", "out state", "i32", "f32",
            "bytes<8>")))


def _label(doc: dict, data: st.DataObject) -> None:
    calls = _calls(doc, data)
    if not calls:
        return
    labels = [c.get("label") for c in calls if isinstance(c, dict) and c.get("label")]
    call = calls[data.draw(st.integers(0, len(calls) - 1))]
    if isinstance(call, dict):
        call["label"] = _pick(data, labels, "label") or "l"


def _drop_decl(doc: dict, data: st.DataObject) -> None:
    section = data.draw(st.sampled_from(("buffers", "states", "vars", "ops", "programs",
                                         "modules")))
    name = _pick(data, _section(doc, section), section)
    if name is not None:
        del doc[section][name]


def _fill(doc: dict, data: st.DataObject) -> None:
    buf = _in_declaration(doc, "buffers", data)
    if buf is not None:
        buf["fill"] = data.draw(st.sampled_from(("token", "position", "valid", "slot",
                                                 "seq_len", "cu_seqlens", "tokens")))


def _domain(doc: dict, data: st.DataObject) -> None:
    buf = _in_declaration(doc, "buffers", data)
    if buf is None:
        return
    targets = [*_section(doc, "states"), *_section(doc, "buffers")]
    buf["domain"] = data.draw(st.sampled_from((
        {"index_into": _pick(data, targets, "into") or "x", "stride": 16},
        {"min": 0, "max": data.draw(st.sampled_from((0, 1, 64, "tokens")))},
        {"monotone": True}, {})))


_EDITS = {"call_delete": _call_delete, "call_repeat": _call_repeat, "call_move": _call_move,
          "arg_rename": _arg_rename, "arg_offset": _arg_offset, "buffer_kind": _buffer_kind,
          "buffer_dtype": _buffer_dtype, "shape": _shape, "var_max": _var_max,
          "state_size": _state_size, "batch": _batch, "flag": _flag, "param": _param,
          "label": _label, "drop_decl": _drop_decl, "fill": _fill, "domain": _domain}


def _expression_paths(doc: dict) -> list[Path_]:
    """Where a manifest takes an expression: launch grids and shared memory, domain bounds."""
    paths: list[Path_] = []
    for name, op in _section(doc, "ops").items():
        launches = op.get("impl", {}).get("launches") if isinstance(op, dict) else None
        for i, launch in enumerate(launches if isinstance(launches, list) else []):
            if isinstance(launch, dict) and isinstance(launch.get("grid"), list):
                paths += [("ops", name, "impl", "launches", i, "grid", j)
                          for j in range(len(launch["grid"]))]
                paths.append(("ops", name, "impl", "launches", i, "shared_mem"))
    for name, buf in _section(doc, "buffers").items():
        if isinstance(buf, dict) and isinstance(buf.get("domain"), dict):
            paths += [("buffers", name, "domain", "min"), ("buffers", name, "domain", "max")]
    return paths


def _expr(doc: dict, data: st.DataObject) -> Any:
    """An expression position set to a deep, dividing-by-zero, huge or unknown expression."""
    paths = _expression_paths(doc)
    if not paths:
        return doc
    path = data.draw(st.sampled_from(paths), label="expression at")
    var = _pick(data, _section(doc, "vars"), "var") or "tokens"
    op = data.draw(st.sampled_from(("add", "mul", "ceil_div")))
    if data.draw(st.booleans(), label="deep"):
        depth = data.draw(st.sampled_from((2, 60, 61, 150, 250, 400)), label="depth")
        value: Any = Raw(_deep_expr(depth, op).text.replace('"tokens"', json.dumps(var)))
    else:
        value = data.draw(st.sampled_from((
            {"ceil_div": [var, 0]}, {"mul": [var, 0]}, {"mul": [var, 2**64 - 1]},
            {"add": [var, var]}, {"mul": [{"add": [var, 2**63]}, 2**32]},
            {"ceil_div": [var, -1]}, "nope", -1, 0, 2**64)), label="expression")
    get_at(doc, path[:-1])[path[-1]] = value
    return doc
