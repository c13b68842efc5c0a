"""Where the host time of a served prompt goes: cProfile of one chunked prefill.

    python tests/bench/serve_profile.py [--devices 0,1] [--tokens 8192] [--chunk 512]

Builds the small example (cut at the middle layer when two devices are given), serves the
prompt twice to warm up (graph capture), then once under cProfile, and prints the functions
that took the most host time. A diagnostic for the pipeline's TTFT, not a benchmark.
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

from gpu_bench import build  # noqa: E402

from kerncc.runtime import Chain  # noqa: E402
from kerncc.runtime.generate import Generator  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="0,1")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--top", type=int, default=45)
    args = parser.parse_args()
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


if __name__ == "__main__":
    sys.exit(main())
