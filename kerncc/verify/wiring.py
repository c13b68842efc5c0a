"""Rule group 7, wiring: each launch arg against its launch param (spec §2.1 rule 7).

Updates the impl-level dataflow of one op (`checker.OpFlow`: interface `out` params and scratch
start unwritten and are written by launches in order), the checks of `{"param"}`, `{"scratch"}`,
literal and `{"rank"}` launch args (packs go to `packs`), kern's display strings of
launch and call args, and `op_tensormaps`: the tensormap footprints rule 8 checks per call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from kerncc import manifest as m
from kerncc.verify import packs as verify_packs

from kerncc.verify.checker import OpFlow

if TYPE_CHECKING:
    from kerncc.verify.checker import Checker


@attrs.frozen
class TensorMapUse:
    """A tensormap field whose footprint a call's buffer must hold (rule 8)."""

    param: int
    footprint: int
    context: str


def launch_context(op_name: str, index: int, launch: m.Launch) -> str:
    return f"op `{op_name}` launch #{index} ({launch.entry})"


def check_launch_args(checker: Checker, flow: OpFlow, ctx: str, ptr: str, launch: m.Launch) -> None:
    """Every arg of a launch whose arity already matched its params."""
    params = m.launch_params(launch, flow.op)
    args = m.launch_args(launch, flow.op)
    for j, (arg, param) in enumerate(zip(args, params)):
        # Defaulted wiring has no JSON of its own: point at the launch.
        arg_ptr = f"{ptr}/args/{j}" if launch.args is not None else ptr
        check_launch_arg(checker, flow, f"{ctx}: arg #{j}", arg_ptr, arg, param)


def check_launch_arg(checker: Checker, flow: OpFlow, ctx: str, ptr: str, arg: m.LaunchArg,
                     param: m.ParamType) -> None:
    if isinstance(arg, m.ParamRef):
        _check_param_arg(checker, flow, ctx, ptr, arg.index, param)
    elif isinstance(arg, m.ScratchRef):
        _check_scratch_arg(checker, flow, ctx, ptr, arg.name, param)
    elif isinstance(arg, m.RankArg):
        check_rank(checker, ctx, ptr, arg.group, param)
    elif isinstance(arg, m.Pack):
        verify_packs.check_pack(checker, flow, ctx, ptr, arg, param)
    elif not (isinstance(arg, m.Literal) and literal_fits(arg, param)):
        checker.error(f"{ctx}: {describe_arg(arg)} does not match launch param `{param}`", ptr)


def literal_fits(arg: m.Literal, param: m.ParamType) -> bool:
    """Literals bind to the scalar of exactly their type."""
    return param.kind == "scalar" and param.scalar == arg.type


def check_rank(checker: Checker, ctx: str, ptr: str, group: str, param: m.ParamType) -> None:
    if not (param.kind == "scalar" and param.scalar in ("i32", "i64")):
        checker.error(f"{ctx}: a rank binds only to an i32 or i64 param, not `{param}`", ptr)
    checker.check_group(ptr, ctx, group)


def _compatible(iface: m.ParamType, param: m.ParamType) -> bool:
    """Same kind; buffers of one dtype, scalars of one type (directions are checked apart)."""
    if iface.kind != param.kind or iface.kind == "bytes":
        return False
    return iface.dtype == param.dtype and iface.scalar == param.scalar


def _check_param_arg(checker: Checker, flow: OpFlow, ctx: str, ptr: str, index: int,
                     param: m.ParamType) -> None:
    iface = verify_packs.interface_param(checker, flow.op, ctx, ptr, index)
    if iface is None:
        return
    if not _compatible(iface, param):
        checker.error(f"{ctx}: interface param `{iface}` does not match launch param `{param}`",
                      ptr)
        return
    if not iface.is_pointer:
        return
    if param.writes and iface.direction == "in":
        checker.error(f"{ctx}: launch writes through interface `in` param #{index}", ptr)
    if param.reads and not flow.written[index]:
        checker.error(f"{ctx}: interface `out` param #{index} read before any launch wrote it",
                      ptr)
    if param.writes:
        flow.written[index] = True


