"""Text in, text out: a model folder's Hugging Face tokenizer and chat template.

`TextCodec.from_dir(dir)` reads `tokenizer.json` with the Hugging Face `tokenizers` library
(an optional dependency: `pip install 'kerncc[hf]'`; without it text features fail with that
command), the chat template and the eos ids; it returns None when the folder has no
tokenizer.json. Its API, used by `kerncc run` and the serving engine, and how templates render
are docs/hf-import.md's. Nothing in a model folder is executed beyond the sandboxed template,
and a render is bounded (MAX_STEPS, MAX_TEXT, MAX_ITEMS, MAX_WORK, RENDER_SECONDS, and a
caller's stop), so a hostile template is an error within seconds, not a hang or a process out
of memory. tokenizer.json and chat_template.jinja are read bounded (TOKENIZER_LIMIT,
TEMPLATE_LIMIT, or `--max-file-size` when given). Every problem is a KernccError naming the file.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from kerncc.diagnostics import Diagnostic, KernccError, Location
from kerncc.files import parse_json, read_json
from kerncc.hf.config import token_ids

INSTALL = "pip install 'kerncc[hf]'"
TOKENIZER, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                  "cls_token", "mask_token")
REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise KernccError.single(f"text needs the Hugging Face `tokenizers` library: {INSTALL}"
                                 ) from None
    return tokenizers


def _file_error(path: Path, message: str, where: str = "") -> KernccError:
    return KernccError(f"{path}: {message}", [Diagnostic(message, Location(where, file=str(path)))])


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class TextStream:
    """Incremental decoding: each `push(id)` returns the text that id completes.

    Decodes a short window of recent ids and hands out only text past what was already
    handed out; text ending in an incomplete UTF-8 sequence waits for the next id, so a
    multi-byte character split over tokens never comes out broken.
    """

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # ids already turned into text

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        before = self.codec.decode(self.ids[self.prefix:self.read])
        now = self.codec.decode(self.ids[self.prefix:])
        if len(now) <= len(before) or now.endswith(REPLACEMENT):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before):]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete sequence at the end), as decoded."""
        before = self.codec.decode(self.ids[self.prefix:self.read])
        now = self.codec.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return now[len(before):]


