"""How the engine turns a call's outputs into tokens: greedy, or per-request sampling.

The one place that knows about `kerncc.runtime.sampling` (being added on another branch:
`SamplingParams(temperature=0.0, top_k=0, top_p=1.0, seed=None)` and a sampler over rows of the
logits). Until it is there every request is greedy: the token is the manifest's argmax output
(the forward's `emits`, e.g. `next_tokens`), and a request that asks for temperature > 0 is
refused with a clear message. When it is there, `sample` hands it the logits rows of the
sequences that sample, with each request's params and the index of the token being drawn, so a
seeded request draws the same tokens whatever it is batched with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from kerncc.diagnostics import KernccError

try:  # the sampling branch; absent until it merges
    from kerncc.runtime import sampling as _sampling  # type: ignore[attr-defined]
except ImportError:
    _sampling = None


@attrs.frozen
class Params:
    """A request's sampling parameters (OpenAI's names); greedy when temperature is 0."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def available() -> bool:
    """Whether requests may sample (temperature > 0)."""
    return _sampling is not None and hasattr(_sampling, "SamplingParams")


def check(params: Params) -> None:
    """Refuse what cannot be served: sampling before kerncc.runtime.sampling exists."""
    if not params.greedy and not available():
        raise KernccError.single("temperature > 0 needs kerncc.runtime.sampling, which this "
                                 "kerncc does not have yet: only greedy decoding (temperature "
                                 "0) is served", "/temperature")


def tokens(outputs: dict[str, Any], emits: str | None, logits: str, params: Sequence[Params],
           steps: Sequence[int]) -> list[int]:
    """The token of each of a call's sequences: `params[i]` and `steps[i]` (the index of the
    token drawn) are sequence i's."""
    greedy = [int(t) for t in np.asarray(outputs[emits]).reshape(-1)[:len(params)]] \
        if emits is not None and emits in outputs else None
    if all(p.greedy for p in params):
        if greedy is None:
            raise KernccError.single(f"the call hands back no `tokens` output ({emits}): "
                                     "nothing to decode with")
        return greedy
    rows = np.asarray(outputs[logits]).reshape(len(params), -1)
    return [greedy[i] if p.greedy and greedy is not None else _draw(rows[i], p, steps[i])
            for i, p in enumerate(params)]


def _draw(row: np.ndarray, params: Params, step: int) -> int:
    """One token from one logits row through kerncc.runtime.sampling."""
    check(params)
    native = _sampling.SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                      top_p=params.top_p, seed=params.seed)
    for name in ("sample_row", "sample"):
        draw = getattr(_sampling, name, None)
        if draw is not None:
            return int(draw(row, native, step))
    raise KernccError.single("kerncc.runtime.sampling has no sample_row(row, params, step): "
                             "kerncc.serve.sampling_hook needs wiring to its sampler")
