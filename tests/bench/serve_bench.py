"""Load on `kerncc serve` over loopback: tokens/s, TTFT and inter-token latency p50/p99 at
concurrency 1, 8 and 32, printed side by side with the ratio to concurrency 1.

The server runs in this process (uvicorn on a thread, 127.0.0.1, a free port) over the example
model (generated into --dir unless it is there), whole or cut (--pipeline), on --backend.
Every level sends `--requests-per-level x concurrency` streaming requests of random token-id
prompts (`--prompt-len`, `--max-tokens`, fixed seed), at most `concurrency` at once; each
request's TTFT is the time to its first streamed token, its ITLs the gaps between the next ones.
Bounded: a level stops after --budget seconds.

  python tests/bench/serve_bench.py --size small --backend cuda                     # whole
  python tests/bench/serve_bench.py --size small --backend cuda --pipeline 'cut,slice-derive,emit'
  python tests/bench/serve_bench.py --size tiny --backend cpu --levels 1,4 --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import uvicorn

from kerncc.example import generate
from kerncc.lower import lower_to_bundle
from kerncc.runtime import Bundle, Chain
from kerncc.serve.engine import Config, Engine
from kerncc.serve.http import Server, create_app


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
              max_tokens: int) -> tuple[float, list[float], int]:
    """(TTFT, ITLs, tokens) of one streaming request."""
    started = time.perf_counter()
    times: list[float] = []
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            times += [time.perf_counter()] * len(event["choices"][0].get("token_ids", []))
    if not times:
        raise RuntimeError("a request returned no token")
    return times[0] - started, [b - a for a, b in itertools.pairwise(times)], len(times)


async def level(url: str, model: str, concurrency: int, prompts: list[list[int]],
                max_tokens: int, budget: float) -> dict[str, float]:
    gate = asyncio.Semaphore(concurrency)
    deadline = time.perf_counter() + budget
    results: list[tuple[float, list[float], int]] = []

    async def run(prompt: list[int]) -> None:
        async with gate:
            if time.perf_counter() < deadline:
                results.append(await one(client, url, model, prompt, max_tokens))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(run(p) for p in prompts))
        wall = time.perf_counter() - started
    ttft = [r[0] for r in results]
    itl = [x for r in results for x in r[1]]
    tokens = sum(r[2] for r in results)
    return {"requests": len(results), "tokens": tokens, "wall": wall, "tok_s": tokens / wall,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99)}


def start_server(chain: Chain, max_seqs: int, model: str) -> tuple[str, uvicorn.Server]:
    engine = Engine(chain, Config(max_running=max_seqs, max_queue=4096))
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=("tiny", "small"), default="small")
    p.add_argument("--dir", default="/tmp/kerncc-serve-bench", help="example model folder")
    p.add_argument("--max-seqs", type=int, default=32, help="example's seqs bound and the "
                   "engine's sequences at once (default 32)")
    p.add_argument("--backend", default="cuda")
    p.add_argument("--devices", default=None, help="e.g. 0,1")
    p.add_argument("--pipeline", default="emit", help="e.g. 'cut,slice-derive,emit'")
    p.add_argument("--levels", default="1,8,32")
    p.add_argument("--requests-per-level", type=int, default=2,
                   help="requests per level = this x concurrency (default 2)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--budget", type=float, default=120.0, help="seconds per level at most")
    args = p.parse_args()

    folder = Path(args.dir) / f"{args.size}-{args.max_seqs}"
    manifest = folder / "model.json"
    if not manifest.exists():
        generate(folder, args.size, max_seqs=args.max_seqs)
    devices = [int(d) for d in args.devices.split(",")] if args.devices else None
    bundle = lower_to_bundle(manifest, args.pipeline)
    chain = Chain(bundle, backend=args.backend, devices=devices)
    model = bundle.stages[0].manifest.model
    url, uv = start_server(chain, args.max_seqs, model)
    vocab = bundle.stages[0].manifest.buffers["embed.w"].shape[0]
    rng = np.random.default_rng(0)
    levels = [int(x) for x in args.levels.split(",")]
    # warm up: graphs and allocations of every decode batch size on the way
    asyncio.run(level(url, model, max(levels), [rng.integers(0, vocab, args.prompt_len).tolist()
                                                for _ in range(max(levels))], 4, args.budget))
    rows = []
    for conc in levels:
        prompts = [rng.integers(0, vocab, args.prompt_len).tolist()
                   for _ in range(conc * args.requests_per_level)]
        rows.append((conc, asyncio.run(level(url, model, conc, prompts, args.max_tokens,
                                             args.budget))))
    uv.should_exit = True
    stages = len(bundle.stages)
    print(f"serve_bench: {args.size} (seqs <= {args.max_seqs}), {stages} stage(s) on "
          f"{args.backend}{' ' + args.devices if args.devices else ''}, prompt "
          f"{args.prompt_len}, max_tokens {args.max_tokens}")
    print("| concurrency | requests | tokens/s | x conc 1 | TTFT p50 ms | TTFT p99 ms "
          "| ITL p50 ms | ITL p99 ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    base = rows[0][1]["tok_s"]
    for conc, r in rows:
        print(f"| {conc} | {r['requests']} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f} | "
              f"{r['ttft_p50'] * 1e3:.1f} | {r['ttft_p99'] * 1e3:.1f} | "
              f"{r['itl_p50'] * 1e3:.2f} | {r['itl_p99'] * 1e3:.2f} |")


if __name__ == "__main__":
    main()
