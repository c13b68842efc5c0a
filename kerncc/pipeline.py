"""Pass pipelines: the Pass base, the `-p` spec (parse, print, resolve), the runner, instruments.

The shape follows xDSL and MLIR (docs: STYLE.md). A spec such as
`cut{at=218,290},slice-derive,emit{out=stages}` parses (grammar/pipeline.lark) into a
`PipelineSpec` that prints back to an equal spec. `resolve_pipeline` checks it against the
registry (kerncc.passes) before anything runs: unknown passes and options, and values of the
wrong type, are reported together, each with a caret under the text and a did-you-mean.
`run_pipeline` runs the passes in order, inserting the passes each one `requires`, verifies the
IR after each, and calls instruments around every pass (MLIR's PassInstrumentation):
`PrintIRAfter`, `PrintIRAfterAll`, `PrintIRAfterChange`, `TimePasses`, `DumpDir`.

A pass that raises a KernccError fails as `PassFailed`, whose headline names the pass and the
passes that ran before it; any other exception is a bug in kerncc and comes out as
`InternalPassError`, carrying a command line that reproduces it.
The IR is opaque here: anything with `to_text() -> str` and `verify() -> None`.
"""

from __future__ import annotations

import difflib
import functools
import importlib.resources
import json
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol, TextIO, TypeVar

import attrs
import lark

from kerncc.diagnostics import Diagnostic, Diagnostics, KernccError, Location
from kerncc.passes import OptionInfo, PassRegistry, pass_options, pass_summary, registry

__all__ = [
    "IR",
    "DumpDir",
    "Instrument",
    "InternalPassError",
    "Pass",
    "PassFailed",
    "PassSpec",
    "PipelineSpec",
    "PrintIRAfter",
    "PrintIRAfterAll",
    "PrintIRAfterChange",
    "ScheduledPass",
    "TimePasses",
    "caret_diagnostic",
    "convert_option",
    "default_text",
    "describe_passes",
    "format_value",
    "instruments_from_args",
    "parse_pipeline",
    "pass_spec",
    "reproducer",
    "resolve_pipeline",
    "run_pipeline",
    "schedule_passes",
]

INVALID_PIPELINE = "invalid pass pipeline:"


class IR(Protocol):
    """What the pipeline needs of an IR; kerncc.ir provides the real one."""

    def to_text(self) -> str: ...

    def verify(self) -> None: ...


IRT = TypeVar("IRT", bound=IR)


class Pass:
    """Base of every pass. Subclasses are frozen attrs classes registered with `@register`.

    `name` is the kebab-case name a spec uses; `requires` names passes that must have run before
    (the runner inserts missing ones); options are attrs fields with a default and
    `metadata={"help": ...}`; `run` returns a new IR and never mutates its argument.
    """

    name: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()
    # A pass that writes files (emit) comes last: a pass after it could fail with the output
    # already written, and `kerncc lower -o DIR` promises no output when it fails.
    writes_output: ClassVar[bool] = False

    def run(self, ir: Any) -> Any:
        raise NotImplementedError(f"pass `{self.name}` does not define run()")


# ---------------------------------------------------------------------------------------------
# The spec: option values, passes, pipelines, and their printed form.

Scalar = int | bool | str
Value = Scalar | tuple[Scalar, ...]
Span = tuple[int, int]  # [start, end) offsets into the spec text

_INT_WORD = re.compile(r"-?[0-9]+")


@functools.cache
def _parser() -> lark.Lark:
    grammar = (importlib.resources.files("kerncc.grammar") / "pipeline.lark").read_text()
    return lark.Lark(grammar, start="pipeline", parser="lalr", propagate_positions=True,
                     maybe_placeholders=True)


@functools.cache
def _word_pattern() -> re.Pattern[str]:
    # The grammar's WORD terminal, so printing quotes exactly what parsing would not read bare.
    return re.compile(_parser().get_terminal("WORD").pattern.to_regexp())


def _classify_word(word: str) -> Scalar:
    """A bare word's value: an integer, true/false, or the word itself."""
    if _INT_WORD.fullmatch(word):
        return int(word)
    if word in ("true", "false"):
        return word == "true"
    return word


def _format_scalar(value: Scalar) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if _word_pattern().fullmatch(value) and _classify_word(value) == value:
        return value
    return json.dumps(value, ensure_ascii=False)


