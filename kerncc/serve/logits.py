"""A request's logits processing and what it asked to hear of each token's probabilities.

A request with penalties, a `logit_bias`, `min_tokens`, a grammar or `logprobs` gets a
`Drawer` (kerncc.serve.sampling_hook.prepare): its state across steps (how often each token was
generated, its grammar's matcher) and what it heard (each token's logprob and the top ones).
`draw` takes a call's logits rows of such requests, packs them into the arguments of the
processing kernel (kernels/logits_ref.py's ABI: the numpy reference runs here, on the host,
on the rows the call brought back), then picks each row's token: the argmax for a greedy
request, else the sampler (kerncc.runtime.sampling's reference) on the processed row. The
logprobs are those of the processed row (after penalties, bias and mask), before temperature.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from kerncc.kernels.logits_ref import (HAS_BIAS, HAS_MASK, LOGIT_WORDS, f32_bits, log_softmax,
                                       process_logits)


@attrs.frozen
class Heard:
    """One generated token's logprob and the most likely tokens of its step, best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class Drawer:
    """One request's processors and their state (see the module docstring)."""

    def __init__(self, params: Any, native: Any, matcher: Any = None) -> None:
        self.params, self.native, self.matcher = params, native, matcher
        self.counts: Counter[int] = Counter()
        self.heard: list[Heard] = []
        self.cumulative = 0.0  # sum of the chosen tokens' logprobs (best_of ranks by it)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def words(self, row: int, step: int) -> np.ndarray:
        p = self.params
        flags = (HAS_BIAS if p.logit_bias else 0) | (HAS_MASK if self._masks(step) else 0)
        out = np.zeros(LOGIT_WORDS, dtype=np.uint32)
        out[:5] = [row, f32_bits(p.presence_penalty), f32_bits(p.frequency_penalty),
                   f32_bits(p.repetition_penalty), flags]
        return out

    def _masks(self, step: int) -> bool:
        return self.matcher is not None or (step < self.params.min_tokens
                                            and bool(self.params.suppress))

    def fill(self, step: int, counts: np.ndarray, seen: np.ndarray, bias: np.ndarray,
             allow: np.ndarray) -> None:
        """This request's rows of the kernel's per-row arguments."""
        p, vocab = self.params, counts.shape[0]
        for token, count in self.counts.items():
            if token < vocab:
                counts[token] = count
        if p.repetition_penalty != 1:
            seen[[t for t in p.prompt if 0 <= t < vocab]] = 1
            seen[counts > 0] = 1
        for token, value in p.logit_bias:
            if token < vocab:
                bias[token] = value
        if not self._masks(step):
            return
        if self.matcher is not None:
            self.matcher.fill(allow)
        else:
            allow[:] = 0xFFFFFFFF
        if step < p.min_tokens:
            for token in p.suppress:
                if token < vocab:
                    allow[token // 32] &= np.uint32(~(1 << (token % 32)) & 0xFFFFFFFF)

    def accept(self, token: int, logp: np.ndarray | None) -> None:
        self.counts[token] += 1
        if self.matcher is not None:
            self.matcher.consume(token)
        if logp is None:
            return
        chosen = float(logp[token])
        self.cumulative += chosen
        if self.params.logprobs is None:
            return
        k = min(self.params.logprobs, logp.size)
        best = np.argsort(-logp, kind="stable")[:k]
        self.heard.append(Heard(token, chosen, tuple((int(t), float(logp[t])) for t in best)))


def draw(rows: np.ndarray, drawers: Sequence[Drawer], steps: Sequence[int],
         sample: Any) -> list[int]:
    """The token of each row of `rows` (f32 [n, vocab], one per drawer): processed, then
    picked; `sample(processed, indices, natives, counters)` draws the sampled ones."""
    n, vocab = rows.shape
    processed = np.array(rows, dtype=np.float32)
    words = np.stack([d.words(b, s) for b, (d, s) in enumerate(zip(drawers, steps))])
    counts = np.zeros((n, vocab), dtype=np.int32)
    seen = np.zeros((n, vocab), dtype=np.uint8)
    bias = np.zeros((n, vocab), dtype=np.float32)
    allow = np.zeros((n, (vocab + 31) // 32), dtype=np.uint32)
    for b, (d, s) in enumerate(zip(drawers, steps)):
        d.fill(s, counts[b], seen[b], bias[b], allow[b])
    process_logits(processed, words, counts, seen, bias, allow)
    out = [int(np.argmax(processed[b])) for b in range(n)]
    sampled = [b for b, d in enumerate(drawers) if not d.greedy]
    if sampled:
        picked = sample(processed, sampled, [drawers[b].native for b in sampled],
                        [(0, int(steps[b])) for b in sampled])
        for b, token in zip(sampled, picked):
            out[b] = int(token)
    for b, d in enumerate(drawers):
        wants = d.params.logprobs is not None or d.params.ranked
        d.accept(out[b], log_softmax(processed[b]) if wants else None)
    return out
