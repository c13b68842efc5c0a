"""A Hugging Face checkpoint's tensor table, read from the safetensors headers only.

`read_table(dir)` finds `model.safetensors` or `model.safetensors.index.json` (kerncc.checkpoint.shards)
and returns every tensor's dtype, shape and file without touching tensor data: a header is
the file's first 8 + N bytes, so an 8B checkpoint is read in milliseconds and a header-only
file (the tensor table with no data, as the real-shape tests write) reads like a full one.
Headers are validated as the runtime's reader validates them (dtype, shape, offsets that
match the shape, no overlaps) except for the data section's extent, which only loading reads;
a tensor the index names but its shard lacks is an error naming the index and the tensor.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from kerncc.diagnostics import KernccError
from kerncc.checkpoint.safetensors import TensorInfo, dtype_name, parse_header, read_prefix
from kerncc.checkpoint.shards import CHECKPOINT_FILE, SHARD_INDEX, checkpoint_beside, shard_map

KERN_DTYPES = {"BF16": "bf16", "F16": "f16", "F32": "f32"}


@attrs.frozen
class Tensor:
    name: str
    dtype: str  # safetensors name: BF16, F16, F32, ...
    shape: tuple[int, ...]
    file: str


@attrs.frozen
class Table:
    """The checkpoint's tensors by name, and the file a manifest beside it binds."""

    tensors: dict[str, Tensor]
    reference: Path  # model.safetensors or the shard index

    def kern_dtype(self, name: str) -> str:
        return KERN_DTYPES.get(self.tensors[name].dtype, self.tensors[name].dtype.lower())


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """The tensor table of a safetensors file from its header alone."""
    prefix, size = read_prefix(path)
    return parse_header(path, prefix, size, data=False)[1]


def _tensors(path: Path, names: set[str] | None = None) -> dict[str, Tensor]:
    infos = read_header(path)
    return {name: Tensor(name, dtype_name(info.dtype) or str(info.dtype), info.shape, path.name)
            for name, info in infos.items() if names is None or name in names}


def read_table(directory: str | os.PathLike) -> Table:
    """The tensor table of the checkpoint in `directory` (one file or an index of shards)."""
    reference = checkpoint_beside(directory)
    if reference is None:
        raise KernccError.single(f"{directory}: no {CHECKPOINT_FILE} or {SHARD_INDEX} (the "
                                 "checkpoint to import)")
    if reference.name == CHECKPOINT_FILE:
        return Table(_tensors(reference), reference)
    mapping = shard_map(reference)
    tensors: dict[str, Tensor] = {}
    for shard in sorted(set(mapping.values())):
        wanted = {t for t, s in mapping.items() if s == shard}
        found = _tensors(shard, wanted)
        for name in sorted(wanted - set(found)):
            raise KernccError.single(f"{reference}: tensor `{name}` is mapped to shard "
                                     f"`{shard.name}`, which does not hold it",
                                     f"/weight_map/{name}")
        tensors.update(found)
    return Table(tensors, reference)
