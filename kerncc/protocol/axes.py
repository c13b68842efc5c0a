"""The serving protocol's layout rules (spec §4.1-4.3): the axes, every fill, the state tables.

Axes come from `vars.<name>.axis` (V5.1). Many real manifests predate that field, so when no
var declares an axis they are derived the way kern did before (ARCHITECTURE §8): rows from the
`slot` fill's var, groups from the `seq_len` fill's, and the tray from the one other var a fill
or a line table spans. Once some var declares an axis, the newest rules apply and a missing
axis is an error. Every diagnostic points at the var or buffer at fault.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import attrs

from kerncc import manifest as m
from kerncc.diagnostics import Diagnostics, pointer
from kerncc.protocol.model import Axis, Bound, Filled, Fixed, LineTable, PageTable

_EXPECTED = {
    "token": "expected [rows], [tray] (one per row) or [groups] (each sequence's first)",
    "position": "expected [rows]",
    "valid": "expected [rows]",
    "slot": "expected [rows]",
    "seq_len": "expected [groups]",
    "count": "expected [groups]",
    "cu_seqlens": "expected [n] with n >= groups + 1",
    "tokens": "expected [groups], [groups, w] or [tray]",
    "span_at": "expected i32 [1]",
    "error": "expected i32 [1]",
    "blocks": "expected i32 [members + 1]",
}

# Roles a serving loop stages from one buffer; a second one would leave it guessing.
_SINGLE_FILLS = ("position", "valid", "cu_seqlens", "span_at", "blocks", "count", "error")


@attrs.frozen
class Axes:
    """The vars a call is sized by, and whether they were derived from fills (older way)."""

    rows: Bound
    groups: Bound
    tray: Bound | None = None
    derived: bool = False

    def classify(self, var: str) -> str | None:
        """The axis `var` counts; None when it counts none (derived: every other var is tray)."""
        if var == self.rows.var:
            return "rows"
        if var == self.groups.var:
            return "groups"
        if self.derived or (self.tray is not None and var == self.tray.var):
            return "tray"
        return None


def shape_text(items: Sequence[m.Dim]) -> str:
    """A shape or name list as kern's messages print it: `["seqs", 3]`."""
    return "[" + ", ".join(json.dumps(item) for item in items) + "]"


def buffers_with_fill(manifest: m.Manifest, fill: str) -> list[str]:
    return sorted(name for name, b in manifest.buffers.items() if b.fill == fill)

# -------------------------------------------------------------------- axes (§4.1)


def read_axes(manifest: m.Manifest, diags: Diagnostics) -> Axes | None:
    """The axes, declared or derived; None (with diagnostics) when rows or groups are missing."""
    if not any(var.axis for var in manifest.vars.values()):
        return _derive_axes(manifest, diags)
    rows = _declared(manifest, "rows", diags)
    groups = _declared(manifest, "groups", diags)
    if rows is None or groups is None:
        return None
    return Axes(rows, groups, _axis_bound(manifest, "tray"))


def _declared(manifest: m.Manifest, axis: str, diags: Diagnostics) -> Bound | None:
    bound = _axis_bound(manifest, axis)
    if bound is None:
        diags.error(f"no var has `axis: {axis}`", "/vars")
    return bound


def _axis_bound(manifest: m.Manifest, axis: str) -> Bound | None:
    # The verifier allows one var per axis; sorting keeps a hand-made Verified deterministic.
    names = sorted(name for name, var in manifest.vars.items() if var.axis == axis)
    if not names:
        return None
    return Bound(names[0], manifest.vars[names[0]].max)


def _derive_axes(manifest: m.Manifest, diags: Diagnostics) -> Axes | None:
    rows = _axis_from_fill(manifest, "slot", "rows", diags)
    groups = _axis_from_fill(manifest, "seq_len", "groups", diags)
    if rows is None or groups is None:
        return None
    if rows.var == groups.var:
        where = pointer("buffers", buffers_with_fill(manifest, "seq_len")[0], "shape", 0)
        diags.error(f"`slot` and `seq_len` are both over var `{rows.var}`; "
                    "rows and sequences need their own", where)
        return None
    return Axes(rows, groups, _derive_tray(manifest, rows, groups, diags), derived=True)


