"""Launch sites: plan.json's launch records turned, once at load, into ready argument lists.

A `Site` is one launch of one call of one program (docs/bundle.md: `site` numbers every launch
of a stage). At load every argument that does not read vars is fixed: pointers become the
backend's pointer values (the Session's `resolve` maps a `ptr` record to one), literal scalars
become numpy scalars, ranks become 0 (one device). What reads vars stays a `VarScalar` (or a
`Pack` holding some); at each launch `Site.bind(scalars)` fills them in, in argument order, from
the values stage.py passes (`var_values` computes the same values from the vars when the plan is
interpreted). Malformed records are KernccErrors naming plan.json and the record's pointer.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import numpy as np

from kerncc import manifest as m
from kerncc.diagnostics import Diagnostic, KernccError, Location

SCALARS = {"i32": np.int32, "i64": np.int64, "f32": np.float32, "u8": np.uint8}
INTEGER_RANGES = {"i32": (-2**31, 2**31 - 1), "i64": (-2**63, 2**63 - 1), "u8": (0, 255)}



class Resolver(Protocol):
    """What parsing needs from the Session's memory: pointers, and their bytes in a pack."""

    def pointer(self, record: dict, program: str) -> Any: ...

    def address(self, pointer: Any) -> int: ...

    def tensormap(self, pointer: Any, record: dict) -> bytes: ...


class PlanError(Exception):
    """A malformed launch record; the loader adds the file and pointer."""


def plan_error(path: str, ptr: str, message: str) -> KernccError:
    return KernccError(f"cannot load `{path}`:", [Diagnostic(message, Location(ptr, file=path))])


# ---------------------------------------------------------------------------------- values


def expr(raw: Any) -> m.Expr:
    """A plan record's JSON expression as the manifest model's Expr."""
    if isinstance(raw, bool):
        raise PlanError(f"invalid expression {raw!r}")
    if isinstance(raw, (int, str)):
        return raw
    if not isinstance(raw, dict) or len(raw) != 1:
        raise PlanError(f"invalid expression {raw!r}")
    (key, body), = raw.items()
    if key not in ("ceil_div", "mul", "add") or not isinstance(body, list) or len(body) != 2:
        raise PlanError(f"invalid expression {raw!r}")
    if key == "add":
        return m.Add(expr(body[0]), expr(body[1]))
    if not isinstance(body[1], int):
        raise PlanError(f"invalid expression {raw!r}")
    return m.CeilDiv(expr(body[0]), body[1]) if key == "ceil_div" else m.Mul(expr(body[0]), body[1])


def evaluate(e: m.Expr, env: dict[str, int]) -> int:
    try:
        return m.eval_expr(e, env)
    except m.ExprError as err:
        raise KernccError.single(f"cannot evaluate {e!r}: {err}") from None


def scalar(type_: str, value: float) -> np.generic:
    """A numpy scalar of param type `type_`; integers must fit (no silent wrap)."""
    if type_ not in SCALARS:
        raise PlanError(f"unknown scalar type `{type_}`")
    if type_ in INTEGER_RANGES:
        lo, hi = INTEGER_RANGES[type_]
        if int(value) != value or not lo <= int(value) <= hi:
            raise PlanError(f"{value} does not fit a `{type_}` scalar")
        return SCALARS[type_](int(value))
    return SCALARS[type_](value)


@attrs.frozen
class VarScalar:
    """A scalar whose value reads vars: filled in at each launch."""

    type: str
    expr: m.Expr


@attrs.frozen
class PackField:
    at: int
    width: int
    value: bytes | VarScalar


@attrs.frozen
class Pack:
    """A `bytes<n>` argument; fields that read vars are encoded at each launch."""

    size: int
    fields: tuple[PackField, ...]

    @property
    def var_fields(self) -> list[VarScalar]:
        return [f.value for f in self.fields if isinstance(f.value, VarScalar)]

    def encode(self, scalars: Sequence[int]) -> bytes:
        out = bytearray(self.size)
        values = iter(scalars)
        for f in self.fields:
            data = f.value
            if isinstance(data, VarScalar):
                data = _scalar_bytes(data.type, next(values))
            out[f.at:f.at + f.width] = data[:f.width].ljust(f.width, b"\0")
        return bytes(out)


