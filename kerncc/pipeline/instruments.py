"""Pipeline instruments: code called around every pass (MLIR's PassInstrumentation).

`PrintIRAfter`, `PrintIRAfterAll`, `PrintIRAfterChange`, `TimePasses` and `DumpDir`, and
`instruments_from_args`, which builds them from the `kerncc lower` / `dump` flags.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import attrs

from kerncc.diagnostics import Diagnostic, KernccError
from kerncc.passes import PassRegistry, registry
from kerncc.pipeline.spec import _did_you_mean, pass_spec

if TYPE_CHECKING:
    from kerncc.pipeline.base import ScheduledPass


# ---------------------------------------------------------------------------------------------
# Instruments.

class Instrument:
    """Hooks around passes (MLIR's PassInstrumentation). Every hook is optional."""

    def before_pipeline(self, schedule: tuple[ScheduledPass, ...], ir: Any) -> None:
        """Before the first pass, with the full schedule (required passes inserted)."""

    def before_pass(self, pass_: Any, ir: Any) -> None:
        """Before `pass_` runs on `ir`."""

    def after_pass(self, pass_: Any, ir_before: Any, ir_after: Any) -> None:
        """After `pass_` ran and its result verified."""

    def after_failed(self, pass_: Any, ir: Any, error: BaseException) -> None:
        """After `pass_` (or the verifier after it) raised `error` on `ir`."""

    def after_pipeline(self) -> None:
        """After the last pass, or after a failure."""


@attrs.define
class _Printing(Instrument):
    out: TextIO | None = attrs.field(default=None, kw_only=True)

    def write(self, text: str) -> None:
        # sys.stderr at write time, not at construction: MLIR prints dumps to stderr, and
        # tests and the CLI may swap the stream in between.
        (self.out or sys.stderr).write(text)

    def dump(self, pass_: Any, text: str) -> None:
        self.write(f"// -----// IR Dump After {pass_spec(pass_)} //----- //\n")
        self.write(text if text.endswith("\n") else text + "\n")


@attrs.define
class PrintIRAfter(_Printing):
    """`--print-ir-after=a,b`: print the IR after each pass with one of these names."""

    names: frozenset[str] = attrs.field(converter=frozenset)

    def after_pass(self, pass_: Any, ir_before: Any, ir_after: Any) -> None:
        if pass_.name in self.names:
            self.dump(pass_, ir_after.to_text())


@attrs.define
class PrintIRAfterAll(_Printing):
    """`--print-ir-after-all`: print the IR after every pass."""

    def after_pass(self, pass_: Any, ir_before: Any, ir_after: Any) -> None:
        self.dump(pass_, ir_after.to_text())


@attrs.define
class PrintIRAfterChange(_Printing):
    """`--print-ir-after-change`: print the IR after a pass only when its text changed."""

    def after_pass(self, pass_: Any, ir_before: Any, ir_after: Any) -> None:
        text = ir_after.to_text()
        if text != ir_before.to_text():
            self.dump(pass_, text)


@attrs.define
class TimePasses(_Printing):
    """`--time-passes`: a table of wall time per pass, printed when the pipeline ends."""

    clock: Callable[[], float] = attrs.field(default=time.perf_counter, kw_only=True)
    _schedule: tuple[ScheduledPass, ...] = attrs.field(default=(), init=False)
    _rows: list[tuple[str, float, str]] = attrs.field(factory=list, init=False)
    _start: float = attrs.field(default=0.0, init=False)

    def before_pipeline(self, schedule: tuple[ScheduledPass, ...], ir: Any) -> None:
        self._schedule, self._rows = schedule, []

    def before_pass(self, pass_: Any, ir: Any) -> None:
        self._start = self.clock()

    def after_pass(self, pass_: Any, ir_before: Any, ir_after: Any) -> None:
        self._add_row(pass_, "")

    def after_failed(self, pass_: Any, ir: Any, error: BaseException) -> None:
        self._add_row(pass_, "failed")

    def _add_row(self, pass_: Any, note: str) -> None:
        elapsed = self.clock() - self._start
        required_by = self._schedule[len(self._rows)].required_by
        if required_by:
            note = ", ".join(filter(None, [f"inserted: required by {required_by}", note]))
        self._rows.append((pass_.name, elapsed, note))

    def after_pipeline(self) -> None:
        self.write(self.table())

    def table(self) -> str:
        """The report: one row per pass run, then the total."""
        total = sum(seconds for _, seconds, _ in self._rows)
        width = max([len("total")] + [len(name) for name, _, _ in self._rows])
        lines = ["pass timing (wall clock; a pass's time includes verifying its result)",
                 f"  {'pass':<{width}}  {'wall ms':>10}  {'%':>6}"]
        for name, seconds, note in self._rows + [("total", total, "")]:
            share = 100.0 * seconds / total if total else 0.0
            row = f"  {name:<{width}}  {seconds * 1e3:>10.3f}  {share:>5.1f}%"
            lines.append(f"{row}  {note}" if note else row)
        return "\n".join(lines) + "\n"


@attrs.define
class DumpDir(Instrument):
    """`--dump-dir DIR`: write `00-input.kir`, then `NN-<pass>.kir` after each pass. Files a
    longer earlier run left behind are not removed."""

    directory: Path = attrs.field(converter=Path)
    _count: int = attrs.field(default=0, init=False)

    def make(self) -> DumpDir:
        """The directory, made now: `instruments_from_args` makes it before any pass runs, so
        that a bad --dump-dir is reported as itself and not at a place in the input."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise self._cannot(err) from None
        return self

    def before_pipeline(self, schedule: tuple[ScheduledPass, ...], ir: Any) -> None:
        self.make()
        self._count = 0
        self._write("input", ir)

    def after_pass(self, pass_: Any, ir_before: Any, ir_after: Any) -> None:
        self._count += 1
        self._write(pass_.name, ir_after)

    def _write(self, label: str, ir: Any) -> None:
        try:
            (self.directory / f"{self._count:02d}-{label}.kir").write_text(ir.to_text())
        except OSError as err:
            raise self._cannot(err) from None

    def _cannot(self, err: OSError) -> KernccError:
        """A directory that cannot be made or written is the command line's problem."""
        return KernccError.single(f"--dump-dir `{self.directory}`: {err.strerror or err}")


def instruments_from_args(print_ir_after: Sequence[str] | None, print_ir_after_all: bool,
                          print_ir_after_change: bool, time_passes: bool, dump_dir: str | None,
                          out: TextIO | None = None, reg: PassRegistry | None = None
                          ) -> list[Instrument]:
    """The instruments the CLI flags ask for. `print_ir_after` items may hold comma lists;
    unknown pass names raise KernccError with a did-you-mean. Timing comes last so that it
    measures the pass alone."""
    reg = registry() if reg is None else reg
    instruments: list[Instrument] = []
    if print_ir_after:
        instruments.append(PrintIRAfter(_known_names(print_ir_after, reg), out=out))
    if print_ir_after_all:
        instruments.append(PrintIRAfterAll(out=out))
    if print_ir_after_change:
        instruments.append(PrintIRAfterChange(out=out))
    if dump_dir is not None:
        instruments.append(DumpDir(dump_dir).make())
    if time_passes:
        instruments.append(TimePasses(out=out))
    return instruments


def _known_names(items: Sequence[str], reg: PassRegistry) -> list[str]:
    names = [name.strip() for item in items for name in item.split(",") if name.strip()]
    unknown = [name for name in names if name not in reg]
    if unknown:
        raise KernccError("invalid --print-ir-after:", [
            Diagnostic(f"unknown pass `{name}`{_did_you_mean(name, reg.names())}")
            for name in unknown])
    return names


