"""Rule group 7 of the verifier (kerncc.verify.ops, verify_wiring, verify_packs).

Each negative case edits one valid manifest (`verify_ops_builders.base`) and expects kern's
exact message at an exact JSON pointer; only rule groups 7 and 8 run, so the cases do not
depend on the declaration rules.
"""

from __future__ import annotations

from typing import Any

import pytest
from verify_ops_builders import DELETE, add_op, base, checked, diagnostics, edit, edited

from kerncc import manifest as m
from kerncc.manifest.reader import from_raw
from kerncc.verify import verify
from kerncc.verify.packs import tensormap_footprint, tensormap_problems
from kerncc.verify.wiring import TensorMapUse, describe_arg, op_tensormaps

ACT = ("ops", "act", "impl", "launches")
TMA = ("ops", "tma", "impl", "launches", 0)
FIELDS = TMA + ("args", 0, "pack", "fields")
TMAP0 = FIELDS + (0, "tensormap")
ACT_CTX = "op `act` launch #0 (act_a)"
ACT_PTR = "/ops/act/impl/launches/0"
TMA_CTX = "op `tma` launch #0 (tma_k)"
TMA_PTR = "/ops/tma/impl/launches/0"
PACK_CTX = f"{TMA_CTX}: arg #0"
FIELD_PTR = f"{TMA_PTR}/args/0/pack/fields"


def case(name: str, edits: list[tuple[tuple, Any]], message: str, ptr: str) -> Any:
    return pytest.param(edits, message, ptr, id=name)


