"""Load on `kerncc serve` over loopback: tokens/s, TTFT and inter-token latency p50/p99 at
concurrency 1, 8 and 32, printed side by side with the ratio to concurrency 1.

The server runs in a process of its own (uvicorn on a thread, 127.0.0.1, a free port), as
`kerncc serve` does, over the example model (generated into --dir unless it is there), whole or
cut (--pipeline), on --backend; `--backend sim` serves on the CPU over a simulated device whose
decode steps take --step-ms (bench/simulated.py) and adds the device's median wait for
the host before each step: the host's cost a step, measured without a GPU.
Every level sends `--requests-per-level x concurrency` streaming requests of random token-id
prompts (`--prompt-len`, `--max-tokens`, fixed seed), at most `concurrency` at once; each
request's TTFT is the time to its first streamed token, its ITLs the gaps between the next ones.
Bounded: a level stops after --budget seconds.

`--prefix N,M` (bare: 2000,100) makes every prompt one fixed N-token shared prefix (a system
prompt, the same in every round) and M random tokens of its own. The example is generated with
a context of at least N + M + --max-tokens (`max_context`, in a folder of its own), and a model
whose context is shorter is refused before any request. The warm-up sends the prefix too, so
the levels meet it cached, as a server that has served that system prompt before.
`--prefix-cache ab` alternates servers with the prefix cache off (`--no-prefix-cache`) and on
over two rounds each and prints TTFT p50 / p99 and tokens/s, on against off, with the ratios;
at the end of each round it reads the server's /metrics: the prefix cache's hit rate and
evictions over the levels. On `--backend sim`, `--row-us` makes a prefill chunk cost its rows
(bench/simulated.py's cost model), so that prefill the cache skips shows in the TTFT.

`--ramp-ms T` starts a level's first `concurrency` requests evenly over T ms rather than all at
once; each client then sends its next request when its last one ends. All at once (the
default, as the rows measured before), requests of one prompt and answer length stay in step:
the whole level arrives, prefills and finishes together, wave after wave, which the prefix
cache meets at its worst (without it, a 2,100-token prefill a request pulls the streams
apart). That is the load generator's doing, not the clients' of the issue's workload (32
users of one system prompt, each starting a turn when its last one ends, none in step with
another): spread over about one request's life, as such clients settle (`--ramp-ms 150` for
64 tokens at a 2 ms step), the levels measure that workload. Measured on the sim (`--row-us
10 --prefix --prefix-cache on --split on`, docs/serving.md): TTFT p50 about 100 ms all at
once, 12-41 ms spread, each wave's 32 prompts waiting for each other in the front end and in
the engine's prefill steps.

`--trace FILE` stamps each request's way to its first token, stage by stage (HTTP read, parse,
the wire both ways, admission, the prefill chunk, the first token, the SSE write: see
bench/serve_trace.py), and prints after each level each stage's median time from the one
before and the prefill rows of the engine's steps meanwhile. Off by default: nothing is
stamped, the server's code is unchanged (the stamps wrap its functions in the bench's
processes only).

A level's streams are read by `--clients` processes (default one per 16 streams, all starting
at one instant), as independent clients would read them: one Python process reading 128
streams fell behind them, and its late reads showed as the server's ITL tail.

The server speaks HTTP through the protocol `kerncc serve` uses (kerncc.serve.guard's h11 with
its guards), not whichever parser uvicorn would pick where httptools is installed.

`--split on` runs the front end apart from the engine core (`kerncc serve --api-workers 1`): a
forked process of its own serving HTTP over a kerncc.serve.client, the core on a thread of the
server's process, as `kerncc serve` runs by default; `--split off` (the default here, as
the rows measured before the split were) keeps everything in one process, and
`--split ab` alternates the two over two rounds each and prints the ratios. `--api-workers N`
puts N front ends beside the core (one writes every stream's events at 128 streams).

Each level is also held against its own decode step: on cuda with one stage the server times
the `decode_batch` graph at the level's sequences (each at the level's mean decode context)
before the engine takes the chain; on the sim the step is --step-ms. The second table gives
tokens/s against sequences / step and the ITL p50 / p99 against the step (issue 40's goals).
`--newcomers N,MS` sends an N-token prompt every MS ms beside the streams, from one interval
after every stream of the first wave has its first token.

--doc docs/benchmarks.md writes the rows between the file's `serve` markers.

  python -m bench.serve --size small --backend cuda                     # whole
  python -m bench.serve --size small --backend cuda --pipeline 'cut,slice-derive,emit'
  python -m bench.serve --size tiny --backend cpu --levels 1,4 --max-tokens 16
  python -m bench.serve --size small --backend sim --step-ms 2.0        # no GPU
  python -m bench.serve --size small --backend sim --ahead ab           # A/B
  python -m bench.serve --size small --backend cuda --levels 32 --invariant ab  # determinism's cost
  python -m bench.serve --size small --backend sim --sampled 0.5        # half of them sample
  python -m bench.serve --size small --backend sim --max-seqs 32 --max-running 128 \
      --levels 64,128 --ahead ab             # four decode calls a step, issued ahead or not
  python -m bench.serve --size small --backend sim --max-seqs 128 --levels 32,128 --split ab
                                                   # front end apart from the core vs one process
  python -m bench.serve --size small --backend cuda --max-seqs 128 --levels 32,128 --split on \
      --api-workers 4                                 # each level against its own decode step
  python -m bench.serve --size small --backend sim --row-us 10 --prefix --prefix-cache ab \
      --levels 32                                                       # prefix cache A/B
  python -m bench.serve --size small --backend cuda --prefix --prefix-cache ab --levels 32 \
      --split on --ramp-ms 150 --trace /tmp/trace.jsonl   # the issue's workload, its TTFT's stages
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import multiprocessing
import os
import re
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import uvicorn

from bench import serve_trace
from bench.report import Report
from kerncc.diagnostics import KernccError
from kerncc.example import generate, make_config
from kerncc.lower import lower_to_bundle
from kerncc.runtime import Chain
from kerncc.runtime.model_runner import request_limits
from kerncc.serve import guard
from kerncc.serve.engine import Config, Engine
from kerncc.serve.http import Server, create_app


REPORT = Report("serve")
HOLD_STEPS = attrs.fields(Config).hold_steps.default


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def one(url: str, model: str, prompt: list[int], max_tokens: int,
              sampled: dict[str, Any] | None = None,
              first: asyncio.Event | None = None) -> tuple[float, list[float], int]:
    """(TTFT, ITLs, tokens) of one streaming request, each token timed when its bytes arrive;
    `first` is set when its first token arrives.

    HTTP/1.1 by hand over asyncio's streams: httpx's stream reader handed the tokens of a
    steady 2 ms rhythm over in bunches about 40 ms apart (ITL p50 0.03 ms, p99 39 ms at 8
    streams), where the server had written them 2 ms apart and a plain socket read them so."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "stream": True, **(sampled or {})}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                 % (host.encode(), len(body)) + body)
    times: list[float] = []
    serve_trace.stamp("sent", prompt, started)
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.split(b"\r\n", 1)[0].decode())
        text = ""
        while (size := int((await reader.readline()).strip() or b"0", 16)) > 0:
            text += (await reader.readexactly(size + 2))[:-2].decode()
            arrived = time.perf_counter()
            *events, text = text.split("\n\n")
            for event in events:
                if not event.startswith("data: ") or event == "data: [DONE]":
                    continue
                data = json.loads(event[6:])
                if "error" in data:
                    raise RuntimeError(data["error"]["message"])
                times += [arrived] * len(data["choices"][0].get("token_ids", []))
                if times and first is not None:
                    first.set()
    finally:
        writer.close()
    if not times:
        raise RuntimeError("a request returned no token")
    serve_trace.stamp("first", prompt, times[0])
    return times[0] - started, [b - a for a, b in itertools.pairwise(times)], len(times)