def format_value(value: Value) -> str:
    """An option value as a spec writes it: `218`, `218,290`, `l18.qkv_proj`, `"a b"`."""
    if isinstance(value, tuple):
        return ",".join(_format_scalar(v) for v in value)
    return _format_scalar(value)


def _normalize_value(value: Value | list) -> Value:
    # One spelling per value, so that parse(str(spec)) == spec: a one-item list prints and
    # parses back as its item.
    if isinstance(value, (tuple, list)):
        items = tuple(value)
        return items[0] if len(items) == 1 else items
    return value


def _normalize_options(options: Iterable[tuple[str, Value]]) -> tuple[tuple[str, Value], ...]:
    return tuple((key, _normalize_value(value)) for key, value in options)


def _check_word(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not _word_pattern().fullmatch(value):
        raise ValueError(f"`{value}` cannot be a pass name or option key")


def _check_options(instance: object, attribute: attrs.Attribute, options: tuple) -> None:
    for key, value in options:
        _check_word(instance, attribute, key)
        for item in value if isinstance(value, tuple) else (value,):
            if not isinstance(item, (int, str)):
                raise TypeError(f"option `{key}`: {item!r} is not an int, bool or str")


@attrs.frozen
class PassSpec:
    """One pass of a spec as written: its name and options; spans locate them in the text."""

    name: str = attrs.field(validator=_check_word)
    options: tuple[tuple[str, Value], ...] = attrs.field(
        default=(), converter=_normalize_options, validator=_check_options)
    span: Span | None = attrs.field(default=None, eq=False)
    name_span: Span | None = attrs.field(default=None, eq=False)
    # Per option: (key span, value span).
    option_spans: tuple[tuple[Span, Span], ...] = attrs.field(default=(), eq=False)

    def __str__(self) -> str:
        if not self.options:
            return self.name
        body = ",".join(f"{key}={format_value(value)}" for key, value in self.options)
        return f"{self.name}{{{body}}}"


@attrs.frozen
class PipelineSpec:
    """A parsed pipeline: its passes in order, and the text it came from (None when built)."""

    passes: tuple[PassSpec, ...] = attrs.field(default=(), converter=tuple)
    source: str | None = attrs.field(default=None, eq=False)

    def __str__(self) -> str:
        return ",".join(str(p) for p in self.passes)


def pass_spec(pass_: Any) -> PassSpec:
    """A pass instance printed back: its name and the options that differ from the defaults."""
    options = []
    for info in pass_options(type(pass_)):
        value = getattr(pass_, info.field)
        # None is "not given" and has no spelling; it can only differ from a non-None default.
        if value != info.default and value is not None:
            options.append((info.key, value))
    return PassSpec(pass_.name, tuple(options))


# ---------------------------------------------------------------------------------------------
# Carets and parse errors.

def _position(text: str, offset: int) -> tuple[int, int, str]:
    """(line, column, the line's text) of an offset; both numbers 1-based."""
    start = text.rfind("\n", 0, offset) + 1
    end = text.find("\n", offset)
    line_text = text[start:] if end < 0 else text[start:end]
    return text.count("\n", 0, offset) + 1, offset - start + 1, line_text


def caret_diagnostic(text: str, span: Span, message: str) -> Diagnostic:
    """A diagnostic at `span` of a spec, its message followed by the line and a caret under it."""
    line, column, line_text = _position(text, span[0])
    width = max(1, min(span[1], span[0] + len(line_text) - column + 1) - span[0])
    caret = " " * (column - 1) + "^" + "~" * (width - 1)
    return Diagnostic(f"{message}\n{line_text}\n{caret}",
                      Location("", "pipeline", line, column))


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    match = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean `{match[0]}`?)" if match else ""


# What a parse error says it expected, in this order.
_TERMINAL_WORDS = {
    "WORD": "a name", "STRING": "a quoted string", "EQ": "`=`", "LBRACE": "`{`",
    "COMMA": "`,`", "RBRACE": "`}`", "$END": "the end of the pipeline",
}


