"""kerncc.analysis.layout: kern's staging rule (spec §5 properties) and the workspace arena planner."""

from __future__ import annotations

from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kerncc.analysis.layout import (
    ALIGN,
    Interval,
    Window,
    align_up,
    arena_layout,
    best_fit,
    first_fit,
    staging_layout,
)

# Bounded profiles: spec §5 asks for 2,000 random staging cases; these two tests give them.
STAGING_GENERAL = settings(max_examples=1500, deadline=None)
STAGING_CHAIN = settings(max_examples=500, deadline=None)
ARENA = settings(max_examples=300, deadline=None)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Half-open byte ranges (or inclusive call ranges shifted by one) intersect."""
    return a[0] < b[1] and b[0] < a[1]


# ---------------------------------------------------------------------------------------------
# Staging


@st.composite
def _windows(draw: st.DrawFn) -> list[Window]:
    count = draw(st.integers(0, 12))
    out = []
    for i in range(count):
        first = draw(st.integers(0, 20))
        last = first + draw(st.integers(0, 6))
        size = draw(st.one_of(st.integers(0, 3000), st.integers(0, 8).map(lambda k: k * ALIGN)))
        out.append(Window(first, last, size, f"s{i}"))
    return out


def _lowest_clear(w: Window, placed: list[tuple[Window, int]]) -> int:
    """Oracle: scan every aligned offset upward until none of the live windows is hit."""
    live = [(off, off + p.bytes) for p, off in placed if p.last >= w.first]
    offset = 0
    while any(_overlap((offset, offset + w.bytes), r) for r in live if w.bytes and r[1] > r[0]):
        offset += ALIGN
    return offset


def _oracle(windows: list[Window]) -> dict[str, int]:
    placed: list[tuple[Window, int]] = []
    for i in sorted(range(len(windows)), key=lambda i: (windows[i].first, i)):
        placed.append((windows[i], _lowest_clear(windows[i], placed)))
    return {w.name: off for w, off in placed}


@STAGING_GENERAL
@given(_windows())
def test_staging_properties(windows: list[Window]) -> None:
    layout = staging_layout(windows)
    offsets = layout.offsets
    assert all(off % ALIGN == 0 for off in offsets.values())
    assert layout.total <= sum(align_up(w.bytes) for w in windows)
    assert layout.total == max((offsets[w.name] + w.bytes for w in windows), default=0)
    for a, b in combinations(windows, 2):
        co_live = _overlap((a.first, a.last + 1), (b.first, b.last + 1))
        bytes_a = (offsets[a.name], offsets[a.name] + a.bytes)
        bytes_b = (offsets[b.name], offsets[b.name] + b.bytes)
        assert not (co_live and _overlap(bytes_a, bytes_b)), (a, b)
    assert offsets == _oracle(windows)


@STAGING_CHAIN
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=12))
def test_staging_chain_of_single_call_sources_reuses_offset_zero(sizes: list[int]) -> None:
    layout = staging_layout([Window(i, i, n, f"s{i}") for i, n in enumerate(sizes)])
    assert set(layout.offsets.values()) == {0}
    assert layout.total == max(sizes)


def test_staging_obstruction_rounds_up_to_256() -> None:
    layout = staging_layout([Window(0, 1, 100, "a"), Window(1, 1, 10, "b"), Window(2, 2, 10, "c")])
    assert layout.offsets == {"a": 0, "b": 256, "c": 0}
    assert layout.total == 266


def test_staging_ties_keep_input_order() -> None:
    layout = staging_layout([Window(3, 4, 300, "late"), Window(0, 4, 10, "x"),
                             Window(0, 4, 10, "y")])
    assert layout.offsets == {"x": 0, "y": 256, "late": 512}


def test_staging_refuses_bad_windows() -> None:
    with pytest.raises(ValueError):
        staging_layout([Window(2, 1, 8, "a")])
    with pytest.raises(ValueError):
        staging_layout([Window(0, 0, 8, "a"), Window(1, 1, 8, "a")])


# ---------------------------------------------------------------------------------------------
# Arena


@st.composite
def _intervals(draw: st.DrawFn) -> list[Interval]:
    out = []
    for i in range(draw(st.integers(0, 14))):
        start = draw(st.integers(0, 30))
        end = start + draw(st.integers(0, 8))
        size = draw(st.integers(0, 5000))
        out.append(Interval(f"w{i}", start, end, size))
        if draw(st.integers(0, 4)) == 0:  # the same buffer live again later
            again = end + 1 + draw(st.integers(0, 6))
            out.append(Interval(f"w{i}", again, again + draw(st.integers(0, 3)), size))
    return out


def _check_arena(intervals: list[Interval]) -> None:
    layout = arena_layout(intervals)
    offsets = layout.offsets
    assert set(offsets) == {iv.name for iv in intervals}
    assert all(off % ALIGN == 0 for off in offsets.values())
    for a, b in combinations(intervals, 2):
        if a.name == b.name or not _overlap((a.start, a.end + 1), (b.start, b.end + 1)):
            continue
        bytes_a = (offsets[a.name], offsets[a.name] + a.bytes)
        bytes_b = (offsets[b.name], offsets[b.name] + b.bytes)
        assert not _overlap(bytes_a, bytes_b), (a, b)
    assert all(offsets[iv.name] + iv.bytes <= layout.total for iv in intervals)
    assert layout.lower_bound <= layout.total <= layout.naive
    assert layout.total % ALIGN == 0


@ARENA
@given(_intervals())
def test_arena_properties(intervals: list[Interval]) -> None:
    _check_arena(intervals)


def test_arena_lower_bound_counts_each_call() -> None:
    layout = arena_layout([Interval("a", 0, 2, 100), Interval("b", 1, 1, 300),
                           Interval("c", 3, 3, 1000)])
    assert layout.lower_bound == 1024 and layout.naive == 256 + 512 + 1024
    assert layout.total == 1024


def test_arena_buffer_live_in_several_ranges_keeps_one_offset() -> None:
    # `h` and `g` alternate through the layers: they can share bytes; `x` is live throughout.
    intervals = [Interval("x", 0, 20, 512)]
    for layer in range(5):
        intervals += [Interval("h", 4 * layer, 4 * layer + 1, 1024),
                      Interval("g", 4 * layer + 2, 4 * layer + 3, 1024)]
    layout = arena_layout(intervals)
    assert layout.total == layout.lower_bound == 1536
    assert layout.offsets["h"] == layout.offsets["g"]


def test_arena_refuses_bad_intervals() -> None:
    with pytest.raises(ValueError):
        arena_layout([Interval("a", 3, 2, 8)])
    with pytest.raises(ValueError):
        arena_layout([Interval("a", 0, 0, 8), Interval("a", 2, 2, 4096)])


def test_arena_empty() -> None:
    assert arena_layout([]).total == 0


def test_fits_choose_gaps() -> None:
    taken = [(0, 256), (1024, 1280), (1536, 2048)]  # gaps: [256, 1024) and [1280, 1536)
    assert best_fit(taken, 256) == 1280
    assert first_fit(taken, 256) == 256
    assert best_fit(taken, 512) == 256
    assert best_fit(taken, 1024) == first_fit(taken, 1024) == 2048


# ---------------------------------------------------------------------------------------------
# A 36-layer transformer's workspaces (Qwen3-4B-like sizes, bf16)

HIDDEN, Q, KV, FFN, VOCAB = 2560, 4096, 1024, 9728, 151936


def _layer(first: int, tokens: int, name: callable) -> list[Interval]:
    """One decoder layer's temporaries from call `first`: 11 calls, each value to its reader."""
    c, t = first, tokens
    return [
        Interval(name("h"), c, c + 1, t * HIDDEN * 2),                 # norm -> qkv_proj
        Interval(name("qkv"), c + 1, c + 3, t * (Q + 2 * KV) * 2),     # qkv_proj -> rope -> attn
        Interval(name("attn_partials"), c + 3, c + 3, 8 << 20),        # split-k scratch
        Interval(name("lse"), c + 3, c + 3, t * 32 * 4),
        Interval(name("attn"), c + 3, c + 4, t * Q * 2),               # attn -> o_proj
        Interval(name("o"), c + 4, c + 5, t * HIDDEN * 2),             # o_proj -> add
        Interval(name("h2"), c + 6, c + 7, t * HIDDEN * 2),            # norm -> gate_up
        Interval(name("gate_up"), c + 7, c + 8, t * 2 * FFN * 2),      # gate_up -> silu_mul
        Interval(name("act"), c + 8, c + 9, t * FFN * 2),              # silu_mul -> down
        Interval(name("down"), c + 9, c + 10, t * HIDDEN * 2),         # down -> add
    ]


def _transformer(tokens: int, shared_names: bool, layers: int = 36) -> list[Interval]:
    intervals: list[Interval] = []
    call = 1  # call 0 embeds into the residual stream
    for layer in range(layers):
        def name(k: str, layer: int = layer) -> str:
            return k if shared_names else f"l{layer}.{k}"
        intervals += _layer(call, tokens, name)
        call += 11
    intervals += [Interval("x", 0, call, tokens * HIDDEN * 2),        # residual, live throughout
                  Interval("final_h", call, call + 1, tokens * HIDDEN * 2),
                  Interval("logits", call + 1, call + 2, VOCAB * 4)]
    return intervals


@pytest.mark.parametrize("shared_names", [False, True], ids=["per-layer", "reused-per-layer"])
@pytest.mark.parametrize("tokens", [1, 7, 512, 2048, 8192])
def test_transformer_workspace_within_5_percent_of_lower_bound(tokens: int,
                                                                shared_names: bool) -> None:
    intervals = _transformer(tokens, shared_names)
    layout = arena_layout(intervals)
    _check_arena(intervals)
    assert layout.total <= 1.05 * layout.lower_bound, layout.strategy
