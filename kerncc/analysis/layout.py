"""Memory layout algorithms: kern's source staging rule and the workspace arena planner.

Both are pure functions of live ranges and sizes; they know nothing of manifests.

- `staging_layout` is kern's rule for the derive staging allocation (spec §5), kept exact:
  windows in (first call, input index) order, each at the lowest 256-aligned offset clear of
  every already-placed window still alive at its first call.
- `arena_layout` packs workspaces into one arena so that buffers live at the same call never
  share bytes. Packing is NP-hard in general; we run greedy placement (best fit and first fit)
  over several orders, keep the smallest, then try a few deterministic re-orderings that lift
  the item that sets the top. It reports the lower bound (the most bytes live at one call) so
  callers can see how close the plan is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import attrs

ALIGN = 256


def align_up(n: int, alignment: int = ALIGN) -> int:
    """`n` rounded up to a multiple of `alignment`."""
    return -(-n // alignment) * alignment


# ---------------------------------------------------------------------------------------------
# Source staging (spec §5)


@attrs.frozen
class Window:
    """A source's staging window: the first and last derive call reading it, and its size."""

    first: int
    last: int
    bytes: int
    name: str


@attrs.frozen
class StagingLayout:
    offsets: dict[str, int]
    total: int


def _check_window(w: Window) -> None:
    if w.first > w.last or w.bytes < 0:
        raise ValueError(f"window `{w.name}`: calls [{w.first}, {w.last}], {w.bytes} bytes")


def _first_clear_offset(w: Window, placed: Sequence[tuple[Window, int]]) -> int:
    """kern's scan: bump past any obstructing live window until none obstructs."""
    live = [(off, off + p.bytes) for p, off in placed if p.last >= w.first and p.bytes > 0]
    offset = 0
    moved = True
    while moved and w.bytes > 0:
        moved = False
        for start, end in live:
            if start < offset + w.bytes and offset < end:
                offset = align_up(end)
                moved = True
    return offset


def staging_layout(windows: Sequence[Window]) -> StagingLayout:
    """Offsets of the source windows in the one staging allocation, and its size."""
    for w in windows:
        _check_window(w)
    if len({w.name for w in windows}) != len(windows):
        raise ValueError("window names must be unique")
    order = sorted(range(len(windows)), key=lambda i: (windows[i].first, i))
    placed: list[tuple[Window, int]] = []
    for i in order:
        w = windows[i]
        placed.append((w, _first_clear_offset(w, placed)))
    offsets = {w.name: off for w, off in placed}
    total = max((off + w.bytes for w, off in placed), default=0)
    return StagingLayout(offsets, total)


# ---------------------------------------------------------------------------------------------
# Workspace arena


@attrs.frozen
class Interval:
    """A workspace's live range: inclusive call indices [start, end] and its size.

    Several intervals may share a name: one buffer live in several separate ranges (written
    again each layer). They get one offset, and must agree on `bytes`.
    """

    name: str
    start: int
    end: int
    bytes: int


@attrs.frozen
class ArenaLayout:
    offsets: dict[str, int]
    total: int  # arena size: the top placed byte, rounded up to ALIGN
    lower_bound: int  # the most ALIGN-rounded bytes live at any one call
    naive: int  # every buffer its own space
    strategy: str  # which order and fit produced the plan


@attrs.frozen
class _Item:
    """One buffer to place: its size rounded to ALIGN and its live calls as a bit mask."""

    name: str
    size: int
    start: int
    end: int
    live: int  # bit t set when the buffer is live at call t

    @property
    def span(self) -> int:
        return self.end - self.start


def _mask(start: int, end: int) -> int:
    return ((1 << (end - start + 1)) - 1) << start


def _items(intervals: Iterable[Interval]) -> list[_Item]:
    merged: dict[str, _Item] = {}
    for iv in intervals:
        if iv.start > iv.end or iv.start < 0 or iv.bytes < 0:
            raise ValueError(f"interval `{iv.name}`: calls [{iv.start}, {iv.end}], "
                             f"{iv.bytes} bytes")
        old = merged.get(iv.name)
        if old is not None and old.size != align_up(iv.bytes):
            raise ValueError(f"intervals of `{iv.name}` disagree on bytes")
        item = _Item(iv.name, align_up(iv.bytes), iv.start, iv.end, _mask(iv.start, iv.end))
        if old is not None:
            item = _Item(iv.name, old.size, min(old.start, iv.start), max(old.end, iv.end),
                         old.live | item.live)
        merged[iv.name] = item
    return list(merged.values())


def _conflicts(items: Sequence[_Item]) -> list[set[int]]:
    """For each item, the indices of the items live at some call with it."""
    out: list[set[int]] = [set() for _ in items]
    for i, a in enumerate(items):
        for j in range(i + 1, len(items)):
            if a.live & items[j].live:
                out[i].add(j)
                out[j].add(i)
    return out


def lower_bound(items: Sequence[_Item]) -> int:
    """The most rounded bytes live at any one call: no valid plan is smaller."""
    deltas: dict[int, int] = {}
    for item in items:
        live, t = item.live, 0
        while live:
            if live & 1:
                deltas[t] = deltas.get(t, 0) + item.size
            live >>= 1
            t += 1
    return max(deltas.values(), default=0)


