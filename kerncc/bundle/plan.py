"""The launch records and memory of one stage's `plan.json` (docs/bundle.md), as plain JSON.

Pure functions of a stage manifest and its arena: every launch of every call gets kern's
defaults applied (`launch_params` / `launch_args`), each interface param reference replaced by
the call's argument and resolved to a pointer (buffer, state, or arena byte offset of a
workspace or op-scratch slot) or a scalar source (literal, var, expression, rank). Sites number
the launches of the stage in program-name order, then call order. Nothing here reads files.
"""

from __future__ import annotations

from typing import Any

from kerncc import manifest as m
from kerncc.manifest import writer
from kerncc.analysis.liveness import buffer_sizes

Json = dict[str, Any]


def scratch_slot(op: str, scratch: str, call: int) -> str:
    """The arena name of op scratch `scratch` during call `call` of a program."""
    return f"op:{op}/scratch:{scratch}@{call}"


def program_kind(program: m.Program) -> str:
    if program.driven:
        return "driven"
    if program.once:
        return "once"
    return "derive" if program.derive else "harness"


def program_order(man: m.Manifest) -> list[str]:
    """Program names in the order sites are numbered (and plan.json lists them)."""
    return sorted(man.programs, key=str.encode)


# ---------------------------------------------------------------------------------------------
# Memory outside the arena


def memory_json(man: m.Manifest) -> Json:
    """Every buffer that is not a workspace, sized at var max, and every state."""
    sizes = buffer_sizes(man)
    buffers = {name: {"bytes": sizes[name], "kind": b.kind, "dtype": b.dtype,
                      "export": b.export}
               for name, b in sorted(man.buffers.items(), key=lambda kv: kv[0].encode())
               if b.kind != "workspace"}
    states = {name: writer.state(s)
              for name, s in sorted(man.states.items(), key=lambda kv: kv[0].encode())}
    return {"buffers": buffers, "states": states}


# ---------------------------------------------------------------------------------------------
# Argument resolution


class CallScope:
    """What one call's launch args resolve against: its args, op, and its program's arena."""

    def __init__(self, man: m.Manifest, call: m.Call, index: int,
                 offsets: dict[str, int]) -> None:
        self.man = man
        self.call = call
        self.index = index
        self.op = man.ops[call.op]
        self.offsets = offsets

    def param(self, i: int, scalar_type: str | None) -> Json:
        """Call argument `i` as a pointer or as a scalar of `scalar_type` (the ABI's)."""
        arg = self.call.args[i]
        if isinstance(arg, m.BufArg):
            return {"ptr": self.buffer_ptr(arg)}
        if isinstance(arg, m.StateArg):
            return {"ptr": {"state": arg.name, "offset": arg.offset or 0}}
        return {"scalar": scalar_source(arg, scalar_type or self.op.params[i].scalar or "i32")}

    def buffer_ptr(self, arg: m.BufArg) -> Json:
        # A workspace's bytes sit in the arena: resolve to the arena byte offset now.
        if self.man.buffers[arg.name].kind == "workspace":
            return {"arena": arg.name, "offset": self.offsets[arg.name] + (arg.offset or 0)}
        return {"buffer": arg.name, "offset": arg.offset or 0}

    def scratch(self, name: str) -> Json:
        slot = scratch_slot(self.call.op, name, self.index)
        return {"ptr": {"scratch": slot, "offset": self.offsets[slot]}}


def scalar_source(arg: m.CallArg | m.FieldSource, scalar_type: str) -> Json:
    """A scalar's type and where its value comes from (value, var, expr or rank)."""
    if isinstance(arg, m.Literal):
        return {"type": scalar_type, "value": writer.literal(arg)[arg.type]}
    if isinstance(arg, m.VarArg):
        return {"type": scalar_type, "var": arg.name}
    if isinstance(arg, m.ExprArg):
        return {"type": scalar_type, "expr": writer.expr(arg.expr)}
    if isinstance(arg, m.RankArg):
        return {"type": scalar_type, "rank": arg.group}
    raise TypeError(f"not a scalar source: {arg!r}")


