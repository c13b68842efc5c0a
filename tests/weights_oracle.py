"""A buffer assembled on the host from its bind segments: the path the streamed loader
(runtime/loader.py) replaced, kept for tests as its oracle.

`assemble_buffer(segments, tensors, dtype, nbytes, rank, where, finite)` lays the pieces
`kerncc.runtime.weights.plan_buffer` resolves (every segment checked there) end to end into one
uint8 array; with `finite`, each tensor it takes is checked whole for NaN and infinity as it is
taken, refused in the words the loader's refusal uses (`weights.nonfinite_error`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kerncc.runtime import weights
from kerncc.runtime.weights import Piece, Tensors, plan_buffer


def assemble_buffer(segments: Sequence[Any], tensors: Tensors, dtype: np.dtype, nbytes: int,
                    rank: int = 0, where: str = "", finite: bool = True) -> np.ndarray:
    """The buffer's `nbytes` bytes (uint8) assembled from `segments` at `rank`; `where` is the
    bind's JSON pointer (`/buffers/w_qkv/bind`), which errors extend with the segment index."""
    pieces = plan_buffer(segments, _finite(tensors) if finite else tensors, dtype, nbytes,
                         rank, where)
    out = np.empty(nbytes, dtype=np.uint8)
    for piece in pieces:
        _write(out, piece, np.dtype(dtype))
    return out


def _finite(tensors: Tensors) -> Tensors:
    """`tensors`, each one checked finite as it is taken (a refusal names it)."""
    def get(name: str) -> np.ndarray | None:
        array = tensors(name)
        text = None if array is None else weights._nonfinite_text(name, np.asarray(array))
        if text is not None:
            raise weights._SegmentError(text)
        return array
    return get


def _write(out: np.ndarray, piece: Piece, dtype: np.dtype) -> None:
    target = out[piece.offset:piece.offset + piece.nbytes].view(dtype)
    if piece.whole is not None:
        target.reshape(piece.whole.shape)[...] = piece.whole
        return
    a, b = piece.pair
    blocks = a.shape[0] // piece.block
    view = target.reshape(blocks, 2, piece.block, a.shape[1])
    view[:, 0] = a.reshape(blocks, piece.block, a.shape[1])
    view[:, 1] = b.reshape(blocks, piece.block, b.shape[1])
