"""The messages between the front end and the engine core (kerncc.serve.client, kerncc.serve.core):
the one owner of their format, msgpack over ZeroMQ.

Every message is a msgpack array whose first item names its kind:

  front end -> core (one message per batch of the event loop's turn)
    ["hello", worker]                        a front end (re)started: its old requests end
    ["add", worker, [[id, prompt, max_new, params, stop_ids], ...]]
    ["cancel", worker, [id, ...]]
  core -> front end
    ["info", {...}]                          the model's bounds, in answer to hello
    ["step", [record, ...], stats]           one engine step's news for this front end
    ["stats", stats]                         the engine's counters (also a heartbeat)

A record is [id, tokens, heard, end]: the request's new tokens, what its drawer heard of each
(logprobs: [token, logprob, [[token, logprob], ...]]) and its end, None or [finish, error,
pointer, score]. A refused request ends at once with finish `queue_full`, `unavailable` or
`invalid` (error: the message, pointer: the field).

`decode` takes bytes from another process and trusts none of them: anything not of this shape
(garbled bytes, a wrong kind, a field of the wrong type, a huge count) is a WireError, which
the receiver logs and drops; nothing in a message can crash the receiver or make it allocate
more than the bytes it was sent.
"""

from __future__ import annotations

from typing import Any

import attrs
import msgpack

from kerncc.serve import sampling_hook

MAX_MESSAGE = 64 << 20  # bytes; a prompt of a million ids is well under it
REFUSALS = ("queue_full", "unavailable", "invalid")
FINISHES = ("stop", "length", "cancelled", "error", *REFUSALS)
STATS = ("running", "waiting", "free", "pages", "ahead_steps", "cached", "hit_rate", "queried",
         "hit", "evictions")
INT64 = 1 << 63
LIMITS = {"context", "context_why", "kv_tokens", "token_low", "token_high", "token_why"}


class WireError(Exception):
    """A message that is not of the format: refused, never acted on."""


