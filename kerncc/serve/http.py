"""`kerncc serve`: an OpenAI-compatible HTTP server in front of the engine (ARCHITECTURE §9).

Starlette routes on uvicorn; no HTTP of our own and no model logic here. The engine runs on its
own thread (kerncc.serve.engine); a request is checked, queued with `Engine.submit` (which never
blocks), and its tokens come back through a per-request asyncio queue fed from the engine's
thread, so the event loop never waits on the engine.

Routes: POST /v1/completions (prompt as text, when the model has a tokenizer, or as token ids,
or a list of prompts; max_tokens, temperature, top_p, top_k, seed, stop (up to 4 strings of up
to 256 characters), stream, n, best_of, echo, logprobs, and the fields of kerncc.serve.fields),
POST /v1/chat/completions (when the tokenizer has a chat template; tools through
kerncc.serve.tools),
GET /v1/models (and /v1/models/{id}), GET /health (200, or 503 after a fault or while
stopping), GET /metrics
(Prometheus text). Errors are OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`: 400 for a bad request, 404 for an unknown
model or route, 413 for a body past 4 MiB, 429 at once when the queue is full, 500 when a stage
failed (the message names the stage and program), 503 when the engine does not admit. A client
that goes away cancels its sequence, whose pages are free before the engine's next step.
Defaults where OpenAI's differ: temperature 0 (greedy) and max_tokens 16 (chat: the rest of the
context, as OpenAI's). Every request field is served or refused by name (kerncc.serve.fields).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kerncc.diagnostics import KernccError
from kerncc.serve import fields, grammar, sampling_hook, tools
from kerncc.serve.access import Access
from kerncc.serve.engine import Engine, QueueFull, Request, Stopped, refusal_of
from kerncc.serve.metrics import Metrics
from kerncc.serve.text import Text

LOG = logging.getLogger("kerncc.serve")
MAX_BODY = 4 << 20
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
MAX_STOPS = 4
# Matching holds back up to a stop's length and costs its square per token on the event loop
# (a 40,000-character stop took 43 ms a token, blocking every other request).
MAX_STOP_CHARS = 256
DEFAULT_MAX_TOKENS = 16
QUICK_BODY = 64 << 10  # bytes of a completions request of token ids parsed on the loop
POLL = 0.25  # seconds between checks that a client still waiting for a piece is there
FINISH = 5.0  # seconds requests cancelled at the end of a drain have to write their ending


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {404: "not_found_error", 429: "rate_limit_error",
                             503: "service_unavailable"}.get(
            status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        # a 408 leaves the body unread: the connection cannot carry another request
        headers = {"connection": "close"} if self.status == 408 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


@attrs.frozen
class Ask:
    """A parsed request: what to feed and how to generate."""

    prompt: list[int]
    max_new: int
    params: sampling_hook.Params
    stops: tuple[str, ...]
    stream: bool
    usage_in_stream: bool
    max_field: str = "max_tokens"  # the field that gave max_new (chat's may be another)
    chat: bool = False
    # a list of prompts in one completions request: every one, `prompt` first
    prompts: tuple[tuple[int, ...], ...] = ()
    texts: tuple[str, ...] = ()  # each prompt's text, for `echo`
    options: fields.Options = fields.Options()
    tools: tools.Plan | None = None  # a chat request's tools, rendered and parsed back

    @property
    def every_prompt(self) -> tuple[tuple[int, ...], ...]:
        return self.prompts or (tuple(self.prompt),)


class Server:
    """The engine on its thread, the model's name and tokenizer, the metrics."""

    def __init__(self, engine: Engine, model: str, text: Text | None = None,
                 lenient: bool = False, api_key: str | None = None,
                 body_timeout: float = 60.0) -> None:
        self.engine, self.model, self.text = engine, model, text
        self.body_timeout = body_timeout  # seconds to send a request's body (408 after)
        self.lenient = lenient  # unknown request fields accepted and ignored (logged)
        self.api_key = api_key  # None: every client is served (kerncc.serve.access)
        self._grammars: grammar.Grammars | None = None  # made at the first grammar asked
        self.metrics = Metrics(engine)
        self.fingerprint = engine.fingerprint  # system_fingerprint
        self.draining = False
        self.active = 0  # generation requests being answered (a stream until its last event)
        self.renders = threading.Event()  # set: every chat template render stops (shutdown)
        self.thread = threading.Thread(target=engine.run_forever, name="kerncc-engine",
                                       daemon=True)
        self._posts: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Post] = \
            weakref.WeakKeyDictionary()

    def post(self, loop: asyncio.AbstractEventLoop) -> _Post:
        """The engine's thread's way onto `loop` (one for every request it serves)."""
        post = self._posts.get(loop)
        if post is None:
            post = self._posts[loop] = _Post(loop)
        return post

    @property
    def healthy(self) -> bool:
        return self.engine.fault is None and not self.draining and self.thread.is_alive()

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel what is in flight and wait for the engine's thread to end."""
        self.draining = True
        self.engine.stop()
        if self.thread.is_alive():
            self.thread.join(timeout)

    async def drain(self, timeout: float, forced: Any = lambda: False) -> None:
        """Stop admitting (new requests get 503), wait up to `timeout` seconds for the requests
        being answered to end, then cancel the rest: each ends with a 503 (a stream: an error
        event and `[DONE]`), told within FINISH seconds."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.active and loop.time() < deadline and not forced():
            await asyncio.sleep(0.05)
        if not self.active:
            return
        LOG.warning("%d request(s) still running after the drain timeout (%g s): cancelled",
                    self.active, timeout)
        self.renders.set()
        self.engine.stop()
        deadline = loop.time() + FINISH
        while self.active and loop.time() < deadline and not forced():
            await asyncio.sleep(0.05)

    # ------------------------------------------------------------------------ requests

    def parse(self, body: Any, chat: bool, stop: Any = None) -> Ask:
        """The request `body`; `stop()` true ends a chat template's render (a KernccError)."""
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model", self.model)
        if not isinstance(model, str):
            raise ApiError(400, "`model` must be a string", "model")
        if model != self.model:
            raise ApiError(404, f"the model `{model}` does not exist (this server serves "
                           f"`{self.model}`)", "model", "model_not_found")
        self._known_fields(body, chat)
        try:
            fields.refuse_off_only(body)
            served = fields.options(body, chat, self.engine.model.vocab)
        except fields.FieldError as err:
            raise ApiError(400, err.message, err.param) from None
        form = self._grammar(body)
        plan, form = self._tool_plan(body, form) if chat else (None, form)
        try:
            if chat:
                prompts, texts = [self._chat_prompt(body, plan, stop)], ("",)
            else:
                prompts, texts = self._prompts(body.get("prompt"), served.echo)
        except KernccError as err:  # the tokenizer or chat template refused the text
            raise ApiError(400, err.headline, "messages" if chat else "prompt") from None
        prompt = prompts[0]
        max_field = "max_completion_tokens" if chat and "max_tokens" not in body \
            else "max_tokens"
        # chat without a bound runs to the end of the context, as OpenAI's and vLLM's do
        rest = max(1, self.engine.capacity + 1 - len(prompt))
        max_new = _field(body, max_field, int, rest if chat else DEFAULT_MAX_TOKENS)
        if served.min_tokens > max_new:
            raise ApiError(400, f"`min_tokens` ({served.min_tokens}) is past `{max_field}` "
                           f"({max_new})", "min_tokens")
        params = attrs.evolve(self._processing(_params(body), served), grammar=form)
        options = body.get("stream_options") or {}
        return Ask(prompt, max_new, params, self._stops(body.get("stop")),
                   bool(_field(body, "stream", bool, False)),
                   isinstance(options, dict) and bool(options.get("include_usage")), max_field,
                   chat, tuple(tuple(p) for p in prompts), texts, served, plan)

    def _known_fields(self, body: dict, chat: bool) -> None:
        """Refuse a field neither OpenAI's schema nor the server knows (`--lenient`: log it
        and go on without it)."""
        odd = fields.unknown(body, chat)
        if not odd:
            return
        if self.lenient:
            LOG.warning("ignoring unknown request field(s) %s (--lenient)",
                        ", ".join(f"`{name}`" for name in odd))
            return
        raise ApiError(400, f"unknown field `{odd[0]}` (this server refuses the fields it does "
                       "not serve; `kerncc serve --lenient` ignores unknown ones)", odd[0],
                       "unknown_field")

    def _processing(self, params: sampling_hook.Params, served: fields.Options
                    ) -> sampling_hook.Params:
        """The request's logits processing and logprobs on its sampling params (unchanged
        when it asks for none: today's path)."""
        ranked = served.best_of > served.n
        return attrs.evolve(
            params, presence_penalty=served.presence_penalty,
            frequency_penalty=served.frequency_penalty,
            repetition_penalty=served.repetition_penalty, logit_bias=served.logit_bias,
            min_tokens=served.min_tokens,
            suppress=self._stop_ids(served) if served.min_tokens else frozenset(),
            logprobs=served.logprobs, ranked=ranked)

    def _stop_ids(self, served: fields.Options, form: Any = None) -> frozenset[int]:
        """The tokens that end a sequence: the tokenizer's eos (unless `ignore_eos`) and
        `stop_token_ids`; with a grammar, the eos that ends it."""
        eos = self.text.eos if self.text is not None and not served.ignore_eos else frozenset()
        done = frozenset((self._grammars.eos,)) if form is not None else frozenset()
        return eos | served.stop_token_ids | done

    def _grammar(self, body: dict) -> Any:
        """The grammar the request's output must follow (kerncc.serve.grammar), or None."""
        asked = next((name for name in grammar.FIELDS if body.get(name) is not None), None)
        if asked is None or body.get("response_format") == {"type": "text"} and not any(
                body.get(name) is not None for name in grammar.FIELDS[1:]):
            return None
        try:
            return self._grammar_engine(asked).of(body)
        except grammar.GrammarError as err:
            raise ApiError(400, err.message, err.param) from None

    def _grammar_engine(self, asked: str) -> grammar.Grammars:
        """The server's grammars (made at the first asked), for the field `asked`."""
        if not grammar.available():
            raise ApiError(400, f"`{asked}` needs llguidance: pip install 'kerncc[serve]'",
                           asked)
        if self._grammars is None:
            self._grammars = grammar.for_text(self.text, self.engine.model.vocab)
        if self._grammars is None:
            raise ApiError(400, f"`{asked}` needs the model's tokenizer.json and an eos token",
                           asked, "no_tokenizer")
        return self._grammars

    def _tool_plan(self, body: dict, form: Any) -> tuple[tools.Plan | None, Any]:
        """A chat request's tools (kerncc.serve.tools) and the grammar its output follows:
        `form`, or the forced call's for `tool_choice` required or a named function."""
        template = getattr(getattr(self.text, "codec", None), "template", None)
        try:
            plan = tools.plan(body, template if isinstance(template, str) else None)
        except tools.ToolError as err:
            raise ApiError(400, err.message, err.param) from None
        lark = plan.grammar() if plan is not None else None
        if lark is None:
            return plan, form
        if form is not None:
            raise ApiError(400, "`tool_choice` forces a tool call, and a `response_format` or "
                           "guided field constrains the output too: give one", "tool_choice")
        try:
            return plan, self._grammar_engine("tool_choice").lark("tool_choice", lark)
        except grammar.GrammarError as err:
            raise ApiError(400, f"{err.message} (the grammar of the tools' `parameters`)",
                           "tools") from None

    def _prompts(self, prompt: Any, echo: bool = False
                 ) -> tuple[list[list[int]], tuple[str, ...]]:
        """A completions request's prompts (a list of texts or of token-id lists is several)
        and their texts (those of token ids decoded only for `echo`, their one use: else the
        tokenizer ran over every prompt's tokens, on the front end's loop, for nothing)."""
        many = isinstance(prompt, list) and bool(prompt) and all(
            isinstance(p, str) or (isinstance(p, list) and p and _ints(p)) for p in prompt)
        given = prompt if many else [prompt]
        if len(given) > fields.MAX_PROMPTS:
            raise ApiError(400, f"{len(given)} prompts: at most {fields.MAX_PROMPTS} are served "
                           "in one request", "prompt")
        prompts = [self._prompt(p) for p in given]
        texts = tuple(p if isinstance(p, str) else self.text.decode(p) if self.text and echo
                      else "" for p in given)
        return prompts, texts

    def _prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if self.text is None:
                raise ApiError(400, "model has no tokenizer: give the prompt as token ids",
                               "prompt", "no_tokenizer")
            return self.text.encode(prompt)
        if isinstance(prompt, list) and _ints(prompt):
            return list(prompt)
        raise ApiError(400, "`prompt` must be a string or a list of token ids", "prompt")

    def _chat_prompt(self, body: dict, plan: tools.Plan | None = None, stop: Any = None
                     ) -> list[int]:
        if self.text is None or not self.text.chat:
            raise ApiError(400, "model has no chat template: use /v1/completions", "messages",
                           "no_chat_template")
        try:  # the history's tool calls and results; chat_template_kwargs and the tools
            messages = tools.messages(body.get("messages"))
            variables = tools.template_variables(body, plan)
        except tools.ToolError as err:
            raise ApiError(400, err.message, err.param) from None
        return self.text.chat_prompt(messages, variables, stop)

    def _stops(self, stop: Any) -> tuple[str, ...]:
        stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) \
                or len(stops) > MAX_STOPS:
            raise ApiError(400, f"`stop` must be a string or up to {MAX_STOPS} strings",
                           "stop")
        long = next((s for s in stops if len(s) > MAX_STOP_CHARS), None)
        if long is not None:
            raise ApiError(400, f"a `stop` string of {len(long)} characters: at most "
                           f"{MAX_STOP_CHARS} are served", "stop")
        if stops and self.text is None:
            raise ApiError(400, "model has no tokenizer: `stop` strings cannot be matched",
                           "stop", "no_tokenizer")
        return tuple(stops)

    def model_object(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": 0, "owned_by": "kerncc"}

    def submit(self, ask: Ask, listener: _Bridge, prompt: Sequence[int] | None = None,
               params: sampling_hook.Params | None = None) -> Request:
        if not self.healthy:
            raise ApiError(503, self.engine.fault and f"the engine stopped: {self.engine.fault}"
                           or "the server is shutting down", code="unavailable")
        request = Request(list(prompt or ask.prompt), ask.max_new, params or ask.params,
                          self._stop_ids(ask.options, ask.params.grammar), listener)
        try:
            return self.engine.submit(request)
        except (QueueFull, Stopped, KernccError) as err:
            raise self._refusal(ask, request.prompt, *refusal_of(err)) from None

    def refused(self, ask: Ask, request: Request) -> ApiError:
        """The answer to a request the engine core refused after it left (kerncc.serve.client:
        the same answers as `submit`'s)."""
        return self._refusal(ask, request.prompt, *self.engine.refusal(request))

    def _refusal(self, ask: Ask, prompt: list[int], why: str, message: str,
                 pointer: str | None) -> ApiError:
        """The engine's refusal of a request (`engine.refusal_of`), naming the field the client
        sent (and OpenAI's `context_length_exceeded` when the sequence would not fit)."""
        if why == "queue_full":
            return ApiError(429, f"the queue is full: {message}", code="queue_full")
        if why == "unavailable":
            return ApiError(503, f"the engine does not admit: {message}", code="unavailable")
        parts = (pointer or "").strip("/").split("/")
        param = parts[-1] if parts[0] == "sampling" else parts[0]  # /sampling/seed: seed
        code = None
        if param == "max_tokens":  # the engine's word for whichever field the client used
            param = ask.max_field
        if param == ask.max_field and len(prompt) + ask.max_new - 1 > self.engine.capacity:
            code = "context_length_exceeded"
            if len(prompt) > self.engine.capacity:  # the prompt alone is too long
                param = "messages" if ask.chat else "prompt"
        return ApiError(400, message, param or None, code)


def _ints(values: list[Any]) -> bool:
    """Whether every item is an integer (not a bool): one pass of builtins for what JSON
    gives, plain ints, else each looked at."""
    return set(map(type, values)) <= {int} or all(fields.is_int(t) for t in values)




def _params(body: dict) -> sampling_hook.Params:
    """The sampling fields, each checked on its own (an error names the one that is off)."""
    temperature = _field(body, "temperature", float, 0.0)
    top_p = _field(body, "top_p", float, 1.0)
    top_k = _field(body, "top_k", int, 0)
    if temperature < 0:
        raise ApiError(400, "`temperature` must be >= 0 (0 is greedy)", "temperature")
    if not 0 < top_p <= 1:
        raise ApiError(400, "`top_p` must be in (0, 1] (1 is off)", "top_p")
    if top_k < 0:
        raise ApiError(400, "`top_k` must be >= 0 (0 is off)", "top_k")
    return sampling_hook.Params(temperature=temperature, top_k=top_k, top_p=top_p,
                                seed=_field(body, "seed", int, None))


def _field(body: dict, name: str, kind: type, default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if kind is int:
        ok, what = fields.is_int(value), "an integer"
    elif kind is bool:
        ok, what = isinstance(value, bool), "true or false"
    else:
        ok, what = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    if not ok:
        raise ApiError(400, f"`{name}` must be {what}", name)
    return _finite(name, value) if kind is float else value


def _finite(name: str, value: float) -> float:
    """`value` as a float; an integer too large for one (JSON has no bound) or 1e400 (inf)
    is refused, as is a NaN or Infinity literal (which Python's json reads)."""
    number = fields.as_float(value)
    if not math.isfinite(number):
        raise ApiError(400, f"`{name}` must be a finite number", name)
    return number


class _Post:
    """What the engine's thread hands an event loop's queues, delivered in order with one
    wake-up of the loop (one `call_soon_threadsafe`, a write to its self-pipe) for all that
    waits, not one a token."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._waiting: list[tuple[asyncio.Queue, int | None]] = []

    def put(self, queue: asyncio.Queue, items: Sequence[int | None]) -> None:
        with self._lock:
            first = not self._waiting
            self._waiting.extend((queue, item) for item in items)
        if not first:  # a delivery is on its way: it takes these too
            return
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            with self._lock:
                self._waiting.clear()

    def _deliver(self) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting, []
        for queue, item in waiting:
            queue.put_nowait(item)


class _Bridge:
    """A request's listener: tokens from the engine's thread onto the event loop's queue."""

    def __init__(self, server: Server, loop: asyncio.AbstractEventLoop) -> None:
        self.server, self.loop = server, loop
        self.post = server.post(loop)
        self.queue: asyncio.Queue[int | None] = asyncio.Queue()
        # set before the sequence is cancelled for having met a stop string: it finished
        # on `stop` (the engine only saw a cancel)
        self.stopped = False

    def _put(self, item: int | None) -> None:
        self.post.put(self.queue, (item,))

    def token(self, request: Request, token: int) -> None:
        self.server.metrics.token(request.arrived, request.token_times)
        self._put(token)

    def tokens_at_once(self, request: Request, tokens: Sequence[int]) -> None:
        """Several tokens at once (the last of `request.token_times` are theirs): what a
        step of the engine core brings (kerncc.serve.client)."""
        self.server.metrics.took(request.arrived, request.token_times, len(tokens))
        self.post.put(self.queue, tokens)

    def done(self, request: Request) -> None:
        self._put(None)

    def count(self, request: Request) -> None:
        """Count the finish the client is told, once the answer is over: a stop string met
        in the text is `stop` even when the engine ended the sequence first (by length, or by
        the cancel the stop string sent); an answer left before the engine ended it is
        `cancelled`."""
        if request.finish == "refused":  # never served (the engine core said why)
            return
        reason = "stop" if self.stopped else request.finish or "cancelled"
        self.server.metrics.finished(reason)


# ---------------------------------------------------------------------------------------------
# Generation: tokens to text, stop strings


@attrs.define
class _Piece:
    text: str
    token_ids: list[int]
    finish: str | None = None
    heard: list[Any] = attrs.field(factory=list)  # the tokens' logprobs (logits.Heard)
    score: float = 0.0  # at the end: the sum of the chosen tokens' logprobs (best_of)


class _Detok:
    """Text of the tokens so far, handed out in pieces; finds stop strings.

    Incremental: the codec's TextStream decodes a short window of recent ids per token, and a
    stop is looked for only where the new text could complete one, so a token costs the same
    at the 10th and the 10,000th (decoding everything each time cost the square of the
    length, on the event loop).
    """

    def __init__(self, text: Text | None, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.stream = None if text is None else text.stream()
        self.full = ""  # the text of the tokens so far (what the stream handed out)
        self.sent = ""  # what was handed out here: a prefix of `full`
        self.stopped = False
        self.reach = max((len(s) for s in stops), default=0)

    def add(self, token: int) -> str:
        if self.stream is None:
            return ""
        new = self.stream.push(token)
        if not new:  # an incomplete character: wait for its next byte
            return ""
        searched = max(0, len(self.full) - self.reach + 1)
        self.full += new
        full = self.full
        cut = min((i for i in (full.find(s, searched) for s in self.stops) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.stopped = True
            full = full[:cut]
        else:  # hold back what may be the start of a stop string
            full = full[:len(full) - self._held(full)]
        piece, self.sent = full[len(self.sent):], max(full, self.sent, key=len)
        return piece

    def rest(self) -> str:
        """Text held back at the end (the generation ended without completing a stop)."""
        if self.stream is None:
            return ""
        self.full += self.stream.flush()
        piece, self.sent = self.full[len(self.sent):], self.full
        return piece

    def _held(self, full: str) -> int:
        return max((n for s in self.stops for n in range(1, len(s))
                    if full.endswith(s[:n])), default=0)


class _Watch:
    """Whether `_pieces` looks, every POLL seconds while it waits for the engine, for a client
    gone away: a whole answer's for as long as it runs, a stream's until its first piece (from
    then on the stream's own writes find out)."""

    def __init__(self) -> None:
        self.on = True


async def _pieces(server: Server, ask: Ask, http: HttpRequest, watch: _Watch,
                  prompt: Sequence[int] | None = None,
                  params: sampling_hook.Params | None = None) -> AsyncIterator[_Piece]:
    """The pieces of one generation (of `prompt` with `params`, by default the request's);
    cancels the sequence when the caller goes away."""
    bridge = _Bridge(server, asyncio.get_running_loop())
    request = server.submit(ask, bridge, prompt, params)
    detok = _Detok(server.text, ask.stops)
    told = 0
    try:
        while True:
            try:
                item = await asyncio.wait_for(bridge.queue.get(), POLL) if watch.on \
                    else await bridge.queue.get()
            except TimeoutError:
                if await http.is_disconnected():
                    return
                continue
            piece, ended = _catch_up(item, bridge.queue, request, detok)
            piece.heard = _heard(request, told, len(piece.token_ids))
            told += len(piece.token_ids)
            if piece.finish == "stop":
                bridge.stopped = True
                piece.score = _score(request)
            if piece.token_ids:
                yield piece
            if piece.finish == "stop":
                return
            if ended:
                break
        if request.finish == "refused":  # by the engine core (kerncc.serve.client)
            raise server.refused(ask, request)
        if request.finish == "error":
            raise ApiError(500, request.error or "the engine failed", code="engine_fault")
        if request.finish == "cancelled":
            raise ApiError(503, "the request was cancelled: the server is shutting down",
                           code="cancelled")
        yield _Piece(detok.rest(), [], request.finish, score=_score(request))
    finally:
        if request.finish is None:
            server.engine.cancel(request)
        bridge.count(request)


def _catch_up(item: int | None, queue: asyncio.Queue, request: Request, detok: _Detok
              ) -> tuple[_Piece, bool]:
    """`item` and every token queued behind it as one piece, and whether the generation
    ended (None came). One token a piece while the loop keeps up; when it has fallen behind
    the engine (at 32 streams it can), the tokens waiting go out in one event, one write."""
    ids: list[int] = []
    texts: list[str] = []
    while item is not None:
        texts.append("" if item in request.stop_ids else detok.add(item))  # eos: no text
        ids.append(item)
        if detok.stopped:
            return _Piece("".join(texts), ids, "stop"), True
        if queue.empty():
            return _Piece("".join(texts), ids), False
        item = queue.get_nowait()
    return _Piece("".join(texts), ids), True


def _heard(request: Request, start: int, count: int) -> list[Any]:
    """What the request's drawer heard of its tokens start..start+count (their logprobs);
    the engine's thread adds a token's before the token is told."""
    heard = getattr(request.sampler, "heard", None)
    return list(heard[start:start + count]) if heard else []


def _score(request: Request) -> float:
    return float(getattr(request.sampler, "cumulative", 0.0))


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


# ---------------------------------------------------------------------------------------------
# Routes


def create_app(server: Server) -> Starlette:
    """The ASGI app; its lifespan starts and stops the engine's thread."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        server.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.stop)

    async def completions(http: HttpRequest) -> Response:
        return await _generate(server, http, chat=False)

    async def chat(http: HttpRequest) -> Response:
        return await _generate(server, http, chat=True)

    async def models(http: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [server.model_object()]})

    async def model(http: HttpRequest) -> Response:
        name = http.path_params["model"]
        if name != server.model:
            return ApiError(404, f"no model `{name}` (this server has `{server.model}`)",
                            "model", "model_not_found").response()
        return JSONResponse(server.model_object())

    async def health(http: HttpRequest) -> Response:
        if server.healthy:
            return JSONResponse({"status": "ok"})
        why = server.engine.fault or "shutting down"
        return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)

    async def metrics(http: HttpRequest) -> Response:
        return Response(server.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def http_error(http: HttpRequest, exc: Exception) -> Response:
        """Starlette's own refusals (no route, a method the route does not take), in
        OpenAI's shape like every other error."""
        assert isinstance(exc, HTTPException)
        message = f"no route {http.method} {http.url.path}" if exc.status_code == 404 \
            else f"{http.method} {http.url.path}: {exc.detail}"
        response = ApiError(exc.status_code, message).response()
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{model:path}", model, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: http_error},
                     middleware=[Middleware(Access, key=lambda: server.api_key)])


async def _body(http: HttpRequest, timeout: float) -> bytes:
    """The request's bytes, bounded in size and in time (a client sending a byte now and then
    would hold its connection for ever); JSON decoding is the caller's."""
    raw = b""
    try:
        async with asyncio.timeout(timeout):
            async for chunk in http.stream():
                raw += chunk
                if len(raw) > MAX_BODY:
                    raise ApiError(413, f"the request body is over {MAX_BODY} bytes")
    except ClientDisconnect:  # nobody hears this answer; it only keeps a traceback out of logs
        raise ApiError(400, "the client went away before the end of its request body") from None
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} seconds",
                       code="timeout") from None
    return raw


def _json(raw: bytes) -> Any:
    try:  # strictly: json.loads(bytes) would let UTF-8-encoded surrogates through
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ApiError(400, f"the request body is not UTF-8 JSON: {err}") from None
    try:
        body = json.loads(text)
    except ValueError as err:
        raise ApiError(400, f"the request body is not JSON: {err}") from None
    except RecursionError:  # json's decoder recurses once per level of [ or {
        raise ApiError(400, "the request body nests arrays or objects too deeply") from None
    # Decoded strictly, the text holds no surrogate: only a \u escape can make one.
    pointer = _unpaired(body) if SURROGATE_ESCAPE.search(raw) else None
    if pointer is not None:
        raise ApiError(400, f"{pointer}: the string is not Unicode text: it holds half of a "
                       "UTF-16 surrogate pair (an escape such as \\ud800 without its partner)",
                       pointer.split("/")[1] or None)
    return body


def _unpaired(body: Any) -> str | None:
    """The JSON pointer of a string (or key) of `body` holding a lone surrogate, or None:
    JSON may escape one, but no tokenizer and no UTF-8 answer can carry it."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        pointer, value = stack.pop()
        if isinstance(value, str) and not _is_text(value):
            return pointer or "/"
        if isinstance(value, dict):
            for key, item in value.items():
                where = f"{pointer}/{key.encode('utf-8', 'backslashreplace').decode()}"
                if not _is_text(key):
                    return where
                stack.append((where, item))
        elif isinstance(value, list):
            stack.extend((f"{pointer}/{i}", item) for i, item in enumerate(value)
                         if isinstance(item, (str, list, dict)))
    return None


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def _generate(server: Server, http: HttpRequest, chat: bool) -> Response:
    """A completion or chat request, counted in `server.active` until its last byte (a
    stream's until its last event): a drain waits for those."""
    if server.draining:
        return ApiError(503, "the server is shutting down", code="unavailable").response()
    server.active += 1
    try:
        response = await _answer(server, http, chat)
    except BaseException:
        server.active -= 1
        raise
    if isinstance(response, _Counted):
        response.server = server  # the stream's end lowers the count
    else:
        server.active -= 1
    return response


class _Counted(StreamingResponse):
    """A stream that lowers its server's count of requests being answered when it ends,
    however it ends (written out, its client gone, cancelled)."""

    server: Server | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.server is not None:
                self.server.active -= 1


async def _answer(server: Server, http: HttpRequest, chat: bool) -> Response:
    try:
        ask = await _parsed(server, http, chat, await _body(http, server.body_timeout))
        units = _units(ask)
        if ask.stream:
            # a client that leaves while its request waits (queued, or behind a long
            # prefill) is cancelled then, before the engine spends a step on it
            watch = _Watch()
            first = _indexed(_pieces(server, ask, http, watch)) if len(units) == 1 \
                else _merged(server, ask, http, watch, units)
            opened = await _first(first)  # errors before the first token are plain answers
            watch.on = False
            return _Counted(_sse(server, ask, chat, opened, first),
                            media_type="text/event-stream")
        got: dict[int, list[_Piece]] = {i: [] for i in range(len(units))}
        async for index, piece in _merged(server, ask, http, _Watch(), units):
            got[index].append(piece)
    except ApiError as err:
        return err.response()
    return JSONResponse(_whole(server, ask, chat, [got[i] for i in range(len(units))]))


async def _parsed(server: Server, http: HttpRequest, chat: bool, raw: bytes) -> Ask:
    """The request parsed off the event loop (decoding 4 MiB of JSON, tokenizing it and
    rendering a chat template take long enough to stall every stream the loop is feeding);
    a chat template's render stops when its client leaves or the server shuts down. A small
    completions request of token ids (`_quick`) is parsed on the loop: cheaper there than a
    hop to a thread, which waits for the interpreter lock the loop holds."""
    if not chat and len(raw) <= QUICK_BODY:
        body = _json(raw)
        if _quick(body):
            return server.parse(body, chat)
        return await asyncio.to_thread(server.parse, body, chat)  # no template to stop
    gone = threading.Event()

    def stop() -> bool:
        return gone.is_set() or server.renders.is_set()

    work = asyncio.ensure_future(asyncio.to_thread(
        lambda: server.parse(_json(raw), chat, stop)))
    while True:
        done, _ = await asyncio.wait({work}, timeout=POLL)
        if done:
            return work.result()
        if not gone.is_set() and await http.is_disconnected():
            gone.set()  # the render ends at its next step; nobody hears the answer


def _quick(body: Any) -> bool:
    """Whether a completions request is parsed on the event loop: its prompt token ids (no
    text to tokenize), no grammar to compile, no prompt text to decode for `echo`."""
    if not isinstance(body, dict) or body.get("echo"):
        return False
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or str in set(map(type, prompt)):
        return False
    return all(body.get(name) is None for name in grammar.FIELDS)


def _units(ask: Ask) -> list[tuple[tuple[int, ...], sampling_hook.Params]]:
    """The sequences a request asks for: `best_of` of each prompt, in order, each with its
    own seed (the request's seed plus its place: n seeded answers differ, and repeat)."""
    out = []
    for prompt in ask.every_prompt:
        params = ask.params
        if params.repetition_penalty != 1:
            params = attrs.evolve(params, prompt=prompt)
        for j in range(ask.options.best_of):
            seed = None if params.seed is None else (params.seed + j) % (1 << 64)
            out.append((prompt, attrs.evolve(params, seed=seed) if j else params))
    return out


def _indexed(pieces: AsyncIterator[_Piece]) -> AsyncIterator[tuple[int, _Piece]]:
    async def indexed() -> AsyncIterator[tuple[int, _Piece]]:
        try:
            async for piece in pieces:
                yield 0, piece
        finally:
            await pieces.aclose()  # type: ignore[attr-defined]
    return indexed()


async def _merged(server: Server, ask: Ask, http: HttpRequest, watch: _Watch,
                  units: list[tuple[tuple[int, ...], sampling_hook.Params]]
                  ) -> AsyncIterator[tuple[int, _Piece]]:
    """The pieces of every unit as they come, each with its unit's index; the first error
    ends them all (every sequence still served is cancelled)."""
    queue: asyncio.Queue[tuple[int, _Piece | BaseException | None]] = asyncio.Queue()

    async def run(index: int, prompt: tuple[int, ...], params: sampling_hook.Params) -> None:
        try:
            async for piece in _pieces(server, ask, http, watch, prompt, params):
                queue.put_nowait((index, piece))
            queue.put_nowait((index, None))
        except Exception as err:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((index, err))

    tasks = [asyncio.create_task(run(i, p, params)) for i, (p, params) in enumerate(units)]
    left = len(tasks)
    try:
        while left:
            index, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _whole(server: Server, ask: Ask, chat: bool, results: list[list[_Piece]]
           ) -> dict[str, Any]:
    """The answer of a request not streamed: each prompt's `n` choices (its best `best_of`
    by the sum of their logprobs, when it asked for more)."""
    n, best_of = ask.options.n, ask.options.best_of
    choices, completion = [], 0
    for i, text in enumerate(ask.texts or ("",)):
        group = results[i * best_of:(i + 1) * best_of]
        completion += sum(len(p.token_ids) for pieces in group for p in pieces)
        if best_of > n:
            group = sorted(group, key=lambda pieces: -pieces[-1].score if pieces else 0.0)[:n]
        choices += [_choice(server, ask, chat, pieces, i * n + rank, text)
                    for rank, pieces in enumerate(group)]
    prompt_tokens = sum(len(p) for p in ask.every_prompt)
    return {**_head(server, chat, stream=False), "choices": choices,
            "usage": _usage(prompt_tokens, completion)}


def _choice(server: Server, ask: Ask, chat: bool, pieces: list[_Piece], index: int,
            prompt_text: str) -> dict[str, Any]:
    ids = [t for p in pieces for t in p.token_ids]
    text = "".join(p.text for p in pieces)
    heard = [h for p in pieces for h in p.heard]
    finish = next((p.finish for p in pieces if p.finish), "length")
    choice: dict[str, Any] = {"index": index, "finish_reason": finish, "token_ids": ids}
    wants = ask.options.logprobs is not None
    if chat:
        choice["message"], choice["finish_reason"] = _tool_message(ask, text, finish)
        choice["logprobs"] = _chat_logprobs(server, heard) if wants else None
    else:
        echo = prompt_text if ask.options.echo else ""
        choice.update(text=echo + text,
                      logprobs=_text_logprobs(server, heard, 0)[0] if wants else None)
    return choice


def _tool_message(ask: Ask, text: str, finish: str) -> tuple[dict[str, Any], str]:
    """A chat choice's message (its tool calls parsed out of the text, when it has tools)
    and finish reason (`tool_calls` when it ended on them)."""
    if ask.tools is None:
        return {"role": "assistant", "content": text}, finish
    content, calls = tools.parse(ask.tools.format, text)
    calls = tools.limited(ask.tools, calls)
    if not calls:
        return {"role": "assistant", "content": text}, finish
    return ({"role": "assistant", "content": content, "tool_calls": calls},
            "tool_calls" if finish == "stop" else finish)


def _chat_delta(ask: Ask, streams: dict[int, tools.Stream], index: int, piece: _Piece
                ) -> tuple[dict[str, Any], str | None]:
    """A streamed chat piece's delta and finish reason: its text, or with tools what of it
    is content now and the calls completed (`delta.tool_calls`)."""
    if ask.tools is None:
        return ({"content": piece.text} if piece.text or piece.token_ids else {}), piece.finish
    stream = streams.setdefault(index, tools.Stream(ask.tools))
    before = stream.calls
    content, calls = stream.push(piece.text)
    if piece.finish:
        more, last = stream.finish()
        content, calls = content + more, calls + last
    delta: dict[str, Any] = {}
    if content or (piece.token_ids and not calls):
        delta["content"] = content
    if calls:
        delta["tool_calls"] = [{"index": before + k, **c} for k, c in enumerate(calls)]
    finish = "tool_calls" if piece.finish == "stop" and stream.calls else piece.finish
    return delta, finish


# ---------------------------------------------------------------------------------------------
# Logprobs in OpenAI's shapes

FLOOR = -9999.0  # a logprob of -inf (a masked token), as JSON can carry it (vLLM's choice)


def _token_text(server: Server, token: int) -> str:
    return server.text.decode([token]) if server.text is not None else f"token_id:{token}"


def _lp(value: float) -> float:
    return max(value, FLOOR)


def _text_logprobs(server: Server, heard: list[Any], offset: int
                   ) -> tuple[dict[str, Any], int]:
    """Completions' `logprobs` of these tokens, the first at text offset `offset`; and the
    offset after them."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    for h in heard:
        text = _token_text(server, h.token)
        out["tokens"].append(text)
        out["token_logprobs"].append(_lp(h.logprob))
        out["top_logprobs"].append({_token_text(server, t): _lp(lp) for t, lp in h.top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset


def _chat_logprobs(server: Server, heard: list[Any]) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = _token_text(server, token)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode())}

    return {"content": [{**entry(h.token, h.logprob),
                         "top_logprobs": [entry(t, lp) for t, lp in h.top]} for h in heard],
            "refusal": None}


async def _first(pieces: AsyncIterator[tuple[int, _Piece]]) -> tuple[int, _Piece] | None:
    try:
        return await pieces.__anext__()
    except StopAsyncIteration:
        return None


def _head(server: Server, chat: bool, stream: bool) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if stream else "chat.completion") if chat \
        else "text_completion"
    prefix = "chatcmpl" if chat else "cmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": server.model, "system_fingerprint": server.fingerprint}


async def _sse(server: Server, ask: Ask, chat: bool, first: tuple[int, _Piece] | None,
               rest: AsyncIterator[tuple[int, _Piece]]) -> AsyncIterator[bytes]:
    head = _head(server, chat, stream=True)
    count = 0
    wants = ask.options.logprobs is not None
    offsets: dict[int, int] = {}  # completions' text offset, by choice (logprobs)
    streams: dict[int, tools.Stream] = {}  # chat choices' tool-call parsers, by choice
    texts = ask.texts or ("",)
    choices = len(texts) * ask.options.n

    def event(data: dict[str, Any]) -> bytes:
        return f"data: {json.dumps(data)}\n\n".encode()

    plain = _Plain(head, chat) if not wants and ask.tools is None else None

    def chunk(index: int, piece: _Piece) -> bytes:
        if plain is not None and not (ask.options.echo and index not in offsets):
            offsets.setdefault(index, 0)
            return plain.chunk(index, piece)
        choice: dict[str, Any] = {"index": index, "finish_reason": piece.finish,
                                  "token_ids": piece.token_ids}
        if chat:
            choice["delta"], choice["finish_reason"] = _chat_delta(ask, streams, index, piece)
            choice["logprobs"] = _chat_logprobs(server, piece.heard) if wants else None
            return event({**head, "choices": [choice]})
        text = piece.text
        if ask.options.echo and index not in offsets:  # the prompt leads each choice's text
            text = texts[index // ask.options.n] + text
        logprobs = None
        if wants:
            logprobs, offsets[index] = _text_logprobs(server, piece.heard,
                                                      offsets.get(index, 0))
        offsets.setdefault(index, 0)
        choice.update(text=text, logprobs=logprobs)
        return event({**head, "choices": [choice]})

    try:
        if chat:
            for index in range(choices):
                yield event({**head, "choices": [{"index": index, "delta": {"role": "assistant"},
                                                  "finish_reason": None}]})
        pieces = [first] if first is not None else []
        async for index, piece in _chain(pieces, rest):
            count += len(piece.token_ids)
            yield chunk(index, piece)
        if ask.usage_in_stream:
            prompt_tokens = sum(len(p) for p in ask.every_prompt)
            yield event({**head, "choices": [], "usage": _usage(prompt_tokens, count)})
    except ApiError as err:
        yield event(err.body())
    yield b"data: [DONE]\n\n"


class _Plain:
    """A stream's chunk without logprobs or tools, written from a template made once of its
    head: the bytes `json.dumps` makes of the chunk's dict (the same keys in the same order,
    its separators, its escapes), without building and walking a dict a chunk."""

    def __init__(self, head: dict[str, Any], chat: bool) -> None:
        opened = json.dumps(head)
        self.before = f'data: {opened[:-1]}, "choices": [{{"index": '
        self.chat = chat

    def chunk(self, index: int, piece: _Piece) -> bytes:
        finish = "null" if piece.finish is None else json.dumps(piece.finish)
        ids = ", ".join(map(str, piece.token_ids))
        if self.chat:
            delta = f'{{"content": {json.dumps(piece.text)}}}' \
                if piece.text or piece.token_ids else "{}"
            rest = f'"delta": {delta}, "logprobs": null'
        else:
            rest = f'"text": {json.dumps(piece.text)}, "logprobs": null'
        return (f'{self.before}{index}, "finish_reason": {finish}, "token_ids": [{ids}], '
                f'{rest}}}]}}\n\n').encode()


async def _chain(first: list[Any], rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    for piece in first:
        yield piece
    try:
        async for piece in rest:
            yield piece
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
