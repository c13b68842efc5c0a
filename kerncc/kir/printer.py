"""The `.kir` printer: a Manifest as kir text, one declaration or call per line.

It prints the canonical raw JSON (`kerncc.manifest.writer.to_raw`), so whatever the writer keeps implicit
stays implicit here and kir carries exactly what JSON carries. Attributes are `key=value` with the
JSON field names in the writer's order; call args drop their kind word (and gain their direction)
whenever the op's interface says the same thing (`kerncc.kir.build.infer_arg` decides, for both sides).
"""

from __future__ import annotations

import json
from typing import Any

from kerncc import manifest as m
from kerncc.manifest import writer
from kerncc.kir.build import infer_arg, raw_param_type
from kerncc.kir.parse import FLAGS, NAME_RE, keywords

INDENT = "  "
# Free-text labels: always quoted, so a hash or a path never reads as a name.
_QUOTED_KEYS = frozenset({"source", "sha256", "id"})
# Closed vocabularies: printed bare even where a word is also a keyword (`dtype=i32`).
_VOCABULARY_KEYS = frozenset({"dtype", "kind", "fill", "axis", "placement"})
_EXPR_KEYS = ("add", "mul", "ceil_div")


def dumps(man: m.Manifest) -> str:
    """The kir text of a manifest, with a trailing newline."""
    raw = writer.to_raw(man)
    sections = [_header(raw)]
    sections.append([f"var {name(k)} {attrs(v)}".rstrip() for k, v in raw.get("vars", {}).items()])
    sections.append([f"state {name(k)} {attrs(v)}".rstrip()
                     for k, v in raw.get("states", {}).items()])
    sections.append([line for k, v in raw["buffers"].items() for line in buffer(k, v)])
    sections.append([f"module {name(k)} {attrs(v)}" for k, v in raw["modules"].items()])
    blocks = [op(k, v) for k, v in raw["ops"].items()]
    blocks += [program(k, v, raw["ops"]) for k, v in raw["programs"].items()]
    text = "\n\n".join("\n".join(lines) for lines in sections + blocks if lines)
    return text + "\n"


def _header(raw: dict) -> list[str]:
    lines = [f"schema_version {raw['schema_version']}", f"model {quoted(raw['model'])}"]
    if "topology" in raw:
        groups = " ".join(f"{name(g)}={n}" for g, n in raw["topology"]["groups"].items())
        lines.append(f"topology {groups}".rstrip())
    if "cut" in raw:
        lines.append(f"cut {attrs(raw['cut'])}")
    return lines

# ---------------------------------------------------------------------------- words and values


def name(text: str) -> str:
    """A name bare when it reads back as one, else as a JSON string."""
    if NAME_RE.fullmatch(text) and text not in keywords():
        return text
    return quoted(text)


def word(text: str) -> str:
    """A vocabulary word (dtype, kind...): bare, in positions where no keyword is expected."""
    return text if NAME_RE.fullmatch(text) else quoted(text)


def quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def number(value: float) -> str:
    return repr(value)  # repr of a float reads back to the same float


def expr(e: Any, context: int = 0) -> str:
    """Infix, `+` below `*` and `ceildiv`, both left-associative; parentheses only where needed."""
    if isinstance(e, str):
        return name(e)
    if not isinstance(e, dict):
        return number(e)
    (op_name, (left, right)), = e.items()
    if op_name == "add":
        text, precedence = f"{expr(left, 1)} + {expr(right, 2)}", 1
    else:
        keyword = "*" if op_name == "mul" else "ceildiv"
        text, precedence = f"{expr(left, 2)} {keyword} {right}", 2
    return f"({text})" if precedence < context else text


def value(v: Any, key: str = "") -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return _string(v, key)
    if isinstance(v, list):
        return _list(v, key)
    if not isinstance(v, dict):
        return number(v)
    if len(v) == 1 and next(iter(v)) in _EXPR_KEYS:
        return expr(v)
    if set(v) in ({"group", "tensors"}, {"group", "ranges"}):
        items = v.get("tensors", v.get("ranges"))
        return f"per {name(v['group'])} {_list(items, key)}"
    return "{" + ", ".join(attr(k, x) for k, x in v.items()) + "}"


def _string(text: str, key: str) -> str:
    if key in _QUOTED_KEYS:
        return quoted(text)
    if key in _VOCABULARY_KEYS:
        return word(text)
    return name(text)


def _list(items: list, key: str) -> str:
    if key in ("rows", "cols") and len(items) == 2 and all(isinstance(x, int) for x in items):
        return f"[{items[0]}, {items[1]})"  # a half-open range
    return "[" + ", ".join(value(x, key) for x in items) + "]"


