"""The serving protocol's program rules (spec §4.4): every `batch` program becomes a `Forward`.

A forward's shape is its `batch` (groups sequences of rows rows, maybe one run of `span` rows,
maybe a `context` var); what it hands back is not declared but read from dataflow: the `tokens`
output its calls write, and the `count` output, if any. Runs and contexts are protocol-wide: one
var sizes every run and one var bounds every context. Diagnostics point at the program's batch.
"""

from __future__ import annotations

import attrs

from kerncc import manifest as m
from kerncc.analysis.access import program_access
from kerncc.diagnostics import Diagnostics, pointer
from kerncc.protocol.model import VAR_ROWS, Bound, Filled, Forward, Rows
from kerncc.protocol.axes import Axes, buffers_with_fill, shape_text


@attrs.frozen
class Forwards:
    """The forwards in name order, and the one span var and one context var they share."""

    forwards: tuple[Forward, ...]
    span: Bound | None
    context: Bound | None


def read_forwards(manifest: m.Manifest, axes: Axes, fills: list[Filled], sampled: bool,
                  diags: Diagnostics) -> Forwards:
    """Check every `batch` program against the axes and fills; collect their shapes."""
    reader = _ForwardReader(manifest, axes, fills, diags)
    for name in sorted(manifest.programs):
        program = manifest.programs[name]
        if program.batch is not None:
            reader.read(name, program, program.batch)
    reader.check_whole(sampled)
    return Forwards(tuple(reader.forwards), reader.span, reader.context)


