"""The schedule: each pass preceded by the passes it `requires`.

The Pass base class lives with the registry in kerncc.passes.base (re-exported by the runner):
pass modules import nothing of the pipeline package, so the pipeline, which imports the
passes, is never imported back by them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import attrs

from kerncc.diagnostics import KernccError
from kerncc.passes import PassRegistry, registry


class PassIR(Protocol):
    """What the pipeline needs of an IR; kerncc.ir provides the real one."""

    def to_text(self) -> str: ...

    def verify(self) -> None: ...


IRT = TypeVar("IRT", bound=PassIR)


@attrs.frozen
class ScheduledPass:
    """A pass as the runner runs it; `required_by` names the pass it was inserted for."""

    pass_: Any
    required_by: str | None = None


def schedule_passes(passes: Sequence[Any], reg: PassRegistry | None = None
                    ) -> tuple[ScheduledPass, ...]:
    """The passes in order, each preceded by the passes it requires that have not run yet
    (with default options, recursively); KernccError on an unknown or circular requirement,
    or a pass after one that writes the output."""
    reg = registry() if reg is None else reg
    schedule: list[ScheduledPass] = []
    for pass_ in passes:
        _schedule(pass_, None, reg, schedule, ())
    writers = [item.pass_.name for item in schedule[:-1]
               if getattr(item.pass_, "writes_output", False)]
    if writers:
        raise KernccError.single(f"pass `{writers[0]}` writes the output, so it comes last")
    return tuple(schedule)


def _schedule(pass_: Any, required_by: str | None, reg: PassRegistry,
              schedule: list[ScheduledPass], chain: tuple[str, ...]) -> None:
    if pass_.name in chain:
        cycle = " -> ".join(chain + (pass_.name,))
        raise KernccError.single(f"pass requirements form a cycle: {cycle}")
    for name in pass_.requires:
        if any(item.pass_.name == name for item in schedule):
            continue
        cls = reg.get(name)
        if cls is None:
            raise KernccError.single(f"pass `{pass_.name}` requires unknown pass `{name}`")
        _schedule(cls(), pass_.name, reg, schedule, chain + (pass_.name,))
    schedule.append(ScheduledPass(pass_, required_by))
