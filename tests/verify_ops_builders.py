"""Small valid manifests for the verifier tests of rule groups 7 and 8 (ops and programs).

`base()` is a manifest that exercises packs with tensormaps, scratch, `when`, a cluster, an
extern with `algo`, a derive program, ranks, vars and expressions, and verifies cleanly.
`diagnostics(doc)` runs only rule groups 7 and 8 on it and returns (message, pointer) pairs.
"""

from __future__ import annotations

import copy
from typing import Any

from kerncc.manifest.reader import from_raw
from kerncc.verify import Checker
from kerncc.verify.ops import check_ops
from kerncc.verify.programs import check_programs

SHA = "ab" * 32


def tensormap(param: int, dims: list[int], **extra: Any) -> dict:
    """A bf16 descriptor over interface param `param`: 64-element rows, 128-byte strides."""
    tmap = {"param": param, "dtype": "bf16", "dims": dims, "strides": [128] * (len(dims) - 1),
            "box": [64] + [8] * (len(dims) - 1), "swizzle": 128}
    tmap.update(extra)
    return tmap


def tma_pack() -> dict:
    """Two descriptors, then one field of every other source kind (320-byte image)."""
    return {"size": 320, "fields": [
        {"at": 0, "tensormap": tensormap(0, [64, 0])},
        {"at": 128, "tensormap": tensormap(1, [64, 8])},
        {"at": 256, "param": 1},
        {"at": 264, "var": "tokens"},
        {"at": 268, "expr": {"mul": ["seqs", 2]}},
        {"at": 272, "param": 3},
        {"at": 276, "f32": 0.5},
        {"at": 280, "i64": 7},
        {"at": 288, "u8": 3},
        {"at": 292, "rank": "tp"},
    ]}


def base() -> dict:
    return copy.deepcopy(_BASE)


_BASE: dict = {
    "schema_version": 5,
    "model": "t",
    "vars": {"tokens": {"max": 8, "axis": "rows"}, "seqs": {"max": 4, "axis": "groups"}},
    "topology": {"groups": {"tp": 2}},
    "states": {"kv": {"bytes_per_token": 64}},
    "buffers": {
        "x": {"dtype": "bf16", "shape": ["tokens", 64], "kind": "input"},
        "w": {"dtype": "bf16", "shape": [64, 64], "kind": "weight", "bind": [{"tensor": "w"}]},
        "src": {"dtype": "bf16", "shape": [64, 64], "kind": "source", "bind": [{"tensor": "s"}]},
        "c": {"dtype": "bf16", "shape": [64, 64], "kind": "carry"},
        "h": {"dtype": "bf16", "shape": ["tokens", 64], "kind": "workspace"},
        "h2": {"dtype": "bf16", "shape": ["tokens", 64], "kind": "workspace"},
        "h3": {"dtype": "bf16", "shape": ["tokens", 64], "kind": "workspace"},
        "y": {"dtype": "bf16", "shape": ["tokens", 64], "kind": "output"},
    },
    "modules": {"k": {"source": "k.cubin", "sha256": SHA}},
    "ops": {
        "mm": {"params": ["in buffer<bf16>", "in buffer<bf16>", "out buffer<bf16>"],
               "impl": {"launches": [{"entry": "extern:cublaslt_bf16_tn", "algo": {
                   "id": 6, "tile": 18, "stages": 4, "split_k": 1, "reduction": 0,
                   "swizzle": 1, "custom": 0, "inner_shape": 0, "cluster_shape": 2}}]}},
        "act": {"params": ["in buffer<bf16>", "out buffer<bf16>", "i32"],
                "impl": {"scratch": {"tmp": {"dtype": "f32", "shape": ["tokens", 64]}},
                         "launches": [
                             {"module": "k", "entry": "act_a", "block": [128, 1, 1],
                              "grid": [{"ceil_div": ["tokens", 2]}, 1, 1],
                              "params": ["in buffer<bf16>", "out buffer<f32>", "i32"],
                              "args": [{"param": 0}, {"scratch": "tmp"}, {"param": 2}]},
                             {"module": "k", "entry": "act_b", "block": [128, 1, 1],
                              "grid": ["tokens", 1, 1],
                              "params": ["in buffer<f32>", "out buffer<bf16>"],
                              "args": [{"scratch": "tmp"}, {"param": 1}]}]}},
        "sc": {"params": ["in buffer<bf16>", "out buffer<bf16>", "u8", "f32", "i64"],
               "impl": {"launches": [{"module": "k", "entry": "sc_k", "block": [64, 2, 1],
                                      "grid": [{"add": ["tokens", "seqs"]}, 1, 1]}]}},
        "tma": {"params": ["in buffer<bf16>", "out buffer<bf16>", "inout state", "i32"],
                "impl": {"launches": [
                    {"module": "k", "entry": "tma_k", "block": [128, 1, 1], "grid": [2, 1, 1],
                     "cluster": [2, 1, 1], "shared_mem": {"mul": ["tokens", 1024]},
                     "when": {"var": "tokens", "min": 1, "max": 8},
                     "params": ["bytes<320>", "i32", "i64"],
                     "args": [{"pack": tma_pack()}, {"rank": "tp"}, {"i64": 9}]}]}},
    },
    "programs": {
        "load": {"derive": True, "calls": [
            {"label": "derive.c", "op": "mm", "args": [{"buf": "src"}, {"buf": "w"}, {"buf": "c"}]},
        ]},
        "p": {"batch": {"groups": 1, "rows": "tokens"}, "calls": [
            {"label": "mm", "op": "mm", "args": [{"buf": "x"}, {"buf": "c"}, {"buf": "h"}]},
            {"label": "act", "op": "act", "args": [{"buf": "h"}, {"buf": "h2"}, {"i32": 3}]},
            {"label": "sc", "op": "sc", "args": [{"buf": "h2"}, {"buf": "h3"}, {"u8": 2},
                                                 {"f32": 0.5}, {"expr": {"mul": ["seqs", 2]}}]},
            {"op": "tma", "args": [{"buf": "h3"}, {"buf": "y"}, {"state": "kv"},
                                   {"var": "seqs"}]},
        ]},
    },
}


def checked(doc: dict) -> Checker:
    """A Checker after rule groups 7 and 8 only (no declarations, no unused-declaration rule)."""
    checker = Checker(from_raw(doc))
    check_ops(checker)
    check_programs(checker)
    return checker


def diagnostics(doc: dict) -> list[tuple[str, str]]:
    return [(d.message, d.location.pointer) for d in checked(doc).diags]


def add_op(doc: dict, name: str, params: list[str], launches: list[dict],
           scratch: dict | None = None) -> dict:
    impl: dict = {"launches": launches}
    if scratch is not None:
        impl["scratch"] = scratch
    doc["ops"][name] = {"params": params, "impl": impl}
    return doc


DELETE = object()


def edit(doc: dict, path: tuple, value: Any) -> dict:
    """Set (or with DELETE remove) the value at `path`, a tuple of keys and indices."""
    *parents, last = path
    node = doc
    for key in parents:
        node = node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return doc


def edited(*edits: tuple[tuple, Any]) -> dict:
    doc = base()
    for path, value in edits:
        edit(doc, path, value)
    return doc
