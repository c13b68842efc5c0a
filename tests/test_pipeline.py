"""The pass framework (kerncc.pipeline, kerncc.passes): spec grammar, resolution, runner,
instruments, listings. Everything runs on a fake IR and fake passes registered in a private
registry, so these tests hold whatever real passes exist."""

from __future__ import annotations

import io
import shlex

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kerncc import passes
from kerncc.pipeline.docgen import pass_reference_markdown
from kerncc.diagnostics import Diagnostic, KernccError
from kerncc.pipeline import (
    DumpDir,
    Instrument,
    InternalPassError,
    Pass,
    PassFailed,
    PassSpec,
    PipelineSpec,
    PrintIRAfter,
    PrintIRAfterAll,
    PrintIRAfterChange,
    TimePasses,
    describe_passes,
    format_value,
    instruments_from_args,
    parse_pipeline,
    pass_spec,
    resolve_pipeline,
    run_pipeline,
    schedule_passes,
)

PassRegistry = passes.PassRegistry
pass_options = passes.pass_options

# ---------------------------------------------------------------------------------------------
# A fake IR and fake passes.

@attrs.frozen
class FakeIR:
    """Lines of text; verification fails when a line says `invalid`."""

    lines: tuple[str, ...] = ()

    def to_text(self) -> str:
        return "".join(line + "\n" for line in self.lines)

    def verify(self) -> None:
        if "invalid" in self.lines:
            raise KernccError.single("ir line `invalid` is not allowed", "/lines")

    def plus(self, line: str) -> FakeIR:
        return FakeIR(self.lines + (line,))


REG = PassRegistry({"default": "liveness,cut,slice-derive", "broken": "liveness,nope"})


def _help(text: str) -> dict:
    return {"help": text}


@REG.register
@attrs.frozen
class Liveness(Pass):
    """Attach liveness."""

    name = "liveness"

    def run(self, ir: FakeIR) -> FakeIR:
        return ir.plus("liveness")


@REG.register
@attrs.frozen
class Cut(Pass):
    """Split every driven program into stages.

    More text for the reference.
    """

    name = "cut"
    requires = ("liveness",)
    at: tuple[int, ...] = attrs.field(default=(), metadata=_help("call indices to cut before"))
    at_label: str | None = attrs.field(default=None, metadata=_help("label of the call"))
    stages: int | None = attrs.field(default=None, metadata=_help("number of stages"))
    check: bool = attrs.field(default=True, metadata=_help("prove the cut"))

    def __attrs_post_init__(self) -> None:
        given_ = [o for o in (self.at, self.at_label, self.stages) if o not in ((), None)]
        if len(given_) > 1:
            raise ValueError("give one of at, at-label, stages")

    def run(self, ir: FakeIR) -> FakeIR:
        return ir.plus(f"cut at={self.at} label={self.at_label} stages={self.stages}")


@REG.register
@attrs.frozen
class SliceDerive(Pass):
    """Slice derive programs."""

    name = "slice-derive"
    names: tuple[str, ...] = attrs.field(default=(), metadata=_help("programs to slice"))

    def run(self, ir: FakeIR) -> FakeIR:
        return ir.plus(f"slice {','.join(self.names)}")


@REG.register
@attrs.frozen
class PlanMemory(Pass):
    """Plan the arena."""

    name = "plan-memory"

    def run(self, ir: FakeIR) -> FakeIR:
        return ir.plus("plan")


@REG.register
@attrs.frozen
class Emit(Pass):
    """Write the bundles."""

    name = "emit"
    requires = ("plan-memory",)
    out: str = attrs.field(default="out", metadata=_help("output directory"))

    def run(self, ir: FakeIR) -> FakeIR:
        return ir.plus(f"emit {self.out}")


@REG.register
@attrs.frozen
class Noop(Pass):
    """Change nothing."""

    name = "noop"

    def run(self, ir: FakeIR) -> FakeIR:
        return ir


@REG.register
@attrs.frozen
class Refuse(Pass):
    """Refuse the input like a cut does."""

    name = "refuse"

    def run(self, ir: FakeIR) -> FakeIR:
        raise KernccError("manifest cannot be cut:", [Diagnostic("program `p` has 3 calls")])


