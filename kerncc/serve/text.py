"""The tokenizer behind the server: `kerncc.hf.tokenizer.TextCodec` (the Hugging Face
`tokenizers` library; its API is docs/hf-import.md's).

This module is the one place of the server that knows it: `load(folders)` gives a codec or
None (token-id prompts only; a text prompt is then refused with "model has no tokenizer").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kerncc.hf.tokenizer import TextCodec, TextStream


class Text:
    """A codec's text side as the server needs it."""

    def __init__(self, codec: Any) -> None:
        self.codec = codec

    @property
    def eos(self) -> frozenset[int]:
        return frozenset(int(t) for t in (getattr(self.codec, "eos_token_ids", None) or ()))

    @property
    def chat(self) -> bool:
        return bool(getattr(self.codec, "has_chat_template", False))

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.codec.encode(text)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.codec.decode(list(ids)))

    def stream(self) -> Any:
        """Incremental decoding (`push(id)`, `flush()`): kerncc.hf.tokenizer.TextStream over
        this codec, which decodes a short window of recent ids per id."""
        return TextStream(self)

    def chat_prompt(self, messages: list[dict[str, Any]],
                    variables: dict[str, Any] | None = None, stop: Any = None) -> list[int]:
        """The prompt of `messages` by the chat template; `variables` reach the template as
        Hugging Face's apply_chat_template passes its extra arguments (`tools`,
        chat_template_kwargs such as `enable_thinking`). The render is bounded in steps, sizes
        and time (kerncc.hf.tokenizer), and ends (a KernccError) once `stop()` is true: the
        server's caller runs it on a worker thread and asks it to stop when its client
        leaves."""
        render = getattr(self.codec, "render_chat", None)
        if render is not None:
            made = render(messages, variables or {}, add_generation_prompt=True, stop=stop)
        else:  # a codec of its own (tests), unbounded by kerncc
            made = self.codec.apply_chat_template(messages, add_generation_prompt=True,
                                                  **(variables or {}))
        if not isinstance(made, str):
            return [int(t) for t in made]
        try:  # the template writes its own special tokens (as transformers encodes it)
            return [int(t) for t in self.codec.encode(made, add_special_tokens=False)]
        except TypeError:  # a codec without the flag
            return self.encode(made)


def load(folders: Iterable[Path | None], pins: Any = None) -> Text | None:
    """The first folder's tokenizer that TextCodec can read, or None; `pins`: the tokenizer
    files the bundle was lowered with, which the files read must be (TextCodec.from_dir)."""
    for folder in folders:
        if folder is None or not Path(folder).is_dir():
            continue
        codec = TextCodec.from_dir(folder, pins)
        if codec is not None:
            return Text(codec)
    return None
