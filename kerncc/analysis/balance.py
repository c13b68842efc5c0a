"""Choosing cut points: balance a per-call cost over N stages, only at legal points.

The cost of a call is the bytes its buffer arguments span at var max: in a decoder the weights
dominate, so this tracks each layer's share of a memory-bound step. A point is legal when, in
every driven program, only workspaces cross it, no output or carry is written before it, and no
state region is touched on both sides. Among legal points the one nearest each 1/N share of the
total cost wins; fewer crossing bytes break ties.
"""

from __future__ import annotations

from kerncc import manifest as m
from kerncc.analysis.access import program_access
from kerncc.analysis.liveness import buffer_sizes, crossings
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
        sets = crossings(accesses)
        legal -= _illegal(whole, accesses, sets, length)
        for a in list(crossing_bytes):
            crossing_bytes[a] += sum(sizes.get(b, 0) for b in sets[a])
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


def _pick(costs: list[int], legal: list[int], crossing_bytes: dict[int, int],
          stages: int) -> list[int]:
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    total, picked = prefix[-1], []
    for k in range(1, stages):
        target = total * k / stages
        after = [a for a in legal if not picked or a > picked[-1]]
        if not after:
            break
        picked.append(min(after, key=lambda a: (abs(prefix[a] - target), crossing_bytes[a], a)))
    return picked
