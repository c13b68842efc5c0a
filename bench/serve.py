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

--doc docs/benchmarks.md writes the rows between the file's `serve` markers.

  python -m bench.serve --size small --backend cuda                     # whole
  python -m bench.serve --size small --backend cuda --pipeline 'cut,slice-derive,emit'
  python -m bench.serve --size tiny --backend cpu --levels 1,4 --max-tokens 16
  python -m bench.serve --size small --backend sim --step-ms 2.0        # no GPU
  python -m bench.serve --size small --backend sim --ahead ab           # A/B
  python -m bench.serve --size small --backend sim --sampled 0.5        # half of them sample
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import socket
import statistics
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn

from bench.report import Report
from kerncc.example import generate
from kerncc.lower import lower_to_bundle
from kerncc.runtime import Chain
from kerncc.serve.engine import Config, Engine
from kerncc.serve.http import Server, create_app


REPORT = Report("serve")


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def one(url: str, model: str, prompt: list[int], max_tokens: int,
              sampled: dict[str, Any] | None = None) -> tuple[float, list[float], int]:
    """(TTFT, ITLs, tokens) of one streaming request, each token timed when its bytes arrive.

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
    finally:
        writer.close()
    if not times:
        raise RuntimeError("a request returned no token")
    return times[0] - started, [b - a for a, b in itertools.pairwise(times)], len(times)


async def level(url: str, model: str, concurrency: int, prompts: list[list[int]],
                max_tokens: int, budget: float, sampled: float = 0.0) -> dict[str, float]:
    gate = asyncio.Semaphore(concurrency)
    deadline = time.perf_counter() + budget
    results: list[tuple[float, list[float], int]] = []

    async def run(number: int, prompt: list[int]) -> None:
        async with gate:
            if time.perf_counter() < deadline:
                results.append(await one(url, model, prompt, max_tokens,
                                         _sampling(number, sampled)))

    started = time.perf_counter()
    await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - started
    ttft = [r[0] for r in results]
    itl = [x for r in results for x in r[1]]
    tokens = sum(r[2] for r in results)
    return {"requests": len(results), "tokens": tokens, "wall": wall, "tok_s": tokens / wall,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99)}


def _sampling(number: int, fraction: float) -> dict[str, Any] | None:
    """Request `number`'s sampling fields: `fraction` of the requests, spread evenly (so that
    every batch mixes them), sample at temperature 0.8, top-p 0.95, a seed each; the rest
    are greedy (None)."""
    if int((number + 1) * fraction) == int(number * fraction):
        return None
    return {"temperature": 0.8, "top_p": 0.95, "seed": number}


def start_server(chain: Chain, max_seqs: int, model: str, ahead: bool = True
                 ) -> tuple[str, uvicorn.Server]:
    engine = Engine(chain, Config(max_running=max_seqs, max_queue=4096, ahead=ahead))
    server = Server(engine, model)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(create_app(server), log_level="warning"))
    threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True).start()
    for _ in range(500):
        if uv.started:
            break
        time.sleep(0.02)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", uv


def serve(conn: Connection, args: argparse.Namespace, manifest: Path, ahead: bool) -> None:
    """The server's process: load, serve on loopback, answer the bench's questions (`idle`:
    the simulated device's wait for the host a step, then reset; `stop`) until told to stop."""
    bundle = lower_to_bundle(manifest, args.pipeline)
    devices = [int(d) for d in args.devices.split(",")] if args.devices else None
    if args.backend == "sim":
        from bench.simulated import Device

        backend: Any = Device(args.step_ms)
        chain = Chain(bundle, backend=backend, graphs=True,
                      token_capacity=args.max_seqs * (args.prompt_len + args.max_tokens + 64))
    else:
        backend = None
        chain = Chain(bundle, backend=args.backend, devices=devices)
    model = bundle.stages[0].manifest.model
    url, uv = start_server(chain, args.max_seqs, model, ahead=ahead)
    conn.send((url, model, bundle.stages[0].manifest.buffers["embed.w"].shape[0],
               len(bundle.stages), getattr(backend, "wake_us", None)))
    while (asked := conn.recv()) != "stop":
        conn.send(backend.idle_us() if asked == "idle" and backend is not None else None)
        if backend is not None:
            backend.reset()
    uv.should_exit = True


def _milliseconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, got `{text}`") from None
    if not 0 < value < 1e4:
        raise argparse.ArgumentTypeError(f"expected 0 < milliseconds < 10000, got {text}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction, got `{text}`") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.splitlines()[0])
    REPORT.add_options(p)
    p.add_argument("--size", choices=("tiny", "small"), default="small")
    p.add_argument("--dir", default="/tmp/kerncc-serve-bench", help="example model folder")
    p.add_argument("--max-seqs", type=int, default=32, help="example's seqs bound and the "
                   "engine's sequences at once (default 32)")
    p.add_argument("--backend", default="cuda", help="cuda, cpu, or sim (launches that compute "
                   "nothing and decode steps of --step-ms on a simulated device: the host's "
                   "cost, measured on the CPU)")
    p.add_argument("--step-ms", type=_milliseconds, default=2.0, help="--backend sim: a replayed "
                   "step's device time (default 2.0, the small model's 32-sequence step)")
    p.add_argument("--ahead", choices=("on", "off", "ab"), default="on", help="greedy decode "
                   "steps issued a step ahead by the engine (default on); ab: off and on, "
                   "alternating over two rounds of servers, with the ratios")
    p.add_argument("--devices", default=None, help="e.g. 0,1")
    p.add_argument("--pipeline", default="emit", help="e.g. 'cut,slice-derive,emit'")
    p.add_argument("--levels", default="1,8,32")
    p.add_argument("--requests-per-level", type=int, default=2,
                   help="requests per level = this x concurrency (default 2)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--budget", type=float, default=120.0, help="seconds per level at most")
    p.add_argument("--sampled", type=_fraction, default=0.0, help="the fraction of requests "
                   "that sample (temperature 0.8, top-p 0.95, a seed each; default 0: all "
                   "greedy)")
    args = p.parse_args(argv)

    folder = Path(args.dir) / f"{args.size}-{args.max_seqs}"
    manifest = folder / "model.json"
    if not manifest.exists():
        generate(folder, args.size, max_seqs=args.max_seqs)
    settings = {"on": [True], "off": [False], "ab": [False, True, False, True]}[args.ahead]
    runs = [(ahead, *served(args, manifest, ahead)) for ahead in settings]
    for ahead, stages, rows, wake_us in runs:
        report(args, stages, rows, wake_us, ahead)
    if args.ahead == "ab":
        compare([r for r in runs if r[0]], [r for r in runs if not r[0]])
    return REPORT.finish(args, device(args), argv)


