"""Rendering a stage's `stage.py` (docs/bundle.md): plan the lines, then join them.

TorchInductor style: every line of every program function is decided in Python from the
stage's launch records (plan.json's `programs`), then `render_stage` only lays them out
between the module's fixed parts (no template engine: importing jinja2 cost more than
rendering, on every `kerncc lower` and every bundle load). A launch becomes
`rt.launch(site, grid, scalars)`: the grid evaluated from the vars (None for an extern), and
the var-dependent scalars in argument order, pack fields in their listed order (pointers and
constants are fixed at load, in the site's parameter block). A launch with `when` sits under
`if lo <= v["var"] <= hi:`. The runtime evaluates `shared_mem` from the site's record.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

from kerncc import manifest as m
from kerncc.manifest import writer

@attrs.frozen
class Function:
    """One program's function: its Python name, the program name literal, docstring, body."""

    name: str
    key: str
    doc: str
    lines: tuple[str, ...]


# `json.dumps(text, ensure_ascii=False)`, with the encoder built once rather than per call.
_json_text = json.JSONEncoder(ensure_ascii=False).encode


def py_str(text: str) -> str:
    """A Python string literal for `text` (JSON's escapes are Python's)."""
    return _json_text(text)


def py_docstring(text: str) -> str:
    """A triple-quoted docstring when `text` allows one, else a plain literal."""
    if '"' in text or "\\" in text or not text.isprintable():
        return py_str(text)
    return f'"""{text}"""'


def comment(text: str) -> str:
    """Text safe on one comment line: control characters escaped."""
    return re.sub(r"[\x00-\x1f\x7f\u2028\u2029]",
                  lambda c: c.group().encode("unicode_escape").decode(), text)


def py_expr(expr: Any, nested: bool = False) -> str:
    """A Python expression for an expression in its JSON form, vars read from `v`."""
    if isinstance(expr, int):
        return str(expr)
    if isinstance(expr, str):
        return f"v[{py_str(expr)}]"
    if "ceil_div" in expr:
        inner, divisor = expr["ceil_div"]
        return f"cdiv({py_expr(inner)}, {divisor})"
    if "mul" in expr:
        inner, factor = expr["mul"]
        return f"{py_expr(inner, nested=True)} * {factor}"
    left, right = expr["add"]
    text = f"{py_expr(left)} + {py_expr(right)}"
    return f"({text})" if nested else text


def _scalar_exprs(source: dict) -> list[str]:
    if "var" in source:
        return [py_expr(source["var"])]
    if "expr" in source:
        return [py_expr(source["expr"])]
    return []


def var_scalars(args: list[dict]) -> list[str]:
    """The var-dependent scalars of a launch, in argument order (pack fields in list order)."""
    out: list[str] = []
    for arg in args:
        if "scalar" in arg:
            out += _scalar_exprs(arg["scalar"])
        elif "pack" in arg:
            for f in arg["pack"]["fields"]:
                out += _scalar_exprs(f.get("scalar", {}))
    return out


def py_tuple(items: list[str]) -> str:
    if len(items) == 1:
        return f"({items[0]},)"
    return f"({', '.join(items)})"


def launch_lines(record: dict) -> list[str]:
    grid = py_tuple([py_expr(g) for g in record["grid"]]) if record["kind"] == "kernel" else "None"
    line = f"rt.launch({record['site']}, {grid}, {py_tuple(var_scalars(record['args']))})"
    when = record["when"]
    if when is None:
        return [line]
    return [f"if {when_condition(when)}:", "    " + line]


def when_condition(when: dict) -> str:
    parts = [str(when["min"])] if "min" in when else []
    parts.append(py_expr(when["var"]))
    if "max" in when:
        parts.append(str(when["max"]))
    if len(parts) == 1:  # neither bound: the launch always runs
        return "True"
    return " <= ".join(parts)


def call_text(man: m.Manifest, call: m.Call) -> str:
    """`label = op(in a, out b, tokens)`: the call as the comment above its launches."""
    op = man.ops.get(call.op)
    params = op.params if op else ()
    args = [_arg_text(a, p) for a, p in zip(call.args, params)]
    head = f"{call.label} = " if call.label else ""
    return f"{head}{call.op}({', '.join(args)})"


def _arg_text(arg: m.CallArg, param: m.ParamType) -> str:
    if isinstance(arg, (m.BufArg, m.StateArg)):
        kind = "state " if isinstance(arg, m.StateArg) else ""
        offset = f"+{arg.offset}" if arg.offset else ""
        return f"{param.direction} {kind}{arg.name}{offset}"
    if isinstance(arg, m.VarArg):
        return arg.name
    if isinstance(arg, m.ExprArg):
        return json.dumps(writer.expr(arg.expr))
    if isinstance(arg, m.Literal):
        return str(writer.literal(arg)[arg.type])
    return f"rank {arg.group}"


def function_lines(man: m.Manifest, program: str, record: dict) -> list[str]:
    calls = man.programs[program].calls
    lines: list[str] = []
    for call_record in record["calls"]:
        index = call_record["index"]
        lines.append(comment(f"# #{index} {call_text(man, calls[index])}"))
        for launch in call_record["launches"]:
            lines += launch_lines(launch)
    return lines


def _identifier(program: str, taken: set[str]) -> str:
    base = "run_" + re.sub(r"\W", "_", program, flags=re.ASCII)
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    taken.add(name)
    return name


def functions(man: m.Manifest, programs: dict) -> list[Function]:
    taken: set[str] = set()
    out = []
    for program, record in programs.items():
        calls = len(record["calls"])
        doc = py_docstring(f"program `{program}`: {calls} call{'s' if calls != 1 else ''}")
        out.append(Function(_identifier(program, taken), py_str(program), doc,
                            tuple(function_lines(man, program, record))))
    return out


# The header lines of stage.py, and the module constants that repeat them.
CONSTANTS = {"kerncc": "KERNCC_VERSION", "pipeline": "PIPELINE", "input sha256": "INPUT_SHA256",
             "manifest sha256": "MANIFEST_SHA256", "plan sha256": "PLAN_SHA256"}


MODULE_DOC = '''"""Stage {stage}: one straight-line function per program, issuing launches through `rt`.

`rt.launch(site, grid, scalars)` issues launch `site` of plan.json with the grid evaluated from
the vars `v` (None for an extern launch) and the var-dependent scalars in argument order.
"""'''

CDIV = '''def cdiv(a, b):
    """`ceil_div` as kern evaluates it on non-negative integers."""
    return -(-a // b)'''


def render_stage(man: m.Manifest, plan: dict, header: dict[str, str]) -> str:
    """The text of stage.py; `header` holds the values of CONSTANTS' keys, in order."""
    stage = plan["stage"]
    fns = functions(man, plan["programs"])
    lines = ["# Generated by kerncc; do not edit."]
    lines += ["# " + comment(f"{key}: {value}") for key, value in header.items()]
    lines += [MODULE_DOC.format(stage=stage), ""]
    lines += [f"{CONSTANTS[key]} = {py_str(value)}" for key, value in header.items()]
    lines += [f"STAGE = {stage}", "", "", CDIV]
    for fn in fns:
        lines += ["", "", f"def {fn.name}(rt, v):", f"    {fn.doc}"]
        lines += [f"    {line}" for line in fn.lines]
    lines += ["", "", "PROGRAMS = {"]
    lines += [f"    {fn.key}: {fn.name}," for fn in fns]
    lines.append("}")
    return "\n".join(lines) + "\n"
