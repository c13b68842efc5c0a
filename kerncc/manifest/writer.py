"""Canonical serialization of a `Manifest` (spec §1.11): kern's `to_json`, byte for byte in shape.

Struct fields in declaration order, maps sorted by key (byte-wise, as Rust's BTreeMap), defaults
omitted, launch `params`/`args` written only when the input spelled them, 2-space indentation.
`to_raw` gives the plain JSON value; `dumps` the text. Constants are never written back.
"""

from __future__ import annotations

from json.encoder import encode_basestring as _encode_string  # the C one, as json.dumps uses
from collections.abc import Callable
from typing import Any

from kerncc.analysis.cache import per_manifest
from kerncc.manifest import model as m


@per_manifest
def dumps(manifest: m.Manifest) -> str:
    """The canonical text, once per manifest object (cut hashes the whole's, emit digests it)."""
    return indented_json(to_raw(manifest, call_json=_call_text)) + "\n"


class _Written(str):
    """JSON text already written at its place's indentation, put into the output as it is."""


# Where a call sits in the canonical text: programs -> NAME -> calls -> [index], 4 levels in.
CALL_NEWLINE = "\n" + "  " * 4


def _call_text(c: m.Call) -> _Written:
    # A call is three quarters of a manifest's text, and a stage holds the whole's Call
    # objects (frozen, like everything in a manifest): each is written once, by identity. The
    # entry holds the call, so its id stays its own; a weak reference per call cost more than
    # writing it (kerncc.analysis.access keeps call accesses the same way).
    hit = _CALL_TEXTS.get(id(c))
    if hit is not None and hit[0] is c:
        return hit[1]
    text = _Written(_write_call(c))
    if len(_CALL_TEXTS) >= _CALL_TEXTS_LIMIT:
        _CALL_TEXTS.clear()
    _CALL_TEXTS[id(c)] = (c, text)
    return text


_CALL_TEXTS_LIMIT = 65536
_CALL_TEXTS: dict[int, tuple[m.Call, _Written]] = {}


# The indentation inside a call: its fields, each argument, an argument's fields.
_FIELD = CALL_NEWLINE + "  "
_ARG = _FIELD + "  "
_ARG_FIELD = _ARG + "  "
_POINTER_KEYS = {m.BufArg: '"buf": ', m.StateArg: '"state": '}


def _write_call(c: m.Call) -> str:
    """What `_write(call(c), CALL_NEWLINE, ...)` writes, spelled out for the common shapes
    (string label and op; buffer, state and var arguments): the generic walk costs most of a
    manifest's text. Any other value goes through the generic walk."""
    if type(c.op) is not str or not (c.label is None or type(c.label) is str):
        parts: list[str] = []
        _write(call(c), CALL_NEWLINE, parts)
        return "".join(parts)
    fields = [] if c.label is None else ['"label": ' + _encode_string(c.label)]
    fields.append('"op": ' + _encode_string(c.op))
    args = [_write_call_arg(a) for a in c.args]
    fields.append('"args": [' + _ARG + ("," + _ARG).join(args) + _FIELD + "]" if args
                  else '"args": []')
    return "{" + _FIELD + ("," + _FIELD).join(fields) + CALL_NEWLINE + "}"


def _write_call_arg(a: m.CallArg) -> str:
    kind = type(a)
    if kind is m.VarArg and type(a.name) is str:
        return "{" + _ARG_FIELD + '"var": ' + _encode_string(a.name) + _ARG + "}"
    key = _POINTER_KEYS.get(kind)
    if key is None or type(a.name) is not str or not (a.offset is None or type(a.offset) is int):
        parts: list[str] = []
        _write(call_arg(a), _ARG, parts)
        return "".join(parts)
    offset = "" if a.offset is None else f',{_ARG_FIELD}"offset": {int.__repr__(a.offset)}'
    return "{" + _ARG_FIELD + key + _encode_string(a.name) + offset + _ARG + "}"


def indented_json(value: Any) -> str:
    """`json.dumps(value, indent=2, ensure_ascii=False)`, byte for byte, about 3x faster.

    The standard library's indenting encoder is pure Python generators (its C encoder only
    writes one line); this is one recursion into a list of strings. Emit writes every stage
    manifest and cut hashes the whole's text, so this is on every lowering's path.
    """
    parts: list[str] = []
    _write(value, "\n", parts)
    return "".join(parts)


def _write(value: Any, newline: str, parts: list[str]) -> None:
    # `newline` is "\n" plus the current indentation.
    if isinstance(value, dict):
        _write_dict(value, newline, parts)
    elif isinstance(value, (list, tuple)):
        _write_list(value, newline, parts)
    else:
        parts.append(_scalar(value))


