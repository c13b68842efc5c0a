"""Logits processing in numpy: the reference of a device kernel run before sampling.

One row of f32 logits per block of a kernel (per row here), changed in place, with the row's
parameters as `LOGIT_WORDS` uint32 words (packed by kerncc.serve.logits):

  0 row (of the logits, `stride` floats apart)   1 presence penalty (f32 bits; 0 = off)
  2 frequency penalty (f32 bits; 0 = off)        3 repetition penalty (f32 bits; 1 = off)
  4 flags: 1 = add row b of `bias`, 2 = mask by row b of `allow`
  5, 6, 7 zero

and per row b of the call: `counts[b]` (int32 [vocab]: how often each token was generated),
`seen[b]` (uint8 [vocab]: 1 where the token is in the prompt or was generated), `bias[b]`
(f32 [vocab]) and `allow[b]` (uint32 [ceil(vocab / 32)]: bit t % 32 of word t // 32 set where
token t may come next, the layout grammar engines fill). In order, as vLLM applies them:

1. repetition r (HF's CTRL rule): a seen token's logit x becomes x / r if x > 0, else x * r;
2. x -= frequency * count + presence * (count > 0), over generated tokens (OpenAI's rule);
3. x += bias (logit_bias);
4. a token whose `allow` bit is clear becomes -inf (a grammar's mask, min_tokens' stop ids).

Every step is one f32 operation a token, so a kernel gives the same bits.
"""

from __future__ import annotations

import numpy as np

LOGIT_WORDS = 8
HAS_BIAS, HAS_MASK = 1, 2


def f32_bits(value: float) -> int:
    return int(np.asarray([value], dtype=np.float32).view(np.uint32)[0])


def _f32(word: int) -> np.float32:
    return np.asarray([word], dtype=np.uint32).view(np.float32)[0]


def allowed(allow_row: np.ndarray, vocab: int) -> np.ndarray:
    """A bool [vocab] of the tokens a packed `allow` row lets through."""
    bits = np.unpackbits(np.ascontiguousarray(allow_row, dtype="<u4").view(np.uint8),
                         bitorder="little")
    return bits[:vocab].astype(bool)


def process_logits(logits: np.ndarray, words: np.ndarray, counts: np.ndarray,
                   seen: np.ndarray, bias: np.ndarray, allow: np.ndarray) -> None:
    """Apply each row's processors to its logits row, in place (see the module docstring)."""
    vocab = counts.shape[1]
    for b, w in enumerate(words):
        x = logits[int(w[0]), :vocab]
        presence, frequency, repetition = _f32(w[1]), _f32(w[2]), _f32(w[3])
        if repetition != np.float32(1):
            hit = seen[b].astype(bool)
            x[hit] = np.where(x[hit] > 0, x[hit] / repetition, x[hit] * repetition)
        if frequency != 0 or presence != 0:
            count = counts[b].astype(np.float32)
            x -= frequency * count + presence * (count > 0).astype(np.float32)
        if int(w[4]) & HAS_BIAS:
            x += bias[b]
        if int(w[4]) & HAS_MASK:
            x[~allowed(allow[b], vocab)] = -np.inf


def log_softmax(x: np.ndarray) -> np.ndarray:
    """log p of a row of f32 logits (-inf where the logit is -inf), in f32."""
    x = np.asarray(x, dtype=np.float32)
    top = x.max()
    with np.errstate(under="ignore", divide="ignore"):
        return (x - top - np.log(np.exp(x - top).sum(dtype=np.float32))).astype(np.float32)