@REG.register
@attrs.frozen
class Corrupt(Pass):
    """Produce IR that does not verify."""

    name = "corrupt"

    def run(self, ir: FakeIR) -> FakeIR:
        return ir.plus("invalid")


@REG.register
@attrs.frozen
class Crash(Pass):
    """Have a bug."""

    name = "crash"

    def run(self, ir: FakeIR) -> FakeIR:
        return 1 // 0


@REG.register
@attrs.frozen
class Forget(Pass):
    """Forget to return the IR."""

    name = "forget"

    def run(self, ir: FakeIR) -> None:
        ir.plus("lost")


def resolve(text: str) -> tuple:
    return resolve_pipeline(text, REG)


def run(text: str, ir: FakeIR | None = None, **kwargs) -> FakeIR:
    return run_pipeline(ir or FakeIR(), text, reg=REG, **kwargs)


def error_of(call, *args, **kwargs) -> KernccError:
    with pytest.raises(KernccError) as info:
        call(*args, **kwargs)
    return info.value


# ---------------------------------------------------------------------------------------------
# Parsing and printing.

def test_parse_the_examples() -> None:
    spec = parse_pipeline("cut{at=218,290},slice-derive,emit{out=stages}")
    assert spec == PipelineSpec((PassSpec("cut", (("at", (218, 290)),)), PassSpec("slice-derive"),
                                 PassSpec("emit", (("out", "stages"),))))
    assert parse_pipeline("cut{at-label=l18.qkv_proj}").passes[0].options == (
        ("at-label", "l18.qkv_proj"),)
    assert parse_pipeline("cut{stages=3}").passes[0].options == (("stages", 3),)
    assert parse_pipeline("cut") == PipelineSpec((PassSpec("cut"),))


@pytest.mark.parametrize("text, options", [
    ("p{out=/tmp/x}", (("out", "/tmp/x"),)),
    ('p{out="a b, {c}"}', (("out", "a b, {c}"),)),
    ('p{s="12"}', (("s", "12"),)),
    ("p{b=true,c=false}", (("b", True), ("c", False))),
    ("p{n=-3}", (("n", -3),)),
    ("p{e=}", (("e", ()),)),
    ("p{e=,f=1}", (("e", ()), ("f", 1))),
    ("p{xs=a,b,2,k=v}", (("xs", ("a", "b", 2)), ("k", "v"))),
    ('p{xs="a",b}', (("xs", ("a", "b")),)),
    ("p{}", ()),
    (" p { at = 1 , 2 } ", (("at", (1, 2)),)),
])
def test_option_values(text: str, options: tuple) -> None:
    assert parse_pipeline(text).passes[0].options == options


def test_empty_pipeline() -> None:
    assert parse_pipeline("") == PipelineSpec(())
    assert str(parse_pipeline("  ")) == ""


def test_print_is_canonical() -> None:
    text = ' cut { at = 218 , 290 } , emit{out="a b",s="12",t="true",e=} '
    assert str(parse_pipeline(text)) == 'cut{at=218,290},emit{out="a b",s="12",t="true",e=}'


def test_spans_locate_the_text() -> None:
    spec = parse_pipeline("cut,emit{out=/x,at=1,2}")
    emit = spec.passes[1]
    assert spec.source == "cut,emit{out=/x,at=1,2}"
    assert emit.span == (4, 23) and emit.name_span == (4, 8)
    assert emit.option_spans == (((9, 12), (13, 15)), ((16, 18), (19, 22)))


def test_pass_spec_normalizes_and_checks() -> None:
    assert PassSpec("cut", (("at", (5,)),)) == PassSpec("cut", (("at", 5),))
    assert PassSpec("cut", (("at", [1, 2]),)).options == (("at", (1, 2)),)
    with pytest.raises(ValueError):
        PassSpec("a b")
    with pytest.raises(ValueError):
        PassSpec("cut", (("k=", 1),))
    with pytest.raises(TypeError):
        PassSpec("cut", (("k", 1.5),))


def test_format_value() -> None:
    assert format_value((218, 290)) == "218,290"
    assert format_value("l18.qkv_proj") == "l18.qkv_proj"
    assert format_value("007") == '"007"'
    assert format_value(True) == "true"
    assert format_value("") == '""'
    assert format_value(()) == ""


