"""The serving protocol's result types (spec §4), its queries (§4.5) and the `kern verify` summary.

The runtime reads structure and executes blindly; a serving loop needs more: which var a call's
rows, sequences and tray rows go in (the axes), which buffer carries which role (`fill`s), which
inputs are page and line tables, which call shape each `batch` program accepts and what it hands
back. `check(verified)` reads all of that off the manifest, every problem collected, and returns
a `Protocol` the loop queries instead of naming buffers, programs or vars itself. It is a pure
projection of a `Verified` manifest: no GPU, no config.

The rules live in `axes` (axes, fills, tables) and `forwards` (programs), `check` in the
package; this module holds the result types, the queries of spec §4.5 and the `kern verify`
summary.
Axes come from `vars.<name>.axis`; when no var declares one, they are derived the older way
(ARCHITECTURE §8) and the protocol says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import attrs


HEADLINE: Final = "manifest does not fit the serving protocol:"

VAR_ROWS: Final = "var"
"""`Forward.rows` of a program whose rows are set per call (`batch.rows` is the rows var)."""

DERIVED_NOTE: Final = "derived from fills (no var declares an axis)"


@attrs.frozen
class Fixed:
    """An axis of fixed length, declared at its bound (`cu_seqlens`, the one-word `error`)."""

    n: int


Axis = str | Fixed       # "rows" | "groups" | "tray" | Fixed(n)
Rows = int | str        # rows per sequence: a constant, or VAR_ROWS


@attrs.frozen
class Bound:
    """A var a call is sized by, with its upper bound."""

    var: str
    max: int


@attrs.frozen
class Filled:
    """A caller-facing buffer: its role, element type and layout along an axis."""

    name: str
    fill: str
    dtype: str
    axis: Axis
    width: int = 1

    @property
    def word(self) -> int:
        """Bytes per value on the wire: i32 buffers take 4, every other fill dtype 8."""
        return 4 if self.dtype == "i32" else 8

    def encode(self, values: Sequence[int]) -> bytes:
        """The values as the buffer's little-endian elements (wrapping, as kern's casts do)."""
        mask = (1 << (8 * self.word)) - 1
        return b"".join((int(v) & mask).to_bytes(self.word, "little") for v in values)

    def decode(self, data: bytes) -> list[int]:
        """The buffer's bytes as signed values; a trailing partial element is ignored."""
        count = len(data) // self.word
        return [int.from_bytes(data[i * self.word:(i + 1) * self.word], "little", signed=True)
                for i in range(count)]


@attrs.frozen
class PageTable:
    """An `i32 [groups, width]` input indexing a paged state: each sequence's pages."""

    name: str
    width: int


@attrs.frozen
class LineTable:
    """An `i32 [lines, cols]` or `[lines, cols, width]` input indexing a per-sequence state."""

    name: str
    lines: int
    width: int
    axis: Axis


@attrs.frozen
class Forward:
    """A program with a `batch`: the call shape it accepts and the outputs it hands back."""

    name: str
    groups: int
    rows: Rows
    span: bool = False
    emits: str | None = None    # the `tokens` output it writes; None: it only advances state
    count: str | None = None    # the `count` output it writes; None: one token per sequence

    def accepts(self, groups: int, rows: Rows) -> bool:
        """Whether it takes `groups` sequences of `rows` rows with no run among them."""
        return not self.span and self.rows == rows and groups <= self.groups


@attrs.frozen
class Protocol:
    """The manifest's serving contract, checked once and queried everywhere."""

    rows: Bound
    groups: Bound
    tray: Bound | None
    fills: tuple[Filled, ...]
    page_tables: tuple[PageTable, ...]
    line_tables: tuple[LineTable, ...]
    forwards: tuple[Forward, ...]
    once: tuple[str, ...] = ()
    derive: tuple[str, ...] = ()
    span: Bound | None = None
    context: Bound | None = None
    axes_derived: bool = False
    note: str | None = None

    # ---------------------------------------------------------------- queries (spec §4.5)

    def forward(self, groups: int, rows: Rows) -> Forward | None:
        """The program for `groups` sequences of `rows`: the tightest bound that accepts it."""
        fits = [f for f in self.forwards if f.accepts(groups, rows)]
        return min(fits, key=lambda f: f.groups, default=None)

    def chunk(self) -> Forward | None:
        """The program that takes one sequence's rows as fed (a prefill chunk)."""
        return self.forward(1, VAR_ROWS)

    def spanned(self, groups: int) -> Forward | None:
        """The program for `groups` one-row sequences, one of them a run: the tightest bound."""
        fits = [f for f in self.forwards if f.span and groups <= f.groups]
        return min(fits, key=lambda f: f.groups, default=None)

    def max_groups(self, rows: Rows) -> int:
        """Most sequences any program accepts at `rows` per sequence, no run among them."""
        return max((f.groups for f in self.forwards if not f.span and f.rows == rows), default=0)

    def vars(self, groups: int, rows: int, tray: int, longest: int) -> dict[str, int]:
        """The var env of a call: `groups` sequences, `rows` rows in all on this rank, `tray`
        rows in the whole tray batch, and the longest sequence after the call."""
        env = {self.rows.var: rows, self.groups.var: groups}
        if self.tray is not None:
            env[self.tray.var] = tray
        if self.context is not None:
            env[self.context.var] = longest
        return env

    def filled(self, fill: str, axis: Axis) -> Filled | None:
        """The buffer carrying `fill` over `axis`, if any."""
        return next((f for f in self.fills if f.fill == fill and f.axis == axis), None)

    def any(self, fill: str) -> Filled | None:
        """The buffer carrying `fill` whatever its axis (roles that sit on one buffer)."""
        return next((f for f in self.fills if f.fill == fill), None)

    def token_rows(self) -> Filled | None:
        """The tokens fed one per row: over this rank's rows, else over the tray's."""
        return self.filled("token", "rows") or self.filled("token", "tray")