def _syntax_error(text: str, error: lark.exceptions.UnexpectedInput) -> KernccError:
    if isinstance(error, lark.exceptions.UnexpectedCharacters):
        offset = error.pos_in_stream
        char = text[offset]
        what = "unterminated string" if char == '"' else f"unexpected character `{char}`"
        return _invalid(text, (offset, offset + 1), what)
    token = getattr(error, "token", None)
    if token is None or token.type == "$END":
        found, span = "end of the pipeline", (len(text), len(text) + 1)
    else:
        found, span = f"`{token}`", (token.start_pos, token.end_pos)
    expected = [word for name, word in _TERMINAL_WORDS.items()
                if name in getattr(error, "expected", ())]
    return _invalid(text, span, f"unexpected {found}" + _expected(expected))


def _expected(words: list[str]) -> str:
    if not words:
        return ""
    if len(words) == 1:
        return f" (expected {words[0]})"
    return f" (expected {', '.join(words[:-1])} or {words[-1]})"


def _invalid(text: str, span: Span, message: str) -> KernccError:
    return KernccError(INVALID_PIPELINE, [caret_diagnostic(text, span, message)])


# ---------------------------------------------------------------------------------------------
# Parsing: text -> PipelineSpec.

def parse_pipeline(text: str) -> PipelineSpec:
    """Parse a pipeline spec; a syntax error raises KernccError with a caret."""
    try:
        tree = _parser().parse(text)
    except lark.exceptions.UnexpectedInput as error:
        raise _syntax_error(text, error) from None
    passes = [_pass_from_tree(text, node) for node in tree.children if node is not None]
    return PipelineSpec(tuple(passes), text)


def _pass_from_tree(text: str, node: lark.Tree) -> PassSpec:
    name, options = node.children
    items = [] if options is None else [i for i in options.children if i is not None]
    grouped = _group_items(text, items)
    return PassSpec(
        str(name), tuple((key, values) for key, values, _ in grouped),
        span=(node.meta.start_pos, node.meta.end_pos),
        name_span=(name.start_pos, name.end_pos),
        option_spans=tuple(spans for _, _, spans in grouped))


def _group_items(text: str, items: list[lark.Tree]) -> list[tuple[str, list, tuple[Span, Span]]]:
    """Options from the flat item list: each bare item joins the option before it."""
    grouped: list[tuple[str, list, tuple[Span, Span]]] = []
    for item in items:
        if item.data == "keyed":
            grouped.append(_keyed_item(text, item))
            continue
        if not grouped:
            raise _item_error(text, item, "expected `key=value`")
        key, values, (key_span, value_span) = grouped[-1]
        value, span = _value(text, item.children[0])
        start = value_span[0] if values else span[0]
        grouped[-1] = (key, values + [value], (key_span, (start, span[1])))
    return grouped


def _keyed_item(text: str, item: lark.Tree) -> tuple[str, list, tuple[Span, Span]]:
    key, equals, value_node = item.children
    key_span = (key.start_pos, key.end_pos)
    if value_node is None:  # `key=`: the empty list
        return str(key), [], (key_span, (equals.end_pos, equals.end_pos))
    value, value_span = _value(text, value_node)
    return str(key), [value], (key_span, value_span)


def _value(text: str, node: lark.Tree) -> tuple[Scalar, Span]:
    token = node.children[0]
    span = (token.start_pos, token.end_pos)
    if token.type == "WORD":
        return _classify_word(str(token)), span
    try:
        return json.loads(str(token), strict=False), span
    except json.JSONDecodeError as error:
        raise _invalid(text, span, f"bad string: {error.msg}") from None


def _item_error(text: str, item: lark.Tree, message: str) -> KernccError:
    token = item.children[0].children[0]
    return _invalid(text, (token.start_pos, token.end_pos), message)


# ---------------------------------------------------------------------------------------------
# Resolution: PipelineSpec -> pass instances, checked against the registry.

def resolve_pipeline(spec: PipelineSpec | str, reg: PassRegistry | None = None) -> tuple[Pass, ...]:
    """The pass instances a spec names, named pipelines expanded; KernccError lists every
    unknown pass or option and every bad value, each with a caret."""
    reg = registry() if reg is None else reg
    return _resolve(spec, reg, expand_named=True)


