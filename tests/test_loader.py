"""Streamed weight loading (runtime/loader.py) against the path it replaced.

The old path assembled each buffer on the host (`assemble_buffer`, every tensor it takes checked
finite) and uploaded it; a stage loaded by the loader must hold the same bytes, bf16 weights,
an FP8 checkpoint's e4m3 weights and FP8 quantized at load (derive) alike, on the cpu backend
(filled in place) and on a staged backend whose copies land only at a fence (the adversary of
a staging buffer reused too early). A checkpoint that does not fit (a truncated shard, a bad
header) is refused naming the file before any weight byte moves; a NaN is refused in the old
words. The bit tests that find NaN and infinity agree with numpy on every pattern.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kerncc.checkpoint.safetensors import load_file, save_file
from kerncc.cli.main import main as kerncc
from kerncc.diagnostics import KernccError
from kerncc.hf.importer import import_model
from kerncc.runtime import Chain
from kerncc.runtime import loader as loading
from kerncc.runtime.backends.base import BackendError, Geometry
from kerncc.runtime.backends.cpu import CpuBackend
from kerncc.runtime.memory import numpy_dtype
from kerncc.runtime.session import Session
from kerncc.runtime import weights
from kerncc.runtime.weights import plan_buffer

from hf.fp8_models import write_fp8
from hf.models import write_model
from test_weights import Interleave, Ranked, Segment
from weights_oracle import assemble_buffer

LIMITS = {"max_tokens": 32, "max_seqs": 2, "max_context": 128}
# q, k and v rows whole 128-row scale blocks (an FP8 checkpoint's layout needs them)
SIZES = {"hidden": 128, "heads": 2, "kv_heads": 1, "head_dim": 128, "intermediate": 256,
         "vocab": 200, "layers": 2}


# ---------------------------------------------------------------------------------------------
# Bundles: a small Qwen3 as bf16, as an FP8 checkpoint, and quantized to FP8 at load


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loader")
    folder = write_model(root / "hf", "qwen3", seed=3, **SIZES)
    fp8 = write_fp8(folder, root / "hf-fp8")
    out = {}
    for name, source, quantize in (("bf16", folder, None), ("fp8", fp8, None),
                                   ("quantized", folder, "fp8")):
        done = import_model(source, source / f"{name}.json", quantize=quantize, **LIMITS)
        out[name] = root / f"bundle-{name}"
        assert kerncc(["lower", str(done.path), "-p", "emit", "-o", str(out[name])]) == 0
    return out


def resident(chain: Chain) -> dict[str, bytes]:
    """Every weight and carry of every stage after load, as bytes."""
    out = {}
    for k, session in enumerate(chain.sessions):
        for name, buf in session.manifest.buffers.items():
            if buf.kind in ("weight", "carry") and name in session.memory.buffers:
                out[f"{k}/{name}"] = session.read(name).tobytes()
    return out


def old_stream(self: Session, targets, update=None) -> None:
    """The path the loader replaced: each buffer assembled on the host, then uploaded."""
    tensors = self._require_checkpoint()
    for target in targets:
        buf = self.manifest.buffers[target.name]
        try:
            data = assemble_buffer(buf.bind, tensors, numpy_dtype(buf.dtype), target.nbytes,
                                   where=target.where, finite=not self.allow_nonfinite)
        except KernccError as err:
            headline = f"{err.headline} (checkpoint: {self._checkpoint_name})"
            raise self.stage.located(KernccError(headline, err.diagnostics)) from None
        self.backend.sync()
        self.backend.upload(target.allocation, target.offset, data)


@pytest.fixture(scope="module")
def old(bundles) -> dict[str, dict[str, bytes]]:
    patch = pytest.MonkeyPatch()
    patch.setattr(Session, "_stream", old_stream)
    try:
        return {name: resident(Chain(path)) for name, path in bundles.items()}
    finally:
        patch.undo()


class LateCopies(CpuBackend):
    """A backend with pinned staging whose host-to-device copies land as late as a real DMA
    may: when a fence after them is waited for, or before anything else touches memory."""

    def __init__(self) -> None:
        self.queued: list[tuple[np.ndarray, int, np.ndarray]] = []
        self.pinned: list[np.ndarray] = []
        self.freed = 0

    def host_view(self, allocation, offset, nbytes):
        return None

    def pinned_buffer(self, nbytes):
        buffer = np.full(nbytes, 0xA5, np.uint8)
        self.pinned.append(buffer)
        return buffer

    def free_pinned(self, buffer):
        assert not self.queued, "a staging buffer given back before its copies landed"
        self.freed += 1

    def upload_async(self, allocation, offset, data):
        self.queued.append((allocation, offset, data))  # the bytes are read when it lands

    def land(self) -> None:
        queued, self.queued = self.queued, []
        for allocation, offset, data in queued:
            allocation[offset:offset + data.size] = data

    def fence(self):
        backend = self

        class Fence:
            def __init__(self) -> None:
                self.upto = len(backend.queued)

            def sync(self) -> None:
                backend.land()

        return Fence()

    def sync(self):
        self.land()

    def upload(self, allocation, offset, data):
        self.land()
        super().upload(allocation, offset, data)

    def download(self, allocation, offset, nbytes):
        self.land()
        return super().download(allocation, offset, nbytes)

    def launch_kernel(self, geometry: Geometry, args) -> None:
        self.land()
        super().launch_kernel(geometry, args)

    def launch_extern(self, name, args) -> None:
        self.land()
        super().launch_extern(name, args)


@pytest.mark.parametrize("kind", ["bf16", "fp8", "quantized"])
def test_the_cpu_backend_loads_the_bytes_the_old_path_did(bundles, old, kind):
    assert resident(Chain(bundles[kind])) == old[kind]


@pytest.mark.parametrize("kind", ["bf16", "fp8", "quantized"])
def test_a_staged_load_with_late_copies_loads_the_same_bytes(bundles, old, kind, monkeypatch):
    # staging buffers far smaller than the model, jobs smaller still: every buffer is reused
    monkeypatch.setattr(loading, "STAGE_BYTES", 8 << 10)
    monkeypatch.setattr(loading, "JOB_BYTES", 3000)
    monkeypatch.setattr(loading, "STAGES", 3)
    backend = LateCopies()
    chain = Chain(bundles[kind], backend=backend)
    assert resident(chain) == old[kind]
    assert len(backend.pinned) == 3 * len(chain.sessions) and backend.freed == len(backend.pinned)
    times = chain.sessions[0].load_times
    assert times["load_bytes"] > 0 and times["load_jobs"] > 3 and "weights" in times


def test_a_load_without_threads_or_pinned_memory_loads_the_same_bytes(bundles, old,
                                                                       monkeypatch):
    class Plain(CpuBackend):  # neither host views nor pinned memory: fill, then upload
        def host_view(self, allocation, offset, nbytes):
            return None

    monkeypatch.setattr(loading, "JOB_BYTES", 1000)
    monkeypatch.setattr(loading, "THREADS", 1)
    assert resident(Chain(bundles["quantized"], backend=Plain())) == old["quantized"]


def test_a_backend_out_of_pinned_memory_loads_without_staging(bundles, old, monkeypatch):
    class Short(LateCopies):  # the second staging buffer cannot be pinned
        def pinned_buffer(self, nbytes):
            if self.pinned:
                raise BackendError("cuMemAllocHost failed: out of memory")
            return super().pinned_buffer(nbytes)

        def upload_async(self, allocation, offset, data):
            raise AssertionError("no staged copy without every staging buffer")

    backend = Short()
    assert resident(Chain(bundles["bf16"], backend=backend)) == old["bf16"]
    assert backend.freed == len(backend.pinned) == 1


# ---------------------------------------------------------------------------------------------
# Refusals: before anything moves, in the old words


class Counting(CpuBackend):
    def __init__(self) -> None:
        self.writes = 0

    def host_view(self, allocation, offset, nbytes):
        self.writes += nbytes > 0
        return super().host_view(allocation, offset, nbytes)

    def upload(self, allocation, offset, data):
        self.writes += 1
        super().upload(allocation, offset, data)


def shard(bundle: Path, target: Path) -> list[Path]:
    """The bundle's checkpoint as two shards and an index in `target`."""
    tensors = load_file(bundle.parent / "hf" / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    target.mkdir()
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, target / file)
        weight_map.update({n: file for n in part})
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return [target / file for file in halves]


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_a_damaged_shard_is_refused_naming_it_before_any_weight_moves(bundles, tmp_path,
                                                                      damage):
    shards = shard(bundles["bf16"], tmp_path / "ck")
    assert resident(Chain(bundles["bf16"], checkpoint=tmp_path / "ck" /
                          "model.safetensors.index.json"))  # whole, it loads
    bad = shards[1]
    data = bad.read_bytes()
    bad.write_bytes(data[:-100] if damage == "truncated" else data[:8] + b"[" + data[9:])
    backend = Counting()
    with pytest.raises(KernccError) as info:
        Chain(bundles["bf16"], backend=backend,
              checkpoint=tmp_path / "ck" / "model.safetensors.index.json")
    assert str(bad) in str(info.value)
    assert "bad safetensors file" in str(info.value)
    assert backend.writes == 0


