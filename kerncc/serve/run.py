"""`kerncc run` with several `--prompt`s: every prompt served together through the engine.

The command line's hook into kerncc.serve (kerncc.cli.run calls `run_prompts` when more
than one prompt is given): one output line per prompt, in the order given, each the tokens that
prompt alone gives; the summary on stderr counts the calls per program.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kerncc.diagnostics import KernccError
from kerncc.runtime.chain import Chain
from kerncc.serve.engine import serve_prompts


def run_prompts(chain: Chain, prompts: Sequence[Sequence[int]], max_new: int,
                chunk: int | None, logits: str | None, trace: str | None = None) -> int:
    if logits:
        raise KernccError.single("--logits saves one prompt's logits; give one --prompt")
    started = time.perf_counter()
    requests, engine = serve_prompts(chain, prompts, max_new, chunk)
    if trace is not None and chain.trace is not None:
        Path(trace).parent.mkdir(parents=True, exist_ok=True)
        chain.trace.write(trace)
        print(f"wrote a trace of {len(chain.trace.spans)} spans to {trace}", file=sys.stderr)
    calls, rows = engine.calls, engine.rows
    summary = ", ".join(f"{p} {calls[p]} calls ({rows[p]} rows)" for p in sorted(calls))
    print(f"served {len(prompts)} prompts together in {time.perf_counter() - started:.2f} s: "
          f"{summary}", file=sys.stderr, flush=True)
    for request in requests:
        print(" ".join(str(t) for t in request.generated), flush=True)
    return 0
