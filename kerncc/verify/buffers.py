"""Verifier rule group 5 (spec §2.1): buffers, one at a time, in sorted name order.

Per buffer: shape (the shared `Checker.check_shape`), domain (form, `index_into` target, bounds),
fill, host placement, source export, `bind` segments, and the peer rules (`of`, `group`).
Messages carry kern's contexts: ``buffer `b`: ``, ``buffer `b` domain: ``,
``buffer `b` bind[i]: ``. What these rules see counts as used for rule group 9: shape and
bound vars, a peer's `of` target, the groups of peer buffers and ranked binds. An `index_into`
target deliberately does not (spec §2.1 rule 9).
"""

from __future__ import annotations

import math
from decimal import Decimal

from kerncc import manifest as m
from kerncc.verify.checker import Checker, buffer_ptr

FILL_DTYPES = ("i32", "i64")
BIND_KINDS = ("weight", "source")


def check_buffers(c: Checker) -> None:
    for name, buf in sorted(c.m.buffers.items()):
        c.check_shape(buffer_ptr(name, "shape"), f"buffer `{name}`", buf.dtype, buf.shape)
        if buf.domain is not None:
            check_domain_form(c, name, buf.domain)
            check_index_into(c, name, buf)
            check_bounds(c, name, buf)
        check_fill(c, name, buf)
        check_placement(c, name, buf)
        check_source(c, name, buf)
        check_bind(c, name, buf)
        check_peer(c, name, buf)

# ---------------------------------------------------------------------------- domain


def check_domain_form(c: Checker, name: str, dom: m.Domain) -> None:
    ctx = f"buffer `{name}` domain"
    has_bounds = dom.min is not None or dom.max is not None
    if dom.index_into is not None and has_bounds:
        c.error(f"{ctx}: `index_into` and `min`/`max` are mutually exclusive",
                buffer_ptr(name, "domain", "index_into"))
    if not has_bounds and dom.index_into is None and not dom.monotone:
        c.error(f"{ctx}: empty (declare bounds, `index_into`, or `monotone`)",
                buffer_ptr(name, "domain"))
    if dom.stride == 0:
        c.error(f"{ctx}: `stride` must be > 0", buffer_ptr(name, "domain", "stride"))
    elif dom.stride != 1 and dom.index_into is None:
        c.error(f"{ctx}: `stride` only applies with `index_into`",
                buffer_ptr(name, "domain", "stride"))


def check_index_into(c: Checker, name: str, buf: m.Buffer) -> None:
    dom = buf.domain
    if dom is None or dom.index_into is None:
        return
    target = dom.index_into
    ctx, ptr = f"buffer `{name}` domain", buffer_ptr(name, "domain", "index_into")
    if buf.dtype in m.FLOAT_DTYPES:
        c.error(f"{ctx}: a {buf.dtype} buffer cannot index anything", ptr)
    if target == name:
        c.error(f"{ctx}: a buffer cannot index itself", ptr)
        return
    in_buffers, state = target in c.m.buffers, c.m.states.get(target)
    if in_buffers and state is not None:
        c.error(f"{ctx}: `index_into` `{target}` is both a buffer and a state", ptr)
    elif not in_buffers and state is None:
        c.error(f"{ctx}: `index_into` unknown buffer/state `{target}`", ptr)
    elif state is not None and state.bytes_per_seq and dom.stride:
        _check_line_stride(c, ctx, ptr, target, state, dom.stride)


def _check_line_stride(c: Checker, ctx: str, ptr: str, target: str, state: m.State,
                       stride: int) -> None:
    # A per-sequence state is indexed in lines of `stride` bytes; they must tile a sequence.
    if state.bytes_per_seq % stride:
        c.error(f"{ctx}: `index_into` per-sequence state `{target}` in lines of {stride} bytes, "
                f"which do not divide its {state.bytes_per_seq} bytes per sequence", ptr)


def check_bounds(c: Checker, name: str, buf: m.Buffer) -> None:
    dom = buf.domain
    if dom is None:
        return
    ctx = f"buffer `{name}` domain"
    if dom.monotone and len(buf.shape) != 1:
        c.error(f"{ctx}: `monotone` requires a one-dimensional buffer",
                buffer_ptr(name, "domain", "monotone"))
    ok = {key: _check_bound(c, name, buf.dtype, key, getattr(dom, key)) for key in ("min", "max")}
    if dom.min is not None and dom.max is not None and ok["min"] and ok["max"]:
        _check_min_below_max(c, name, dom.min, dom.max)


def _check_bound(c: Checker, name: str, dtype: str, key: str, bound: m.Bound | None) -> bool:
    """One bound's own rules; whether it can be evaluated."""
    if bound is None:
        return False
    ptr = buffer_ptr(name, "domain", key)
    if isinstance(bound, float):
        if dtype not in m.FLOAT_DTYPES:
            c.error(f"buffer `{name}` domain: float `{key}` on a {dtype} buffer", ptr)
        return True
    # kerncc's context for expressions inside a bound: the domain's, then the bound's name.
    return c.check_expr(ptr, f"buffer `{name}` domain {key}", bound)