def test_a_tensor_of_the_wrong_size_is_refused_before_any_weight_moves(bundles, tmp_path):
    tensors = load_file(bundles["bf16"].parent / "hf" / "model.safetensors")
    name = "lm_head.weight"  # bound by `lm_head.w`, the buffer loaded last
    tensors[name] = tensors[name][:-1].copy()
    save_file(tensors, tmp_path / "model.safetensors")
    backend = Counting()
    with pytest.raises(KernccError) as info:
        Chain(bundles["bf16"], backend=backend, checkpoint=tmp_path / "model.safetensors")
    assert "cannot assemble buffer `lm_head.w`" in str(info.value)
    assert backend.writes == 0


@pytest.mark.parametrize("value, words", [(np.nan, "holds nan at"), (np.inf, "holds inf at")])
def test_a_nonfinite_weight_is_refused_in_the_old_words(bundles, tmp_path, value, words,
                                                        monkeypatch):
    tensors = load_file(bundles["bf16"].parent / "hf" / "model.safetensors")
    name = sorted(tensors)[len(tensors) // 2]
    tensors[name].reshape(-1)[5] = value
    save_file(tensors, tmp_path / "model.safetensors")
    checkpoint = tmp_path / "model.safetensors"
    monkeypatch.setattr(loading, "JOB_BYTES", 512)  # found by one job of many
    with pytest.raises(KernccError) as new:
        Chain(bundles["bf16"], checkpoint=checkpoint)
    monkeypatch.setattr(Session, "_stream", old_stream)
    with pytest.raises(KernccError) as was:
        Chain(bundles["bf16"], checkpoint=checkpoint)
    assert f"tensor `{name}` {words}" in str(new.value)
    assert str(new.value) == str(was.value)


# ---------------------------------------------------------------------------------------------
# The loader alone: segments of every kind, and the bit tests


def plain_load(segments, tensors, dtype, nbytes, rank=0, **sizes) -> np.ndarray:
    backend = CpuBackend()
    out = backend.allocate(nbytes + 16)
    pieces = plan_buffer(segments, tensors.__getitem__, dtype, nbytes, rank, "/buffers/w/bind")
    target = loading.Target("w", "/buffers/w/bind", np.dtype(dtype), out, 8, tuple(pieces))
    with loading.Loader(backend, tensors.__getitem__, **sizes) as loader:
        loader.load([target])
    assert not out[:8].any() and not out[-8:].any()  # nothing written outside the buffer
    return out[8:-8]


@pytest.mark.parametrize("job_bytes", [1, 7, 64, 1 << 20])
def test_every_kind_of_segment_loads_as_assemble_buffer_lays_it(job_bytes):
    rng = np.random.default_rng(3)
    tensors = {n: rng.standard_normal(shape).astype(np.float32)
               for n, shape in (("a", (6, 4)), ("b", (6, 4)), ("c", (5, 3, 2)), ("d", ()))}
    segments = [Segment("a", cols=(1, 3)), Segment("c", rows=(1, 4)),
                Segment("a", interleave=Interleave("b", 2)), Segment("d"),
                Segment(Ranked("tp", ("c", "a")), rows=Ranked("tp", ((0, 5), (2, 6))))]
    for rank in (0, 1):
        pieces, problems = weights._plan(segments, tensors.__getitem__, np.dtype(np.float32),
                                         rank, "")
        assert not problems
        nbytes = sum(p.nbytes for p in pieces)
        want = assemble_buffer(segments, tensors.__getitem__, np.float32, nbytes, rank=rank)
        got = plain_load(segments, tensors, np.float32, nbytes, rank, job_bytes=job_bytes,
                         threads=3)
        assert got.tobytes() == want.tobytes()


def test_a_nan_outside_the_rows_taken_is_refused_as_before():
    tensors = {"a": np.arange(24, dtype=np.float32).reshape(6, 4)}
    tensors["a"][5, 1] = np.nan  # rows 0-2 are loaded; the old path checked the tensor whole
    segments = [Segment("a", rows=(0, 3))]
    with pytest.raises(KernccError) as was:
        assemble_buffer(segments, tensors.__getitem__, np.float32, 48, where="/buffers/w/bind")
    with pytest.raises(KernccError) as new:
        plain_load(segments, tensors, np.float32, 48, job_bytes=8)
    assert "holds nan at [5, 1]" in str(new.value) and str(new.value) == str(was.value)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, ml_dtypes.float8_e4m3fn,
                                   ml_dtypes.float8_e5m2])
