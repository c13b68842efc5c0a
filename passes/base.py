"""The pass framework's leaf (`kerncc.passes.base`): the Pass base class, `@register` and the
registry, options, and the named pipelines.

A pass module (`passes/<name>.py`) defines one frozen attrs class and decorates it:

    @register
    @attrs.frozen
    class Cut(Pass):
        \"\"\"Split every driven program into pipeline stages at call indices, labels, or balanced points.\"\"\"
        name = "cut"
        requires = ()
        stages: int = attrs.field(default=0, metadata={
            "help": "choose N-1 balanced points (plain `cut` means 2)"})

        def run(self, ir): ...

and its module name goes into `PASS_MODULES`; the package (`passes/__init__.py`) imports
those modules. This module imports no pass and nothing of kerncc.pipeline, so that the passes,
the package that collects them and the pipeline that runs them import it and never each other.
`register` checks the class's shape when the module is imported, so a malformed pass fails at
once rather than when someone first spells it in a pipeline. Option metadata (`OptionInfo`) is
read from the attrs fields: kebab-case key, type, default, one-line help.
"""

from __future__ import annotations

import functools
import inspect
import re
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import attrs

__all__ = [
    "NAMED_PIPELINES", "PASS_MODULES", "REGISTRY", "OptionInfo", "Pass", "PassRegistry",
    "pass_options", "pass_summary", "register",
]

# Modules under kerncc.passes that define registered passes, in the order a pipeline runs them;
# the package imports them in this order.
PASS_MODULES: tuple[str, ...] = ("liveness", "cut", "share_states", "slicing", "plan_memory",
                                 "emit")

# A pipeline spec that is exactly one of these names (or names one as an element) expands to it.
NAMED_PIPELINES: dict[str, str] = {
    "default": "liveness,cut,share-states,slice-once,slice-derive,plan-memory",
}

