"""The engine alone (no HTTP, no front end): streams' tokens/s, TTFT and inter-token gaps in
waves of prompts, for several `Config.hold_steps` side by side in one run.

A level sends `concurrency` requests at once (--prompt-len random token ids, --max-tokens
each), and each stream sends its next request when its last one ends, twice the concurrency
in all: waves, as bench.serve's levels are by default. The listener stamps each token as the
engine hands it over. Each level is held against its own decode step: on cuda the
`decode_batch` graph's replay at the level's sequences, each at the mean context of its
decode (bench.gpu.batch_step_ms), measured before the engines take the chain; on the
simulated device (--backend sim, bench/simulated.py: a decode step --step-ms, a prefill chunk
--step-ms plus --row-us a row) --step-ms, so the tail a wave's prefill puts into the streams
is studied on the CPU; on cpu the level's median gap. A level runs --rounds rounds of every
hold value in turn, an engine each, after one wave untimed; each figure is the median over
the rounds. `first gap`: each stream's gap from its first token to its second (a stream that
waits for its burst waits there).

  python -m bench.streams --size small --backend cuda --levels 32,128
  python -m bench.streams --size small --backend sim --layers 4 --levels 32,128    # no GPU
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from bench.report import Report
from bench.serve import fraction_flag, microseconds_flag, milliseconds_flag
from kerncc.example import generate
from kerncc.example.config import make_config
from kerncc.lower import lower_to_bundle
from kerncc.runtime import Chain
from kerncc.serve import sampling_hook
from kerncc.serve.engine import Config, Engine, Request

REPORT = Report("streams")
SAMPLED = sampling_hook.Params(temperature=0.8, top_p=0.95)


class Streams:
    """The clients of a level: each request sent as one before it ends (`send` as many times
    as the concurrency to begin), until every prompt is sent; each token's time."""

    def __init__(self, engine: Engine, prompts: list[list[int]], max_new: int,
                 sampled: float) -> None:
        self.engine, self.prompts, self.max_new, self.sampled = engine, prompts, max_new, sampled
        self.sent: dict[int, float] = {}
        self.times: dict[int, list[float]] = defaultdict(list)

    def send(self) -> None:
        n = len(self.sent)
        sampled = int((n + 1) * self.sampled) > int(n * self.sampled)  # spread evenly
        params = attrs.evolve(SAMPLED, seed=n) if sampled else sampling_hook.Params()
        request = self.engine.submit(Request(self.prompts[n], self.max_new, params,
                                             listener=self))
        self.sent[request.id] = time.perf_counter()

    def token(self, request: Request, token: int) -> None:
        self.times[request.id].append(time.perf_counter())

    def done(self, request: Request) -> None:
        if len(self.sent) < len(self.prompts):
            self.send()


def wave(chain: Chain, args: argparse.Namespace, conc: int, hold: int, seed: int
         ) -> dict[str, Any]:
    """One engine's timed run of a level (after a wave untimed): tokens, wall, TTFTs, gaps."""
    engine = Engine(chain, Config(max_running=conc, max_queue=4 * conc, chunk=args.chunk,
                                  hold_steps=hold))
    rng = np.random.default_rng(seed)
    for _ in ("untimed", "timed"):
        prompts = rng.integers(1, args.vocab, (2 * conc, args.prompt_len)).tolist()
        streams = Streams(engine, prompts, args.max_tokens, args.sampled)
        started = time.perf_counter()
        for _ in range(conc):
            streams.send()
        engine.run_until_idle()
        wall = time.perf_counter() - started
    ttft = [ts[0] - streams.sent[i] for i, ts in streams.times.items()]
    gaps = [b - a for ts in streams.times.values() for a, b in zip(ts, ts[1:])]
    firsts = [ts[1] - ts[0] for ts in streams.times.values() if len(ts) > 1]
    tokens = sum(len(ts) for ts in streams.times.values())
    return {"tok_s": tokens / wall, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "itl_p50": pct(gaps, 50), "itl_p99": pct(gaps, 99), "first_p50": pct(firsts, 50)}


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values) * 1e3, q))