def _resolve(spec: PipelineSpec | str, reg: PassRegistry, expand_named: bool) -> tuple[Pass, ...]:
    if isinstance(spec, str) or spec.source is None:
        spec = parse_pipeline(str(spec))  # the text and spans the carets point into
    diags = Diagnostics()
    resolved = [_resolve_pass(ps, spec.source or "", reg, diags, expand_named)
                for ps in spec.passes]
    _check_writers_last(spec, resolved, diags)
    diags.raise_if_any(INVALID_PIPELINE)
    return tuple(p for passes in resolved for p in passes)


def _check_writers_last(spec: PipelineSpec, resolved: list[list[Pass]],
                        diags: Diagnostics) -> None:
    for ps, passes, after in zip(spec.passes, resolved, spec.passes[1:]):
        if any(getattr(p, "writes_output", False) for p in passes):
            diags.add(caret_diagnostic(spec.source or "", ps.span, f"pass `{ps.name}` writes "
                                       f"the output, so it comes last (`{after.name}` follows)"))


def _resolve_pass(ps: PassSpec, text: str, reg: PassRegistry, diags: Diagnostics,
                  expand_named: bool) -> list[Pass]:
    if expand_named and ps.name in reg.pipelines:
        return _expand_named(ps, text, reg, diags)
    cls = reg.get(ps.name)
    if cls is None:
        hint = _did_you_mean(ps.name, reg.names() + list(reg.pipelines))
        diags.add(caret_diagnostic(text, ps.name_span, f"unknown pass `{ps.name}`{hint}"))
        return []
    kwargs = _pass_kwargs(cls, ps, text, diags)
    if kwargs is None:
        return []
    return _construct(cls, kwargs, ps, text, diags)


def _expand_named(ps: PassSpec, text: str, reg: PassRegistry, diags: Diagnostics) -> list[Pass]:
    if ps.options:
        diags.add(caret_diagnostic(text, ps.span, f"named pipeline `{ps.name}` takes no options"))
        return []
    try:
        # Inside a named pipeline only passes are names: no expansion loops.
        return list(_resolve(reg.pipelines[ps.name], reg, expand_named=False))
    except KernccError as error:
        diags.extend(attrs.evolve(d, message=f"in named pipeline `{ps.name}`: {d.message}")
                     for d in error.diagnostics)
        return []


def _pass_kwargs(cls: type, ps: PassSpec, text: str, diags: Diagnostics) -> dict | None:
    infos = {info.key: info for info in pass_options(cls)}
    kwargs: dict[str, object] = {}
    before = len(diags)
    for (key, raw), (key_span, value_span) in zip(ps.options, ps.option_spans):
        info = infos.get(key)
        if info is None:
            diags.add(caret_diagnostic(text, key_span, _unknown_option(ps.name, key, infos)))
        elif info.field in kwargs:
            diags.add(caret_diagnostic(text, key_span, f"option `{key}` is given twice"))
        else:
            kwargs[info.field] = _checked_value(info, raw, ps.name, text, value_span, diags)
    return kwargs if len(diags) == before else None


def _unknown_option(pass_name: str, key: str, infos: dict[str, OptionInfo]) -> str:
    message = f"pass `{pass_name}` has no option `{key}`"
    hint = _did_you_mean(key, infos)
    if hint:
        return message + hint
    if not infos:
        return message + " (it takes no options)"
    return message + f" (options: {', '.join(infos)})"


def _checked_value(info: OptionInfo, raw: Value, pass_name: str, text: str, span: Span,
                   diags: Diagnostics) -> object:
    try:
        return convert_option(info, raw)
    except ValueError as error:
        message = f"option `{info.key}` of pass `{pass_name}` {error}"
        diags.add(caret_diagnostic(text, span, message + _value_hint(info, raw)))
        return None


_KIND_WORDS = {int: "an integer", bool: "true or false", str: "a string"}
_LIST_WORDS = {int: "a list of integers", str: "a list of strings"}


def convert_option(info: OptionInfo, raw: Value) -> object:
    """The field value for a spec value; ValueError ("expects ..., got ...") when it does not
    fit. Lists take one item or several; a string option takes any bare word as text."""
    if info.is_list:
        items = raw if isinstance(raw, tuple) else (raw,)
        converted = tuple(_convert_scalar(info.kind, item) for item in items)
        if None in converted:
            raise ValueError(f"expects {_LIST_WORDS[info.kind]}, got `{format_value(raw)}`")
        return converted
    value = None if isinstance(raw, tuple) else _convert_scalar(info.kind, raw)
    if value is None:
        got = "an empty list" if raw == () else f"`{format_value(raw)}`"
        raise ValueError(f"expects {_KIND_WORDS[info.kind]}, got {got}")
    return value