def _write_dict(value: dict, newline: str, parts: list[str]) -> None:
    if not value:
        parts.append("{}")
        return
    inner = newline + "  "
    sep = "{" + inner
    for key, item in value.items():
        head = sep + (_encode_string(key) if type(key) is str else _key(key)) + ": "
        _write_item(head, item, inner, parts)
        sep = "," + inner
    parts.append(newline + "}")


def _write_list(value: list | tuple, newline: str, parts: list[str]) -> None:
    if not value:
        parts.append("[]")
        return
    inner = newline + "  "
    sep = "[" + inner
    for item in value:
        _write_item(sep, item, inner, parts)
        sep = "," + inner
    parts.append(newline + "]")


def _write_item(head: str, item: Any, inner: str, parts: list[str]) -> None:
    # Strings and ints, most leaves, are spelled here without a further call.
    kind = type(item)
    if kind is str:
        parts.append(head + _encode_string(item))
    elif kind is int:
        parts.append(head + int.__repr__(item))
    elif kind is _Written:
        parts.append(head + item)
    else:
        parts.append(head)
        _write(item, inner, parts)


def _scalar(value: Any) -> str:
    if isinstance(value, str):
        return _encode_string(value)
    if value is None or value is True or value is False:
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        return _float(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _key(key: Any) -> str:
    # json.dumps's key rule: strings as they are, scalars by their JSON spelling, quoted.
    if isinstance(key, str):
        return _encode_string(key)
    if isinstance(key, float):
        return _encode_string(_float(key))
    if key is None or key is True or key is False or isinstance(key, int):
        return _encode_string(_scalar(key))
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")


def _float(value: float) -> str:
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "Infinity" if value > 0 else "-Infinity"
    return float.__repr__(value)


def sort_key(name: str) -> bytes:
    return name.encode("utf-8")


def sorted_map(items: dict, convert) -> dict:
    return {k: convert(items[k]) for k in sorted(items, key=sort_key)}


def to_raw(man: m.Manifest, call_json: Callable[[m.Call], Any] | None = None) -> dict:
    """The canonical JSON value (`call_json`: how a call is written, `call` by default)."""
    out: dict[str, Any] = {"schema_version": man.schema_version, "model": man.model}
    if man.topology is not None:
        out["topology"] = {"groups": sorted_map(man.topology, lambda v: v)}
    if man.cut is not None:
        out["cut"] = {"id": man.cut.id, "stage": man.cut.stage, "stages": man.cut.stages}
    if man.vars:
        out["vars"] = sorted_map(man.vars, var)
    if man.states:
        out["states"] = sorted_map(man.states, state)
    out["buffers"] = sorted_map(man.buffers, buffer)
    out["modules"] = sorted_map(man.modules, lambda x: {"source": x.source, "sha256": x.sha256})
    out["ops"] = sorted_map(man.ops, op)
    out["programs"] = sorted_map(man.programs, lambda p: program(p, call_json or call))
    return out


def _given(out: dict, **fields: Any) -> dict:
    """`out` with each of `fields` that is not None, in order: a field at its default (passed
    as None) is not written."""
    out.update((k, v) for k, v in fields.items() if v is not None)
    return out


def _opt(convert: Callable[[Any], Any], value: Any) -> Any:
    return None if value is None else convert(value)


def expr(e: m.Expr) -> Any:
    if isinstance(e, (int, float, str)):
        return e
    if isinstance(e, m.CeilDiv):
        return {"ceil_div": [expr(e.expr), e.divisor]}
    if isinstance(e, m.Mul):
        return {"mul": [expr(e.expr), e.factor]}
    return {"add": [expr(e.left), expr(e.right)]}


def var(v: m.Var) -> dict:
    return _given({"max": v.max}, axis=v.axis)


def state(s: m.State) -> dict:
    host = _opt(lambda h: {"dtype": h.dtype, "shape": list(h.shape), "strides": list(h.strides)},
                s.host)
    return _given({}, bytes_per_token=s.bytes_per_token or None, bytes=s.bytes or None,
                  bytes_per_seq=s.bytes_per_seq or None, host=host)


def buffer(b: m.Buffer) -> dict:
    return _given({"dtype": b.dtype, "shape": list(b.shape), "kind": b.kind},
                  placement=None if b.placement == "device" else b.placement, fill=b.fill,
                  domain=_opt(domain, b.domain), export=b.export or None, of=b.of,
                  group=b.group, bind=[segment(s) for s in b.bind] or None)


def domain(d: m.Domain) -> dict:
    return _given({}, min=_opt(expr, d.min), max=_opt(expr, d.max), index_into=d.index_into,
                  stride=None if d.stride == 1 else d.stride, monotone=d.monotone or None)


def tensor_source(t: m.TensorSource) -> Any:
    if isinstance(t, str):
        return t
    return {"group": t.group, "tensors": list(t.items)}


def ranges(r: m.Ranges) -> Any:
    if isinstance(r, m.Ranked):
        return {"group": r.group, "ranges": [list(x) for x in r.items]}
    return list(r)


def segment(s: m.Segment) -> dict:
    interleave = _opt(lambda i: {"with": tensor_source(i.with_), "rows": i.rows}, s.interleave)
    return _given({"tensor": tensor_source(s.tensor)}, rows=_opt(ranges, s.rows),
                  cols=_opt(ranges, s.cols), interleave=interleave)


def op(o: m.Op) -> dict:
    impl: dict[str, Any] = {}
    if o.scratch:
        impl["scratch"] = sorted_map(o.scratch, lambda s: {"dtype": s.dtype,
                                                           "shape": list(s.shape)})
    impl["launches"] = [launch(x) for x in o.launches]
    return {"params": [str(p) for p in o.params], "impl": impl}


def launch(x: m.Launch) -> dict:
    params = _opt(lambda ps: [str(p) for p in ps], x.params)
    args = _opt(lambda xs: [launch_arg(a) for a in xs], x.args)
    if isinstance(x, m.ExternLaunch):
        algo = _opt(lambda a: {k: getattr(a, k) for k in m.ALGO_FIELDS}, x.algo)
        return _given({"entry": x.entry}, params=params, when=_opt(when, x.when), algo=algo,
                      args=args)
    return _given({"module": x.module, "entry": x.entry}, params=params, block=list(x.block),
                  grid=[expr(g) for g in x.grid], shared_mem=_opt(expr, x.shared_mem),
                  cluster=_opt(list, x.cluster), pdl=x.pdl, when=_opt(when, x.when), args=args)


def when(w: m.When) -> dict:
    return _given({"var": w.var}, min=w.min, max=w.max)


def literal(lit: m.Literal) -> dict:
    return {lit.type: float(lit.value) if lit.type == "f32" else lit.value}


def launch_arg(a: m.LaunchArg) -> dict:
    if isinstance(a, m.ParamRef):
        return {"param": a.index}
    if isinstance(a, m.ScratchRef):
        return {"scratch": a.name}
    if isinstance(a, m.Literal):
        return literal(a)
    if isinstance(a, m.RankArg):
        return {"rank": a.group}
    return {"pack": {"size": a.size, "fields": [field(f) for f in a.fields]}}


def field(f: m.Field) -> dict:
    return _given({"at": f.at}, width=f.width) | field_source(f.source)


def field_source(s: m.FieldSource) -> dict:
    if isinstance(s, m.VarArg):
        return {"var": s.name}
    if isinstance(s, m.ExprArg):
        return {"expr": expr(s.expr)}
    if isinstance(s, m.TensorMap):
        return {"tensormap": tensormap(s)}
    return launch_arg(s)


def tensormap(t: m.TensorMap) -> dict:
    return _given({"param": t.param, "dtype": t.dtype, "dims": list(t.dims)},
                  strides=list(t.strides) or None, box=list(t.box), swizzle=t.swizzle or None,
                  l2_promotion=t.l2_promotion or None, oob_nan=t.oob_nan or None,
                  wrap=t.wrap or None)


def program(p: m.Program, call_json: Callable[[m.Call], Any] | None = None) -> dict:
    return _given({}, batch=_opt(batch, p.batch), once=p.once or None,
                  derive=p.derive or None, graph=p.graph or None,
                  calls=[(call_json or call)(c) for c in p.calls])


def batch(b: m.Batch) -> dict:
    return _given({"groups": b.groups, "rows": b.rows}, span=b.span, context=b.context)


def call(c: m.Call) -> dict:
    return _given({}, label=c.label, op=c.op, args=[call_arg(a) for a in c.args])


def call_arg(a: m.CallArg) -> dict:
    if isinstance(a, m.BufArg):
        return _given({"buf": a.name}, offset=a.offset)
    if isinstance(a, m.StateArg):
        return _given({"state": a.name}, offset=a.offset)
    if isinstance(a, m.VarArg):
        return {"var": a.name}
    if isinstance(a, m.ExprArg):
        return {"expr": expr(a.expr)}
    if isinstance(a, m.Literal):
        return literal(a)
    return {"rank": a.group}