# Placement: each item goes into a gap between already-placed conflicting items.

Fit = Callable[[list[tuple[int, int]], int], int]


def _gaps(taken: list[tuple[int, int]]) -> list[tuple[int, int | None]]:
    """Free (start, length) gaps between the occupied (offset, end) ranges; last is open."""
    gaps: list[tuple[int, int | None]] = []
    cursor = 0
    for offset, end in sorted(taken):
        if offset > cursor:
            gaps.append((cursor, offset - cursor))
        cursor = max(cursor, end)
    gaps.append((cursor, None))
    return gaps


def best_fit(taken: list[tuple[int, int]], size: int) -> int:
    """The smallest gap that holds `size`; past the top when none does."""
    fitting = [(length, start) for start, length in _gaps(taken)
               if length is not None and length >= size]
    if fitting:
        return min(fitting)[1]
    return _gaps(taken)[-1][0]


def first_fit(taken: list[tuple[int, int]], size: int) -> int:
    """The lowest gap that holds `size`."""
    for start, length in _gaps(taken):
        if length is None or length >= size:
            return start
    raise AssertionError("the last gap is open")


def _place(items: Sequence[_Item], conflicts: Sequence[set[int]], order: Sequence[int],
           fit: Fit) -> tuple[dict[int, int], int]:
    offsets: dict[int, int] = {}
    for i in order:
        taken = [(offsets[j], offsets[j] + items[j].size) for j in conflicts[i] if j in offsets]
        offsets[i] = fit(taken, items[i].size) if items[i].size else 0
    total = max((offsets[i] + items[i].size for i in offsets), default=0)
    return offsets, total


# Orders tried: (name, sort key). Ties fall back to the input index for determinism.
_ORDERS: list[tuple[str, Callable[[_Item], tuple]]] = [
    ("size", lambda it: (-it.size, it.start)),
    ("size-span", lambda it: (-it.size, -it.span, it.start)),
    ("area", lambda it: (-it.size * (it.span + 1), it.start)),
    ("span", lambda it: (-it.span, -it.size, it.start)),
    ("start", lambda it: (it.start, -it.size)),
    ("end", lambda it: (it.end, -it.size)),
]
_FITS: list[tuple[str, Fit]] = [("best-fit", best_fit), ("first-fit", first_fit)]


def _orders(items: Sequence[_Item]) -> list[tuple[str, list[int]]]:
    indices = range(len(items))
    return [(name, sorted(indices, key=lambda i: (key(items[i]), i))) for name, key in _ORDERS]


@attrs.frozen
class _Plan:
    strategy: str
    offsets: dict[int, int]
    total: int


def _lift_top(items: Sequence[_Item], conflicts: Sequence[set[int]], order: list[int],
              fit: Fit, plan: _Plan, rounds: int = 8) -> _Plan:
    """Improve a greedy plan: move the items that reach the top to the front and re-place.

    The top is set by items that found no gap low enough; placing them earlier lets the
    others fit around them. Deterministic, at most `rounds` re-placements, each kept only if
    it lowers the top.
    """
    offsets, total, lifted = plan.offsets, plan.total, 0
    for _ in range(rounds):
        top = [i for i in order if offsets[i] + items[i].size == total]
        candidate = top + [i for i in order if i not in top]
        new_offsets, new_total = _place(items, conflicts, candidate, fit)
        if new_total >= total:
            break
        order, offsets, total, lifted = candidate, new_offsets, new_total, lifted + 1
    suffix = f"+lift{lifted}" if lifted else ""
    return _Plan(plan.strategy + suffix, offsets, total)


def _search(items: Sequence[_Item], conflicts: Sequence[set[int]], floor: int) -> _Plan:
    """The smallest plan over every (order, fit); stops early at the lower bound."""
    best: _Plan | None = None
    for order_name, order in _orders(items):
        for fit_name, fit in _FITS:
            offsets, total = _place(items, conflicts, order, fit)
            plan = _Plan(f"{order_name}/{fit_name}", offsets, total)
            if total > floor:
                plan = _lift_top(items, conflicts, order, fit, plan)
            if best is None or plan.total < best.total:
                best = plan
            if best.total <= floor:
                return best
    assert best is not None
    return best


def arena_layout(intervals: Iterable[Interval]) -> ArenaLayout:
    """Offsets for every buffer in one arena; conflicting live ranges never share bytes."""
    items = _items(intervals)
    if not items:
        return ArenaLayout({}, 0, 0, 0, "empty")
    conflicts = _conflicts(items)
    floor = lower_bound(items)
    naive = sum(it.size for it in items)
    plan = _search(items, conflicts, floor)
    if plan.total > naive:
        plan = _Plan("naive", _stacked(items), naive)
    named = {items[i].name: plan.offsets[i] for i in range(len(items))}
    return ArenaLayout(named, plan.total, floor, naive, plan.strategy)


def _stacked(items: Sequence[_Item]) -> dict[int, int]:
    offsets: dict[int, int] = {}
    cursor = 0
    for i, item in enumerate(items):
        offsets[i] = cursor
        cursor += item.size
    return offsets
