"""Prefill packing (spec §6.2): which waiting sequences' rows go into one chunk call.

`pack(seqs, bounds)` is kern-serve's `pp/pack.rs` as a pure function: walk the sequences in
admission order, skip those with nothing left, give each as many rows as the call still has
room for (rows, sequences, context), stop at the first that gets none. Oldest first and no
older sequence skipped while it could still take a row, so nothing starves; the last one may
get a partial chunk. The context counts every packed sequence's length after the call (what a
context-sized kernel expands).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


@attrs.frozen
class Waiting:
    """A sequence with prefill rows to go: `pos` rows already cached, `left` still to feed."""

    pos: int
    left: int


@attrs.frozen
class Bounds:
    """What one chunk call holds: rows in all, sequences, and the summed context after it."""

    rows: int
    seqs: int
    context: int


def pack(seqs: Sequence[Waiting], bounds: Bounds) -> list[tuple[int, int]]:
    """The (index into `seqs`, rows) of one chunk call, in admission order."""
    plan: list[tuple[int, int]] = []
    rows = context = 0
    for index, seq in enumerate(seqs):
        if seq.left == 0:
            continue
        room = max(0, bounds.context - (context + seq.pos))
        n = min(seq.left, bounds.rows - rows, room)
        if n <= 0 or len(plan) == bounds.seqs:
            break
        plan.append((index, n))
        rows += n
        context += seq.pos + n
    return plan