_WORD_CHARS = "abcxyzAZ0129_./:+@~-"  # a sample of the grammar's WORD characters
_words = st.text(_WORD_CHARS, min_size=1, max_size=8)
_scalars = st.one_of(st.integers(), st.booleans(),
                     st.text(st.characters(blacklist_categories=("Cs",)), max_size=12), _words)
_values = st.one_of(_scalars, st.just(()), st.lists(_scalars, min_size=2, max_size=4).map(tuple))
_pass_specs = st.builds(PassSpec, _words, st.lists(st.tuples(_words, _values), max_size=4)
                        .map(tuple))
_specs = st.builds(PipelineSpec, st.lists(_pass_specs, max_size=4).map(tuple))


@given(_specs)
def test_print_parse_round_trip(spec: PipelineSpec) -> None:
    assert parse_pipeline(str(spec)) == spec


@given(_specs, st.sampled_from([" ", "\t", "\n ", ""]))
def test_whitespace_between_tokens_is_ignored(spec: PipelineSpec, space: str) -> None:
    # Spaces around every comma and brace; values with spaces are quoted, so none lands inside.
    text = str(spec)
    spaced = "".join(_spaced(part, space) for part in _tokens_outside_strings(text))
    assert parse_pipeline(spaced) == spec


def _tokens_outside_strings(text: str) -> list[tuple[str, bool]]:
    parts, quoted, start, i = [], False, 0, 0
    while i < len(text):
        if text[i] == "\\" and quoted:
            i += 2
            continue
        if text[i] == '"':
            parts.append((text[start:i + quoted], quoted))
            start, quoted = i + (quoted), not quoted
        i += 1
    parts.append((text[start:], quoted))
    return parts


def _spaced(part: tuple[str, bool], space: str) -> str:
    text, quoted = part
    if quoted:
        return text
    for sep in ",{}=":
        text = text.replace(sep, f"{space}{sep}{space}")
    return text


# ---------------------------------------------------------------------------------------------
# Syntax errors.

@pytest.mark.parametrize("text, rendered", [
    ("cut,", "pipeline:1:5: unexpected end of the pipeline (expected a name)\ncut,\n    ^"),
    ("cut{at=1;2}", "pipeline:1:9: unexpected character `;`\ncut{at=1;2}\n        ^"),
    ("cut{3}", "pipeline:1:5: expected `key=value`\ncut{3}\n    ^"),
    ('emit{out="x', 'pipeline:1:10: unterminated string\nemit{out="x\n         ^'),
    ('emit{out="\\q"}',
     'pipeline:1:10: bad string: Invalid \\escape\nemit{out="\\q"}\n         ^~~~'),
    ("cut{a=1", ("pipeline:1:8: unexpected end of the pipeline (expected `,` or `}`)\n"
                 "cut{a=1\n       ^")),
    ("cut emit", ("pipeline:1:5: unexpected `emit` (expected `{` or `,`)\n"
                  "cut emit\n    ^~~~")),
    ("cut\n,,", "pipeline:2:2: unexpected `,` (expected a name)\n,,\n ^"),
])
def test_syntax_errors(text: str, rendered: str) -> None:
    error = error_of(parse_pipeline, text)
    assert error.headline == "invalid pass pipeline:"
    assert [d.render() for d in error.diagnostics] == [rendered]


# ---------------------------------------------------------------------------------------------
# Resolution.

def test_unknown_pass_has_caret_and_did_you_mean() -> None:
    error = error_of(resolve, "cut,slise-derive")
    (diag,) = error.diagnostics
    assert diag.render() == (
        "pipeline:1:5: unknown pass `slise-derive` (did you mean `slice-derive`?)\n"
        "cut,slise-derive\n"
        "    ^~~~~~~~~~~~")
    assert (diag.location.line, diag.location.column, diag.location.pointer) == (1, 5, "")
    assert str(error).startswith("invalid pass pipeline:\n  - pipeline:1:5: unknown pass")


def test_unknown_pass_without_a_close_name() -> None:
    (diag,) = error_of(resolve, "zzzzzz{a=1}").diagnostics
    assert diag.message.splitlines() == ["unknown pass `zzzzzz`", "zzzzzz{a=1}", "^~~~~~"]


