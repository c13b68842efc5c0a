"""How the engine turns a call's outputs into tokens: greedy, or per-request sampling.

The one place that knows about `kerncc.runtime.sampling` (`SamplingParams(temperature=0.0,
top_k=0, top_p=1.0, seed=None)`, Philox draws keyed by the seed with a (sequence, step) counter,
and `sample_logits`, the numpy reference over host logits rows). Greedy rows take the
manifest's argmax output (the forward's `emits`, e.g. `next_tokens`), which is what the argmax
of the logits gives. A call that holds a sampling request brings its logits back and samples
them on the host: the engine keeps several calls in flight, and the logits buffer on the device
already holds a later call's by the time the oldest is collected. The counter of a request's
token t is (0, t), so a seeded request draws the same tokens whatever it is batched with and
whichever request it is.

Where the model runner can (`ModelRunner.draws_on_device`), a decode call's plain sampled
requests are drawn on the device instead (`device_draws`: the same reference, the same
counters, into the call's token output, greedy rows by their argmax as before), so that their
tokens are fed to the next step on the device as greedy ones are; their tokens are those the
host draw gives (tests/test_serve_engine_pace.py).

A request that asks for logits processing (penalties, `logit_bias`, `min_tokens`, a grammar)
or for logprobs gets a `kerncc.serve.logits.Drawer` instead, greedy or not: in a decode call
drawn on the device its row is a `kerncc.runtime.processing.Processed` one (processed and
drawn there, its results heard by the Drawer when the call's outputs are taken); elsewhere its
rows come back, are processed, then picked (`logits.draw`). A request that asks for none of it
takes exactly the path above: its bits are those of a server without processors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from kerncc.diagnostics import KernccError
from kerncc.runtime import processing as _processing
from kerncc.runtime import sampling as _sampling
from kerncc.serve import logits as _logits


@attrs.frozen
class Params:
    """A request's sampling parameters (OpenAI's names); greedy when temperature is 0."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 is off
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    suppress: frozenset[int] = frozenset()  # the stop ids held back until min_tokens
    prompt: tuple[int, ...] = ()  # the tokens repetition_penalty counts as seen
    logprobs: int | None = None  # how many top tokens each step reports (0: the chosen only)
    ranked: bool = False  # the sum of the chosen tokens' logprobs is wanted (best_of)
    grammar: Any = None  # a kerncc.serve.grammar.Grammar the tokens must follow

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain(self) -> bool:
        """Nothing but temperature, top-k, top-p and seed: today's path, untouched."""
        return (self.presence_penalty == 0 and self.frequency_penalty == 0
                and self.repetition_penalty == 1 and not self.logit_bias
                and (self.min_tokens == 0 or not self.suppress) and self.logprobs is None
                and not self.ranked and self.grammar is None)


def prepare(params: Params) -> Any:
    """The sampler's own params for one request, checked, its seed fixed for the whole
    sequence (a fresh random one when none is given); None for a greedy request."""
    if params.greedy and params.plain:
        return None
    if params.greedy:
        return _logits.Drawer(params, None, _matcher(params))
    native = _sampling.SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                      top_p=params.top_p, seed=params.seed)
    if params.plain:
        return native.resolved()
    return _logits.Drawer(params, native.resolved(), _matcher(params))


def _matcher(params: Params) -> Any:
    return None if params.grammar is None else params.grammar.matcher()


def device_draws(natives: Sequence[Any], steps: Sequence[int], every: bool = False
                 ) -> tuple[list[Any], list[tuple[int, int]]] | None:
    """The (params, counters) a decode call's sequences are drawn with on the device
    (kerncc.runtime.model_runner: `submit(draws=...)`), `natives[i]` sequence i's `prepare`d
    params (None: greedy), `steps[i]` the index of the token it draws; None when every one
    is greedy (the argmax output is the token already), unless `every` (a call whose forward
    was issued to be drawn: `ModelRunner.draw`). A `Drawer`'s row is processed on the
    device before its draw (kerncc.runtime.processing.Processed)."""
    if all(n is None for n in natives) and not every:
        return None
    greedy = _sampling.SamplingParams()
    params = [_processing.Processed(n.native or greedy, n, max(0, int(step)))
              if isinstance(n, _logits.Drawer) else n or greedy
              for n, step in zip(natives, steps)]
    return (params, [(0, max(0, int(step))) for step in steps])


def follows_tokens(native: Any) -> bool:
    """Whether a request's next draw needs its last token on the host first (a grammar's
    mask): a step issued ahead of that token has its forward issued at once and its draw
    once the token is here (kerncc.serve.engine's `_draw_ahead`)."""
    return isinstance(native, _logits.Drawer) and native.matcher is not None


def ended(native: Any) -> None:
    """A request's sequence ended: a `Drawer` hears no more (a row of it still in flight
    has its token dropped, its logprobs with it)."""
    if isinstance(native, _logits.Drawer):
        native.close()


def tokens(outputs: dict[str, Any], emits: str | None, logits: str, natives: Sequence[Any],
           steps: Sequence[int]) -> list[int]:
    """The token of each of a call's sequences: `natives[i]` is sequence i's `prepare`d
    params (None: greedy), `steps[i]` the index of the token it draws."""
    greedy = [int(t) for t in np.asarray(outputs[emits]).reshape(-1)[:len(natives)]] \
        if emits is not None and emits in outputs else None
    if all(n is None for n in natives):
        if greedy is None:
            raise KernccError.single(f"the call hands back no `tokens` output ({emits}): "
                                     "nothing to decode with")
        return greedy
    rows = np.asarray(outputs[logits], dtype=np.float32).reshape(len(natives), -1)
    processed = [i for i, n in enumerate(natives) if isinstance(n, _logits.Drawer)]
    drawn = [i for i, n in enumerate(natives)
             if (n is not None or greedy is None) and i not in processed]
    greedy_params = _sampling.SamplingParams()
    picked = _sampling.sample_logits(rows, drawn, [natives[i] or greedy_params for i in drawn],
                                     [(0, int(steps[i])) for i in drawn])
    out = list(greedy) if greedy is not None else [0] * len(natives)
    for i, token in zip(drawn, picked):
        out[i] = int(token)
    if processed:
        chosen = _logits.draw(rows[processed], [natives[i] for i in processed],
                              [int(steps[i]) for i in processed], _sampling.sample_logits)
        for i, token in zip(processed, chosen):
            out[i] = token
    return out
