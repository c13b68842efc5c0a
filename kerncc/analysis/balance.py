"""Choosing cut points: balance a per-call cost over N stages, only at legal points.

The cost of a call is the bytes its buffer arguments span at var max: in a decoder the weights
dominate, so this tracks each layer's share of a memory-bound step. A point is legal when, in
every driven program, only workspaces cross it, no output or carry is written before it, and no
state region is touched on both sides. The balance of a cut is the cost of its heaviest stage;
among the cuts within a few percent (BALANCE_SLACK) of the best balance, the one with the fewest
crossing bytes wins, so a layer boundary beats a nearby point inside a layer.
"""

from __future__ import annotations

from kerncc import manifest as m
from kerncc.analysis.access import program_access
from kerncc.analysis.liveness import analyze_program, buffer_sizes
from kerncc.diagnostics import KernccError


def balanced_points(whole: m.Manifest, stages: int) -> dict[str, tuple[int, ...]]:
    driven = whole.driven_programs()
    if not driven:
        raise KernccError.single("no program declares a `batch`: nothing to cut", "/programs")
    if stages < 2:
        raise KernccError.elsewhere(f"cut{{stages={stages}}}: a cut has at least 2 stages")
    costs, legal, crossing_bytes = _profile(whole, driven)
    picked = _pick(costs, legal, crossing_bytes, stages)
    if len(picked) != stages - 1:
        raise KernccError.single(
            f"no {stages}-stage cut exists: only {len(legal)} legal cut points "
            "(a point is legal when only workspaces cross it, no output or carry is written "
            "before it and no state region is touched on both sides)")
    return {name: tuple(picked) for name in driven}


def _profile(whole: m.Manifest, driven: list[str]) -> tuple[list[int], list[int], dict[int, int]]:
    sizes = buffer_sizes(whole)
    length = min(len(whole.programs[p].calls) for p in driven)
    costs = [0] * length
    legal = set(range(1, length))
    crossing_bytes: dict[int, int] = {a: 0 for a in legal}
    for name in driven:
        accesses = program_access(whole, whole.programs[name])
        for i, acc in enumerate(accesses[:length]):
            costs[i] += sum(sizes.get(b, 0) for b in acc.buffers)
        # The program's liveness (cached: the `liveness` pass has usually computed it) holds
        # kern's crossing set at every index and its bytes at var max.
        live = analyze_program(whole, name)
        legal -= _illegal(whole, accesses, live.crossing, length)
        for a in crossing_bytes:
            crossing_bytes[a] += live.crossing_bytes[a]
    return costs, sorted(legal), crossing_bytes


def _illegal(whole: m.Manifest, accesses, sets, length: int) -> set[int]:
    bad = {a for a in range(1, length)
           if any(whole.buffers[b].kind != "workspace" for b in sets[a])}
    first_output = next((i for i, acc in enumerate(accesses)
                         if any(whole.buffers[b].kind in ("output", "carry")
                                for b in acc.buffer_writes)), length)
    bad |= set(range(first_output + 1, length))
    span: dict[tuple[str, int], tuple[int, int]] = {}
    for i, acc in enumerate(accesses):
        for region in acc.regions:
            lo, _ = span.get(region, (i, i))
            span[region] = (lo, i)
    for lo, hi in span.values():
        bad |= set(range(lo + 1, hi + 1))
    return bad


BALANCE_SLACK = 0.03
"""How much heavier than the best balance a cut may make its heaviest stage to cross fewer
bytes: 3%, so that a layer boundary (one residual crosses) beats a point inside a layer (the
residual and a projection's output cross) a few calls away."""


def _pick(costs: list[int], legal: list[int], crossing_bytes: dict[int, int],
          stages: int) -> list[int]:
    """The stages-1 legal points whose heaviest stage is within BALANCE_SLACK of the lightest
    possible heaviest stage, and among those the fewest crossing bytes (then the earliest)."""
    if len(legal) < stages - 1:
        return legal
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = _least_heaviest(prefix, legal, stages)
    return _fewest_bytes(prefix, legal, crossing_bytes, stages, best * (1 + BALANCE_SLACK))


def _least_heaviest(prefix: list[int], legal: list[int], stages: int) -> int:
    """The least cost of the heaviest stage over every way to cut at stages-1 legal points
    (binary search over the bound; `_fits` decides one bound greedily)."""
    low, high = 0, prefix[-1]
    while low < high:
        middle = (low + high) // 2
        if _fits(prefix, legal, stages, middle):
            high = middle
        else:
            low = middle + 1
    return low


def _fits(prefix: list[int], legal: list[int], stages: int, bound: int) -> bool:
    """Whether at most stages-1 legal points cut every stage to at most `bound` (more points
    only lighten stages, and there are enough legal points to reach exactly stages-1)."""
    at, cuts, i = 0, 0, 0
    while prefix[-1] - prefix[at] > bound:
        furthest = None
        while i < len(legal) and prefix[legal[i]] - prefix[at] <= bound:
            furthest = legal[i] if legal[i] > at else furthest
            i += 1
        if furthest is None:
            return False
        at, cuts = furthest, cuts + 1
    return cuts <= stages - 1


def _fewest_bytes(prefix: list[int], legal: list[int], crossing_bytes: dict[int, int],
                  stages: int, bound: float) -> list[int]:
    """stages-1 legal points, every stage at most `bound`, the fewest crossing bytes in all
    (ties: the earliest points). Dynamic programming over (cuts made, last point)."""
    # best[i]: (bytes, points) of the cheapest way to end the cuts so far at legal[i]
    best: list[tuple[int, tuple[int, ...]] | None] = [
        (crossing_bytes[a], (a,)) if prefix[a] <= bound else None for a in legal]
    for _ in range(stages - 2):
        best = [_extend(prefix, legal, crossing_bytes, best, i, bound)
                for i in range(len(legal))]
    ends = [b for a, b in zip(legal, best) if b is not None and prefix[-1] - prefix[a] <= bound]
    return list(min(ends)[1]) if ends else []


def _extend(prefix: list[int], legal: list[int], crossing_bytes: dict[int, int],
            best: list, i: int, bound: float) -> tuple[int, tuple[int, ...]] | None:
    a = legal[i]
    before = [best[j] for j in range(i) if best[j] is not None
              and prefix[a] - prefix[legal[j]] <= bound]
    if not before:
        return None
    spent, points = min(before)
    return spent + crossing_bytes[a], points + (a,)
