"""Rule groups 1-6 and 9 of the verifier (kerncc.verify.decls, kerncc.verify.buffers).

Each case mutates one valid manifest and expects kern's exact message at an exact JSON pointer.
Rule groups 7 and 8 are not run: the unused-declaration tests stand in for them with
`mark_program_uses`, which records what the calls and launches use.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from kerncc import manifest as m
from kerncc.manifest.reader import from_raw
from kerncc.verify import Checker
from kerncc.verify.buffers import rust_f64
from kerncc.verify.decls import (
    RegistryRefError,
    check_declarations,
    check_unused,
    registry_url,
    rust_debug_str,
)

SHA = "0123456789abcdef" * 4

BASE: dict[str, Any] = {
    "schema_version": 5,
    "model": "decls-test",
    "topology": {"groups": {"tp": 2}},
    "vars": {
        "tokens": {"max": 8, "axis": "rows"},
        "seqs": {"max": 4, "axis": "groups"},
        "blocks": {"max": 3},
        "ctx": {"max": 64},
    },
    "states": {
        "kv": {"bytes_per_token": 64},
        "conv": {"bytes_per_seq": 256},
        "host_kv": {"host": {"dtype": "bf16", "shape": [0, 16, 8], "strides": [128, 8, 1]}},
        "flags": {"bytes": 1024},
    },
    "buffers": {
        "token_ids": {"dtype": "i32", "shape": ["tokens"], "kind": "input", "fill": "token",
                      "domain": {"min": 0, "max": 151935}},
        "positions": {"dtype": "i64", "shape": ["tokens"], "kind": "input", "fill": "position",
                      "domain": {"min": 0, "max": {"add": ["ctx", 7]}}},
        "block_table": {"dtype": "i32", "shape": ["seqs", "blocks"], "kind": "input",
                        "domain": {"index_into": "kv", "stride": 16}},
        "conv_lines": {"dtype": "i32", "shape": [2, "seqs"], "kind": "input",
                       "domain": {"index_into": "conv", "stride": 64}},
        "host_table": {"dtype": "i32", "shape": ["seqs", 5], "kind": "input",
                       "domain": {"index_into": "host_kv", "stride": 16}},
        "cu_seqlens": {"dtype": "i32", "shape": [5], "kind": "input", "fill": "cu_seqlens",
                       "domain": {"monotone": True}},
        "temp": {"dtype": "f32", "shape": [1], "kind": "input",
                 "domain": {"min": 0.0, "max": 2.5}},
        "next_token": {"dtype": "i32", "shape": ["seqs"], "kind": "output", "fill": "tokens"},
        "w_embed": {"dtype": "bf16", "shape": [32, 16], "kind": "weight",
                    "bind": [{"tensor": "model.embed.weight", "rows": [0, 32]}]},
        "w_qkv": {"dtype": "bf16", "shape": [16, 48], "kind": "weight",
                  "bind": [{"tensor": {"group": "tp", "tensors": ["qkv.0", "qkv.1"]},
                            "cols": {"group": "tp", "ranges": [[0, 48], [48, 96]]}}]},
        "w_gate_up": {"dtype": "bf16", "shape": [64, 16], "kind": "weight",
                      "bind": [{"tensor": "gate", "interleave": {"with": "up", "rows": 8}}]},
        "w_head": {"dtype": "bf16", "shape": [32, 16], "kind": "weight", "placement": "host",
                   "bind": [{"tensor": "lm_head.weight"}]},
        "src": {"dtype": "bf16", "shape": [32, 16], "kind": "source",
                "bind": [{"tensor": "raw.weight"}]},
        "hidden": {"dtype": "bf16", "shape": ["tokens", 16], "kind": "workspace",
                   "export": True},
        "hidden_peers": {"dtype": "u64", "shape": [2], "kind": "peer", "of": "hidden",
                         "group": "tp"},
        "kv_peers": {"dtype": "u64", "shape": [2], "kind": "peer", "of": "kv", "group": "tp"},
        "acc": {"dtype": "f32", "shape": [16], "kind": "carry"},
    },
    "modules": {
        "step": {"source": "hf:kern-org/kernels/step.cubin@v1", "sha256": SHA},
        "derive": {"source": "derive.cubin", "sha256": SHA.upper()},
    },
    "ops": {
        "step": {"params": ["in buffer<i32>", "inout state", "out buffer<i32>", "i32"],
                 "impl": {"launches": [{"module": "step", "entry": "step_k",
                                        "block": [128, 1, 1],
                                        "grid": [{"ceil_div": ["tokens", 128]}, 1, 1]}]}},
        "fold": {"params": ["in buffer<bf16>", "out buffer<f32>"],
                 "impl": {"launches": [{"module": "derive", "entry": "fold_k",
                                        "block": [64, 1, 1], "grid": [1, 1, 1]}]}},
    },
    "programs": {
        # Every buffer but `hidden` (used only through its peer) appears in some call.
        "decode": {"batch": {"groups": 1, "rows": 1}, "calls": [
            {"op": "step", "args": [{"buf": name}, {"state": state}, {"buf": "next_token"},
                                    {"var": "tokens"}]}
            for name, state in (("token_ids", "kv"), ("positions", "conv"),
                                ("block_table", "host_kv"), ("conv_lines", "flags"),
                                ("host_table", "kv"), ("cu_seqlens", "kv"), ("temp", "kv"),
                                ("hidden_peers", "kv"), ("kv_peers", "kv"))]},
        "load": {"derive": True, "calls": [
            {"op": "fold", "args": [{"buf": w}, {"buf": "acc"}]}
            for w in ("w_embed", "w_qkv", "w_gate_up", "w_head", "src")]},
    },
}

Mutation = Callable[[dict], Any]


def diagnostics(raw: dict, unused: bool = False) -> list[tuple[str, str]]:
    checker = Checker(from_raw(raw))
    check_declarations(checker)
    if unused:
        checker.diags.items.clear()
        mark_program_uses(checker)
        check_unused(checker)
    return [(d.message, d.location.pointer) for d in checker.diags]


def mark_program_uses(c: Checker) -> None:
    """Stands in for rule groups 7 and 8: what launches and calls use."""
    for op in c.m.ops.values():
        c.used.modules.update(la.module for la in op.launches if isinstance(la, m.KernelLaunch))
    for program in c.m.programs.values():
        for call in program.calls:
            c.used.ops.add(call.op)
            for arg in call.args:
                _mark_arg(c, arg)


def _mark_arg(c: Checker, arg: m.CallArg) -> None:
    if isinstance(arg, m.BufArg):
        c.used.buffers.add(arg.name)
    elif isinstance(arg, m.StateArg):
        c.used.states.add(arg.name)
    elif isinstance(arg, m.VarArg):
        c.used.vars.add(arg.name)


def mutated(*mutations: Mutation | tuple[Mutation, ...]) -> dict:
    """A copy of BASE with the mutations applied; a tuple stands for its members in order."""
    raw = copy.deepcopy(BASE)
    for mutation in mutations:
        for mutate in mutation if isinstance(mutation, tuple) else (mutation,):
            mutate(raw)
    return raw


def buf(raw: dict, name: str) -> dict:
    return raw["buffers"][name]


def put(path: str, value: Any) -> Mutation:
    """Set (or with value DELETE, remove) the value at a `/`-separated path."""
    def apply(raw: dict) -> None:
        *parents, last = path.split("/")
        node = raw
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return apply


DELETE = object()

# ---------------------------------------------------------------------------- valid


def test_valid_manifest_has_no_declaration_errors() -> None:
    assert diagnostics(mutated()) == []


def test_valid_manifest_has_nothing_unused() -> None:
    # Covers what this rule group itself marks used: shape vars (`blocks`), domain expression
    # vars (`ctx`), peer `of` targets (`hidden`), peer groups and ranked binds (`tp`).
    assert diagnostics(mutated(), unused=True) == []


def test_minimal_example_declarations_verify() -> None:
    import pathlib

    from kerncc.manifest.reader import load
    path = pathlib.Path(__file__).parent.parent / "examples" / "minimal.json"
    checker = Checker(load(str(path)))
    check_declarations(checker)
    # minimal.json carries an all-zero placeholder sha256, which is still 64 hex chars.
    assert list(checker.diags) == []


# ---------------------------------------------------------------------------- rule groups 1-4

HEAD_CASES = [
    (put("schema_version", 4),
     "unsupported schema_version 4 (this runtime reads 5)", "/schema_version"),
    (put("vars/extra", {"max": 0}), "var `extra`: max must be >= 1", "/vars/extra/max"),
    (put("vars/extra", {"max": 2, "axis": "rows"}),
     'vars ["extra", "tokens"] all count the `rows` axis; one var does', "/vars/tokens/axis"),
    (put("topology/groups/dp", 0), "topology group `dp`: size must be > 0",
     "/topology/groups/dp"),
    (put("cut", {"id": "", "stage": 0, "stages": 2}),
     ("cut: stage 0 of 2 with id ``; a cut has at least 2 stages, a stage below their count "
     "and an id"), "/cut/id"),
    (put("cut", {"id": "c7", "stage": 0, "stages": 1}),
     ("cut: stage 0 of 1 with id `c7`; a cut has at least 2 stages, a stage below their count "
     "and an id"), "/cut/stages"),
    (put("cut", {"id": "c7", "stage": 3, "stages": 3}),
     ("cut: stage 3 of 3 with id `c7`; a cut has at least 2 stages, a stage below their count "
     "and an id"), "/cut/stage"),
    (put("buffers/hidden_peers/group", "pp"),
     "buffer `hidden_peers`: unknown topology group `pp`", "/buffers/hidden_peers/group"),
    (put("states/host_kv/bytes", 64),
     ("state `host_kv`: a host state is sized by the host; bytes_per_token / bytes / "
     "bytes_per_seq must be absent"), "/states/host_kv/bytes"),
    (put("states/empty", {}),
     "state `empty`: one of bytes_per_token / bytes / bytes_per_seq / host must be set",
     "/states/empty"),
    (put("states/empty", {"bytes": 0}),
     "state `empty`: one of bytes_per_token / bytes / bytes_per_seq / host must be set",
     "/states/empty"),
    (put("states/kv/bytes_per_seq", 128),
     "state `kv`: bytes_per_token, bytes and bytes_per_seq are exclusive",
     "/states/kv/bytes_per_seq"),
    (put("states/host_kv/host/strides", [8, 1]),
     "state `host_kv`: host: 3 extents and 2 strides; want as many of each, at least one",
     "/states/host_kv/host"),
    (put("states/host_kv/host", {"dtype": "bf16", "shape": [], "strides": []}),
     "state `host_kv`: host: 0 extents and 0 strides; want as many of each, at least one",
     "/states/host_kv/host"),
    (put("states/host_kv/host/shape", [0, 0, 8]),
     ("state `host_kv`: host: shape [0, 0, 8]: only the outermost extent may be 0 "
     "(the host's count)"), "/states/host_kv/host/shape/1"),
    (put("states/host_kv/host/strides", [128, 0, 1]),
     "state `host_kv`: host: strides [128, 0, 1]: a zero stride aliases elements",
     "/states/host_kv/host/strides/1"),
    (put("states/host_kv/host/strides", [1, 2**62, 1]),
     ("state `host_kv`: host: shape [0, 16, 8] with strides [1, 4611686018427387904, 1]: "
     "one outer row overflows 64 bits"), "/states/host_kv/host/strides"),
]


@pytest.mark.parametrize("mutation, message, ptr", HEAD_CASES)
def test_head_rules(mutation: Mutation, message: str, ptr: str) -> None:
    assert diagnostics(mutated(mutation)) == [(message, ptr)]


def test_groups_without_topology_name_every_reference() -> None:
    found = diagnostics(mutated(put("topology", DELETE)))
    no_topology = "group `tp` but the manifest declares no topology"
    assert found == [
        (f"buffer `hidden_peers`: {no_topology}", "/buffers/hidden_peers/group"),
        (f"buffer `kv_peers`: {no_topology}", "/buffers/kv_peers/group"),
        (f"buffer `w_qkv` bind[0]: {no_topology}", "/buffers/w_qkv/bind/0/tensor/group"),
        (f"buffer `w_qkv` bind[0]: {no_topology}", "/buffers/w_qkv/bind/0/cols/group"),
    ]


# ---------------------------------------------------------------------------- rule group 5


def _domain(name: str, **fields: Any) -> Mutation:
    return put(f"buffers/{name}/domain", fields)


SHAPE_CASES = [
    (put("buffers/acc/shape", []), "buffer `acc`: shape must not be empty", "/buffers/acc/shape"),
    (put("buffers/acc/shape", [16, 0]), "buffer `acc`: zero-sized dimension",
     "/buffers/acc/shape/1"),
    (put("buffers/acc/shape", [4, "nope"]), "buffer `acc`: unknown var `nope` in shape",
     "/buffers/acc/shape/1"),
    (put("buffers/acc/shape", [2**40, "ctx", 2**20]),
     "buffer `acc`: byte size overflows u64 at var upper bounds", "/buffers/acc/shape"),
]

DOMAIN_CASES = [
    (put("buffers/block_table/domain/min", 1),
     "buffer `block_table` domain: `index_into` and `min`/`max` are mutually exclusive",
     "/buffers/block_table/domain/index_into"),
    (_domain("acc"), "buffer `acc` domain: empty (declare bounds, `index_into`, or `monotone`)",
     "/buffers/acc/domain"),
    (put("buffers/block_table/domain/stride", 0),
     "buffer `block_table` domain: `stride` must be > 0", "/buffers/block_table/domain/stride"),
    (put("buffers/token_ids/domain/stride", 4),
     "buffer `token_ids` domain: `stride` only applies with `index_into`",
     "/buffers/token_ids/domain/stride"),
    (_domain("temp", index_into="kv"), "buffer `temp` domain: a f32 buffer cannot index anything",
     "/buffers/temp/domain/index_into"),
    (put("buffers/block_table/domain/index_into", "nope"),
     "buffer `block_table` domain: `index_into` unknown buffer/state `nope`",
     "/buffers/block_table/domain/index_into"),
    (put("buffers/block_table/domain/index_into", "block_table"),
     "buffer `block_table` domain: a buffer cannot index itself",
     "/buffers/block_table/domain/index_into"),
    (put("buffers/conv_lines/domain/stride", 48),
     ("buffer `conv_lines` domain: `index_into` per-sequence state `conv` in lines of 48 bytes, "
     "which do not divide its 256 bytes per sequence"), "/buffers/conv_lines/domain/index_into"),
    (put("buffers/block_table/domain/monotone", True),
     "buffer `block_table` domain: `monotone` requires a one-dimensional buffer",
     "/buffers/block_table/domain/monotone"),
    (put("buffers/token_ids/domain/min", 0.5),
     "buffer `token_ids` domain: float `min` on a i32 buffer", "/buffers/token_ids/domain/min"),
    (put("buffers/positions/domain/max", {"add": ["nope", 7]}),
     "buffer `positions` domain max: unknown var `nope`", "/buffers/positions/domain/max"),
    (put("buffers/positions/domain/max", {"ceil_div": ["ctx", 0]}),
     "buffer `positions` domain max: division by zero", "/buffers/positions/domain/max"),
    (put("buffers/positions/domain/min", {"mul": ["ctx", 0]}),
     "buffer `positions` domain min: multiplication by constant zero",
     "/buffers/positions/domain/min"),
    (_domain("token_ids", min=10, max=3), "buffer `token_ids` domain: min 10 > max 3",
     "/buffers/token_ids/domain/min"),
    # Below `ctx`'s max but above its lower bound 1: fails at the lower var corner only.
    (_domain("positions", min=4, max="ctx"), "buffer `positions` domain: min 4 > max 1",
     "/buffers/positions/domain/min"),
    (_domain("positions", min={"mul": ["ctx", 2]}, max=100),
     "buffer `positions` domain: min 128 > max 100", "/buffers/positions/domain/min"),
    (_domain("temp", min=2.5, max=-0.75), "buffer `temp` domain: min 2.5 > max -0.75",
     "/buffers/temp/domain/min"),
]

FILL_CASES = [
    (put("buffers/next_token/fill", "token"),
     "buffer `next_token`: fill `token` is written into an input but the buffer is output",
     "/buffers/next_token/fill"),
    (put("buffers/token_ids/fill", "count"),
     "buffer `token_ids`: fill `count` is read from an output but the buffer is input",
     "/buffers/token_ids/fill"),
    (put("buffers/temp/fill", "valid"), ("buffer `temp`: fill `valid` needs an i32 or i64 buffer, "
     "not f32"), "/buffers/temp/dtype"),
]

PLACEMENT_CASES = [
    ((put("buffers/w_embed/export", True), put("buffers/w_embed/placement", "host")),
     "buffer `w_embed`: host placement requires a non-exported immutable weight",
     "/buffers/w_embed/placement"),
    (put("buffers/w_qkv/placement", "host"),
     "buffer `w_qkv`: shared host weights cannot select tensors, rows or columns by rank",
     "/buffers/w_qkv/bind/0/tensor"),
    (put("buffers/src/export", True),
     "buffer `src`: a source lives only while weights load; it cannot be exported",
     "/buffers/src/export"),
]

BIND_CASES = [
    (put("buffers/w_embed/bind", []),
     "buffer `w_embed`: a weight buffer binds at least one checkpoint tensor (`bind`)",
     "/buffers/w_embed"),
    (put("buffers/src/bind", DELETE),
     "buffer `src`: a source buffer binds at least one checkpoint tensor (`bind`)",
     "/buffers/src"),
    (put("buffers/hidden/bind", [{"tensor": "h"}]),
     ("buffer `hidden`: `bind` names checkpoint tensors for a weight or a source, "
     "not a workspace buffer"), "/buffers/hidden/bind"),
    (put("buffers/w_embed/bind/0/tensor", ""), "buffer `w_embed` bind[0]: empty tensor name",
     "/buffers/w_embed/bind/0/tensor"),
    (put("buffers/w_gate_up/bind/0/interleave/with", ""),
     "buffer `w_gate_up` bind[0]: empty tensor name", "/buffers/w_gate_up/bind/0/interleave/with"),
    (put("buffers/w_qkv/bind/0/tensor/tensors", ["qkv.0", "qkv.1", "qkv.2"]),
     "buffer `w_qkv` bind[0]: group `tp` needs 2 tensor names, got 3",
     "/buffers/w_qkv/bind/0/tensor/tensors"),
    (put("buffers/w_qkv/bind/0/tensor/group", "pp"),
     "buffer `w_qkv` bind[0]: unknown topology group `pp`", "/buffers/w_qkv/bind/0/tensor/group"),
    (put("buffers/w_gate_up/bind/0/interleave/rows", 0),
     "buffer `w_gate_up` bind[0]: interleave blocks of 0 rows",
     "/buffers/w_gate_up/bind/0/interleave/rows"),
    (put("buffers/w_gate_up/bind/0/cols", [0, 8]),
     "buffer `w_gate_up` bind[0]: an interleaved segment takes both tensors whole, not a range",
     "/buffers/w_gate_up/bind/0/cols"),
    (put("buffers/w_qkv/bind/0/cols/ranges", [[0, 48]]),
     "buffer `w_qkv` bind[0]: group `tp` needs 2 column ranges, got 1",
     "/buffers/w_qkv/bind/0/cols/ranges"),
    (put("buffers/w_qkv/bind/0/rows", {"group": "tp", "ranges": [[0, 8]]}),
     "buffer `w_qkv` bind[0]: group `tp` needs 2 row ranges, got 1",
     "/buffers/w_qkv/bind/0/rows/ranges"),
    (put("buffers/w_embed/bind/0/rows", [32, 32]),
     "buffer `w_embed` bind[0]: rows [32, 32) is empty", "/buffers/w_embed/bind/0/rows"),
    (put("buffers/w_qkv/bind/0/cols/ranges/1", [96, 48]),
     "buffer `w_qkv` bind[0]: cols [96, 48) is empty", "/buffers/w_qkv/bind/0/cols/ranges/1"),
]

PEER_CASES = [
    (put("buffers/hidden_peers/export", True),
     "buffer `hidden_peers`: a peer buffer cannot itself be exported",
     "/buffers/hidden_peers/export"),
    (put("buffers/hidden_peers/dtype", "i64"),
     "buffer `hidden_peers`: a peer buffer holds device addresses, dtype must be u64, not i64",
     "/buffers/hidden_peers/dtype"),
    (_domain("hidden_peers", min=1, max=9),
     ("buffer `hidden_peers`: a peer buffer's contents are runtime-filled addresses; "
     "it takes no domain"), "/buffers/hidden_peers/domain"),
    (put("buffers/hidden_peers/of", DELETE),
     ("buffer `hidden_peers`: a peer buffer must name the exported buffer or state it holds "
     "addresses `of`"), "/buffers/hidden_peers"),
    (put("buffers/hidden_peers/of", "hidden_peers"),
     "buffer `hidden_peers`: a peer buffer cannot be `of` itself", "/buffers/hidden_peers/of"),
    (put("states/hidden", {"bytes": 64}),
     "buffer `hidden_peers`: `of` `hidden` is both a buffer and a state",
     "/buffers/hidden_peers/of"),
    (put("buffers/hidden_peers/of", "kv_peers"),
     "buffer `hidden_peers`: `of` `kv_peers` is itself a peer buffer", "/buffers/hidden_peers/of"),
    (put("buffers/hidden_peers/of", "acc"),
     "buffer `hidden_peers`: `of` buffer `acc` is not exported", "/buffers/hidden_peers/of"),
    (put("buffers/hidden_peers/of", "host_kv"),
     "buffer `hidden_peers`: `of` state `host_kv` is the host's; only runtime memory is exported",
     "/buffers/hidden_peers/of"),
    (put("buffers/hidden_peers/of", "nope"),
     "buffer `hidden_peers`: `of` unknown buffer/state `nope`", "/buffers/hidden_peers/of"),
    (put("buffers/hidden_peers/group", DELETE),
     ("buffer `hidden_peers`: a peer buffer must name the topology `group` its addresses are "
     "indexed by"), "/buffers/hidden_peers"),
    (put("buffers/hidden_peers/shape", ["seqs"]),
     "buffer `hidden_peers`: a peer buffer over group `tp` has shape [2], one address per member",
     "/buffers/hidden_peers/shape"),
    (put("buffers/acc/of", "hidden"), "buffer `acc`: `of` only applies to peer buffers",
     "/buffers/acc/of"),
    (put("buffers/acc/group", "tp"), "buffer `acc`: `group` only applies to peer buffers",
     "/buffers/acc/group"),
]

BUFFER_CASES = (SHAPE_CASES + DOMAIN_CASES + FILL_CASES + PLACEMENT_CASES + BIND_CASES
                + PEER_CASES)


@pytest.mark.parametrize("mutation, message, ptr", BUFFER_CASES)
def test_buffer_rules(mutation: Mutation | tuple, message: str, ptr: str) -> None:
    assert diagnostics(mutated(mutation)) == [(message, ptr)]


def test_fill_on_other_kind_reports_kind_and_dtype() -> None:
    found = diagnostics(mutated(put("buffers/acc/fill", "valid")))
    assert found == [
        ("buffer `acc`: a fill sits on an input or output, not a carry buffer",
         "/buffers/acc/fill"),
        ("buffer `acc`: fill `valid` needs an i32 or i64 buffer, not f32", "/buffers/acc/dtype"),
    ]


def test_host_placement_on_workspace() -> None:
    found = diagnostics(mutated(put("buffers/acc/placement", "host")))
    assert found == [("buffer `acc`: host placement requires a non-exported immutable weight",
                      "/buffers/acc/placement")]


def test_index_into_a_name_both_buffer_and_state() -> None:
    found = diagnostics(mutated(put("states/temp", {"bytes": 8}),
                                put("buffers/block_table/domain/index_into", "temp")))
    assert found == [(("buffer `block_table` domain: `index_into` `temp` is both a buffer and a "
                      "state"), "/buffers/block_table/domain/index_into")]


def test_names_with_slashes_are_escaped_in_pointers() -> None:
    found = diagnostics(mutated(put("buffers/a~b", {"dtype": "f32", "shape": [0], "kind": "carry"}),
                                lambda raw: raw["buffers"].__setitem__(
                                    "x/y", {"dtype": "f32", "shape": [3, 0], "kind": "carry"})))
    assert found == [("buffer `a~b`: zero-sized dimension", "/buffers/a~0b/shape/0"),
                     ("buffer `x/y`: zero-sized dimension", "/buffers/x~1y/shape/1")]

# ---------------------------------------------------------------------------- rule group 6


MODULE_CASES = [
    (put("modules/step/sha256", "abc123"), "module `step`: sha256 `abc123` is not 64 hex chars",
     "/modules/step/sha256"),
    (put("modules/step/sha256", "g" + SHA[1:]),
     f"module `step`: sha256 `g{SHA[1:]}` is not 64 hex chars", "/modules/step/sha256"),
    (put("modules/step/source", ""), "module `step`: empty source", "/modules/step/source"),
    (put("modules/step/source", "s3://bucket/step.cubin"),
     ("module `step`: invalid registry ref `s3://bucket/step.cubin`: only https:// and hf: "
     "sources are fetched"), "/modules/step/source"),
    (put("modules/step/source", "https://example.com"),
     "module `step`: invalid registry ref `https://example.com`: expected https://<host>/<path>",
     "/modules/step/source"),
    (put("modules/step/source", "hf:kern-org/step.cubin"),
     ("module `step`: invalid registry ref `hf:kern-org/step.cubin`: expected "
     "hf:<org>/<repo>/<path>[@revision]"), "/modules/step/source"),
]


@pytest.mark.parametrize("mutation, message, ptr", MODULE_CASES)
def test_module_rules(mutation: Mutation, message: str, ptr: str) -> None:
    assert diagnostics(mutated(mutation)) == [(message, ptr)]


@pytest.mark.parametrize("source, url", [
    ("step.cubin", None),
    ("kernels/step v2.cubin", None),
    ("https://cdn.example.com/k/step.cubin", "https://cdn.example.com/k/step.cubin"),
    ("hf:org/repo/dir/step.cubin", "https://huggingface.co/org/repo/resolve/main/dir/step.cubin"),
    ("hf:org/repo/step.cubin@v1.2", "https://huggingface.co/org/repo/resolve/v1.2/step.cubin"),
])
def test_registry_url_accepts(source: str, url: str | None) -> None:
    assert registry_url(source) == url


@pytest.mark.parametrize("source, expected", [
    ("http://example.com/step.cubin", "only https:// and hf: sources are fetched"),
    ("hf://org/repo/step.cubin", "only https:// and hf: sources are fetched"),
    ("https:///step.cubin", "expected https://<host>/<path>"),
    ("https://example.com/", "expected https://<host>/<path>"),
    ("https://example.com/a b.cubin", "expected https://<host>/<path>"),
    ("hf:org//step.cubin", "expected hf:<org>/<repo>/<path>[@revision]"),
    ("hf:org/repo/../step.cubin", "expected hf:<org>/<repo>/<path>[@revision]"),
    ("hf:org/repo/./step.cubin", "expected hf:<org>/<repo>/<path>[@revision]"),
    ("hf:org/repo/step.cubin@", "expected hf:<org>/<repo>/<path>[@revision]"),
    ("hf:org/repo/step.cubin@a/b", "expected hf:<org>/<repo>/<path>[@revision]"),
])
def test_registry_url_refuses(source: str, expected: str) -> None:
    with pytest.raises(RegistryRefError) as err:
        registry_url(source)
    assert str(err.value) == f"invalid registry ref `{source}`: {expected}"

# ---------------------------------------------------------------------------- rule group 9


UNUSED_CASES = [
    (put("buffers/spare", {"dtype": "bf16", "shape": [4, 16], "kind": "workspace"}),
     [("buffer `spare` is never used by any program", "/buffers/spare")]),
    (put("ops/spare_op", {"params": [], "impl": {"launches": [{"entry": "extern:x"}]}}),
     [("op `spare_op` is never called", "/ops/spare_op")]),
    (put("modules/spare_mod", {"source": "spare.cubin", "sha256": SHA}),
     [("module `spare_mod` is never launched", "/modules/spare_mod")]),
    (put("states/spare_state", {"bytes": 4096}),
     [("state `spare_state` is never used by any program", "/states/spare_state")]),
    (put("vars/extra", {"max": 2}), [("var `extra` is never used", "/vars/extra")]),
    (put("topology/groups/dp", 2),
     [("topology group `dp` is never used (no peer buffer or rank arg names it)",
       "/topology/groups/dp")]),
    # An `index_into` target is not a use.
    ((put("buffers/spare", {"dtype": "i32", "shape": [8], "kind": "workspace"}),
      put("buffers/conv_lines/domain", {"index_into": "spare"})),
     [("buffer `spare` is never used by any program", "/buffers/spare")]),
    # Without its peers, `hidden` has no use; `tp` keeps one through the ranked bind of `w_qkv`.
    ((put("buffers/hidden_peers", DELETE), put("buffers/kv_peers", DELETE),
      lambda raw: raw["programs"]["decode"]["calls"].__delitem__(slice(7, None))),
     [("buffer `hidden` is never used by any program", "/buffers/hidden")]),
]


@pytest.mark.parametrize("mutation, expected", UNUSED_CASES)
def test_unused_declarations(mutation: Mutation | tuple, expected: list) -> None:
    assert diagnostics(mutated(mutation), unused=True) == expected


def test_unused_are_listed_per_family_in_name_order() -> None:
    raw = mutated(put("buffers/zz", {"dtype": "u8", "shape": [3], "kind": "workspace"}),
                  put("buffers/aa", {"dtype": "u8", "shape": [3], "kind": "workspace"}),
                  put("vars/extra", {"max": 5}), put("states/spare", {"bytes": 16}))
    assert [msg for msg, _ in diagnostics(raw, unused=True)] == [
        "buffer `aa` is never used by any program",
        "buffer `zz` is never used by any program",
        "state `spare` is never used by any program",
        "var `extra` is never used",
    ]

# ---------------------------------------------------------------------------- collection


def test_every_error_is_collected_in_one_run_in_kern_order() -> None:
    raw = mutated(put("schema_version", 6), put("vars/tokens/max", 0),
                  put("states/kv/bytes", 32), put("buffers/temp/fill", "valid"),
                  put("buffers/acc/shape", [7, "nope"]), put("modules/derive/source", ""),
                  put("buffers/hidden_peers/dtype", "u32"))
    found = diagnostics(raw)
    zero_tokens = [("buffer `hidden`: zero-sized dimension", "/buffers/hidden/shape/0"),
                   ("buffer `positions`: zero-sized dimension", "/buffers/positions/shape/0"),
                   ("buffer `token_ids`: zero-sized dimension", "/buffers/token_ids/shape/0")]
    assert found == [
        ("unsupported schema_version 6 (this runtime reads 5)", "/schema_version"),
        ("var `tokens`: max must be >= 1", "/vars/tokens/max"),
        ("state `kv`: bytes_per_token, bytes and bytes_per_seq are exclusive", "/states/kv/bytes"),
        ("buffer `acc`: unknown var `nope` in shape", "/buffers/acc/shape/1"),
        zero_tokens[0],
        (("buffer `hidden_peers`: a peer buffer holds device addresses, dtype must be u64, "
         "not u32"), "/buffers/hidden_peers/dtype"),
        zero_tokens[1],
        ("buffer `temp`: fill `valid` needs an i32 or i64 buffer, not f32", "/buffers/temp/dtype"),
        zero_tokens[2],
        ("module `derive`: empty source", "/modules/derive/source"),
    ]

# ---------------------------------------------------------------------------- text helpers


@pytest.mark.parametrize("value, text", [
    (3.0, "3"), (-0.75, "-0.75"), (1e20, "100000000000000000000"), (1.5e-7, "0.00000015"),
    (2.5, "2.5"),
])
def test_rust_f64_display(value: float, text: str) -> None:
    assert rust_f64(value) == text


def test_rust_debug_str_escapes() -> None:
    assert rust_debug_str('a"b\\c\n') == '"a\\"b\\\\c\\n"'

# ---------------------------------------------------------------------------- driver


@pytest.fixture
def stub_rules_7_8(monkeypatch: pytest.MonkeyPatch) -> None:
    """`verify()` with rule groups 7 and 8 replaced by `mark_program_uses`."""
    import types

    import kerncc.verify
    ops = types.ModuleType("kerncc.verify.ops")
    ops.check_ops = mark_program_uses  # type: ignore[attr-defined]
    programs = types.ModuleType("kerncc.verify.programs")
    programs.check_programs = lambda checker: None  # type: ignore[attr-defined]
    # The driver (kerncc/verify/__init__.py) calls the rule groups through these names.
    monkeypatch.setattr(kerncc.verify, "verify_ops", ops)
    monkeypatch.setattr(kerncc.verify, "verify_programs", programs)


def test_verify_driver_accepts_valid(stub_rules_7_8: None) -> None:
    from kerncc.verify import Verified, verify
    assert isinstance(verify(from_raw(mutated())), Verified)


def test_verify_driver_reports_all(stub_rules_7_8: None) -> None:
    from kerncc.diagnostics import KernccError
    from kerncc.verify import verify
    raw = mutated(put("schema_version", 4), put("vars/extra", {"max": 3}))
    with pytest.raises(KernccError) as err:
        verify(from_raw(raw))
    assert str(err.value) == ("manifest failed verification:\n"
                              "  - /schema_version: unsupported schema_version 4 "
                              "(this runtime reads 5)\n"
                              "  - /vars/extra: var `extra` is never used")