def _convert_scalar(kind: type, raw: Scalar) -> Scalar | None:
    if kind is str:
        return raw if isinstance(raw, str) else _format_scalar(raw)
    if kind is bool:
        return raw if isinstance(raw, bool) else None
    return raw if isinstance(raw, int) and not isinstance(raw, bool) else None


def _value_hint(info: OptionInfo, raw: Value) -> str:
    if info.kind is bool and isinstance(raw, str):
        return _did_you_mean(raw, ("true", "false"))
    return ""


def _construct(cls: type, kwargs: dict, ps: PassSpec, text: str, diags: Diagnostics) -> list:
    # A pass checks how its options combine (say, `at` with `stages`) when constructed.
    try:
        return [cls(**kwargs)]
    except KernccError as error:
        reasons = error.messages() or [error.headline]
    except (TypeError, ValueError) as error:
        reasons = [str(error)]
    for reason in reasons:
        diags.add(caret_diagnostic(text, ps.span, f"pass `{ps.name}`: {reason}"))
    return []


# ---------------------------------------------------------------------------------------------
# Scheduling: each pass preceded by the passes it requires.

@attrs.frozen
class ScheduledPass:
    """A pass as the runner runs it; `required_by` names the pass it was inserted for."""

    pass_: Any
    required_by: str | None = None


def schedule_passes(passes: Sequence[Any], reg: PassRegistry | None = None
                    ) -> tuple[ScheduledPass, ...]:
    """The passes in order, each preceded by the passes it requires that have not run yet
    (with default options, recursively); KernccError on an unknown or circular requirement,
    or a pass after one that writes the output."""
    reg = registry() if reg is None else reg
    schedule: list[ScheduledPass] = []
    for pass_ in passes:
        _schedule(pass_, None, reg, schedule, ())
    writers = [item.pass_.name for item in schedule[:-1] if getattr(item.pass_, "writes_output", False)]
    if writers:
        raise KernccError.single(f"pass `{writers[0]}` writes the output, so it comes last")
    return tuple(schedule)


def _schedule(pass_: Any, required_by: str | None, reg: PassRegistry,
              schedule: list[ScheduledPass], chain: tuple[str, ...]) -> None:
    if pass_.name in chain:
        cycle = " -> ".join(chain + (pass_.name,))
        raise KernccError.single(f"pass requirements form a cycle: {cycle}")
    for name in pass_.requires:
        if any(item.pass_.name == name for item in schedule):
            continue
        cls = reg.get(name)
        if cls is None:
            raise KernccError.single(f"pass `{pass_.name}` requires unknown pass `{name}`")
        _schedule(cls(), pass_.name, reg, schedule, chain + (pass_.name,))
    schedule.append(ScheduledPass(pass_, required_by))


# ---------------------------------------------------------------------------------------------
# Failures.

class PassFailed(KernccError):
    """A pass, or the verifier after it, rejected the IR: the pass's diagnostics under a
    headline that names the pass and the passes that ran before it."""

    def __init__(self, headline: str, diagnostics: Iterable[Diagnostic] = (), *,
                 pass_name: str = "", history: tuple[str, ...] = (), reproducer: str = "") -> None:
        super().__init__(headline, diagnostics)
        self.pass_name = pass_name
        self.history = history
        self.reproducer = reproducer


class InternalPassError(Exception):
    """A pass raised something other than a KernccError: a bug in kerncc. `__cause__` is the
    original exception; `str()` says which pass, after which, and how to reproduce it."""

    def __init__(self, pass_name: str, history: tuple[str, ...], reproducer: str,
                 error: BaseException) -> None:
        self.pass_name = pass_name
        self.history = history
        self.reproducer = reproducer
        self.error = error
        super().__init__(self.__str__())

    def __str__(self) -> str:
        return (f"internal error in pass `{self.pass_name}`{_after(self.history)}: "
                f"{type(self.error).__name__}: {self.error}\n"
                f"please report this bug with the reproducer:\n  {self.reproducer}")


def _after(history: tuple[str, ...]) -> str:
    return f" (after: {', '.join(history)})" if history else ""


