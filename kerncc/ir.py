"""The IR: the whole manifest, its stages once cut, the reports passes attach, cached analyses.

Before a cut the IR has one stage, the whole manifest. `cut` replaces `stages` with one verified
manifest per pipeline stage, plus the cut points (per driven program) and the crossing buffers
of each edge. Later passes rewrite stages (always through `kerncc.stage.assemble`, so every
stage verifies) and file reports under their own name (`reports["liveness"]`...). The IR is
frozen: passes return `attrs.evolve(ir, ...)`. Analyses are cached per manifest object.

The IR's analyses are functions of one manifest object, computed once and cached on it
(kerncc.analysis.cache, keyed by identity): `verify` (kerncc.verify), the accesses of each
program (analysis.access.program_access), liveness and buffer sizes (analysis.liveness), and the
dataflow graph with its queries (analysis.dataflow: cut crossings, backward slices, region
touches). A pass asks; it does not recompute. A stage a pass leaves alone keeps its identity,
so its analyses carry over.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kerncc import manifest as m
from kerncc.analysis.dataflow import dataflow_graph, execution_order
from kerncc.stage import host_inputs

__all__ = ["IR", "Edge", "dataflow_graph", "execution_order", "verify_stages"]


@attrs.frozen
class Edge:
    """A buffer that leaves stage `source` for stage `target`, and its bytes at var max."""

    buffer: str
    source: int
    target: int
    nbytes: int


@attrs.frozen
class IR:
    whole: m.Manifest
    stages: tuple[m.Manifest, ...]
    points: dict[str, tuple[int, ...]] = attrs.field(factory=dict)
    edges: tuple[Edge, ...] = ()
    reports: dict[str, Any] = attrs.field(factory=dict)
    history: tuple[str, ...] = ()
    source: str | None = None
    # The pipeline the driver (kerncc.lower.run_lowering) runs on this IR, required passes
    # inserted: what a bundle records. Empty when passes run outside the driver.
    pipeline: str = ""

    @classmethod
    def from_manifest(cls, manifest: m.Manifest, source: str | None = None) -> IR:
        return cls(whole=manifest, stages=(manifest,), source=source)

    @property
    def is_pipeline(self) -> bool:
        return self.stages[0].cut is not None

    def with_report(self, name: str, report: Any) -> IR:
        return attrs.evolve(self, reports={**self.reports, name: report})

    def host_inputs(self, stage: int) -> list[str]:
        """Inputs of a stage the host must write: its inputs that no earlier stage hands on."""
        return host_inputs(self.stages[stage], {e.buffer for e in self.edges
                                                if e.target == stage})

    def verify(self) -> None:
        """Every stage verifies on its own (the runner calls this after each pass)."""
        verify_stages(self.stages, "manifest failed verification:", prefix=self.is_pipeline)

    def to_text(self) -> str:
        """The canonical text: the `.kir` of each stage (one, before a cut)."""
        from kerncc import kir

        if not self.is_pipeline:
            return kir.dumps(self.whole)
        parts = [f"// stage {i} of {len(self.stages)}\n{kir.dumps(s)}"
                 for i, s in enumerate(self.stages)]
        return "\n".join(parts)


def verify_stages(stages: Sequence[m.Manifest], headline: str, *, prefix: bool = True) -> None:
    """Every stage verifies (spec §3.6 step 10); failures read `stage S: <message>`."""
    from kerncc.diagnostics import KernccError
    from kerncc.verify import verify

    problems = []
    for index, stage in enumerate(stages):
        try:
            verify(stage)
        except KernccError as err:
            shown = f"stage {index}: " if prefix else ""
            problems += [attrs.evolve(d, message=shown + d.message) for d in err.diagnostics]
    if problems:
        raise KernccError(headline, problems)