async def level(url: str, model: str, concurrency: int, prompts: list[list[int]],
                max_tokens: int, budget: float, sampled: float = 0.0, ramp: float = 0.0,
                newcomers: Newcomers | None = None) -> dict[str, float]:
    """One level's measures; `ramp` seconds: the first `concurrency` requests start evenly
    over it (request i at i x ramp / concurrency), the rest as places free (see --ramp-ms);
    `newcomers`: their prompts arrive beside the streams, their TTFTs measured apart (`new_`
    keys: count, p50, p99), not in the streams' TTFT. Every stream is read here, in this
    process (`spread_level`: several)."""
    results, came, wall = await _streams(url, model, concurrency, list(enumerate(prompts)),
                                         max_tokens, budget, sampled, ramp, newcomers)
    return _row(results, came, wall, newcomers is not None)


async def _streams(url: str, model: str, concurrency: int,
                   numbered: list[tuple[int, list[int]]], max_tokens: int, budget: float,
                   sampled: float = 0.0, ramp: float = 0.0, newcomers: Newcomers | None = None,
                   wave: int | None = None, start_at: float | None = None
                   ) -> tuple[list[tuple[float, list[float], int]], list[float], float]:
    """`level`'s streams: (each request's TTFT, ITLs and tokens; the newcomers' TTFTs; the
    wall time from the start). `numbered`: (the request's number in the level, its prompt);
    at most `concurrency` of them at once here; the level's first `wave` numbers (default
    `concurrency`) are its first wave, which `ramp` spreads; `start_at`: a perf_counter
    instant to start at (the processes of `spread_level` start together)."""
    wave = concurrency if wave is None else wave
    if start_at is not None:
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    gate = asyncio.Semaphore(concurrency)
    deadline = time.perf_counter() + budget
    results: list[tuple[float, list[float], int]] = []
    # the first wave's first tokens: newcomers arrive beside streams that decode, not beside
    # the wave's own prefill (a newcomer sent with it waited for all of it)
    firsts = {number: asyncio.Event() for number, _ in numbered if number < wave}

    async def run(number: int, prompt: list[int]) -> None:
        # the place first, then the ramp's wait: the tasks take their places in order, so the
        # first `concurrency` hold them while they wait (waiting for the ramp first left the
        # places free, and the requests after the first `concurrency` took them at once: all
        # of a level's first wave started together, ramp or not)
        async with gate:
            if number < wave and ramp > 0:
                await asyncio.sleep(number * ramp / wave)
            if time.perf_counter() < deadline:
                results.append(await one(url, model, prompt, max_tokens,
                                         _sampling(number, sampled), firsts.get(number)))

    started = time.perf_counter()
    streams = asyncio.gather(*(run(i, p) for i, p in numbered))
    came = [] if newcomers is None else \
        await _newcomers(url, model, newcomers, streams, deadline, list(firsts.values()))
    await streams
    return results, came, time.perf_counter() - started