@pytest.mark.parametrize("text, message, caret", [
    ("cut{at-lable=x}", "pass `cut` has no option `at-lable` (did you mean `at-label`?)",
     "    ^~~~~~~~"),
    ("cut{at_label=x}", "pass `cut` has no option `at_label` (did you mean `at-label`?)",
     "    ^~~~~~~~"),
    ("cut{zz=1}", "pass `cut` has no option `zz` (options: at, at-label, stages, check)",
     "    ^~"),
    ("noop{x=1}", "pass `noop` has no option `x` (it takes no options)", "     ^"),
    ("cut{at=x}", "option `at` of pass `cut` expects a list of integers, got `x`", "       ^"),
    ("cut{at=1,x,3}", "option `at` of pass `cut` expects a list of integers, got `1,x,3`",
     "       ^~~~~"),
    ("cut{stages=1,2}", "option `stages` of pass `cut` expects an integer, got `1,2`",
     "           ^~~"),
    ("cut{stages=}", "option `stages` of pass `cut` expects an integer, got an empty list",
     "           ^"),
    ("cut{stages=\"3\"}", "option `stages` of pass `cut` expects an integer, got `\"3\"`",
     "           ^~~"),
    ("cut{check=ture}", ("option `check` of pass `cut` expects true or false, got `ture` "
                         "(did you mean `true`?)"), "          ^~~~"),
    ("cut{check=1}", "option `check` of pass `cut` expects true or false, got `1`",
     "          ^"),
    ("emit{out=}", "option `out` of pass `emit` expects a string, got an empty list",
     "         ^"),
    ("cut{at=1,at=2}", "option `at` is given twice", "         ^~"),
    ("cut{at=1,stages=2}", "pass `cut`: give one of at, at-label, stages",
     "^~~~~~~~~~~~~~~~~~"),
    ("default{x=1}", "named pipeline `default` takes no options", "^~~~~~~~~~~~"),
    ("defualt", "unknown pass `defualt` (did you mean `default`?)", "^~~~~~~"),
])
def test_resolution_errors(text: str, message: str, caret: str) -> None:
    (diag,) = error_of(resolve, text).diagnostics
    assert diag.message == f"{message}\n{text}\n{caret}"


def test_resolution_collects_every_error() -> None:
    error = error_of(resolve, "cut{at=x},slise,emit{oot=1}")
    assert [d.location.column for d in error.diagnostics] == [8, 11, 22]


def test_errors_in_a_named_pipeline_say_so() -> None:
    (diag,) = error_of(resolve, "broken").diagnostics
    assert diag.message.startswith("in named pipeline `broken`: unknown pass `nope`")
    assert diag.message.endswith("liveness,nope\n         ^~~~")


@pytest.mark.parametrize("text, expected", [
    ("cut", Cut()),
    ("cut{at=218}", Cut(at=(218,))),
    ("cut{at=218,290}", Cut(at=(218, 290))),
    ("cut{at=}", Cut(at=())),
    ("cut{at-label=l18.qkv_proj}", Cut(at_label="l18.qkv_proj")),
    ("cut{at-label=12}", Cut(at_label="12")),
    ("cut{at-label=true}", Cut(at_label="true")),
    ("cut{stages=3,check=false}", Cut(stages=3, check=False)),
    ("emit{out=/tmp/x}", Emit(out="/tmp/x")),
    ('emit{out="/tmp/a b"}', Emit(out="/tmp/a b")),
    ("slice-derive{names=a,b,3}", SliceDerive(names=("a", "b", "3"))),
    ("slice-derive{names=decode}", SliceDerive(names=("decode",))),
])
def test_option_conversion(text: str, expected: Pass) -> None:
    assert resolve(text) == (expected,)


def test_named_pipelines_expand() -> None:
    assert resolve("default") == (Liveness(), Cut(), SliceDerive())
    assert resolve(" default ") == resolve("default")
    assert resolve("default,emit{out=x}")[-1] == Emit(out="x")


