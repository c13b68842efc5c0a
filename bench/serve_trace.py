"""Where a request's time to first token goes, stage by stage (`python -m bench.serve --trace
FILE`): timestamps taken along one request's way, joined by its prompt.

`install(path)` wraps a few functions of the server's process (before the front end is forked
from it, so both have them) and `client(path, ...)` is called by the bench's clients; every
stamp is a JSON line appended to `path`: (stage, the prompt's last 8 tokens, perf_counter).
Every process of the bench runs on one machine, whose perf_counter is one clock
(CLOCK_MONOTONIC). Nothing of this runs unless --trace is given: the server's code is not
changed, the functions are wrapped in the bench's own processes only.

The stages, in order (`STAGES`):

  sent      the client opens its connection (bench.serve.one)
  app       the front end's handler starts (http._generate: HTTP read and parsed by uvicorn)
  parsed    the body is JSON-decoded and checked, the request made (Server.submit)
  out       the front end's batch holding it leaves for the core (CoreClient._flush)
  in        the core's receiving thread has it (Core._take)
  admitted  the engine's plan admits it (Engine._issue)
  chunked   the chunk call that feeds its prompt's last row is issued (Engine._issue)
  token     its first token is collected (Engine._add_token)
  told      the core's step message with it leaves (Core._flush)
  heard     the front end has it (CoreClient._record)
  written   its first SSE bytes go to uvicorn (the response's first body write)
  first     the client reads them (bench.serve.one)

`report(path)` prints each stage's median and p90 time from the one before it, and the steps
the engine issued (prefill rows, decode rows) while newcomers waited.
"""

from __future__ import annotations

import contextvars
import json
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

STAGES = ("sent", "app", "parsed", "out", "in", "admitted", "chunked", "token", "told",
          "heard", "written", "first")

_fd: int | None = None
_current: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "kerncc_bench_trace", default=None)


def key(prompt: Sequence[int]) -> list[int]:
    return [int(t) for t in prompt[-8:]]


def stamp(stage: str, prompt: Sequence[int] | None, when: float | None = None,
          **extra: Any) -> None:
    if _fd is None:
        return
    line = {"s": stage, "k": key(prompt) if prompt is not None else None,
            "t": time.perf_counter() if when is None else when, **extra}
    os.write(_fd, (json.dumps(line) + "\n").encode())


def open_trace(path: str) -> None:
    global _fd
    _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def close_trace() -> None:
    global _fd
    if _fd is not None:
        os.close(_fd)
        _fd = None


