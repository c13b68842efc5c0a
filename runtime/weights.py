"""Weight assembly: a `weight` or `source` buffer's bytes from its `bind` segments (spec §1.6).

Owns the meaning of a segment: its tensor (by name, or one name per rank of a topology group)
is viewed as a matrix [dim0, product(rest)]; optional half-open `rows` and `cols` ranges (plain
or per rank) cut it; or `interleave` alternates `rows`-row blocks of the tensor and its `with`
tensor, both taken whole. Segments are laid end to end and must fill the buffer exactly.

Segments arrive duck-typed, as the manifest model gives them: `seg.tensor` is a `str` or a
ranked object (`.group`, `.items`); `seg.rows` / `seg.cols` are `None`, `(from, to)` or ranked;
`seg.interleave` is `None` or an object with `.with_` and `.rows`. Every problem becomes one
`KernccError` naming the buffer, with a diagnostic per bad segment at `<where>/<i>`.
`Checkpoint` serves tensors from one or more safetensors files: a file, a directory of them,
or a Hugging Face shard index (`model.safetensors.index.json`, see kerncc.checkpoint.shards).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import attrs
import numpy as np

from kerncc.files import FileRefused, check_regular
from kerncc.diagnostics import Diagnostic, KernccError, Location, split_pointer
from kerncc.checkpoint.safetensors import SafeTensors
from kerncc.checkpoint.shards import shard_paths

Tensors = Callable[[str], np.ndarray]


class _SegmentError(Exception):
    """A problem with one segment; `plan_buffer` turns these into located diagnostics."""


@attrs.frozen
class Piece:
    """One segment resolved: the arrays to copy and where they land in the buffer."""

    offset: int
    nbytes: int
    whole: np.ndarray | None = None  # a (possibly strided) matrix copied as is
    pair: tuple[np.ndarray, np.ndarray] | None = None  # interleaved matrices
    block: int = 0  # rows per interleave block
    segment: int = 0  # its index in the bind list
    names: tuple[str, ...] = ()  # the tensors it reads
    entire: bool = False  # it takes its tensors whole (a scan of its bytes scans them)


# ---------------------------------------------------------------------------------------------
# Resolving one segment


def _pick(value: Any, rank: int, what: str) -> Any:
    """A plain value as is; a ranked one (`.group`, `.items`) at this rank."""
    items = getattr(value, "items", None)
    if items is None or isinstance(value, (str, tuple, list)):
        return value
    if not 0 <= rank < len(items):
        raise _SegmentError(f"rank {rank} has no {what} in group `{value.group}` "
                            f"({len(items)} given)")
    return items[rank]


def _matrix(array: np.ndarray) -> np.ndarray:
    """The tensor as [dim0, product(rest)]; a scalar as [1, 1]."""
    if array.ndim == 0:
        return array.reshape(1, 1)
    return array.reshape(array.shape[0], int(np.prod(array.shape[1:])))


# Elements checked at once for finiteness: bounds the temporary mask of a large tensor.
_FINITE_CHUNK = 1 << 22


def first_nonfinite(array: np.ndarray) -> tuple[tuple[int, ...], Any, int] | None:
    """(index, value, count) of the first NaN or infinity of a float tensor; None if none
    (or the dtype has no such values)."""
    flat = array.reshape(-1)
    first, count = None, 0
    with np.errstate(all="ignore"):
        for start in range(0, flat.size, _FINITE_CHUNK):
            try:
                bad = ~np.isfinite(flat[start:start + _FINITE_CHUNK])
            except TypeError:  # integers, booleans: every value is finite
                return None
            hits = np.flatnonzero(bad)
            if hits.size and first is None:
                first = start + int(hits[0])
            count += int(hits.size)
    if first is None:
        return None
    index = tuple(int(i) for i in np.unravel_index(first, array.shape)) if array.ndim else ()
    return index, flat[first], count


def _nonfinite_text(name: str, array: np.ndarray) -> str | None:
    found = first_nonfinite(array)
    if found is None:
        return None
    index, value, count = found
    more = f" (and {count - 1} more)" if count > 1 else ""
    return (f"tensor `{name}` holds {float(value)} at [{', '.join(str(i) for i in index)}]"
            f"{more}: weights must be finite (--allow-nonfinite loads them anyway)")


def nonfinite_error(pieces: Sequence[Piece], tensors: Tensors, where: str
                    ) -> KernccError | None:
    """The refusal of a buffer of `pieces` whose tensors hold a NaN or an infinity (each tensor
    searched whole, so the words do not depend on how its bytes were read); None if none does."""
    diagnostics = []
    for piece in pieces:
        for name in piece.names:
            text = _nonfinite_text(name, np.asarray(tensors(name)))
            if text is not None:
                diagnostics.append(Diagnostic(f"bind[{piece.segment}]: {text}",
                                              Location(f"{where}/{piece.segment}")))
                break
    return KernccError(_headline(where), diagnostics) if diagnostics else None


def _load(tensors: Tensors, name: str, dtype: np.dtype) -> np.ndarray:
    try:
        array = tensors(name)
    except KeyError:
        array = None
    if array is None:
        raise _SegmentError(f"tensor `{name}` is not in the checkpoint")
    array = np.asarray(array)
    if array.dtype != dtype:
        raise _SegmentError(f"tensor `{name}` is {_dtype_text(array.dtype)}, but the buffer "
                            f"is {_dtype_text(dtype)}")
    return array


def _dtype_text(dtype: np.dtype) -> str:
    return np.dtype(dtype).name


def _range(value: Any, rank: int, axis: str, extent: int, name: str) -> tuple[int, int] | None:
    picked = _pick(value, rank, f"{axis[:-1]} range")
    if picked is None:
        return None
    start, stop = (int(v) for v in picked)
    if start > stop:
        raise _SegmentError(f"{axis} [{start}, {stop}) is reversed")
    if stop > extent:
        raise _SegmentError(f"{axis} [{start}, {stop}) exceed the {extent} {axis} of "
                            f"tensor `{name}`")
    return start, stop


def _sliced(seg: Any, matrix: np.ndarray, rank: int, name: str) -> np.ndarray:
    rows = _range(seg.rows, rank, "rows", matrix.shape[0], name)
    cols = _range(seg.cols, rank, "cols", matrix.shape[1], name)
    if rows is not None:
        matrix = matrix[rows[0]:rows[1]]
    if cols is not None:
        matrix = matrix[:, cols[0]:cols[1]]
    return matrix


def _interleaved(seg: Any, first: np.ndarray, tensors: Tensors, dtype: np.dtype,
                 rank: int, name: str) -> tuple[np.ndarray, np.ndarray, int]:
    spec = seg.interleave
    if seg.rows is not None or seg.cols is not None:
        raise _SegmentError("an interleaved segment takes both tensors whole, not a range")
    block = int(spec.rows)
    if block <= 0:
        raise _SegmentError("interleave blocks of 0 rows")
    other_name = _pick(spec.with_, rank, "tensor name")
    other = _load(tensors, other_name, dtype)
    a, b = _matrix(first), _matrix(other)
    if a.shape != b.shape:
        raise _SegmentError(f"interleaved tensors `{name}` {list(first.shape)} and "
                            f"`{other_name}` {list(other.shape)} differ in shape")
    if a.shape[0] % block:
        raise _SegmentError(f"tensor `{name}` has {a.shape[0]} rows, not a multiple of the "
                            f"interleave block of {block}")
    return a, b, block


def _piece(seg: Any, offset: int, tensors: Tensors, dtype: np.dtype, rank: int,
           index: int) -> Piece:
    name = _pick(seg.tensor, rank, "tensor name")
    array = _load(tensors, name, dtype)
    if seg.interleave is not None:
        a, b, block = _interleaved(seg, array, tensors, dtype, rank, name)
        other = _pick(seg.interleave.with_, rank, "tensor name")
        return Piece(offset, a.nbytes + b.nbytes, pair=(a, b), block=block, segment=index,
                      names=(name, other), entire=True)
    matrix = _sliced(seg, _matrix(array), rank, name)
    return Piece(offset, matrix.size * dtype.itemsize, whole=matrix, segment=index,
                  names=(name,), entire=matrix.size == array.size)


def _buffer_name(where: str) -> str:
    tokens = split_pointer(where)
    if len(tokens) >= 2 and tokens[0] == "buffers":
        return tokens[1]
    return where or "?"


def _plan(segments: Sequence[Any], tensors: Tensors, dtype: np.dtype, rank: int,
          where: str) -> tuple[list[Piece], list[Diagnostic]]:
    pieces: list[Piece] = []
    diagnostics: list[Diagnostic] = []
    offset = 0
    for i, seg in enumerate(segments):
        try:
            piece = _piece(seg, offset, tensors, dtype, rank, i)
        except _SegmentError as exc:
            diagnostics.append(Diagnostic(f"bind[{i}]: {exc}", Location(f"{where}/{i}")))
            continue
        pieces.append(piece)
        offset += piece.nbytes
    return pieces, diagnostics


def plan_buffer(segments: Sequence[Any], tensors: Tensors, dtype: np.dtype, nbytes: int,
                rank: int = 0, where: str = "") -> list[Piece]:
    """The pieces a buffer's bytes are laid from, every segment checked (tensors present, dtypes,
    ranges, shapes, the total) from the tensors' headers alone: no weight byte is read here
    unless `tensors` reads it (the loader checks finiteness as it streams the bytes)."""
    dtype = np.dtype(dtype)
    pieces, diagnostics = _plan(segments, tensors, dtype, rank, where)
    if diagnostics:
        raise KernccError(_headline(where), diagnostics)
    total = sum(p.nbytes for p in pieces)
    if total != nbytes:
        message = f"bind segments hold {total} bytes, but the buffer has {nbytes}"
        raise KernccError(_headline(where), [Diagnostic(message, Location(where))])
    return pieces


def _headline(where: str) -> str:
    return f"cannot assemble buffer `{_buffer_name(where)}` from its bind segments"


# ---------------------------------------------------------------------------------------------
# Checkpoints


class Checkpoint:
    """Tensors by name across one or more safetensors files (a sharded checkpoint).

    Callable as the `tensors` argument of `plan_buffer`: unknown names raise KeyError.
    """

    def __init__(self, paths: Iterable[str | os.PathLike]) -> None:
        self.files = [SafeTensors(p) for p in paths]
        self._where: dict[str, SafeTensors] = {}
        for f in self.files:
            self._index(f)

    def _index(self, f: SafeTensors) -> None:
        for name in f:
            earlier = self._where.get(name)
            if earlier is not None:
                raise KernccError.single(f"tensor `{name}` is in both {earlier.path} and "
                                         f"{f.path}")
            self._where[name] = f

    def __call__(self, name: str) -> np.ndarray:
        found = self._where.get(name)
        if found is None:
            raise KeyError(name)
        return found.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def keys(self) -> list[str]:
        return sorted(self._where)

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


CheckpointLike = str | os.PathLike | Sequence[str | os.PathLike] | Mapping[str, np.ndarray] \
    | Checkpoint | None


@attrs.frozen
class OpenCheckpoint:
    """Checkpoint tensors by name while loading, and what messages call them."""

    get: Callable[[str], np.ndarray]
    name: str
    owned: Checkpoint | None = None  # opened here, so closed here after loading


def open_checkpoint(checkpoint: CheckpointLike) -> OpenCheckpoint | None:
    """Tensors by name from a path (file or directory), paths, a mapping or a Checkpoint."""
    if checkpoint is None:
        return None
    if isinstance(checkpoint, Checkpoint):
        return OpenCheckpoint(checkpoint, "the given Checkpoint")
    if isinstance(checkpoint, Mapping):
        return OpenCheckpoint(checkpoint.__getitem__, "the given tensors")
    if isinstance(checkpoint, (str, os.PathLike)):
        path = Path(checkpoint)
        if path.is_dir():
            paths = sorted(path.glob("*.safetensors"))
        elif path.name.endswith(".json") and path.is_file():
            paths = shard_paths(path)
        else:
            paths = [path]
    else:
        paths = [Path(p) for p in checkpoint]
    if not paths:
        raise KernccError.single(f"checkpoint `{checkpoint}` holds no *.safetensors file")
    for p in paths:  # the right words for a directory, a FIFO or a device given as a file
        try:
            check_regular(p, "checkpoint")
        except FileRefused as err:
            raise KernccError.single(err.message) from None
    opened = Checkpoint(paths)
    return OpenCheckpoint(opened, ", ".join(str(p) for p in paths), opened)