OP_CASES = [
    case("interface-bytes", [(("ops", "sc", "params", 2), "bytes<8>")],
         "op `sc`: interface param #2 is a byte aggregate; packs are launch-private, the "
         "interface takes the buffers and scalars they are assembled from", "/ops/sc/params/2"),
    case("scratch-zero-dim", [(("ops", "act", "impl", "scratch", "tmp", "shape"), ["tokens", 0])],
         "op `act` scratch `tmp`: zero-sized dimension", "/ops/act/impl/scratch/tmp/shape/1"),
    case("scratch-unknown-var", [(("ops", "act", "impl", "scratch", "tmp", "shape"), ["nope"])],
         "op `act` scratch `tmp`: unknown var `nope` in shape",
         "/ops/act/impl/scratch/tmp/shape/0"),
    case("no-launches", [(("ops", "mm", "impl", "launches"), [])],
         "op `mm`: implementation has no launches", "/ops/mm/impl/launches"),
    case("when-unknown-var", [(TMA + ("when", "var"), "nope")],
         f"{TMA_CTX}: when: unknown var `nope`", f"{TMA_PTR}/when/var"),
    case("when-empty", [(TMA + ("when", "min"), 5), (TMA + ("when", "max"), 3)],
         f"{TMA_CTX}: when: `tokens` range [5, 3] is empty", f"{TMA_PTR}/when"),
    case("when-above-var-max", [(TMA + ("when", "min"), 9), (TMA + ("when", "max"), DELETE)],
         f"{TMA_CTX}: when: `tokens` range [9, 8] is empty", f"{TMA_PTR}/when"),
    case("extern-without-prefix", [(("ops", "mm", "impl", "launches", 0, "entry"), "cublas")],
         "op `mm` launch #0 (cublas): a launch without a module must be a runtime built-in "
         "(`extern:<name>`)", "/ops/mm/impl/launches/0/entry"),
    case("algo-elsewhere", [(("ops", "mm", "impl", "launches", 0, "entry"),
                             "extern:cublaslt_fp8_tn")],
         "op `mm` launch #0 (extern:cublaslt_fp8_tn): `algo` pins a cublaslt_bf16_tn[_acc] "
         "launch, not `extern:cublaslt_fp8_tn`", "/ops/mm/impl/launches/0/algo"),
    case("kernel-empty-entry", [(ACT + (0, "entry"), "")],
         "op `act` launch #0 (): empty entry", f"{ACT_PTR}/entry"),
    case("kernel-extern-entry", [(ACT + (0, "entry"), "extern:x")],
         "op `act` launch #0 (extern:x): an extern entry has no module or launch geometry",
         f"{ACT_PTR}/entry"),
    case("unknown-module", [(ACT + (0, "module"), "nope")],
         f"{ACT_CTX}: unknown module `nope`", f"{ACT_PTR}/module"),
    case("block-threads", [(ACT + (0, "block"), [1024, 2, 1])],
         f"{ACT_CTX}: block [1024, 2, 1] exceeds 1024 threads or has a zero dim",
         f"{ACT_PTR}/block"),
    case("block-zero-dim", [(ACT + (0, "block"), [128, 0, 1])],
         f"{ACT_CTX}: block [128, 0, 1] exceeds 1024 threads or has a zero dim",
         f"{ACT_PTR}/block"),
    case("block-z", [(ACT + (0, "block"), [1, 1, 65])],
         f"{ACT_CTX}: block.z 65 > 64", f"{ACT_PTR}/block/2"),
    case("grid-x-limit", [(ACT + (0, "grid", 0), {"mul": ["tokens", 2**30]})],
         f"{ACT_CTX}: grid.x: 8589934592 exceeds CUDA limit 2147483647 at var upper bounds",
         f"{ACT_PTR}/grid/0"),
    case("grid-y-limit", [(ACT + (0, "grid", 1), 65536)],
         f"{ACT_CTX}: grid.y: 65536 exceeds CUDA limit 65535 at var upper bounds",
         f"{ACT_PTR}/grid/1"),
    case("grid-unknown-var", [(ACT + (0, "grid", 2), "nope")],
         f"{ACT_CTX}: grid.z: unknown var `nope`", f"{ACT_PTR}/grid/2"),
    case("grid-division-by-zero", [(ACT + (0, "grid", 0), {"ceil_div": ["tokens", 0]})],
         f"{ACT_CTX}: grid.x: division by zero", f"{ACT_PTR}/grid/0"),
    case("grid-multiplication-by-zero", [(ACT + (0, "grid", 0), {"mul": ["tokens", 0]})],
         f"{ACT_CTX}: grid.x: multiplication by constant zero", f"{ACT_PTR}/grid/0"),
    case("grid-overflow", [(ACT + (0, "grid", 0), {"mul": ["tokens", 2**62]})],
         f"{ACT_CTX}: grid.x: arithmetic overflow", f"{ACT_PTR}/grid/0"),
    case("grid-zero-at-lower-bounds", [(ACT + (0, "grid", 2), 0)],
         f"{ACT_CTX}: grid.z: evaluates to 0 at var lower bounds", f"{ACT_PTR}/grid/2"),
    case("shared-mem-limit", [(TMA + ("shared_mem",), {"mul": ["tokens", 30000]})],
         f"{TMA_CTX}: shared_mem: 240000 bytes exceeds opt-in limit 232448 at var upper bounds",
         f"{TMA_PTR}/shared_mem"),
    case("shared-mem-unknown-var", [(TMA + ("shared_mem",), "nope")],
         f"{TMA_CTX}: shared_mem: unknown var `nope`", f"{TMA_PTR}/shared_mem"),
    case("cluster-zero-dim", [(TMA + ("cluster",), [2, 0, 1])],
         f"{TMA_CTX}: cluster [2, 0, 1] has a zero dim or more than 16 blocks",
         f"{TMA_PTR}/cluster"),
    case("cluster-too-many-blocks", [(TMA + ("cluster",), [4, 2, 4])],
         f"{TMA_CTX}: cluster [4, 2, 4] has a zero dim or more than 16 blocks",
         f"{TMA_PTR}/cluster"),
    case("cluster-grid-lower", [(TMA + ("grid", 0), {"ceil_div": ["tokens", 4]})],
         f"{TMA_CTX}: grid.x = 1 at var lower bounds is not a multiple of cluster.x = 2",
         f"{TMA_PTR}/grid/0"),
    case("cluster-grid-upper", [(TMA + ("grid", 0), {"add": ["tokens", 1]})],
         f"{TMA_CTX}: grid.x = 9 at var upper bounds is not a multiple of cluster.x = 2",
         f"{TMA_PTR}/grid/0"),
    case("arity", [(ACT + (0, "args", 2), DELETE)],
         f"{ACT_CTX}: takes 3 params, got 2 args", f"{ACT_PTR}/args"),
    case("arity-defaulted-args-forward-the-op", [(ACT + (1, "args"), DELETE)],
         "op `act` launch #1 (act_b): takes 2 params, got 3 args", "/ops/act/impl/launches/1"),
    case("param-out-of-range", [(ACT + (0, "args", 0), {"param": 5})],
         f"{ACT_CTX}: arg #0: interface param #5 out of range (3 interface params)",
         f"{ACT_PTR}/args/0"),
    case("param-dtype", [(ACT + (0, "params", 0), "in buffer<i32>")],
         f"{ACT_CTX}: arg #0: interface param `in buffer<bf16>` does not match launch param "
         "`in buffer<i32>`", f"{ACT_PTR}/args/0"),
    case("param-scalar", [(ACT + (0, "params", 2), "i64")],
         f"{ACT_CTX}: arg #2: interface param `i32` does not match launch param `i64`",
         f"{ACT_PTR}/args/2"),
    case("write-through-in", [(ACT + (0, "params", 0), "inout buffer<bf16>")],
         f"{ACT_CTX}: arg #0: launch writes through interface `in` param #0", f"{ACT_PTR}/args/0"),
    case("out-read-before-written", [(ACT + (1, "params", 1), "inout buffer<bf16>")],
         "op `act` launch #1 (act_b): arg #1: interface `out` param #1 read before any launch "
         "wrote it", "/ops/act/impl/launches/1/args/1"),
    case("out-never-written", [(ACT + (1, "params", 1), "in buffer<bf16>")],
         "op `act`: interface `out buffer<bf16>` param #1 is never written by any launch",
         "/ops/act/params/1"),
    case("scratch-unknown", [(ACT + (0, "args", 1), {"scratch": "nope"})],
         f"{ACT_CTX}: arg #1: unknown scratch `nope`", f"{ACT_PTR}/args/1"),
    case("scratch-non-buffer", [(ACT + (0, "params", 1), "i32")],
         f"{ACT_CTX}: arg #1: scratch `tmp` bound to non-buffer param `i32`", f"{ACT_PTR}/args/1"),
    case("scratch-dtype", [(ACT + (0, "params", 1), "out buffer<bf16>")],
         f"{ACT_CTX}: arg #1: scratch `tmp` has dtype f32 but param expects bf16",
         f"{ACT_PTR}/args/1"),
    case("scratch-read-before-written", [(ACT + (0, "params", 1), "inout buffer<f32>")],
         f"{ACT_CTX}: arg #1: scratch `tmp` is read before any launch wrote it",
         f"{ACT_PTR}/args/1"),
    case("scratch-never-used", [(("ops", "act", "impl", "scratch", "spare"),
                                 {"dtype": "f32", "shape": [4]})],
         "op `act`: scratch `spare` is never used", "/ops/act/impl/scratch/spare"),
    case("literal-type", [(ACT + (0, "args", 2), {"i64": 3})],
         f"{ACT_CTX}: arg #2: i64 literal 3 does not match launch param `i32`",
         f"{ACT_PTR}/args/2"),
    case("literal-f32-display", [(ACT + (0, "args", 2), {"f32": 0.1})],
         f"{ACT_CTX}: arg #2: f32 literal 0.1 does not match launch param `i32`",
         f"{ACT_PTR}/args/2"),
    case("pack-on-scalar-launch-param", [(ACT + (0, "args", 2), {"pack": {"size": 4, "fields": [
        {"at": 0, "i32": 5}]}})],
         f"{ACT_CTX}: arg #2: a pack binds only to a `bytes<n>` param, not `i32`",
         f"{ACT_PTR}/args/2/pack"),
    case("rank-type", [(TMA + ("params", 1), "u8")],
         f"{TMA_CTX}: arg #1: a rank binds only to an i32 or i64 param, not `u8`",
         f"{TMA_PTR}/args/1"),
    case("rank-unknown-group", [(TMA + ("args", 1), {"rank": "nope"})],
         f"{TMA_CTX}: arg #1: unknown topology group `nope`", f"{TMA_PTR}/args/1"),
    case("rank-without-topology", [(("topology",), DELETE)],
         f"{TMA_CTX}: arg #1: group `tp` but the manifest declares no topology",
         f"{TMA_PTR}/args/1"),
    case("pack-size", [(TMA + ("params", 0), "bytes<512>")],
         f"{PACK_CTX}: pack of 320 bytes bound to a `bytes<512>` param",
         f"{TMA_PTR}/args/0/pack/size"),
    case("pack-on-scalar", [(TMA + ("params", 0), "i64")],
         f"{PACK_CTX}: a pack binds only to a `bytes<n>` param, not `i64`",
         f"{TMA_PTR}/args/0/pack"),
]