def _row(results: list[tuple[float, list[float], int]], came: list[float], wall: float,
         newcomers: bool) -> dict[str, float]:
    ttft = [r[0] for r in results]
    itl = [x for r in results for x in r[1]]
    tokens = sum(r[2] for r in results)
    row = {"requests": len(results), "tokens": tokens, "wall": wall, "tok_s": tokens / wall,
           "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
           "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99)}
    if newcomers:
        row.update(newcomers=len(came), new_ttft_p50=percentile(came, 50),
                   new_ttft_p99=percentile(came, 99))
    return row


# Streams one client process reads at most, by default: one Python process reading 128 SSE
# streams at a decode step of 4 ms (32,000 events a second, each a read and a JSON parse)
# fell behind them, and its late reads showed as the server's ITL tail.
STREAMS_A_CLIENT = 16


def clients_for(concurrency: int, asked: int | None = None) -> int:
    """Client processes of a level: `asked` (--clients), else one per STREAMS_A_CLIENT
    streams; never more than the streams."""
    wanted = asked if asked is not None else -(-concurrency // STREAMS_A_CLIENT)
    return max(1, min(wanted, concurrency))


def spread_level(url: str, model: str, concurrency: int, prompts: list[list[int]],
                 max_tokens: int, budget: float, sampled: float = 0.0, ramp: float = 0.0,
                 newcomers: Newcomers | None = None, clients: int = 1) -> dict[str, float]:
    """`level` with its streams read by `clients` processes (request i by process
    i % clients, each at most its share of `concurrency` at once, all starting at one
    instant: perf_counter is one clock for every process here), so that no client falls
    behind the streams it reads; the newcomers are sent by the first. One process: `level`
    itself."""
    if clients <= 1:
        return asyncio.run(level(url, model, concurrency, prompts, max_tokens, budget,
                                 sampled, ramp, newcomers))
    context = multiprocessing.get_context("fork")  # this process runs no thread of its own
    start_at = time.perf_counter() + 0.5  # every process forked and its loop running
    pipes, children = [], []
    for k in range(clients):
        numbered = [(i, p) for i, p in enumerate(prompts) if i % clients == k]
        share = sum(1 for i, _ in numbered if i < concurrency)
        mine, theirs = context.Pipe()
        child = context.Process(target=_client, daemon=True, args=(
            theirs, url, model, share, numbered, max_tokens, budget, sampled, ramp,
            newcomers if k == 0 else None, concurrency, start_at))
        child.start()
        pipes.append(mine)
        children.append(child)
    parts = []
    try:
        for mine in pipes:  # bounded: the level's budget, then a minute for its last reads
            if not mine.poll(budget + 60 + max(0.0, start_at - time.perf_counter())):
                raise RuntimeError(f"a client process did not finish in {budget + 60:.0f} s")
            parts.append(mine.recv())
    finally:
        for child in children:
            child.join(5)
            if child.is_alive():
                child.terminate()
    failed = [part for part in parts if isinstance(part, str)]
    if failed:
        raise RuntimeError(failed[0])
    results = [r for part in parts for r in part[0]]
    wall = max(part[2] for part in parts) - start_at  # the last stream's end
    return _row(results, parts[0][1], wall, newcomers is not None)


def _client(conn: Connection, url: str, model: str, share: int,
            numbered: list[tuple[int, list[int]]], max_tokens: int, budget: float,
            sampled: float, ramp: float, newcomers: Newcomers | None, wave: int,
            start_at: float) -> None:
    """A client process of `spread_level`: its streams' results, the newcomers' TTFTs and
    the instant its last stream ended, or the error that ended it, as one message."""
    try:
        results, came, _ = asyncio.run(_streams(url, model, share, numbered, max_tokens,
                                                budget, sampled, ramp, newcomers, wave,
                                                start_at))
        conn.send((results, came, time.perf_counter()))
    except Exception as err:  # noqa: BLE001 - told to the parent, which raises it
        conn.send(f"{type(err).__name__}: {err}")


async def _newcomers(url: str, model: str, newcomers: Newcomers, streams: Any,
                     deadline: float, firsts: list[asyncio.Event]) -> list[float]:
    """The TTFTs of newcomers sent every `newcomers.every` seconds while `streams` run (each
    its own prompt of `newcomers.tokens` random ids, one token asked: its TTFT is the
    measure), from one interval after every stream of the first wave has its first token, at
    most `newcomers.most`, none past `deadline`; every one sent is awaited."""
    rng = np.random.default_rng(1)
    sent: list[asyncio.Task] = []
    decoding = asyncio.ensure_future(asyncio.gather(*(f.wait() for f in firsts)))
    await asyncio.wait([streams, decoding], timeout=max(0.0, deadline - time.perf_counter()),
                       return_when=asyncio.FIRST_COMPLETED)
    decoding.cancel()
    await asyncio.wait([streams], timeout=newcomers.every)
    while not streams.done() and len(sent) < newcomers.most \
            and time.perf_counter() < deadline:
        prompt = rng.integers(0, newcomers.vocab, newcomers.tokens).tolist()
        sent.append(asyncio.ensure_future(one(url, model, prompt, 1)))
        await asyncio.wait([streams], timeout=newcomers.every)
    return [r[0] for r in await asyncio.gather(*sent)]


@attrs.frozen
class Newcomers:
    """`--newcomers N,MS`: an N-token prompt every MS ms beside the running streams."""

    tokens: int
    every: float  # seconds
    vocab: int
    most: int = 1000  # a level's newcomers at most (bounded)


def _sampling(number: int, fraction: float) -> dict[str, Any] | None:
    """Request `number`'s sampling fields: `fraction` of the requests, spread evenly (so that
    every batch mixes them), sample at temperature 0.8, top-p 0.95, a seed each; the rest
    are greedy (None)."""
    if int((number + 1) * fraction) == int(number * fraction):
        return None
    return {"temperature": 0.8, "top_p": 0.95, "seed": number}


def start_server(chain: Chain, max_seqs: int, model: str, ahead: bool = True,
                 prefix_cache: bool = True, split: bool = False,
                 step_tokens: int | None = None, fronts: int = 1,
                 chunk: int | None = None, hold_steps: int = HOLD_STEPS) -> tuple[str, Any]:
    """The server on a free port of loopback; its URL and what `stop_server` stops. `split`:
    `fronts` front ends in processes of their own over a kerncc.serve.core Core in this one,
    as `kerncc serve --api-workers N` runs them; else everything here (--api-workers 0).
    `step_tokens`: the engine's step budget (Config.step_tokens; None: its default); `chunk`:
    its prefill rows a step (Config.chunk; None: its default); `hold_steps`: Config.hold_steps."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    engine = Engine(chain, Config(max_running=max_seqs, max_queue=4096, ahead=ahead,
                                  prefix_cache=prefix_cache, step_tokens=step_tokens,
                                  chunk=chunk, hold_steps=hold_steps))
    if split:
        return url, _start_apart(engine, model, sock, url, fronts)
    server = Server(engine, model)
    uv = uvicorn.Server(_uvicorn_config(server))
    threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True).start()
    for _ in range(500):
        if uv.started:
            break
        time.sleep(0.02)
    return url, uv


def _start_apart(engine: Engine, model: str, sock: socket.socket, url: str,
                 fronts: int = 1) -> tuple[Any, Any]:
    """The front ends forked first (before this process starts a thread of its own), then
    the core on a thread here; (the front ends' processes, the core) once /health answers."""
    from kerncc.serve.core import Core

    folder = tempfile.mkdtemp(prefix="kerncc-bench-")
    inbox = f"ipc://{folder}/core"
    outboxes = [f"ipc://{folder}/front-{i}" for i in range(fronts)]
    sock.listen(2048)
    front = [multiprocessing.get_context("fork").Process(
        target=_front, args=(sock, inbox, outbox, i, model, os.getpid()), daemon=True)
        for i, outbox in enumerate(outboxes)]
    for process in front:
        process.start()
    core = Core(engine, inbox, outboxes)
    threading.Thread(target=core.run, daemon=True).start()
    for _ in range(3000):  # bounded: 60 s
        with contextlib.suppress(OSError):
            with socket.create_connection(sock.getsockname()[:2], timeout=1) as probe:
                probe.sendall(b"GET /health HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n")
                if probe.recv(12).startswith(b"HTTP/1.1 200"):
                    return front, core
        time.sleep(0.02)
    raise SystemExit(f"bench.serve: the front end at {url} did not start in 60 s")


def _front(sock: socket.socket, inbox: str, outbox: str, worker: int, model: str,
           parent: int) -> None:
    """Front end `worker`'s process: uvicorn over a CoreClient."""
    from kerncc.serve.client import CoreClient

    client = CoreClient(inbox, outbox, worker, alive=lambda: os.getppid() == parent)
    uv = uvicorn.Server(_uvicorn_config(Server(client, model)))
    uv.run(sockets=[sock])


def _uvicorn_config(server: Server) -> uvicorn.Config:
    """uvicorn serving `server` over the HTTP protocol `kerncc serve` runs (kerncc.serve.guard's
    h11 with its guards), not uvicorn's pick: with httptools installed that is another parser,
    whose costs `kerncc serve` does not have."""
    return uvicorn.Config(create_app(server), log_level="warning", http=guard.protocol())


def stop_server(running: Any) -> None:
    if isinstance(running, uvicorn.Server):
        running.should_exit = True
        return
    fronts, core = running
    for front in fronts:
        front.terminate()
    for front in fronts:
        front.join(10)
    core.stop()


def serve(conn: Connection, args: argparse.Namespace, manifest: Path, ahead: bool,
          prefix_cache: bool, split: bool = False, invariant: bool = True) -> None:
    """The server's process: load, serve on loopback, answer the bench's questions (`idle`:
    the simulated device's wait for the host a step, then reset; `stop`) until told to stop.
    `invariant` False: the cuda backend's batch-shaped GEMMs (KERNCC_INVARIANT=0), for the A/B."""
    if not invariant:
        from kerncc.runtime.backends import gemv

        gemv.INVARIANT = False  # read by each CudaBackend as it is made
    if args.trace:
        serve_trace.install(args.trace)
    bundle = lower_to_bundle(manifest, args.pipeline)
    devices = [int(d) for d in args.devices.split(",")] if args.devices else None
    if args.backend == "sim":
        from bench.simulated import Device, Timed

        backend: Any = Device(args.step_ms, args.row_us)
        chain = (Chain if args.row_us is None else Timed)(
            bundle, backend=backend, graphs=True,
            token_capacity=engine_seqs(args) * (args.prompt_len + args.max_tokens + 64)
            + newcomer_len(args))
    else:
        backend = None
        chain = Chain(bundle, backend=args.backend, devices=devices)
    model = bundle.stages[0].manifest.model
    context = request_limits([s.manifest for s in bundle.stages]).context
    # a newcomer takes a place of its own beside the streams (it is answered by its chunk's
    # token and leaves: it never decodes), else it would wait for a stream to end
    seats = engine_seqs(args) + (args.newcomers is not None)
    steps = decode_steps(args, chain, seats)  # before the engine: it owns the chain after
    try:
        url, running = start_server(chain, seats, model, ahead=ahead,
                                    prefix_cache=prefix_cache, split=split,
                                    step_tokens=args.step_tokens, fronts=args.api_workers,
                                    chunk=args.chunk, hold_steps=args.hold_steps)
    except KernccError as err:  # a flag the engine refuses (--chunk past the rows bound)
        conn.send(("error", err.headline))
        return
    gc.collect()  # what the server holds from its start on, out of the cyclic collector, as
    gc.freeze()  # `kerncc serve` does (kerncc.cli.serve.make_engine)
    conn.send((url, model, bundle.stages[0].manifest.buffers["embed.w"].shape[0],
               len(bundle.stages), getattr(backend, "wake_us", None), context, steps))
    while (asked := conn.recv()) != "stop":
        conn.send(backend.idle_us() if asked == "idle" and backend is not None else None)
        if backend is not None:
            backend.reset()
    stop_server(running)


def _workers(text: str) -> int:
    """--api-workers: 1 to 16 front ends."""
    try:
        workers = int(text)
    except ValueError:
        workers = 0
    if not 1 <= workers <= 16:
        raise argparse.ArgumentTypeError(f"expected 1 to 16 front ends, got `{text}`")
    return workers


def decode_steps(args: argparse.Namespace, chain: Chain, seats: int) -> dict[int, float]:
    """Each level's decode step, ms, to hold its rows against: on the sim, --step-ms; on cuda
    with one stage, the `decode_batch` graph's replay at the level's sequences, each at the
    mean context of the level's decode (the prompt and half the answer), measured here before
    the engine takes the chain; else none."""
    levels = [int(x) for x in args.levels.split(",")]
    if args.backend == "sim":
        return {conc: args.step_ms for conc in levels}
    if args.backend != "cuda" or len(chain.sessions) > 1 \
            or "decode_batch" not in chain.sessions[0].manifest.programs:
        return {}
    from bench.gpu import batch_step_ms

    prompt = sum(args.prefix) if args.prefix else args.prompt_len
    return {conc: batch_step_ms(chain, conc, prompt + args.max_tokens // 2)
            for conc in levels if conc <= seats}


def _number(unit: str, inside: Callable[[float], bool], bounds: str) -> Callable[[str], float]:
    """An option's parser of a number of `unit`, refused (naming `bounds`) unless `inside`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {unit}, got `{text}`") from None
        if not inside(value):
            raise argparse.ArgumentTypeError(f"expected {bounds}, got {text}")
        return value

    return parse


milliseconds_flag = _number("milliseconds", lambda v: 0 < v < 1e4, "0 < milliseconds < 10000")
fraction_flag = _number("a fraction", lambda v: 0 <= v <= 1, "a fraction in [0, 1]")
_ramp = _number("milliseconds", lambda v: 0 <= v <= 6e4, "0 <= milliseconds <= 60000")
microseconds_flag = _number("microseconds", lambda v: 0 <= v < 1e5,
                            "0 <= microseconds < 100000")


def _newcomers_flag(text: str) -> tuple[int, float]:
    try:
        tokens, every = int(text.split(",")[0]), float(text.split(",")[1])
        if text.count(",") != 1:
            raise ValueError
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"expected N,MS (a newcomer's prompt tokens, ms "
                                         f"between newcomers), got `{text}`") from None
    if tokens < 1 or not 1 <= every <= 6e4:
        raise argparse.ArgumentTypeError(f"expected N >= 1 tokens and 1 <= MS <= 60000, got "
                                         f"{text}")
    return tokens, every


def _prefix(text: str) -> tuple[int, int]:
    try:
        shared, own = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N,M (shared prefix tokens, tokens of "
                                         f"each request's own), got `{text}`") from None
    if shared < 1 or own < 1:
        raise argparse.ArgumentTypeError(f"expected N,M of at least 1 token each, got {text}")
    return shared, own


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.splitlines()[0])
    REPORT.add_options(p)
    p.add_argument("--size", choices=("tiny", "small"), default="small")
    p.add_argument("--dir", default="/tmp/kerncc-serve-bench", help="example model folder")
    p.add_argument("--max-seqs", type=int, default=32, help="example's seqs bound and, "
                   "unless --max-running, the engine's sequences at once (default 32)")
    p.add_argument("--max-running", type=int, default=None, help="the engine's sequences at "
                   "once (default --max-seqs); more than --max-seqs makes a decode step "
                   "several calls of the example's decode program")
    p.add_argument("--backend", default="cuda", help="cuda, cpu, or sim (launches that compute "
                   "nothing and decode steps of --step-ms on a simulated device: the host's "
                   "cost, measured on the CPU)")
    p.add_argument("--step-ms", type=milliseconds_flag, default=2.0, help="--backend sim: a "
                   "replayed step's device time (default 2.0, the small model's 32-sequence step)")
    p.add_argument("--row-us", type=microseconds_flag, default=None, help="--backend sim: a "
                   "prefill chunk call takes --step-ms plus this a row it feeds, and every "
                   "call takes time, replayed or not (bench/simulated.py); default: only "
                   "replays take time, --step-ms each")
    p.add_argument("--ahead", choices=("on", "off", "ab"), default="on", help="greedy decode "
                   "steps issued a step ahead by the engine (default on); ab: off and on, "
                   "alternating over two rounds of servers, with the ratios")
    p.add_argument("--invariant", choices=("on", "off", "ab"), default="on", help="cuda: "
                   "the batch-invariant GEMMs (on, the default); off: the batch-shaped path "
                   "(KERNCC_INVARIANT=0); ab: both, alternating over two rounds each")
    p.add_argument("--split", choices=("on", "off", "ab"), default="off", help="on: the "
                   "front end in a process of its own, apart from the engine core (`kerncc "
                   "serve --api-workers 1`, its default); off: one process (`--api-workers "
                   "0`; the default here, as the rows measured before the split were); ab: "
                   "off and on, alternating over two rounds of servers, with the ratios")
    p.add_argument("--api-workers", type=_workers, default=1, metavar="N", help="--split on: "
                   "the front ends beside the core (`kerncc serve --api-workers N`; default 1)")
    p.add_argument("--devices", default=None, help="e.g. 0,1")
    p.add_argument("--pipeline", default="emit", help="e.g. 'cut,slice-derive,emit'")
    p.add_argument("--levels", default="1,8,32")
    p.add_argument("--requests-per-level", type=int, default=2,
                   help="requests per level = this x concurrency (default 2)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--prefix", type=_prefix, nargs="?", const=(2000, 100), default=None,
                   metavar="N,M", help="every prompt: one fixed N-token shared prefix, then M "
                   "random tokens of its own (bare: 2000,100); replaces --prompt-len")
    p.add_argument("--prefix-cache", choices=("on", "off", "ab"), default="on", help="the "
                   "server's prefix cache (default on); ab: off and on, alternating over two "
                   "rounds of servers, with the ratios and the cache's hits")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--budget", type=float, default=120.0, help="seconds per level at most")
    p.add_argument("--ramp-ms", type=_ramp, default=0.0, help="the first `concurrency` "
                   "requests of a level start evenly over this many ms, the rest as places "
                   "free (default 0: all at once; with prompts and answers of one length the "
                   "streams then stay in step, and each wave of `concurrency` requests arrives "
                   "at once, which no independent clients do; about one request's life, e.g. "
                   "150, spreads them as such clients are)")
    p.add_argument("--trace", default=None, metavar="FILE", help="stamp each request's way "
                   "to its first token (bench/serve_trace.py) into FILE (appended) and print "
                   "where the TTFT goes after each level; default: nothing stamped")
    p.add_argument("--newcomers", type=_newcomers_flag, nargs="?", const=(2000, 100.0),
                   default=None, metavar="N,MS", help="beside each level's streams, an N-token "
                   "prompt (one token asked) every MS ms; prints their TTFT p50/p99 against "
                   "the same prompt length's TTFT alone (measured before the level) and the "
                   "streams' ITL p50/p99 against --step-ms (bare: 2000,100, issue 40's goal)")
    p.add_argument("--step-tokens", type=int, default=None, help="the engine's step budget "
                   "(Config.step_tokens: decode and prefill rows a step; default: the "
                   "engine's)")
    p.add_argument("--hold-steps", type=int, default=HOLD_STEPS, metavar="N", help="steps of "
                   "prefill a stream primed in a burst waits for the burst's prompts "
                   f"(Config.hold_steps; 0: none; default {HOLD_STEPS}, the engine's)")
    p.add_argument("--clients", type=int, default=None, metavar="N", help="client processes "
                   f"reading a level's streams (default: one per {STREAMS_A_CLIENT} streams)")
    p.add_argument("--chunk", type=int, default=None, help="the engine's prefill rows a step "
                   "(Config.chunk; default: the engine's)")
    p.add_argument("--sampled", type=fraction_flag, default=0.0, help="the fraction of requests "
                   "that sample (temperature 0.8, top-p 0.95, a seed each; default 0: all "
                   "greedy)")
    args = p.parse_args(argv)
    REPORT.rows.clear()  # one run's rows (main may run again in one process: the tests)
    REPORT.results.clear()
    if [args.ahead, args.prefix_cache, args.split, args.invariant].count("ab") > 1:
        p.error("--ahead ab, --prefix-cache ab, --split ab, --invariant ab: one A/B at a time")
    if args.api_workers != 1 and args.split == "off":
        p.error(f"--api-workers {args.api_workers}: front ends apart from the core need "
                "--split on (or ab)")
    if args.invariant != "on" and args.backend != "cuda":
        p.error(f"--invariant {args.invariant}: the GEMM paths are the cuda backend's, not "
                f"{args.backend}'s")
    if args.row_us is not None and args.backend != "sim":
        p.error(f"--row-us is the simulated device's (--backend sim), not {args.backend}'s")
    if args.step_tokens is not None and args.step_tokens < 1:
        p.error(f"--step-tokens {args.step_tokens}: at least 1 row a step")
    if args.hold_steps < 0:
        p.error(f"--hold-steps {args.hold_steps}: at least 0 steps")
    if args.clients is not None and args.clients < 1:
        p.error(f"--clients {args.clients}: at least 1 client process")
    if args.chunk is not None and args.chunk < 1:
        p.error(f"--chunk {args.chunk}: at least 1 prefill row a step")
    if args.max_running is not None and args.max_running < 1:
        p.error(f"--max-running {args.max_running}: at least 1 sequence at once")
    if args.trace:  # refused before any server starts, not as a traceback mid-run
        try:
            with open(args.trace, "a"):
                pass
        except OSError as err:
            p.error(f"--trace {args.trace}: cannot append to it ({err.strerror})")
    if args.prefix is not None:
        args.prompt_len = sum(args.prefix)

    manifest = example(args)
    switch = {"on": [True], "off": [False], "ab": [False, True, False, True]}
    settings = [(ahead, cache, split, inv) for ahead in switch[args.ahead]
                for cache in switch[args.prefix_cache] for split in switch[args.split]
                for inv in switch[args.invariant]]
    runs = [Round(ahead, cache, *served(args, manifest, ahead, cache, split, inv), split=split,
                  invariant=inv)
            for ahead, cache, split, inv in settings]
    for run in runs:
        report(args, run)
    if args.ahead == "ab":
        compare([r for r in runs if r.ahead], [r for r in runs if not r.ahead])
    if args.split == "ab":
        compare([r for r in runs if r.split], [r for r in runs if not r.split],
                "front end apart from the core against one process", "apart / one process")
    if args.invariant == "ab":
        compare([r for r in runs if r.invariant], [r for r in runs if not r.invariant],
                "batch-invariant GEMMs against batch-shaped", "invariant / batch-shaped")
    if args.prefix_cache == "ab":
        compare_cache([r for r in runs if r.cache], [r for r in runs if not r.cache])
    return REPORT.finish(args, device(args), argv)


def newcomer_len(args: argparse.Namespace) -> int:
    """A newcomer's tokens (its prompt and the one asked; 0 without --newcomers)."""
    newcomers = getattr(args, "newcomers", None)  # callers' namespaces may lack the flag
    return 0 if newcomers is None else newcomers[0] + 1


def engine_seqs(args: argparse.Namespace) -> int:
    """The engine's sequences at once: --max-running, else the example's bound."""
    return args.max_running or args.max_seqs


def example(args: argparse.Namespace) -> Path:
    """The example's manifest, generated unless it is there: with a context of at least the
    prompt and --max-tokens (a multiple of the page, 16), in a folder named by it when it is
    longer than the size's own."""
    own = make_config(args.size).max_context
    needed = -(-max(args.prompt_len + args.max_tokens, newcomer_len(args)) // 16) * 16
    name = f"{args.size}-{args.max_seqs}"
    overrides: dict[str, int] = {"max_seqs": args.max_seqs}
    if needed > own:
        name, overrides["max_context"] = f"{name}-context{needed}", needed
    manifest = Path(args.dir) / name / "model.json"
    if not manifest.exists():
        generate(manifest.parent, args.size, **overrides)
    return manifest


@attrs.frozen
class Round:
    """One server's run: its settings and what was measured."""

    ahead: bool
    cache: bool  # the prefix cache
    stages: int
    rows: list[tuple[int, dict[str, float]]]
    wake_us: float | None  # the simulated device's late wake-up
    hits: dict[str, float]  # the prefix cache's counters over the levels (/metrics)
    steps: dict[int, float]  # each level's decode step, ms (`decode_steps`; none: {})
    split: bool = False  # the front end in a process of its own (kerncc.serve.core)
    invariant: bool = True  # the cuda backend's batch-invariant GEMMs (the default)


def device(args: argparse.Namespace) -> str:
    """What served, for the --doc header."""
    if args.backend == "sim":
        rows = f", {args.row_us} us a prefill row" if args.row_us is not None else ""
        return f"a simulated device ({args.step_ms} ms a step{rows}) on the CPU"
    if args.backend == "cuda":
        from bench.gpu import device_name

        return device_name()
    return f"the {args.backend} backend"


Levels = list[tuple[int, dict[str, float]]]


def served(args: argparse.Namespace, manifest: Path, ahead: bool, cache: bool,
           split: bool = False, invariant: bool = True
           ) -> tuple[int, Levels, float | None, dict[str, float], dict[int, float]]:
    """One server's levels: (stages, rows, the simulated device's late wake-up, the prefix
    cache's counters over the levels, each level's decode step in ms: `decode_steps`)."""
    # The server in a process of its own, as `kerncc serve` runs: the clients' work here does
    # not take the server's interpreter lock (in one process it doubled the ITL at 32).
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    # not a daemon: apart, it forks its front end (joined, then terminated, below)
    child = context.Process(target=serve, args=(theirs, args, manifest, ahead, cache, split,
                                                invariant))
    child.start()
    try:
        for _ in range(600):  # bounded: 600 s, and no longer than the server lives
            if mine.poll(1):
                break
            if not child.is_alive():
                raise SystemExit("bench.serve: the server's process ended before it served "
                                 "(its error is above)")
        else:
            raise SystemExit("bench.serve: the server did not start in 600 s")
        started = mine.recv()
        if started[0] == "error":
            raise SystemExit(f"bench.serve: {started[1]}")
        url, model, vocab, stages, wake_us, limit, steps = started
        if limit is not None and max(args.prompt_len + args.max_tokens,
                                     newcomer_len(args)) > limit:
            mine.send("stop")
            raise SystemExit(f"bench.serve: {manifest}: a sequence holds at most {limit} "
                             f"tokens, fewer than a prompt of {args.prompt_len} and "
                             f"--max-tokens {args.max_tokens}; generate the example with a "
                             "longer max_context (or remove that folder: the bench does)")
        rows, hits = measure(args, mine, url, model, vocab)
        mine.send("stop")
    finally:
        child.join(10)
        if child.is_alive():
            child.terminate()
    return stages, rows, wake_us, hits, steps


METRICS = ("queried_tokens", "hit_tokens", "evictions")  # kerncc_prefix_cache_*_total


def scrape(url: str) -> dict[str, float]:
    """The prefix cache's counters off the server's /metrics."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n"
                     % host.encode())
        text = b"".join(iter(lambda: sock.recv(65536), b"")).decode()
    if not text.startswith("HTTP/1.1 200"):
        raise RuntimeError(f"/metrics: {text.splitlines()[0] if text else 'no answer'}")
    counts = {}
    for name in METRICS:
        found = re.search(rf"^kerncc_prefix_cache_{name}_total (\S+)$", text, re.MULTILINE)
        if found is None:
            raise RuntimeError(f"/metrics has no kerncc_prefix_cache_{name}_total")
        counts[name] = float(found.group(1))
    return counts


def measure(args: argparse.Namespace, conn: Connection, url: str, model: str, vocab: int
            ) -> tuple[list[tuple[int, dict[str, float]]], dict[str, float]]:
    """The levels' rows, and the prefix cache's counters over them (the warm-up's not)."""
    rng = np.random.default_rng(0)
    shared, own = args.prefix or (0, args.prompt_len)
    # the same in every round (one seed); none drawn without --prefix (the prompts as before)
    prefix = rng.integers(0, vocab, shared).tolist() if shared else []

    def prompt() -> list[int]:
        return prefix + rng.integers(0, vocab, own).tolist()

    levels = [int(x) for x in args.levels.split(",")]
    # warm up: graphs and allocations of every decode batch size on the way
    top = max(levels)
    spread_level(url, model, top, [prompt() for _ in range(top)], 4, args.budget,
                 clients=clients_for(top, args.clients))
    conn.send("idle")
    conn.recv()
    before = scrape(url)
    rows = []
    if args.trace:
        serve_trace.open_trace(args.trace)
    newcomers = None if args.newcomers is None else \
        Newcomers(args.newcomers[0], args.newcomers[1] / 1e3, vocab)
    for conc in levels:
        prompts = [prompt() for _ in range(conc * args.requests_per_level)]
        alone = None if newcomers is None else asyncio.run(ttft_alone(url, model, newcomers))
        since = time.perf_counter()
        row = spread_level(url, model, conc, prompts, args.max_tokens, args.budget,
                           args.sampled, args.ramp_ms / 1e3, newcomers,
                           clients_for(conc, args.clients))
        if alone is not None:
            row["new_alone"] = alone
        conn.send("idle")
        row["idle_us"] = conn.recv()
        rows.append((conc, row))
        if args.trace:
            print(f"trace, concurrency {conc}:\n{serve_trace.report(args.trace, since)}")
    serve_trace.close_trace()
    after = scrape(url)
    return rows, {name: after[name] - before[name] for name in after}


ALONE = 5  # newcomers timed alone before each level: their TTFT alone is the median


async def ttft_alone(url: str, model: str, newcomers: Newcomers) -> float:
    """The median TTFT of `ALONE` newcomer prompts sent one after another on an idle server
    (each its own random prompt, as during the level: none is in the prefix cache)."""
    rng = np.random.default_rng(2)
    times = []
    for _ in range(ALONE):
        prompt = rng.integers(0, newcomers.vocab, newcomers.tokens).tolist()
        times.append((await one(url, model, prompt, 1))[0])
    return statistics.median(times)


def report_newcomers(args: argparse.Namespace, rows: Levels,
                     steps: dict[int, float] | None = None) -> None:
    """--newcomers: their TTFT p50 / p99 under the level's load against their TTFT alone
    (the same run), and the running streams' ITL p50 / p99 against the level's decode step
    (`decode_steps`; --step-ms where none was measured)."""
    tokens, every = args.newcomers
    steps = steps or {}
    said = "measured" if steps and args.backend != "sim" else f"--step-ms, {args.step_ms:g} ms"
    print(f"newcomers: a {tokens}-token prompt every {every:g} ms beside the streams; their "
          f"TTFT against alone, the streams' ITL against the decode step ({said})")
    print("| concurrency | newcomers | TTFT alone ms | TTFT p50 ms | x alone | TTFT p99 ms "
          "| x alone | ITL p50 x step | ITL p99 x step |")
    print("| --- " * 9 + "|")
    for conc, r in rows:
        alone, step = r["new_alone"], steps.get(conc, args.step_ms)
        cells = [f"{r['newcomers']}", f"{alone * 1e3:.1f}",
                 f"{r['new_ttft_p50'] * 1e3:.1f}", f"{r['new_ttft_p50'] / alone:.2f}x",
                 f"{r['new_ttft_p99'] * 1e3:.1f}", f"{r['new_ttft_p99'] / alone:.2f}x",
                 f"{r['itl_p50'] * 1e3 / step:.2f}x", f"{r['itl_p99'] * 1e3 / step:.2f}x"]
        print(f"| {conc} | {' | '.join(cells)} |")
        REPORT.row("newcomers", f"concurrency {conc}, a {tokens}-token prompt every {every:g} "
                   "ms: newcomers; TTFT alone ms; TTFT p50, p99 ms (x alone); streams' ITL "
                   "p50, p99 (x --step-ms)",
                   f"{cells[0]}; {cells[1]}; {cells[2]} ({cells[3]}), {cells[4]} ({cells[5]}); "
                   f"{cells[6]}, {cells[7]}")


def report(args: argparse.Namespace, run: Round) -> None:
    sim, stages, rows, ahead = args.backend == "sim", run.stages, run.rows, run.ahead
    shared = f" ({args.prefix[0]} shared + {args.prefix[1]} own)" if args.prefix else ""
    front = f"apart from the core ({args.api_workers} of them)" if run.split \
        else "in the core process"
    at_once = f", {engine_seqs(args)} at once" if engine_seqs(args) != args.max_seqs else ""
    print(f"bench.serve: {args.size} (seqs <= {args.max_seqs}{at_once}), {stages} stage(s) on "
          f"{args.backend}{' ' + args.devices if args.devices else ''}, prompt "
          f"{args.prompt_len}{shared}, max_tokens {args.max_tokens}, sampled "
          f"{args.sampled:g}, a step ahead {'on' if ahead else 'off'}, "
          f"{f'first requests over {args.ramp_ms:g} ms' if args.ramp_ms else 'all at once'}, "
          f"front end {front}, prefix cache "
          f"{'on' if run.cache else 'off'}")
    if sim:
        rows_cost = f" plus {args.row_us} us a prefill row" if args.row_us is not None else ""
        print(f"simulated device: {args.step_ms} ms a step{rows_cost}; its idle time counts a "
              f"sleep's late wake-up here, {run.wake_us:.0f} us, which a GPU does not pay")
    hits = run.cache and (args.prefix is not None or args.prefix_cache != "on")
    if hits:
        print(f"prefix cache over the levels (/metrics): {hit_line(run.hits)}")
    extra = " device idle a step us |" if sim else ""
    print("| concurrency | requests | tokens/s | x conc 1 | TTFT p50 ms | TTFT p99 ms "
          f"| ITL p50 ms | ITL p99 ms |{extra}")
    print("| --- " * (8 + sim) + "|")
    base = rows[0][1]["tok_s"]
    label = f"{stages} stage(s), ahead {'on' if ahead else 'off'}" + \
        (f", prefix cache {'on' if run.cache else 'off'}" if args.prefix_cache == "ab" else "") \
        + (f", {'apart' if run.split else 'one process'}" if args.split == "ab" else "") \
        + (f", {'invariant' if run.invariant else 'batch-shaped'}" if args.invariant == "ab"
           else "")
    for conc, r in rows:
        idle = f" {r['idle_us']:.0f} |" if sim else ""
        print(f"| {conc} | {r['requests']} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f} | "
              f"{r['ttft_p50'] * 1e3:.1f} | {r['ttft_p99'] * 1e3:.1f} | "
              f"{r['itl_p50'] * 1e3:.2f} | {r['itl_p99'] * 1e3:.2f} |{idle}")
        waited = f"; {r['idle_us']:.0f}" if sim else ""
        REPORT.row(label, f"concurrency {conc}: tokens/s (x conc 1); TTFT p50 / p99 ms; ITL p50 "
                   f"/ p99 ms{'; device idle a step us' if sim else ''}",
                   f"{r['tok_s']:.1f} ({r['tok_s'] / base:.2f}x); {r['ttft_p50'] * 1e3:.1f} / "
                   f"{r['ttft_p99'] * 1e3:.1f}; {r['itl_p50'] * 1e3:.2f} / "
                   f"{r['itl_p99'] * 1e3:.2f}{waited}")
    if hits:
        REPORT.row(label, "prefix cache over the levels: hit rate, hit / queried tokens, "
                   "evictions", hit_line(run.hits))
    if run.steps:
        report_steps(label, rows, run.steps)
    if args.newcomers is not None:
        report_newcomers(args, rows, run.steps)
    REPORT.results.setdefault("runs", []).append({"ahead": ahead, "prefix_cache": run.cache,
                                                  "split": run.split,
                                                  "stages": stages, "rows": rows,
                                                  "prefix_cache_counts": run.hits,
                                                  "decode_step_ms": run.steps})


def report_steps(label: str, rows: Levels, steps: dict[int, float]) -> None:
    """Each level against its own decode step (`decode_steps`): tokens/s against the
    sequences a step could give (issue 40's goal: at least 0.85x), the ITL p50 / p99 against
    the step (at most 1.15x / 2x)."""
    print("against each level's decode step: tokens/s x (sequences / step), ITL x step")
    print("| concurrency | decode step ms | tokens/s x (seqs / step) | ITL p50 x step "
          "| ITL p99 x step |")
    print("| --- " * 5 + "|")
    for conc, r in rows:
        if conc not in steps:
            continue
        step = steps[conc]
        cells = (f"{step:.3f}", f"{r['tok_s'] * step / 1e3 / conc:.2f}x",
                 f"{r['itl_p50'] * 1e3 / step:.2f}x", f"{r['itl_p99'] * 1e3 / step:.2f}x")
        print(f"| {conc} | {' | '.join(cells)} |")
        REPORT.row(label, f"concurrency {conc}: decode step ms; tokens/s x (sequences / step); "
                   "ITL p50, p99 x step", "; ".join(cells))


def hit_line(hits: dict[str, float]) -> str:
    rate = hits["hit_tokens"] / hits["queried_tokens"] if hits["queried_tokens"] else 0.0
    return (f"hit rate {rate:.1%}, {hits['hit_tokens']:.0f} / {hits['queried_tokens']:.0f} "
            f"tokens, {hits['evictions']:.0f} evictions")


def compare_cache(on: list[Round], off: list[Round]) -> None:
    """--prefix-cache ab: each measure's median over the rounds, on and off side by side, with
    how many times lower the TTFTs are (off / on) and higher the tokens/s (on / off)."""
    print("prefix cache on against off (the medians of the rounds):")
    print("| concurrency | TTFT p50 ms on / off | x lower | TTFT p99 ms on / off | x lower "
          "| tokens/s on / off | x higher |")
    print("| --- " * 7 + "|")
    for i, (conc, _) in enumerate(on[0].rows):
        cells, values = [], []
        for key, scale, lower in (("ttft_p50", 1e3, True), ("ttft_p99", 1e3, True),
                                  ("tok_s", 1, False)):
            mine = statistics.median(run.rows[i][1][key] for run in on) * scale
            theirs = statistics.median(run.rows[i][1][key] for run in off) * scale
            ratio = theirs / mine if lower else mine / theirs
            cells += [f"{mine:.1f} / {theirs:.1f}", f"{ratio:.2f}x"]
            values.append(f"{mine:.1f} / {theirs:.1f} ({ratio:.2f}x)")
        print(f"| {conc} | {' | '.join(cells)} |")
        REPORT.row("prefix cache on / off", f"concurrency {conc}: TTFT p50 ms (x lower); "
                   "TTFT p99 ms (x lower); tokens/s (x higher) (medians of the rounds)",
                   "; ".join(values))


def compare(on: list[Round], off: list[Round],
            title: str = "a step ahead against one step at a time",
            label: str = "ahead on / off") -> None:
    """--ahead ab, --split ab, --invariant ab: each measure's median over the rounds, on
    against off."""
    print(f"{title} (the medians of the rounds, on / off):")
    print("| concurrency | tokens/s | TTFT p50 | ITL p50 | ITL p99 |")
    print("| --- | --- | --- | --- | --- |")
    for i, (conc, _) in enumerate(on[0].rows):
        ratios = []
        for key in ("tok_s", "ttft_p50", "itl_p50", "itl_p99"):
            mine = statistics.median(run.rows[i][1][key] for run in on)
            theirs = statistics.median(run.rows[i][1][key] for run in off)
            ratios.append(f"{mine / theirs:.2f}x" if theirs else "n/a")
        print(f"| {conc} | {' | '.join(ratios)} |")
        REPORT.row(label, f"concurrency {conc}: tokens/s, TTFT p50, ITL p50, ITL p99 "
                   "(medians of the rounds)", ", ".join(ratios))


if __name__ == "__main__":
    raise SystemExit(main())