def _axis_from_fill(manifest: m.Manifest, fill: str, axis: str,
                    diags: Diagnostics) -> Bound | None:
    """The older rule: an axis is the var of the one buffer carrying `fill`."""
    names = buffers_with_fill(manifest, fill)
    if not names:
        diags.error(f"no var has `axis: {axis}` and no input has fill `{fill}` "
                    "to derive it from", "/vars")
        return None
    if len(names) > 1:
        diags.error(f"fill `{fill}` is on {len(names)} buffers ({shape_text(names)}), "
                    "expected one", pointer("buffers", names[1], "fill"))
        return None
    shape = manifest.buffers[names[0]].shape
    if len(shape) != 1 or shape[0] not in manifest.vars:
        diags.error(f"`{names[0]}` (fill `{fill}`) is shaped {shape_text(shape)}, "
                    "expected [<var>]", pointer("buffers", names[0], "shape"))
        return None
    return Bound(shape[0], manifest.vars[shape[0]].max)


def _derive_tray(manifest: m.Manifest, rows: Bound, groups: Bound,
                 diags: Diagnostics) -> Bound | None:
    """The older rule: the tray is the one var besides rows and groups that
    a fill's first dim or a line table's columns span."""
    spanned: dict[str, str] = {}
    for name in sorted(manifest.buffers):
        var = _spanned_var(manifest, manifest.buffers[name])
        if var is not None and var not in (rows.var, groups.var):
            spanned.setdefault(var, name)
    extra = sorted(spanned)
    if len(extra) > 1:
        diags.error(f"fills and line tables span {len(extra)} vars besides rows and sequences "
                    f"({shape_text(extra)}), at most one names the tray batch",
                    pointer("buffers", spanned[extra[1]], "shape"))
    if not extra or extra[0] not in manifest.vars:
        return None
    return Bound(extra[0], manifest.vars[extra[0]].max)


def _spanned_var(manifest: m.Manifest, buf: m.Buffer) -> str | None:
    """The var a line table's columns or a fill's first dim span, if any."""
    if _per_seq_table(manifest, buf):
        dims = buf.shape[1:2]
    elif buf.fill is not None:
        dims = buf.shape[:1]
    else:
        return None
    return dims[0] if dims and isinstance(dims[0], str) else None

# -------------------------------------------------------------------- fills (§4.2)


def read_fills(manifest: m.Manifest, axes: Axes, diags: Diagnostics) -> list[Filled]:
    """Every buffer with a fill, in name order, each checked against its role's shapes."""
    fills: list[Filled] = []
    for name in sorted(manifest.buffers):
        buf = manifest.buffers[name]
        if buf.fill is None:
            continue
        filled = _filled(name, buf, axes, diags)
        if filled is not None:
            fills.append(filled)
    _check_unique(manifest, fills, diags)
    if buffers_with_fill(manifest, "blocks") and axes.tray is None:
        where = pointer("buffers", buffers_with_fill(manifest, "blocks")[0], "fill")
        diags.error("fill `blocks` without a var naming the tray batch", where)
    return fills


def _filled(name: str, buf: m.Buffer, axes: Axes, diags: Diagnostics) -> Filled | None:
    where = pointer("buffers", name, "shape")
    layout = _layout(buf.shape)
    if layout is None:
        diags.error(f"`{name}` (fill `{buf.fill}`) is shaped {shape_text(buf.shape)}, "
                    "expected [<axis>], [<n>] or [<axis>, w]", where)
        return None
    dim, width = layout
    axis = Fixed(dim) if isinstance(dim, int) else axes.classify(dim)
    if axis is None:
        diags.error(f"fill `{buf.fill}` `{name}` is over var `{dim}`, which counts no axis",
                    f"{where}/0")
        return None
    if not _fits(buf.fill, buf.dtype, axis, width, axes.groups.max):
        diags.error(f"`{name}` (fill `{buf.fill}`) is shaped {shape_text(buf.shape)}: "
                    f"{_EXPECTED[buf.fill]}", where)
        return None
    return Filled(name, buf.fill, buf.dtype, axis, width)


def _layout(shape: Sequence[m.Dim]) -> tuple[m.Dim, int] | None:
    """`[var]`, `[n]` or `[var, w]` as (first dim, width); None for any other shape."""
    if len(shape) == 1:
        return shape[0], 1
    if len(shape) == 2 and isinstance(shape[0], str) and isinstance(shape[1], int):
        return shape[0], shape[1]
    return None


