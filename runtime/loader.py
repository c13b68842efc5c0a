"""Streamed weight loading: a stage's weights and derive sources from the checkpoint's mapped
shards to the device, read by a few threads while what they read before is being copied.

Every buffer's bind segments are resolved first (`kerncc.runtime.weights.plan_buffer`:
tensors, dtypes, ranges and totals from the shards' headers alone), so a checkpoint that does
not fit the bundle is refused before any byte moves. Each buffer's bytes are then cut into
jobs (a run of rows of one segment, at most `job_bytes`) that a pool of threads fills:
* on a backend whose memory is the host's (cpu, `Backend.host_view`) straight into the
  allocation: the same jobs, threads and checks, without a staging copy;
* on a backend with pinned memory (cuda, `Backend.pinned_buffer`) into `stages` reusable
  pinned staging buffers of `stage_bytes`: each staging buffer's copies go to the device on the
  backend's stream (`upload_async`) as soon as its jobs are filled, while the threads fill the
  next ones, and it is filled again only once the fence recorded behind its copies has passed.
  The host waits for the device only for a staging buffer to reuse and at `close`;
* on any other backend each job is filled into host memory and uploaded.
Each job checks the bytes it copies for NaN and infinity while they are in cache (bit tests on
the dtype's integer view, `has_nonfinite`) unless the load allows them. Every tensor a buffer
reads is checked whole: one that no segment takes whole (a row or column range) is checked by
jobs of its own, once per load. A refusal carries `weights.nonfinite_error`'s words for the
first bad segment in load order, and comes after every thread has stopped.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
import ml_dtypes
import numpy as np

from kerncc.diagnostics import KernccError
from kerncc.runtime.backends.base import Backend, BackendError
from kerncc.runtime.weights import Piece, Tensors, nonfinite_error

JOB_BYTES = 8 << 20  # one thread's share at a time: a tensor or a source spreads over threads
STAGE_BYTES = 128 << 20  # one pinned staging buffer (pinning costs time: 512 MB in all)
STAGES = 4  # staging buffers: three filling while one is copied
THREADS = max(1, min(8, os.cpu_count() or 1))
BLOCK_BYTES = 1 << 20  # copied, then checked while still in cache
ALIGN = 256  # where a job starts in a staging buffer

# dtype -> (integer view, mask, limit): a value is NaN or infinite iff (bits & mask) >= limit
_NONFINITE_BITS: dict[np.dtype, tuple[type, int, int]] = {
    np.dtype(ml_dtypes.bfloat16): (np.uint16, 0x7FFF, 0x7F80),
    np.dtype(np.float16): (np.uint16, 0x7FFF, 0x7C00),
    np.dtype(np.float32): (np.uint32, 0x7FFF_FFFF, 0x7F80_0000),
    np.dtype(np.float64): (np.uint64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
    np.dtype(ml_dtypes.float8_e4m3fn): (np.uint8, 0x7F, 0x7F),  # no infinity; NaN is S1111111
    np.dtype(ml_dtypes.float8_e5m2): (np.uint8, 0x7F, 0x7C),
}


def has_nonfinite(raw: np.ndarray, dtype: np.dtype) -> bool:
    """Whether bytes `raw` (uint8, whole values of `dtype`) hold a NaN or an infinity."""
    if raw.size == 0:
        return False
    dtype = np.dtype(dtype)
    bits = _NONFINITE_BITS.get(dtype.newbyteorder("<"))
    if bits is not None and dtype.byteorder != ">":
        view, mask, limit = bits
        return int(np.bitwise_and(raw.view(view), view(mask)).max()) >= limit
    try:  # other floats (complex, e8m0 scales) through numpy; integers are always finite
        return not bool(np.isfinite(raw.view(dtype)).all())
    except TypeError:
        return False


def _unsigned(dtype: np.dtype) -> np.dtype:
    """The unsigned integer of the dtype's size: copies move bits, never values."""
    return np.dtype(f"u{np.dtype(dtype).itemsize}")


@attrs.frozen(eq=False)
class Target:
    """A buffer to fill: its planned pieces, laid at byte `offset` of `allocation`."""

    name: str
    where: str  # its bind's JSON pointer, for a refusal
    dtype: np.dtype
    allocation: Any
    offset: int
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


@attrs.frozen(eq=False)
class _Job:
    """Units [start, stop) of one piece written at byte `offset` of its target (or, with no
    piece, elements [start, stop) of tensor `source` only checked)."""

    target: Target
    piece: Piece | None
    source: np.ndarray | None
    start: int
    stop: int
    offset: int
    nbytes: int
    check: bool


