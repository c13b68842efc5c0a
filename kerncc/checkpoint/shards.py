"""Where a manifest's checkpoint lives: `model.safetensors` or a shard index beside it.

A sharded Hugging Face checkpoint is `model.safetensors.index.json`, whose `weight_map` names
for every tensor the shard file (beside the index) that holds it. `checkpoint_beside(dir)` is
the one rule emit (bundle.json's `checkpoint`) and the runtime (a manifest run in place) use to
find a manifest's checkpoint; `shard_map` reads an index, refusing shards outside its
directory or missing, each error naming the index file and the tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kerncc.diagnostics import Diagnostic, KernccError, Location, pointer

CHECKPOINT_FILE, SHARD_INDEX = "model.safetensors", "model.safetensors.index.json"


def checkpoint_beside(directory: str | os.PathLike) -> Path | None:
    """`model.safetensors` in `directory`, else its shard index, else None."""
    for name in (CHECKPOINT_FILE, SHARD_INDEX):
        path = Path(directory) / name
        if path.is_file():
            return path
    return None


def _index_error(path: Path, message: str, where: str = "") -> KernccError:
    return KernccError(f"{path}: bad shard index", [Diagnostic(message, Location(where,
                                                                                 file=str(path)))])


def shard_map(index: str | os.PathLike) -> dict[str, Path]:
    """{tensor: shard path} of a shard index; shards are plain file names beside the index
    and must exist (an index never reaches outside its directory)."""
    from kerncc.files import read_json

    path = Path(index)
    raw = read_json(path, "shard index")
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise _index_error(path, "`weight_map` must be a non-empty object of tensor -> shard",
                           "/weight_map")
    out: dict[str, Path] = {}
    for tensor, shard in weight_map.items():
        where = pointer("weight_map", tensor)
        if not isinstance(shard, str) or not shard or Path(shard).name != shard \
                or shard in (".", ".."):
            raise _index_error(path, f"tensor `{tensor}`: shard {json.dumps(shard)} is not a "
                               "file name beside the index", where)
        if not (path.parent / shard).is_file():
            raise _index_error(path, f"tensor `{tensor}`: shard `{shard}` does not exist", where)
        out[tensor] = path.parent / shard
    return out


def shard_paths(index: str | os.PathLike) -> list[Path]:
    """The distinct shard files of a shard index, sorted."""
    return sorted(set(shard_map(index).values()))
