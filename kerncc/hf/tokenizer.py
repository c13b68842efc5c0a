"""Text in, text out: a model folder's Hugging Face tokenizer and chat template.

`TextCodec.from_dir(dir)` reads `tokenizer.json` with the Hugging Face `tokenizers` library
(an optional dependency: `pip install 'kerncc[hf]'`; without it text features fail with that
command), the chat template (`chat_template.jinja`, else `tokenizer_config.json`'s
`chat_template`) and the eos ids (`generation_config.json`'s `eos_token_id`, then
`config.json`'s, then the tokenizer config's `eos_token`). It returns None when the folder has
no tokenizer.json. The API, used by `kerncc run` and the serving engine:

    codec.encode(text, add_special_tokens=True) -> list[int]
                                             ids as transformers' tokenizer(text) gives them;
                                             False for apply_chat_template's output
    codec.decode(ids, skip_special_tokens=False) -> str
    codec.stream() -> TextStream             incremental: stream.push(id) -> new text
    codec.apply_chat_template(messages, add_generation_prompt=True, **variables) -> str
    codec.eos_token_ids, codec.has_chat_template, codec.vocab_size

Chat templates render as transformers renders them: jinja2's immutable sandbox with
trim_blocks and lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson` that keeps
non-ASCII, and `bos_token` / `eos_token` (and the other special tokens) as variables. Nothing
in a model folder is executed beyond the sandboxed template. Every problem (a tokenizer.json
or template that does not parse, ids past the model's vocabulary) is a KernccError naming the
file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from kerncc.diagnostics import Diagnostic, KernccError, Location
from kerncc.hf.config import read_json, token_ids

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
    def from_dir(cls, path: str | Path) -> TextCodec | None:
        """The codec of a model folder, or None when it has no tokenizer.json."""
        directory = Path(path)
        tokenizer_path = directory / TOKENIZER
        if not tokenizer_path.is_file():
            return None
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
        if self._compiled is None:
            raise KernccError.single(f"{self.directory}: the tokenizer has no chat template "
                                     f"({TOKENIZER_CONFIG} `chat_template` or {TEMPLATE_FILE})")
        try:
            return self._compiled.render(**{**self.specials, **variables},
                                         messages=[dict(m) for m in messages],
                                         add_generation_prompt=add_generation_prompt)
        except Exception as err:  # noqa: BLE001 - raise_exception, or any bad expression
            where = self.template_file or self.directory / TOKENIZER_CONFIG
            raise _file_error(where, f"the chat template failed: {err}", "/chat_template"
                              ) from None


# ---------------------------------------------------------------------------------------------
# Reading the folder


def _load_tokenizer(path: Path) -> Any:
    tokenizers = _tokenizers()
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - the library raises plain Exceptions
        raise _file_error(path, f"not a tokenizer the `tokenizers` library reads: {err}"
                          ) from None


def _optional_json(path: Path, what: str) -> dict:
    if not path.is_file():
        return {}
    raw = read_json(path, what)
    if not isinstance(raw, dict):
        raise _file_error(path, f"the {what} is not a JSON object")
    return raw


def _template(directory: Path, config: dict) -> tuple[str | None, Path | None]:
    """The chat template: chat_template.jinja, else tokenizer_config.json's (a string, or a
    list of {name, template} whose `default` entry counts)."""
    file = directory / TEMPLATE_FILE
    if file.is_file():
        try:
            return file.read_text(encoding="utf-8"), file
        except (OSError, UnicodeDecodeError) as err:
            raise _file_error(file, f"cannot read: {err}") from None
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


def _compile(template: str, where: Path | None) -> Any:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    _Generation = _generation_extension()

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _Generation])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
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