@attrs.define
class LoadStats:
    """Where a load's seconds went, seen from the thread that drives it."""

    bytes: int = 0
    jobs: int = 0
    fill_s: float = 0.0  # summed over the threads: reading the shards, copying, checking
    read_wait_s: float = 0.0  # waiting for the threads' fills
    copy_wait_s: float = 0.0  # waiting for the device's copies (staging reuse, close)
    wall_s: float = 0.0  # inside `load` and `close`

    def as_dict(self) -> dict[str, float]:
        return attrs.asdict(self)


# ---------------------------------------------------------------------------------------------
# Cutting pieces into jobs


def _units(piece: Piece) -> tuple[int, int]:
    """(units, bytes per unit): elements of a contiguous matrix, rows of a strided one,
    interleave blocks (of both tensors) of an interleaved pair."""
    if piece.pair is not None:
        a = piece.pair[0]
        return a.shape[0] // piece.block, 2 * piece.block * a.shape[1] * a.itemsize
    matrix = piece.whole
    if matrix.flags.c_contiguous:
        return matrix.size, matrix.itemsize
    return matrix.shape[0], matrix.shape[1] * matrix.itemsize


def _spans(units: int, unit_bytes: int, most: int) -> Iterator[tuple[int, int]]:
    step = max(1, most // max(unit_bytes, 1))
    for start in range(0, units, step):
        yield start, min(units, start + step)


def _piece_jobs(target: Target, piece: Piece, check: bool, job_bytes: int) -> list[_Job]:
    units, unit_bytes = _units(piece)
    if unit_bytes == 0:
        return []
    return [_Job(target, piece, None, a, b, piece.offset + a * unit_bytes,
                 (b - a) * unit_bytes, check) for a, b in _spans(units, unit_bytes, job_bytes)]


def _check_jobs(target: Target, piece: Piece, tensors: Tensors, names: list[str],
                job_bytes: int) -> list[_Job]:
    """Jobs checking whole the tensors of `names` that `piece` takes only a range of."""
    jobs = []
    for name in names:
        flat = np.asarray(tensors(name)).reshape(-1)
        for a, b in _spans(flat.size, flat.itemsize, job_bytes):
            jobs.append(_Job(target, piece, flat, a, b, 0, 0, True))
    return jobs


# ---------------------------------------------------------------------------------------------
# Filling one job


def _copy(piece: Piece, start: int, stop: int, out: np.ndarray) -> None:
    """Units [start, stop) of `piece` into `out` (uint8)."""
    raw = _unsigned(piece.pair[0].dtype if piece.pair is not None else piece.whole.dtype)
    if piece.pair is not None:
        a, b = (m.view(raw) for m in piece.pair)
        cols, block = a.shape[1], piece.block
        view = out.view(raw).reshape(stop - start, 2, block, cols)
        view[:, 0] = a[start * block:stop * block].reshape(stop - start, block, cols)
        view[:, 1] = b[start * block:stop * block].reshape(stop - start, block, cols)
        return
    matrix = piece.whole.view(raw)
    if matrix.flags.c_contiguous:
        out.view(raw)[...] = matrix.reshape(-1)[start:stop]
        return
    out.view(raw).reshape(stop - start, matrix.shape[1])[...] = matrix[start:stop]


class _Nonfinite(Exception):
    """A job met a NaN or an infinity (the refusal's words are found after the load stops)."""

    def __init__(self, job: _Job) -> None:
        super().__init__(job.target.name)
        self.job = job


def _fill(job: _Job, out: np.ndarray | None) -> float:
    """Do one job (`out`: where its bytes go); the seconds it took."""
    started = time.perf_counter()
    dtype = job.target.dtype
    if job.source is not None:  # a check alone, of elements of a tensor
        for a, b in _spans(job.stop - job.start, dtype.itemsize, BLOCK_BYTES):
            part = job.source[job.start + a:job.start + b]
            if has_nonfinite(part.view(np.uint8), dtype):
                raise _Nonfinite(job)
        return time.perf_counter() - started
    _, unit_bytes = _units(job.piece)
    for a, b in _spans(job.stop - job.start, unit_bytes, BLOCK_BYTES):
        part = out[a * unit_bytes:b * unit_bytes]
        _copy(job.piece, job.start + a, job.start + b, part)
        if job.check and has_nonfinite(part, dtype):
            raise _Nonfinite(job)
    return time.perf_counter() - started


# ---------------------------------------------------------------------------------------------
# The loader


class Loader:
    """Streams planned targets to a backend (see the module docstring); `close` waits for
    every copy and gives the staging back. Use it as a context manager."""

    def __init__(self, backend: Backend, tensors: Tensors, finite: bool = True,
                 threads: int | None = None, job_bytes: int | None = None,
                 stage_bytes: int | None = None, stages: int | None = None) -> None:
        """The sizes default to the module's constants as they are at this call."""
        self.backend, self.tensors, self.finite = backend, tensors, finite
        self.job_bytes = max(1, job_bytes or JOB_BYTES)
        self.stage_bytes = max(1, stage_bytes or STAGE_BYTES)
        threads, stages = threads or THREADS, stages or STAGES
        self.stats = LoadStats()
        self._checked: set[str] = set()  # tensors whose every byte a job checks
        self._threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="kerncc-load")
        self._stages: list[np.ndarray] = []
        self._fences: list[Any] = []
        self._next = 0
        self._wanted = max(1, stages)
        self._unstaged = False  # the backend had no pinned memory to give
        self._closed = False

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- planning

    def jobs(self, targets: Sequence[Target]) -> list[_Job]:
        """Every job of `targets` in order, the checks placed where the old path made them."""
        jobs: list[_Job] = []
        for target in targets:
            for piece in target.pieces:
                fresh = [n for n in piece.names if n not in self._checked]
                check = self.finite and piece.entire and bool(fresh)
                jobs += _piece_jobs(target, piece, check, self.job_bytes)
                if self.finite and fresh and not piece.entire:
                    jobs += _check_jobs(target, piece, self.tensors, fresh, self.job_bytes)
                if self.finite:
                    self._checked.update(fresh)
        return jobs

    # ---------------------------------------------------------------- loading

    def load(self, targets: Sequence[Target],
             progress: Callable[[int], None] | None = None) -> None:
        """Fill every target; on a staged backend the last copies may still be in flight
        (stream-ordered: launches issued after this read the weights)."""
        if self._closed:
            raise RuntimeError("the loader is closed")
        started = time.perf_counter()
        try:
            jobs = self.jobs(targets)
            if not jobs:
                return
            if self.backend.host_view(targets[0].allocation, 0, 0) is not None:
                self._load_in_place(jobs, progress)
            elif self._staging_ready(jobs):
                self._load_staged(jobs, progress)
            else:
                self._load_uploading(jobs, progress)
        finally:
            self.stats.wall_s += time.perf_counter() - started

    def _wait(self, job: _Job, future: Future, pending: Sequence[Future]) -> None:
        """The job's fill done; on a failure every other fill is stopped first."""
        waited = time.perf_counter()
        try:
            self.stats.fill_s += future.result()
        except BaseException as err:
            for other in pending:
                other.cancel()
            for other in pending:
                if not other.cancelled():
                    other.exception()  # a running fill writes into memory about to go
            raise self._refusal(err) from None
        finally:
            self.stats.read_wait_s += time.perf_counter() - waited
        self.stats.jobs += 1
        self.stats.bytes += job.nbytes

    def _refusal(self, err: BaseException) -> BaseException:
        if not isinstance(err, _Nonfinite):
            return err
        job = err.job
        found = nonfinite_error(job.target.pieces, self.tensors, job.target.where)
        if found is not None:
            return found
        return KernccError.single(f"buffer `{job.target.name}`: a tensor of segment "
                                  f"{job.piece.segment} holds a NaN or an infinity")

    def _load_in_place(self, jobs: list[_Job], progress: Callable[[int], None] | None) -> None:
        def out(job: _Job) -> np.ndarray:
            return self.backend.host_view(job.target.allocation, job.target.offset + job.offset,
                                          job.nbytes)

        futures = [self._pool.submit(_fill, job, out(job)) for job in jobs]
        for job, future in zip(jobs, futures):
            self._wait(job, future, futures)
            if progress is not None:
                progress(job.nbytes)

    def _load_uploading(self, jobs: list[_Job], progress: Callable[[int], None] | None) -> None:
        """A backend without pinned memory: each job filled on the host, then uploaded, a
        few jobs ahead (never the whole model on the host)."""
        ahead: deque[tuple[_Job, np.ndarray, Future]] = deque()
        window = 2 * self._threads
        for job in [*jobs, None]:
            if job is not None:
                out = np.empty(job.nbytes, np.uint8)
                ahead.append((job, out, self._pool.submit(_fill, job, out)))
            while ahead and (job is None or len(ahead) > window):
                done, out, future = ahead.popleft()
                self._wait(done, future, [f for _, _, f in ahead])
                if done.nbytes:
                    self.backend.upload(done.target.allocation,
                                        done.target.offset + done.offset, out)
                if progress is not None:
                    progress(done.nbytes)

    # ---------------------------------------------------------------- staged

    def _staging_ready(self, jobs: list[_Job]) -> bool:
        """Pinned staging buffers, made at the first load that needs them; False when the
        backend has none."""
        if self._stages or self._unstaged:
            return bool(self._stages)
        try:
            for _ in range(self._wanted):
                buffer = self.backend.pinned_buffer(self.stage_bytes)
                if buffer is None:
                    break
                self._stages.append(buffer)
        except BackendError:  # no page-locked memory to be had: slower, not refused
            pass
        if len(self._stages) < self._wanted:
            stages, self._stages = self._stages, []
            for buffer in stages:
                self.backend.free_pinned(buffer)
            self._unstaged = True  # not asked again at every derive source
            return False
        self._fences = [None] * len(self._stages)
        return True

    def _chunks(self, jobs: list[_Job]) -> Iterator[list[tuple[_Job, int]]]:
        """Jobs packed into staging buffers: [(job, byte position)], in order."""
        chunk: list[tuple[_Job, int]] = []
        used = 0
        capacity = len(self._stages[0])
        for job in jobs:
            if chunk and (used + job.nbytes > capacity or job.nbytes > capacity):
                yield chunk
                chunk, used = [], 0
            chunk.append((job, used))
            used += -(-job.nbytes // ALIGN) * ALIGN
        if chunk:
            yield chunk

    def _take_stage(self) -> int:
        """The next staging buffer, once its last copies have passed."""
        k = self._next
        self._next = (k + 1) % len(self._stages)
        fence, self._fences[k] = self._fences[k], None
        if fence is not None:
            waited = time.perf_counter()
            fence.sync()
            self.stats.copy_wait_s += time.perf_counter() - waited
        return k

    def _load_staged(self, jobs: list[_Job], progress: Callable[[int], None] | None) -> None:
        filling: deque[tuple[int, list[tuple[_Job, int, Future]]]] = deque()
        try:
            for chunk in self._chunks(jobs):
                if chunk[0][0].nbytes > len(self._stages[0]):  # one unit past a staging buffer
                    while filling:
                        self._issue(*filling.popleft(), filling, progress)
                    self._load_uploading([chunk[0][0]], progress)
                    continue
                k = self._take_stage()
                stage = self._stages[k]
                filling.append((k, [(job, at, self._pool.submit(_fill, job,
                                                                 stage[at:at + job.nbytes]))
                                    for job, at in chunk]))
                if len(filling) == len(self._stages):
                    self._issue(*filling.popleft(), filling, progress)
            while filling:
                self._issue(*filling.popleft(), filling, progress)
        except BaseException:
            for _, entries in filling:  # nothing may still write into a staging buffer
                for _, _, future in entries:
                    future.cancel()
                for _, _, future in entries:
                    if not future.cancelled():
                        future.exception()
            raise

    def _issue(self, k: int, entries: list[tuple[_Job, int, Future]], later: deque,
               progress: Callable[[int], None] | None) -> None:
        """Copy staging buffer k's jobs to the device as each is filled; fence it."""
        stage = self._stages[k]
        pending = [f for _, _, f in entries] + [f for _, es in later for _, _, f in es]
        try:
            for job, at, future in entries:
                self._wait(job, future, pending)
                if job.nbytes:
                    self.backend.upload_async(job.target.allocation,
                                              job.target.offset + job.offset,
                                              stage[at:at + job.nbytes])
                if progress is not None:
                    progress(job.nbytes)
        finally:
            self._fences[k] = self.backend.fence()  # behind whatever copies were issued

    # ---------------------------------------------------------------- closing

    def close(self) -> None:
        """Wait for every copy issued, give the staging buffers back, stop the threads."""
        if self._closed:
            return
        self._closed = True
        started = time.perf_counter()
        try:
            for k, fence in enumerate(self._fences):
                if fence is not None:
                    fence.sync()
                    self._fences[k] = None
            self.stats.copy_wait_s += time.perf_counter() - started
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
            stages, self._stages = self._stages, []
            for buffer in stages:
                self.backend.free_pinned(buffer)
            self.stats.wall_s += time.perf_counter() - started