class TextCodec:
    """A model folder's tokenizer, chat template and eos ids (see the module docstring)."""

    def __init__(self, directory: Path, tokenizer: Any, template: str | None,
                 template_file: Path | None, specials: dict[str, str],
                 eos_token_ids: tuple[int, ...], vocab_size: int | None) -> None:
        self.directory = directory
        self.tokenizer = tokenizer
        self.template = template
        self.template_file = template_file
        self.specials = specials
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size  # the model's (config.json), which ids must stay below
        self._compiled: Any = None
        if template is not None:
            self._compiled = _compile(template, template_file)

    # ---------------------------------------------------------------------- loading

    @classmethod
    def from_dir(cls, path: str | Path, pins: Any = None) -> TextCodec | None:
        """The codec of a model folder, or None when it has no tokenizer.json.

        `pins` (kerncc.bundle.reader.TokenizerPins: the files a bundle was lowered with) is
        asked `folder(dir)` before anything is read and `file(path, bytes)` for each file's
        bytes as read, and refuses a file that differs."""
        directory = Path(path)
        tokenizer_path = directory / TOKENIZER
        if not tokenizer_path.is_file():
            return None
        if pins is not None:
            pins.folder(directory)
        with _pinned(pins):
            tokenizer = _load_tokenizer(tokenizer_path)
            config = _optional_json(directory / TOKENIZER_CONFIG, "tokenizer config")
            template, template_file = _template(directory, config)
            specials = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k)))}
            model = _optional_json(directory / "config.json", "model config")
            vocab = model.get("vocab_size")
            eos = _eos_ids(directory, model, specials, tokenizer)
        return cls(directory, tokenizer, template, template_file, specials, eos,
                   vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None)

    @property
    def has_chat_template(self) -> bool:
        return self._compiled is not None

    # ---------------------------------------------------------------------- ids and text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`, as transformers' `tokenizer(text)` gives them: special tokens
        written in the text are recognised, and the tokenizer's post-processor adds its own
        (Llama 3's <|begin_of_text|>) unless `add_special_tokens` is False, which is how text
        rendered by `apply_chat_template` (carrying its own) is encoded."""
        ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        if self.vocab_size is not None and ids and max(ids) >= self.vocab_size:
            bad = max(ids)
            raise _file_error(self.directory / TOKENIZER,
                              f"the text encodes to id {bad}, past the model's vocabulary of "
                              f"{self.vocab_size} (config.json vocab_size)")
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode([int(i) for i in ids],
                                     skip_special_tokens=skip_special_tokens)

    def stream(self) -> TextStream:
        return TextStream(self)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, **variables: Any) -> str:
        """The prompt text of `messages` ([{"role", "content"}, ...]) by the chat template;
        `variables` reach the template as transformers passes its extra arguments (`tools`,
        Qwen3's `enable_thinking`, ...)."""
        return self.render_chat(messages, variables, add_generation_prompt)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], variables: Mapping[str, Any],
                    add_generation_prompt: bool = True, stop: Callable[[], bool] | None = None,
                    seconds: float | None = None) -> str:
        """apply_chat_template's text, the render ended (a KernccError) once `stop()` is true
        or after `seconds` (default RENDER_SECONDS): the server stops the render of a client
        that left."""
        if self._compiled is None:
            raise KernccError.single(f"{self.directory}: the tokenizer has no chat template "
                                     f"({TOKENIZER_CONFIG} `chat_template` or {TEMPLATE_FILE})")
        budget = _Budget(RENDER_SECONDS if seconds is None else seconds, stop)
        try:
            return _render(self._compiled, {**self.specials, **variables,
                                            "messages": [dict(m) for m in messages],
                                            "add_generation_prompt": add_generation_prompt},
                           budget)
        except Exception as err:  # noqa: BLE001 - raise_exception, or any bad expression
            where = self.template_file or self.directory / TOKENIZER_CONFIG
            why = str(err) or type(err).__name__  # a MemoryError says nothing by itself
            raise _file_error(where, f"the chat template failed: {why}", "/chat_template"
                              ) from None


# ---------------------------------------------------------------------------------------------
# Reading the folder


# The largest tokenizer.json and chat template read (a published tokenizer.json is 2-12 MB, a
# template a few KB); `--max-file-size` given on the command line sets both instead.
TOKENIZER_LIMIT = 64 << 20
TEMPLATE_LIMIT = 1 << 20


# The pins of the files being read (TextCodec.from_dir's `pins`), or None: every file the codec
# reads passes its bytes, as read, to them (so what is checked is what is used).
_PINS: contextvars.ContextVar[Any] = contextvars.ContextVar("kerncc_tokenizer_pins",
                                                            default=None)


@contextlib.contextmanager
def _pinned(pins: Any) -> Iterator[None]:
    token = _PINS.set(pins)
    try:
        yield
    finally:
        _PINS.reset(token)


def _read_bounded(path: Path, what: str, default: int | None) -> str:
    """The text of a regular file of at most `default` bytes (or --max-file-size, given;
    None: --max-file-size's value), checked against the pins being read with; a refusal names
    the file."""
    from kerncc.files import FileRefused, limit_or, read_regular

    try:
        data = read_regular(path, what, None if default is None else limit_or(default))
    except FileRefused as err:
        raise _file_error(path, err.message) from None
    pins = _PINS.get()
    if pins is not None:
        pins.file(path, data)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _file_error(path, f"cannot read: {err}") from None


