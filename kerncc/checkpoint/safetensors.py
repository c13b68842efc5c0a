"""Safetensors files: a dependency-free reader and writer (numpy and ml_dtypes only).

Owns the byte format: an 8-byte little-endian header length N, N bytes of JSON header
`{name: {dtype, shape, data_offsets}, "__metadata__"?: {str: str}}` padded with spaces to a
multiple of 8 (as the reference writer does), then the raw little-endian tensor data with
offsets relative to the end of the header.

`save_file` writes deterministic bytes (tensors by name, compact JSON); `load_file` reads a
whole file into writable arrays; `SafeTensors` maps a file and hands out read-only views on
demand. Every problem with a file is a `KernccError` naming the file and the tensor.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any, Self

import attrs
import ml_dtypes
import numpy as np

from kerncc.diagnostics import Diagnostic, KernccError, Location, pointer

# Safetensors dtype name -> numpy dtype (little-endian where byte order matters).
_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "C64": np.dtype("<c8"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
if hasattr(ml_dtypes, "float8_e8m0fnu"):
    _DTYPES["F8_E8M0"] = np.dtype(ml_dtypes.float8_e8m0fnu)

# Lookup by dtype identity ignoring byte order, so native `=f4` and `<f4` both map to F32.
_NAMES: dict[np.dtype, str] = {dt.newbyteorder("="): name for name, dt in _DTYPES.items()}

_METADATA_KEY = "__metadata__"
_HEADER_ALIGN = 8
# The reference reader refuses headers past 100 MB; a longer one is a corrupt length field.
_MAX_HEADER = 100_000_000


@attrs.frozen
class TensorInfo:
    """One header entry: dtype, shape, and the byte range within the data section."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def dtypes() -> dict[str, np.dtype]:
    """The supported safetensors dtype names and their numpy dtypes."""
    return dict(_DTYPES)


def _error(path: str | os.PathLike, message: str, tensor: str | None = None) -> KernccError:
    where = pointer(tensor) if tensor is not None else ""
    text = f"tensor `{tensor}`: {message}" if tensor is not None else message
    diag = Diagnostic(text, Location(where, file=os.fspath(path)))
    return KernccError(f"{os.fspath(path)}: bad safetensors file", [diag])


# ---------------------------------------------------------------------------------------------
# Writing


def dtype_name(dtype: np.dtype) -> str | None:
    """The safetensors name of a numpy dtype, or None when the format has none."""
    return _NAMES.get(np.dtype(dtype).newbyteorder("="))


def _little_endian(path: str | os.PathLike, name: str, array: np.ndarray) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise _error(path, f"is a {type(array).__name__}, not a numpy array", name)
    if dtype_name(array.dtype) is None:
        raise _error(path, f"dtype `{array.dtype}` has no safetensors name", name)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
    return array if array.flags.c_contiguous else array.copy(order="C")


def _header_bytes(entries: dict[str, Any]) -> bytes:
    raw = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    pad = (-len(raw)) % _HEADER_ALIGN
    return raw + b" " * pad


def _check_metadata(path: str | os.PathLike, metadata: Mapping[str, str] | None) -> None:
    if metadata is None:
        return
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise _error(path, f"metadata entry `{key}` must map a string to a string")


def _layout(
    path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None
) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The header entries and the arrays in data order (by name)."""
    entries: dict[str, Any] = {}
    if metadata is not None:
        entries[_METADATA_KEY] = {k: metadata[k] for k in sorted(metadata)}
    arrays: list[np.ndarray] = []
    offset = 0
    for name in sorted(tensors):
        if not isinstance(name, str) or not name or name == _METADATA_KEY:
            raise _error(path, "is not a valid tensor name", str(name))
        array = _little_endian(path, name, tensors[name])
        entries[name] = {"dtype": dtype_name(array.dtype), "shape": list(array.shape),
                         "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    return entries, arrays


def save_file(
    tensors: Mapping[str, np.ndarray],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write `tensors` (laid out by name) and optional string `metadata` to `path`."""
    _check_metadata(path, metadata)
    entries, arrays = _layout(path, tensors, metadata)
    header = _header_bytes(entries)
    from kerncc.progress import progress  # a bar on a terminal only (2.7 GB take a while)

    label = f"writing {os.path.basename(path)}"
    with open(path, "wb") as f, progress(total=sum(a.nbytes for a in arrays), label=label,
                                         unit="B") as bar:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for array in arrays:  # raw byte views, so a large tensor is written without a copy
            f.write(array.reshape(-1).view(np.uint8))
            bar.update(array.nbytes)


# ---------------------------------------------------------------------------------------------
# Reading: header parsing and validation shared by load_file and SafeTensors


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key `{key}`")
        out[key] = value
    return out


