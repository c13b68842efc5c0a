"""Structured output: the grammar a request's tokens must follow, through llguidance.

`response_format` (`json_object`, `json_schema`) and the extensions `guided_json`,
`guided_regex` and `guided_grammar` (Lark) become a `Grammar`; each sequence gets a `Matcher`
(kerncc.serve.logits.Drawer holds it) that fills the step's token mask (the `allow` rows of
kernels/logits_ref.py, the bit layout llguidance writes) before the token is picked, and
follows the token picked (`Matcher.consume`). A call's masks are computed together when the
call is packed (`fill_all`, straight into the rows the device reads): through llguidance's
executor, over the cores, on a machine of 4 or more whose tokenizer llguidance reads natively,
else one after another. (Not ahead on a worker thread: it could not start before the engine
thread let go of the GIL, which it did only when waiting for the mask.) Once the grammar is complete only the tokenizer's eos may come next, which ends the
sequence. `Grammars` is one server's: its tokenizer as llguidance reads it, built once.

llguidance (the `serve` extra) is the engine: no dependency of its own (xgrammar needs torch
and transformers), a JSON schema, regex and context-free (Lark) front end, and the mask in the
32-bit word layout a device kernel reads.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from typing import Any

import numpy as np

try:
    import llguidance
    import llguidance.numpy as llnumpy
except ImportError:  # the serve extra without it: structured output is refused
    llguidance = llnumpy = None

FIELDS = ("response_format", "guided_json", "guided_regex", "guided_grammar")
COMPACT = {"whitespace_flexible": False}  # JSON without free whitespace between tokens


class GrammarError(Exception):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


def available() -> bool:
    return llguidance is not None


class Grammar:
    """A checked grammar, for a tokenizer: `matcher()` gives one sequence's."""

    def __init__(self, tokenizer: Any, text: str, threads: bool) -> None:
        self.tokenizer, self.text, self.threads = tokenizer, text, threads

    def matcher(self) -> Matcher:
        return Matcher(llguidance.LLMatcher(self.tokenizer, self.text), self.threads)


_EXECUTOR: list[Any] = []
_EXECUTOR_LOCK = threading.Lock()
# llguidance's executor spreads a batch's masks over the cores; on a machine of fewer cores
# handing them to its threads costs more than it saves, and they are computed one at a time.
# Nor with a tokenizer it calls back into Python for (`Grammars.threads`): its threads then
# queue for the GIL, and on a 16-core H100 host an array of small objects cost 1.86x a plain
# 32-sequence step through the executor, 1.05x one at a time (bench.host_step --processing)
PARALLEL = (os.cpu_count() or 1) >= 4
ENCODED = 4096  # strings a server's tokenizer callback remembers (_Tokens)


def _executor() -> Any:
    with _EXECUTOR_LOCK:
        if not _EXECUTOR:
            _EXECUTOR.append(llguidance.LLExecutor())
        return _EXECUTOR[0]


class Matcher:
    """One sequence's grammar state (an llguidance matcher)."""

    def __init__(self, matcher: Any, threads: bool = False) -> None:
        self.matcher = matcher
        self.threads = threads  # its masks may be computed on llguidance's threads

    def fill(self, allow: np.ndarray) -> None:
        """Set the bits of the tokens that may come next in `allow` (uint32 [words])."""
        fill_all([self], allow.reshape(1, -1), [0])

    def consume(self, token: int) -> None:
        """Follow `token` (a token the mask refused leaves the matcher in error: its masks
        then let nothing through)."""
        self.matcher.consume_token(int(token))


def fill_all(matchers: list[Matcher], out: np.ndarray, rows: list[int]) -> None:
    """Matcher i's next mask into row rows[i] of `out` (uint32 [n, words], C-contiguous),
    all in one batch."""
    masks = out.view(np.int32)
    if PARALLEL and len(matchers) > 1 and all(m.threads for m in matchers):
        llnumpy.fill_next_token_bitmask_par(
            _executor(), [(m.matcher, row) for m, row in zip(matchers, rows)], masks)
        return
    for matcher, row in zip(matchers, rows):
        llnumpy.fill_next_token_bitmask(matcher.matcher, masks, row)


def for_text(text: Any, vocab: int | None) -> Grammars | None:
    """The grammars of a server's tokenizer (`text`: kerncc.serve.text.Text), or None where
    none can be followed: no llguidance, no tokenizer.json or eos token, no vocabulary size."""
    codec = getattr(text, "codec", None)
    if not available() or getattr(codec, "tokenizer", None) is None or not text.eos \
            or vocab is None:
        return None
    return Grammars(codec, vocab, min(text.eos))


