"""Rule group 8 of the verifier (kerncc.verify.programs): programs, calls, dataflow.

Each negative case edits one valid manifest (`verify_ops_builders.base`: a derive program
`load` and a driven program `p` of four calls, the last unlabeled) and expects kern's exact
message at an exact JSON pointer; only rule groups 7 and 8 run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from verify_ops_builders import DELETE, add_op, base, checked, diagnostics, edit, edited

from kerncc import manifest as m
from kerncc.verify.programs import buffer_size

P = ("programs", "p", "calls")
LOAD = ("programs", "load", "calls")
MM = "program `p` call #0 (mm)"
ACT = "program `p` call #1 (act)"
SC = "program `p` call #2 (sc)"
TMA = "program `p` call #3"
DERIVE = "program `load` call #0 (derive.c)"
TMA_LAUNCH = ("ops", "tma", "impl", "launches", 0)


def ptr(program: str, call: int, *rest: Any) -> str:
    return f"/programs/{program}/calls/{call}" + "".join(f"/{r}" for r in rest)


def case(name: str, edits: list[tuple[tuple, Any]], message: str, where: str) -> Any:
    return pytest.param(edits, message, where, id=name)


PROGRAM_CASES = [
    case("no-programs", [(("programs",), {})], "no programs declared", "/programs"),
    case("once-and-batch", [(("programs", "p", "once"), True)],
         "program `p`: `once` (run after load) and `batch` (driven per step) are exclusive",
         "/programs/p/once"),
    case("derive-and-batch", [(("programs", "load", "batch"), {"groups": 1, "rows": 1})],
         "program `load`: `derive` (run inside weight loading) excludes `once`, `batch` and "
         "`graph`", "/programs/load/derive"),
    case("derive-and-once", [(("programs", "load", "once"), True)],
         "program `load`: `derive` (run inside weight loading) excludes `once`, `batch` and "
         "`graph`", "/programs/load/derive"),
    case("graph-without-batch", [(("programs", "p", "batch"), DELETE),
                                 (("programs", "p", "graph"), True)],
         "program `p`: `graph` (captured per call shape) needs a `batch` (a program a serving "
         "loop drives)", "/programs/p/graph"),
    case("batch-groups", [(("programs", "p", "batch", "groups"), 0)],
         "program `p`: batch.groups must be >= 1", "/programs/p/batch/groups"),
    case("batch-rows", [(("programs", "p", "batch", "rows"), 0)],
         "program `p`: batch.rows must be >= 1", "/programs/p/batch/rows"),
    case("batch-rows-var", [(("programs", "p", "batch", "rows"), "nope")],
         "program `p`: batch.rows names unknown var `nope`", "/programs/p/batch/rows"),
    case("batch-span-var", [(("programs", "p", "batch", "span"), "nope")],
         "program `p`: batch.span names unknown var `nope`", "/programs/p/batch/span"),
    case("batch-context-var", [(("programs", "p", "batch", "context"), "nope")],
         "program `p`: batch.context names unknown var `nope`", "/programs/p/batch/context"),
    case("unknown-op", [(P + (0, "op"), "nope")],
         f"{MM}: unknown op `nope`", ptr("p", 0, "op")),
    case("unknown-op-unlabeled", [(P + (3, "op"), "nope")],
         f"{TMA}: unknown op `nope`", ptr("p", 3, "op")),
    case("arity", [(P + (0, "args", 2), DELETE)],
         f"{MM}: op `mm` takes 3 params, got 2 args", ptr("p", 0, "args")),
    case("output-never-written", [(P + (3,), DELETE)],
         "output buffer `y` is never written by any program", "/buffers/y"),
    case("carry-never-written", [(("programs", "load"), DELETE)],
         "carry buffer `c` is never written by any program", "/buffers/c"),
]

BUFFER_CASES = [
    case("unknown-buffer", [(P + (0, "args", 0), {"buf": "nope"})],
         f"{MM}: arg #0: unknown buffer `nope`", ptr("p", 0, "args", 0)),
    case("dtype", [(("buffers", "ids"), {"dtype": "i32", "shape": [4], "kind": "input"}),
                   (P + (0, "args", 0), {"buf": "ids"})],
         f"{MM}: arg #0: buffer `ids` has dtype i32 but param expects bf16",
         ptr("p", 0, "args", 0)),
    case("offset-alignment", [(P + (0, "args", 0), {"buf": "x", "offset": 3})],
         f"{MM}: arg #0: offset 3 into buffer `x` is not 2-aligned for bf16",
         ptr("p", 0, "args", 0)),
    case("offset-outside", [(P + (0, "args", 0), {"buf": "x", "offset": 1024})],
         f"{MM}: arg #0: offset 1024 is outside buffer `x` (1024 bytes at var upper bounds)",
         ptr("p", 0, "args", 0)),
    case("read-before-written", [(P + (1, "args", 0), {"buf": "h3"})],
         f"{ACT}: arg #0: buffer `h3` is read before ever being written", ptr("p", 1, "args", 0)),
    case("read-before-written-per-program",
         [(("programs", "q"), {"calls": [{"op": "act", "args": [
             {"buf": "h"}, {"buf": "h2"}, {"i32": 1}]}]})],
         "program `q` call #0: arg #0: buffer `h` is read before ever being written",
         ptr("q", 0, "args", 0)),
    case("tensormap-footprint-offset", [(P + (3, "args", 1), {"buf": "y", "offset": 2})],
         f"{TMA}: arg #1: op `tma` launch #0 (tma_k): arg #0: field #1 addresses 1024 bytes but "
         "buffer `y` has 1022 bytes past offset 2 at var upper bounds", ptr("p", 3, "args", 1)),
    case("tensormap-footprint-size", [(("buffers", "y", "shape"), ["tokens", 32])],
         f"{TMA}: arg #1: op `tma` launch #0 (tma_k): arg #0: field #1 addresses 1024 bytes but "
         "buffer `y` has 512 bytes past offset 0 at var upper bounds", ptr("p", 3, "args", 1)),
    case("tensormap-footprint-spanning", [(P + (3, "args", 0), {"buf": "h3", "offset": 1000})],
         f"{TMA}: arg #0: op `tma` launch #0 (tma_k): arg #0: field #0 addresses 128 bytes but "
         "buffer `h3` has 24 bytes past offset 1000 at var upper bounds", ptr("p", 3, "args", 0)),
    case("source-outside-derive", [(P + (0, "args", 1), {"buf": "src"})],
         f"{MM}: arg #1: source buffer `src` is read only by a `derive` program; it is gone after "
         "load", ptr("p", 0, "args", 1)),
    case("derive-reads-input", [(LOAD + (0, "args", 0), {"buf": "x"})],
         f"{DERIVE}: arg #0: a `derive` program runs inside weight loading, before any input "
         "buffer such as `x` means anything", ptr("load", 0, "args", 0)),
    case("derive-writes-output", [(LOAD + (0, "args", 2), {"buf": "y"})],
         f"{DERIVE}: arg #2: a `derive` program runs inside weight loading, before any input "
         "buffer such as `y` means anything", ptr("load", 0, "args", 2)),
    case("writes-weight", [(P + (0, "args", 2), {"buf": "w"})],
         f"{MM}: arg #2: op writes to read-only weight buffer `w`", ptr("p", 0, "args", 2)),
    case("writes-input", [(P + (0, "args", 2), {"buf": "x"})],
         f"{MM}: arg #2: op writes to read-only input buffer `x`", ptr("p", 0, "args", 2)),
    case("writes-source", [(LOAD + (0, "args", 2), {"buf": "src"})],
         f"{DERIVE}: arg #2: op writes to read-only source buffer `src`",
         ptr("load", 0, "args", 2)),
]

SCALAR_CASES = [
    case("unknown-state", [(P + (3, "args", 2), {"state": "nope"})],
         f"{TMA}: arg #2: unknown state `nope`", ptr("p", 3, "args", 2)),
    case("unknown-var", [(P + (3, "args", 3), {"var": "nope"})],
         f"{TMA}: arg #3: unknown var `nope`", ptr("p", 3, "args", 3)),
    case("var-to-f32", [(P + (2, "args", 3), {"var": "seqs"})],
         f"{SC}: arg #3: var `seqs` cannot bind to an f32 param", ptr("p", 2, "args", 3)),
    case("var-u8-range", [(("vars", "big"), {"max": 300}), (P + (2, "args", 2), {"var": "big"})],
         f"{SC}: arg #2: var `big` max 300 exceeds u8 range", ptr("p", 2, "args", 2)),
    case("var-i32-range", [(("vars", "big"), {"max": 2**31}), (P + (3, "args", 3), {"var": "big"})],
         f"{TMA}: arg #3: var `big` max 2147483648 exceeds i32 range", ptr("p", 3, "args", 3)),
    case("expr-to-f32", [(P + (2, "args", 3), {"expr": "seqs"})],
         f"{SC}: arg #3: an expression cannot bind to an f32 param", ptr("p", 2, "args", 3)),
    case("expr-i32-range", [(P + (3, "args", 3), {"expr": {"mul": ["tokens", 2**28]}})],
         f"{TMA}: arg #3: expression reaches 2147483648 at var upper bounds, exceeding i32 range",
         ptr("p", 3, "args", 3)),
    case("expr-u8-range", [(P + (2, "args", 2), {"expr": {"mul": ["tokens", 32]}})],
         f"{SC}: arg #2: expression reaches 256 at var upper bounds, exceeding u8 range",
         ptr("p", 2, "args", 2)),
    case("expr-unknown-var", [(P + (2, "args", 4), {"expr": {"add": ["seqs", "nope"]}})],
         f"{SC}: arg #4: unknown var `nope`", ptr("p", 2, "args", 4)),
    case("expr-multiplication-by-zero", [(P + (2, "args", 4), {"expr": {"mul": ["seqs", 0]}})],
         f"{SC}: arg #4: multiplication by constant zero", ptr("p", 2, "args", 4)),
    case("literal-type", [(P + (2, "args", 2), {"i32": 2})],
         f"{SC}: arg #2: i32 literal 2 does not match param `u8`", ptr("p", 2, "args", 2)),
    case("f32-literal-display", [(P + (3, "args", 3), {"f32": 0.1})],
         f"{TMA}: arg #3: f32 literal 0.1 does not match param `i32`", ptr("p", 3, "args", 3)),
    case("rank-to-u8", [(P + (2, "args", 2), {"rank": "tp"})],
         f"{SC}: arg #2: rank in group `tp` does not match param `u8`", ptr("p", 2, "args", 2)),
    case("rank-unknown-group", [(P + (3, "args", 3), {"rank": "nope"})],
         f"{TMA}: arg #3: unknown topology group `nope`", ptr("p", 3, "args", 3)),
    case("buffer-to-state", [(P + (3, "args", 2), {"buf": "h", "offset": 8})],
         f"{TMA}: arg #2: buffer `h`+8 does not match param `inout state`", ptr("p", 3, "args", 2)),
    case("state-to-buffer", [(P + (0, "args", 0), {"state": "kv", "offset": 64})],
         f"{MM}: arg #0: state `kv`+64 does not match param `in buffer<bf16>`",
         ptr("p", 0, "args", 0)),
    case("var-to-buffer", [(P + (0, "args", 0), {"var": "seqs"})],
         f"{MM}: arg #0: var `seqs` does not match param `in buffer<bf16>`",
         ptr("p", 0, "args", 0)),
]


@pytest.mark.parametrize(("edits", "message", "where"),
                         PROGRAM_CASES + BUFFER_CASES + SCALAR_CASES)
def test_rule_8_refusals(edits: list, message: str, where: str) -> None:
    assert (message, where) in diagnostics(edited(*edits))


def _with_op(name: str, params: list[str], entry: str) -> dict:
    return add_op(base(), name, params, [{"entry": entry}])


def _derive_calls_collective() -> dict:
    doc = _with_op("ar", ["inout buffer<bf16>"], "extern:nccl_allreduce_bf16")
    doc["programs"]["load"]["calls"].append({"op": "ar", "args": [{"buf": "c"}]})
    return doc


def _peer_to_extern() -> dict:
    doc = _with_op("pe", ["in buffer<u64>", "out buffer<bf16>"], "extern:x")
    doc["buffers"]["peers"] = {"dtype": "u64", "shape": [2], "kind": "peer", "of": "h",
                               "group": "tp"}
    doc["programs"]["p"]["calls"].append({"op": "pe", "args": [{"buf": "peers"}, {"buf": "h"}]})
    return doc


def _derive_touches_state() -> dict:
    doc = _with_op("st", ["inout state"], "extern:x")
    doc["programs"]["load"]["calls"].append({"op": "st", "args": [{"state": "kv"}]})
    return doc


@pytest.mark.parametrize(("build", "message", "where"), [
    (_derive_calls_collective,
     ("program `load` call #1: a `derive` program runs before any group is joined; op `ar` is "
      "a collective"), ptr("load", 1, "op")),
    (_peer_to_extern,
     ("program `p` call #4: arg #0: peer buffer `peers` passed to op `pe`, which has an extern "
      "launch; runtime built-ins never receive peer memory"), ptr("p", 4, "args", 0)),
    (_derive_touches_state,
     ("program `load` call #1: arg #0: a `derive` program runs inside weight loading, before "
      "state `kv` holds anything"), ptr("load", 1, "args", 0)),
])
def test_rule_8_refusals_with_extra_ops(build: Callable[[], dict], message: str,
                                        where: str) -> None:
    assert (message, where) in diagnostics(build())

# ---------------------------------------------------------------------------- accepted


def _inout_program() -> dict:
    doc = base()
    doc["buffers"]["io"] = {"dtype": "bf16", "shape": ["tokens", 64], "kind": "inout"}
    edit(doc, P + (0, "args", 2), {"buf": "io"})
    edit(doc, P + (1, "args", 0), {"buf": "io"})
    return doc


def _once_writes_a_carry() -> dict:
    doc = base()
    doc["buffers"]["d"] = {"dtype": "bf16", "shape": [64, 64], "kind": "carry"}
    doc["programs"]["init"] = {"once": True, "calls": [
        {"op": "mm", "args": [{"buf": "w"}, {"buf": "w"}, {"buf": "d"}]}]}
    return doc


ACCEPTED = [
    pytest.param(_inout_program, id="inout-read-at-start-and-rewritten"),
    pytest.param(_once_writes_a_carry, id="once-writes-carry"),
    pytest.param(lambda: edited((P + (0, "args", 0), {"buf": "x", "offset": 1022})),
                 id="offset-aligned-inside"),
    pytest.param(lambda: edited((P + (3, "args", 0), {"buf": "h3", "offset": 896})),
                 id="footprint-exactly-fits"),
    pytest.param(lambda: edited((P + (3, "args", 3), {"expr": {"mul": ["tokens", 268435455]}})),
                 id="expr-at-i32-max"),
    pytest.param(lambda: edited((("vars", "lim"), {"max": 255}),
                                (P + (2, "args", 2), {"var": "lim"})), id="var-at-u8-max"),
    pytest.param(lambda: edited((P + (2, "args", 4), {"rank": "tp"})), id="rank-to-i64"),
    pytest.param(lambda: edited((P + (2, "args", 4), {"i64": -3})), id="i64-literal"),
    pytest.param(lambda: edited((("programs", "p", "graph"), True)), id="graph-with-batch"),
    pytest.param(lambda: edited((("programs", "p", "batch"),
                                 {"groups": 4, "rows": 1, "span": "tokens", "context": "seqs"})),
                 id="batch-span-context"),
    pytest.param(lambda: edited((P + (3, "args", 2), {"state": "kv", "offset": 10**12})),
                 id="state-offsets-unchecked"),
]


@pytest.mark.parametrize("build", ACCEPTED)
def test_accepted_programs(build: Callable[[], dict]) -> None:
    assert diagnostics(build()) == []


def test_batch_vars_count_as_used() -> None:
    doc = base()
    doc["vars"].update({"run": {"max": 4}, "longest": {"max": 64}})
    edit(doc, ("programs", "p", "batch"), {"groups": 2, "rows": 1, "span": "run",
                                           "context": "longest"})
    assert {"run", "longest"} <= checked(doc).used.vars


def test_a_mismatched_rank_marks_no_group_used() -> None:
    """kern marks a group used by a call's rank only when the rank fits the param."""
    doc = edited((P + (2, "args", 2), {"rank": "tp"}),
                 (TMA_LAUNCH + ("args", 1), {"i32": 1}),
                 (TMA_LAUNCH + ("args", 0, "pack", "fields", 9), {"at": 292, "i32": 0}))
    assert "tp" not in checked(doc).used.groups


@pytest.mark.parametrize(("buf", "size"), [
    (m.Buffer("bf16", ("tokens", 64), "workspace"), 1024),
    (m.Buffer("i64", (3, "seqs"), "input"), 96),
    (m.Buffer("u8", (), "input"), None),
    (m.Buffer("u8", ("nope",), "input"), None),
    (m.Buffer("u8", (5, 0), "input"), None),
    (m.Buffer("u64", (2**40, 2**30), "workspace"), None),
])
def test_buffer_size(buf: m.Buffer, size: int | None) -> None:
    assert buffer_size(buf, {"tokens": 8, "seqs": 4}) == size
