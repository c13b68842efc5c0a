"""`kerncc run` with several `--prompt`s: every prompt served together through the engine.

The command line's hook into kerncc.serve (kerncc.cli.run calls `run_prompts` when more
than one prompt is given): one output line per prompt, in the order given, each the tokens that
prompt alone gives (ending at an eos id as that prompt's run would); the summary on stderr
counts the calls per program.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from kerncc.runtime.chain import Chain
from kerncc.serve.engine import serve_prompts


def run_prompts(chain: Chain, prompts: Sequence[Sequence[int]], max_new: int,
                chunk: int | None, trace: str | None = None,
                stop_ids: Collection[int] = (), say: Callable[[str], None] | None = None
                ) -> int:
    """Serve `prompts` together; a prompt ends at one of `stop_ids` (printed, as a single
    prompt's run prints it) or after `max_new` tokens. `say` takes the progress lines
    (default: stderr; the command line's --quiet passes one that drops them)."""
    say = say or _say
    started = time.perf_counter()
    requests, engine = serve_prompts(chain, prompts, max_new, chunk, stop_ids=stop_ids)
    if trace is not None and chain.trace is not None:
        Path(trace).parent.mkdir(parents=True, exist_ok=True)
        chain.trace.write(trace)
        say(f"wrote a trace of {len(chain.trace.spans)} spans to {trace}")
    calls, rows = engine.calls, engine.rows
    summary = ", ".join(f"{p} {calls[p]} calls ({rows[p]} rows)" for p in sorted(calls))
    say(f"served {len(prompts)} prompts together in {time.perf_counter() - started:.2f} s: "
        f"{summary}")
    for request in requests:
        print(" ".join(str(t) for t in request.generated), flush=True)
    return 0


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