def _failure_headline(pass_name: str, what: str, history: tuple[str, ...],
                      error: KernccError) -> str:
    headline = f"pass `{pass_name}` {what}{_after(history)}"
    # KernccError.single repeats its one message as headline; say it once.
    if error.diagnostics and error.headline not in error.messages():
        return f"{headline}: {error.headline.rstrip(':')}:"
    return headline + ":"


def reproducer(schedule: Sequence[ScheduledPass], index: int, input_name: str = "FILE",
               verify: bool = True) -> str:
    """`kerncc lower FILE -p SPEC`, SPEC being the schedule up to and including pass `index`."""
    spec = PipelineSpec(tuple(pass_spec(item.pass_) for item in schedule[:index + 1]))
    line = f"kerncc lower {shlex.quote(input_name)} -p {shlex.quote(str(spec))}"
    return line if verify else line + " --no-verify"


# ---------------------------------------------------------------------------------------------
# The runner.

def run_pipeline(ir: IRT, passes: Sequence[Any] | PipelineSpec | str,
                 instruments: Sequence[Instrument] = (), *, verify: bool = True,
                 reg: PassRegistry | None = None, input_name: str = "FILE") -> IRT:
    """Run the passes (instances, or a spec resolved here) on `ir` and return the result.

    Required passes are inserted first; after each pass the result is verified unless
    `verify=False`. Instruments see every pass: `before_*` hooks in list order, `after_*` hooks
    in reverse, so the last instrument sits closest to the pass (put timing last).
    Raises PassFailed or InternalPassError; `input_name` fills the reproducer's FILE.
    """
    reg = registry() if reg is None else reg
    if isinstance(passes, (str, PipelineSpec)):
        passes = resolve_pipeline(passes, reg)
    runner = _Runner(schedule_passes(passes, reg), tuple(instruments), verify, input_name)
    return runner.run(ir)


@attrs.define
class _Runner:
    schedule: tuple[ScheduledPass, ...]
    instruments: tuple[Instrument, ...]
    verify: bool
    input_name: str

    def run(self, ir: Any) -> Any:
        for instrument in self.instruments:
            instrument.before_pipeline(self.schedule, ir)
        try:
            for index in range(len(self.schedule)):
                ir = self._step(index, ir)
        finally:
            for instrument in reversed(self.instruments):
                instrument.after_pipeline()
        return ir

    def _step(self, index: int, ir: Any) -> Any:
        pass_ = self.schedule[index].pass_
        for instrument in self.instruments:
            instrument.before_pass(pass_, ir)
        after = self._guarded(index, ir, "failed", lambda: _checked_result(pass_, pass_.run(ir)))
        if self.verify:
            self._guarded(index, ir, "produced IR that fails verification", after.verify)
        for instrument in reversed(self.instruments):
            instrument.after_pass(pass_, ir, after)
        return after

    def _guarded(self, index: int, ir: Any, what: str, action: Callable[[], Any]) -> Any:
        pass_ = self.schedule[index].pass_
        try:
            return action()
        except KernccError as error:
            self._after_failed(pass_, ir, error)
            raise self._failed(index, what, error) from error
        except Exception as error:
            self._after_failed(pass_, ir, error)
            raise InternalPassError(pass_.name, self._history(index), self._reproducer(index),
                                    error) from error

    def _failed(self, index: int, what: str, error: KernccError) -> PassFailed:
        name, history = self.schedule[index].pass_.name, self._history(index)
        return PassFailed(_failure_headline(name, what, history, error),
                          error.diagnostics or [Diagnostic(error.headline)], pass_name=name,
                          history=history, reproducer=self._reproducer(index))

    def _history(self, index: int) -> tuple[str, ...]:
        return tuple(item.pass_.name for item in self.schedule[:index])

    def _reproducer(self, index: int) -> str:
        return reproducer(self.schedule, index, self.input_name, self.verify)

    def _after_failed(self, pass_: Any, ir: Any, error: BaseException) -> None:
        for instrument in reversed(self.instruments):
            instrument.after_failed(pass_, ir, error)


def _checked_result(pass_: Any, result: Any) -> Any:
    # A pass that forgets its `return` would otherwise fail later, far from the cause.
    if not callable(getattr(result, "verify", None)) or not callable(getattr(result, "to_text",
                                                                             None)):
        raise TypeError(f"pass `{pass_.name}` returned {type(result).__name__}, not an IR")
    return result