def check_files(directory: str | Path) -> None:
    """Read the tokenizer files of a model folder under their bounds (`kerncc import`: a file
    run and serve would refuse as too large, or as no regular file, is refused there first)."""
    directory = Path(directory)
    bounds = ((TOKENIZER, "tokenizer.json", TOKENIZER_LIMIT),
              (TEMPLATE_FILE, "chat template", TEMPLATE_LIMIT),
              (TOKENIZER_CONFIG, "tokenizer config", None),
              ("generation_config.json", "generation config", None))
    for name, what, limit in bounds:
        path = directory / name
        if path.exists() or path.is_symlink():
            _read_bounded(path, what, limit)


def _load_tokenizer(path: Path) -> Any:
    tokenizers = _tokenizers()
    text = _read_bounded(path, "tokenizer.json", TOKENIZER_LIMIT)
    try:
        return tokenizers.Tokenizer.from_str(text)
    except Exception as err:  # noqa: BLE001 - the library raises plain Exceptions
        raise _file_error(path, f"not a tokenizer the `tokenizers` library reads: {err}"
                          ) from None


def _optional_json(path: Path, what: str) -> dict:
    if not path.is_file():
        return {}
    raw = read_json(path, what) if _PINS.get() is None else \
        parse_json(path, _read_bounded(path, what, None), what)
    if not isinstance(raw, dict):
        raise _file_error(path, f"the {what} is not a JSON object")
    return raw


def _template(directory: Path, config: dict) -> tuple[str | None, Path | None]:
    """The chat template: chat_template.jinja, else tokenizer_config.json's (a string, or a
    list of {name, template} whose `default` entry counts)."""
    file = directory / TEMPLATE_FILE
    if file.is_file():
        return _read_bounded(file, "chat template", TEMPLATE_LIMIT), file
    value = config.get("chat_template")
    where = directory / TOKENIZER_CONFIG
    if value is None:
        return None, None
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value
                 if isinstance(t, dict) and isinstance(t.get("name"), str)}
        value = named.get("default")
    if not isinstance(value, str):
        raise _file_error(where, "`chat_template` must be a string or a list with a `default` "
                          "template", "/chat_template")
    return value, where


def _generation_extension() -> type:
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it for
    its masks): here the body renders as is."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = frozenset({"generation"})

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            from jinja2 import nodes

            return nodes.Scope(body, lineno=lineno)

    return Generation


# Bounds on one render, far past any published template (they loop over messages and tools and
# write at most a few MB), so that a hostile one cannot hang the process or fill its memory.
MAX_STEPS = 1_000_000  # loop iterations, calls, filters and operations of one render
MAX_TEXT = 1 << 24  # characters of the output, of a string, or of a width given to a call
MAX_ITEMS = 1 << 20  # items of a list, tuple or dict a render builds
# What one render may build in all: each call, filter and operation is charged the size of
# what it makes (a character a unit, a list item 8: a pointer), so a loop that builds a big
# value again and again (`('a' * 16000000)|list` 99,999 times) stops after a few.
MAX_WORK = 1 << 28
RENDER_SECONDS = 10.0  # wall-clock time of one render (checked at every step)
MAX_POWER_BITS = 1 << 16  # bits of an integer power
# Where a template can ask for a width: %-formats (`%9s`, `%.9s`, `%*s`), str.format specs
# (`{:9}`), the str methods and the filters that pad to a width or repeat to a count.
_PERCENT_WIDTH = re.compile(r"%[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?")
_FORMAT_WIDTH = re.compile(r"\{[^{}]*:[^{}\d]*(\d*)(?:\.(\d*))?")
WIDE_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})
WIDE_FILTERS = frozenset({"center", "indent", "batch", "slice", "format"})
# Filters and str methods that build one item per item (or character) of their input: refused
# before they run when that input is past MAX_ITEMS (the list would be allocated first).
LISTING_FILTERS = frozenset({"list", "batch", "slice", "sort", "unique", "map", "select",
                             "reject", "selectattr", "rejectattr", "groupby", "dictsort",
                             "join", "reverse", "items"})
SPLITTING_METHODS = frozenset({"split", "rsplit", "splitlines"})


class TemplateLimit(Exception):
    """A render went past one of the bounds above."""


