"""kerncc.runtime.weights: bind segments against direct numpy slicing, and every refusal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kerncc.diagnostics import KernccError
from kerncc.runtime.weights import Checkpoint
from kerncc.checkpoint.safetensors import save_file

from weights_oracle import assemble_buffer

WHERE = "/buffers/w_qkv/bind"


# Test doubles with the manifest model's shape (duck-typed by `assemble_buffer`).
@attrs.frozen
class Ranked:
    group: str
    items: tuple


@attrs.frozen
class Interleave:
    with_: Any
    rows: int


@attrs.frozen
class Segment:
    tensor: Any
    rows: Any = None
    cols: Any = None
    interleave: Any = None


def _ramp(shape: tuple[int, ...], dtype: Any = np.float32, start: int = 1) -> np.ndarray:
    return (np.arange(int(np.prod(shape))) + start).astype(dtype).reshape(shape)


def _nbytes(*arrays: np.ndarray) -> int:
    return sum(a.nbytes for a in arrays)


# ---------------------------------------------------------------------------------------------
# Examples


def test_whole_tensors_are_laid_end_to_end() -> None:
    t = {"a": _ramp((2, 3)), "b": _ramp((4,), start=100)}
    out = assemble_buffer([Segment("a"), Segment("b")], t.__getitem__, np.float32, 40, where=WHERE)
    assert out.dtype == np.uint8 and out.shape == (40,)
    np.testing.assert_array_equal(out.view(np.float32), np.r_[t["a"].ravel(), t["b"]])


def test_rows_and_cols_cut_the_matrix_view() -> None:
    t = {"a": _ramp((4, 2, 3))}  # viewed as [4, 6]
    seg = Segment("a", rows=(1, 3), cols=(2, 5))
    out = assemble_buffer([seg], t.__getitem__, np.float32, 2 * 3 * 4)
    want = t["a"].reshape(4, 6)[1:3, 2:5]
    np.testing.assert_array_equal(out.view(np.float32).reshape(2, 3), want)


def test_interleave_alternates_row_blocks() -> None:
    gate = np.array([[1, 1], [2, 2], [3, 3], [4, 4]], np.float32)
    up = -gate
    seg = Segment("gate", interleave=Interleave("up", 2))
    out = assemble_buffer([seg], {"gate": gate, "up": up}.__getitem__, np.float32, 64)
    want = np.concatenate([gate[:2], up[:2], gate[2:], up[2:]])
    np.testing.assert_array_equal(out.view(np.float32).reshape(8, 2), want)


def test_ranked_sources_select_the_current_rank() -> None:
    t = {"w0": _ramp((4, 4)), "w1": _ramp((4, 4), start=50)}
    seg = Segment(Ranked("tp", ("w0", "w1")), rows=Ranked("tp", ((0, 2), (2, 4))))
    out = assemble_buffer([seg], t.__getitem__, np.float32, 32, rank=1)
    np.testing.assert_array_equal(out.view(np.float32).reshape(2, 4), t["w1"][2:4])


def test_bf16_and_scalars() -> None:
    t = {"s": np.array(3, ml_dtypes.bfloat16), "v": _ramp((3,), ml_dtypes.bfloat16)}
    out = assemble_buffer([Segment("s"), Segment("v", rows=(1, 3))], t.__getitem__,
                   ml_dtypes.bfloat16, 6)
    assert out.view(ml_dtypes.bfloat16).astype(np.float32).tolist() == [3, 2, 3]


def test_checkpoint_serves_shards(tmp_path: Path) -> None:
    save_file({"a": _ramp((2, 2))}, tmp_path / "1.safetensors")
    save_file({"b": _ramp((2,), start=9)}, tmp_path / "2.safetensors")
    with Checkpoint([tmp_path / "1.safetensors", tmp_path / "2.safetensors"]) as ckpt:
        assert ckpt.keys() == ["a", "b"] and "a" in ckpt
        out = assemble_buffer([Segment("b"), Segment("a", rows=(1, 2))], ckpt, np.float32, 16)
    assert out.view(np.float32).tolist() == [9, 10, 3, 4]


def test_checkpoint_refuses_a_tensor_in_two_shards(tmp_path: Path) -> None:
    for name in ("1", "2"):
        save_file({"a": _ramp((2,))}, tmp_path / name)
    with pytest.raises(KernccError, match="`a` is in both"):
        Checkpoint([tmp_path / "1", tmp_path / "2"])


# ---------------------------------------------------------------------------------------------
# Refusals: one KernccError naming the buffer, a diagnostic per bad segment at bind/<i>

TENSORS = {
    "a": _ramp((4, 3)),
    "b": _ramp((4, 3), start=20),
    "odd": _ramp((3, 3)),
    "wide": _ramp((4, 5)),
    "half": _ramp((4, 3), np.float16),
}

REFUSALS = [
    ("missing", Segment("nope"), "tensor `nope` is not in the checkpoint"),
    ("dtype", Segment("half"), "tensor `half` is float16, but the buffer is float32"),
    ("rows-exceed", Segment("a", rows=(2, 5)), "rows [2, 5) exceed the 4 rows of tensor `a`"),
    ("cols-exceed", Segment("a", cols=(0, 4)), "cols [0, 4) exceed the 3 cols of tensor `a`"),
    ("reversed", Segment("a", rows=(3, 1)), "rows [3, 1) is reversed"),
    ("interleave-shapes", Segment("a", interleave=Interleave("wide", 2)),
     "interleaved tensors `a` [4, 3] and `wide` [4, 5] differ in shape"),
    ("interleave-multiple", Segment("odd", interleave=Interleave("odd", 2)),
     "tensor `odd` has 3 rows, not a multiple of the interleave block of 2"),
    ("interleave-range", Segment("a", rows=(0, 2), interleave=Interleave("b", 2)),
     "takes both tensors whole"),
    ("interleave-zero", Segment("a", interleave=Interleave("b", 0)), "blocks of 0 rows"),
    ("interleave-missing", Segment("a", interleave=Interleave("nope", 2)), "`nope` is not in"),
    ("rank-past-group", Segment(Ranked("tp", ("a",))), "rank 1 has no tensor name in group `tp`"),
]


@pytest.mark.parametrize("case, seg, text", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_name_buffer_and_segment(case: str, seg: Segment, text: str) -> None:
    with pytest.raises(KernccError) as info:
        assemble_buffer([Segment("a"), seg], TENSORS.__getitem__, np.float32, 96, rank=1, where=WHERE)
    err = info.value
    assert "buffer `w_qkv`" in err.headline
    assert [d.location.pointer for d in err.diagnostics] == [f"{WHERE}/1"]
    message = err.diagnostics[0].message
    assert message.startswith("bind[1]: ") and text in message


def test_missing_tensor_as_none_is_refused() -> None:
    with pytest.raises(KernccError, match="`x` is not in the checkpoint"):
        assemble_buffer([Segment("x")], lambda name: None, np.float32, 4, where=WHERE)


def test_size_mismatch_names_the_bind() -> None:
    with pytest.raises(KernccError) as info:
        assemble_buffer([Segment("a")], TENSORS.__getitem__, np.float32, 50, where=WHERE)
    assert "bind segments hold 48 bytes, but the buffer has 50" in str(info.value)
    assert info.value.diagnostics[0].location.pointer == WHERE


def test_every_bad_segment_is_reported_together() -> None:
    segs = [Segment("nope"), Segment("a"), Segment("a", rows=(0, 9))]
    with pytest.raises(KernccError) as info:
        assemble_buffer(segs, TENSORS.__getitem__, np.float32, 0, where=WHERE)
    assert [d.location.pointer for d in info.value.diagnostics] == [f"{WHERE}/0", f"{WHERE}/2"]


# ---------------------------------------------------------------------------------------------
# Property: assemble_buffer equals slicing and concatenation written out directly


def _reference(segments: list[Segment], tensors: dict[str, np.ndarray], rank: int) -> bytes:
    def pick(value: Any) -> Any:
        return value.items[rank] if isinstance(value, Ranked) else value

    parts: list[bytes] = []
    for seg in segments:
        t = tensors[pick(seg.tensor)]
        m = t.reshape(t.shape[0], -1) if t.ndim else t.reshape(1, 1)
        if seg.interleave is not None:
            other = tensors[pick(seg.interleave.with_)]
            o = other.reshape(other.shape[0], -1)
            r = seg.interleave.rows
            for start in range(0, m.shape[0], r):
                parts += [m[start:start + r].tobytes(), o[start:start + r].tobytes()]
            continue
        if seg.rows is not None:
            lo, hi = pick(seg.rows)
            m = m[lo:hi]
        if seg.cols is not None:
            lo, hi = pick(seg.cols)
            m = m[:, lo:hi]
        parts.append(m.tobytes())
    return b"".join(parts)


@st.composite
def _worlds(draw: st.DrawFn) -> tuple[list[Segment], dict[str, np.ndarray], int, Any]:
    dtype = draw(st.sampled_from([np.float32, ml_dtypes.bfloat16, np.int8, np.float64]))
    ranks = draw(st.integers(1, 3))
    rank = draw(st.integers(0, ranks - 1))
    tensors: dict[str, np.ndarray] = {}

    def new_tensor(shape: tuple[int, ...]) -> str:
        name = f"t{len(tensors)}"
        values = draw(st.integers(0, 2**31 - 1))
        rng = np.random.default_rng(values)
        tensors[name] = rng.integers(-100, 100, size=shape).astype(dtype)
        return name

    def source(shape: tuple[int, ...]) -> Any:
        if ranks > 1 and draw(st.booleans()):
            return Ranked("g", tuple(new_tensor(shape) for _ in range(ranks)))
        return new_tensor(shape)

    def span(extent: int) -> tuple[int, int] | None:
        if not draw(st.booleans()):
            return None
        lo = draw(st.integers(0, extent))
        return lo, draw(st.integers(lo, extent))

    def ranges(extent: int) -> Any:
        if ranks > 1 and draw(st.booleans()):
            picked = [span(extent) or (0, extent) for _ in range(ranks)]
            return Ranked("g", tuple(picked))
        return span(extent)

    segments: list[Segment] = []
    for _ in range(draw(st.integers(0, 5))):
        rows = draw(st.integers(1, 6))
        rest = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
        cols = int(np.prod(rest))
        if draw(st.integers(0, 3)) == 0:
            block = draw(st.integers(1, 3))
            shape = (rows * block,) + rest
            segments.append(Segment(source(shape), interleave=Interleave(source(shape), block)))
            continue
        segments.append(Segment(source((rows,) + rest), rows=ranges(rows), cols=ranges(cols)))
    return segments, tensors, rank, dtype


@settings(max_examples=400, deadline=None)
@given(_worlds())
def test_assemble_equals_direct_slicing(world) -> None:
    segments, tensors, rank, dtype = world
    want = _reference(segments, tensors, rank)
    out = assemble_buffer(segments, tensors.__getitem__, dtype, len(want), rank=rank, where=WHERE)
    assert out.tobytes() == want