def test_a_built_spec_resolves() -> None:
    spec = PipelineSpec((PassSpec("cut", (("at", (1, 2)),)),))
    assert resolve_pipeline(spec, REG) == (Cut(at=(1, 2)),)
    error = error_of(resolve_pipeline, PipelineSpec((PassSpec("noop"), PassSpec("cutt"))), REG)
    assert error.diagnostics[0].message.endswith("noop,cutt\n     ^~~~")


def test_pass_spec_prints_the_options_that_differ() -> None:
    assert str(pass_spec(Cut())) == "cut"
    assert str(pass_spec(Cut(at=(218, 290), check=False))) == "cut{at=218,290,check=false}"
    assert str(pass_spec(Emit(out="a b"))) == 'emit{out="a b"}'
    for text in ["cut{at=3}", "cut{at-label=l1.x}", "slice-derive{names=a,b}", "emit{out=x}"]:
        assert str(pass_spec(resolve(text)[0])) == text


# ---------------------------------------------------------------------------------------------
# Scheduling and running.

def _names(schedule) -> list[tuple[str, str | None]]:
    return [(item.pass_.name, item.required_by) for item in schedule]


def test_required_passes_are_inserted() -> None:
    assert _names(schedule_passes(resolve("emit"), REG)) == [
        ("plan-memory", "emit"), ("emit", None)]
    assert _names(schedule_passes(resolve("cut,emit"), REG)) == [
        ("liveness", "cut"), ("cut", None), ("plan-memory", "emit"), ("emit", None)]
    assert _names(schedule_passes(resolve("liveness,cut,cut"), REG)) == [
        ("liveness", None), ("cut", None), ("cut", None)]
    assert _names(schedule_passes(resolve("cut,liveness"), REG)) == [
        ("liveness", "cut"), ("cut", None), ("liveness", None)]


def test_requirement_errors() -> None:
    reg = PassRegistry()

    @reg.register
    @attrs.frozen
    class A(Pass):
        """A."""

        name = "a"
        requires = ("b",)

        def run(self, ir):
            return ir

    @reg.register
    @attrs.frozen
    class B(Pass):
        """B."""

        name = "b"
        requires = ("a",)

        def run(self, ir):
            return ir

    @reg.register
    @attrs.frozen
    class C(Pass):
        """C."""

        name = "c"
        requires = ("missing",)

        def run(self, ir):
            return ir

    assert error_of(schedule_passes, [A()], reg).headline == (
        "pass requirements form a cycle: a -> b -> a")
    assert error_of(schedule_passes, [C()], reg).headline == (
        "pass `c` requires unknown pass `missing`")


def test_run_in_order_with_required_passes() -> None:
    ir = run("cut{at=3},emit{out=o}")
    assert ir.lines == ("liveness", "cut at=(3,) label=None stages=None", "plan", "emit o")


def test_run_takes_pass_instances() -> None:
    assert run_pipeline(FakeIR(), [Noop(), PlanMemory()], reg=REG).lines == ("plan",)


def test_verify_after_each_pass() -> None:
    error = error_of(run, "noop,corrupt,noop")
    assert isinstance(error, PassFailed)
    assert str(error) == ("pass `corrupt` produced IR that fails verification (after: noop):\n"
                          "  - /lines: ir line `invalid` is not allowed")
    assert run("noop,corrupt,noop", verify=False).lines == ("invalid",)


def test_a_failing_pass_names_its_history() -> None:
    with pytest.raises(PassFailed) as info:
        run("cut,refuse", input_name="model.json")
    error = info.value
    assert str(error) == ("pass `refuse` failed (after: liveness, cut): manifest cannot be cut:\n"
                          "  - program `p` has 3 calls")
    assert error.messages() == ["program `p` has 3 calls"]
    assert (error.pass_name, error.history) == ("refuse", ("liveness", "cut"))
    assert error.reproducer == "kerncc lower model.json -p liveness,cut,refuse"
    assert isinstance(error.__cause__, KernccError)


def test_a_failing_first_pass_and_a_bare_headline() -> None:
    reg = PassRegistry()

    @reg.register
    @attrs.frozen
    class Bare(Pass):
        """Raise a KernccError without diagnostics."""

        name = "bare"

        def run(self, ir):
            raise KernccError("nothing to cut")

    error = error_of(run_pipeline, FakeIR(), "bare", reg=reg)
    assert str(error) == "pass `bare` failed:\n  - nothing to cut"