class TemplateStopped(TemplateLimit):
    """A render ended from outside (its client left, the server is shutting down)."""


class _Budget:
    """What one render may still do: steps, work (the sizes of what it built) and time; and
    whether it was asked to stop. Every loop iteration, call, filter and intercepted
    operation goes through `tick`."""

    def __init__(self, seconds: float = RENDER_SECONDS,
                 stop: Callable[[], bool] | None = None) -> None:
        self.steps = MAX_STEPS
        self.work = MAX_WORK
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.stop = stop

    def tick(self, cost: int = 0) -> None:
        self.steps -= 1
        self.work -= cost
        if self.steps < 0:
            raise TemplateLimit(f"it took more than {MAX_STEPS} steps (loop iterations, calls, "
                                "filters and operations), kerncc's limit")
        if self.work < 0:
            raise TemplateLimit(f"it built more than {MAX_WORK} characters or items in all, "
                                "kerncc's limit")
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"it ran for more than {self.seconds:g} seconds, kerncc's limit")
        if self.stop is not None and self.stop():
            raise TemplateStopped("its render was stopped: the client left or the server is "
                                  "shutting down")

    def made(self, value: Any) -> Any:
        """`value`, built by a call, filter or operation: refused past the size bounds, and
        charged to the render's work."""
        self.tick(_cost(_check_size(value)))
        return value

    def loop(self, iterable: Any) -> Iterator[Any]:
        for item in iterable:
            self.tick()
            yield item

    def concat(self, *parts: Any) -> str:
        """`a ~ b`, refused before it joins more than MAX_TEXT characters."""
        texts = [str(p) for p in parts]
        if sum(map(len, texts)) > MAX_TEXT:
            raise TemplateLimit(f"it built a value of more than {MAX_TEXT} items, kerncc's "
                                "limit")
        return "".join(texts)  # charged by the call that ran this


# The budget of the render running on this thread (calls, filters and operations find it here:
# a filter is not handed the template's context).
_current: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("kerncc_budget",
                                                                         default=None)


def _made(value: Any) -> Any:
    """`value` through the current render's budget (size-checked alone outside a render)."""
    budget = _current.get()
    return _check_size(value) if budget is None else budget.made(value)


def _cost(value: Any) -> int:
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return 8 * len(value)
    return 0


def _check_size(value: Any) -> Any:
    """What an operation made, refused when past MAX_TEXT characters or MAX_ITEMS items: step
    by step a template can only double what it holds (`s ~ s`, `s + s`, `[s, s]|join`), so
    checking every result bounds the memory of a render to a small multiple of MAX_TEXT."""
    if isinstance(value, str) and len(value) > MAX_TEXT:
        raise TemplateLimit(f"it built a value of more than {MAX_TEXT} items, kerncc's limit")
    if isinstance(value, (list, tuple, dict, set, frozenset)) and len(value) > MAX_ITEMS:
        raise TemplateLimit(f"it built a list of more than {MAX_ITEMS} items, kerncc's limit")
    return value


def _check_items(value: Any) -> None:
    """A filter about to build a list of one item per item of `value`: refused first."""
    try:
        size = len(value)
    except TypeError:  # a generator: its items pass through the budget one by one
        return
    if size > MAX_ITEMS:
        raise TemplateLimit(f"a list of more than {MAX_ITEMS} items, kerncc's limit")


def _check_join(value: Any, separator: Any) -> None:
    """`join` makes the sum of its items' lengths: known before it runs."""
    if isinstance(value, (list, tuple)) and len(value) <= MAX_ITEMS:
        sep = len(separator) if isinstance(separator, str) else 0
        size = sum(len(v) for v in value if isinstance(v, str)) + sep * max(0, len(value) - 1)
        if size > MAX_TEXT:
            raise TemplateLimit(f"a join making more than {MAX_TEXT} characters, kerncc's "
                                "limit")


