"""The serving protocol (spec §4): the fixtures' contracts, the queries, every message, the summary.

`plain.json` and `tray.json` are the spec's fixtures (§4.5); both must pass the whole verifier as
well, so they are verified when the verifier's rule groups are present. Negative cases mutate a
fixture and skip verification: they are about the protocol's own rules.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest

from kerncc import protocol
from kerncc.manifest import reader
from kerncc.diagnostics import KernccError
from kerncc.protocol import (
    HEADLINE,
    VAR_ROWS,
    Bound,
    Filled,
    Fixed,
    Forward,
    LineTable,
    PageTable,
    summary_lines,
)
from kerncc.verify import Verified

FIXTURES = Path(__file__).parent / "fixtures"
_VERIFIER = all(importlib.util.find_spec(f"kerncc.{name}") is not None
                for name in ("verify_decls", "verify_ops", "verify_programs"))


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def verified(raw: dict) -> Verified:
    """The whole verifier when it exists (the fixtures must pass it), else parse only."""
    manifest = reader.from_raw(raw)
    if _VERIFIER:
        from kerncc.verify import verify
        return verify(manifest)
    return Verified(manifest)


def plain() -> dict:
    return fixture("plain")


def unchecked(raw: dict) -> Verified:
    return Verified(reader.from_raw(raw))


def diagnostics(raw: dict, sampled: bool = True) -> list:
    with pytest.raises(KernccError) as err:
        protocol.check(unchecked(raw), sampled)
    assert err.value.headline == HEADLINE
    return err.value.diagnostics


def messages(raw: dict, sampled: bool = True) -> list[str]:
    return [d.message for d in diagnostics(raw, sampled)]


def op(params: list[str]) -> dict:
    launch = {"module": "plain", "entry": "k", "block": [128, 1, 1], "grid": [1, 1, 1]}
    return {"params": params, "impl": {"launches": [launch]}}


def step_call(raw: dict) -> dict:
    return copy.deepcopy(raw["programs"]["decode"]["calls"][0])

# -------------------------------------------------------------------- variants of plain


def speculative() -> dict:
    """plain plus a speculative round: 4 rows per sequence, an anchor, per-row tokens, a count."""
    raw = fixture("plain")
    raw["buffers"].update({
        "anchor_token": {"dtype": "i64", "shape": ["seqs"], "kind": "input", "fill": "token"},
        "verify_tokens": {"dtype": "i64", "shape": ["seqs", 4], "kind": "output",
                          "fill": "tokens"},
        "nacc": {"dtype": "i32", "shape": ["seqs"], "kind": "output", "fill": "count"},
    })
    raw["ops"]["accept"] = op(["in buffer<i64>", "out buffer<i64>", "out buffer<i32>"])
    accept = {"op": "accept", "args": [{"buf": "anchor_token"}, {"buf": "verify_tokens"},
                                       {"buf": "nacc"}]}
    raw["programs"]["round"] = {"batch": {"groups": 2, "rows": 4}, "calls": [accept]}
    return raw


def spanned() -> dict:
    """plain plus a run: a `span` var, the `span_at` word, a decode step that may carry a run."""
    raw = fixture("plain")
    raw["vars"]["span"] = {"max": 6}
    raw["buffers"]["span_at"] = {"dtype": "i32", "shape": [1], "kind": "input",
                                 "fill": "span_at"}
    raw["ops"]["run_head"] = op(["in buffer<i32>", "out buffer<i64>"])
    run_head = {"op": "run_head", "args": [{"buf": "span_at"}, {"buf": "next_token"}]}
    raw["programs"]["decode_span"] = {"batch": {"groups": 4, "rows": 1, "span": "span"},
                                      "calls": [step_call(raw), run_head]}
    return raw


def with_context() -> dict:
    """plain whose prefill bounds the longest sequence after the call by `longest`."""
    raw = fixture("plain")
    raw["vars"]["longest"] = {"max": 64}
    raw["programs"]["prefill"]["batch"]["context"] = "longest"
    return raw


def legacy(raw: dict) -> dict:
    """The same manifest as written before V5.1: no var declares an axis."""
    for var in raw["vars"].values():
        var.pop("axis", None)
    return raw

# -------------------------------------------------------------------- the fixtures (§4.5)


def test_plain_contract():
    p = protocol.check(verified(fixture("plain")))
    assert (p.rows, p.groups, p.tray) == (Bound("tokens", 8), Bound("seqs", 4), None)
    assert p.any("cu_seqlens").axis == Fixed(5)
    assert p.page_tables == (PageTable("block_table", 3),)
    assert p.line_tables == (LineTable("line_index", lines=3, width=1, axis="groups"),)
    assert p.forwards == (Forward("decode", 1, 1, emits="next_token"),
                          Forward("decode_batch", 4, 1, emits="next_token"),
                          Forward("prefill", 1, VAR_ROWS))
    assert p.vars(3, 6, 6, 6) == {"tokens": 6, "seqs": 3}
    assert (p.once, p.derive, p.span, p.context) == ((), (), None, None)
    assert (p.axes_derived, p.note) == (False, None)


def test_tray_contract():
    p = protocol.check(verified(fixture("tray")))
    assert p.tray == Bound("rows", 32)
    assert p.token_rows() == Filled("token_ids", "token", "i64", "tray")
    assert p.line_tables[0].axis == "tray"
    assert p.any("error").name == "tp_err"
    assert p.any("blocks").axis == Fixed(5)
    assert p.once == ("tp_init",)
    assert p.vars(2, 2, 8, 9) == {"tokens": 2, "seqs": 2, "rows": 8}


def test_fills_are_in_name_order():
    p = protocol.check(verified(fixture("plain")))
    assert [f.name for f in p.fills] == ["cu_seqlens_q", "next_token", "positions", "seq_lens",
                                         "slot_mapping", "token_ids"]


def test_derive_programs_are_listed():
    raw = fixture("plain")
    raw["programs"]["prep"] = {"derive": True, "calls": []}
    raw["programs"]["init"] = {"once": True, "calls": []}
    p = protocol.check(unchecked(raw))
    assert (p.derive, p.once) == (("prep",), ("init",))

# -------------------------------------------------------------------- queries


def test_plain_queries():
    p = protocol.check(verified(fixture("plain")))
    assert p.forward(1, 1).name == "decode"
    assert p.forward(3, 1).name == "decode_batch"
    assert p.forward(5, 1) is None
    assert p.forward(1, 2) is None
    assert p.chunk().name == "prefill"
    assert p.spanned(1) is None
    assert (p.max_groups(1), p.max_groups(VAR_ROWS), p.max_groups(4)) == (4, 1, 0)
    assert p.filled("token", "rows").name == "token_ids"
    assert p.filled("token", "groups") is None
    assert p.token_rows().name == "token_ids"
    assert p.any("count") is None


def test_speculative_queries():
    p = protocol.check(verified(speculative()))
    round_ = next(f for f in p.forwards if f.name == "round")
    assert round_ == Forward("round", 2, 4, emits="verify_tokens", count="nacc")
    assert {f.name: f.width for f in p.fills}["verify_tokens"] == 4
    assert p.filled("token", "groups").name == "anchor_token"
    assert p.max_groups(4) == 2
    assert p.forward(2, 4).name == "round"


def test_span_queries():
    p = protocol.check(verified(spanned()))
    assert p.span == Bound("span", 6)
    assert p.any("span_at").axis == Fixed(1)
    assert p.spanned(3).name == "decode_span"
    assert p.spanned(5) is None
    assert p.forward(3, 1).name == "decode_batch"    # the span program is no plain shape
    assert p.max_groups(1) == 4


def test_context_goes_in_the_env():
    p = protocol.check(verified(with_context()))
    assert p.context == Bound("longest", 64)
    assert p.vars(1, 5, 5, 40) == {"tokens": 5, "seqs": 1, "longest": 40}


def test_token_rows_is_optional():
    raw = fixture("plain")
    del raw["buffers"]["token_ids"]["fill"]
    assert protocol.check(unchecked(raw)).token_rows() is None


def test_packed_prefill_is_split_by_cu_seqlens():
    raw = fixture("plain")
    raw["programs"]["prefill"]["batch"]["groups"] = 3
    p = protocol.check(verified(raw))
    assert (p.forward(2, VAR_ROWS).name, p.chunk().name) == ("prefill", "prefill")


def test_encoding_follows_the_dtype():
    p = protocol.check(verified(fixture("plain")))
    assert p.any("seq_len").encode([3, -1]) == bytes([3, 0, 0, 0, 255, 255, 255, 255])
    assert p.any("slot").encode([2]) == (2).to_bytes(8, "little")
    assert p.any("seq_len").decode(bytes([7, 0, 0, 0, 255, 255, 255, 255])) == [7, -1]

# -------------------------------------------------------------------- summary (§4.6)


def test_plain_summary():
    assert summary_lines(protocol.check(verified(fixture("plain")))) == [
        "  rows      `tokens` <= 8",
        "  groups    `seqs` <= 4",
        "  fill      cu_seqlens  `cu_seqlens_q` i32 [5]",
        "  fill      tokens      `next_token` i64 [seqs]",
        "  fill      position    `positions` i64 [tokens]",
        "  fill      seq_len     `seq_lens` i32 [seqs]",
        "  fill      slot        `slot_mapping` i64 [tokens]",
        "  fill      token       `token_ids` i64 [tokens]",
        "  pages     `block_table` [seqs, 3]",
        "  lines     `line_index` [3, seqs]",
        "  forward   `decode`: <= 1 sequences of 1 rows, hands back `next_token`",
        "  forward   `decode_batch`: <= 4 sequences of 1 rows, hands back `next_token`",
        "  forward   `prefill`: <= 1 sequences of rows as fed, state only",
    ]


def test_tray_summary():
    assert summary_lines(protocol.check(verified(fixture("tray")))) == [
        "  rows      `tokens` <= 8",
        "  groups    `seqs` <= 8",
        "  tray      `rows` <= 32",
        "  fill      tokens      `next_token` i64 [rows]",
        "  fill      seq_len     `seq_lens` i32 [seqs]",
        "  fill      slot        `slot_mapping` i64 [tokens]",
        "  fill      token       `token_ids` i64 [rows]",
        "  fill      blocks      `tp_blocks` i32 [5]",
        "  fill      error       `tp_err` i32 [1]",
        "  pages     `block_table` [seqs, 3]",
        "  lines     `kda.line_index` [3, rows]",
        "  forward   `decode`: <= 8 sequences of 1 rows, hands back `next_token`",
        "  once      `tp_init`",
    ]


def test_summary_wording_variants():
    lines = summary_lines(protocol.check(verified(speculative())))
    assert "  fill      tokens      `verify_tokens` i64 [seqs] x 4" in lines
    assert ("  forward   `round`: <= 2 sequences of 4 rows, hands back `verify_tokens` "
            "counted by `nacc`") in lines
    lines = summary_lines(protocol.check(verified(spanned())))
    assert ("  forward   `decode_span`: <= 4 sequences of 1 row, one of them a run of up to 6 "
            "(`span`), hands back `next_token`") in lines
    raw = fixture("plain")
    raw["buffers"]["line_index"]["shape"] = [3, "seqs", 2]
    assert "  lines     `line_index` [3, seqs, 2]" in summary_lines(protocol.check(unchecked(raw)))

# -------------------------------------------------------------------- axes derived (ARCH §8)


def test_legacy_axes_are_derived_from_fills():
    newest = protocol.check(verified(fixture("plain")))
    derived = protocol.check(verified(legacy(fixture("plain"))))
    assert derived.axes_derived and derived.note == protocol.DERIVED_NOTE
    assert derived == attrs.evolve(newest, axes_derived=True, note=protocol.DERIVED_NOTE)
    lines = summary_lines(derived)
    assert lines[2] == "  axes      derived from fills (no var declares an axis)"
    assert lines[:2] + lines[3:] == summary_lines(newest)


def test_legacy_tray_is_the_one_other_var():
    p = protocol.check(verified(legacy(fixture("tray"))))
    assert (p.rows, p.groups, p.tray) == (Bound("tokens", 8), Bound("seqs", 8), Bound("rows", 32))
    assert p.token_rows().axis == "tray"
    assert p.line_tables[0].axis == "tray"


def test_some_declared_axes_mean_the_newest_rules():
    raw = fixture("plain")
    del raw["vars"]["tokens"]["axis"]
    assert messages(raw) == ["no var has `axis: rows`"]


Mutation = Callable[[dict], None]


def _drop_fill(buffer: str) -> Mutation:
    return lambda raw: raw["buffers"][buffer].pop("fill")


def _shape(buffer: str, shape: list) -> Mutation:
    return lambda raw: raw["buffers"][buffer].update(shape=shape)


def _add(name: str, buffer: dict) -> Mutation:
    return lambda raw: raw["buffers"].update({name: buffer})


def _var(name: str, bound: int) -> Mutation:
    return lambda raw: raw["vars"].update({name: {"max": bound}})


def _all(*mutations: Mutation) -> Mutation:
    def mutate(raw: dict) -> None:
        for mutation in mutations:
            mutation(raw)
    return mutate


@pytest.mark.parametrize("mutate, expected", [
    (_all(_drop_fill("slot_mapping"), _drop_fill("seq_lens")),
     ["no var has `axis: rows` and no input has fill `slot` to derive it from",
      "no var has `axis: groups` and no input has fill `seq_len` to derive it from"]),
    (_shape("slot_mapping", [8]), ['`slot_mapping` (fill `slot`) is shaped [8], expected [<var>]']),
    (_shape("seq_lens", ["tokens"]),
     ["`slot` and `seq_len` are both over var `tokens`; rows and sequences need their own"]),
    (_add("slots2", {"dtype": "i64", "shape": ["tokens"], "kind": "input", "fill": "slot"}),
     ['fill `slot` is on 2 buffers (["slot_mapping", "slots2"]), expected one']),
    (_all(_var("other", 2), _var("rows", 32), _shape("next_token", ["other"]),
          _shape("token_ids", ["rows"])),
     [('fills and line tables span 2 vars besides rows and sequences (["other", "rows"]), '
      'at most one names the tray batch')]),
])
def test_legacy_derivation_errors(mutate, expected):
    raw = legacy(fixture("plain"))
    mutate(raw)
    assert messages(raw) == expected

# -------------------------------------------------------------------- every message of §4


def test_missing_axes_are_both_named():
    raw = fixture("plain")
    raw["vars"]["tokens"]["axis"] = "tray"
    del raw["vars"]["seqs"]["axis"]
    found = diagnostics(raw)
    assert [d.message for d in found] == ["no var has `axis: rows`", "no var has `axis: groups`"]
    assert {d.location.pointer for d in found} == {"/vars"}


def _i(kind: str, shape: list, fill: str, dtype: str = "i32") -> dict:
    return {"dtype": dtype, "shape": shape, "kind": kind, "fill": fill}


EXPECT_TOKEN = "expected [rows], [tray] (one per row) or [groups] (each sequence's first)"


@pytest.mark.parametrize("mutate, expected, where", [
    (_all(_var("other", 8), _shape("positions", ["other"])),
     "fill `position` `positions` is over var `other`, which counts no axis",
     "/buffers/positions/shape/0"),
    (_shape("positions", ["tokens", "seqs"]),
     ('`positions` (fill `position`) is shaped ["tokens", "seqs"], '
     'expected [<axis>], [<n>] or [<axis>, w]'), "/buffers/positions/shape"),
    (_shape("token_ids", ["tokens", 2]),
     f'`token_ids` (fill `token`) is shaped ["tokens", 2]: {EXPECT_TOKEN}',
     "/buffers/token_ids/shape"),
    (_shape("positions", ["seqs"]), ('`positions` (fill `position`) is shaped ["seqs"]: '
     "expected [rows]"), "/buffers/positions/shape"),
    (_add("valid_rows", _i("input", ["seqs"], "valid")),
     '`valid_rows` (fill `valid`) is shaped ["seqs"]: expected [rows]',
     "/buffers/valid_rows/shape"),
    (_shape("slot_mapping", [8]), "`slot_mapping` (fill `slot`) is shaped [8]: expected [rows]",
     "/buffers/slot_mapping/shape"),
    (_shape("seq_lens", ["tokens"]), ('`seq_lens` (fill `seq_len`) is shaped ["tokens"]: '
     "expected [groups]"), "/buffers/seq_lens/shape"),
    (_add("nacc", _i("output", ["seqs", 2], "count")),
     '`nacc` (fill `count`) is shaped ["seqs", 2]: expected [groups]', "/buffers/nacc/shape"),
    (_shape("cu_seqlens_q", [4]), ("`cu_seqlens_q` (fill `cu_seqlens`) is shaped [4]: "
     "expected [n] with n >= groups + 1"), "/buffers/cu_seqlens_q/shape"),
    (_shape("next_token", ["tokens"]), ('`next_token` (fill `tokens`) is shaped ["tokens"]: '
     "expected [groups], [groups, w] or [tray]"), "/buffers/next_token/shape"),
    (_add("span_at", _i("input", [2], "span_at")),
     "`span_at` (fill `span_at`) is shaped [2]: expected i32 [1]", "/buffers/span_at/shape"),
    (_add("err", _i("output", [1], "error", "i64")),
     "`err` (fill `error`) is shaped [1]: expected i32 [1]", "/buffers/err/shape"),
    (_add("blocks", _i("input", [1], "blocks")),
     "`blocks` (fill `blocks`) is shaped [1]: expected i32 [members + 1]",
     "/buffers/blocks/shape"),
    (_add("token_ids2", _i("input", ["tokens"], "token", "i64")),
     "fill `token` over Rows is on 2 buffers, expected one", "/buffers/token_ids2/fill"),
    (_all(_add("anchor_a", _i("input", ["seqs"], "token")),
          _add("anchor_b", _i("input", ["seqs"], "token"))),
     "fill `token` over the sequences is on more than one buffer", "/buffers/anchor_b/fill"),
    (_add("tp_blocks", _i("input", [5], "blocks")),
     "fill `blocks` without a var naming the tray batch", "/buffers/tp_blocks/fill"),
    (lambda raw: raw["buffers"]["block_table"].update(dtype="i64"),
     "table `block_table` is i64, the runtime hands out i32 page and line indices",
     "/buffers/block_table/dtype"),
    (_shape("line_index", [3, "tokens"]),
     "line table `line_index` has a column per row (`tokens`); lines are per sequence",
     "/buffers/line_index/shape/1"),
    (_shape("line_index", ["seqs", 3]), ('line table `line_index` is shaped ["seqs", 3], '
     "expected [lines, <groups|tray>] or [lines, <groups|tray>, w]"),
     "/buffers/line_index/shape"),
    (_all(_var("other", 8), _shape("line_index", [3, "other"])),
     "line table `line_index` is over var `other`, which counts no axis",
     "/buffers/line_index/shape/1"),
    (_shape("block_table", ["seqs"]),
     'page table `block_table` is shaped ["seqs"], expected [<groups>, n]',
     "/buffers/block_table/shape"),
])
def test_layout_messages(mutate, expected, where):
    raw = fixture("plain")
    mutate(raw)
    found = [d for d in diagnostics(raw) if d.message == expected]
    assert found, messages(raw)
    assert found[0].location.pointer == where


def test_token_over_the_tray_is_on_one_buffer():
    raw = fixture("tray")
    raw["buffers"]["token_ids2"] = _i("input", ["rows"], "token", "i64")
    assert messages(raw) == ["fill `token` over Tray is on 2 buffers, expected one"]


@pytest.mark.parametrize("fill", ["position", "valid", "cu_seqlens", "span_at", "blocks",
                                  "count", "error"])
def test_single_role_fills_sit_on_one_buffer(fill):
    raw = fixture("tray")
    for name in ("extra_a", "extra_b"):
        raw["buffers"][name] = _i("input", [1], fill)
    found = [d for d in diagnostics(raw) if d.message == f"fill `{fill}` is on more than one buffer"]
    assert [d.location.pointer for d in found] == ["/buffers/extra_b/fill"]


def _batch(program: str, **fields) -> Mutation:
    return lambda raw: raw["programs"][program]["batch"].update(fields)


def _drop_batch(program: str) -> Mutation:
    return lambda raw: raw["programs"][program].pop("batch")


def _drop_heads(raw: dict) -> None:
    for name in ("decode", "decode_batch"):
        raw["programs"][name]["calls"] = raw["programs"][name]["calls"][:1]


def _accept_in_decode(buffers: list[str]) -> Mutation:
    def mutate(raw: dict) -> None:
        args = [{"buf": b} for b in buffers]
        raw["programs"]["decode"]["calls"].append({"op": "accept", "args": args})
    return mutate


@pytest.mark.parametrize("base, mutate, expected, where", [
    (plain, _batch("decode_batch", rows=3),
     "program `decode_batch`: 4 sequences of 3 rows exceed the 8 rows `tokens` allows",
     "/programs/decode_batch/batch/rows"),
    (plain, _batch("prefill", rows="seqs"),
     "program `prefill`: batch.rows is var `seqs`, but the rows of a call go in `tokens`",
     "/programs/prefill/batch/rows"),
    (plain, _all(_batch("prefill", groups=2), _drop_fill("cu_seqlens_q")),
     ("program `prefill`: a call of 2 sequences with rows set per call needs a `cu_seqlens` "
     "fill to split them"), "/programs/prefill/batch/groups"),
    (plain, _batch("decode_batch", groups=5),
     "program `decode_batch`: 5 groups exceed the 4 `seqs` allows",
     "/programs/decode_batch/batch/groups"),
    (spanned, _batch("decode_span", rows=4),
     "program `decode_span`: a span rides a call of one row per sequence, not `4`",
     "/programs/decode_span/batch/span"),
    (spanned, _batch("decode_span", span="tokens"),
     ("program `decode_span`: batch.span is `tokens`, which sizes the call itself; "
     "a run needs its own var"), "/programs/decode_span/batch/span"),
    (spanned, lambda raw: raw["vars"]["span"].update(max=9),
     "program `decode_span`: a run of 9 rows (`span`) exceeds the 8 rows `tokens` allows",
     "/programs/decode_span/batch/span"),
    (spanned, _batch("decode_span", span="nope"),
     "program `decode_span`: batch.span names unknown var `nope`",
     "/programs/decode_span/batch/span"),
    (spanned, _all(_var("other", 2), _batch("decode", span="other")),
     ("program `decode_span`: batch.span is `span`, but `other` sizes a run in another "
     "program; one var sizes every run"), "/programs/decode_span/batch/span"),
    (spanned, _drop_fill("span_at"),
     "a program takes a run of rows (batch.span) but no input has fill `span_at`",
     "/programs/decode_span/batch/span"),
    (plain, _batch("prefill", context="tokens"),
     ("program `prefill`: batch.context is `tokens`, which sizes the call itself; "
     "the context needs its own var"), "/programs/prefill/batch/context"),
    (spanned, _batch("prefill", context="span"),
     ("program `prefill`: batch.context is `span`, which sizes the call itself; "
     "the context needs its own var"), "/programs/prefill/batch/context"),
    (with_context, _all(_var("other", 64), _batch("decode", context="other")),
     ("program `prefill`: batch.context is `longest`, but `other` bounds the context in "
     "another program; one var bounds every context"), "/programs/prefill/batch/context"),
    (speculative, _accept_in_decode(["anchor_token", "verify_tokens", "nacc"]),
     ('program `decode`: writes 2 `tokens` outputs (["next_token", "verify_tokens"]); '
     "a call hands back one"), "/programs/decode/calls"),
    (speculative, _batch("round", rows=3),
     ("program `round`: hands back `verify_tokens` of 4 per sequence, but a call has 3 rows "
     "per sequence"), "/programs/round/batch/rows"),
    (speculative, _batch("round", rows="tokens", groups=1),
     ("program `round`: hands back `verify_tokens` of 4 per sequence, but a call has a "
     "variable number of rows per sequence"), "/programs/round/batch/rows"),
    (speculative, _accept_in_decode(["anchor_token", "next_token", "nacc"]),
     ("program `decode`: writes `nacc` (fill `count`) but no `tokens` output of several per "
     "sequence to count"), "/programs/decode/calls"),
    (plain, _batch("decode_batch", groups=1),
     ("program `decode_batch` and `decode` accept the same call shape; "
     "a shape names one program"), "/programs/decode_batch/batch"),
    (plain, _all(*(_drop_batch(name) for name in ("decode", "decode_batch", "prefill"))),
     "no program declares a `batch`: nothing for a serving loop to drive", "/programs"),
    (plain, _drop_heads,
     "no program with a `batch` writes a `tokens` output: no call hands a token back",
     "/programs"),
])
def test_forward_messages(base, mutate, expected, where):
    raw = base()
    mutate(raw)
    found = [d for d in diagnostics(raw) if d.message == expected]
    assert found, messages(raw)
    assert found[0].location.pointer == where


def test_unsampled_needs_no_token_back():
    raw = fixture("plain")
    del raw["buffers"]["next_token"]["fill"]     # host-sampled: the head writes logits
    manifest = verified(raw)
    with pytest.raises(KernccError, match="no call hands a token back"):
        protocol.check(manifest)
    p = protocol.check_unsampled(manifest)
    assert all(f.emits is None for f in p.forwards)


def test_errors_are_collected_and_displayed_together():
    raw = fixture("plain")
    raw["buffers"]["block_table"]["dtype"] = "i64"
    raw["programs"]["decode_batch"]["batch"]["groups"] = 5
    with pytest.raises(KernccError) as err:
        protocol.check(unchecked(raw))
    assert str(err.value).splitlines() == [
        HEADLINE,
        ("  - /buffers/block_table/dtype: table `block_table` is i64, the runtime hands out i32 "
        "page and line indices"),
        ("  - /programs/decode_batch/batch/groups: program `decode_batch`: 5 groups exceed the "
        "4 `seqs` allows"),
    ]


def test_only_a_verified_manifest_is_read():
    with pytest.raises(TypeError):
        protocol.check(reader.from_raw(fixture("plain")))
