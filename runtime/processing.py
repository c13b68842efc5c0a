"""Logits processing where the tokens are drawn: penalties, logit_bias, masks and logprobs.

A row that `Session.sample_into` draws (kerncc.runtime.sampling) may be `Processed`: its
logits are processed before the draw by the `logits` module's kernels (kernels/logits.cu; the
cpu backend runs their numpy reference, kernels/logits_ref.py, with the same arguments), and
the small results of the step (the token, its logprob, the top tokens) come back, never the
vocab-wide logits. A `Processor` is one session's: it keeps every processed sequence's state
in a slot of its own buffers (the counts and seen of the generated tokens, its bias row, its
static mask), written once from the host when the sequence first comes (or after the host
counted tokens the device did not see: `Source.version`) and updated on the device from the
drawn tokens (`logits_accept_f32`), so a step ahead needs nothing from the host. Per step
only the rows' parameter words and the grammar masks of the rows that follow a grammar go up.

What a processed row's `source` gives (kerncc.serve.logits.Drawer is one):
* `version`: bumped whenever the host counted a token the device did not;
* `fill_state(counts, seen, bias, allow)`: its slot's rows as of now;
* `device_words(step)`: its LOGIT_WORDS (row and slot are filled here), a sequence this
  module does not write (a source packs it once);
* `masks_steps`: whether it may have a mask of its own per step; then its kind's
  `step_masks(sources, steps, masks) -> rows`: the step masks of several sources of that kind
  into the rows of `masks` (uint32 [len(sources), words]), the rows that have one;
* its kind's `hear_all(sources, results)`: the step's results rows (RESULT_WORDS f32; ints as
  their bits), one a source, all the call's sources of that kind at once, when the call's
  outputs are taken (a grammar follows its token).

A sequence's slot is given back when its source is garbage-collected.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kerncc.kernels import logits_ref as ref
from kerncc.kernels.logits_ref import HAS_STEP_MASK, LOGIT_WORDS, RESULT_WORDS, mask_words
from kerncc.runtime.backends.base import Ready

MODULE = "logits"
THREADS, ACCEPT_THREADS = 1024, 64  # the kernels' blocks (kernels/logits.cu)
HEARD = "logits_processing"  # the key of a draw's results among a Pending's outputs


class Processed:
    """A row drawn with `native` (kerncc.runtime.sampling.SamplingParams; temperature 0 =
    the argmax of the processed row) after `source`'s processing, for its token `step`
    (a plain record, not attrs: a call makes one a sequence)."""

    __slots__ = ("native", "source", "step")

    def __init__(self, native: Any, source: Any, step: int) -> None:
        self.native, self.source, self.step = native, source, step


class Heard:
    """A draw's pending results: on `result()` each source hears its row, once."""

    def __init__(self, download: Any, sources: Sequence[Any]) -> None:
        self.download, self.sources = download, list(sources)
        self._done: np.ndarray | None = None

    def result(self) -> np.ndarray:
        if self._done is None:
            raw = np.asarray(self.download.result())
            self._done = raw.view(np.float32).reshape(len(self.sources), RESULT_WORDS)
            for kind, members in _kinds(self.sources):
                if len(members) == len(self.sources):
                    kind.hear_all(self.sources, self._done)
                else:
                    kind.hear_all([self.sources[i] for i in members], self._done[members])
        return self._done


def _kinds(sources: Sequence[Any]) -> list[tuple[type, list[int]]]:
    """The sources (None: left out) by kind: each kind's indices, in order."""
    kinds: dict[type, list[int]] = {}
    for i, source in enumerate(sources):
        if source is not None:
            kinds.setdefault(type(source), []).append(i)
    return list(kinds.items())