def _fits(fill: str, dtype: str, axis: Axis, width: int, groups_max: int) -> bool:
    """Whether a fill's layout is one its role allows (spec §4.2)."""
    if fill == "token":
        return width == 1 and axis in ("rows", "tray", "groups")
    if fill in ("position", "valid", "slot"):
        return width == 1 and axis == "rows"
    if fill in ("seq_len", "count"):
        return width == 1 and axis == "groups"
    if fill == "cu_seqlens":
        return isinstance(axis, Fixed) and axis.n > groups_max
    if fill == "tokens":
        return axis == "groups" or (axis == "tray" and width == 1)
    if fill in ("span_at", "error"):
        return axis == Fixed(1) and dtype == "i32"
    return isinstance(axis, Fixed) and axis.n >= 2 and dtype == "i32"    # blocks


def _check_unique(manifest: m.Manifest, fills: list[Filled], diags: Diagnostics) -> None:
    for axis in ("rows", "tray"):
        tokens = [f.name for f in fills if f.fill == "token" and f.axis == axis]
        if len(tokens) > 1:
            diags.error(f"fill `token` over {axis.capitalize()} is on {len(tokens)} buffers, "
                        "expected one", pointer("buffers", tokens[1], "fill"))
    anchors = [f.name for f in fills if f.fill == "token" and f.axis == "groups"]
    if len(anchors) > 1:
        diags.error("fill `token` over the sequences is on more than one buffer",
                    pointer("buffers", anchors[1], "fill"))
    for fill in _SINGLE_FILLS:
        names = buffers_with_fill(manifest, fill)
        if len(names) > 1:
            diags.error(f"fill `{fill}` is on more than one buffer",
                        pointer("buffers", names[1], "fill"))

# -------------------------------------------------------------------- tables (§4.3)


def read_tables(manifest: m.Manifest, axes: Axes,
                diags: Diagnostics) -> tuple[list[PageTable], list[LineTable]]:
    """The inputs without a fill that index a state: page tables and line tables, name order."""
    pages: list[PageTable] = []
    lines: list[LineTable] = []
    for name in sorted(manifest.buffers):
        buf = manifest.buffers[name]
        if _indexed_state(manifest, buf) is None:
            continue
        if buf.dtype != "i32":
            diags.error(f"table `{name}` is {buf.dtype}, the runtime hands out i32 page and "
                        "line indices", pointer("buffers", name, "dtype"))
        elif _per_seq_table(manifest, buf):
            _append(lines, _line_table(name, buf, axes, diags))
        else:
            _append(pages, _page_table(name, buf, axes, diags))
    return pages, lines


def _append(items: list, item: object | None) -> None:
    if item is not None:
        items.append(item)


def _indexed_state(manifest: m.Manifest, buf: m.Buffer) -> m.State | None:
    """The state an input indexes; its fill, if any, gives it a role of its own instead
    (the `slot` fill indexes the paged state too, one slot per row)."""
    if buf.kind != "input" or buf.fill is not None or buf.domain is None:
        return None
    return manifest.states.get(buf.domain.index_into or "")


def _per_seq_table(manifest: m.Manifest, buf: m.Buffer) -> bool:
    target = buf.domain.index_into if buf.domain else None
    state = manifest.states.get(target or "")
    return buf.kind == "input" and state is not None and state.bytes_per_seq > 0


def _line_table(name: str, buf: m.Buffer, axes: Axes, diags: Diagnostics) -> LineTable | None:
    where = pointer("buffers", name, "shape")
    shape = buf.shape
    known_rank = len(shape) == 2 or (len(shape) == 3 and isinstance(shape[2], int))
    if not (known_rank and isinstance(shape[0], int) and isinstance(shape[1], str)):
        diags.error(f"line table `{name}` is shaped {shape_text(shape)}, expected "
                    "[lines, <groups|tray>] or [lines, <groups|tray>, w]", where)
        return None
    axis = axes.classify(shape[1])
    if axis is None:
        diags.error(f"line table `{name}` is over var `{shape[1]}`, which counts no axis",
                    f"{where}/1")
        return None
    if axis == "rows":
        diags.error(f"line table `{name}` has a column per row (`{shape[1]}`); "
                    "lines are per sequence", f"{where}/1")
        return None
    width = shape[2] if len(shape) == 3 else 1
    return LineTable(name, shape[0], width, axis)


def _page_table(name: str, buf: m.Buffer, axes: Axes, diags: Diagnostics) -> PageTable | None:
    shape = buf.shape
    if len(shape) == 2 and shape[0] == axes.groups.var and isinstance(shape[1], int):
        return PageTable(name, shape[1])
    diags.error(f"page table `{name}` is shaped {shape_text(shape)}, expected [<groups>, n]",
                pointer("buffers", name, "shape"))
    return None