def test_an_exception_is_an_internal_error_with_a_reproducer() -> None:
    with pytest.raises(InternalPassError) as info:
        run('cut{at=3},emit{out="a b"},crash', input_name="my model.json", verify=False)
    error = info.value
    reproducer = ("kerncc lower 'my model.json' "
                  "-p 'liveness,cut{at=3},plan-memory,emit{out=\"a b\"},crash' --no-verify")
    assert error.reproducer == reproducer
    assert str(error) == (
        "internal error in pass `crash` (after: liveness, cut, plan-memory, emit): "
        "ZeroDivisionError: integer division or modulo by zero\n"
        f"please report this bug with the reproducer:\n  {reproducer}")
    assert isinstance(error.__cause__, ZeroDivisionError)
    assert not isinstance(error, KernccError)
    # The reproducer's spec resolves to the same passes.
    spec = shlex.split(reproducer)[4]
    assert [p.name for p in resolve(spec)] == ["liveness", "cut", "plan-memory", "emit", "crash"]


def test_a_pass_that_returns_nothing_is_an_internal_error() -> None:
    with pytest.raises(InternalPassError) as info:
        run("forget")
    assert "TypeError: pass `forget` returned NoneType, not an IR" in str(info.value)


# ---------------------------------------------------------------------------------------------
# Instruments.

class Recorder(Instrument):
    def __init__(self, tag: str, log: list) -> None:
        self.tag, self.log = tag, log

    def before_pipeline(self, schedule, ir) -> None:
        self.log.append((self.tag, "start", len(schedule)))

    def before_pass(self, pass_, ir) -> None:
        self.log.append((self.tag, "before", pass_.name))

    def after_pass(self, pass_, ir_before, ir_after) -> None:
        self.log.append((self.tag, "after", pass_.name, ir_before.lines, ir_after.lines))

    def after_failed(self, pass_, ir, error) -> None:
        self.log.append((self.tag, "failed", pass_.name, type(error).__name__))

    def after_pipeline(self) -> None:
        self.log.append((self.tag, "end"))


def test_instrument_hooks_and_their_order() -> None:
    log: list = []
    with pytest.raises(PassFailed):
        run("liveness,refuse", FakeIR(("x",)), instruments=[Recorder("a", log),
                                                             Recorder("b", log)])
    assert log == [
        ("a", "start", 2), ("b", "start", 2),
        ("a", "before", "liveness"), ("b", "before", "liveness"),
        ("b", "after", "liveness", ("x",), ("x", "liveness")),
        ("a", "after", "liveness", ("x",), ("x", "liveness")),
        ("a", "before", "refuse"), ("b", "before", "refuse"),
        ("b", "failed", "refuse", "KernccError"), ("a", "failed", "refuse", "KernccError"),
        ("b", "end"), ("a", "end"),
    ]


def test_after_failed_sees_internal_errors_and_verify_failures() -> None:
    log: list = []
    with pytest.raises(InternalPassError):
        run("crash", instruments=[Recorder("a", log)])
    with pytest.raises(PassFailed):
        run("corrupt", instruments=[Recorder("a", log)])
    failed = [entry for entry in log if entry[1] == "failed"]
    assert failed == [("a", "failed", "crash", "ZeroDivisionError"),
                      ("a", "failed", "corrupt", "KernccError")]


DUMP = "// -----// IR Dump After {} //----- //\n"


def test_print_ir_after() -> None:
    out = io.StringIO()
    run("cut{at=3},noop", instruments=[PrintIRAfter(["cut"], out=out)])
    assert out.getvalue() == (DUMP.format("cut{at=3}")
                              + "liveness\ncut at=(3,) label=None stages=None\n")


def test_print_ir_after_all() -> None:
    out = io.StringIO()
    run("liveness,noop", instruments=[PrintIRAfterAll(out=out)])
    assert out.getvalue() == (DUMP.format("liveness") + "liveness\n"
                              + DUMP.format("noop") + "liveness\n")


def test_print_ir_after_change() -> None:
    out = io.StringIO()
    run("noop,liveness,noop,plan-memory", instruments=[PrintIRAfterChange(out=out)])
    assert out.getvalue() == (DUMP.format("liveness") + "liveness\n"
                              + DUMP.format("plan-memory") + "liveness\nplan\n")


