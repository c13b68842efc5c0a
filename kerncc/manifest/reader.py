"""The strict typed parse of a manifest (spec §1): raw JSON -> `Manifest`, every problem collected.

kern parses with serde (`deny_unknown_fields`, untagged enums tried in order) and stops at the
first error; kerncc keeps serde's texts (`unknown field`, `missing field`, `invalid type`,
`did not match any variant`, `duplicate name`, `invalid param type`...) but reports every one,
each at its JSON pointer. Wire-only `constants` (spec §1.2) are expanded here, because the
positions where a string may name a constant are exactly the numeric positions this reader
knows. Nothing here judges meaning: that is `kerncc.verify`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from kerncc.manifest import model as m
from kerncc.diagnostics import (Diagnostic, Diagnostics, KernccError, Location,
                                escape_pointer_token)
from kerncc.manifest.jsonsource import PARSE_HEADLINE, PositionIndex, parse_json

_BYTE_COUNT = re.compile(r"[0-9]{1,20}")
_LIMITS = {"u64": (0, 2**64 - 1), "u32": (0, 2**32 - 1), "u16": (0, 2**16 - 1),
           "u8": (0, 255), "i32": (-2**31, 2**31 - 1), "i64": (-2**63, 2**63 - 1),
           "usize": (0, 2**64 - 1)}


class _Fail(Exception):
    """Unwinds one value's parse after its diagnostic was recorded."""


STDIN = "-"  # the file name that means standard input, for every command reading a file


def read_text(path: str | Path) -> str:
    """The file's text (`-`: standard input); bytes that are not UTF-8 are an error at their
    line:col. Only a regular file is read, bounded: a FIFO would hang, /dev/zero never end."""
    from kerncc.files import FileRefused, read_regular

    if str(path) == STDIN:
        try:
            data = _stdin_bytes()
        except OSError as err:
            raise KernccError.single(f"cannot read standard input: {err.strerror or err}"
                                     ) from None
    else:
        try:
            data = read_regular(Path(path), "file")
        except FileRefused as err:
            raise KernccError.single(err.message) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise KernccError(PARSE_HEADLINE, [_not_utf8(data, err, str(path))]) from None


def _stdin_bytes() -> bytes:
    """Standard input, bounded like a file (`--max-file-size`)."""
    import sys

    from kerncc.files import max_file_size

    limit = max_file_size()
    data = sys.stdin.buffer.read(limit + 1)
    if len(data) > limit:
        raise KernccError.single(f"standard input holds more than {limit} bytes, the most a "
                                 "manifest may have (raise it with --max-file-size)")
    return data


def _not_utf8(data: bytes, err: UnicodeDecodeError, path: str) -> Diagnostic:
    line_start = data.rfind(b"\n", 0, err.start) + 1
    column = len(data[line_start:err.start].decode("utf-8", errors="replace")) + 1
    line = data.count(b"\n", 0, err.start) + 1
    return Diagnostic(f"not UTF-8: byte 0x{data[err.start]:02x} ({err.reason})",
                      Location("", path, line, column))


def load(path: str | Path) -> m.Manifest:
    """Read a JSON manifest file; parse strictly (a `.kir` text: `kerncc.source.load`)."""
    return load_with_locator(path)[0]


def load_with_locator(path: str | Path) -> tuple[m.Manifest, Callable[[str], Location]]:
    """The manifest and a function mapping a JSON pointer to its place in the file.

    Later phases (verify, passes) report JSON pointers; the locator turns them into line:col.
    """
    text = read_text(path)
    return loads(text, str(path)), PositionIndex.locator(text, str(path))


def loads(text: str, file: str | None = None) -> m.Manifest:
    """Parse manifest JSON text; a KernccError carries every problem with pointer and line:col."""
    raw = parse_json(text, file)
    try:
        return from_raw(raw)
    except KernccError as err:
        raise err.located(PositionIndex.locator(text, file)) from None