def test_the_bit_test_agrees_with_numpy_on_every_pattern(dtype):
    dtype = np.dtype(dtype)
    bits = np.arange(1 << (8 * dtype.itemsize), dtype=f"u{dtype.itemsize}")
    finite = np.isfinite(bits.view(dtype).astype(np.float32))
    assert not finite.all() and finite.any()
    for value, ok in zip(bits, finite):
        raw = np.array([value]).view(np.uint8)
        assert loading.has_nonfinite(raw, dtype) == (not ok), (dtype, hex(int(value)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_bit_test_finds_every_nan_and_infinity_of_wide_floats(dtype):
    rng = np.random.default_rng(1)
    values = rng.standard_normal(4096).astype(dtype)
    assert not loading.has_nonfinite(values.view(np.uint8), dtype)
    extremes = [np.finfo(dtype).max, -np.finfo(dtype).max, np.finfo(dtype).tiny]
    assert not loading.has_nonfinite(np.array(extremes, dtype).view(np.uint8), dtype)
    for bad in (np.nan, -np.nan, np.inf, -np.inf):
        poisoned = values.copy()
        poisoned[rng.integers(4096)] = bad
        assert loading.has_nonfinite(poisoned.view(np.uint8), dtype)
    payload = np.array([0x7FC00001 if dtype == np.float32 else 0x7FF0000000000001],
                       f"u{np.dtype(dtype).itemsize}")  # a NaN with a payload
    assert loading.has_nonfinite(payload.view(np.uint8), dtype)