def example(args: argparse.Namespace) -> dict[str, int]:
    """The example's overrides: the levels' sequences, --layers, and a context that holds a
    prompt and its answer where the size's own does not (ValueError: one it cannot build)."""
    overrides = {"max_seqs": max(args.levels)}
    if args.layers:
        overrides["layers"] = args.layers
    needed = -(-(args.prompt_len + args.max_tokens) // 16) * 16
    if needed > make_config(args.size).max_context:
        overrides["max_context"] = needed
    make_config(args.size, **overrides)
    return overrides


def make_chain(args: argparse.Namespace, overrides: dict[str, int]) -> tuple[Chain, str]:
    name = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    manifest, _ = generate(Path(args.dir) / f"{args.size}-{name}", args.size, **overrides)
    bundle = lower_to_bundle(manifest)
    capacity = max(args.levels) * (args.prompt_len + args.max_tokens + 64)
    if args.backend == "sim":
        from bench.simulated import Device, Timed

        device = Device(args.step_ms, args.row_us)
        return (Timed(bundle, backend=device, graphs=True, token_capacity=capacity),
                f"a simulated device ({args.step_ms} ms a step, {args.row_us} us a prefill row, "
                f"{args.layers or 'all'} layers) on the CPU")
    chain = Chain(bundle, backend=args.backend, token_capacity=capacity)
    if args.backend == "cuda":
        from bench.gpu import device_name

        return chain, device_name()
    return chain, f"the {args.backend} backend"


def decode_step(args: argparse.Namespace, chain: Chain, conc: int) -> float | None:
    """The level's decode step, ms (None on cpu: its median gap stands in)."""
    if args.backend == "sim":
        return args.step_ms
    if args.backend == "cuda":
        from bench.gpu import batch_step_ms

        return batch_step_ms(chain, conc, args.prompt_len + args.max_tokens // 2)
    return None


def levels_flag(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected concurrencies like 32,128, got {text!r}"
                                         ) from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"expected concurrencies of at least 1, got {text!r}")
    return levels


def holds_flag(text: str) -> list[int]:
    try:
        holds = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected steps like 8,0, got {text!r}") from None
    if min(holds) < 0:
        raise argparse.ArgumentTypeError(f"expected steps of at least 0, got {text!r}")
    return holds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.streams",
                                description=__doc__.splitlines()[0])
    REPORT.add_options(p)
    p.add_argument("--size", choices=("tiny", "small"), default="small")
    p.add_argument("--dir", default="/tmp/kerncc-streams-bench", help="example model folder")
    p.add_argument("--layers", type=int, default=0, help="the example's layers (default: "
                   "the size's; fewer make a simulated run quicker)")
    p.add_argument("--backend", choices=("cuda", "cpu", "sim"), default="cuda")
    p.add_argument("--step-ms", type=milliseconds_flag, default=None, help="--backend sim: a "
                   "decode step (default 3.9, the small model's 128-sequence step on an H100)")
    p.add_argument("--row-us", type=microseconds_flag, default=None, help="--backend sim: a "
                   "prefill chunk's cost a row beyond --step-ms (default 2.9)")
    p.add_argument("--levels", type=levels_flag, default=[32, 128])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--chunk", type=int, default=None, help="the engine's prefill rows a step "
                   "(Config.chunk; default: the rows bound)")
    p.add_argument("--hold-steps", type=holds_flag, default=[8, 0], metavar="N,M",
                   help="Config.hold_steps values to run side by side (default 8,0)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sampled", type=fraction_flag, default=0.0, help="the fraction of "
                   "requests that sample (temperature 0.8, top-p 0.95, a seed each; default 0)")
    args = p.parse_args(argv)
    for flag, value, least in (("--prompt-len", args.prompt_len, 1),
                               ("--max-tokens", args.max_tokens, 2), ("--rounds", args.rounds, 1),
                               ("--layers", args.layers, 0)):
        if value < least:
            p.error(f"{flag} {value}: at least {least}")
    if args.backend != "sim" and (args.step_ms, args.row_us) != (None, None):
        p.error(f"--step-ms and --row-us are the simulated device's (--backend sim), not "
                f"{args.backend}'s")
    args.step_ms = 3.9 if args.step_ms is None else args.step_ms
    args.row_us = 2.9 if args.row_us is None else args.row_us
    args.vocab = 256 if args.size == "tiny" else 32000
    try:
        overrides = example(args)
    except ValueError as err:  # before anything is written
        p.error(f"--levels / --layers / --prompt-len / --max-tokens: {err}")
    chain, device = make_chain(args, overrides)
    for conc in args.levels:
        with REPORT.section(f"{conc} streams", limit=600):
            step = decode_step(args, chain, conc)
            runs: dict[int, list[dict[str, Any]]] = defaultdict(list)
            for r in range(args.rounds):
                for hold in args.hold_steps:
                    runs[hold].append(wave(chain, args, conc, hold, seed=r))
            for hold in args.hold_steps:
                m = {k: statistics.median(run[k] for run in runs[hold]) for k in runs[hold][0]}
                unit = step or m["itl_p50"]
                REPORT.row(f"{conc} streams", f"hold_steps {hold}: tokens/s (x sequences / "
                           "step); TTFT p50 / p99 ms; ITL p50 / p99, first gap p50 x step",
                           f"{m['tok_s']:.0f} ({m['tok_s'] * unit / 1e3 / conc:.2f}x); "
                           f"{m['ttft_p50']:.1f} / {m['ttft_p99']:.1f}; "
                           f"{m['itl_p50'] / unit:.2f}x / {m['itl_p99'] / unit:.2f}x, "
                           f"{m['first_p50'] / unit:.1f}x")
                REPORT.results.setdefault(str(conc), {})[str(hold)] = runs[hold]
            REPORT.results[str(conc)]["step_ms"] = step
    return REPORT.finish(args, device, argv)


if __name__ == "__main__":
    raise SystemExit(main())
