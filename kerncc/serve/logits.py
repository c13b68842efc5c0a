"""A request's logits processing and what it asked to hear of each token's probabilities.

A request with penalties, a `logit_bias`, `min_tokens`, a grammar or `logprobs` gets a
`Drawer` (kerncc.serve.sampling_hook.prepare): its state across steps (how often each token was
generated, its grammar's matcher) and what it heard (each token's logprob and the top ones).
The logprobs are those of the processed row (after penalties, bias and mask), before
temperature. Its tokens are drawn one of two ways, with the same numbers:

* on the device, where the model runner draws a decode call's tokens there (every decode step
  of a server with its stages in this process): the Drawer is the `source` of a
  kerncc.runtime.processing.Processed row (sampling_hook.device_draws). Its state lives in the
  session's processor (written once from `fill_state`, then counted on the device from the
  drawn tokens); each step it gives its words (`device_words`, worked out once per request)
  and, following a grammar, the step's mask (`step_masks`: a call's grammar masks in one
  llguidance batch, kerncc.serve.grammar.fill_all); it hears the step's token, logprob and
  top tokens when the call's outputs are taken (`hear_all`: the call's rows at once), and its
  grammar follows the token. The vocab-wide logits never come back. Once its request ended
  (`close`), a step still in flight (issued ahead, or cancelled under it) hears nothing: that
  row's token is dropped;
* on the host (`draw`: a prefill chunk's token, or a runner that cannot draw on the device):
  the call's logits rows of such requests come back and are packed into the same kernels'
  arguments (kernels/logits_ref.py's ABI: the numpy reference runs here), then each row's
  token is picked: the argmax for a greedy request, else the sampler
  (kerncc.runtime.sampling's reference) on the processed row.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from kerncc.serve import grammar as _grammar

from kerncc.kernels.logits_ref import (CHOSEN, HAS_BIAS, HAS_LOGPROBS, HAS_MASK, LOGIT_WORDS,
                                       TOKEN, TOP_IDS, TOP_LOGPROBS, TOP_MAX, f32_bits,
                                       log_softmax, process_logits, top_tokens)


class Heard(NamedTuple):
    """One generated token's logprob and the most likely tokens of its step, best first (a
    tuple: a step makes one per sequence)."""

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
        self.version = 0  # bumped when the host path counts a token (a device slot is stale)
        # its request ended (`close`): a row still in flight hears nothing (its token dropped)
        self.closed = False
        self.vocab = 0  # the logits' width, once a device slot is filled
        # what each device step reads, worked out once: whether the chosen token's logprob is
        # wanted (logprobs, or best_of's ranking), how many top tokens, the words (by `held`)
        self.wants = params.logprobs is not None or params.ranked
        self.masks_steps = matcher is not None  # each step has a mask of its own
        self._top = min(params.logprobs or 0, TOP_MAX)
        self._held_until = params.min_tokens if matcher is None and params.suppress else 0
        self._device = (self._device_words(False), self._device_words(True))

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def close(self) -> None:
        """Its request ended: a step issued before that (ahead, or in flight when it was
        cancelled) drops its token, so its logprob and top tokens are not heard either."""
        self.closed = True

    def words(self, row: int, step: int) -> np.ndarray:
        p = self.params
        flags = (HAS_BIAS if p.logit_bias else 0) | (HAS_MASK if self._masks(step) else 0)
        out = np.zeros(LOGIT_WORDS, dtype=np.uint32)
        out[:6] = [row, f32_bits(p.presence_penalty), f32_bits(p.frequency_penalty),
                   f32_bits(p.repetition_penalty), flags, row]
        return out

    # ------------------------------------------------------------------------ on the device

    def device_words(self, step: int) -> tuple[int, ...]:
        """This step's words for the device kernels (row and slot left 0: the processor
        fills them): the slot's static mask holds min_tokens' stop ids back, a grammar's is
        the step's. Packed once per request; not to be written."""
        return self._device[step < self._held_until]

    def _device_words(self, held: bool) -> tuple[int, ...]:
        p = self.params
        flags = ((HAS_BIAS if p.logit_bias else 0) | (HAS_MASK if held else 0)
                 | (HAS_LOGPROBS if self.wants else 0))
        return (0, f32_bits(p.presence_penalty), f32_bits(p.frequency_penalty),
                f32_bits(p.repetition_penalty), flags, 0, self._top, 0)

    def fill_state(self, counts: np.ndarray, seen: np.ndarray, bias: np.ndarray,
                   allow: np.ndarray) -> None:
        """The device slot's rows as of now: counts, seen, bias and the static mask (every
        token but min_tokens' stop ids)."""
        self.vocab = counts.shape[0]
        self._fill_counts(counts, seen, bias)
        allow[:] = 0xFFFFFFFF
        self._suppress(allow, counts.shape[0])

    @staticmethod
    def step_masks(drawers: Sequence[Drawer], steps: Sequence[int],
                   masks: np.ndarray) -> list[int]:
        """This step's grammar masks (min_tokens' stop ids held back) into the rows of
        `masks` (uint32 [len(drawers), words]); the rows that have one."""
        rows = [b for b, d in enumerate(drawers) if d.matcher is not None]
        if not rows:
            return rows
        _grammar.fill_all([drawers[b].matcher for b in rows], masks, rows)
        for b in rows:
            if steps[b] < drawers[b].params.min_tokens:
                drawers[b]._suppress(masks[b], masks.shape[1] * 32)
        return rows

    @staticmethod
    def hear_all(drawers: Sequence[Drawer], results: np.ndarray) -> None:
        """A device step's results rows (kernels/logits_ref.py's RESULT_WORDS), one a
        drawer: each hears its token, its logprob and the top tokens, as `accept` takes them
        on the host path, and its grammar follows the token."""
        ids = results.view(np.int32)
        tokens = ids[:, TOKEN].tolist()
        chosen = results[:, CHOSEN].tolist()
        k = max(min(d._top, d.vocab) for d in drawers)
        top_ids = ids[:, TOP_IDS:TOP_IDS + k].tolist()
        top_logprobs = results[:, TOP_LOGPROBS:TOP_LOGPROBS + k].tolist()
        for d, token, logprob, ids_, logprobs in zip(drawers, tokens, chosen, top_ids,
                                                     top_logprobs):
            if d.closed:
                continue
            d.counts[token] += 1
            if d.matcher is not None:
                d.matcher.consume(token)
            if not d.wants:
                continue
            d.cumulative += logprob
            if d.params.logprobs is None:
                continue
            n = min(d._top, d.vocab)
            d.heard.append(Heard(token, logprob, tuple(zip(ids_[:n], logprobs[:n]))))

    # ------------------------------------------------------------------------ on the host

    def _masks(self, step: int) -> bool:
        return self.matcher is not None or (step < self.params.min_tokens
                                            and bool(self.params.suppress))

    def fill(self, step: int, counts: np.ndarray, seen: np.ndarray, bias: np.ndarray,
             allow: np.ndarray) -> None:
        """This request's rows of the kernel's per-row arguments."""
        self._fill_counts(counts, seen, bias)
        if not self._masks(step):
            return
        if self.matcher is not None:
            self.matcher.fill(allow)
        else:
            allow[:] = 0xFFFFFFFF
        if step < self.params.min_tokens:
            self._suppress(allow, counts.shape[0])

    def _fill_counts(self, counts: np.ndarray, seen: np.ndarray, bias: np.ndarray) -> None:
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

    def _suppress(self, allow: np.ndarray, vocab: int) -> None:
        """min_tokens' stop ids cleared in `allow`."""
        for token in self.params.suppress:
            if token < vocab:
                allow[token // 32] &= np.uint32(~(1 << (token % 32)) & 0xFFFFFFFF)

    def accept(self, token: int, logp: np.ndarray | None) -> None:
        if self.closed:
            return
        self.counts[token] += 1
        self.version += 1  # counted here, not on the device
        if self.matcher is not None:
            self.matcher.consume(token)
        if logp is None:
            return
        chosen = float(logp[token])
        self.cumulative += chosen
        if self.params.logprobs is None:
            return
        k = min(self.params.logprobs, logp.size)
        best = top_tokens(logp, k)
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
