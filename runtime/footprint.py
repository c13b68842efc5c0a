"""A bundle's device memory, from its plans alone, and the check that it fits before any load.

`stage_footprint(manifest, plan, token_capacity)` sums what `kerncc.runtime.memory.Memory`
will allocate for one stage, by the same rules (plan.json's `memory` and `arena`, states by
kind): the weights (weight and carry buffers), the other buffers (inputs, outputs, edges), the
arena, the states (the KV pool: bytes per token x token capacity) and the derive staging, which
lives only while loading. Its `peak` is everything at once (the staging is freed after the
derive programs, so the resident memory after load is `peak - staging`).

`fitting_capacity(stages, free, default)` is the token capacity a device gets when none is
given: the default where it fits, else the most whole pages that do, less a headroom.

`check_fits(footprints, free, where)` refuses a load whose peak does not fit a device's free
bytes, naming the largest part and what lowers it, before a single byte is allocated. Both are
pure functions: the cuda backend supplies the free bytes (`Backend.free_bytes`, cuMemGetInfo)
and its allocation rounding (`Backend.device_bytes`); the cpu backend has no limit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from kerncc import manifest as m
from kerncc.diagnostics import Diagnostic, KernccError, Location
from kerncc.runtime.memory import (NOT_ALLOCATED, PAGE_MULTIPLE, default_token_capacity,
                                   state_bytes)

WEIGHT_KINDS = ("weight", "carry")
MiB = 1 << 20
GiB = 1 << 30


def exact(nbytes: int) -> int:
    """Allocation rounding of a backend that takes exactly what is asked (the cpu's)."""
    return nbytes


@attrs.frozen
class StageFootprint:
    """One stage's device memory by part, each a list of allocation sizes in bytes."""

    stage: int
    weights: tuple[int, ...]
    buffers: tuple[int, ...]
    arena: int
    states: tuple[int, ...]
    staging: int
    token_capacity: int
    page_tokens: int  # tokens of one KV page (the page tables' stride); 0 without a pool

    @property
    def pages(self) -> int:
        """Pages of the KV pool (0 when the stage keeps no per-token state)."""
        return self.token_capacity // self.page_tokens if self.page_tokens else 0

    def parts(self, rounding: Callable[[int], int] = exact) -> dict[str, int]:
        """Bytes by part, each allocation rounded as the device rounds it."""
        return {"weights": sum(rounding(n) for n in self.weights),
                "buffers": sum(rounding(n) for n in self.buffers),
                "arena": rounding(self.arena), "kv pool": sum(rounding(n) for n in self.states),
                "staging": rounding(self.staging) if self.staging else 0}

    def resident(self, rounding: Callable[[int], int] = exact) -> int:
        """What stays allocated after load (everything but the staging)."""
        parts = self.parts(rounding)
        return sum(parts.values()) - parts["staging"]

    def peak(self, rounding: Callable[[int], int] = exact) -> int:
        """The most bytes allocated at once: at load, while the derive staging is held."""
        return sum(self.parts(rounding).values())

    def to_json(self) -> dict:
        return {"stage": self.stage, **{k.replace(" ", "_"): v for k, v in self.parts().items()},
                "resident": self.resident(), "peak": self.peak(),
                "token_capacity": self.token_capacity, "page_tokens": self.page_tokens,
                "pages": self.pages}


def page_tokens(man: m.Manifest) -> int:
    """Tokens per page of the stage's page tables (inputs indexing a per-token state); 0 when
    it has none."""
    strides = {buf.domain.stride for buf in man.buffers.values()
               if buf.kind in ("input", "inout") and buf.domain is not None
               and buf.domain.index_into in man.states
               and man.states[buf.domain.index_into].bytes_per_token}
    return max(strides, default=0) or 0


def stage_footprint(stage: int, man: m.Manifest, plan: dict,
                    token_capacity: int | None = None) -> StageFootprint:
    """What Memory allocates for this stage at `token_capacity` (default: the stage's own)."""
    capacity = token_capacity or default_token_capacity(man)
    records = plan["memory"].get("buffers", {})
    allocated = {name: int(r["bytes"]) for name, r in records.items()
                 if r.get("kind") not in NOT_ALLOCATED}
    weights = tuple(n for name, n in sorted(allocated.items())
                    if records[name].get("kind") in WEIGHT_KINDS)
    others = tuple(n for name, n in sorted(allocated.items())
                   if records[name].get("kind") not in WEIGHT_KINDS)
    states = tuple(state_bytes(name, record, capacity, man.seq_slots())
                   for name, record in sorted(plan["memory"].get("states", {}).items()))
    return StageFootprint(stage, weights, others, int(plan["arena"].get("bytes", 0)), states,
                          int(plan.get("staging", {}).get("total", 0)), capacity,
                          page_tokens(man))


def bundle_footprints(stages: Sequence[tuple[m.Manifest, dict]],
                      token_capacity: int | None = None) -> list[StageFootprint]:
    """Every stage's footprint at the one token capacity a Chain gives them all (the largest
    stage default, unless given)."""
    capacity = token_capacity or max((default_token_capacity(man) for man, _ in stages),
                                     default=1)
    return [stage_footprint(k, man, plan, capacity) for k, (man, plan) in enumerate(stages)]


def fitting_capacity(stages: Sequence[tuple[int, m.Manifest, dict]], free: int | None,
                     default: int, rounding: Callable[[int], int] = exact) -> int:
    """The token capacity a device's `stages` get when none is given: `default` (every
    sequence at the context bound) where that fits `free` bytes less `headroom(free)`, else the
    most tokens that do, in whole pages (a KV pool sized to the device, as a serving engine
    sizes it, rather than a refusal). Never below one chunk's rows (`chunk_rows`): a device that
    cannot hold that much keeps `default`, and `check_fits` refuses it, naming what to lower."""
    if free is None:
        return default

    def peak(capacity: int) -> int:
        return sum(stage_footprint(k, man, plan, capacity).peak(rounding)
                   for k, man, plan in stages)

    room = free - headroom(free)
    if peak(default) <= room:
        return default
    step = max((page_tokens(man) for _, man, _ in stages), default=0) or PAGE_MULTIPLE
    low = -(-chunk_rows([man for _, man, _ in stages]) // step)  # pages
    high = default // step
    if low > high or peak(low * step) > room:
        return default
    while low < high:  # the most pages that fit: peak grows with the pages
        mid = (low + high + 1) // 2
        low, high = (mid, high) if peak(mid * step) <= room else (low, mid - 1)
    return low * step


def headroom(free: int) -> int:
    """Device bytes a fitted KV pool leaves to what no plan counts (the BLAS workspace, CUDA
    graphs, the driver's own): 5% of the free bytes, at least 512 MiB."""
    return max(free // 20, 512 * MiB)


def chunk_rows(manifests: Sequence[m.Manifest]) -> int:
    """The fewest token slots a fitted pool may have: one call's rows at their bound."""
    return max((v.max for man in manifests for v in man.vars.values() if v.axis == "rows"),
               default=1)


# ---------------------------------------------------------------------------------------------
# The check


LOWER = {
    "weights": "the weights: cut the model into more stages on more devices "
               "(`kerncc lower -p 'cut{stages=N},...'`) or import them as FP8 "
               "(`kerncc import --quantize fp8`)",
    "kv pool": "the KV pool: fewer sequences or a shorter context at import "
               "(`kerncc import --max-seqs` / `--max-context`), or a smaller token capacity "
               "(`--kv-tokens`)",
    "arena": "the arena: fewer rows per call at import (`kerncc import --max-tokens`)",
    "buffers": "the buffers: fewer rows per call at import (`kerncc import --max-tokens`)",
    "staging": "the derive staging: cut the model into more stages",
}


def human(nbytes: int) -> str:
    if nbytes >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    if nbytes >= MiB:
        return f"{nbytes / MiB:.1f} MiB"
    return f"{nbytes / 1024:.1f} KiB" if nbytes >= 1024 else f"{nbytes} B"


def check_fits(footprints: Sequence[StageFootprint], free: int | None, where: str,
               rounding: Callable[[int], int] = exact) -> None:
    """Refuse stages whose peak together passes `free` bytes of the device `where`; None
    (a backend without a device limit) always fits."""
    if free is None:
        return
    need = sum(f.peak(rounding) for f in footprints)
    if need <= free:
        return
    totals: dict[str, int] = {}
    for f in footprints:
        for part, n in f.parts(rounding).items():
            totals[part] = totals.get(part, 0) + n
    pages = sum(f.pages for f in footprints[:1])
    detail = ", ".join(f"{part} {human(n)}" for part, n in totals.items() if n)
    largest = max(totals, key=lambda part: totals[part])
    stages = ", ".join(str(f.stage) for f in footprints)
    raise KernccError(
        f"{where}: stage{'s' if len(footprints) > 1 else ''} {stages} need {human(need)} at "
        f"load ({detail}; {pages} KV pages), but the device has {human(free)} free; "
        f"nothing was loaded",
        [Diagnostic(f"lower {LOWER[largest]}", Location("")),
         *(Diagnostic(f"or lower {LOWER[p]}", Location(""))
           for p in sorted(totals, key=lambda p: -totals[p])[1:3] if totals[p])])


def text(footprints: Sequence[StageFootprint]) -> list[str]:
    """The footprint as table rows (part, then one column per stage), for report and serve."""
    rows = [["", *(f"stage{f.stage}" for f in footprints)]]
    for part in ("weights", "buffers", "arena", "kv pool", "staging"):
        rows.append([part, *(human(f.parts()[part]) for f in footprints)])
    rows.append(["peak (load)", *(human(f.peak()) for f in footprints)])
    rows.append(["resident", *(human(f.resident()) for f in footprints)])
    rows.append(["kv pages", *(f"{f.pages} x {f.page_tokens}" if f.pages else "-"
                               for f in footprints)])
    return rows


def summary(f: StageFootprint) -> str:
    """One line of a stage's footprint (what `kerncc serve` prints before it loads)."""
    parts = ", ".join(f"{part} {human(n)}" for part, n in f.parts().items() if n)
    pool = f"{f.pages} KV pages of {f.page_tokens} tokens" if f.pages else "no KV pool"
    return f"stage {f.stage}: {human(f.peak())} at load, {human(f.resident())} resident " \
           f"({parts}; {pool})"
