"""Rule group 7, packs and tensormaps (spec §1.8, §2.1 rule 7 `{"pack"}`).

Owns what a `{"pack": ...}` launch arg must satisfy: the `bytes<n>` param it binds to, the
layout of its image (field widths, tensormap slots, bounds, overlaps), each field's source, and
the structure of every tensormap descriptor with its footprint (`wrap` and overflow included).
`tensormap_footprint` is also what rule 8 measures against the buffer a call binds.
The op-level dataflow (`OpFlow`: which interface params and scratch the launches wrote) is
`checker.OpFlow`, updated by `wiring`; fields update it as kern's verifier does.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from kerncc import manifest as m

if TYPE_CHECKING:
    from kerncc.verify.checker import Checker
    from kerncc.verify.checker import OpFlow

U32_MAX = 2**32 - 1
TENSORMAP_BYTES = 128
TENSORMAP_ALIGN = 64
MAX_TENSORMAP_RANK = 5
MAX_BOX = 256
SWIZZLES = (0, 32, 64, 128)
L2_PROMOTIONS = (0, 64, 128, 256)

# Natural widths of the non-param field sources (spec §1.8); a param field is as wide as the
# interface param's ABI size.
_LITERAL_WIDTHS = {"i64": 8, "i32": 4, "f32": 4, "u8": 1}
_SOURCE_WIDTHS = {m.ScratchRef: 8, m.VarArg: 4, m.ExprArg: 4, m.RankArg: 4,
                  m.TensorMap: TENSORMAP_BYTES}


def check_pack(checker: Checker, flow: OpFlow, ctx: str, ptr: str, pack: m.Pack,
               param: m.ParamType) -> None:
    """A pack launch arg (`ctx`/`ptr` name the arg): binding, layout, then every field."""
    pack_ptr = f"{ptr}/pack"
    if param.kind != "bytes":
        checker.error(f"{ctx}: a pack binds only to a `bytes<n>` param, not `{param}`", pack_ptr)
    elif param.size != pack.size:
        checker.error(f"{ctx}: pack of {pack.size} bytes bound to a `bytes<{param.size}>` param",
                      f"{pack_ptr}/size")
    _check_layout(checker, flow.op, ctx, pack_ptr, pack)
    for k, field in enumerate(pack.fields):
        _check_field(checker, flow, f"{ctx}: field #{k}", f"{pack_ptr}/fields/{k}", field)


def field_width(field: m.Field, op: m.Op) -> int | None:
    """The field's width: explicit, else its source's natural width; None when unknowable."""
    if field.width is not None:
        return field.width
    source = field.source
    if isinstance(source, m.ParamRef):
        in_range = source.index < len(op.params)
        return op.params[source.index].abi_size if in_range else None
    if isinstance(source, m.Literal):
        return _LITERAL_WIDTHS[source.type]
    return _SOURCE_WIDTHS[type(source)]

# ---------------------------------------------------------------------------- image layout


def _check_layout(checker: Checker, op: m.Op, ctx: str, pack_ptr: str, pack: m.Pack) -> None:
    """Every field has a width and lies inside the image; no two fields overlap."""
    spans: list[tuple[int, int, int]] = []
    for k, field in enumerate(pack.fields):
        field_ptr = f"{pack_ptr}/fields/{k}"
        width = field_width(field, op)
        if not width:
            checker.error(f"{ctx}: field #{k}: width unknown", field_ptr)
            continue
        if isinstance(field.source, m.TensorMap):
            _check_tensormap_slot(checker, ctx, field_ptr, k, field.at, width)
        end = field.at + width
        if end > pack.size or end > U32_MAX:
            checker.error(f"{ctx}: field #{k} at {field.at} spans {width} bytes, past the "
                          f"{pack.size} byte image", field_ptr)
            continue
        spans.append((field.at, end, k))
    _check_overlaps(checker, ctx, pack_ptr, sorted(spans))


def _check_tensormap_slot(checker: Checker, ctx: str, field_ptr: str, k: int, at: int,
                          width: int) -> None:
    if width != TENSORMAP_BYTES:
        checker.error(f"{ctx}: field #{k}: a tensormap field is 128 bytes, not {width}",
                      field_ptr)
    if at % TENSORMAP_ALIGN:
        checker.error(f"{ctx}: field #{k}: tensormap at {at} is not 64-byte aligned", field_ptr)


def _check_overlaps(checker: Checker, ctx: str, pack_ptr: str,
                    spans: list[tuple[int, int, int]]) -> None:
    """Neighbours in offset order; kern compares only adjacent spans."""
    for (_, end, first), (start, _, second) in itertools.pairwise(spans):
        if start < end:
            checker.error(f"{ctx}: field #{second} overlaps field #{first}",
                          f"{pack_ptr}/fields/{second}")

# ---------------------------------------------------------------------------- field sources


def _check_field(checker: Checker, flow: OpFlow, ctx: str, ptr: str, field: m.Field) -> None:
    source = field.source
    if isinstance(source, m.ParamRef):
        _check_param_field(checker, flow, ctx, ptr, source.index)
    elif isinstance(source, m.ScratchRef):
        _check_scratch_field(checker, flow, ctx, ptr, source.name)
    elif isinstance(source, m.VarArg):
        checker.used.vars.add(source.name)
        if source.name not in checker.m.vars:
            checker.error(f"{ctx}: unknown var `{source.name}`", f"{ptr}/var")
    elif isinstance(source, m.ExprArg):
        checker.check_expr(f"{ptr}/expr", ctx, source.expr)
    elif isinstance(source, m.RankArg):
        checker.check_group(f"{ptr}/rank", ctx, source.group)
    elif isinstance(source, m.TensorMap):
        _check_tensormap_field(checker, flow, ctx, f"{ptr}/tensormap", source)


def interface_param(checker: Checker, op: m.Op, ctx: str, ptr: str,
                    index: int) -> m.ParamType | None:
    """Interface param `index`, or None after reporting it out of range."""
    if index < len(op.params):
        return op.params[index]
    checker.error(f"{ctx}: interface param #{index} out of range ({len(op.params)} interface "
                  f"params)", ptr)
    return None


def _check_param_field(checker: Checker, flow: OpFlow, ctx: str, ptr: str, index: int) -> None:
    # A pointer field is read or written per the interface direction; like a tensormap's
    # kernel, the pack's kernel is trusted to honour it.
    iface = interface_param(checker, flow.op, ctx, f"{ptr}/param", index)
    if iface is not None and iface.writes:
        flow.written[index] = True


def _check_scratch_field(checker: Checker, flow: OpFlow, ctx: str, ptr: str, name: str) -> None:
    if name not in flow.op.scratch:
        checker.error(f"{ctx}: unknown scratch `{name}`", f"{ptr}/scratch")
        return
    # A field carries no direction: kern counts it as both a use and a write.
    flow.scratch_used.add(name)
    flow.scratch_written.add(name)

# ---------------------------------------------------------------------------- tensormaps


def _check_tensormap_field(checker: Checker, flow: OpFlow, ctx: str, ptr: str,
                           tmap: m.TensorMap) -> None:
    iface = interface_param(checker, flow.op, ctx, f"{ptr}/param", tmap.param)
    if iface is None:
        return
    if not iface.is_pointer:
        checker.error(f"{ctx}: tensormap over interface param #{tmap.param} (`{iface}`), which "
                      "is not a buffer or state", f"{ptr}/param")
        return
    for problem in tensormap_problems(tmap):
        checker.error(f"{ctx}: {problem}", ptr)
    if iface.writes:
        flow.written[tmap.param] = True
    _check_wrap(checker, ctx, ptr, tmap)


def _check_wrap(checker: Checker, ctx: str, ptr: str, tmap: m.TensorMap) -> None:
    """`wrap` is declared exactly when the strides overflow 64 bits."""
    footprint = tensormap_footprint(tmap)
    if footprint is None:
        return
    overflows = footprint > m.U64_MAX
    if tmap.wrap and not overflows:
        checker.error(f"{ctx}: `wrap` on a tensormap whose strides do not overflow", ptr)
    if overflows and not tmap.wrap:
        checker.error(f"{ctx}: the tensormap's strides overflow (declare `wrap` if that is the "
                      "kernel's trick)", ptr)


def tensormap_footprint(tmap: m.TensorMap) -> int | None:
    """Bytes the descriptor addresses from its base, exactly (may exceed u64: an overflow).

    A spanning outermost dim (0) adds nothing: its extent is the bound buffer's. None when the
    shape is malformed (no dims, strides not one per outer dim, an inner dim of 0).
    """
    dims, strides = tmap.dims, tmap.strides
    if not dims or len(strides) != len(dims) - 1:
        return None
    bits = m.TENSORMAP_DTYPE_BITS[tmap.dtype]
    total = -(-dims[0] * bits // 8)
    for i, (dim, stride) in enumerate(zip(dims[1:], strides), start=1):
        if dim == 0 and i == len(dims) - 1:
            continue
        if dim == 0:
            return None
        total += (dim - 1) * stride
    return total


def tensormap_problems(tmap: m.TensorMap) -> list[str]:
    """Structural problems that need no buffer: rank, box, strides, alignment, swizzle, L2."""
    rank = len(tmap.dims)
    if not 1 <= rank <= MAX_TENSORMAP_RANK:
        return [f"dims has {rank} entries, expected 1 to 5"]
    problems = _shape_problems(tmap, rank)
    problems += _alignment_problems(tmap)
    if tmap.swizzle not in SWIZZLES:
        problems.append(f"swizzle {tmap.swizzle} is not one of 0, 32, 64, 128")
    if tmap.l2_promotion not in L2_PROMOTIONS:
        problems.append(f"l2_promotion {tmap.l2_promotion} is not one of 0, 64, 128, 256")
    return problems


def _shape_problems(tmap: m.TensorMap, rank: int) -> list[str]:
    """Entry counts and the first bad entry of dims, box and strides (kern names only one)."""
    problems = []
    if len(tmap.strides) != rank - 1:
        problems.append(f"strides has {len(tmap.strides)} entries, expected dims - 1 = "
                        f"{rank - 1}")
    if len(tmap.box) != rank:
        problems.append(f"box has {len(tmap.box)} entries, expected {rank}")
    inner_zero = next((i for i, d in enumerate(tmap.dims[:-1]) if d == 0), None)
    if inner_zero is not None:
        problems.append(f"dims[{inner_zero}] is 0; only the outermost dim may span the buffer")
    if rank == 1 and tmap.dims[0] == 0:
        problems.append("dims[0] is 0")
    bad_box = next((i for i, b in enumerate(tmap.box) if not 1 <= b <= MAX_BOX), None)
    if bad_box is not None:
        problems.append(f"box[{bad_box}] = {tmap.box[bad_box]}, must be 1..=256")
    bad_stride = next((i for i, s in enumerate(tmap.strides) if s == 0 or s % 16), None)
    if bad_stride is not None:
        problems.append(f"strides[{bad_stride}] = {tmap.strides[bad_stride]} is not a positive "
                        "multiple of 16")
    return problems


def _alignment_problems(tmap: m.TensorMap) -> list[str]:
    """TMA wants 16-byte rows and boxes, and a box row inside the swizzle span."""
    problems = []
    bits = m.TENSORMAP_DTYPE_BITS[tmap.dtype]
    if tmap.dims[0] * bits % 128:
        problems.append(f"dims[0] = {tmap.dims[0]} elements is not a multiple of 16 bytes")
    if not tmap.box:
        return problems
    inner = tmap.box[0] * bits // 8
    if inner % 16:
        problems.append(f"box[0] = {tmap.box[0]} elements spans {inner} bytes, not a multiple "
                        "of 16")
    if tmap.swizzle and inner > tmap.swizzle:
        problems.append(f"box[0] spans {inner} bytes, more than the {tmap.swizzle} byte "
                        "swizzle span")
    return problems

