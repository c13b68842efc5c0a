"""Where the time of a served prompt goes: host (cProfile) and GPU (each kernel's events).

    python tests/bench/serve_profile.py [--devices 0,1] [--tokens 8192] [--chunk 512]
    python tests/bench/serve_profile.py --kernels [--context 4096] [--chunk 512]

Builds the small example (cut at the middle layer when two devices are given), serves the
prompt twice to warm up (graph capture), then once under cProfile, and prints the functions
that took the most host time. With --kernels, one GPU: `context` tokens are prefilled, then
one chunk of `chunk` rows is issued launch by launch behind a busy stream, an event pair
around each launch, and the GPU time is summed per op and entry (largest first). Diagnostics
for the TTFT, not benchmarks.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import Busy, build  # noqa: E402

from kerncc.runtime import Chain  # noqa: E402
from kerncc.runtime.generate import Generator, Served, _Record  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="0,1")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--top", type=int, default=45)
    parser.add_argument("--kernels", action="store_true", help="GPU time per op, one GPU")
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()
    if args.kernels:
        return kernels(args.context, args.chunk)
    devices = [int(d) for d in args.devices.split(",")]
    model = build(Path(tempfile.mkdtemp()), "small")
    bundle = model["two"] if len(devices) > 1 else model["whole"]
    chain = Chain(bundle, backend="cuda", devices=devices if len(devices) > 1 else None)
    prompt = [int(t) for t in np.random.default_rng(5).integers(1, 32000, args.tokens)]
    generator = Generator(chain)
    for _ in range(2):
        generator.generate(prompt, 1, args.chunk)
    t0 = time.perf_counter()
    generator.generate(prompt, 1, args.chunk)
    plain = time.perf_counter() - t0
    profile = cProfile.Profile()
    profile.enable()
    generator.generate(prompt, 1, args.chunk)
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    print(f"TTFT {args.tokens} chunk {args.chunk} on {devices}: {plain * 1e3:.1f} ms unprofiled")
    print(text.getvalue())
    return 0


def kernels(context: int, chunk: int) -> int:
    model = build(Path(tempfile.mkdtemp()), "small")
    chain = Chain(model["whole"], backend="cuda", graphs="off")
    session, backend = chain.sessions[0], chain.sessions[0].backend
    generator = Generator(chain)
    program = generator.chunk_program
    prompt = [int(t) for t in np.random.default_rng(5).integers(1, 32000, context + chunk)]
    seq, record = Served(prompt), _Record()
    while seq.cached < context:
        generator._feed(seq, min(chunk, context - seq.cached), program, record, wait=False)
    generator._reserve(seq, context + chunk)
    inputs = generator._inputs(seq, context, context + chunk)
    vars = generator.protocol.vars(1, chunk, chunk, context + chunk)
    backend.sync()
    originals = dict(session._launchers)
    marks: list[tuple] = []

    def timed(number, launcher):
        site = session._by_number[number]

        def launch(grid, shared, scalars):
            start = backend.mark()
            launcher(grid, shared, scalars)
            marks.append((f"{site.op} {site.entry}", start, backend.mark()))
        return launch

    totals: dict[str, list[float]] = {}
    busy = Busy(backend)
    try:
        session._launchers = {n: timed(n, fn) for n, fn in originals.items()}
        for _ in range(3):
            marks.clear()
            with busy:
                session.submit(program.name, inputs, vars, outputs=False)
            backend.sync()
            run: dict[str, float] = {}
            for name, a, b in marks:
                run[name] = run.get(name, 0.0) + backend.elapsed_ms(a, b)
            for name, ms in run.items():
                totals.setdefault(name, []).append(ms)
        counts = {name: sum(1 for n, _, _ in marks if n == name) for name in totals}
    finally:
        session._launchers = originals
    queued = []
    for _ in range(3):
        with busy:
            start = backend.mark()
            session.submit(program.name, inputs, vars, outputs=False)
            end = backend.mark()
        queued.append(backend.elapsed_ms(start, end))
    best = {name: min(v) for name, v in totals.items()}
    whole = sum(best.values())
    print(f"prefill chunk {chunk} rows at context {context}: {len(marks)} launches, "
          f"event sum {whole:.3f} ms, queued back to back {min(queued):.3f} ms")
    print(f"{'op entry':60s} {'count':>5s} {'ms':>8s} {'share':>6s}")
    for name in sorted(best, key=best.get, reverse=True):
        print(f"{name[:60]:60s} {counts[name]:5d} {best[name]:8.3f} {best[name] / whole:6.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