class Processor:
    """One session's processing state and the host half of each draw (see the module
    docstring); a subclass holds the state and runs the kernels where the logits are."""

    def __init__(self, backend: Any, vocab: int) -> None:
        self.backend, self.vocab, self.words_per_mask = backend, vocab, mask_words(vocab)
        self.slots: dict[int, list[int]] = {}  # id(source) -> [slot, version written]
        self.free: list[int] = []
        self.capacity = 0
        self._last_words: tuple[list[Any], np.ndarray] | None = None  # `_words`' last call
        self._mask_rows: np.ndarray | None = None  # the step masks' buffer (`_masks`)

    # ------------------------------------------------------------------------ slots

    def slot(self, source: Any) -> int:
        """`source`'s slot, its rows written from the host if new or stale."""
        key = id(source)
        found = self.slots.get(key)
        if found is not None and found[1] == source.version:
            return found[0]
        if found is None:
            if not self.free:
                self._grow(max(8, 2 * self.capacity))
            found = self.slots[key] = [self.free.pop(), source.version]
            weakref.finalize(source, self._release, key)
        counts = np.zeros(self.vocab, np.int32)
        seen = np.zeros(self.vocab, np.uint8)
        bias = np.zeros(self.vocab, np.float32)
        allow = np.zeros(self.words_per_mask, np.uint32)
        source.fill_state(counts, seen, bias, allow)
        self._write_slot(found[0], counts, seen, bias, allow)
        found[1] = source.version
        return found[0]

    def _release(self, key: int) -> None:
        found = self.slots.pop(key, None)
        if found is not None:
            self.free.append(found[0])

    def _grow(self, capacity: int) -> None:
        self._resize(self.capacity, capacity)
        self.free.extend(range(capacity - 1, self.capacity - 1, -1))
        self.capacity = capacity

    # ------------------------------------------------------------------------ a draw

    def pack(self, params: Sequence[Any]) -> tuple[list[int], np.ndarray, np.ndarray | None,
                                                   list[Any]]:
        """The processed rows of a call: their indices, words, step masks (None: no row has
        one) and sources. Each source's words are packed once (`device_words`); per step
        only the rows, slots and mask flags are written, and the masks go into a buffer of
        the processor's, reused (valid until the next `pack`)."""
        rows = [i for i, p in enumerate(params) if isinstance(p, Processed)]
        sources = [params[i].source for i in rows]
        steps = [params[i].step for i in rows]
        words = self._words([s.device_words(t) for s, t in zip(sources, steps)])
        words[:, 0] = rows
        words[:, 5] = [self.slot(s) for s in sources]
        masks = None
        for kind, members in _kinds([s if getattr(s, "masks_steps", False) else None
                                     for s in sources]):
            if masks is None:
                masks = self._masks(len(rows))
            if len(members) == len(rows):
                got = kind.step_masks(sources, steps, masks)
            else:
                part = masks[members]
                got = [members[b] for b in kind.step_masks(
                    [sources[i] for i in members], [steps[i] for i in members], part)]
                masks[members] = part
            words[got, 4] |= HAS_STEP_MASK
        return rows, words, masks, sources

    def _words(self, packed: list[Any]) -> np.ndarray:
        """The rows' words as `device_words` gave them: the last call's array again when
        every source gave the same (a decode step's batch is mostly its last one)."""
        last = self._last_words
        if last is None or last[0] != packed:
            array = np.array(packed, np.uint32).reshape(len(packed), LOGIT_WORDS)
            last = self._last_words = (packed, array)
        return last[1].copy()

    def _masks(self, n: int) -> np.ndarray:
        """The step masks' buffer, [n, words_per_mask], reused from call to call."""
        found = self._mask_rows
        if found is None or found.shape[0] < n:
            found = self._mask_rows = np.zeros((max(n, 8), self.words_per_mask), np.uint32)
        return found[:n]

    def draw(self, session: Any, buffer: str, output: str, params: Sequence[Any],
             counters: Sequence[tuple[int, int]], sample: Callable[..., None]) -> Heard:
        """Process, draw (`sample(natives)` issues the plain draw of every row into
        `output`), accept; the pending results."""
        raise NotImplementedError

    def _resize(self, old: int, new: int) -> None:
        raise NotImplementedError

    def _write_slot(self, slot: int, counts: np.ndarray, seen: np.ndarray, bias: np.ndarray,
                    allow: np.ndarray) -> None:
        raise NotImplementedError


def natives(params: Sequence[Any]) -> list[Any]:
    """Each row's plain sampling params (a processed row's own)."""
    return [p.native if isinstance(p, Processed) else p for p in params]