def _check_widths(widths: Iterable[Any]) -> None:
    """A width past MAX_TEXT would be allocated before anything could look at the result."""
    if any(isinstance(w, int) and not isinstance(w, bool) and w > MAX_TEXT for w in widths):
        raise TemplateLimit(f"a width past {MAX_TEXT} characters, kerncc's limit")


def _format_widths(pattern: re.Pattern[str], text: str, values: Any) -> list[Any]:
    """The widths a format string asks for; a `*` takes its width from the values."""
    specs = [w for m in pattern.finditer(text) for w in m.groups() if w]
    star = [] if "*" not in specs else list(values) if isinstance(values, tuple) else [values]
    return [int(w) for w in specs if w != "*"] + star


def _check_replace(text: Any, old: Any, new: Any) -> None:
    """`replace` can multiply a string by len(new) in one step: its size is known first."""
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str) and old \
            and len(text) + text.count(old) * (len(new) - len(old)) > MAX_TEXT:
        raise TemplateLimit(f"a replace making more than {MAX_TEXT} characters, kerncc's limit")


def _check_call(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """What a str method is asked to make (`'x'.ljust(n)`, `s.replace(a, b)`), before it runs."""
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return
    if name == "replace" and len(args) >= 2:
        _check_replace(owner, args[0], args[1])
    elif name in SPLITTING_METHODS and len(owner) > MAX_ITEMS:
        sep = args[0] if args and isinstance(args[0], str) and args[0] else None
        pieces = owner.count(sep) if sep else sum(owner.count(c) for c in " \t\n\r\x0b\x0c")
        if pieces >= MAX_ITEMS:
            raise TemplateLimit(f"a split into more than {MAX_ITEMS} pieces, kerncc's limit")
    elif name in WIDE_METHODS:
        _check_widths([*args, *kwargs.values()])


def _bounded_format(text: str, wrapped: Any) -> Any:
    """str.format as the sandbox wraps it, its widths checked first: those written in the
    string (`{:9}`) and, where a spec nests a field (`{:{}}`), any number it is given."""
    _check_widths(_format_widths(_FORMAT_WIDTH, text, ()))

    def bounded(*args: Any, **kwargs: Any) -> Any:
        if ":{" in text:
            values = [*args, *kwargs.values()]
            _check_widths(values + [v for a in values if isinstance(a, dict) for v in a.values()])
        return wrapped(*args, **kwargs)

    return bounded


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse `*`, `**` and `%` whose result would be past the bounds, before computing it."""
    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            bound = MAX_TEXT if isinstance(seq, str) else MAX_ITEMS
            if isinstance(seq, (str, list, tuple)) and isinstance(count, int) \
                    and len(seq) * count > bound:
                raise TemplateLimit(f"a repetition past {bound} items, kerncc's limit")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 \
            and abs(left) > 1 and right * abs(left).bit_length() > MAX_POWER_BITS:
        raise TemplateLimit(f"a power past {MAX_POWER_BITS} bits, kerncc's limit")
    elif operator == "%" and isinstance(left, str):
        _check_widths(_format_widths(_PERCENT_WIDTH, left, right))


def _bounded_filter(name: str, fn: Any) -> Any:
    """The filter with its widths checked first (see WIDE_FILTERS) and its result after."""
    passes = getattr(fn, "jinja_pass_arg", None)  # a context comes first, before the value

    @functools.wraps(fn)  # keeps jinja's pass_context / pass_eval_context marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        value = list(args[1:] if passes else args)
        if name == "format" and value and isinstance(value[0], str):
            _check_widths(_format_widths(_PERCENT_WIDTH, value[0], tuple(value[1:])))
        elif name == "replace" and len(value) >= 3:
            _check_replace(*value[:3])
        elif name in WIDE_FILTERS:
            _check_widths([*value[1:], *kwargs.values()])
        if name in LISTING_FILTERS and value:
            _check_items(value[0])
            if name == "join":
                _check_join(value[0], value[1] if len(value) > 1 else kwargs.get("d", ""))
        return _made(fn(*args, **kwargs))

    return bounded


def _environment() -> Any:
    """jinja2's immutable sandbox, bounded: every call counts a step, widths are checked
    before a str method or filter pads to them, and `*`, `**` and `%` are checked before they
    run (and so are never folded at compile time)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%", "+"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right)
            return _made(super().call_binop(context, operator, left, right))

        def wrap_str_format(self, value: Any) -> Any:
            wrapped = super().wrap_str_format(value)
            return None if wrapped is None else _bounded_format(value.__self__, wrapped)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            _check_call(__obj, args, kwargs)
            return _made(super().call(__context, __obj, *args, **kwargs))

    env = Bounded(trim_blocks=True, lstrip_blocks=True,
                  extensions=["jinja2.ext.loopcontrols", _generation_extension()])
    env.filters = {name: _bounded_filter(name, fn) for name, fn in env.filters.items()}
    return env


_BUDGET = "_kerncc_budget"


def _through_budget(tree: Any) -> Any:
    """Every `for` of the parsed template iterates through the render's budget, and every
    `~` joins through it."""
    from jinja2 import nodes

    def budget(method: str) -> Any:
        return nodes.Getattr(nodes.Name(_BUDGET, "load"), method, "load")

    for loop in tree.find_all(nodes.For):
        loop.iter = nodes.Call(budget("loop"), [loop.iter], [], None, None)
    for concat in list(tree.find_all(nodes.Concat)):
        parts = concat.nodes
        concat.__class__ = nodes.Call  # in place: the parent still points at this node
        concat.node, concat.args, concat.kwargs = budget("concat"), parts, []
        concat.dyn_args = concat.dyn_kwargs = None
        del concat.nodes
    return tree


def _render(compiled: Any, variables: dict[str, Any], budget: _Budget | None = None) -> str:
    """The template's text under `budget` (a fresh one by default), stopped at MAX_TEXT
    characters of output."""
    budget = budget or _Budget()
    parts, size = [], 0
    token = _current.set(budget)
    try:
        for part in compiled.generate(**variables, **{_BUDGET: budget}):
            size += len(part)
            if size > MAX_TEXT:
                raise TemplateLimit(f"its output passed {MAX_TEXT} characters, kerncc's limit")
            budget.tick(len(part))
            parts.append(part)
    finally:
        _current.reset(token)
    return "".join(parts)


def _compile(template: str, where: Path | None) -> Any:
    from jinja2 import TemplateError

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = _environment()
    env.filters["tojson"] = _bounded_filter("tojson", tojson)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(_through_budget(env.parse(template)))
    except TemplateError as err:
        line = getattr(err, "lineno", None)
        raise KernccError(f"{where}: the chat template does not parse", [Diagnostic(
            f"{err}", Location("/chat_template" if where and where.suffix == ".json" else "",
                               file=str(where), line=line))]) from None


def _eos_ids(directory: Path, model: dict, specials: dict[str, str], tokenizer: Any
             ) -> tuple[int, ...]:
    """generation_config.json's eos ids, else config.json's, else the eos token's id."""
    generation = _optional_json(directory / "generation_config.json", "generation config")
    for source, name in ((generation, "generation_config.json"), (model, "config.json")):
        value = source.get("eos_token_id")
        if value is None:
            continue
        ok = (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                            for v in value))
        if not ok:
            raise _file_error(directory / name, f"`eos_token_id` must be an id or a list of "
                              f"ids, not {json.dumps(value)}", "/eos_token_id")
        return token_ids(value)
    eos = specials.get("eos_token")
    found = tokenizer.token_to_id(eos) if eos and tokenizer is not None else None
    return () if found is None else (int(found),)


def model_eos_ids(directory: str | Path | None) -> tuple[int, ...]:
    """The eos ids of generation_config.json / config.json in a model folder (no tokenizer
    needed); () when neither names one or there is no folder."""
    if directory is None:
        return ()
    directory = Path(directory)
    model = _optional_json(directory / "config.json", "model config")
    return _eos_ids(directory, model, {}, None)