def launch_arg(scope: CallScope, arg: m.LaunchArg, param: m.ParamType) -> Json:
    if isinstance(arg, m.ParamRef):
        return scope.param(arg.index, param.scalar)
    if isinstance(arg, m.ScratchRef):
        return scope.scratch(arg.name)
    if isinstance(arg, m.Pack):
        return {"pack": {"size": arg.size, "fields": [pack_field(scope, f) for f in arg.fields]}}
    literal_type = arg.type if isinstance(arg, m.Literal) else "i32"
    return {"scalar": scalar_source(arg, param.scalar or literal_type)}


def pack_field(scope: CallScope, f: m.Field) -> Json:
    """A pack field with its width made explicit and its source resolved."""
    from kerncc.verify.packs import field_width

    width = field_width(f, scope.op)
    out: Json = {"at": f.at, "width": width}
    source = f.source
    if isinstance(source, m.ParamRef):
        out.update(scope.param(source.index, None))
    elif isinstance(source, m.ScratchRef):
        out.update(scope.scratch(source.name))
    elif isinstance(source, m.TensorMap):
        out["tensormap"] = tensormap(scope, source)
    elif isinstance(source, m.Literal):
        out["scalar"] = scalar_source(source, source.type)
    else:
        # var / expr / rank fields are 4 bytes unless widened; a wide one is a 64-bit integer.
        out["scalar"] = scalar_source(source, "i64" if width == 8 else "i32")
    return out


def tensormap(scope: CallScope, t: m.TensorMap) -> Json:
    return {"ptr": scope.param(t.param, None)["ptr"], "dtype": t.dtype, "dims": list(t.dims),
            "strides": list(t.strides), "box": list(t.box), "swizzle": t.swizzle,
            "l2_promotion": t.l2_promotion, "oob_nan": t.oob_nan, "wrap": t.wrap}


# ---------------------------------------------------------------------------------------------
# Launch records


def when_json(when: m.When | None) -> Json | None:
    return None if when is None else writer.when(when)


def launch_record(scope: CallScope, launch: m.Launch, site: int) -> Json:
    params = m.launch_params(launch, scope.op)
    args = [launch_arg(scope, a, p) for a, p in zip(m.launch_args(launch, scope.op), params)]
    if isinstance(launch, m.ExternLaunch):
        algo = None if launch.algo is None else {k: getattr(launch.algo, k)
                                                 for k in m.ALGO_FIELDS}
        return {"site": site, "kind": "extern", "entry": launch.entry, "algo": algo,
                "when": when_json(launch.when), "args": args}
    return {"site": site, "kind": "kernel", "module": scope.man.modules[launch.module].sha256,
            "entry": launch.entry, "block": list(launch.block),
            "grid": [writer.expr(g) for g in launch.grid],
            "shared_mem": writer.expr(launch.shared_mem or 0),
            "cluster": None if launch.cluster is None else list(launch.cluster),
            "pdl": bool(launch.pdl), "when": when_json(launch.when), "args": args}


def program_records(man: m.Manifest, offsets: dict[str, dict[str, int]]) -> Json:
    """`programs` of plan.json: per program its kind and calls, each with its launch records.

    `offsets[program]` maps workspaces and scratch slots to arena byte offsets.
    """
    site = 0
    out: Json = {}
    for name in program_order(man):
        program = man.programs[name]
        calls = []
        for index, call in enumerate(program.calls):
            scope = CallScope(man, call, index, offsets.get(name, {}))
            launches = []
            for launch in scope.op.launches:
                launches.append(launch_record(scope, launch, site))
                site += 1
            calls.append({"index": index, "label": call.label, "op": call.op,
                          "launches": launches})
        out[name] = {"kind": program_kind(program), "calls": calls}
    return out
