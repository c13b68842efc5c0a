"""kerncc.kir: lossless round trips (properties over random manifests), the locator, errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kerncc import kir, source
from kerncc.manifest import writer
from kerncc.manifest import reader
from kerncc import manifest as m
from kerncc.diagnostics import KernccError
from kerncc.kir.parse import DECLARATIONS, FLAGS, keywords
from tests.random_manifests import examples

ROOT = Path(__file__).resolve().parents[1]

# Every construct of the format, written by hand (directions, bare args, comments, spacing).
KITCHEN_SINK = textwrap.dedent("""\
    // everything kir can say
    schema_version 5
    model "kitchen sink"
    topology tp=2 "pp group"=4
    cut id="c0ffee" stage=0 stages=2

    var seqs max=4 axis=groups
    var tokens max=8 axis=rows
    var plain max=3

    state conv bytes_per_seq=1024
    state host_kv host={dtype=bf16, shape=[0, 16, 8], strides=[256, 16, 2]}
    state kv bytes_per_token=64
    state table bytes=4096

    buffer addrs u64[2] peer of=x group=tp
    buffer block_table i32[seqs, 3] input domain={index_into=kv, stride=16}
    buffer ids i32[tokens] input fill=token domain={min=0, max=tokens ceildiv 2 + 1, monotone}
    buffer scale f32[1] input domain={min=-1.5, max=2.5e-05}
    buffer src bf16[64] source {
      bind model.layers.0.src
    }
    buffer w bf16[64, 64] weight placement=host {
      bind "model.layers.18.qkv.weight" rows=[0, 32) cols=[0, 64)
      bind model.b rows=per tp [[0, 16), [16, 32)] cols=per tp [[0, 8), [8, 16)]
      bind per tp [w.0, w.1] interleave={with=per tp [u.0, u.1], rows=8}
      bind gate interleave={with=up, rows=4}
    }
    buffer x bf16[tokens, 64] inout export
    buffer y i32[seqs] output fill=tokens

    module attn source="hf:org/repo/attn.cubin@v1" sha256="00ff"

    op attn(in buffer<bf16>, inout state, out buffer<bf16>, i32, i64, f32, u8) {
      scratch tmp f32[tokens, 64]
      launch attn_k module=attn block=[128, 1, 1] grid=[tokens * 2 + (seqs + 1), 1, 1] shared_mem=tokens * 64 cluster=[2, 1, 1] pdl when={var=tokens, min=1, max=64}
      launch attn_k2 module=attn params=(in buffer<bf16>, bytes<200>, i32) block=[64, 1, 1] grid=[1, 1, 1] pdl=false args=(%0, pack 200 {
          @0 %0
          @8 width=8 scratch tmp
          @16 i32 -5
          @20 i64 7
          @28 f32 0.5
          @32 u8 3
          @36 var tokens
          @40 expr tokens ceildiv 16
          @44 rank tp
          @64 tensormap %0 dtype=bf16 dims=[64, 0] strides=[128] box=[64, 16] swizzle=128 l2_promotion=256 oob_nan wrap
        }, i32 9)
      launch extern:cublaslt_bf16_tn params=(in buffer<bf16>) when={var=seqs} algo={id=1, tile=20, stages=4, split_k=1, reduction=0, swizzle=0, custom=0, inner_shape=0, cluster_shape=0} args=(scratch tmp, rank tp, f32 1.0, i64 -1, u8 0)
      launch extern:nccl_allreduce_bf16 args=()
    }
    op copy(in buffer<bf16>, out buffer<bf16>) {}

    program decode batch={groups=2, rows=1, span=plain, context=seqs} graph {
      #0 l0.attn = attn(in x, inout kv@64, out x, tokens, 6144, 1.5, 7)
      #1 attn(buf x@0, state kv, x, var plain, i64 -3, f32 2.0, u8 1)
      attn(x, host_kv, x, tokens * 2, expr 5, expr tokens, rank tp)
      "odd label" = copy(in x, out y)
      nowhere(x@8, var tokens, i32 1, rank tp, state s@16, expr plain + 1)
    }
    program derive_w derive {
      #0 copy(src, w)
    }
    program init once {}