def test_printing_defaults_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    run("liveness", instruments=[PrintIRAfterAll()])
    assert capsys.readouterr().err == DUMP.format("liveness") + "liveness\n"


def _clock(*times: float):
    return iter(times).__next__


def test_time_passes() -> None:
    out = io.StringIO()
    timer = TimePasses(out=out, clock=_clock(0.0, 0.001, 0.001, 0.004))
    run("cut", instruments=[timer])
    assert out.getvalue() == (
        "pass timing (wall clock; a pass's time includes verifying its result)\n"
        "  pass         wall ms       %\n"
        "  liveness       1.000   25.0%  inserted: required by cut\n"
        "  cut            3.000   75.0%\n"
        "  total          4.000  100.0%\n")


def test_time_passes_reports_a_failure() -> None:
    out = io.StringIO()
    timer = TimePasses(out=out, clock=_clock(0.0, 0.002, 0.002, 0.002))
    with pytest.raises(PassFailed):
        run("noop,refuse", instruments=[timer])
    assert out.getvalue().splitlines()[2:] == [
        "  noop         2.000  100.0%",
        "  refuse       0.000    0.0%  failed",
        "  total        2.000  100.0%"]


def test_time_passes_with_no_passes() -> None:
    out = io.StringIO()
    run("", instruments=[TimePasses(out=out)])
    assert out.getvalue().splitlines()[-1] == "  total       0.000    0.0%"


def test_dump_dir(tmp_path) -> None:
    directory = tmp_path / "dumps" / "x"
    run("cut,noop", FakeIR(("in",)), instruments=[DumpDir(directory)])
    files = sorted(p.name for p in directory.iterdir())
    assert files == ["00-input.kir", "01-liveness.kir", "02-cut.kir", "03-noop.kir"]
    assert (directory / "00-input.kir").read_text() == "in\n"
    assert (directory / "01-liveness.kir").read_text() == "in\nliveness\n"


def test_instruments_from_args(tmp_path) -> None:
    out = io.StringIO()
    instruments = instruments_from_args(["cut,emit", "noop"], True, True, True,
                                        str(tmp_path), out, reg=REG)
    assert [type(i) for i in instruments] == [
        PrintIRAfter, PrintIRAfterAll, PrintIRAfterChange, DumpDir, TimePasses]
    assert instruments[0].names == {"cut", "emit", "noop"}
    assert all(i.out is out for i in instruments if not isinstance(i, DumpDir))
    assert instruments_from_args(None, False, False, False, None, out, reg=REG) == []


def test_instruments_from_args_checks_pass_names() -> None:
    error = error_of(instruments_from_args, ["cut,slise-derive"], False, False, False, None,
                     reg=REG)
    assert str(error) == ("invalid --print-ir-after:\n"
                          "  - unknown pass `slise-derive` (did you mean `slice-derive`?)")


# ---------------------------------------------------------------------------------------------
# Registration and listings.

def test_options_are_read_from_fields() -> None:
    infos = pass_options(Cut)
    assert [(i.key, i.field, i.type_text, i.optional, i.default) for i in infos] == [
        ("at", "at", "int,...", False, ()),
        ("at-label", "at_label", "str", True, None),
        ("stages", "stages", "int", True, None),
        ("check", "check", "bool", False, True)]


def _pass_class(name: str = "p", doc: str | None = "Do p.", frozen: bool = True, **fields):
    namespace = {"__doc__": doc, "name": name, "run": lambda self, ir: ir,
                 "__annotations__": {k: t for k, (t, _) in fields.items()}}
    namespace.update({k: f for k, (_, f) in fields.items()})
    cls = type("P", (Pass,), namespace)
    return attrs.frozen(cls) if frozen else attrs.define(cls)