class _ForwardReader:
    """Reads one program after another, keeping what programs must agree on."""

    def __init__(self, manifest: m.Manifest, axes: Axes, fills: list[Filled],
                 diags: Diagnostics) -> None:
        self.m = manifest
        self.axes = axes
        self.fills = fills
        self.diags = diags
        self.forwards: list[Forward] = []
        self.span: Bound | None = None
        self.context: Bound | None = None
        self.span_vars = {p.batch.span for p in manifest.programs.values()
                          if p.batch is not None and p.batch.span is not None}

    def read(self, name: str, program: m.Program, batch: m.Batch) -> None:
        ctx, where = f"program `{name}`", pointer("programs", name, "batch")
        rows = self._rows(ctx, where, batch)
        if batch.groups > self.axes.groups.max:
            self.diags.error(f"{ctx}: {batch.groups} groups exceed the {self.axes.groups.max} "
                             f"`{self.axes.groups.var}` allows", f"{where}/groups")
        spanned = self._span(ctx, where, batch, rows)
        self._context(ctx, where, batch)
        written = _written(self.m, program)
        emits = self._emits(ctx, name, rows, written)
        count = self._count(ctx, name, emits, written)
        self._unique_shape(ctx, where, batch.groups, rows, spanned)
        self.forwards.append(Forward(name, batch.groups, rows, spanned,
                                     emits.name if emits else None, count))

    def check_whole(self, sampled: bool) -> None:
        """The rules over all forwards: something to drive, something that samples, a span_at."""
        if not self.forwards:
            self.diags.error("no program declares a `batch`: nothing for a serving loop to drive",
                             "/programs")
        elif sampled and all(f.emits is None for f in self.forwards):
            self.diags.error("no program with a `batch` writes a `tokens` output: "
                             "no call hands a token back", "/programs")
        runs = [f.name for f in self.forwards if f.span]
        if runs and not buffers_with_fill(self.m, "span_at"):
            self.diags.error("a program takes a run of rows (batch.span) but no input has "
                             "fill `span_at`", pointer("programs", runs[0], "batch", "span"))

    # ---------------------------------------------------------------- the shape

    def _rows(self, ctx: str, where: str, batch: m.Batch) -> Rows:
        rows = self.axes.rows
        if isinstance(batch.rows, int):
            if batch.groups * batch.rows > rows.max:
                self.diags.error(f"{ctx}: {batch.groups} sequences of {batch.rows} rows exceed "
                                 f"the {rows.max} rows `{rows.var}` allows", f"{where}/rows")
            return batch.rows
        if batch.rows != rows.var:
            self.diags.error(f"{ctx}: batch.rows is var `{batch.rows}`, but the rows of a call "
                             f"go in `{rows.var}`", f"{where}/rows")
        # Newest kern: a packed prefill chunk carries several sequences, split by cu_seqlens.
        if batch.groups > 1 and not buffers_with_fill(self.m, "cu_seqlens"):
            self.diags.error(f"{ctx}: a call of {batch.groups} sequences with rows set per "
                             "call needs a `cu_seqlens` fill to split them", f"{where}/groups")
        return VAR_ROWS

    def _span(self, ctx: str, where: str, batch: m.Batch, rows: Rows) -> bool:
        if batch.span is None:
            return False
        var = batch.span
        if rows != 1:
            self.diags.error(f"{ctx}: a span rides a call of one row per sequence, "
                             f"not `{batch.rows}`", f"{where}/span")
        if var in (self.axes.rows.var, self.axes.groups.var):
            self.diags.error(f"{ctx}: batch.span is `{var}`, which sizes the call itself; "
                             "a run needs its own var", f"{where}/span")
        bound = self._run_bound(ctx, where, var)
        if bound is None:
            return True
        if self.span is None:
            self.span = bound
        elif self.span != bound:
            self.diags.error(f"{ctx}: batch.span is `{var}`, but `{self.span.var}` sizes a run "
                             "in another program; one var sizes every run", f"{where}/span")
        return True

    def _run_bound(self, ctx: str, where: str, var: str) -> Bound | None:
        if var not in self.m.vars:
            self.diags.error(f"{ctx}: batch.span names unknown var `{var}`", f"{where}/span")
            return None
        bound, rows = Bound(var, self.m.vars[var].max), self.axes.rows
        if bound.max > rows.max:
            self.diags.error(f"{ctx}: a run of {bound.max} rows (`{var}`) exceeds the "
                             f"{rows.max} rows `{rows.var}` allows", f"{where}/span")
            return None
        return bound

    def _context(self, ctx: str, where: str, batch: m.Batch) -> None:
        var = batch.context
        if var is None:
            return
        if var in (self.axes.rows.var, self.axes.groups.var) or var in self.span_vars:
            self.diags.error(f"{ctx}: batch.context is `{var}`, which sizes the call itself; "
                             "the context needs its own var", f"{where}/context")
            return
        if var not in self.m.vars:
            self.diags.error(f"{ctx}: batch.context names unknown var `{var}`",
                             f"{where}/context")
            return
        if self.context is None:
            self.context = Bound(var, self.m.vars[var].max)
        elif self.context.var != var:
            self.diags.error(f"{ctx}: batch.context is `{var}`, but `{self.context.var}` bounds "
                             "the context in another program; one var bounds every context",
                             f"{where}/context")

    def _unique_shape(self, ctx: str, where: str, groups: int, rows: Rows,
                      spanned: bool) -> None:
        for other in self.forwards:
            if (other.groups, other.rows, other.span) == (groups, rows, spanned):
                self.diags.error(f"{ctx} and `{other.name}` accept the same call shape; "
                                 "a shape names one program", where)
                return

    # ---------------------------------------------------------------- what it hands back

    def _emits(self, ctx: str, name: str, rows: Rows, written: set[str]) -> Filled | None:
        tokens = [f for f in self.fills if f.fill == "tokens" and f.name in written]
        if not tokens:
            return None
        if len(tokens) > 1:
            names = shape_text([f.name for f in tokens])
            self.diags.error(f"{ctx}: writes {len(tokens)} `tokens` outputs ({names}); "
                             "a call hands back one", pointer("programs", name, "calls"))
            return None
        out = tokens[0]
        if out.width != 1 and out.width != rows:
            per = "a variable number of" if rows == VAR_ROWS else rows
            self.diags.error(f"{ctx}: hands back `{out.name}` of {out.width} per sequence, "
                             f"but a call has {per} rows per sequence",
                             pointer("programs", name, "batch", "rows"))
        return out

    def _count(self, ctx: str, name: str, emits: Filled | None,
               written: set[str]) -> str | None:
        counts = [f.name for f in self.fills if f.fill == "count" and f.name in written]
        if not counts:
            return None
        if emits is None or emits.width <= 1:
            self.diags.error(f"{ctx}: writes `{counts[0]}` (fill `count`) but no `tokens` output "
                             "of several per sequence to count", pointer("programs", name, "calls"))
        return counts[0]


def _written(manifest: m.Manifest, program: m.Program) -> set[str]:
    """Buffers the program's calls pass to an `out` or `inout` param."""
    written: set[str] = set()
    for access in program_access(manifest, program):
        written |= access.buffer_writes
    return written