def _scalar_bytes(type_: str, value: float) -> bytes:
    try:
        return scalar(type_, value).tobytes()
    except PlanError as err:
        raise KernccError.single(str(err)) from None


# ---------------------------------------------------------------------------------- sites


@attrs.frozen
class Site:
    """One launch record, its fixed arguments resolved."""

    number: int
    program: str
    call: int
    label: str | None
    op: str
    launch: int
    kind: str  # kernel | extern
    entry: str
    module: str | None
    block: tuple[int, int, int]
    grid: tuple[m.Expr, ...]
    shared_mem: m.Expr
    when: m.When | None
    args: tuple[Any, ...]

    @property
    def extern_name(self) -> str:
        return self.entry.removeprefix("extern:")

    def where(self) -> str:
        label = f"`{self.label}`, " if self.label else ""
        return (f"program `{self.program}` call {self.call} ({label}op `{self.op}`) "
                f"launch {self.launch} (site {self.number})")

    def gated_off(self, env: dict[str, int]) -> bool:
        """Whether `when` keeps this launch from running at these vars."""
        w = self.when
        if w is None:
            return False
        value = env.get(w.var, 1)
        return (w.min is not None and value < w.min) or (w.max is not None and value > w.max)

    def grid_at(self, env: dict[str, int]) -> tuple[int, int, int]:
        x, y, z = (evaluate(e, env) for e in self.grid)
        return (x, y, z)

    def var_values(self, env: dict[str, int]) -> tuple[int, ...]:
        """The values stage.py passes as `scalars`: every var-reading arg, in argument order."""
        return tuple(evaluate(v.expr, env) for v in self.var_scalars())

    def vars_read(self) -> set[str]:
        """Every var this launch depends on: grid, shared memory, scalars and its gate."""
        found: set[str] = set()
        for e in (*self.grid, self.shared_mem, *(v.expr for v in self.var_scalars())):
            found.update(m.expr_vars(e))
        if self.when is not None:
            found.add(self.when.var)
        return found

    def var_scalars(self) -> list[VarScalar]:
        found: list[VarScalar] = []
        for arg in self.args:
            if isinstance(arg, VarScalar):
                found.append(arg)
            elif isinstance(arg, Pack):
                found.extend(arg.var_fields)
        return found

    def bind(self, scalars: Sequence[int]) -> list[Any]:
        """The launch's args with the var-reading ones filled in from `scalars`."""
        expected = len(self.var_scalars())
        if len(scalars) != expected:
            raise KernccError.single(f"{self.where()}: stage.py passes {len(scalars)} "
                                     f"var-dependent scalars, plan.json has {expected}")
        values = iter(scalars)
        out: list[Any] = []
        for arg in self.args:
            if isinstance(arg, VarScalar):
                out.append(_bound_scalar(self, arg, next(values)))
            elif isinstance(arg, Pack):
                out.append(arg.encode([next(values) for _ in arg.var_fields]))
            else:
                out.append(arg)
        return out


def _bound_scalar(site: Site, arg: VarScalar, value: int) -> np.generic:
    try:
        return scalar(arg.type, value)
    except PlanError as err:
        raise KernccError.single(f"{site.where()}: {err}") from None


# ---------------------------------------------------------------------------------- parsing


def parse_sites(plan: dict, resolve: Resolver) -> dict[str, list[Site]]:
    """Every program's sites in launch order (call order, then launch order)."""
    out: dict[str, list[Site]] = {}
    for name, program in plan["programs"].items():
        sites: list[Site] = []
        for c, call in enumerate(program.get("calls", [])):
            for j, record in enumerate(call.get("launches", [])):
                ptr = f"/programs/{name}/calls/{c}/launches/{j}"
                sites.append(_site(name, call, j, record, resolve, ptr))
        out[name] = sites
    return out