def encode(message: list[Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def decode(raw: bytes, kinds: tuple[str, ...]) -> list[Any]:
    """The message `raw`, checked against its kind's shape; WireError when it is not one of
    `kinds` (the kinds the receiver takes) or not of its shape."""
    if not isinstance(raw, (bytes, bytearray, memoryview)) or len(raw) > MAX_MESSAGE:
        raise WireError("not a message (or one past the size bound)")
    try:
        message = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception as err:  # noqa: BLE001 - any malformed bytes, whatever msgpack raises
        raise WireError(f"not msgpack: {type(err).__name__}: {err}") from None
    if not isinstance(message, list) or not message or message[0] not in kinds:
        kind = message[0] if isinstance(message, list) and message else message
        raise WireError(f"unexpected message {str(kind)[:40]!r}")
    _SHAPES[message[0]](message)
    return message


# ------------------------------------------------------------------------ shapes


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise WireError(what)


def _int(value: Any, what: str, low: int = -INT64, high: int = INT64 - 1) -> int:
    _need(isinstance(value, int) and not isinstance(value, bool) and low <= value <= high,
          f"{what}: expected an integer in [{low}, {high}]")
    return value


def _num(value: Any, what: str) -> float:
    _need(isinstance(value, (int, float)) and not isinstance(value, bool), f"{what}: expected a "
          "number")
    return float(value)


def _ints(value: Any, what: str, low: int = -INT64, high: int = INT64 - 1) -> list[int]:
    _need(isinstance(value, list), f"{what}: expected a list")
    # one pass of builtins for the usual list (a call an item took 1 ms of the core's
    # receiving thread for a 2,100-token prompt); an odd one is looked at item by item
    if set(map(type, value)) <= {int} and (not value or low <= min(value)
                                           and max(value) <= high):
        return value
    for i, item in enumerate(value):
        _int(item, f"{what}[{i}]", low, high)
    return value


def _len(message: list[Any], n: int) -> None:
    _need(len(message) == n, f"`{message[0]}`: expected {n} items, got {len(message)}")


def _hello(message: list[Any]) -> None:
    _len(message, 2)
    _int(message[1], "hello: worker", 0, 1 << 16)


def _add(message: list[Any]) -> None:
    _len(message, 3)
    _int(message[1], "add: worker", 0, 1 << 16)
    _need(isinstance(message[2], list), "add: expected a list of requests")
    for i, item in enumerate(message[2]):
        where = f"add[{i}]"
        _need(isinstance(item, list) and len(item) == 5, f"{where}: expected 5 items")
        _int(item[0], f"{where}: id", 0)
        _ints(item[1], f"{where}: prompt")
        _int(item[2], f"{where}: max_new")
        _need(isinstance(item[3], dict), f"{where}: params: expected a map")
        _ints(item[4], f"{where}: stop ids")


def _cancel(message: list[Any]) -> None:
    _len(message, 3)
    _int(message[1], "cancel: worker", 0, 1 << 16)
    _ints(message[2], "cancel: ids", 0)


def _stats(value: Any, what: str = "stats") -> None:
    _need(isinstance(value, dict), f"{what}: expected a map")
    for name in STATS:
        _num(value.get(name), f"{what}.{name}")
    fault = value.get("fault")
    _need(fault is None or isinstance(fault, str), f"{what}.fault: expected text or nil")


def _info(message: list[Any]) -> None:
    _len(message, 2)
    info = message[1]
    _need(isinstance(info, dict), "info: expected a map")
    _int(info.get("capacity"), "info.capacity", 1)
    _int(info.get("stride"), "info.stride", 1)
    _need(info.get("vocab") is None or isinstance(info["vocab"], int), "info.vocab")
    _need(isinstance(info.get("fingerprint"), str), "info.fingerprint: expected a string")
    limits = info.get("limits")
    _need(isinstance(limits, dict) and set(limits) == LIMITS, "info.limits: expected a map "
          f"of {', '.join(sorted(LIMITS))}")
    for name in ("context", "kv_tokens", "token_high"):
        if limits[name] is not None:
            _int(limits[name], f"info.limits.{name}")
    _int(limits["token_low"], "info.limits.token_low")
    _need(isinstance(limits["context_why"], str) and isinstance(limits["token_why"], str),
          "info.limits: the reasons are text")
    _stats(info.get("stats"), "info.stats")


def _step(message: list[Any]) -> None:
    _len(message, 3)
    _need(isinstance(message[1], list), "step: expected a list of records")
    for i, record in enumerate(message[1]):
        _record(record, f"step[{i}]")
    _stats(message[2])


def _record(record: Any, where: str) -> None:
    _need(isinstance(record, list) and len(record) == 4, f"{where}: expected 4 items")
    _int(record[0], f"{where}: id", 0)
    _ints(record[1], f"{where}: tokens")
    _need(isinstance(record[2], list), f"{where}: heard: expected a list")
    for heard in record[2]:
        _need(isinstance(heard, list) and len(heard) == 3 and isinstance(heard[2], list),
              f"{where}: heard: expected [token, logprob, top]")
    end = record[3]
    if end is None:
        return
    _need(isinstance(end, list) and len(end) == 4 and end[0] in FINISHES,
          f"{where}: end: expected [finish, error, pointer, score]")
    _need(all(x is None or isinstance(x, str) for x in end[1:3]), f"{where}: end: error, pointer")
    _num(end[3], f"{where}: end: score")


def _stats_message(message: list[Any]) -> None:
    _len(message, 2)
    _stats(message[1])


_SHAPES = {"hello": _hello, "add": _add, "cancel": _cancel, "info": _info, "step": _step,
           "stats": _stats_message}


# ------------------------------------------------------------------------ sampling params


def params_out(params: sampling_hook.Params) -> dict[str, Any]:
    """`params` as a map (the grammar as its text: the core rebuilds it for its tokenizer)."""
    out = attrs.asdict(params, recurse=False)
    out["logit_bias"] = [list(pair) for pair in params.logit_bias]
    out["suppress"] = sorted(params.suppress)
    out["prompt"] = list(params.prompt)
    out["grammar"] = None if params.grammar is None else params.grammar.text
    return out


_FLOATS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def params_in(raw: dict[str, Any], grammar: Any = None) -> sampling_hook.Params:
    """The Params of a map `params_out` made, checked field by field (WireError); `grammar`
    makes a grammar of its text (None: a grammar is refused)."""
    known = {f.name for f in attrs.fields(sampling_hook.Params)}
    _need(set(raw) <= known, f"params: unknown field(s) {sorted(set(raw) - known)[:3]}")
    values: dict[str, Any] = {}
    for name in _FLOATS:
        if name in raw:
            values[name] = _num(raw[name], f"params.{name}")
    for name in ("top_k", "min_tokens"):
        if name in raw:
            values[name] = _int(raw[name], f"params.{name}", 0)
    for name in ("seed", "logprobs"):
        if raw.get(name) is not None:
            values[name] = _int(raw[name], f"params.{name}", 0 if name == "logprobs" else
                                -INT64, (1 << 64) - 1 if name == "seed" else INT64 - 1)
    if "ranked" in raw:
        _need(isinstance(raw["ranked"], bool), "params.ranked: expected true or false")
        values["ranked"] = raw["ranked"]
    bias = raw.get("logit_bias") or []
    _need(isinstance(bias, list) and all(isinstance(p, list) and len(p) == 2 for p in bias),
          "params.logit_bias: expected [[token, bias], ...]")
    values["logit_bias"] = tuple((_int(t, "params.logit_bias"), _num(b, "params.logit_bias"))
                                 for t, b in bias)
    values["suppress"] = frozenset(_ints(raw.get("suppress") or [], "params.suppress"))
    values["prompt"] = tuple(_ints(raw.get("prompt") or [], "params.prompt"))
    text = raw.get("grammar")
    if text is not None:
        _need(isinstance(text, str) and grammar is not None, "params.grammar: expected the "
              "grammar's text (and a core with a tokenizer)")
        values["grammar"] = grammar(text)
    return sampling_hook.Params(**values)