def from_raw(raw: Any) -> m.Manifest:
    reader = Reader()
    result = reader.manifest(raw)
    reader.diags.raise_if_any(PARSE_HEADLINE)
    return result


def describe(value: Any) -> str:
    """serde's words for an unexpected JSON value."""
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    if value is None:
        return "null"
    return "a sequence" if isinstance(value, list) else "a map"


class Reader:
    """Typed parse with one diagnostics collector; each method takes (pointer, raw value)."""

    def __init__(self) -> None:
        self.diags = Diagnostics()
        self.constants: dict[str, int | float] | None = None

    # -------------------------------------------------------------- primitives

    def fail(self, ptr: str, message: str) -> None:
        self.diags.error(message, ptr)
        raise _Fail

    def guard(self, fn: Callable[[], Any], default: Any = None) -> Any:
        """Run one value's parse; on failure keep going with `default`."""
        try:
            return fn()
        except _Fail:
            return default

    def obj(self, ptr: str, raw: Any, required: tuple[str, ...], optional: tuple[str, ...],
            what: str) -> dict:
        if not isinstance(raw, dict):
            self.fail(ptr, f"invalid type: {describe(raw)}, expected struct {what}")
        known = required + optional
        for key in raw:
            if key not in known:
                expected = ", ".join(f"`{k}`" for k in known)
                self.diags.error(f"unknown field `{key}`, expected one of {expected}",
                                 f"{ptr}/{escape_pointer_token(key)}")
        missing = [k for k in required if k not in raw]
        for key in missing:
            self.diags.error(f"missing field `{key}`", ptr)
        if missing or any(k not in known for k in raw):
            raise _Fail
        return raw

    def string(self, ptr: str, raw: Any) -> str:
        if not isinstance(raw, str):
            self.fail(ptr, f"invalid type: {describe(raw)}, expected a string")
        return raw

    def boolean(self, ptr: str, raw: Any) -> bool:
        if not isinstance(raw, bool):
            self.fail(ptr, f"invalid type: {describe(raw)}, expected a boolean")
        return raw

    def constant(self, ptr: str, raw: Any) -> Any:
        """A string in a numeric position names a constant (spec §1.2)."""
        if not isinstance(raw, str) or self.constants is None or ptr == "/schema_version":
            return raw
        if raw in self.constants:
            return self.constants[raw]
        self.fail(ptr, f"undefined constant `{raw}`")

    def integer(self, ptr: str, raw: Any, kind: str = "u64") -> int:
        raw = self.constant(ptr, raw)
        if isinstance(raw, bool) or not isinstance(raw, int):
            self.fail(ptr, f"invalid type: {describe(raw)}, expected {kind}")
        lo, hi = _LIMITS[kind]
        if not lo <= raw <= hi:
            self.fail(ptr, f"invalid value: integer `{raw}`, expected {kind}")
        return raw

    def number(self, ptr: str, raw: Any) -> float:
        raw = self.constant(ptr, raw)
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            self.fail(ptr, f"invalid type: {describe(raw)}, expected f32")
        return float(raw)

    def seq(self, ptr: str, raw: Any, item: Callable[[str, Any], Any],
            length: int | None = None) -> tuple:
        if not isinstance(raw, list):
            self.fail(ptr, f"invalid type: {describe(raw)}, expected a sequence")
        if length is not None and len(raw) != length:
            self.fail(ptr, f"invalid length {len(raw)}, expected an array of length {length}")
        out = [self.guard(lambda p=f"{ptr}/{i}", v=v: item(p, v), _BAD) for i, v in enumerate(raw)]
        if any(v is _BAD for v in out):
            raise _Fail
        return tuple(out)

    def name_map(self, ptr: str, raw: Any, item: Callable[[str, Any], Any]) -> dict:
        if not isinstance(raw, dict):
            self.fail(ptr, f"invalid type: {describe(raw)}, expected a map")
        out = {k: self.guard(lambda p=f"{ptr}/{escape_pointer_token(k)}", v=v: item(p, v), _BAD)
               for k, v in raw.items()}
        return {k: v for k, v in out.items() if v is not _BAD}

    def opt(self, raw: dict, key: str, ptr: str, parse: Callable[[str, Any], Any],
            default: Any = None) -> Any:
        if key not in raw:
            return default
        return parse(f"{ptr}/{key}", raw[key])

    def enum(self, ptr: str, raw: Any, values: tuple[str, ...], what: str) -> str:
        text = self.string(ptr, raw)
        if text not in values:
            expected = ", ".join(f"`{v}`" for v in values)
            self.fail(ptr, f"unknown variant `{text}`, expected one of {expected}")
        return text

    def dtype(self, ptr: str, raw: Any) -> str:
        return self.enum(ptr, raw, tuple(m.DTYPE_SIZES), "DType")

    # -------------------------------------------------------------- expressions

    def expr(self, ptr: str, raw: Any) -> m.Expr:
        raw = self.constant_or_name(ptr, raw)
        if isinstance(raw, str):
            return raw
        if isinstance(raw, int) and not isinstance(raw, bool):
            return self.integer(ptr, raw)
        if not isinstance(raw, dict) or len(raw) != 1:
            self.fail(ptr, "data did not match any variant of untagged enum Expr")
        (key, body), = raw.items()
        if key not in ("ceil_div", "mul", "add"):
            self.fail(ptr, "data did not match any variant of untagged enum Expr")
        inner = f"{ptr}/{key}"
        if key == "add":
            left, right = self.seq(inner, body, self.expr, 2)
            return m.Add(left, right)
        left, right = self.seq(inner, body, lambda p, v: self.expr(p, v) if p.endswith("/0")
                               else self.integer(p, v), 2)
        return m.CeilDiv(left, right) if key == "ceil_div" else m.Mul(left, right)

    def constant_or_name(self, ptr: str, raw: Any) -> Any:
        """Where a string may be a var name, a constant of that name still wins (spec §1.2)."""
        if isinstance(raw, str) and self.constants and raw in self.constants:
            return self.constants[raw]
        return raw

    def dim(self, ptr: str, raw: Any) -> m.Dim:
        raw = self.constant_or_name(ptr, raw)
        if isinstance(raw, str):
            return raw
        return self.integer(ptr, raw)

    def bound(self, ptr: str, raw: Any) -> m.Bound:
        raw = self.constant_or_name(ptr, raw)
        if isinstance(raw, bool):
            self.fail(ptr, "data did not match any variant of untagged enum Bound")
        if isinstance(raw, int):
            return self.integer(ptr, raw, "i64")
        if isinstance(raw, float):
            return raw
        return self.expr(ptr, raw)

    # -------------------------------------------------------------- top level

    def manifest(self, raw: Any) -> m.Manifest | None:
        keys_req = ("schema_version", "model", "buffers", "modules", "ops", "programs")
        keys_opt = ("topology", "cut", "vars", "states", "constants")
        try:
            raw = self.obj("", raw, keys_req, keys_opt, "Manifest")
        except _Fail:
            if not isinstance(raw, dict):
                return None
        self.read_constants(raw)
        get = lambda key, fn, default=None: self.guard(  # noqa: E731
            lambda: self.opt(raw, key, "", fn, default), default)
        result = dict(
            schema_version=get("schema_version", lambda p, v: self.integer(p, v, "u32")),
            model=get("model", self.string),
            topology=get("topology", self.topology),
            cut=get("cut", self.cut),
            vars=get("vars", lambda p, v: self.name_map(p, v, self.var), {}),
            states=get("states", lambda p, v: self.name_map(p, v, self.state), {}),
            buffers=get("buffers", lambda p, v: self.name_map(p, v, self.buffer), {}),
            modules=get("modules", lambda p, v: self.name_map(p, v, self.module), {}),
            ops=get("ops", lambda p, v: self.name_map(p, v, self.op), {}),
            programs=get("programs", lambda p, v: self.name_map(p, v, self.program), {}),
        )
        if self.diags:
            return None
        return m.Manifest(**result)

    def read_constants(self, raw: dict) -> None:
        if "constants" not in raw:
            return
        consts = raw["constants"]
        if not isinstance(consts, dict):
            self.diags.error("constants must be an object", "/constants")
            return
        for name, value in consts.items():
            if not name or isinstance(value, bool) or not isinstance(value, (int, float)):
                self.diags.error("constants require nonempty names and numeric literal values",
                                 f"/constants/{escape_pointer_token(name)}")
        var_names = raw.get("vars") if isinstance(raw.get("vars"), dict) else {}
        for name in consts:
            if name in var_names:
                self.diags.error(f"constant `{name}` conflicts with a var",
                                 f"/constants/{escape_pointer_token(name)}")
        self.constants = {k: v for k, v in consts.items()
                          if k and not isinstance(v, bool) and isinstance(v, (int, float))}

    def topology(self, ptr: str, raw: Any) -> dict[str, int]:
        raw = self.obj(ptr, raw, ("groups",), (), "Topology")
        return self.name_map(f"{ptr}/groups", raw["groups"], self.integer)

    def cut(self, ptr: str, raw: Any) -> m.Cut:
        raw = self.obj(ptr, raw, ("id", "stage", "stages"), (), "Cut")
        return m.Cut(self.string(f"{ptr}/id", raw["id"]),
                     self.integer(f"{ptr}/stage", raw["stage"]),
                     self.integer(f"{ptr}/stages", raw["stages"]))

    def var(self, ptr: str, raw: Any) -> m.Var:
        raw = self.obj(ptr, raw, ("max",), ("axis",), "Var")
        axis = self.opt(raw, "axis", ptr, lambda p, v: self.enum(p, v, m.AXES, "Axis"))
        return m.Var(self.integer(f"{ptr}/max", raw["max"]), axis)

    def state(self, ptr: str, raw: Any) -> m.State:
        raw = self.obj(ptr, raw, (), ("bytes_per_token", "bytes", "bytes_per_seq", "host"),
                       "State")
        sizes = {k: self.opt(raw, k, ptr, self.integer, 0)
                 for k in ("bytes_per_token", "bytes", "bytes_per_seq")}
        return m.State(**sizes, host=self.opt(raw, "host", ptr, self.host_layout))

    def host_layout(self, ptr: str, raw: Any) -> m.HostLayout:
        raw = self.obj(ptr, raw, ("dtype", "shape", "strides"), (), "HostLayout")
        return m.HostLayout(self.dtype(f"{ptr}/dtype", raw["dtype"]),
                            self.seq(f"{ptr}/shape", raw["shape"], self.integer),
                            self.seq(f"{ptr}/strides", raw["strides"], self.integer))

    def module(self, ptr: str, raw: Any) -> m.Module:
        raw = self.obj(ptr, raw, ("source", "sha256"), (), "Module")
        return m.Module(self.string(f"{ptr}/source", raw["source"]),
                        self.string(f"{ptr}/sha256", raw["sha256"]))

    # -------------------------------------------------------------- buffers

    def buffer(self, ptr: str, raw: Any) -> m.Buffer:
        raw = self.obj(ptr, raw, ("dtype", "shape", "kind"),
                       ("placement", "fill", "domain", "export", "of", "group", "bind"), "Buffer")
        opt = lambda key, fn, default=None: self.opt(raw, key, ptr, fn, default)  # noqa: E731
        return m.Buffer(
            dtype=self.dtype(f"{ptr}/dtype", raw["dtype"]),
            shape=self.seq(f"{ptr}/shape", raw["shape"], self.dim),
            kind=self.enum(f"{ptr}/kind", raw["kind"], m.BUFFER_KINDS, "BufferKind"),
            placement=opt("placement", lambda p, v: self.enum(p, v, ("device", "host"),
                                                              "Placement"), "device"),
            fill=opt("fill", lambda p, v: self.enum(p, v, m.FILLS, "Fill")),
            domain=opt("domain", self.domain),
            export=opt("export", self.boolean, False),
            of=opt("of", self.string),
            group=opt("group", self.string),
            bind=opt("bind", lambda p, v: self.seq(p, v, self.segment), ()),
        )

    def domain(self, ptr: str, raw: Any) -> m.Domain:
        raw = self.obj(ptr, raw, (), ("min", "max", "index_into", "stride", "monotone"), "Domain")
        return m.Domain(min=self.opt(raw, "min", ptr, self.bound),
                        max=self.opt(raw, "max", ptr, self.bound),
                        index_into=self.opt(raw, "index_into", ptr, self.string),
                        stride=self.opt(raw, "stride", ptr, self.integer, 1),
                        monotone=self.opt(raw, "monotone", ptr, self.boolean, False))

    def segment(self, ptr: str, raw: Any) -> m.Segment:
        raw = self.obj(ptr, raw, ("tensor",), ("rows", "cols", "interleave"), "Segment")
        return m.Segment(tensor=self.tensor_source(f"{ptr}/tensor", raw["tensor"]),
                         rows=self.opt(raw, "rows", ptr, self.ranges),
                         cols=self.opt(raw, "cols", ptr, self.ranges),
                         interleave=self.opt(raw, "interleave", ptr, self.interleave))

    def tensor_source(self, ptr: str, raw: Any) -> m.TensorSource:
        if isinstance(raw, str):
            return raw
        raw = self.obj(ptr, raw, ("group", "tensors"), (), "RankedTensors")
        return m.Ranked(self.string(f"{ptr}/group", raw["group"]),
                        self.seq(f"{ptr}/tensors", raw["tensors"], self.string))

    def range_pair(self, ptr: str, raw: Any) -> tuple[int, int]:
        return self.seq(ptr, raw, self.integer, 2)

    def ranges(self, ptr: str, raw: Any) -> m.Ranges:
        if isinstance(raw, list):
            return self.range_pair(ptr, raw)
        raw = self.obj(ptr, raw, ("group", "ranges"), (), "RankedRanges")
        return m.Ranked(self.string(f"{ptr}/group", raw["group"]),
                        self.seq(f"{ptr}/ranges", raw["ranges"], self.range_pair))

    def interleave(self, ptr: str, raw: Any) -> m.Interleave:
        raw = self.obj(ptr, raw, ("with", "rows"), (), "Interleave")
        return m.Interleave(self.tensor_source(f"{ptr}/with", raw["with"]),
                            self.integer(f"{ptr}/rows", raw["rows"]))

    # -------------------------------------------------------------- ops

    def param_type(self, ptr: str, raw: Any) -> m.ParamType:
        return parse_param_type(self.string(ptr, raw), lambda msg: self.fail(ptr, msg))

    def op(self, ptr: str, raw: Any) -> m.Op:
        raw = self.obj(ptr, raw, ("params", "impl"), (), "Op")
        params = self.seq(f"{ptr}/params", raw["params"], self.param_type)
        impl = self.obj(f"{ptr}/impl", raw["impl"], ("launches",), ("scratch",), "Impl")
        scratch = self.opt(impl, "scratch", f"{ptr}/impl",
                           lambda p, v: self.name_map(p, v, self.scratch), {})
        launches = self.seq(f"{ptr}/impl/launches", impl["launches"], self.launch)
        return m.Op(params, launches, scratch)

    def scratch(self, ptr: str, raw: Any) -> m.Scratch:
        raw = self.obj(ptr, raw, ("dtype", "shape"), (), "Scratch")
        return m.Scratch(self.dtype(f"{ptr}/dtype", raw["dtype"]),
                         self.seq(f"{ptr}/shape", raw["shape"], self.dim))

    def untagged(self, ptr: str, raw: Any, variants: list[Callable[[str, Any], Any]],
                 what: str) -> Any:
        """serde's untagged enum: the first variant that parses cleanly wins."""
        reasons: list[str] = []
        for variant in variants:
            probe = Reader()
            probe.constants = self.constants
            parse = getattr(probe, variant.__name__)  # the probe's own method: its own diagnostics
            value = probe.guard(lambda: parse(ptr, raw), _BAD)
            if value is not _BAD and not probe.diags:
                return value
            reasons.append(probe.diags.items[0].message if probe.diags else "")
        why = "; ".join(r for r in reasons if r)
        self.fail(ptr, f"data did not match any variant of untagged enum {what}"
                  + (f" ({why})" if why else ""))

    def launch(self, ptr: str, raw: Any) -> m.Launch:
        return self.untagged(ptr, raw, [self.kernel_launch, self.extern_launch], "Launch")

    def kernel_launch(self, ptr: str, raw: Any) -> m.KernelLaunch:
        raw = self.obj(ptr, raw, ("module", "entry", "block", "grid"),
                       ("params", "shared_mem", "cluster", "pdl", "when", "args"), "KernelLaunch")
        u32 = lambda p, v: self.integer(p, v, "u32")  # noqa: E731
        return m.KernelLaunch(
            module=self.string(f"{ptr}/module", raw["module"]),
            entry=self.string(f"{ptr}/entry", raw["entry"]),
            block=self.seq(f"{ptr}/block", raw["block"], u32, 3),
            grid=self.seq(f"{ptr}/grid", raw["grid"], self.expr, 3),
            params=self.opt(raw, "params", ptr, lambda p, v: self.seq(p, v, self.param_type)),
            shared_mem=self.opt(raw, "shared_mem", ptr, self.expr),
            cluster=self.opt(raw, "cluster", ptr, lambda p, v: self.seq(p, v, u32, 3)),
            pdl=self.opt(raw, "pdl", ptr, self.boolean),
            when=self.opt(raw, "when", ptr, self.when),
            args=self.opt(raw, "args", ptr, lambda p, v: self.seq(p, v, self.launch_arg)),
        )

    def extern_launch(self, ptr: str, raw: Any) -> m.ExternLaunch:
        raw = self.obj(ptr, raw, ("entry",), ("params", "when", "algo", "args"), "ExternLaunch")
        return m.ExternLaunch(
            entry=self.string(f"{ptr}/entry", raw["entry"]),
            params=self.opt(raw, "params", ptr, lambda p, v: self.seq(p, v, self.param_type)),
            when=self.opt(raw, "when", ptr, self.when),
            algo=self.opt(raw, "algo", ptr, self.algo),
            args=self.opt(raw, "args", ptr, lambda p, v: self.seq(p, v, self.launch_arg)),
        )

    def when(self, ptr: str, raw: Any) -> m.When:
        raw = self.obj(ptr, raw, ("var",), ("min", "max"), "When")
        return m.When(self.string(f"{ptr}/var", raw["var"]),
                      self.opt(raw, "min", ptr, self.integer),
                      self.opt(raw, "max", ptr, self.integer))

    def algo(self, ptr: str, raw: Any) -> m.GemmAlgo:
        raw = self.obj(ptr, raw, m.ALGO_FIELDS, (), "GemmAlgo")
        kinds = {"id": "i32", "split_k": "i32", "inner_shape": "u16", "cluster_shape": "u16"}
        return m.GemmAlgo(**{k: self.integer(f"{ptr}/{k}", raw[k], kinds.get(k, "u32"))
                             for k in m.ALGO_FIELDS})

    def literal(self, ptr: str, raw: dict) -> m.Literal | None:
        """`{"i32": v}` and friends, when `raw` is such a one-key object."""
        if len(raw) != 1:
            return None
        (key, value), = raw.items()
        if key == "f32":
            return m.Literal("f32", self.number(f"{ptr}/f32", value))
        if key in ("i32", "i64", "u8"):
            return m.Literal(key, self.integer(f"{ptr}/{key}", value, key))
        return None

    def one_key(self, ptr: str, raw: Any, forms: dict[str, Callable[[str, Any], Any]],
                what: str) -> Any:
        """An untagged enum of one-key objects (launch args, call args, pack field sources)."""
        if isinstance(raw, dict):
            lit = self.literal(ptr, raw)
            if lit is not None:
                return lit
            keys = set(raw)
            for key, parse in forms.items():
                wanted = set(key.split("+"))
                if keys == wanted or (keys - wanted == set() and key.split("+")[0] in keys):
                    return parse(ptr, raw)
        self.fail(ptr, f"data did not match any variant of untagged enum {what}")

    def launch_arg(self, ptr: str, raw: Any) -> m.LaunchArg:
        return self.one_key(ptr, raw, {
            "param": lambda p, v: m.ParamRef(self.integer(f"{p}/param", v["param"], "usize")),
            "scratch": lambda p, v: m.ScratchRef(self.string(f"{p}/scratch", v["scratch"])),
            "rank": lambda p, v: m.RankArg(self.string(f"{p}/rank", v["rank"])),
            "pack": lambda p, v: self.pack(f"{p}/pack", v["pack"]),
        }, "LaunchArg")

    def pack(self, ptr: str, raw: Any) -> m.Pack:
        raw = self.obj(ptr, raw, ("size", "fields"), (), "Pack")
        return m.Pack(self.integer(f"{ptr}/size", raw["size"], "u32"),
                      self.seq(f"{ptr}/fields", raw["fields"], self.field))

    def field(self, ptr: str, raw: Any) -> m.Field:
        if not isinstance(raw, dict):
            self.fail(ptr, f"invalid type: {describe(raw)}, expected struct Field")
        sources = ("param", "scratch", "i32", "i64", "f32", "u8", "var", "expr", "rank",
                   "tensormap")
        raw = self.obj(ptr, raw, ("at",), ("width",) + sources, "Field")
        present = [k for k in sources if k in raw]
        if len(present) != 1:
            self.fail(ptr, "a field takes exactly one source: "
                      + ", ".join(f"`{k}`" for k in sources))
        key = present[0]
        return m.Field(at=self.integer(f"{ptr}/at", raw["at"], "u32"),
                       width=self.opt(raw, "width", ptr, lambda p, v: self.integer(p, v, "u32")),
                       source=self.field_source(ptr, key, raw[key]))

    def field_source(self, ptr: str, key: str, value: Any) -> m.FieldSource:
        where = f"{ptr}/{key}"
        if key in ("i32", "i64", "u8", "f32"):
            return self.literal(ptr, {key: value})  # type: ignore[return-value]
        if key == "param":
            return m.ParamRef(self.integer(where, value, "usize"))
        if key == "scratch":
            return m.ScratchRef(self.string(where, value))
        if key == "var":
            return m.VarArg(self.string(where, value))
        if key == "expr":
            return m.ExprArg(self.expr(where, value))
        if key == "rank":
            return m.RankArg(self.string(where, value))
        return self.tensormap(where, value)

    def tensormap(self, ptr: str, raw: Any) -> m.TensorMap:
        raw = self.obj(ptr, raw, ("param", "dtype", "dims", "box"),
                       ("strides", "swizzle", "l2_promotion", "oob_nan", "wrap"), "TensorMap")
        u32 = lambda p, v: self.integer(p, v, "u32")  # noqa: E731
        return m.TensorMap(
            param=self.integer(f"{ptr}/param", raw["param"], "usize"),
            dtype=self.enum(f"{ptr}/dtype", raw["dtype"], tuple(m.TENSORMAP_DTYPE_BITS),
                            "TensorMapDtype"),
            dims=self.seq(f"{ptr}/dims", raw["dims"], self.integer),
            box=self.seq(f"{ptr}/box", raw["box"], u32),
            strides=self.opt(raw, "strides", ptr, lambda p, v: self.seq(p, v, self.integer), ()),
            swizzle=self.opt(raw, "swizzle", ptr, u32, 0),
            l2_promotion=self.opt(raw, "l2_promotion", ptr, u32, 0),
            oob_nan=self.opt(raw, "oob_nan", ptr, self.boolean, False),
            wrap=self.opt(raw, "wrap", ptr, self.boolean, False),
        )

    # -------------------------------------------------------------- programs

    def program(self, ptr: str, raw: Any) -> m.Program:
        raw = self.obj(ptr, raw, ("calls",), ("batch", "once", "derive", "graph"), "Program")
        return m.Program(calls=self.seq(f"{ptr}/calls", raw["calls"], self.call),
                         batch=self.opt(raw, "batch", ptr, self.batch),
                         once=self.opt(raw, "once", ptr, self.boolean, False),
                         derive=self.opt(raw, "derive", ptr, self.boolean, False),
                         graph=self.opt(raw, "graph", ptr, self.boolean, False))

    def batch(self, ptr: str, raw: Any) -> m.Batch:
        raw = self.obj(ptr, raw, ("groups", "rows"), ("span", "context"), "Batch")
        return m.Batch(groups=self.integer(f"{ptr}/groups", raw["groups"]),
                       rows=self.dim(f"{ptr}/rows", raw["rows"]),
                       span=self.opt(raw, "span", ptr, self.string),
                       context=self.opt(raw, "context", ptr, self.string))

    def call(self, ptr: str, raw: Any) -> m.Call:
        raw = self.obj(ptr, raw, ("op", "args"), ("label",), "Call")
        return m.Call(op=self.string(f"{ptr}/op", raw["op"]),
                      args=self.seq(f"{ptr}/args", raw["args"], self.call_arg),
                      label=self.opt(raw, "label", ptr, self.string))

    def call_arg(self, ptr: str, raw: Any) -> m.CallArg:
        offset = lambda p, v: self.opt(v, "offset", p, self.integer)  # noqa: E731
        return self.one_key(ptr, raw, {
            "buf+offset": lambda p, v: m.BufArg(self.string(f"{p}/buf", v["buf"]), offset(p, v)),
            "state+offset": lambda p, v: m.StateArg(self.string(f"{p}/state", v["state"]),
                                                    offset(p, v)),
            "var": lambda p, v: m.VarArg(self.string(f"{p}/var", v["var"])),
            "expr": lambda p, v: m.ExprArg(self.expr(f"{p}/expr", v["expr"])),
            "rank": lambda p, v: m.RankArg(self.string(f"{p}/rank", v["rank"])),
        }, "Arg")