class Grammars:
    """One server's grammars: its tokenizer as llguidance reads it (the logits' vocabulary
    wide, its eos ending a complete grammar)."""

    def __init__(self, codec: Any, vocab: int, eos: int) -> None:
        self.eos = eos
        try:  # the tokenizer.json as llguidance reads it (byte-level BPE, SentencePiece)
            self.tokenizer = llguidance.LLTokenizer(codec.tokenizer.to_str(), n_vocab=vocab,
                                                    eos_token=eos)
            self.threads = True
        except ValueError:  # a decoder it does not know (the example's Fuse): token by token
            self.tokenizer = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(_Tokens(codec, vocab, eos)), n_vocab=vocab,
                eos_token=eos)
            self.threads = False  # it calls back into Python (_Tokens) for forced strings

    def grammar(self, text: str) -> Grammar:
        """A grammar's text (checked already) for this tokenizer."""
        return Grammar(self.tokenizer, text, self.threads)

    def of(self, body: dict) -> Grammar | None:
        """The grammar a request's fields ask for (None: none), checked; a GrammarError
        names the field."""
        asked = [name for name in FIELDS if body.get(name) is not None
                 and not (name == "response_format" and body[name] == {"type": "text"})]
        if not asked:
            return None
        if len(asked) > 1:
            raise GrammarError(asked[1], f"`{asked[0]}` and `{asked[1]}` both constrain the "
                               "output: give one")
        name = asked[0]
        return self._checked(name, lambda: _grammar_text(name, body[name]))

    def lark(self, name: str, text: str) -> Grammar:
        """A Lark grammar (a forced tool call's, kerncc.serve.tools), checked; a GrammarError
        names the field `name` that asked for it."""
        return self._checked(name, lambda: llguidance.LLMatcher.grammar_from_lark(text))

    def _checked(self, name: str, make: Any) -> Grammar:
        try:
            text = make()
            message = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        except (ValueError, TypeError, RuntimeError) as err:  # a schema it cannot compile
            message = str(err) or type(err).__name__
        if message:
            raise GrammarError(name, f"`{name}`: {message}")
        return self.grammar(text)


def _grammar_text(name: str, value: Any) -> str:
    if name == "guided_regex":
        if not isinstance(value, str):
            raise GrammarError(name, "`guided_regex` must be a string")
        return llguidance.LLMatcher.grammar_from_regex(value)
    if name == "guided_grammar":
        if not isinstance(value, str):
            raise GrammarError(name, "`guided_grammar` must be a Lark grammar as a string")
        return llguidance.LLMatcher.grammar_from_lark(value)
    if name == "guided_json":
        try:
            return _json_schema(name, json.loads(value) if isinstance(value, str) else value)
        except ValueError as err:
            raise GrammarError(name, f"`guided_json` is not JSON: {err}") from None
    return _response_format(value)


def _response_format(value: Any) -> str:
    name = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return _json_schema(name, {"type": "object"})
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise GrammarError(name, "`response_format.json_schema` must be an object with a "
                               "`schema` object")
        return _json_schema(name, spec.get("schema", {}))
    raise GrammarError(name, "`response_format` must be {\"type\": \"text\"}, "
                       "\"json_object\" or \"json_schema\"")


def _json_schema(name: str, schema: Any) -> str:
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(name, f"`{name}`: a JSON schema must be an object")
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**COMPACT, **schema.get("x-guidance", {})}}
    return llguidance.LLMatcher.grammar_from_json_schema(schema)


class _Tokens:
    """A tokenizer as llguidance's TokenizerWrapper asks for it: each id's bytes (its text
    alone; the tokenizer.json's added tokens are special) and encoding."""

    def __init__(self, codec: Any, vocab: int, eos: int) -> None:
        tokenizer = codec.tokenizer
        self.eos_token_id, self.bos_token_id = eos, None
        size = min(vocab, tokenizer.get_vocab_size(with_added_tokens=True))
        self.tokens = [tokenizer.decode([i], skip_special_tokens=False).encode()
                       for i in range(size)] + [b""] * (vocab - size)
        self.special_token_ids = sorted(i for i in tokenizer.get_added_tokens_decoder()
                                        if i < vocab)
        # llguidance asks for the same few forced strings (a schema's keys and punctuation)
        # while it computes masks: an array of small objects at 32 rows asked 2,084 times in
        # 80 steps for 29 strings; remembered, a step's masks took 177 us against 272
        self._encode = functools.lru_cache(maxsize=ENCODED)(
            lambda text: tuple(codec.encode(text, add_special_tokens=False)))

    def __call__(self, text: str) -> list[int]:
        return list(self._encode(text))
