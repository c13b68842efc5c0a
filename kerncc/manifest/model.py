"""The manifest model of kern's wire format, schema v5 (spec §1), as frozen attrs classes.

The `Manifest` is the source of truth for everything downstream: maps are plain dicts (their
order is irrelevant; the writer sorts them as kern's BTreeMaps do), sequences are tuples, and
optional wire fields are `None` when absent so that a round trip keeps what was implicit
implicit. `load`/`loads` parse strictly (kerncc.manifest.reader) and `dumps` writes the canonical form
(kerncc.manifest.writer). Expressions, dims and bounds keep the wire's own small vocabulary:
an `Expr` is an `int`, a var name `str`, or `CeilDiv` / `Mul` / `Add`.
"""

from __future__ import annotations

from typing import Union

import attrs

SCHEMA_VERSION = 5

DTYPE_SIZES = {"bf16": 2, "f16": 2, "f32": 4, "fp8e4m3": 1, "fp8e8m0": 1, "i8": 1, "i32": 4,
               "u32": 4, "i64": 8, "u64": 8, "u8": 1}
FLOAT_DTYPES = frozenset({"bf16", "f16", "f32", "fp8e4m3", "fp8e8m0"})
BUFFER_KINDS = ("input", "output", "inout", "weight", "source", "workspace", "carry", "peer")
FILLS = ("token", "position", "valid", "slot", "seq_len", "cu_seqlens", "span_at", "blocks",
         "tokens", "count", "error")
OUTPUT_FILLS = frozenset({"tokens", "count", "error"})
AXES = ("rows", "groups", "tray")
SCALAR_TYPES = ("i32", "i64", "f32", "u8")
SCALAR_SIZES = {"i32": 4, "i64": 8, "f32": 4, "u8": 1}
DIRECTIONS = ("in", "out", "inout")
TENSORMAP_DTYPE_BITS = {"u8": 8, "u16": 16, "u32": 32, "i32": 32, "u64": 64, "i64": 64,
                        "f16": 16, "bf16": 16, "f32": 32, "tf32": 32, "u4": 4, "u4packed": 4}

# ---------------------------------------------------------------------------- expressions


@attrs.frozen
class CeilDiv:
    """`{"ceil_div": [expr, n]}`"""
    expr: Expr
    divisor: int


@attrs.frozen
class Mul:
    """`{"mul": [expr, n]}`"""
    expr: Expr
    factor: int


@attrs.frozen
class Add:
    """`{"add": [expr, expr]}`"""
    left: Expr
    right: Expr


Expr = Union[int, str, CeilDiv, Mul, Add]
Dim = Union[int, str]
Bound = Union[int, float, Expr]

U64_MAX = 2**64 - 1


class ExprError(Exception):
    """An expression that cannot be evaluated: kern's message is the exception text."""


def eval_expr(expr: Expr, env: dict[str, int]) -> int:
    """Evaluate in u64 with checked overflow, as kern does (spec §1.9)."""
    if isinstance(expr, bool):
        raise ExprError("invalid expression")
    if isinstance(expr, int):
        return expr
    if isinstance(expr, str):
        if expr not in env:
            raise ExprError(f"unknown var `{expr}`")
        return env[expr]
    if isinstance(expr, CeilDiv):
        if expr.divisor == 0:
            raise ExprError("division by zero")
        return -(-eval_expr(expr.expr, env) // expr.divisor)
    if isinstance(expr, Mul):
        return _checked(eval_expr(expr.expr, env) * expr.factor)
    return _checked(eval_expr(expr.left, env) + eval_expr(expr.right, env))


def _checked(value: int) -> int:
    if value > U64_MAX:
        raise ExprError("arithmetic overflow")
    return value


def expr_vars(expr: Expr) -> list[str]:
    """The var names an expression reads, in order of appearance."""
    if isinstance(expr, str):
        return [expr]
    if isinstance(expr, (CeilDiv, Mul)):
        return expr_vars(expr.expr)
    if isinstance(expr, Add):
        return expr_vars(expr.left) + expr_vars(expr.right)
    return []

# ---------------------------------------------------------------------------- declarations


@attrs.frozen
class Var:
    max: int
    axis: str | None = None


@attrs.frozen
class HostLayout:
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]


