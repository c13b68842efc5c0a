"""The kernel library's index: which modules (cubins) exist, their sha256 and entries.

Reads `kernels/cubins.json` (written by `kernels/build.py`). Generators use it to fill a
manifest's `modules` (source = cubin file name, sha256 = the cubin's hash); backends use
`cubin_path` to find the file a module names.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent
# Entries no manifest may name: a backend launches them itself, with arguments no plan could
# give safely (persist_run_bf16's phase table holds raw device pointers:
# runtime/backends/persist.py; attn_decode_joined*'s counters are the backend's memory:
# runtime/backends/attention.py). They have no numpy reference; both backends refuse them.
# (The pipelined decode split, attn_decode_split_pipe_tc_bf16, is one the cuda backend puts in
# a launch's place too, but with the split kernel's arguments only: an ordinary entry.)
INTERNAL = frozenset({"persist_run_bf16", "persist_ring_bf16", "persist_ws_bf16",
                      "attn_decode_joined_bf16",
                      "attn_decode_joined_tc_bf16"})


@functools.cache
def index() -> dict[str, dict]:
    """{module name: {"file": path relative to kernels/, "sha256": hex, "entries": [names]}}."""
    return json.loads((KERNELS_DIR / "cubins.json").read_text())


def cubin_path(module: str) -> Path:
    return KERNELS_DIR / index()[module]["file"]


def is_internal(entry: str, module: str | None) -> bool:
    """Whether `entry` of the module with sha256 `module` is one of the library's INTERNAL."""
    return entry in INTERNAL and module == index()[module_of(entry)]["sha256"]


def module_of(entry: str) -> str:
    """The module whose cubin defines kernel `entry`."""
    for name, info in index().items():
        if entry in info["entries"]:
            return name
    raise KeyError(f"no module defines kernel `{entry}`")