FIELD_CASES = [
    case("width-unknown", [(FIELDS + (2, "param"), 9)],
         f"{PACK_CTX}: field #2: width unknown", f"{FIELD_PTR}/2"),
    case("param-field-out-of-range", [(FIELDS + (2, "param"), 9)],
         f"{PACK_CTX}: field #2: interface param #9 out of range (4 interface params)",
         f"{FIELD_PTR}/2/param"),
    case("width-zero", [(FIELDS + (3, "width"), 0)],
         f"{PACK_CTX}: field #3: width unknown", f"{FIELD_PTR}/3"),
    case("tensormap-width", [(FIELDS + (0, "width"), 64)],
         f"{PACK_CTX}: field #0: a tensormap field is 128 bytes, not 64", f"{FIELD_PTR}/0"),
    case("tensormap-alignment", [(FIELDS + (1, "at"), 160)],
         f"{PACK_CTX}: field #1: tensormap at 160 is not 64-byte aligned", f"{FIELD_PTR}/1"),
    case("past-image", [(FIELDS + (8, "at"), 320)],
         f"{PACK_CTX}: field #8 at 320 spans 1 bytes, past the 320 byte image", f"{FIELD_PTR}/8"),
    case("overlap", [(FIELDS + (4, "at"), 266)],
         f"{PACK_CTX}: field #4 overlaps field #3", f"{FIELD_PTR}/4"),
    case("overlap-sorted-by-offset", [(FIELDS + (1, "at"), 192)],
         f"{PACK_CTX}: field #2 overlaps field #1", f"{FIELD_PTR}/2"),
    case("unknown-var", [(FIELDS + (3, "var"), "nope")],
         f"{PACK_CTX}: field #3: unknown var `nope`", f"{FIELD_PTR}/3/var"),
    case("expr", [(FIELDS + (4, "expr"), {"ceil_div": ["seqs", 0]})],
         f"{PACK_CTX}: field #4: division by zero", f"{FIELD_PTR}/4/expr"),
    case("rank", [(FIELDS + (9, "rank"), "nope")],
         f"{PACK_CTX}: field #9: unknown topology group `nope`", f"{FIELD_PTR}/9/rank"),
    case("scratch", [(FIELDS + (2,), {"at": 256, "scratch": "nope"})],
         f"{PACK_CTX}: field #2: unknown scratch `nope`", f"{FIELD_PTR}/2/scratch"),
    case("tensormap-not-pointer", [(TMAP0 + ("param",), 3)],
         f"{PACK_CTX}: field #0: tensormap over interface param #3 (`i32`), which is not a "
         "buffer or state", f"{FIELD_PTR}/0/tensormap/param"),
    case("tensormap-out-of-range", [(TMAP0 + ("param",), 4)],
         f"{PACK_CTX}: field #0: interface param #4 out of range (4 interface params)",
         f"{FIELD_PTR}/0/tensormap/param"),
]