@attrs.frozen
class State:
    bytes_per_token: int = 0
    bytes: int = 0
    bytes_per_seq: int = 0
    host: HostLayout | None = None

    @property
    def is_owned(self) -> bool:
        return self.host is None

    @property
    def kind_triple(self) -> tuple[bool, bool, bool]:
        """What makes two states interchangeable for a page or line table (spec §3.6 step 6)."""
        return (self.bytes_per_token > 0, self.bytes_per_seq > 0, self.is_owned)


@attrs.frozen
class Ranked:
    """A per-rank choice: `{"group": g, "tensors": [...]}` or `{"group": g, "ranges": [...]}`."""
    group: str
    items: tuple


TensorSource = Union[str, Ranked]
Ranges = Union[tuple[int, int], Ranked]


@attrs.frozen
class Interleave:
    with_: TensorSource
    rows: int


@attrs.frozen
class Segment:
    tensor: TensorSource
    rows: Ranges | None = None
    cols: Ranges | None = None
    interleave: Interleave | None = None


@attrs.frozen
class Domain:
    min: Bound | None = None
    max: Bound | None = None
    index_into: str | None = None
    stride: int = 1
    monotone: bool = False


@attrs.frozen
class Buffer:
    dtype: str
    shape: tuple[Dim, ...]
    kind: str
    placement: str = "device"
    fill: str | None = None
    domain: Domain | None = None
    export: bool = False
    of: str | None = None
    group: str | None = None
    bind: tuple[Segment, ...] = ()

    def dims_at(self, vars_env: dict[str, int]) -> list[int]:
        return [d if isinstance(d, int) else vars_env[d] for d in self.shape]

    def nbytes(self, vars_env: dict[str, int]) -> int:
        size = DTYPE_SIZES[self.dtype]
        for d in self.dims_at(vars_env):
            size *= d
        return size


@attrs.frozen
class Module:
    source: str
    sha256: str

# ---------------------------------------------------------------------------- ops


@attrs.frozen
class ParamType:
    """One interface or launch param: a scalar, a `bytes<n>` pack, a state or a buffer<dtype>."""
    kind: str                      # "scalar" | "bytes" | "state" | "buffer"
    scalar: str | None = None      # i32 | i64 | f32 | u8 (kind scalar)
    size: int = 0                  # n of bytes<n>
    direction: str | None = None   # in | out | inout (state, buffer)
    dtype: str | None = None       # buffer element dtype

    def __str__(self) -> str:
        if self.kind == "scalar":
            return self.scalar or ""
        if self.kind == "bytes":
            return f"bytes<{self.size}>"
        if self.kind == "state":
            return f"{self.direction} state"
        return f"{self.direction} buffer<{self.dtype}>"

    @property
    def is_pointer(self) -> bool:
        return self.kind in ("state", "buffer")

    @property
    def reads(self) -> bool:
        return self.direction in ("in", "inout")

    @property
    def writes(self) -> bool:
        return self.direction in ("out", "inout")

    @property
    def abi_size(self) -> int:
        if self.is_pointer:
            return 8
        if self.kind == "bytes":
            return self.size
        return SCALAR_SIZES[self.scalar or "i32"]


@attrs.frozen
class Scratch:
    dtype: str
    shape: tuple[Dim, ...]


@attrs.frozen
class When:
    var: str
    min: int | None = None
    max: int | None = None


@attrs.frozen
class GemmAlgo:
    id: int
    tile: int
    stages: int
    split_k: int
    reduction: int
    swizzle: int
    custom: int
    inner_shape: int
    cluster_shape: int


ALGO_FIELDS = ("id", "tile", "stages", "split_k", "reduction", "swizzle", "custom",
               "inner_shape", "cluster_shape")


@attrs.frozen
class Literal:
    """`{"i32": v}`, `{"i64": v}`, `{"f32": v}`, `{"u8": v}` (call arg, launch arg or pack field)."""
    type: str
    value: int | float


@attrs.frozen
class ParamRef:
    """`{"param": i}`: forward interface param i."""
    index: int


@attrs.frozen
class ScratchRef:
    name: str


@attrs.frozen
class RankArg:
    group: str


@attrs.frozen
class VarArg:
    name: str


@attrs.frozen
class ExprArg:
    expr: Expr