def device(args: argparse.Namespace) -> str:
    """What served, for the --doc header."""
    if args.backend == "sim":
        return f"a simulated device ({args.step_ms} ms a step) on the CPU"
    if args.backend == "cuda":
        from bench.gpu import device_name

        return device_name()
    return f"the {args.backend} backend"


def served(args: argparse.Namespace, manifest: Path, ahead: bool
           ) -> tuple[int, list[tuple[int, dict[str, float]]], float | None]:
    """One server's levels: (stages, rows, the simulated device's late wake-up)."""
    # The server in a process of its own, as `kerncc serve` runs: the clients' work here does
    # not take the server's interpreter lock (in one process it doubled the ITL at 32).
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    child = context.Process(target=serve, args=(theirs, args, manifest, ahead), daemon=True)
    child.start()
    try:
        if not mine.poll(600):
            raise SystemExit("bench.serve: the server did not start in 600 s")
        url, model, vocab, stages, wake_us = mine.recv()
        rows = measure(args, mine, url, model, vocab)
        mine.send("stop")
    finally:
        child.join(10)
        if child.is_alive():
            child.terminate()
    return stages, rows, wake_us


def measure(args: argparse.Namespace, conn: Connection, url: str, model: str,
            vocab: int) -> list[tuple[int, dict[str, float]]]:
    rng = np.random.default_rng(0)
    levels = [int(x) for x in args.levels.split(",")]
    # warm up: graphs and allocations of every decode batch size on the way
    asyncio.run(level(url, model, max(levels), [rng.integers(0, vocab, args.prompt_len).tolist()
                                                for _ in range(max(levels))], 4, args.budget))
    conn.send("idle")
    conn.recv()
    rows = []
    for conc in levels:
        prompts = [rng.integers(0, vocab, args.prompt_len).tolist()
                   for _ in range(conc * args.requests_per_level)]
        row = asyncio.run(level(url, model, conc, prompts, args.max_tokens, args.budget,
                                args.sampled))
        conn.send("idle")
        row["idle_us"] = conn.recv()
        rows.append((conc, row))
    return rows


def report(args: argparse.Namespace, stages: int, rows: list[tuple[int, dict]],
           wake_us: float | None, ahead: bool) -> None:
    sim = args.backend == "sim"
    print(f"bench.serve: {args.size} (seqs <= {args.max_seqs}), {stages} stage(s) on "
          f"{args.backend}{' ' + args.devices if args.devices else ''}, prompt "
          f"{args.prompt_len}, max_tokens {args.max_tokens}, sampled {args.sampled:g}, a step "
          f"ahead {'on' if ahead else 'off'}")
    if sim:
        print(f"simulated device: {args.step_ms} ms a step; its idle time counts a sleep's "
              f"late wake-up here, {wake_us:.0f} us, which a GPU does not pay")
    extra = " device idle a step us |" if sim else ""
    print("| concurrency | requests | tokens/s | x conc 1 | TTFT p50 ms | TTFT p99 ms "
          f"| ITL p50 ms | ITL p99 ms |{extra}")
    print("| --- " * (8 + sim) + "|")
    base = rows[0][1]["tok_s"]
    label = f"{stages} stage(s), ahead {'on' if ahead else 'off'}"
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
    REPORT.results.setdefault("runs", []).append({"ahead": ahead, "stages": stages,
                                                  "rows": rows})


def compare(on: list[tuple], off: list[tuple]) -> None:
    """--ahead ab: each measure's median over the rounds, on against off."""
    print("a step ahead against one step at a time (the medians of the rounds, on / off):")
    print("| concurrency | tokens/s | TTFT p50 | ITL p50 | ITL p99 |")
    print("| --- | --- | --- | --- | --- |")
    for i, (conc, _) in enumerate(on[0][2]):
        ratios = []
        for key in ("tok_s", "ttft_p50", "itl_p50", "itl_p99"):
            mine = statistics.median(run[2][i][1][key] for run in on)
            theirs = statistics.median(run[2][i][1][key] for run in off)
            ratios.append(f"{mine / theirs:.2f}x")
        print(f"| {conc} | {' | '.join(ratios)} |")
        REPORT.row("ahead on / off", f"concurrency {conc}: tokens/s, TTFT p50, ITL p50, ITL p99 "
                   "(medians of the rounds)", ", ".join(ratios))


if __name__ == "__main__":
    raise SystemExit(main())