_PACKAGE = __name__.rpartition(".")[0]  # kerncc.passes
_KEBAB = re.compile(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
_SCALAR_TYPES = (int, bool, str)


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


@attrs.frozen
class OptionInfo:
    """One option of a pass, as a pipeline spec spells it and as the attrs field holds it."""

    key: str  # kebab-case, as written in a spec: `at-label`
    field: str  # the attrs field: `at_label`
    kind: type  # int, bool or str: the type of the value or of each list item
    is_list: bool  # tuple[kind, ...]
    optional: bool  # `kind | None`: None means "not given"
    default: object
    help: str
    shown_default: str | None = None  # metadata `default_text`: a default that depends on others

    @property
    def type_text(self) -> str:
        """The type as `kerncc passes` shows it: `int`, `str`, `int,...` for a list."""
        return f"{self.kind.__name__},..." if self.is_list else self.kind.__name__


def pass_summary(cls: type) -> str:
    """The first line of a pass's docstring."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    return doc.splitlines()[0] if doc else ""


@functools.cache
def pass_options(cls: type) -> tuple[OptionInfo, ...]:
    """The options of a pass class, in field order; TypeError when a field is not a valid one."""
    attrs.resolve_types(cls)  # annotations are strings under `from __future__ import annotations`
    return tuple(_option_info(cls, field) for field in attrs.fields(cls))


def _option_info(cls: type, field: attrs.Attribute) -> OptionInfo:
    where = f"option `{field.name}` of pass class {cls.__qualname__}"
    if not field.init:
        raise TypeError(f"{where}: options must be init fields")
    help_text = field.metadata.get("help")
    if not help_text:
        raise TypeError(f"{where}: give a one-line help in metadata={{'help': ...}}")
    kind, is_list, optional = _option_type(field.type, where)
    key = field.name.replace("_", "-")
    return OptionInfo(key, field.name, kind, is_list, optional, _default(field, where), help_text,
                      field.metadata.get("default_text"))


def _option_type(tp: object, where: str) -> tuple[type, bool, bool]:
    """(item kind, is a list, may be None) of a supported option type, else TypeError."""
    optional = False
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"{where}: unsupported type {tp!r}")
        tp, optional = rest[0], True
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis and args[0] in (int, str):
            return args[0], True, optional
    if tp in _SCALAR_TYPES:
        return typing.cast(type, tp), False, optional
    raise TypeError(f"{where}: type {tp!r} is not one of int, bool, str, tuple[int, ...], "
                    "tuple[str, ...] (optionally `| None`)")


def _default(field: attrs.Attribute, where: str) -> object:
    # Every option needs a default: a pass named without options (`cut`) must construct.
    default = field.default
    if default is attrs.NOTHING:
        raise TypeError(f"{where}: options need a default")
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        if default.takes_self:
            raise TypeError(f"{where}: a default may not depend on other options")
        return default.factory()
    return default


class PassRegistry:
    """Registered pass classes by name, and the named pipelines that expand to specs."""

    def __init__(self, pipelines: Mapping[str, str] | None = None) -> None:
        self._passes: dict[str, type] = {}
        self.pipelines: dict[str, str] = dict(pipelines or {})

    def register(self, cls: type) -> type:
        """Class decorator: check the pass's shape and add it under `cls.name`."""
        _check_pass_class(cls)
        if cls.name in self._passes and self._passes[cls.name] is not cls:
            raise ValueError(f"pass `{cls.name}` is registered twice "
                             f"({self._passes[cls.name].__qualname__} and {cls.__qualname__})")
        if cls.name in self.pipelines:
            raise ValueError(f"pass `{cls.name}` has the name of a named pipeline")
        self._passes[cls.name] = cls
        return cls

    def get(self, name: str) -> type | None:
        return self._passes.get(name)

    def names(self) -> list[str]:
        return sorted(self._passes)

    def __contains__(self, name: object) -> bool:
        return name in self._passes

    def __iter__(self) -> Iterator[type]:
        """The pass classes, by name."""
        return iter(self._passes[name] for name in self.names())

    def in_order(self) -> list[type]:
        """The pass classes in the order a pipeline runs them: by their module's place in
        `PASS_MODULES`, then as each module defines them; other classes after, as registered.
        (Not plain registration order: that follows whichever module was imported first.)"""
        def rank(cls: type) -> int:
            package, _, module = cls.__module__.rpartition(".")
            if package != _PACKAGE or module not in PASS_MODULES:
                return len(PASS_MODULES)
            return PASS_MODULES.index(module)

        return sorted(self._passes.values(), key=rank)


def _check_pass_class(cls: type) -> None:
    what = f"pass class {cls.__qualname__}"
    if not attrs.has(cls):
        raise TypeError(f"{what} must be an attrs class (@attrs.frozen)")
    # A frozen attrs class defines its own __setattr__; a mutable one inherits object's.
    if cls.__setattr__ is object.__setattr__:
        raise TypeError(f"{what} must be frozen (@attrs.frozen)")
    field_names = {f.name for f in attrs.fields(cls)}
    if {"name", "requires"} & field_names:
        raise TypeError(f"{what}: `name` and `requires` are class attributes, not fields "
                        "(leave them unannotated or use ClassVar)")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not _KEBAB.fullmatch(name):
        raise TypeError(f"{what} needs a kebab-case class attribute `name`, got {name!r}")
    _check_requires(what, getattr(cls, "requires", ()))
    if not pass_summary(cls):
        raise TypeError(f"{what} needs a docstring; its first line is the pass summary")
    if not callable(getattr(cls, "run", None)):
        raise TypeError(f"{what} needs a method run(self, ir) -> ir")
    pass_options(cls)


def _check_requires(what: str, requires: object) -> None:
    if not isinstance(requires, tuple) or not all(isinstance(r, str) for r in requires):
        raise TypeError(f"{what}: `requires` must be a tuple of pass names, got {requires!r}")


REGISTRY = PassRegistry(NAMED_PIPELINES)
register = REGISTRY.register