def _check_min_below_max(c: Checker, name: str, low: m.Bound, high: m.Bound) -> None:
    # Expression bounds move with the vars: both corners of the var box must keep min <= max.
    for env in (c.env_max, c.env_min):
        lo, hi = _bound_f64(c, low, env), _bound_f64(c, high, env)
        if lo is None or hi is None or lo <= hi:
            continue
        c.error(f"buffer `{name}` domain: min {rust_f64(lo)} > max {rust_f64(hi)}",
                buffer_ptr(name, "domain", "min"))
        return


def _bound_f64(c: Checker, bound: m.Bound, env: dict[str, int]) -> float | None:
    if isinstance(bound, float):
        return bound
    value = c.eval(bound, env)
    # An evaluation error is not a domain rule of kern's; the comparison is just skipped.
    return None if isinstance(value, str) else float(value)


def rust_f64(value: float) -> str:
    """An f64 as Rust's `Display` writes it: shortest digits, no exponent, no trailing `.0`."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    text = format(Decimal(repr(value)), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text

# ---------------------------------------------------------------------------- fill, placement


def check_fill(c: Checker, name: str, buf: m.Buffer) -> None:
    fill = buf.fill
    if fill is None:
        return
    ctx, ptr = f"buffer `{name}`", buffer_ptr(name, "fill")
    if buf.kind not in ("input", "output"):
        c.error(f"{ctx}: a fill sits on an input or output, not a {buf.kind} buffer", ptr)
    elif fill in m.OUTPUT_FILLS and buf.kind == "input":
        c.error(f"{ctx}: fill `{fill}` is read from an output but the buffer is input", ptr)
    elif fill not in m.OUTPUT_FILLS and buf.kind == "output":
        c.error(f"{ctx}: fill `{fill}` is written into an input but the buffer is output", ptr)
    if buf.dtype not in FILL_DTYPES:
        c.error(f"{ctx}: fill `{fill}` needs an i32 or i64 buffer, not {buf.dtype}",
                buffer_ptr(name, "dtype"))


def check_placement(c: Checker, name: str, buf: m.Buffer) -> None:
    if buf.placement != "host":
        return
    ctx = f"buffer `{name}`"
    if buf.kind != "weight" or buf.export:
        c.error(f"{ctx}: host placement requires a non-exported immutable weight",
                buffer_ptr(name, "placement"))
    ranked = _first_ranked(name, buf.bind)
    if ranked is not None:
        # One host copy serves every rank, so no rank may pick its own slice.
        c.error(f"{ctx}: shared host weights cannot select tensors, rows or columns by rank",
                ranked)


def _first_ranked(name: str, bind: tuple[m.Segment, ...]) -> str | None:
    """The pointer of the first per-rank choice among the segments, if any."""
    for i, seg in enumerate(bind):
        with_ = seg.interleave.with_ if seg.interleave else None
        for key, value in (("tensor", seg.tensor), ("rows", seg.rows), ("cols", seg.cols),
                           ("interleave/with", with_)):
            if isinstance(value, m.Ranked):
                return buffer_ptr(name, "bind", i) + "/" + key
    return None


def check_source(c: Checker, name: str, buf: m.Buffer) -> None:
    if buf.kind == "source" and buf.export:
        c.error(f"buffer `{name}`: a source lives only while weights load; it cannot be exported",
                buffer_ptr(name, "export"))

# ---------------------------------------------------------------------------- bind


def check_bind(c: Checker, name: str, buf: m.Buffer) -> None:
    ctx = f"buffer `{name}`"
    if buf.kind in BIND_KINDS and not buf.bind:
        c.error(f"{ctx}: a {buf.kind} buffer binds at least one checkpoint tensor (`bind`)",
                buffer_ptr(name))
    elif buf.kind not in BIND_KINDS and buf.bind:
        c.error(f"{ctx}: `bind` names checkpoint tensors for a weight or a source, "
                f"not a {buf.kind} buffer", buffer_ptr(name, "bind"))
    # Segments on a wrong kind are still checked: every problem is reported at once.
    for i, seg in enumerate(buf.bind):
        check_segment(c, f"{ctx} bind[{i}]", buffer_ptr(name, "bind", i), seg)


def check_segment(c: Checker, ctx: str, ptr: str, seg: m.Segment) -> None:
    _check_tensor_source(c, ctx, f"{ptr}/tensor", seg.tensor)
    if seg.interleave is not None:
        _check_interleave(c, ctx, ptr, seg)
    for key, noun in (("rows", "row"), ("cols", "column")):
        ranges = getattr(seg, key)
        if ranges is not None:
            _check_ranges(c, ctx, f"{ptr}/{key}", key, noun, ranges)


def _check_interleave(c: Checker, ctx: str, ptr: str, seg: m.Segment) -> None:
    interleave = seg.interleave
    if interleave is None:
        return
    _check_tensor_source(c, ctx, f"{ptr}/interleave/with", interleave.with_)
    if interleave.rows == 0:
        c.error(f"{ctx}: interleave blocks of 0 rows", f"{ptr}/interleave/rows")
    ranged = "rows" if seg.rows is not None else "cols" if seg.cols is not None else None
    if ranged is not None:
        c.error(f"{ctx}: an interleaved segment takes both tensors whole, not a range",
                f"{ptr}/{ranged}")


def _check_tensor_source(c: Checker, ctx: str, ptr: str, source: m.TensorSource) -> None:
    if isinstance(source, str):
        if not source:
            c.error(f"{ctx}: empty tensor name", ptr)
        return
    for j, tensor in enumerate(source.items):
        if not tensor:
            c.error(f"{ctx}: empty tensor name", f"{ptr}/tensors/{j}")
    size = _ranked_group_size(c, ctx, ptr, source)
    if size is not None and size != len(source.items):
        c.error(f"{ctx}: group `{source.group}` needs {size} tensor names, "
                f"got {len(source.items)}", f"{ptr}/tensors")


def _check_ranges(c: Checker, ctx: str, ptr: str, key: str, noun: str,
                  ranges: m.Ranges) -> None:
    pairs = [(ptr, ranges)]
    if isinstance(ranges, m.Ranked):
        size = _ranked_group_size(c, ctx, ptr, ranges)
        if size is not None and size != len(ranges.items):
            c.error(f"{ctx}: group `{ranges.group}` needs {size} {noun} ranges, "
                    f"got {len(ranges.items)}", f"{ptr}/ranges")
        pairs = [(f"{ptr}/ranges/{j}", pair) for j, pair in enumerate(ranges.items)]
    for where, (start, stop) in pairs:
        if start >= stop:
            c.error(f"{ctx}: {key} [{start}, {stop}) is empty", where)


def _ranked_group_size(c: Checker, ctx: str, ptr: str, ranked: m.Ranked) -> int | None:
    """Check the group reference of a per-rank choice; its size when the group exists."""
    c.check_group(f"{ptr}/group", ctx, ranked.group)
    return (c.m.topology or {}).get(ranked.group)

# ---------------------------------------------------------------------------- peer


def check_peer(c: Checker, name: str, buf: m.Buffer) -> None:
    ctx = f"buffer `{name}`"
    if buf.kind != "peer":
        if buf.of is not None:
            c.error(f"{ctx}: `of` only applies to peer buffers", buffer_ptr(name, "of"))
        if buf.group is not None:
            c.error(f"{ctx}: `group` only applies to peer buffers", buffer_ptr(name, "group"))
        return
    if buf.export:
        c.error(f"{ctx}: a peer buffer cannot itself be exported", buffer_ptr(name, "export"))
    if buf.dtype != "u64":
        c.error(f"{ctx}: a peer buffer holds device addresses, dtype must be u64, not {buf.dtype}",
                buffer_ptr(name, "dtype"))
    if buf.domain is not None:
        c.error(f"{ctx}: a peer buffer's contents are runtime-filled addresses; "
                "it takes no domain", buffer_ptr(name, "domain"))
    check_peer_of(c, name, buf)
    check_peer_group(c, name, buf)


def check_peer_of(c: Checker, name: str, buf: m.Buffer) -> None:
    ctx, of = f"buffer `{name}`", buf.of
    if of is None:
        c.error(f"{ctx}: a peer buffer must name the exported buffer or state it holds "
                "addresses `of`", buffer_ptr(name))
        return
    ptr = buffer_ptr(name, "of")
    if of == name:
        c.error(f"{ctx}: a peer buffer cannot be `of` itself", ptr)
        return
    target, state = c.m.buffers.get(of), c.m.states.get(of)
    if target is None and state is None:
        c.error(f"{ctx}: `of` unknown buffer/state `{of}`", ptr)
        return
    # Exporting memory for peers is a use, though no call of this rank names it.
    if target is not None:
        c.used.buffers.add(of)
    if state is not None:
        c.used.states.add(of)
    if target is not None and state is not None:
        c.error(f"{ctx}: `of` `{of}` is both a buffer and a state", ptr)
    elif target is not None:
        _check_peer_target(c, ctx, ptr, of, target)
    elif state is not None and not state.is_owned:
        c.error(f"{ctx}: `of` state `{of}` is the host's; only runtime memory is exported", ptr)


def _check_peer_target(c: Checker, ctx: str, ptr: str, of: str, target: m.Buffer) -> None:
    if target.kind == "peer":
        c.error(f"{ctx}: `of` `{of}` is itself a peer buffer", ptr)
    elif not target.export:
        c.error(f"{ctx}: `of` buffer `{of}` is not exported", ptr)


def check_peer_group(c: Checker, name: str, buf: m.Buffer) -> None:
    ctx, group = f"buffer `{name}`", buf.group
    if group is None:
        c.error(f"{ctx}: a peer buffer must name the topology `group` its addresses are "
                "indexed by", buffer_ptr(name))
        return
    c.check_group(buffer_ptr(name, "group"), ctx, group)
    size = (c.m.topology or {}).get(group)
    if size is not None and buf.shape != (size,):
        c.error(f"{ctx}: a peer buffer over group `{group}` has shape [{size}], "
                "one address per member", buffer_ptr(name, "shape"))
