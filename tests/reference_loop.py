"""One sequence served two ways, for tests: `reference` (the oracle) and `alone` (the engine).

`reference(runner, prompt, max_new, chunk)` is the plainest loop the protocol allows: the
prompt through the chunk program in chunks (all of it when the chunk program hands back a
token, else all but its last token, which goes through the one-row program), then one row at
a time, each call waited for, every input sent by the host, tokens greedy or drawn on the host
(`sample_logits`, counter (0, tokens so far)). Nothing goes ahead, nothing is staged: what the
engine serves must equal it bit for bit.

`alone(runner, prompt, max_new, ...)` is one prompt served through the engine as `kerncc run`
serves it (every call recorded, `Config(runs=True)`), in the same shape.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import attrs
import numpy as np

from kerncc.runtime.model_runner import LOGITS, ModelRunner, Rows
from kerncc.runtime.sampling import SamplingParams, sample_logits


@attrs.frozen
class Generation:
    """A sequence's new tokens, every call's last-row logits, every call's (program, rows)."""

    tokens: list[int]
    logits: np.ndarray | None
    steps: list[tuple[str, int]]


def reference(runner: Any, prompt: Sequence[int], max_new: int, chunk: int | None = None,
              sampling: SamplingParams | None = None, stop: Collection[int] = ()
              ) -> Generation:
    model = ModelRunner(runner)
    prompt = [int(t) for t in prompt]
    chunk = chunk or model.protocol.rows.max
    pages = list(range(max(1, -(-(len(prompt) + max_new - 1) // model.stride))))
    sampler = None if sampling is None or sampling.greedy else sampling.resolved()
    generated: list[int] = []
    steps: list[tuple[str, int]] = []
    logits: list[np.ndarray] = []
    cached = 0

    def call(forward: Any, n: int) -> int | None:
        nonlocal cached
        rows = [Rows(0, prompt, generated, pages, cached, n)]
        vars = model.protocol.vars(1, n, n, cached + n)
        wanted = {LOGITS} | ({forward.emits} if forward.emits else set())
        out = runner.submit(forward.name, model.inputs(rows), vars, outputs=wanted).result()
        cached += n
        steps.append((forward.name, n))
        row = np.asarray(out[LOGITS]).reshape(-1, np.shape(out[LOGITS])[-1])[-1].copy() \
            if LOGITS in out else None
        if row is not None:
            logits.append(row)
        if sampler is not None:
            return int(sample_logits(row[None], [0], [sampler], [(0, len(generated))])[0])
        return int(np.asarray(out[forward.emits]).reshape(-1)[0]) if forward.emits else None

    chunks = model.chunk_program or model.step_program
    end = len(prompt) if model.chunk_emits else len(prompt) - 1
    token = None
    while cached < end:
        token = call(chunks, min(chunk if model.chunk_program else 1, end - cached))
    step = model.step_program or model.chunk_program
    if not model.chunk_emits:
        token = call(step, 1)
    while True:
        generated.append(token)
        if token in stop or len(generated) >= max_new:
            return Generation(generated, np.stack(logits) if logits else None, steps)
        token = call(step, 1)


def alone(runner: Any, prompt: Sequence[int], max_new: int, chunk: int | None = None,
          sampling: SamplingParams | None = None, stop: Collection[int] = (),
          ahead: bool = True, listener: Any = None) -> Generation:
    """`prompt` served alone through the engine (as `kerncc run` serves one prompt)."""
    from kerncc.serve.engine import serve_prompts
    from kerncc.serve.sampling_hook import Params

    params = Params() if sampling is None else Params(
        sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed)
    (request,), engine = serve_prompts(runner, [prompt], max_new, chunk, logits=True,
                                       stop_ids=stop, ahead=ahead, params=params,
                                       listener=listener, runs=True)
    assert engine.pool.free == engine.pool.pages, "every page came back"
    rows = [row for _, _, row in request.runs if row is not None]
    return Generation(request.generated, np.stack(rows) if rows else None,
                      [(program, n) for program, n, _ in request.runs])