@attrs.frozen
class TensorMap:
    param: int
    dtype: str
    dims: tuple[int, ...]
    box: tuple[int, ...]
    strides: tuple[int, ...] = ()
    swizzle: int = 0
    l2_promotion: int = 0
    oob_nan: bool = False
    wrap: bool = False


FieldSource = Union[ParamRef, ScratchRef, Literal, VarArg, ExprArg, RankArg, TensorMap]


@attrs.frozen
class Field:
    at: int
    source: FieldSource
    width: int | None = None


@attrs.frozen
class Pack:
    size: int
    fields: tuple[Field, ...]


LaunchArg = Union[ParamRef, ScratchRef, Literal, RankArg, Pack]


@attrs.frozen
class KernelLaunch:
    module: str
    entry: str
    block: tuple[int, int, int]
    grid: tuple[Expr, Expr, Expr]
    params: tuple[ParamType, ...] | None = None
    shared_mem: Expr | None = None
    cluster: tuple[int, int, int] | None = None
    pdl: bool | None = None
    when: When | None = None
    args: tuple[LaunchArg, ...] | None = None


@attrs.frozen
class ExternLaunch:
    entry: str
    params: tuple[ParamType, ...] | None = None
    when: When | None = None
    algo: GemmAlgo | None = None
    args: tuple[LaunchArg, ...] | None = None


Launch = Union[KernelLaunch, ExternLaunch]


def launch_params(launch: Launch, op: Op) -> tuple[ParamType, ...]:
    """The launch ABI: its own `params`, or the op's interface when left implicit."""
    return op.params if launch.params is None else launch.params


def launch_args(launch: Launch, op: Op) -> tuple[LaunchArg, ...]:
    """The launch wiring: its own `args`, or the op's params forwarded in order.

    Forwarding counts the op's params, not the launch's own: a launch declaring its own ABI
    without wiring it is an arity error in kern (`takes N params, got M args`).
    """
    if launch.args is not None:
        return launch.args
    return tuple(ParamRef(i) for i in range(len(op.params)))


@attrs.frozen
class Op:
    params: tuple[ParamType, ...]
    launches: tuple[Launch, ...]
    scratch: dict[str, Scratch] = attrs.field(factory=dict)

# ---------------------------------------------------------------------------- programs


@attrs.frozen
class BufArg:
    name: str
    offset: int | None = None


@attrs.frozen
class StateArg:
    name: str
    offset: int | None = None


CallArg = Union[BufArg, StateArg, VarArg, ExprArg, Literal, RankArg]


@attrs.frozen
class Call:
    op: str
    args: tuple[CallArg, ...]
    label: str | None = None


@attrs.frozen
class Batch:
    groups: int
    rows: Dim
    span: str | None = None
    context: str | None = None


@attrs.frozen
class Program:
    calls: tuple[Call, ...]
    batch: Batch | None = None
    once: bool = False
    derive: bool = False
    graph: bool = False

    @property
    def driven(self) -> bool:
        return self.batch is not None


@attrs.frozen
class Cut:
    id: str
    stage: int
    stages: int


@attrs.frozen
class Manifest:
    schema_version: int
    model: str
    buffers: dict[str, Buffer]
    modules: dict[str, Module]
    ops: dict[str, Op]
    programs: dict[str, Program]
    topology: dict[str, int] | None = None
    cut: Cut | None = None
    vars: dict[str, Var] = attrs.field(factory=dict)
    states: dict[str, State] = attrs.field(factory=dict)

    def vars_max(self) -> dict[str, int]:
        return {name: var.max for name, var in self.vars.items()}

    def vars_min(self) -> dict[str, int]:
        return {name: 1 for name in self.vars}

    def driven_programs(self) -> list[str]:
        return sorted(name for name, p in self.programs.items() if p.driven)

    def seq_slots(self) -> int:
        """Slots of per-sequence states (spec §1.12): the widest table over them, plus 2."""
        best = 1
        for buf in self.buffers.values():
            target = buf.domain.index_into if buf.domain else None
            if buf.kind != "input" or target not in self.states:
                continue
            if self.states[target].bytes_per_seq == 0 or len(buf.shape) < 2:
                continue
            dim = buf.shape[1]
            best = max(best, self.vars[dim].max if isinstance(dim, str) and dim in self.vars
                       else dim if isinstance(dim, int) else 1)
        return max(best, 1) + 2
