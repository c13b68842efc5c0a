"""TTFT of a 4096-token prompt with the first token from the last chunk (the default) against
kern-serve's order (the last prompt token through the one-row step), alternating in one run,
through the Generator and through the serving engine; the ratio of the two in each.

    python tests/bench/first_token_bench.py      # one GPU, the small example, ~20 s
"""
import os
import statistics
import sys
import time
from pathlib import Path
sys.path.insert(0, "tests/bench")
import attrs
import numpy as np
from gpu_bench import build
from kerncc.runtime import Chain
from kerncc.runtime.generate import Generator
from kerncc.serve.engine import Config, Engine, Request

work = Path(os.environ.get("TMPDIR", "/tmp")) / "kerncc-first-token-bench"
model = build(work, "small")
chain = Chain(model["whole"], backend="cuda", token_capacity=32 * 1024)
prompt = [int(t) for t in np.random.default_rng(4).integers(1, 32000, 4096)]
g = Generator(chain)
times = {True: [], False: []}
toks = {}
for rep in range(7):
    for emits in (True, False):
        g.chunk_emits = emits
        t = time.perf_counter()
        toks[emits] = g.generate(prompt, 1, 2048).tokens
        times[emits].append(time.perf_counter() - t)
for emits, ts in times.items():
    print(f"Generator TTFT 4096 chunk 2048, first token from the chunk={emits}: median of 6 "
          f"{statistics.median(ts[1:]) * 1e3:.2f} ms (all {[round(x * 1e3, 1) for x in ts]})")
print(f"  ratio {statistics.median(times[True][1:]) / statistics.median(times[False][1:]):.3f}")
print("same first token:", toks[True] == toks[False], toks)
engine = Engine(chain, Config(max_running=4, chunk=2048))
base = engine.limits
etimes = {True: [], False: []}
for rep in range(5):
    for emits in (True, False):
        engine.limits = attrs.evolve(base, chunk_emits=emits)
        r = Request(list(prompt), 1)
        t = time.perf_counter()
        engine.submit(r)
        engine.run_until_idle()
        etimes[emits].append(time.perf_counter() - t)
        assert r.finish == "length", r.finish
for emits, ts in etimes.items():
    print(f"Engine TTFT 4096 chunk 2048, first token from the chunk={emits}: median of 4 "
          f"{statistics.median(ts[1:]) * 1e3:.2f} ms")
print(f"  ratio {statistics.median(etimes[True][1:]) / statistics.median(etimes[False][1:]):.3f}")