@pytest.mark.parametrize("make, message", [
    (lambda: type("P", (Pass,), {"name": "p", "__doc__": "D.", "run": None}), "attrs class"),
    (lambda: _pass_class(frozen=False), "must be frozen"),
    (lambda: _pass_class(name="Bad_Name"), "kebab-case"),
    (lambda: _pass_class(doc=None), "needs a docstring"),
    (lambda: _pass_class(x=(int, attrs.field(default=1))), "one-line help"),
    (lambda: _pass_class(x=(float, attrs.field(default=1.0, metadata=_help("h")))),
     "is not one of int, bool, str"),
    (lambda: _pass_class(x=(int, attrs.field(metadata=_help("h")))), "need a default"),
    (lambda: _pass_class(x=(tuple[int, int], attrs.field(default=(1, 2),
                                                         metadata=_help("h")))),
     "is not one of"),
    (lambda: _pass_class(requires=(tuple[str, ...], attrs.field(default=(),
                                                                metadata=_help("h")))),
     "class attributes, not fields"),
])
def test_register_checks_the_class(make, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        PassRegistry().register(make())


def test_register_refuses_duplicates_and_pipeline_names() -> None:
    reg = PassRegistry({"default": "p"})
    reg.register(_pass_class("p"))
    with pytest.raises(ValueError, match="registered twice"):
        reg.register(_pass_class("p"))
    with pytest.raises(ValueError, match="named pipeline"):
        reg.register(_pass_class("default"))


def test_factory_defaults() -> None:
    cls = _pass_class(xs=(tuple[str, ...], attrs.field(factory=tuple, metadata=_help("h"))))
    assert pass_options(cls)[0].default == ()


def test_describe_passes() -> None:
    reg = PassRegistry({"all": "cut,emit"})
    reg.register(Cut)
    reg.register(Emit)
    assert describe_passes(reg) == (
        "cut: Split every driven program into stages.\n"
        "    at=int,...    (default: empty)  call indices to cut before\n"
        "    at-label=str  (default: none)   label of the call\n"
        "    stages=int    (default: none)   number of stages\n"
        "    check=bool    (default: true)   prove the cut\n"
        "    requires: liveness\n"
        "\n"
        "emit: Write the bundles.\n"
        "    out=str  (default: out)  output directory\n"
        "    requires: plan-memory\n"
        "\n"
        "named pipelines:\n"
        "  all = cut,emit\n")


def test_pass_reference_markdown() -> None:
    reg = PassRegistry({"all": "cut,noop"})
    reg.register(Cut)
    reg.register(Noop)
    text = pass_reference_markdown(reg)
    assert text.startswith("# Pass reference\n")
    assert "| `all` | `cut,noop` |" in text
    assert ("## `cut`\n\nSplit every driven program into stages.\n\nMore text for the "
            "reference.\n\nClass `test_pipeline.Cut`.\n\nRequires: `liveness`.\n") in text
    assert "| `at-label` | `str` | `none` | label of the call |" in text
    assert "## `noop`\n\nChange nothing.\n" in text
    assert "| [`noop`](#noop) | Change nothing. |" in text
    assert text.index("## `cut`") < text.index("## `noop`")  # registration order
    assert "> The pass framework (kerncc.pipeline" in text  # the module's docstring, once
    assert "Module notes: see [`cut`](#cut)." in text


def test_the_global_registry() -> None:
    assert passes.NAMED_PIPELINES["default"] == (
        "liveness,cut,share-states,slice-once,slice-derive,plan-memory")
    assert isinstance(passes.PASS_MODULES, tuple)
    assert passes.registry() is passes.REGISTRY
    assert passes.REGISTRY.pipelines == passes.NAMED_PIPELINES
    for cls in passes.registry():
        assert pass_options(cls) is not None  # every registered pass has valid options


def test_the_package_imports_every_pass_module() -> None:
    """PASS_MODULES is what the package imports: each module listed registers a pass, and no
    module of the folder defines a pass the registry lacks."""
    import inspect
    import sys

    for name in passes.PASS_MODULES:
        assert f"kerncc.passes.{name}" in sys.modules
    defined = {cls for module in list(sys.modules.values())
               if module and module.__name__.startswith("kerncc.passes.")
               for _, cls in inspect.getmembers(module, inspect.isclass)
               if issubclass(cls, passes.Pass) and cls is not passes.Pass
               and cls.__module__ == module.__name__}
    assert defined == set(passes.registry())
    assert {cls.__module__.rpartition(".")[2] for cls in defined} == set(passes.PASS_MODULES)