def attr(key: str, v: Any) -> str:
    if v is True and key in FLAGS:
        return key
    return f"{key}={value(v, key)}"


def attrs(raw: dict, skip: tuple[str, ...] = ()) -> str:
    return " ".join(attr(k, v) for k, v in raw.items() if k not in skip)

# ---------------------------------------------------------------------------- buffers


def shape(dtype: str, dims: list) -> str:
    return f"{word(dtype)}[{', '.join(value(d) for d in dims)}]"


def buffer(key: str, raw: dict) -> list[str]:
    head = f"buffer {name(key)} {shape(raw['dtype'], raw['shape'])} {word(raw['kind'])}"
    rest = attrs(raw, ("dtype", "shape", "kind", "bind"))
    line = f"{head} {rest}".rstrip()
    if "bind" not in raw:
        return [line]
    binds = [f"{INDENT}{bind(s)}" for s in raw["bind"]]
    return [line + " {", *binds, "}"]


def bind(segment: dict) -> str:
    rest = attrs(segment, ("tensor",))
    return f"bind {value(segment['tensor'], 'tensor')} {rest}".rstrip()

# ---------------------------------------------------------------------------- ops


def op(key: str, raw: dict) -> list[str]:
    head = f"op {name(key)}({', '.join(raw['params'])}) {{"
    impl = raw["impl"]
    body = [f"{INDENT}scratch {name(s)} {shape(x['dtype'], x['shape'])}"
            for s, x in impl.get("scratch", {}).items()]
    body += [INDENT + launch(x) for x in impl["launches"]]
    return [head + "}"] if not body else [head, *body, "}"]


def launch(raw: dict) -> str:
    parts = [f"launch {name(raw['entry'])}"]
    for key, v in raw.items():
        if key == "params":
            parts.append(f"params=({', '.join(v)})")
        elif key == "args":
            parts.append(f"args=({', '.join(launch_arg(a) for a in v)})")
        elif key != "entry":
            parts.append(attr(key, v))
    return " ".join(parts)


def launch_arg(arg: dict) -> str:
    """A launch arg or a pack field's source (the same one-key forms)."""
    (key, v), = arg.items()
    if key == "param":
        return f"%{v}"
    if key == "pack":
        return pack(v)
    if key == "tensormap":
        return f"tensormap %{v['param']} {attrs(v, ('param',))}".rstrip()
    if key == "expr":
        return f"expr {expr(v)}"
    if key in m.SCALAR_TYPES:
        return f"{key} {number(v)}"
    return f"{key} {name(v)}"  # scratch, var, rank


def pack(raw: dict) -> str:
    pad = INDENT * 3
    fields = [pad + field(f) for f in raw["fields"]]
    return "\n".join([f"pack {raw['size']} {{", *fields, INDENT * 2 + "}"])


def field(raw: dict) -> str:
    width = f" width={raw['width']}" if "width" in raw else ""
    source = {k: v for k, v in raw.items() if k not in ("at", "width")}
    return f"@{raw['at']}{width} {launch_arg(source)}"

# ---------------------------------------------------------------------------- programs


def program(key: str, raw: dict, ops: dict) -> list[str]:
    head = " ".join(x for x in (f"program {name(key)}", attrs(raw, ("calls",)), "{") if x)
    calls = [INDENT + call(i, c, ops) for i, c in enumerate(raw["calls"])]
    return [head + "}"] if not calls else [head, *calls, "}"]


def call(index: int, raw: dict, ops: dict) -> str:
    label = f"{name(raw['label'])} = " if "label" in raw else ""
    args = ", ".join(call_arg(a, raw_param_type(ops, raw["op"], i))
                     for i, a in enumerate(raw["args"]))
    return f"#{index} {label}{name(raw['op'])}({args})"


def call_arg(arg: dict, param: m.ParamType | None) -> str:
    """Bare when the interface implies the kind; `in`/`out`/`inout` from the interface."""
    (key, v), *_ = arg.items()
    offset = arg.get("offset")
    at = "" if offset is None else f"@{offset}"
    pointer = key in ("buf", "state")
    direction = f"{param.direction} " if pointer and param is not None and param.is_pointer else ""
    if key != "rank" and infer_arg(param, v, offset) == arg:
        return f"{direction}{_bare(v)}{at}"
    if pointer:
        return f"{direction}{key} {name(v)}{at}"
    return launch_arg(arg)


def _bare(v: Any) -> str:
    """A name, a number or an expression, as a bare call arg shows it."""
    if isinstance(v, str):
        return name(v)
    return expr(v)  # numbers print as themselves