class HostProcessor(Processor):
    """The reference kernels on host arrays (the cpu backend): the logits are read, processed
    and drawn on the host, and the drawn tokens written to `output`, as the plain cpu draw."""

    def _resize(self, old: int, new: int) -> None:
        def grown(array: np.ndarray | None, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
            out = np.zeros(shape, dtype)
            if array is not None:
                out[:old] = array
            return out

        v, w = self.vocab, self.words_per_mask
        self.counts = grown(getattr(self, "counts", None), (new, v), np.int32)
        self.seen = grown(getattr(self, "seen", None), (new, v), np.uint8)
        self.bias = grown(getattr(self, "bias", None), (new, v), np.float32)
        self.allow = grown(getattr(self, "allow", None), (new, w), np.uint32)

    def _write_slot(self, slot, counts, seen, bias, allow) -> None:
        self.counts[slot], self.seen[slot], self.bias[slot] = counts, seen, bias
        self.allow[slot] = allow

    def draw(self, session, buffer, output, params, counters, sample) -> Heard:
        rows, words, masks, sources = self.pack(params)
        logits = np.array(session.read(buffer), dtype=np.float32)
        results = np.zeros((len(rows), RESULT_WORDS), np.float32)
        ref.process_logits(logits, words, self.counts, self.seen, self.bias, self.allow, masks)
        ref.logprobs(logits, words, results, self.vocab)
        tokens = sample(logits)
        ref.accept(logits, words, tokens, self.counts, self.seen, results)
        return Heard(Ready(results), sources)


class CudaProcessor(Processor):
    """The `logits` cubin on one CUDA backend: the state in device buffers, the logits
    processed in place in the session's buffer before the draw."""

    def __init__(self, backend: Any, vocab: int) -> None:
        from cuda.bindings import driver as cu

        from kerncc.runtime.backends.cuda import check, library_functions

        super().__init__(backend, vocab)
        self.cu, self.check = cu, check
        self.fns = library_functions(backend, MODULE, ("logits_process_f32",
                                                       "logits_logprobs_f32",
                                                       "logits_accept_f32"))
        self.state: dict[str, Any] = {}
        self.rows_capacity = 0
        self.call: dict[str, Any] = {}

    def _sizes(self) -> dict[str, int]:
        """Bytes a slot of each state buffer takes."""
        return {"counts": 4 * self.vocab, "seen": self.vocab, "bias": 4 * self.vocab,
                "allow": 4 * self.words_per_mask}

    def _resize(self, old: int, new: int) -> None:
        for name, size in self._sizes().items():
            grown = self.backend.allocate(new * size)  # zeroed
            if name in self.state:
                self.backend.copy(self.state[name], 0, grown, 0, old * size)
                self.backend.free(self.state[name])  # waits for the stream
            self.state[name] = grown

    def _write_slot(self, slot, counts, seen, bias, allow) -> None:
        sizes = self._sizes()
        for name, row in (("counts", counts), ("seen", seen), ("bias", bias),
                          ("allow", allow)):
            self.backend.upload(self.state[name], slot * sizes[name], row.view(np.uint8))

    def _ensure_rows(self, n: int) -> None:
        if n <= self.rows_capacity:
            return
        self.rows_capacity = max(n, 2 * self.rows_capacity, 8)
        sizes = {"words": 4 * LOGIT_WORDS, "masks": 4 * self.words_per_mask,
                 "results": 4 * RESULT_WORDS}
        for name, size in sizes.items():
            if name in self.call:
                self.backend.free(self.call[name])
            self.call[name] = self.backend.allocate(self.rows_capacity * size)

    def _launch(self, name: str, grid: int, block: int, args: Sequence[Any]) -> None:
        slots = [ctypes.c_uint64(a) if isinstance(a, _Ptr) else ctypes.c_int32(a)
                 for a in args]
        table = (ctypes.c_void_p * len(slots))(*[ctypes.addressof(s) for s in slots])
        self.check(self.cu.cuLaunchKernel(self.fns[name], grid, 1, 1, block, 1, 1, 0,
                                          self.backend.stream_handle, ctypes.addressof(table),
                                          0), f"cuLaunchKernel({name})")

    def draw(self, session, buffer, output, params, counters, sample) -> Heard:
        rows, words, masks, sources = self.pack(params)
        stride = session.manifest.buffers[buffer].dims_at(session.last_vars)[1]
        download = self.issue(session.memory.buffer(buffer), stride,
                              session.memory.buffer(output), words, masks, lambda: sample(None))
        return Heard(download, sources)

    def issue(self, logits: Any, stride: int, tokens: Any, words: np.ndarray,
              masks: np.ndarray | None, sample: Callable[[], None]) -> Any:
        """The kernels around `sample()` (which draws every row into `tokens`) on the
        logits allocation; the pending download of the results."""
        n, vocab = words.shape[0], self.vocab
        self.backend.activate()
        self._ensure_rows(n)
        self.backend.upload(self.call["words"], 0, words.reshape(-1).view(np.uint8))
        if masks is not None:
            self.backend.upload(self.call["masks"], 0, masks.reshape(-1).view(np.uint8))
        at = {name: _Ptr(a.ptr) for name, a in {**self.state, **self.call}.items()}
        x, out = _Ptr(logits.ptr), _Ptr(tokens.ptr)
        self._launch("logits_process_f32", n, THREADS, [
            x, at["words"], at["counts"], at["seen"], at["bias"], at["allow"], at["masks"], n,
            vocab, stride])
        self._launch("logits_logprobs_f32", n, THREADS, [x, at["words"], at["results"], n,
                                                          vocab, stride])
        sample()
        self._launch("logits_accept_f32", (n + ACCEPT_THREADS - 1) // ACCEPT_THREADS,
                     ACCEPT_THREADS, [x, at["words"], out, at["counts"], at["seen"],
                                      at["results"], n, vocab, stride])
        return self.backend.download_async(self.call["results"], 0, 4 * RESULT_WORDS * n)


class _Ptr(int):
    """A device address among a launch's arguments (an int is an i32 scalar)."""


def processor(session: Any, vocab: int) -> Processor:
    """The session's processor (made on first use): the backend's own where it has one
    (`logits_processor(vocab)`: a simulated device), the cubin on cuda, else the reference."""
    found = getattr(session, "_processor", None)
    if found is not None and found.vocab == vocab:
        return found
    own = getattr(session.backend, "logits_processor", None)
    if own is not None:
        made = own(vocab)
    elif session.backend.name == "cuda":
        made = CudaProcessor(session.backend, vocab)
    else:
        made = HostProcessor(session.backend, vocab)
    session._processor = made
    return made
