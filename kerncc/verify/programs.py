"""Rule group 8 of the verifier: programs, calls and dataflow (spec §2.1 rule 8).

Owns, per program in name order: the flags (`once`, `batch`, `derive`, `graph`), the batch,
and every call: its op, the derive refusal of collectives, arity, and each arg against its
interface param (buffers: dtype, offset, read-before-written in this program, tensormap
footprints, source/derive/peer/read-only rules; states; vars, expressions, literals, ranks).
After all programs: every output and carry buffer written by some program. Records in
`checker.used` the ops called, the buffers and states calls bind, and the vars calls and
batches read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from kerncc import manifest as m
from kerncc.diagnostics import pointer
from kerncc.verify.wiring import TensorMapUse, describe_arg, literal_fits, op_tensormaps

if TYPE_CHECKING:
    from kerncc.verify.checker import Checker

# Per program, what holds a value before its first call: the host, the loader or another
# program wrote it (carry: the caller sequences programs). Workspaces and outputs start empty.
WRITTEN_AT_START = frozenset({"input", "inout", "weight", "source", "carry", "peer"})
READ_ONLY_KINDS = frozenset({"input", "weight", "source", "peer"})
# What a derive program cannot touch: it runs inside weight loading, before any run.
RUN_KINDS = frozenset({"input", "output", "inout", "peer"})
SCALAR_MAX = {"i32": 2**31 - 1, "i64": 2**63 - 1, "u8": 255}


def check_programs(checker: Checker) -> None:
    """Rule group 8: every program, then the outputs and carries no program writes."""
    if not checker.m.programs:
        checker.error("no programs declared", "/programs")
    scan = ProgramScan.start(checker)
    for name in sorted(checker.m.programs):
        scan.check_program(name, checker.m.programs[name])
    for name in sorted(checker.m.buffers):
        kind = checker.m.buffers[name].kind
        if kind in ("output", "carry") and name not in scan.written_anywhere:
            checker.error(f"{kind} buffer `{name}` is never written by any program",
                          pointer("buffers", name))


def buffer_size(buf: m.Buffer, env_max: dict[str, int]) -> int | None:
    """Bytes at var upper bounds; None when rule 5 rejects the shape (it reports why)."""
    if not buf.shape:
        return None
    size = m.DTYPE_SIZES[buf.dtype]
    for dim in buf.shape:
        extent = dim if isinstance(dim, int) else env_max.get(dim, 0)
        if extent == 0:
            return None
        size *= extent
    return size if size <= m.U64_MAX else None


@attrs.define
class ProgramScan:
    """State across programs (sizes, footprints, buffers written anywhere) and per program."""

    checker: Checker
    sizes: dict[str, int]
    tensormaps: dict[str, list[TensorMapUse]]
    written_anywhere: set[str] = attrs.field(factory=set)
    name: str = ""
    program: m.Program = attrs.field(factory=lambda: m.Program(calls=()))
    written: set[str] = attrs.field(factory=set)

    @classmethod
    def start(cls, checker: Checker) -> ProgramScan:
        sizes = {name: buffer_size(buf, checker.env_max) for name, buf in checker.m.buffers.items()}
        tensormaps = {name: op_tensormaps(name, op) for name, op in checker.m.ops.items()}
        return cls(checker, {k: v for k, v in sizes.items() if v is not None}, tensormaps)

    def error(self, message: str, ptr: str) -> None:
        self.checker.error(message, ptr)

    # ------------------------------------------------------------ programs

    def check_program(self, name: str, program: m.Program) -> None:
        self.name, self.program = name, program
        self.written = {b for b, buf in self.checker.m.buffers.items()
                        if buf.kind in WRITTEN_AT_START}
        self._check_flags()
        if program.batch is not None:
            self._check_batch(program.batch)
        for index, call in enumerate(program.calls):
            self._check_call(index, call)

    def _check_flags(self) -> None:
        p, ctx = self.program, f"program `{self.name}`"
        ptr = pointer("programs", self.name)
        if p.once and p.batch is not None:
            self.error(f"{ctx}: `once` (run after load) and `batch` (driven per step) are "
                       "exclusive", f"{ptr}/once")
        if p.derive and (p.once or p.batch is not None or p.graph):
            self.error(f"{ctx}: `derive` (run inside weight loading) excludes `once`, `batch` "
                       "and `graph`", f"{ptr}/derive")
        if p.graph and p.batch is None:
            self.error(f"{ctx}: `graph` (captured per call shape) needs a `batch` (a program a "
                       "serving loop drives)", f"{ptr}/graph")

    def _check_batch(self, batch: m.Batch) -> None:
        ctx, ptr = f"program `{self.name}`", pointer("programs", self.name, "batch")
        if batch.groups < 1:
            self.error(f"{ctx}: batch.groups must be >= 1", f"{ptr}/groups")
        if batch.rows == 0:
            self.error(f"{ctx}: batch.rows must be >= 1", f"{ptr}/rows")
        named = (("rows", batch.rows), ("span", batch.span), ("context", batch.context))
        for field, var in named:
            if isinstance(var, str):
                self._check_batch_var(ctx, f"{ptr}/{field}", field, var)

    def _check_batch_var(self, ctx: str, ptr: str, field: str, var: str) -> None:
        self.checker.used.vars.add(var)
        if var not in self.checker.m.vars:
            self.error(f"{ctx}: batch.{field} names unknown var `{var}`", ptr)

    # ------------------------------------------------------------ calls

    def _check_call(self, index: int, call: m.Call) -> None:
        ctx = f"program `{self.name}` call #{index}"
        if call.label is not None:
            ctx += f" ({call.label})"
        ptr = pointer("programs", self.name, "calls", index)
        op = self.checker.m.ops.get(call.op)
        if op is None:
            self.error(f"{ctx}: unknown op `{call.op}`", f"{ptr}/op")
            return
        self.checker.used.ops.add(call.op)
        if self.program.derive and _is_collective(op):
            self.error(f"{ctx}: a `derive` program runs before any group is joined; op "
                       f"`{call.op}` is a collective", f"{ptr}/op")
        if len(call.args) != len(op.params):
            self.error(f"{ctx}: op `{call.op}` takes {len(op.params)} params, got "
                       f"{len(call.args)} args", f"{ptr}/args")
            return
        for j, (arg, param) in enumerate(zip(call.args, op.params)):
            self._check_arg(call.op, op, j, f"{ctx}: arg #{j}", f"{ptr}/args/{j}", arg, param)

    def _check_arg(self, op_name: str, op: m.Op, j: int, ctx: str, ptr: str, arg: m.CallArg,
                   param: m.ParamType) -> None:
        """The interface param's type decides which arg forms are legal."""
        scalar = param.kind == "scalar"
        if isinstance(arg, m.BufArg) and param.kind == "buffer":
            self._check_buffer_arg(op_name, op, j, ctx, ptr, arg, param)
        elif isinstance(arg, m.StateArg) and param.kind == "state":
            self._check_state_arg(ctx, ptr, arg.name)
        elif isinstance(arg, m.VarArg) and scalar:
            self._check_var_arg(ctx, ptr, arg.name, param.scalar)
        elif isinstance(arg, m.ExprArg) and scalar:
            self._check_expr_arg(ctx, ptr, arg.expr, param.scalar)
        elif isinstance(arg, m.RankArg) and scalar and param.scalar in ("i32", "i64"):
            self.checker.check_group(ptr, ctx, arg.group)
        elif not (isinstance(arg, m.Literal) and literal_fits(arg, param)):
            self.error(f"{ctx}: {describe_arg(arg)} does not match param `{param}`", ptr)

    def _check_state_arg(self, ctx: str, ptr: str, name: str) -> None:
        # State offsets are layout arithmetic over a runtime-scaled pool: nothing to bound.
        self.checker.used.states.add(name)
        if self.program.derive:
            self.error(f"{ctx}: a `derive` program runs inside weight loading, before state "
                       f"`{name}` holds anything", ptr)
        if name not in self.checker.m.states:
            self.error(f"{ctx}: unknown state `{name}`", ptr)

    def _check_var_arg(self, ctx: str, ptr: str, name: str, scalar: str) -> None:
        self.checker.used.vars.add(name)
        var = self.checker.m.vars.get(name)
        if var is None:
            self.error(f"{ctx}: unknown var `{name}`", ptr)
        elif scalar == "f32":
            self.error(f"{ctx}: var `{name}` cannot bind to an f32 param", ptr)
        elif var.max > SCALAR_MAX[scalar]:
            self.error(f"{ctx}: var `{name}` max {var.max} exceeds {scalar} range", ptr)

    def _check_expr_arg(self, ctx: str, ptr: str, expr: m.Expr, scalar: str) -> None:
        self.checker.check_expr(ptr, ctx, expr)
        if scalar == "f32":
            self.error(f"{ctx}: an expression cannot bind to an f32 param", ptr)
            return
        value = self.checker.eval(expr, self.checker.env_max)
        if isinstance(value, int) and value > SCALAR_MAX[scalar]:
            self.error(f"{ctx}: expression reaches {value} at var upper bounds, exceeding "
                       f"{scalar} range", ptr)

    # ------------------------------------------------------------ buffer args

    def _check_buffer_arg(self, op_name: str, op: m.Op, j: int, ctx: str, ptr: str,
                          arg: m.BufArg, param: m.ParamType) -> None:
        self.checker.used.buffers.add(arg.name)
        buf = self.checker.m.buffers.get(arg.name)
        if buf is None:
            self.error(f"{ctx}: unknown buffer `{arg.name}`", ptr)
            return
        if buf.dtype != param.dtype:
            self.error(f"{ctx}: buffer `{arg.name}` has dtype {buf.dtype} but param expects "
                       f"{param.dtype}", ptr)
        offset = arg.offset or 0
        if offset:
            self._check_offset(ctx, ptr, arg.name, buf, offset)
        if param.reads and arg.name not in self.written:
            self.error(f"{ctx}: buffer `{arg.name}` is read before ever being written", ptr)
        self._check_footprints(op_name, j, ctx, ptr, arg.name, offset)
        self._check_buffer_kind(op_name, op, ctx, ptr, arg.name, buf.kind)
        if param.writes:
            self._record_write(ctx, ptr, arg.name, buf.kind)

    def _check_offset(self, ctx: str, ptr: str, name: str, buf: m.Buffer, offset: int) -> None:
        align = m.DTYPE_SIZES[buf.dtype]
        if offset % align:
            self.error(f"{ctx}: offset {offset} into buffer `{name}` is not {align}-aligned for "
                       f"{buf.dtype}", ptr)
        size = self.sizes.get(name)
        if size is not None and offset >= size:
            self.error(f"{ctx}: offset {offset} is outside buffer `{name}` ({size} bytes at var "
                       "upper bounds)", ptr)

    def _check_footprints(self, op_name: str, j: int, ctx: str, ptr: str, name: str,
                          offset: int) -> None:
        """Every tensormap the op builds over this param fits what the buffer holds."""
        size = self.sizes.get(name)
        if size is None:
            return
        available = max(size - offset, 0)
        for use in self.tensormaps.get(op_name, []):
            if use.param == j and use.footprint > available:
                self.error(f"{ctx}: {use.context} addresses {use.footprint} bytes but buffer "
                           f"`{name}` has {available} bytes past offset {offset} at var upper "
                           "bounds", ptr)

    def _check_buffer_kind(self, op_name: str, op: m.Op, ctx: str, ptr: str, name: str,
                           kind: str) -> None:
        """Sources belong to derive programs; derive programs touch no run-time buffer."""
        derive = self.program.derive
        if kind == "source" and not derive:
            self.error(f"{ctx}: source buffer `{name}` is read only by a `derive` program; it "
                       "is gone after load", ptr)
        if kind in RUN_KINDS and derive:
            self.error(f"{ctx}: a `derive` program runs inside weight loading, before any input "
                       f"buffer such as `{name}` means anything", ptr)
        if kind == "peer" and any(isinstance(launch, m.ExternLaunch) for launch in op.launches):
            self.error(f"{ctx}: peer buffer `{name}` passed to op `{op_name}`, which has an "
                       "extern launch; runtime built-ins never receive peer memory", ptr)

    def _record_write(self, ctx: str, ptr: str, name: str, kind: str) -> None:
        if kind in READ_ONLY_KINDS:
            self.error(f"{ctx}: op writes to read-only {kind} buffer `{name}`", ptr)
        self.written.add(name)
        self.written_anywhere.add(name)


def _is_collective(op: m.Op) -> bool:
    return any(launch.entry.startswith("extern:nccl") for launch in op.launches)
