"""Logits processing in numpy: the reference of the `logits` module's kernels (kernels/logits.cu).

The cpu backend runs these where the cuda backend launches the kernels, with the same
arguments (kerncc.runtime.processing packs them); the host path of kerncc.serve.logits runs
`process_logits` too. Per processed row b of a call, `LOGIT_WORDS` uint32 words:

  0 row (of the logits, `stride` floats apart)   1 presence penalty (f32 bits; 0 = off)
  2 frequency penalty (f32 bits; 0 = off)        3 repetition penalty (f32 bits; 1 = off)
  4 flags: HAS_BIAS add the slot's `bias`, HAS_MASK mask by the slot's `allow`,
    HAS_STEP_MASK mask by row b of `step_allow`, HAS_LOGPROBS compute the logprobs
  5 the sequence's state slot s                  6 top logprobs wanted (0..TOP_MAX)
  7 zero

and per slot s: `counts[s]` (int32 [vocab]: how often each token was generated), `seen[s]`
(uint8 [vocab]: 1 where the token is in the prompt or was generated), `bias[s]` (f32 [vocab])
and `allow[s]` (uint32 [ceil(vocab / 32)]: bit t % 32 of word t // 32 set where token t may
come next, the layout grammar engines fill); `step_allow[b]` is the same layout, this step's.
`process_logits`, in order, as vLLM applies them:

1. repetition r (HF's CTRL rule): a seen token's logit x becomes x / r if x > 0, else x * r;
2. x -= frequency * count + presence * (count > 0), over generated tokens (OpenAI's rule);
3. x += bias (logit_bias);
4. a token whose `allow` (or `step_allow`) bit is clear becomes -inf (a grammar's mask,
   min_tokens' stop ids).

Every step is one f32 operation a token, so a kernel gives the same bits.

`logprobs` then writes row b of `results` (f32 [n, RESULT_WORDS], ints as their bits):
1 the row's max m, 2 log(sum(exp(x - m))), 4.. the top w[6] token ids by logprob
(x - m) - log-sum (ties: the smaller id first), 4 + TOP_MAX.. their logprobs. After the
sampler has written each row's token to `tokens[row]`, `accept` writes 3 the token, 0 its
logprob (when HAS_LOGPROBS), and counts the token in its slot's `counts` and `seen`.
"""

from __future__ import annotations

import numpy as np

LOGIT_WORDS = 8
TOP_MAX = 20  # the most top logprobs a step reports (kerncc.serve.fields.MAX_LOGPROBS)
RESULT_WORDS = 4 + 2 * TOP_MAX
HAS_BIAS, HAS_MASK, HAS_STEP_MASK, HAS_LOGPROBS = 1, 2, 4, 8
CHOSEN, MAX, LOG_SUM, TOKEN, TOP_IDS, TOP_LOGPROBS = 0, 1, 2, 3, 4, 4 + TOP_MAX


def f32_bits(value: float) -> int:
    return int(np.asarray([value], dtype=np.float32).view(np.uint32)[0])


def _f32(word: int) -> np.float32:
    return np.asarray([word], dtype=np.uint32).view(np.float32)[0]


def mask_words(vocab: int) -> int:
    return (vocab + 31) // 32


def allowed(allow_row: np.ndarray, vocab: int) -> np.ndarray:
    """A bool [vocab] of the tokens a packed `allow` row lets through."""
    bits = np.unpackbits(np.ascontiguousarray(allow_row, dtype="<u4").view(np.uint8),
                         bitorder="little")
    return bits[:vocab].astype(bool)


def process_logits(logits: np.ndarray, words: np.ndarray, counts: np.ndarray,
                   seen: np.ndarray, bias: np.ndarray, allow: np.ndarray,
                   step_allow: np.ndarray | None = None) -> None:
    """Apply each row's processors to its logits row, in place (see the module docstring)."""
    vocab = counts.shape[1]
    for b, w in enumerate(words):
        x, s, flags = logits[int(w[0]), :vocab], int(w[5]), int(w[4])
        presence, frequency, repetition = _f32(w[1]), _f32(w[2]), _f32(w[3])
        if repetition != np.float32(1):
            hit = seen[s].astype(bool)
            x[hit] = np.where(x[hit] > 0, x[hit] / repetition, x[hit] * repetition)
        if frequency != 0 or presence != 0:
            count = counts[s].astype(np.float32)
            x -= frequency * count + presence * (count > 0).astype(np.float32)
        if flags & HAS_BIAS:
            x += bias[s]
        if flags & HAS_MASK:
            x[~allowed(allow[s], vocab)] = -np.inf
        if flags & HAS_STEP_MASK:
            x[~allowed(step_allow[b], vocab)] = -np.inf


def log_softmax(x: np.ndarray) -> np.ndarray:
    """log p of a row of f32 logits (-inf where the logit is -inf), in f32."""
    x = np.asarray(x, dtype=np.float32)
    top = x.max()
    with np.errstate(under="ignore", divide="ignore"):
        return (x - top - np.log(np.exp(x - top).sum(dtype=np.float32))).astype(np.float32)


def top_tokens(logp: np.ndarray, k: int) -> np.ndarray:
    """The k tokens of highest logprob, best first; ties: the smaller id first."""
    return np.argsort(-logp, kind="stable")[:k]


def logprobs(logits: np.ndarray, words: np.ndarray, results: np.ndarray, vocab: int) -> None:
    """Each HAS_LOGPROBS row's log-softmax terms and top tokens into `results` (see above)."""
    ids = results.view(np.int32)
    for b, w in enumerate(words):
        if not int(w[4]) & HAS_LOGPROBS:
            continue
        x = np.asarray(logits[int(w[0]), :vocab], dtype=np.float32)
        top = x.max()
        with np.errstate(under="ignore", divide="ignore"):
            log_sum = np.log(np.exp(x - top).sum(dtype=np.float32))
        results[b, MAX], results[b, LOG_SUM] = top, log_sum
        k = min(int(w[6]), TOP_MAX, vocab)
        logp = (x - top - log_sum).astype(np.float32)
        best = top_tokens(logp, k)
        ids[b, TOP_IDS:TOP_IDS + k] = best
        results[b, TOP_LOGPROBS:TOP_LOGPROBS + k] = logp[best]


def accept(logits: np.ndarray, words: np.ndarray, tokens: np.ndarray, counts: np.ndarray,
           seen: np.ndarray, results: np.ndarray) -> None:
    """Each row's drawn token (`tokens[row]`) into `results`, its logprob, and its count."""
    vocab = counts.shape[1]
    ids = results.view(np.int32)
    for b, w in enumerate(words):
        token = int(tokens[int(w[0])])
        ids[b, TOKEN] = token
        if not 0 <= token < vocab:
            continue
        if int(w[4]) & HAS_LOGPROBS:
            x = np.float32(logits[int(w[0]), token])
            results[b, CHOSEN] = np.float32(x - results[b, MAX]) - results[b, LOG_SUM]
        counts[int(w[5]), token] += 1
        seen[int(w[5]), token] = 1