# (edits of field #0's descriptor, kern's text): field #0 spans param 0 (`dims` [64, 0]).
TENSORMAP_CASES = [
    ({"dims": [], "strides": []}, "dims has 0 entries, expected 1 to 5"),
    ({"dims": [64, 2, 2, 2, 2, 2], "strides": [128] * 5, "box": [64] + [1] * 5},
     "dims has 6 entries, expected 1 to 5"),
    ({"strides": []}, "strides has 0 entries, expected dims - 1 = 1"),
    ({"box": [64]}, "box has 1 entries, expected 2"),
    ({"dims": [64, 0, 4], "strides": [128, 1024], "box": [64, 8, 1]},
     "dims[1] is 0; only the outermost dim may span the buffer"),
    ({"dims": [0], "strides": [], "box": [64]}, "dims[0] is 0"),
    ({"box": [64, 300]}, "box[1] = 300, must be 1..=256"),
    ({"strides": [100]}, "strides[0] = 100 is not a positive multiple of 16"),
    ({"strides": [0]}, "strides[0] = 0 is not a positive multiple of 16"),
    ({"dims": [65, 0]}, "dims[0] = 65 elements is not a multiple of 16 bytes"),
    ({"box": [60, 8]}, "box[0] = 60 elements spans 120 bytes, not a multiple of 16"),
    ({"swizzle": 64}, "box[0] spans 128 bytes, more than the 64 byte swizzle span"),
    ({"swizzle": 16}, "swizzle 16 is not one of 0, 32, 64, 128"),
    ({"l2_promotion": 32}, "l2_promotion 32 is not one of 0, 64, 128, 256"),
    ({"wrap": True}, "`wrap` on a tensormap whose strides do not overflow"),
    ({"dims": [64, 2**40], "strides": [2**40]},
     "the tensormap's strides overflow (declare `wrap` if that is the kernel's trick)"),
]