# -------------------------------------------------------------------- `kern verify` output


def summary_lines(protocol: Protocol) -> list[str]:
    """The stdout lines `kern verify` prints for a manifest that fits (spec §4.6)."""
    p = protocol
    lines = [f"  rows      `{p.rows.var}` <= {p.rows.max}",
             f"  groups    `{p.groups.var}` <= {p.groups.max}"]
    if p.tray is not None:
        lines.append(f"  tray      `{p.tray.var}` <= {p.tray.max}")
    if p.note is not None:
        lines.append(f"  axes      {p.note}")
    for f in p.fills:
        width = f" x {f.width}" if f.width > 1 else ""
        lines.append(f"  fill      {f.fill:<11} `{f.name}` {f.dtype} "
                     f"[{_axis_text(p, f.axis)}]{width}")
    for t in p.page_tables:
        lines.append(f"  pages     `{t.name}` [{p.groups.var}, {t.width}]")
    for t in p.line_tables:
        width = f", {t.width}" if t.width > 1 else ""
        lines.append(f"  lines     `{t.name}` [{t.lines}, {_axis_text(p, t.axis)}{width}]")
    lines.extend(_forward_line(p, f) for f in p.forwards)
    lines.extend(f"  once      `{name}`" for name in p.once)
    return lines


def _axis_text(p: Protocol, axis: Axis) -> str:
    """An axis as `kern verify` prints it: the var it counts, or the fixed length."""
    if isinstance(axis, Fixed):
        return str(axis.n)
    if axis == "rows":
        return p.rows.var
    if axis == "groups":
        return p.groups.var
    return p.tray.var if p.tray is not None else "tray"


def _forward_line(p: Protocol, f: Forward) -> str:
    if f.rows == VAR_ROWS:
        rows = "rows as fed"
    elif f.span and p.span is not None:
        rows = f"1 row, one of them a run of up to {p.span.max} (`{p.span.var}`)"
    else:
        rows = f"{f.rows} rows"
    emits = f", hands back `{f.emits}`" if f.emits is not None else ", state only"
    count = f" counted by `{f.count}`" if f.count is not None else ""
    return f"  forward   `{f.name}`: <= {f.groups} sequences of {rows}{emits}{count}"


def summary_json(protocol: Protocol) -> dict:
    """The same summary as fields a script can read (`kerncc verify --format json`)."""
    p = protocol

    def bound(b: Bound | None) -> dict | None:
        return None if b is None else {"var": b.var, "max": b.max}

    def axis(a: Axis) -> str | int:
        return a.n if isinstance(a, Fixed) else a

    return {
        "axes": {"rows": bound(p.rows), "groups": bound(p.groups), "tray": bound(p.tray),
                 "span": bound(p.span), "context": bound(p.context),
                 "derived": p.axes_derived, "note": p.note},
        "fills": [{"name": f.name, "fill": f.fill, "dtype": f.dtype, "axis": axis(f.axis),
                   "width": f.width} for f in p.fills],
        "tables": {"pages": [{"name": t.name, "width": t.width} for t in p.page_tables],
                   "lines": [{"name": t.name, "lines": t.lines, "width": t.width,
                              "axis": axis(t.axis)} for t in p.line_tables]},
        "forwards": [{"name": f.name, "groups": f.groups, "rows": f.rows, "span": f.span,
                      "emits": f.emits, "count": f.count} for f in p.forwards],
        "once": list(p.once),
        "derive": list(p.derive),
    }
