"""Pass pipelines: resolve a `-p` spec against the registry, then run it with instruments.

The shape follows xDSL and MLIR (docs: STYLE.md). A spec such as
`cut{at=218,290},slice-derive,emit{out=stages}` parses (kerncc.pipeline.spec) into a
`PipelineSpec` that prints back to an equal spec. `resolve_pipeline` checks it against the
registry (kerncc.passes) before anything runs: unknown passes and options, and values of the
wrong type, are reported together, each with a caret under the text and a did-you-mean.
`run_pipeline` runs the passes in order, inserting the passes each one `requires`, verifies the
IR after each, and calls instruments around every pass (MLIR's PassInstrumentation):
`PrintIRAfter`, `PrintIRAfterAll`, `PrintIRAfterChange`, `TimePasses`, `DumpDir`.
The Pass base lives in kerncc.passes.base, the scheduler in kerncc.pipeline.base, the spec's
syntax in kerncc.pipeline.spec and the instruments in kerncc.pipeline.instruments; the package
`kerncc.pipeline` re-exports all of them.

A pass that raises a KernccError fails as `PassFailed`, whose headline names the pass and the
passes that ran before it; any other exception is a bug in kerncc and comes out as
`InternalPassError`, carrying a command line that reproduces it.
The IR is opaque here: anything with `to_text() -> str` and `verify() -> None`.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from kerncc.diagnostics import Diagnostic, Diagnostics, KernccError
from kerncc.pipeline.base import IRT, PassIR, ScheduledPass, schedule_passes
from kerncc.pipeline.instruments import (
    DumpDir,
    Instrument,
    PrintIRAfter,
    PrintIRAfterAll,
    PrintIRAfterChange,
    TimePasses,
    instruments_from_args,
)
from kerncc.passes import registry
from kerncc.passes.base import OptionInfo, Pass, PassRegistry, pass_options, pass_summary
from kerncc.pipeline.spec import (
    INVALID_PIPELINE,
    PassSpec,
    PipelineSpec,
    Scalar,
    Span,
    Value,
    _did_you_mean,
    _format_scalar,
    caret_diagnostic,
    format_value,
    parse_pipeline,
    pass_spec,
)

__all__ = [
    "PassIR",
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
        if getattr(ir, "pipeline", None) == "" and attrs.has(type(ir)):
            # the spec that ran, as emit records it (`kerncc check` runs it again)
            ir = attrs.evolve(ir, pipeline=str(passes))
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
# The pass listing (`kerncc passes`); the generated reference is kerncc.pipeline.docgen's.

def default_text(info: OptionInfo) -> str:
    """An option's default as `kerncc passes` and docs/passes.md show it."""
    if info.shown_default is not None:
        return info.shown_default
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