@pytest.mark.parametrize(("edits", "message", "ptr"), OP_CASES + FIELD_CASES)
def test_rule_7_refusals(edits: list, message: str, ptr: str) -> None:
    assert (message, ptr) in diagnostics(edited(*edits))


@pytest.mark.parametrize(("changes", "message"), TENSORMAP_CASES,
                         ids=[text.split(" ")[0] + f"-{i}" for i, (_, text)
                              in enumerate(TENSORMAP_CASES)])
def test_tensormap_structure(changes: dict, message: str) -> None:
    doc = base()
    for key, value in changes.items():
        edit(doc, TMAP0 + (key,), value)
    assert (f"{PACK_CTX}: field #0: {message}", f"{FIELD_PTR}/0/tensormap") in diagnostics(doc)


def test_extern_refuses_a_pack() -> None:
    doc = add_op(base(), "e", ["in buffer<bf16>"], [{
        "entry": "extern:x", "params": ["bytes<8>"],
        "args": [{"pack": {"size": 8, "fields": [{"at": 0, "param": 0}]}}]}])
    assert ("op `e` launch #0 (extern:x): an extern launch takes pointers and scalars, not a pack",
            "/ops/e/impl/launches/0/params/0") in diagnostics(doc)


def test_never_written_out_param_of_an_extern_without_args() -> None:
    doc = add_op(base(), "z", ["out buffer<bf16>", "i32"], [{
        "entry": "extern:x", "params": ["i32"], "args": [{"param": 1}]}])
    assert diagnostics(doc) == [
        ("op `z`: interface `out buffer<bf16>` param #0 is never written by any launch",
         "/ops/z/params/0")]

# ---------------------------------------------------------------------------- accepted


def test_base_has_no_diagnostics_and_verifies() -> None:
    assert diagnostics(base()) == []
    verify(from_raw(base()))


ACCEPTED = [
    pytest.param([(("ops", "mm", "impl", "launches", 0, "entry"), "extern:cublaslt_bf16_tn_acc")],
                 id="algo-on-acc"),
    pytest.param([(TMAP0 + ("dims",), [64, 2**40]), (TMAP0 + ("strides",), [2**40]),
                  (TMAP0 + ("wrap",), True)], id="wrap-with-overflowing-strides"),
    pytest.param([(TMAP0 + ("dtype",), "u4"), (TMAP0 + ("dims",), [256, 0]),
                  (TMAP0 + ("box",), [128, 8]), (TMAP0 + ("swizzle",), 64)], id="u4-tensormap"),
    pytest.param([(TMAP0 + ("dims",), [64, 2, 2, 2, 0]), (TMAP0 + ("strides",), [128] * 4),
                  (TMAP0 + ("box",), [64, 1, 1, 1, 1])], id="five-dim-tensormap"),
    pytest.param([(TMA + ("when",), {"var": "seqs"})], id="when-whole-range"),
    pytest.param([(TMA + ("when",), {"var": "tokens", "min": 8})], id="when-at-max"),
    pytest.param([(TMA + ("cluster",), [1, 1, 1]), (TMA + ("grid", 0), "tokens")],
                 id="unit-cluster"),
    pytest.param([(TMA + ("cluster",), [2, 8, 1]), (TMA + ("grid", 1), {"mul": ["seqs", 8]})],
                 id="cluster-of-16"),
    pytest.param([(FIELDS + (2, "width"), 8), (FIELDS + (8, "width"), 4)], id="explicit-widths"),
    pytest.param([(ACT + (0, "block"), [1024, 1, 1]), (ACT + (0, "grid", 0), 2**31 - 1)],
                 id="limits-exactly"),
    pytest.param([(TMA + ("shared_mem",), 232448)], id="shared-mem-at-limit"),
    pytest.param([(ACT + (0, "params", 2), "i32"), (ACT + (0, "args", 2), {"i32": -7})],
                 id="i32-literal"),
]