def _site(program: str, call: dict, j: int, record: dict, resolve: Resolver, ptr: str) -> Site:
    try:
        return _parse_site(program, call, j, record, resolve)
    except PlanError as err:
        raise PlanError(f"{ptr}: {err}") from None
    except (KeyError, TypeError, ValueError) as err:
        raise PlanError(f"{ptr}: malformed launch record ({type(err).__name__}: {err})") from None


def _parse_site(program: str, call: dict, j: int, record: dict, resolve: Resolver) -> Site:
    kind = _typed(record.get("kind", "kernel"), str, "kind")
    if kind not in ("kernel", "extern"):
        raise PlanError(f"unknown launch kind {kind!r}")
    kernel = kind == "kernel"
    grid = tuple(expr(g) for g in record["grid"]) if kernel else (1, 1, 1)
    block = tuple(int(b) for b in record["block"]) if kernel else (1, 1, 1)
    if len(grid) != 3 or len(block) != 3:
        raise PlanError("grid and block need 3 entries")
    return Site(
        number=_typed(record["site"], int, "site"), program=program,
        call=_typed(call.get("index", 0), int, "index"),
        label=_typed(call.get("label"), (str, type(None)), "label"),
        op=_typed(call.get("op", "?"), str, "op"), launch=j, kind=kind,
        entry=_typed(record["entry"], str, "entry"),
        module=_typed(record.get("module"), (str, type(None)), "module"),
        block=block, grid=grid, shared_mem=expr(record.get("shared_mem") or 0),  # type: ignore[arg-type]
        when=_when(record.get("when")),
        args=tuple(_arg(a, program, resolve) for a in record.get("args", [])))


def _typed(value: Any, kinds: type | tuple[type, ...], what: str) -> Any:
    """`value` when it is of `kinds` (a bool is not an int); else a PlanError naming `what`."""
    if isinstance(value, kinds) and not isinstance(value, bool):
        return value
    raise PlanError(f"`{what}` is {value!r}")


def _when(raw: Any) -> m.When | None:
    if not raw:
        return None
    bound = (int, type(None))
    return m.When(_typed(raw["var"], str, "when.var"), _typed(raw.get("min"), bound, "when.min"),
                  _typed(raw.get("max"), bound, "when.max"))


def _arg(raw: dict, program: str, resolve: Resolver) -> Any:
    if "ptr" in raw:
        return resolve.pointer(raw["ptr"], program)
    if "scalar" in raw:
        return _scalar_arg(raw["scalar"])
    if "pack" in raw:
        return _pack(raw["pack"], program, resolve)
    raise PlanError(f"unknown launch argument {raw!r}")


def _scalar_arg(raw: dict) -> np.generic | VarScalar:
    type_ = raw["type"]
    if "var" in raw:
        return VarScalar(type_, expr(raw["var"]))
    if "expr" in raw:
        return VarScalar(type_, expr(raw["expr"]))
    if "rank" in raw:
        return scalar(type_, 0)  # one device: rank 0 of every group
    return scalar(type_, raw["value"])


def _pack(raw: dict, program: str, resolve: Resolver) -> Pack:
    fields = tuple(_field(f, program, resolve) for f in raw["fields"])
    return Pack(int(raw["size"]), fields)


def _field(raw: dict, program: str, resolve: Resolver) -> PackField:
    at = int(raw["at"])
    if "ptr" in raw:
        address = resolve.address(resolve.pointer(raw["ptr"], program))
        return PackField(at, int(raw.get("width", 8)), struct.pack("<Q", address))
    if "scalar" in raw:
        value = _scalar_arg(raw["scalar"])
        width = int(raw.get("width", np.dtype(SCALARS[raw["scalar"]["type"]]).itemsize))
        data = value if isinstance(value, VarScalar) else value.tobytes()
        return PackField(at, width, data)
    if "tensormap" in raw:
        tm = raw["tensormap"]
        data = resolve.tensormap(resolve.pointer(tm["ptr"], program), tm)
        return PackField(at, int(raw.get("width", 128)), data)
    raise PlanError(f"unknown pack field {raw!r}")