def install(path: str) -> None:
    """Wrap the server's functions to stamp the stages (this process and those forked)."""
    from kerncc.serve import client, core, engine, http

    open_trace(path)

    generate = http._generate

    async def _generate(server: Any, request: Any, chat: bool) -> Any:
        record = {"app": time.perf_counter()}
        _current.set(record)
        response = await generate(server, request, chat)
        if hasattr(response, "server"):  # a stream: its first body write is stamped
            response.trace = record
        return response

    http._generate = _generate

    submit = http.Server.submit

    def server_submit(self: Any, ask: Any, listener: Any, prompt: Any = None,
                      params: Any = None) -> Any:
        request = submit(self, ask, listener, prompt, params)
        record = _current.get()
        if record is not None:
            record["prompt"] = request.prompt
            stamp("app", request.prompt, record["app"])
            stamp("parsed", request.prompt)
        return request

    http.Server.submit = server_submit

    counted_call = http._Counted.__call__

    async def counted(self: Any, scope: Any, receive: Any, send: Any) -> None:
        record = getattr(self, "trace", None)
        if record is None or "prompt" not in record:
            return await counted_call(self, scope, receive, send)

        async def traced(message: dict[str, Any]) -> None:
            if message.get("type") == "http.response.body" and message.get("body") \
                    and not record.get("written"):
                record["written"] = True
                stamp("written", record["prompt"])
            await send(message)

        return await counted_call(self, scope, receive, traced)

    http._Counted.__call__ = counted

    flush = client.CoreClient._flush

    def client_flush(self: Any) -> None:
        adds = [self.requests.get(item[0]) for item in self._batch["add"]]
        flush(self)
        now = time.perf_counter()
        for request in adds:
            if request is not None:
                stamp("out", request.prompt, now)

    client.CoreClient._flush = client_flush

    record = client.CoreClient._record

    def client_record(self: Any, message: list[Any], now: float) -> None:
        request = self.requests.get(message[0])
        if request is not None and message[1] and not request.generated:
            stamp("heard", request.prompt, now)
        record(self, message, now)

    client.CoreClient._record = client_record

    take = core.Core._take

    def core_take(self: Any, raw: bytes) -> None:
        now = time.perf_counter()
        try:
            message = core.wire.decode(raw, ("hello", "add", "cancel"))
        except core.wire.WireError:
            message = None
        if message is not None and message[0] == "add":
            for item in message[2]:
                stamp("in", item[1], now)
        take(self, raw)

    core.Core._take = core_take

    issue = engine.Engine._issue

    def engine_issue(self: Any, plan: Any) -> None:
        now = time.perf_counter()
        for seq_id in plan.admitted:
            stamp("admitted", self.requests[seq_id].prompt, now)
        chunk_rows = sum(n for item in plan.items if item.kind == "chunk"
                         for _, _, n in item.parts)
        decode_rows = sum(len(item.parts) for item in plan.items if item.kind == "decode")
        stamp("step", None, now, chunk=chunk_rows, decode=decode_rows,
              waiting=len(self.state.waiting), admitted=len(plan.admitted),
              calls=len(plan.items))
        issue(self, plan)
        for item in plan.items:
            if item.kind != "chunk":
                continue
            for seq_id, start, n in item.parts:
                prompt = self.requests[seq_id].prompt
                if start + n >= len(prompt) - 1:
                    stamp("chunked", prompt)

    engine.Engine._issue = engine_issue

    add_token = engine.Engine._add_token

    def engine_add_token(self: Any, request: Any, token: int, now: float) -> None:
        if not request.generated:
            stamp("token", request.prompt, now)
        add_token(self, request, token, now)

    engine.Engine._add_token = engine_add_token

    sink_token = core._Sink.token

    def sink(self: Any, request: Any, token: int) -> None:
        if self.told == 0:
            self.core._traced.append(request.prompt)
        sink_token(self, request, token)

    core._Sink.token = sink
    core.Core._traced = []

    core_flush = core.Core._flush

    def flushed(self: Any) -> None:
        told, self._traced = self._traced, []
        core_flush(self)
        now = time.perf_counter()
        for prompt in told:
            stamp("told", prompt, now)

    core.Core._flush = flushed


def report(path: str, since: float = 0.0) -> str:
    """Each stage's median and p90 from the stage before (ms), over the requests the clients
    stamped `sent` at or after `since`; and the engine's steps while they arrived."""
    by_key: dict[tuple[int, ...], dict[str, float]] = defaultdict(dict)
    steps = []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if row["s"] == "step":
                steps.append(row)
            elif row["k"] is not None:
                by_key[tuple(row["k"])].setdefault(row["s"], row["t"])
    chosen = [r for r in by_key.values() if r.get("sent", -1) >= since and "first" in r]
    lines = [f"{len(chosen)} requests; ms from the stage before (median, p90), and from sent:"]
    lines.append("| stage | median | p90 | median from sent |")
    lines.append("| --- | --- | --- | --- |")
    before = None
    for stage in STAGES:
        have = [r for r in chosen if stage in r]
        if not have:
            continue
        if before is None:
            lines.append(f"| {stage} | | | 0 |")
        else:
            gaps = [(r[stage] - r[before]) * 1e3 for r in have if before in r]
            total = [(r[stage] - r["sent"]) * 1e3 for r in have]
            lines.append(f"| {stage} | {np.median(gaps):.2f} | {np.percentile(gaps, 90):.2f} | "
                         f"{np.median(total):.2f} |")
        before = stage
    if chosen:
        start = min(r["sent"] for r in chosen)
        end = max(r["first"] for r in chosen)
        inside = [s for s in steps if start <= s["t"] <= end]
        prefill = [s for s in inside if s["chunk"]]
        lines.append(f"engine steps between the first sent and the last first token: "
                     f"{len(inside)}, {len(prefill)} with prefill rows "
                     f"(rows a step: {', '.join(str(s['chunk']) for s in prefill[:40])})")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(report(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.0))
