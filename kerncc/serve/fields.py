"""Which fields of OpenAI's completions and chat-completions requests the server knows, and
what it does with each: nothing is silently ignored.

Every field of OpenAI's two request schemas is here, with vLLM's extensions the server serves.
A field is served, or accepted only at its off value (a value asking for what the server does
not do is a 400 naming it), or unknown: refused with a 400 naming it, unless the server runs
`--lenient`, which accepts and ignores it (logged). The checks of the served fields' values
(`options`) raise `FieldError(param, message)`, answered as a 400 by kerncc.serve.http.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs

MAX_N = 16  # choices a request may ask for (n, best_of): each is a sequence of its own
MAX_PROMPTS = 64  # prompts of one completions request
MAX_LOGPROBS = 20  # top tokens a step may report (vLLM's bound; OpenAI's is 5 and 20)
MAX_BIAS = 300  # logit_bias entries (OpenAI's bound)


class FieldError(Exception):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


def _none(value: Any) -> bool:
    return value is None


# The fields accepted only at values that ask for nothing: name -> (test of an off value, why).
OFF_ONLY: dict[str, tuple[Callable[[Any], bool], str]] = {
    "suffix": (lambda v: v in (None, ""), "text after the insertion point is not served"),
    "audio": (_none, "audio output is not served"),
    "modalities": (lambda v: v in (None, ["text"]), "only the `text` modality is served"),
    "prediction": (_none, "predicted outputs are not served"),
    "web_search_options": (_none, "web search is not served"),
    "functions": (_none, "the deprecated `functions` are not served"),
    "function_call": (_none, "the deprecated `function_call` is not served"),
    "reasoning_effort": (_none, "reasoning effort is not served"),
    "verbosity": (_none, "verbosity is not served"),
    "store": (lambda v: v in (None, False), "stored completions are not served"),
    "metadata": (lambda v: v in (None, {}), "`metadata` goes with stored completions, which "
                 "are not served"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "only the default service "
                     "tier is served"),
    "prompt_cache_key": (_none, "prompt cache keys are not served"),
    "parallel_tool_calls": (lambda v: v is None or isinstance(v, bool), "must be true or false"),
}
# Served on chat, checked by kerncc.serve.tools: tools, tool_choice, chat_template_kwargs.
# Informational fields that change nothing in OpenAI's own service either (abuse monitoring).
NOTES = ("user", "safety_identifier")

SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
            "stream_options", "n", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "ignore_eos",
            "response_format", "guided_regex", "guided_json", "guided_grammar")
COMPLETIONS = frozenset(("model", "prompt", "echo", "logprobs", "best_of", "suffix",
                         *SAMPLING, *NOTES))
CHAT = frozenset(("model", "messages", "max_completion_tokens", "logprobs", "top_logprobs",
                  "audio", "modalities", "prediction", "web_search_options", "functions",
                  "function_call", "reasoning_effort", "verbosity", "store", "metadata",
                  "service_tier", "prompt_cache_key", "tools", "tool_choice",
                  "parallel_tool_calls", "chat_template_kwargs", *SAMPLING, *NOTES))


def unknown(body: dict, chat: bool) -> list[str]:
    """The fields of `body` neither schema of this route knows, in the body's order."""
    known = CHAT if chat else COMPLETIONS
    return [name for name in body if name not in known]


def refuse_off_only(body: dict) -> None:
    for name, (off, why) in OFF_ONLY.items():
        if name in body and not off(body[name]):
            raise FieldError(name, f"`{name}`: {why}")
    for name in NOTES:
        if body.get(name) is not None and not isinstance(body[name], str):
            raise FieldError(name, f"`{name}` must be a string")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def as_float(value: int | float) -> float:
    """A JSON number as a float: an integer too large for one (JSON has no bound) is inf."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def number(body: dict, name: str, default: float, low: float, high: float,
           open_low: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise FieldError(name, f"`{name}` must be a number")
    value = as_float(value)
    if not math.isfinite(value) or value > high or value < low or (open_low and value == low):
        side = "(" if open_low else "["
        raise FieldError(name, f"`{name}` must be in {side}{low:g}, {high:g}]")
    return value


def integer(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value) or not low <= value <= high:
        raise FieldError(name, f"`{name}` must be a whole number from {low} to {high}")
    return value


def flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise FieldError(name, f"`{name}` must be true or false")
    return bool(value)


@attrs.frozen
class Options:
    """The served fields beyond temperature, top-k, top-p, seed, stop and max_tokens."""

    n: int = 1
    best_of: int = 1
    echo: bool = False
    logprobs: int | None = None  # top tokens a step reports; None: no logprobs asked
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False


def options(body: dict, chat: bool, vocab: int | None) -> Options:
    """The served fields of `body`, checked (a FieldError names the first one that is off)."""
    n = integer(body, "n", 1, 1, MAX_N)
    best_of = n if chat else integer(body, "best_of", n, 1, MAX_N)
    if best_of < n:
        raise FieldError("best_of", f"`best_of` ({best_of}) must be at least `n` ({n})")
    if best_of > n and body.get("stream"):
        raise FieldError("best_of", "`best_of` greater than `n` cannot be streamed")
    echo = False if chat else flag(body, "echo")
    logprobs = _chat_logprobs(body) if chat else integer(body, "logprobs", None, 0,
                                                         MAX_LOGPROBS)
    if echo and logprobs is not None:
        raise FieldError("echo", "`echo` with `logprobs` (the prompt's logprobs) is not "
                         "served")
    return Options(
        n=n, best_of=best_of, echo=echo, logprobs=logprobs,
        presence_penalty=number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=number(body, "repetition_penalty", 1.0, 0.0, 10.0, open_low=True),
        logit_bias=_bias(body.get("logit_bias"), vocab),
        min_tokens=integer(body, "min_tokens", 0, 0, 1 << 30),
        stop_token_ids=frozenset(_token_ids(body.get("stop_token_ids"), vocab)),
        ignore_eos=flag(body, "ignore_eos"))


def _chat_logprobs(body: dict) -> int | None:
    wanted = flag(body, "logprobs")
    top = integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not wanted:
        raise FieldError("top_logprobs", "`top_logprobs` needs `logprobs` true")
    return (top or 0) if wanted else None


def _bias(value: Any, vocab: int | None) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_BIAS:
        raise FieldError("logit_bias", f"`logit_bias` must map up to {MAX_BIAS} token ids to "
                         "numbers from -100 to 100")
    out = []
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else None
        if token is None or (vocab is not None and token >= vocab):
            raise FieldError("logit_bias", f"`logit_bias` key {key!r} is not a token id"
                             + (f" (0..{vocab - 1})" if vocab else ""))
        if not isinstance(bias, (int, float)) or isinstance(bias, bool) \
                or not -100 <= bias <= 100:
            raise FieldError("logit_bias", f"`logit_bias` of token {key}: {bias!r} is not a "
                             "number from -100 to 100")
        out.append((token, float(bias)))
    return tuple(out)


def _token_ids(value: Any, vocab: int | None) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(is_int(t) and t >= 0 for t in value) \
            or any(vocab is not None and t >= vocab for t in value):
        raise FieldError("stop_token_ids", "`stop_token_ids` must be a list of token ids"
                         + (f" (0..{vocab - 1})" if vocab else ""))
    return value