def _header_length(path: str | os.PathLike, prefix: bytes, file_size: int) -> int:
    if len(prefix) < 8:
        raise _error(path, f"file is {file_size} bytes, too short for the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > _MAX_HEADER or 8 + n > file_size:
        raise _error(path, f"header length {n} exceeds the file ({file_size} bytes)")
    return n


def _parse_json(path: str | os.PathLike, raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _error(path, f"header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise _error(path, "header is not a JSON object")
    return header


def _is_uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_entry(path: str | os.PathLike, name: str, entry: Any) -> TensorInfo:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise _error(path, "entry must hold dtype, shape and data_offsets", name)
    dtype = _DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise _error(path, f"unknown dtype {json.dumps(entry['dtype'])}", name)
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise _error(path, f"shape {json.dumps(shape)} is not a list of non-negative ints", name)
    offsets = entry["data_offsets"]
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_uint, offsets)):
        raise _error(path, f"data_offsets {json.dumps(offsets)} is not a pair of ints", name)
    return TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])


def _check_extent(path: str | os.PathLike, info: TensorInfo, data_size: int | None) -> None:
    """The tensor's bytes lie in the data section (`data_size` bytes; None: a section not read,
    as a header-only file has none) and are as many as its shape needs."""
    if info.begin > info.end or data_size is not None and info.end > data_size:
        size = "" if data_size is None else f"{data_size}-byte "
        raise _error(path, f"data_offsets [{info.begin}, {info.end}] fall outside the "
                     f"{size}data section", info.name)
    expected = int(np.prod(info.shape, dtype=object)) * info.dtype.itemsize
    if expected != info.end - info.begin:
        raise _error(path, f"shape {list(info.shape)} of {_NAMES[info.dtype.newbyteorder('=')]} "
                     f"needs {expected} bytes, but data_offsets span {info.end - info.begin}",
                     info.name)


def _check_overlaps(path: str | os.PathLike, infos: list[TensorInfo]) -> None:
    # Zero-byte tensors occupy nothing, so they can sit anywhere.
    placed = sorted((i for i in infos if i.end > i.begin), key=lambda i: (i.begin, i.name))
    for before, after in itertools.pairwise(placed):
        if after.begin < before.end:
            raise _error(path, f"data_offsets [{after.begin}, {after.end}] overlap tensor "
                         f"`{before.name}` [{before.begin}, {before.end}]", after.name)


def _parse_metadata(path: str | os.PathLike, value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise _error(path, "__metadata__ must map strings to strings")
    return dict(value)


def parse_header(
    path: str | os.PathLike, prefix: bytes, file_size: int, data: bool = True
) -> tuple[int, dict[str, TensorInfo], dict[str, str]]:
    """(data start, tensors by name, metadata) from the file's first bytes; checks everything
    (but, without `data`, that the data section holds the tensors: a header-only file).

    `prefix` must hold at least the 8-byte length and the header (callers read that much).
    """
    n = _header_length(path, prefix, file_size)
    header = _parse_json(path, prefix[8:8 + n])
    metadata = _parse_metadata(path, header.pop(_METADATA_KEY, None))
    data_size = file_size - 8 - n if data else None
    infos = {name: _parse_entry(path, name, entry) for name, entry in header.items()}
    for info in infos.values():
        _check_extent(path, info, data_size)
    _check_overlaps(path, list(infos.values()))
    return 8 + n, infos, metadata


def _view(buffer: np.ndarray, start: int, info: TensorInfo) -> np.ndarray:
    raw = buffer[start + info.begin:start + info.end]
    return raw.view(info.dtype).reshape(info.shape)


def read_prefix(path: str | os.PathLike) -> tuple[bytes, int]:
    """The file's 8-byte header length and as much of the header as the file holds; its size."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) == 8:
                (n,) = struct.unpack("<Q", head)
                # Never more than the file holds: a length that lies must not size a buffer.
                head += f.read(min(n, _MAX_HEADER + 1, max(size - 8, 0)))
    except OSError as exc:
        raise _error(path, f"cannot read: {exc.strerror or exc}") from None
    return head, size


def load_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of the file at `path`, as writable arrays in host byte order."""
    # Copying out of the mapping keeps the peak at one copy of the data, not two.
    with SafeTensors(path) as f:
        return {name: np.array(f.get(name)) for name in f}


class SafeTensors:
    """A safetensors file mapped into memory; tensors are read-only views made on demand.

    Arrays handed out keep the mapping alive after `close()`; the object itself refuses
    further reads once closed.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        prefix, size = read_prefix(path)
        self._start, self._infos, self.metadata = parse_header(path, prefix, size)
        try:
            self._data: np.ndarray | None = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise _error(path, f"cannot map: {exc}") from None

    def keys(self) -> list[str]:
        """Tensor names, sorted."""
        return sorted(self._infos)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, name: str) -> TensorInfo:
        """The header entry of `name`."""
        found = self._infos.get(name)
        if found is None:
            raise _error(self.path, "is not in the file", name)
        return found

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def dtype(self, name: str) -> np.dtype:
        return self.info(name).dtype

    def get(self, name: str) -> np.ndarray:
        """A read-only view of tensor `name` backed by the mapped file."""
        info = self.info(name)
        if self._data is None:
            raise _error(self.path, "read after the file was closed", name)
        return _view(self._data, self._start, info)

    def close(self) -> None:
        self._data = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