def _check_scratch_arg(checker: Checker, flow: OpFlow, ctx: str, ptr: str, name: str,
                       param: m.ParamType) -> None:
    decl = flow.op.scratch.get(name)
    if decl is None:
        checker.error(f"{ctx}: unknown scratch `{name}`", ptr)
        return
    flow.scratch_used.add(name)
    if param.kind != "buffer":
        checker.error(f"{ctx}: scratch `{name}` bound to non-buffer param `{param}`", ptr)
        return
    if decl.dtype != param.dtype:
        checker.error(f"{ctx}: scratch `{name}` has dtype {decl.dtype} but param expects "
                      f"{param.dtype}", ptr)
    if param.reads and name not in flow.scratch_written:
        checker.error(f"{ctx}: scratch `{name}` is read before any launch wrote it", ptr)
    if param.writes:
        flow.scratch_written.add(name)

# ---------------------------------------------------------------------------- display


def describe_arg(arg: m.LaunchArg | m.CallArg) -> str:
    """kern's display of a launch or call arg, as its `does not match` messages print it."""
    if isinstance(arg, (m.BufArg, m.StateArg)):
        kind = "buffer" if isinstance(arg, m.BufArg) else "state"
        offset = f"+{arg.offset}" if arg.offset else ""
        return f"{kind} `{arg.name}`{offset}"
    if isinstance(arg, m.Literal):
        return f"{arg.type} literal {format_literal(arg)}"
    simple = {m.VarArg: lambda a: f"var `{a.name}`", m.ExprArg: lambda a: "expression",
              m.RankArg: lambda a: f"rank in group `{a.group}`",
              m.ParamRef: lambda a: f"interface param #{a.index}",
              m.ScratchRef: lambda a: f"scratch `{a.name}`",
              m.Pack: lambda a: f"pack of {a.size} bytes"}
    return simple[type(arg)](arg)


def format_literal(arg: m.Literal) -> str:
    """The value as Rust prints it; an f32 is rounded to f32 and printed shortest, positional."""
    if arg.type != "f32":
        return str(arg.value)
    import numpy as np  # here, not at the top: `kerncc verify` of a valid manifest needs none

    with np.errstate(over="ignore"):
        return np.format_float_positional(np.float32(arg.value), trim="-")

# ---------------------------------------------------------------------------- footprints


def op_tensormaps(op_name: str, op: m.Op) -> list[TensorMapUse]:
    """Footprints of the op's well-formed tensormap fields, for rule 8's per-call check.

    Exactly those rule 7 accepts as measurable: in a launch whose arity matches, over an
    in-range buffer or state param, shaped well enough to measure, neither wrapping nor
    overflowing.
    """
    uses: list[TensorMapUse] = []
    for index, launch in enumerate(op.launches):
        args = m.launch_args(launch, op)
        if len(args) != len(m.launch_params(launch, op)):
            continue
        ctx = launch_context(op_name, index, launch)
        for j, arg in enumerate(args):
            if isinstance(arg, m.Pack):
                uses += _pack_tensormaps(op, f"{ctx}: arg #{j}", arg)
    return uses


def _pack_tensormaps(op: m.Op, ctx: str, pack: m.Pack) -> list[TensorMapUse]:
    uses = []
    for k, field in enumerate(pack.fields):
        tmap = field.source
        if not isinstance(tmap, m.TensorMap) or tmap.wrap or tmap.param >= len(op.params):
            continue
        footprint = verify_packs.tensormap_footprint(tmap)
        measurable = footprint is not None and footprint <= m.U64_MAX
        if measurable and op.params[tmap.param].is_pointer:
            uses.append(TensorMapUse(tmap.param, footprint, f"{ctx}: field #{k}"))
    return uses