# ---------------------------------------------------------------------------------------------
# Instruments.

class Instrument:
    """Hooks around passes (MLIR's PassInstrumentation). Every hook is optional."""

    def before_pipeline(self, schedule: tuple[ScheduledPass, ...], ir: Any) -> None:
        """Before the first pass, with the full schedule (required passes inserted)."""

    def before_pass(self, pass_: Any, ir: Any) -> None:
        """Before `pass_` runs on `ir`."""

    def after_pass(self, pass_: Any, ir_before: Any, ir_after: Any) -> None:
        """After `pass_` ran and its result verified."""

    def after_failed(self, pass_: Any, ir: Any, error: BaseException) -> None:
        """After `pass_` (or the verifier after it) raised `error` on `ir`."""

    def after_pipeline(self) -> None:
        """After the last pass, or after a failure."""


@attrs.define
class _Printing(Instrument):
    out: TextIO | None = attrs.field(default=None, kw_only=True)

    def write(self, text: str) -> None:
        # sys.stderr at write time, not at construction: MLIR prints dumps to stderr, and
        # tests and the CLI may swap the stream in between.
        (self.out or sys.stderr).write(text)

    def dump(self, pass_: Any, text: str) -> None:
        self.write(f"// -----// IR Dump After {pass_spec(pass_)} //----- //\n")
        self.write(text if text.endswith("\n") else text + "\n")


@attrs.define
class PrintIRAfter(_Printing):
    """`--print-ir-after=a,b`: print the IR after each pass with one of these names."""

    names: frozenset[str] = attrs.field(converter=frozenset)

    def after_pass(self, pass_: Any, ir_before: Any, ir_after: Any) -> None:
        if pass_.name in self.names:
            self.dump(pass_, ir_after.to_text())


@attrs.define
class PrintIRAfterAll(_Printing):
    """`--print-ir-after-all`: print the IR after every pass."""

    def after_pass(self, pass_: Any, ir_before: Any, ir_after: Any) -> None:
        self.dump(pass_, ir_after.to_text())


@attrs.define
class PrintIRAfterChange(_Printing):
    """`--print-ir-after-change`: print the IR after a pass only when its text changed."""

    def after_pass(self, pass_: Any, ir_before: Any, ir_after: Any) -> None:
        text = ir_after.to_text()
        if text != ir_before.to_text():
            self.dump(pass_, text)


@attrs.define
class TimePasses(_Printing):
    """`--time-passes`: a table of wall time per pass, printed when the pipeline ends."""

    clock: Callable[[], float] = attrs.field(default=time.perf_counter, kw_only=True)
    _schedule: tuple[ScheduledPass, ...] = attrs.field(default=(), init=False)
    _rows: list[tuple[str, float, str]] = attrs.field(factory=list, init=False)
    _start: float = attrs.field(default=0.0, init=False)

    def before_pipeline(self, schedule: tuple[ScheduledPass, ...], ir: Any) -> None:
        self._schedule, self._rows = schedule, []

    def before_pass(self, pass_: Any, ir: Any) -> None:
        self._start = self.clock()

    def after_pass(self, pass_: Any, ir_before: Any, ir_after: Any) -> None:
        self._add_row(pass_, "")

    def after_failed(self, pass_: Any, ir: Any, error: BaseException) -> None:
        self._add_row(pass_, "failed")

    def _add_row(self, pass_: Any, note: str) -> None:
        elapsed = self.clock() - self._start
        required_by = self._schedule[len(self._rows)].required_by
        if required_by:
            note = ", ".join(filter(None, [f"inserted: required by {required_by}", note]))
        self._rows.append((pass_.name, elapsed, note))

    def after_pipeline(self) -> None:
        self.write(self.table())

    def table(self) -> str:
        """The report: one row per pass run, then the total."""
        total = sum(seconds for _, seconds, _ in self._rows)
        width = max([len("total")] + [len(name) for name, _, _ in self._rows])
        lines = ["pass timing (wall clock; a pass's time includes verifying its result)",
                 f"  {'pass':<{width}}  {'wall ms':>10}  {'%':>6}"]
        for name, seconds, note in self._rows + [("total", total, "")]:
            share = 100.0 * seconds / total if total else 0.0
            row = f"  {name:<{width}}  {seconds * 1e3:>10.3f}  {share:>5.1f}%"
            lines.append(f"{row}  {note}" if note else row)
        return "\n".join(lines) + "\n"