@pytest.mark.parametrize("edits", ACCEPTED)
def test_accepted_variants(edits: list) -> None:
    assert diagnostics(edited(*edits)) == []


def test_usage_recorded_for_rule_9() -> None:
    used = checked(base()).used
    assert used.modules == {"k"}
    assert used.vars == {"tokens", "seqs"}
    assert used.groups == {"tp"}
    assert used.ops == {"mm", "act", "sc", "tma"}
    assert used.states == {"kv"}
    assert used.buffers == set(base()["buffers"])


def test_when_and_pack_vars_count_as_used() -> None:
    doc = base()
    doc["vars"]["gate"] = {"max": 3}
    doc["vars"]["width"] = {"max": 5}
    edit(doc, TMA + ("when",), {"var": "gate", "max": 2})
    edit(doc, FIELDS + (3, "var"), "width")
    assert {"gate", "width"} <= checked(doc).used.vars

# ---------------------------------------------------------------------------- footprints


def test_op_tensormaps_records_measurable_descriptors() -> None:
    manifest = from_raw(base())
    ctx = f"{PACK_CTX}: field #"
    assert op_tensormaps("tma", manifest.ops["tma"]) == [
        TensorMapUse(0, 128, f"{ctx}0"), TensorMapUse(1, 1024, f"{ctx}1")]


def test_op_tensormaps_skips_wrapping_and_misfit_launches() -> None:
    doc = edited((TMAP0 + ("dims",), [64, 2**40]), (TMAP0 + ("strides",), [2**40]),
                 (TMAP0 + ("wrap",), True))
    uses = op_tensormaps("tma", from_raw(doc).ops["tma"])
    assert [u.param for u in uses] == [1]
    doc = edited((TMA + ("args",), DELETE))
    assert op_tensormaps("tma", from_raw(doc).ops["tma"]) == []


def _tmap(dtype: str, dims: list[int], strides: list[int]) -> m.TensorMap:
    return m.TensorMap(param=0, dtype=dtype, dims=tuple(dims), box=(8,) * len(dims),
                       strides=tuple(strides))


@pytest.mark.parametrize(("tmap", "footprint"), [
    (_tmap("bf16", [64], []), 128),
    (_tmap("u4", [33], []), 17),
    (_tmap("f32", [16, 3, 5], [64, 256]), 64 + 2 * 64 + 4 * 256),
    (_tmap("i64", [2, 0], [16]), 16),
    (_tmap("u8", [16, 0, 3], [16, 48]), None),
    (_tmap("u8", [16, 3], []), None),
    (_tmap("u8", [16, 2**40], [2**40]), 16 + (2**40 - 1) * 2**40),
])
def test_tensormap_footprint(tmap: m.TensorMap, footprint: int | None) -> None:
    assert tensormap_footprint(tmap) == footprint


def test_tensormap_problems_of_a_good_descriptor() -> None:
    assert tensormap_problems(_tmap("bf16", [64, 7, 0], [128, 896])) == []


@pytest.mark.parametrize(("arg", "text"), [
    (m.BufArg("h"), "buffer `h`"), (m.BufArg("h", 0), "buffer `h`"),
    (m.BufArg("h", 8), "buffer `h`+8"), (m.StateArg("kv", 64), "state `kv`+64"),
    (m.VarArg("tokens"), "var `tokens`"), (m.ExprArg(m.Mul("tokens", 3)), "expression"),
    (m.Literal("i32", -5), "i32 literal -5"), (m.Literal("i64", 7), "i64 literal 7"),
    (m.Literal("f32", 1.0), "f32 literal 1"), (m.Literal("f32", 0.1), "f32 literal 0.1"),
    (m.Literal("f32", 1e20), "f32 literal 100000000000000000000"),
    (m.Literal("u8", 9), "u8 literal 9"), (m.RankArg("tp"), "rank in group `tp`"),
    (m.ParamRef(3), "interface param #3"), (m.ScratchRef("tmp"), "scratch `tmp`"),
    (m.Pack(24, ()), "pack of 24 bytes"),
])
def test_arg_display(arg: Any, text: str) -> None:
    assert describe_arg(arg) == text
