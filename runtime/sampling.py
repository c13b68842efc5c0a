"""Sampling: picking tokens from a forward's logits by temperature, top-k, top-p and a seed.

The runtime samples after the forward, on the logits buffer the manifest already writes (a
manifest written by kern stays unchanged; its `argmax` op keeps giving the greedy token). What
this module owns:
* `SamplingParams`: one request's parameters, checked when made (a clear error names the
  parameter);
* `sample(session, buffer, rows, params, counters)`, which `Session.sample` calls: the token of
  each listed row of the buffer. On the cpu backend the numpy reference runs
  (kerncc.kernels.sampling_ref); on cuda the library's Numba-CUDA cubin `sample_f32` (module
  `sampling_nb`, built ahead of time; numba is never imported here) runs on the device logits
  and only the chosen ids come back (4 bytes a row);
* `sample_into(session, buffer, output, params, counters)`, which `Session.sample_into` calls:
  rows 0..n-1 drawn into an i32 buffer on the device, after everything issued so far, nothing
  brought back (a server feeds them to its next step, kerncc.runtime.model_runner). The cpu
  backend runs the same numpy reference, so a token drawn there is the host draw's
  (`sample_logits`) for the same counter.
The random draw of a row is Philox4x32-10 keyed by the seed with the counter (step, sequence),
so a seed reproduces a whole sampled sequence, however rows are batched. Greedy rows
(temperature 0) give the first argmax, as the manifest's `argmax` op does.
"""

from __future__ import annotations

import ctypes
import math
import secrets
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from kerncc.diagnostics import KernccError
from kerncc.kernels.sampling_ref import PARAM_WORDS, sample_row
from kerncc.runtime import processing

U64_MAX = 2**64 - 1
F32_MAX = float(np.finfo(np.float32).max)  # the kernel's parameters are f32
MODULE, ENTRY = "sampling_nb", "sample_f32"
THREADS = 1024  # the kernel's block (a power of two up to 1024)


def _refuse(name: str, value: Any, rule: str) -> KernccError:
    return KernccError.single(f"sampling parameter `{name}` = {value!r}: {rule}",
                              f"/sampling/{name}")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@attrs.frozen