""")


def _round_trip_ok(man: m.Manifest) -> None:
    text = kir.dumps(man)
    back = kir.loads(text)
    assert writer.dumps(back) == writer.dumps(man)
    assert kir.dumps(back) == text

# ---------------------------------------------------------------------------- examples


def test_minimal_example_round_trips() -> None:
    man = m.load(str(ROOT / "examples" / "minimal.json"))
    _round_trip_ok(man)
    assert "#0 step = step(in token_ids, in slots, in seq_lens, in block_table, inout kv, " \
           "out next_token, tokens)" in kir.dumps(man)


def test_kitchen_sink_round_trips_through_json() -> None:
    man = kir.loads(KITCHEN_SINK)
    _round_trip_ok(man)
    assert writer.dumps(reader.loads(writer.dumps(man))) == writer.dumps(man)


def test_kitchen_sink_reads_what_it_says() -> None:
    raw = writer.to_raw(kir.loads(KITCHEN_SINK))
    calls = raw["programs"]["decode"]["calls"]
    assert calls[0] == {"label": "l0.attn", "op": "attn", "args": [
        {"buf": "x"}, {"state": "kv", "offset": 64}, {"buf": "x"}, {"var": "tokens"},
        {"i64": 6144}, {"f32": 1.5}, {"u8": 7}]}
    assert calls[2]["args"][3:6] == [{"expr": {"mul": ["tokens", 2]}}, {"expr": 5},
                                     {"expr": "tokens"}]
    assert calls[4]["args"][0] == {"buf": "x", "offset": 8}  # an undeclared op: names are buffers
    launches = raw["ops"]["attn"]["impl"]["launches"]
    assert launches[0]["pdl"] is True and launches[1]["pdl"] is False
    assert "args" not in launches[0] and launches[3]["args"] == []
    assert launches[1]["args"][1]["pack"]["fields"][1] == {"at": 8, "width": 8, "scratch": "tmp"}
    assert raw["buffers"]["w"]["bind"][2] == {
        "tensor": {"group": "tp", "tensors": ["w.0", "w.1"]},
        "interleave": {"with": {"group": "tp", "tensors": ["u.0", "u.1"]}, "rows": 8}}
    assert raw["buffers"]["scale"]["domain"] == {"min": -1.5, "max": 2.5e-05}
    assert raw["topology"] == {"groups": {"pp group": 4, "tp": 2}}


def test_json_spellings_and_implicit_forms_are_accepted() -> None:
    text = ('schema_version 5 model m buffer x bf16[4] weight {bind t rows=[0, 4]}\n'
            'op f(in buffer<bf16>) {} program p {f(buf x) f(in x)}')
    raw = writer.to_raw(kir.loads(text))
    assert raw["buffers"]["x"]["bind"] == [{"tensor": "t", "rows": [0, 4]}]
    assert [c["args"] for c in raw["programs"]["p"]["calls"]] == [[{"buf": "x"}]] * 2


def test_names_that_spell_keywords_are_quoted() -> None:
    raw = writer.to_raw(kir.loads(KITCHEN_SINK))
    raw["buffers"]["in"] = raw["buffers"].pop("x")
    raw["vars"]["i32"] = raw["vars"].pop("plain")
    raw["programs"]["decode"]["calls"][1]["args"][0]["buf"] = "in"
    raw["programs"]["decode"]["calls"][1]["args"][3]["var"] = "i32"
    text = kir.dumps(reader.from_raw(raw))
    assert 'buffer "in" bf16[tokens, 64] inout export' in text
    assert '#1 attn(in "in"@0, inout kv, out x, "i32", -3, 2.0, 1)' in text
    _round_trip_ok(reader.from_raw(raw))


def test_the_keyword_sets_follow_the_grammar() -> None:
    assert DECLARATIONS | FLAGS <= keywords()
    assert {"in", "out", "inout", "i32", "per", "true", "ceildiv"} <= keywords()


def test_load_reads_kir_files(tmp_path: Path) -> None:
    path = tmp_path / "k.kir"
    path.write_text(KITCHEN_SINK)
    man, locate = source.load_with_locator(path)  # kerncc.source reads .kir and .json
    assert writer.dumps(man) == writer.dumps(kir.loads(KITCHEN_SINK))
    assert locate("/buffers/x").file == str(path)

# ---------------------------------------------------------------------------- the locator


def _line_col(text: str, needle: str, nth: int = 0) -> tuple[int, int]:
    at = -1
    for _ in range(nth + 1):
        at = text.index(needle, at + 1)
    line = text.count("\n", 0, at) + 1
    return line, at - (text.rfind("\n", 0, at) + 1) + 1


@pytest.mark.parametrize("ptr, needle, nth", [
    ("/programs/decode/calls/0/args/1", "inout kv@64", 0),
    ("/programs/decode/calls/0/args/1/offset", "@64, out", 0),
    ("/programs/decode/calls/0/label", "l0.attn", 0),
    ("/programs/decode/calls/3", '"odd label" =', 0),
    ("/programs/decode/calls/3/op", "copy(in x", 0),
    ("/buffers/x/shape", "[tokens, 64] inout", 0),
    ("/buffers/x/shape/1", "64] inout", 0),
    ("/buffers/x/kind", "inout export", 0),
    ("/buffers/ids/domain/max/add/0/ceil_div/1", "2 + 1", 0),
    ("/buffers/w/bind/1/cols/group", "tp [[0, 8)", 0),
    ("/ops/attn/params/3", "i32, i64", 0),
    ("/ops/attn/impl/scratch/tmp", "tmp f32", 0),
    ("/ops/attn/impl/launches/0/grid/0/add/1/add/0", "seqs + 1", 0),
    ("/ops/attn/impl/launches/1/args/1/pack/fields/9/tensormap/box/1", "16] swizzle", 0),
    ("/vars/tokens/max", "max=8", 0),
    ("/topology/groups/pp group", '"pp group"', 0),
])
def test_locate_points_at_the_text(ptr: str, needle: str, nth: int) -> None:
    _, locate = kir.loads_with_locator(KITCHEN_SINK, "k.kir")
    loc = locate(ptr)
    assert (loc.line, loc.column) == _line_col(KITCHEN_SINK, needle, nth)
    assert loc.pointer == ptr and loc.file == "k.kir"


def test_locate_falls_back_to_the_nearest_written_parent() -> None:
    _, locate = kir.loads_with_locator(KITCHEN_SINK)
    shape = locate("/buffers/x/shape")
    assert (locate("/buffers/x/shape/9").line, locate("/buffers/x/shape/9").column) == \
        (shape.line, shape.column)
    assert locate("/programs/decode/calls/1/args/0/nothing").line == \
        _line_col(KITCHEN_SINK, "#1 attn")[0]
    assert (locate("/nowhere").line, locate("/nowhere").column) == (1, 1)


def test_verifier_pointers_land_on_kir_lines() -> None:
    from kerncc.verify import verify

    man, locate = kir.loads_with_locator(KITCHEN_SINK, "k.kir")
    with pytest.raises(KernccError) as info:
        verify(man)
    located = info.value.located(locate)
    unknown = [d for d in located.diagnostics if "unknown op `nowhere`" in d.message]
    assert unknown and unknown[0].location.line == _line_col(KITCHEN_SINK, "nowhere(")[0]

# ---------------------------------------------------------------------------- errors


def _error(text: str) -> str:
    with pytest.raises(KernccError) as info:
        kir.loads(text, "m.kir")
    return str(info.value)


HEAD = 'schema_version 5\nmodel "m"\n'


def test_syntax_error_bad_bracket() -> None:
    assert _error(HEAD + "buffer x bf16[4) input\n") == textwrap.dedent("""\
        manifest failed to parse:
          - m.kir:3:16: unexpected ')'; expected ',' or ']'
            buffer x bf16[4) input
                           ^""")


def test_syntax_error_missing_value() -> None:
    assert _error(HEAD + "buffer x bf16[4] input domain={min=}\n") == textwrap.dedent("""\
        manifest failed to parse:
          - m.kir:3:36: unexpected '}'; expected a name, a number, '(', '[', 'false', 'per', 'true' or '{'
            buffer x bf16[4] input domain={min=}
                                               ^""")


def test_syntax_error_misspelt_declaration() -> None:
    assert _error(HEAD + "var x max=4\nbuffr y f32[4] input\n") == textwrap.dedent("""\
        manifest failed to parse:
          - m.kir:4:7: unexpected name `y`; expected '='
            buffr y f32[4] input
                  ^""")


def test_syntax_error_launch_arg_needs_its_type() -> None:
    text = HEAD + "op f(i32) {\n\tlaunch k module=m block=[1, 1, 1] grid=[1, 1, 1] args=(%0, 5)\n}\n"
    assert _error(text) == textwrap.dedent("""\
        manifest failed to parse:
          - m.kir:4:61: unexpected number `5`; expected an interface param (`%0`), 'f32', 'i32', 'i64', 'pack', 'rank', 'scratch' or 'u8'
            \tlaunch k module=m block=[1, 1, 1] grid=[1, 1, 1] args=(%0, 5)
            \t                                                           ^""")


def test_syntax_error_unexpected_character() -> None:
    assert _error(HEAD + "var x max=4 !\n") == textwrap.dedent("""\
        manifest failed to parse:
          - m.kir:3:13: unexpected character `!`; expected a name, a declaration, a flag, '*', '+', 'ceildiv' or end of input
            var x max=4 !
                        ^""")


def test_syntax_error_end_of_input() -> None:
    assert _error(HEAD + "buffer x bf16[4] weight {\n") == textwrap.dedent("""\
        manifest failed to parse:
          - m.kir:3:26: unexpected end of input; expected 'bind' or '}'
            buffer x bf16[4] weight {
                                     ^""")


def test_syntax_error_multiplying_by_a_var() -> None:
    assert _error(HEAD + "op f() {\n  launch k grid=[a * b]\n}\n") == textwrap.dedent("""\
        manifest failed to parse:
          - m.kir:4:22: unexpected name `b`; expected a number
              launch k grid=[a * b]
                                 ^""")


def test_build_errors_are_located() -> None:
    text = HEAD + textwrap.dedent("""\
        var x max=4
        var x max=5
        var z max=3 max=4
        op f(in buffer<bf16>, in state, i32) {}
        program p {
          #1 f(out b, in s, in 5)
          g(5)
          f(b, s, tokens@4)
          f(b, s, "bad\\q")
        }
    """)
    assert _error(text) == textwrap.dedent("""\
        manifest failed to parse:
          - m.kir:4:5: /vars/x: duplicate name `x`
          - m.kir:5:13: /vars/z/max: duplicate name `max`
          - m.kir:8:3: /programs/p/calls/0: call #1 of program `p` is its call #0
          - m.kir:8:8: /programs/p/calls/0/args/0: direction `out` disagrees with the op: param #0 of op `f` is `in buffer<bf16>`
          - m.kir:8:21: /programs/p/calls/0/args/2: `in` is a direction, but param #2 of op `f` is `i32`
          - m.kir:9:5: /programs/p/calls/1/args/0: the kind of this arg is unclear: op `g` is not declared; write it (`buf`, `state`, `var`, `expr`, `i32`, `i64`, `f32`, `u8` or `rank`)
          - m.kir:10:11: /programs/p/calls/2/args/2: an offset (`@4`) follows only a buffer or a state; param #2 of op `f` is `i32`
          - m.kir:11:11: invalid string: invalid \\escape""")


def test_reader_errors_are_located_in_kir() -> None:
    # kern's reader gives up on an object at its first bad field: one error per object
    text = HEAD + ("buffer x bf17[4] input\nbuffer y bf16[4] input frob=3\nvar v max=-1\n"
                   "op f(inn state, bytes<0>) {}\nop g() {\n  launch k block=[1, 1, 1]\n}\n")
    assert _error(text) == textwrap.dedent("""\
        manifest failed to parse:
          - m.kir:3:10: /buffers/x/dtype: unknown variant `bf17`, expected one of `bf16`, `f16`, `f32`, `fp8e4m3`, `fp8e8m0`, `i8`, `i32`, `u32`, `i64`, `u64`, `u8`
          - m.kir:4:24: /buffers/y/frob: unknown field `frob`, expected one of `dtype`, `shape`, `kind`, `placement`, `fill`, `domain`, `export`, `of`, `group`, `bind`
          - m.kir:5:7: /vars/v/max: invalid value: integer `-1`, expected u64
          - m.kir:6:6: /ops/f/params/0: invalid direction `inn` in param type `inn state`
          - m.kir:6:17: /ops/f/params/1: invalid byte count in param type `bytes<0>`
          - m.kir:8:3: /ops/g/impl/launches/0: data did not match any variant of untagged enum Launch (missing field `module`; unknown field `block`, expected one of `entry`, `params`, `when`, `algo`, `args`)""")

# ---------------------------------------------------------------------------- properties

_KEYWORDS = sorted(keywords())
_ODD_NAMES = ["", "a b", "18.qkv", 'q"uote', "back\\slash", "ünï", "a//b", "a/", "%0", "#1",
              "@x", "tab\there", "new\nline", "model.layers.18.qkv.weight", "l18.qkv_proj",
              "x-y", "a/b", "x:y", "extern:cublaslt_bf16_tn", "hf:org/repo/f.cubin@main"]
names = st.one_of(st.from_regex(r"[a-z_][a-z0-9_]{0,4}", fullmatch=True),
                  st.sampled_from(_KEYWORDS), st.sampled_from(_ODD_NAMES),
                  st.text(max_size=4))
texts = st.one_of(names, st.text(max_size=12))


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(max(lo, 0), min(hi, 300)), st.sampled_from([lo, hi]),
                     st.integers(lo, hi))


u8, u16, u32 = _ints(0, 255), _ints(0, 2**16 - 1), _ints(0, 2**32 - 1)
u64, i32, i64 = _ints(0, 2**64 - 1), _ints(-2**31, 2**31 - 1), _ints(-2**63, 2**63 - 1)
floats = st.floats(allow_nan=False, allow_infinity=False)


def _opt(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.none(), strategy)


def _either(*strategies: st.SearchStrategy) -> st.SearchStrategy:
    """One of the strategies, each as likely (`one_of` weighs the branches of nested ones)."""
    return st.sampled_from(strategies).flatmap(lambda chosen: chosen)


def _tuple(strategy: st.SearchStrategy, max_size: int = 3) -> st.SearchStrategy[tuple]:
    return st.lists(strategy, max_size=max_size).map(tuple)


def _map(strategy: st.SearchStrategy, max_size: int = 3) -> st.SearchStrategy[dict]:
    return st.dictionaries(names, strategy, max_size=max_size)


exprs = st.recursive(st.one_of(u64, names), lambda inner: st.one_of(
    st.builds(m.Add, inner, inner), st.builds(m.Mul, inner, u64),
    st.builds(m.CeilDiv, inner, u64)), max_leaves=5)
compound = exprs.filter(lambda e: isinstance(e, (m.Add, m.Mul, m.CeilDiv)))
bounds = st.one_of(i64, floats, names, compound)
dims = st.one_of(u64, names)
dtypes = st.sampled_from(sorted(m.DTYPE_SIZES))
three = st.tuples(u32, u32, u32)

tensor_sources = st.one_of(names, st.builds(m.Ranked, names, _tuple(names)))
pairs = st.tuples(u64, u64)
ranges = st.one_of(pairs, st.builds(m.Ranked, names, _tuple(pairs)))
segments = st.builds(m.Segment, tensor_sources, _opt(ranges), _opt(ranges),
                     _opt(st.builds(m.Interleave, tensor_sources, u64)))
domains = st.builds(m.Domain, _opt(bounds), _opt(bounds), _opt(names), u64, st.booleans())
buffers = st.builds(m.Buffer, dtypes, _tuple(dims), st.sampled_from(m.BUFFER_KINDS),
                    st.sampled_from(["device", "host"]), _opt(st.sampled_from(m.FILLS)),
                    _opt(domains), st.booleans(), _opt(names), _opt(names), _tuple(segments, 2))
states = st.builds(m.State, u64, u64, u64,
                   _opt(st.builds(m.HostLayout, dtypes, _tuple(u64), _tuple(u64))))

param_types = st.one_of(
    st.builds(m.ParamType, st.just("scalar"), scalar=st.sampled_from(m.SCALAR_TYPES)),
    st.builds(m.ParamType, st.just("bytes"), size=st.integers(1, 2**32)),
    st.builds(m.ParamType, st.just("state"), direction=st.sampled_from(m.DIRECTIONS)),
    st.builds(m.ParamType, st.just("buffer"), direction=st.sampled_from(m.DIRECTIONS),
              dtype=dtypes))
literal_of = {t: st.builds(m.Literal, st.just(t), values)
              for t, values in (("i32", i32), ("i64", i64), ("u8", u8), ("f32", floats))}
literals = _either(*literal_of.values())
tensormaps = st.builds(m.TensorMap, u64, st.sampled_from(sorted(m.TENSORMAP_DTYPE_BITS)),
                       _tuple(u64), _tuple(u32), _tuple(u64), u32, u32, st.booleans(),
                       st.booleans())
field_sources = st.one_of(st.builds(m.ParamRef, u64), st.builds(m.ScratchRef, names), literals,
                          st.builds(m.VarArg, names), st.builds(m.ExprArg, exprs),
                          st.builds(m.RankArg, names), tensormaps)
packs = st.builds(m.Pack, u32, _tuple(st.builds(m.Field, u32, field_sources, _opt(u32))))
launch_args = st.one_of(st.builds(m.ParamRef, u64), st.builds(m.ScratchRef, names), literals,
                        st.builds(m.RankArg, names), packs)
whens = st.builds(m.When, names, _opt(u64), _opt(u64))
algos = st.builds(m.GemmAlgo, i32, u32, u32, i32, u32, u32, u32, u16, u16)
kernel_launches = st.builds(m.KernelLaunch, names, names, three, st.tuples(exprs, exprs, exprs),
                            _opt(_tuple(param_types)), _opt(exprs), _opt(three),
                            _opt(st.booleans()), _opt(whens), _opt(_tuple(launch_args)))
extern_entries = st.one_of(names, st.sampled_from(["extern:cublaslt_bf16_tn", "extern:x"]))
extern_launches = st.builds(m.ExternLaunch, extern_entries, _opt(_tuple(param_types)),
                            _opt(whens), _opt(algos), _opt(_tuple(launch_args)))
ops = st.builds(m.Op, _tuple(param_types, 5),
                _tuple(st.one_of(kernel_launches, extern_launches), 3),
                _map(st.builds(m.Scratch, dtypes, _tuple(dims))))

any_call_arg = _either(st.builds(m.BufArg, names, _opt(u64)),
                         st.builds(m.StateArg, names, _opt(u64)),
                         st.builds(m.VarArg, names), st.builds(m.ExprArg, exprs), literals,
                         st.builds(m.RankArg, names))


def _fitting_arg(param: m.ParamType) -> st.SearchStrategy:
    """Mostly args of the param's own kind, so that the bare forms get printed."""
    if param.kind == "buffer":
        fits = st.builds(m.BufArg, names, _opt(u64))
    elif param.kind == "state":
        fits = st.builds(m.StateArg, names, _opt(u64))
    elif param.kind == "scalar":
        fits = _either(literal_of[param.scalar],
                       st.builds(m.VarArg, names), st.builds(m.ExprArg, exprs))
    else:
        fits = any_call_arg
    return _either(fits, fits, any_call_arg)


@st.composite
def calls(draw: st.DrawFn, op_table: dict[str, m.Op]) -> m.Call:
    op_name = draw(st.one_of(st.sampled_from(sorted(op_table)), names)
                   if op_table else names)
    params = op_table[op_name].params if op_name in op_table else ()
    args = [draw(_fitting_arg(p)) for p in params]
    args = draw(st.sampled_from([args, args, args[:-1], args + [draw(any_call_arg)]]))
    return m.Call(op_name, tuple(args), draw(_opt(names)))


@st.composite
def manifests(draw: st.DrawFn) -> m.Manifest:
    op_table = draw(_map(ops))
    batches = st.builds(m.Batch, u64, dims, _opt(names), _opt(names))
    programs = _map(st.builds(m.Program, _tuple(calls(op_table), 4), _opt(batches),
                              st.booleans(), st.booleans(), st.booleans()))
    return m.Manifest(
        schema_version=draw(st.one_of(st.just(5), u32)), model=draw(texts),
        buffers=draw(_map(buffers)), ops=op_table, programs=draw(programs),
        modules=draw(_map(st.builds(m.Module, texts, texts))),
        topology=draw(_opt(_map(u64))), cut=draw(_opt(st.builds(m.Cut, texts, u64, u64))),
        vars=draw(_map(st.builds(m.Var, u64, _opt(st.sampled_from(m.AXES))))),
        states=draw(_map(states)))


@settings(max_examples=examples(200, 2000))
@given(manifests())
def test_json_to_kir_to_json_is_lossless(man: m.Manifest) -> None:
    canonical = writer.dumps(man)
    assert writer.dumps(reader.loads(canonical)) == canonical  # the generator is well-formed
    assert writer.dumps(kir.loads(kir.dumps(man))) == canonical


@settings(max_examples=examples(200, 2000))
@given(manifests())
def test_kir_to_json_to_kir_is_a_fixed_point(man: m.Manifest) -> None:
    text = kir.dumps(man)
    again = kir.dumps(reader.loads(writer.dumps(kir.loads(text))))
    assert again == text


@settings(max_examples=examples(200, 2000))
@given(st.integers(0, len(KITCHEN_SINK)), st.integers(0, 40),
       st.text(alphabet='{}[]()<>=,@%#+*;:"\\/ \t\n-.0123456789aeinrstxz_ü', max_size=8))
def test_any_edit_reads_or_fails_with_a_located_error(at: int, cut: int, junk: str) -> None:
    text = KITCHEN_SINK[:at] + junk + KITCHEN_SINK[at + cut:]
    try:
        kir.loads(text, "e.kir")
    except KernccError as err:
        assert err.diagnostics and all(d.location.line for d in err.diagnostics)


def test_the_reference_example_reads_and_prints_back() -> None:
    doc = (ROOT / "docs" / "kir.md").read_text()
    example = doc.split("```\n", 2)[1].replace("00…00", "0" * 64)
    man = kir.loads(example)
    assert kir.dumps(man) == example.replace("// a comment runs to the end of the line\n", "")


def test_a_runaway_the_innermost_put_cannot_record_is_placed_at_the_last_put(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The builder's last resort (a RecursionError escaping even the handler inside `put`)
    points at the attribute it was building, not at 1:1."""
    from kerncc.kir import build as kir_build

    real_error, real_value = kir_build._Build.error, kir_build._Build.value

    def error(self, message, node, ptr=""):
        if message == kir_build.TOO_DEEP and ptr.endswith("/grid"):
            monkeypatch.setattr(kir_build._Build, "error", real_error)
            raise RecursionError  # the handler itself ran out of stack
        real_error(self, message, node, ptr)

    def value(self, node, ptr, *rest):
        if "/grid/" in ptr:
            raise RecursionError
        return real_value(self, node, ptr, *rest)

    text = (HEAD + "var tokens max=8 axis=rows\n"
            "op f() {\n  launch k module=mm block=[1, 1, 1] grid=[tokens, 1, 1]\n}\n")
    monkeypatch.setattr(kir_build._Build, "error", error)
    monkeypatch.setattr(kir_build._Build, "value", value)
    with pytest.raises(KernccError) as err:
        kir.loads(text, "m.kir")
    found = [d for d in err.value.diagnostics if d.message == kir_build.TOO_DEEP]
    assert found, "the runaway was not reported"
    assert found[0].location.pointer == "/ops/f/impl/launches/0/grid"
    assert (found[0].location.line, found[0].location.column) == (5, 38)