_BAD = object()


def parse_param_type(text: str, fail: Callable[[str], Any]) -> m.ParamType:
    """Parse `i32`, `bytes<16>`, `in state`, `out buffer<bf16>` (spec §1.8), kern's error texts."""
    body = text.strip()
    if body in m.SCALAR_TYPES:
        return m.ParamType("scalar", scalar=body)
    if body.startswith("bytes<") and body.endswith(">"):
        count = body[6:-1]
        # a usize, as kern parses it: ASCII digits (str.isdigit takes `²`), nonzero, < 2**64
        if not _BYTE_COUNT.fullmatch(count) or not 0 < int(count) < 2**64:
            return fail(f"invalid byte count in param type `{text}`")
        return m.ParamType("bytes", size=int(count))
    words = body.split(None, 1)
    if len(words) == 2 and _is_pointer_type(words[1]):
        if words[0] not in m.DIRECTIONS:
            return fail(f"invalid direction `{words[0]}` in param type `{text}`")
        return _pointer_type(words[0], words[1], text, fail)
    return fail(f"invalid param type `{text}`")


def _is_pointer_type(word: str) -> bool:
    return word.strip() == "state" or word.strip().startswith("buffer<")


def _pointer_type(direction: str, word: str, text: str, fail) -> m.ParamType:
    word = word.strip()
    if word == "state":
        return m.ParamType("state", direction=direction)
    dtype = word[len("buffer<"):-1] if word.endswith(">") else ""
    if dtype not in m.DTYPE_SIZES:
        return fail(f"invalid param type `{text}`")
    return m.ParamType("buffer", direction=direction, dtype=dtype)