class SamplingParams:
    """How one sequence picks its tokens. The defaults are greedy decoding.

    temperature: 0 = greedy (argmax), else logits are divided by it before the softmax.
    top_k: keep the k most likely tokens (ties at the boundary kept); 0 = off.
    top_p: keep the fewest most likely tokens holding this much probability; 1 = off.
    seed: the Philox key, 0..2**64-1; None = fresh OS randomness (see `resolved`).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __attrs_post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise a KernccError naming the first parameter out of range."""
        t = self.temperature
        if _is_int(t) or isinstance(t, (float, np.floating)):
            if not math.isfinite(t) or t < 0:
                raise _refuse("temperature", t, "must be a finite number >= 0 (0 is greedy)")
            if t > F32_MAX:  # it would be inf in the kernel: every token equally likely
                raise _refuse("temperature", t, f"must fit float32 (at most {F32_MAX:.6g})")
        else:
            raise _refuse("temperature", t, "must be a number")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise _refuse("top_k", self.top_k, "must be a whole number >= 0 (0 is off)")
        p = self.top_p
        if not isinstance(p, (int, float, np.integer, np.floating)) or isinstance(p, bool) \
                or not 0 < p <= 1:
            raise _refuse("top_p", p, "must be in (0, 1] (1 is off)")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= U64_MAX):
            raise _refuse("seed", self.seed, "must be a whole number in 0..2**64-1 or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def resolved(self) -> SamplingParams:
        """These parameters with a concrete seed (a fresh random one when seed is None):
        resolve once per sequence, so that its steps share one key."""
        return self if self.seed is not None else attrs.evolve(self, seed=secrets.randbits(64))


def pack(rows: Sequence[int], params: Sequence[SamplingParams],
         counters: Sequence[tuple[int, int]], vocab: int) -> np.ndarray:
    """The kernel's parameter words, [len(rows), 12] uint32 (kernels/sampling_ref.py's
    layout); seeds still None draw fresh randomness here."""
    words = np.zeros((len(rows), PARAM_WORDS), dtype=np.uint32)
    for b, (row, p, (sequence, step)) in enumerate(zip(rows, params, counters)):
        seed = p.resolved().seed
        top_k = p.top_k if p.top_k < vocab else 0
        floats = np.asarray([p.temperature, p.top_p], dtype=np.float32).view(np.uint32)
        words[b, :10] = [row, floats[0], top_k, floats[1], seed & 0xFFFFFFFF, seed >> 32,
                         sequence & 0xFFFFFFFF, sequence >> 32, step & 0xFFFFFFFF, step >> 32]
    return words


def _listed(value: Any, name: str) -> list:
    """`value` as a list: a sequence or a 1-D array (None, a number or a string is refused)."""
    if isinstance(value, np.ndarray) and value.ndim == 1:
        return value.tolist()
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise KernccError.single(f"sample: {name}: expected a list, got {type(value).__name__}")
    return list(value)


def check_request(rows: Sequence[int], params: Sequence[SamplingParams],
                  counters: Sequence[tuple[int, int]], available: int, buffer: str) -> None:
    """Rows inside the buffer, one params and one (sequence, step) counter per row."""
    if not (len(rows) == len(params) == len(counters)):
        raise KernccError.single(f"sample: {len(rows)} rows, {len(params)} params and "
                                 f"{len(counters)} counters; give one of each per row")
    if _plain(rows, params, counters, available):
        return
    for row in rows:
        if not _is_int(row) or not 0 <= row < available:
            raise KernccError.single(f"sample: row {row!r} is outside buffer `{buffer}`'s "
                                     f"{available} rows (at the last run's vars)")
    for p in params:
        if isinstance(p, processing.Processed):
            p = p.native
        if not isinstance(p, SamplingParams):
            raise KernccError.single(f"sample: expected SamplingParams, got {type(p).__name__}")
    for counter in counters:
        ok = isinstance(counter, tuple) and len(counter) == 2 and all(
            _is_int(c) and 0 <= c <= U64_MAX for c in counter)
        if not ok:
            raise KernccError.single(f"sample: counter {counter!r} is not a (sequence, step) "
                                     "pair of whole numbers in 0..2**64-1")


def _plain(rows: Sequence[Any], params: Sequence[Any], counters: Sequence[Any],
           available: int) -> bool:
    """Whether a request is plainly right, checked in a few passes of builtins: plain int
    rows in range, SamplingParams, (int, int) counters in range. A decode step of 128 rows
    drawn on the device spent 0.5 ms in the per-value checks below, which name the value
    at fault and run only when this says no."""
    if not rows:
        return True
    pairs = set(map(type, counters)) == {tuple} and set(map(len, counters)) == {2}
    if not pairs or set(map(type, params)) != {SamplingParams}:
        return False
    flat = [c for counter in counters for c in counter]
    return (set(map(type, rows)) == {int} and set(map(type, flat)) == {int}
            and 0 <= min(rows) and max(rows) < available
            and 0 <= min(flat) and max(flat) <= U64_MAX)


def sample_logits(logits: np.ndarray, rows: Sequence[int], params: Sequence[SamplingParams],
                  counters: Sequence[tuple[int, int]]) -> np.ndarray:
    """The tokens (int32) the reference picks from host logits [rows, vocab] (cpu path)."""
    words = pack(rows, params, counters, logits.shape[-1])
    out = np.empty(len(rows), dtype=np.int32)
    for b, w in enumerate(words):
        p = params[b]
        seed = int(w[4]) | int(w[5]) << 32
        out[b] = sample_row(logits[rows[b]], p.temperature, int(w[2]), p.top_p, seed,
                            counters[b][0], counters[b][1])
    return out


def sample(session: Any, buffer: str, rows: Sequence[int], params: Sequence[SamplingParams],
           counters: Sequence[tuple[int, int]]) -> np.ndarray:
    """`Session.sample`: one token (int32) per listed row of f32 buffer `buffer` [rows, vocab],
    shaped at the last run's vars."""
    buf = session._buffer(buffer)
    dims = buf.dims_at(session.last_vars)
    if buf.dtype != "f32" or len(dims) != 2:
        raise KernccError.single(f"sample: buffer `{buffer}` is {buf.dtype} of {len(dims)} "
                                 "dims; sampling reads f32 logits [rows, vocab]")
    rows, params = _listed(rows, "rows"), _listed(params, "params")
    counters = _listed(counters, "counters")
    check_request(rows, params, counters, dims[0], buffer)
    if not rows:
        return np.zeros(0, dtype=np.int32)
    if session.backend.name != "cuda":
        return sample_logits(session.read(buffer), rows, params, counters)
    sampler = getattr(session, "_sampler", None)
    if sampler is None:
        sampler = session._sampler = CudaSampler(session.backend)
    return sampler.run(session.memory.buffer(buffer), dims, pack(rows, params, counters,
                                                                 dims[1]))


def sample_into(session: Any, buffer: str, output: str, params: Sequence[Any],
                counters: Sequence[tuple[int, int]]) -> processing.Heard | None:
    """`Session.sample_into`: row i of f32 logits `buffer` [rows, vocab] (at the last run's
    vars) drawn with params[i] and counters[i] into entry i of i32 buffer `output`, for every
    i < len(params), on the device after everything issued so far; nothing comes back. A
    greedy row (temperature 0) gets the first argmax, as the manifest's `argmax_f32` writes
    it. A backend with a `sample_into` of its own draws its own way (the simulated device of
    bench/simulated.py: a launch that computes nothing).

    A `processing.Processed` row is processed first (penalties, bias, masks, its logprobs:
    kerncc.runtime.processing), then drawn with its own params from the processed row; the
    draw's pending results are returned (None when no row is processed: the plain path)."""
    buf, out = session._buffer(buffer), session._buffer(output)
    dims = buf.dims_at(session.last_vars)
    params, counters = _listed(params, "params"), _listed(counters, "counters")
    if buf.dtype != "f32" or len(dims) != 2:
        raise KernccError.single(f"sample: buffer `{buffer}` is {buf.dtype} of {len(dims)} "
                                 "dims; sampling reads f32 logits [rows, vocab]")
    if out.dtype != "i32" or out.nbytes(session.last_vars) < 4 * len(params):
        raise KernccError.single(f"sample: buffer `{output}` ({out.dtype}) cannot hold "
                                 f"{len(params)} i32 tokens")
    rows = list(range(len(params)))
    check_request(rows, params, counters, dims[0], buffer)
    if not rows:
        return None
    if any(isinstance(p, processing.Processed) for p in params):
        return _processed_into(session, buffer, output, params, counters, dims)
    own = getattr(session.backend, "sample_into", None)
    if own is not None:
        own(session, buffer, output, params, counters)
        return None
    _draw_into(session, buffer, output, params, counters, dims, None)
    return None


def _draw_into(session: Any, buffer: str, output: str, params: Sequence[SamplingParams],
               counters: Sequence[tuple[int, int]], dims: Sequence[int],
               logits: np.ndarray | None) -> np.ndarray | None:
    """Rows 0..n-1 drawn into i32 buffer `output`: off cuda on the host from `logits` (None:
    the buffer's, read), the tokens returned; on cuda by the cubin (None returned)."""
    rows = list(range(len(params)))
    target = session.memory.buffer(output)
    if session.backend.name != "cuda":
        host = session.read(buffer) if logits is None else logits
        tokens = sample_logits(host, rows, params, counters)
        session.backend.upload(target, 0, tokens.view(np.uint8))
        return tokens
    sampler = getattr(session, "_sampler", None)
    if sampler is None:
        sampler = session._sampler = CudaSampler(session.backend)
    sampler.launch(session.memory.buffer(buffer), dims, pack(rows, params, counters, dims[1]),
                   target.ptr)
    return None


def _processed_into(session: Any, buffer: str, output: str, params: Sequence[Any],
                    counters: Sequence[tuple[int, int]], dims: Sequence[int]
                    ) -> processing.Heard:
    """`sample_into` with processed rows: the session's processor runs around the draw."""
    natives = processing.natives(params)
    own = getattr(session.backend, "sample_into", None)

    def draw(logits: np.ndarray | None) -> np.ndarray | None:
        if own is not None:  # a simulated device draws its own way
            own(session, buffer, output, natives, counters)
            return None
        return _draw_into(session, buffer, output, natives, counters, dims, logits)

    return processing.processor(session, dims[1]).draw(session, buffer, output, params,
                                                       counters, draw)


class CudaSampler:
    """The library's `sample_f32` cubin on one CUDA backend, with its parameter and token
    buffers (grown as batches grow)."""

    def __init__(self, backend: Any) -> None:
        from cuda.bindings import driver as cu

        from kerncc.runtime.backends.cuda import check, library_functions

        self.cu, self.check, self.backend = cu, check, backend
        self.fn = library_functions(backend, MODULE, (ENTRY,))[ENTRY]
        self.capacity = 0
        self.words = self.tokens = None

    def _ensure(self, n: int) -> None:
        if n <= self.capacity:
            return
        self.capacity = max(n, 2 * self.capacity, 8)
        for old in (self.words, self.tokens):  # free waits for the stream: no launch reads it
            if old is not None:
                self.backend.free(old)
        self.words = self.backend.allocate(self.capacity * PARAM_WORDS * 4)
        self.tokens = self.backend.allocate(self.capacity * 4)

    def run(self, logits: Any, dims: Sequence[int], words: np.ndarray) -> np.ndarray:
        """The tokens of the rows `words` pack, brought back to the host."""
        n = words.shape[0]
        self.launch(logits, dims, words, None)
        return self.backend.download(self.tokens, 0, 4 * n).view(np.int32)

    def launch(self, logits: Any, dims: Sequence[int], words: np.ndarray,
               tokens: int | None) -> None:
        """Issue the kernel on the stream: the tokens into device address `tokens` (None:
        this sampler's own buffer). The parameter words are uploaded before the launch; the
        upload is ordered on the stream, so the next launch may reuse the buffer."""
        n = words.shape[0]
        self.backend.activate()
        self._ensure(n)
        self.backend.upload(self.words, 0, words.reshape(-1).view(np.uint8))
        out = self.tokens.ptr if tokens is None else tokens
        slots = [ctypes.c_uint64(logits.ptr), ctypes.c_uint64(self.words.ptr),
                 ctypes.c_uint64(out), ctypes.c_int32(n),
                 ctypes.c_int32(dims[1]), ctypes.c_int32(dims[1])]
        table = (ctypes.c_void_p * len(slots))(*[ctypes.addressof(s) for s in slots])
        self.check(self.cu.cuLaunchKernel(self.fn, n, 1, 1, THREADS, 1, 1, 0,
                                          self.backend.stream_handle, ctypes.addressof(table),
                                          0), "cuLaunchKernel(sample_f32)")