@attrs.define
class DumpDir(Instrument):
    """`--dump-dir DIR`: write `00-input.kir`, then `NN-<pass>.kir` after each pass. Files a
    longer earlier run left behind are not removed."""

    directory: Path = attrs.field(converter=Path)
    _count: int = attrs.field(default=0, init=False)

    def make(self) -> DumpDir:
        """The directory, made now: `instruments_from_args` makes it before any pass runs, so
        that a bad --dump-dir is reported as itself and not at a place in the input."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise self._cannot(err) from None
        return self

    def before_pipeline(self, schedule: tuple[ScheduledPass, ...], ir: Any) -> None:
        self.make()
        self._count = 0
        self._write("input", ir)

    def after_pass(self, pass_: Any, ir_before: Any, ir_after: Any) -> None:
        self._count += 1
        self._write(pass_.name, ir_after)

    def _write(self, label: str, ir: Any) -> None:
        try:
            (self.directory / f"{self._count:02d}-{label}.kir").write_text(ir.to_text())
        except OSError as err:
            raise self._cannot(err) from None

    def _cannot(self, err: OSError) -> KernccError:
        """A directory that cannot be made or written is the command line's problem."""
        return KernccError.single(f"--dump-dir `{self.directory}`: {err.strerror or err}")


def instruments_from_args(print_ir_after: Sequence[str] | None, print_ir_after_all: bool,
                          print_ir_after_change: bool, time_passes: bool, dump_dir: str | None,
                          out: TextIO | None = None, reg: PassRegistry | None = None
                          ) -> list[Instrument]:
    """The instruments the CLI flags ask for. `print_ir_after` items may hold comma lists;
    unknown pass names raise KernccError with a did-you-mean. Timing comes last so that it
    measures the pass alone."""
    reg = registry() if reg is None else reg
    instruments: list[Instrument] = []
    if print_ir_after:
        instruments.append(PrintIRAfter(_known_names(print_ir_after, reg), out=out))
    if print_ir_after_all:
        instruments.append(PrintIRAfterAll(out=out))
    if print_ir_after_change:
        instruments.append(PrintIRAfterChange(out=out))
    if dump_dir is not None:
        instruments.append(DumpDir(dump_dir).make())
    if time_passes:
        instruments.append(TimePasses(out=out))
    return instruments


def _known_names(items: Sequence[str], reg: PassRegistry) -> list[str]:
    names = [name.strip() for item in items for name in item.split(",") if name.strip()]
    unknown = [name for name in names if name not in reg]
    if unknown:
        raise KernccError("invalid --print-ir-after:", [
            Diagnostic(f"unknown pass `{name}`{_did_you_mean(name, reg.names())}")
            for name in unknown])
    return names


# ---------------------------------------------------------------------------------------------
# The pass listing (`kerncc passes`); the generated reference is kerncc.docgen's.

def default_text(info: OptionInfo) -> str:
    """An option's default as `kerncc passes` and docs/passes.md show it."""
    if info.default is None:
        return "none"
    if info.default == ():
        return "empty"
    return format_value(info.default)  # type: ignore[arg-type]


def describe_passes(reg: PassRegistry | None = None) -> str:
    """`kerncc passes`: each pass with its summary, options (type, default, help), requires;
    then the named pipelines."""
    reg = registry() if reg is None else reg
    blocks = [_describe_pass(cls) for cls in reg]
    if reg.pipelines:
        blocks.append("\n".join(["named pipelines:"] + [
            f"  {name} = {text}" for name, text in sorted(reg.pipelines.items())]))
    return "\n\n".join(blocks) + "\n"


def _describe_pass(cls: type) -> str:
    lines = [f"{cls.name}: {pass_summary(cls)}"]
    rows = [(f"{i.key}={i.type_text}", f"(default: {default_text(i)})", i.help)
            for i in pass_options(cls)]
    widths = [max((len(row[c]) for row in rows), default=0) for c in range(2)]
    lines += [f"    {a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows]
    requires = getattr(cls, "requires", ())
    if requires:
        lines.append(f"    requires: {', '.join(requires)}")
    return "\n".join(lines)
