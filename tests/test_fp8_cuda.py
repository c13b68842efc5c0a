"""kernels/fp8.cu on the GPU against its numpy references, and an FP8 model end to end
(marked `gpu`: skipped without a CUDA driver).

Quantize and dequantize compute each value alone with the references' roundings (f32 division,
e4m3 round to nearest even with saturation; one bf16 rounding), so they must give the
references' bits. The GEMVs (`gemv_fp8_bf16` and its tensor-core form `gemv_fp8_bf16_tc`) sum the same f32
products in other fixed orders: within f32 rounding of the reference, plus one bf16 rounding
in the bf16 modes. The tensor-core form is also checked at
the 8B model's shapes and at odd ones, on raw e4m3 bytes (every finite code, subnormals
included) with scales that differ block by block, for the same bits on every grid and launch,
and for a row of C whose bits do not depend on m or on its place in the batch. An
FP8-quantized model gives the cpu backend's greedy tokens on cuda, with either FP8 GEMV.
"""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

from gpu_driver import Gpu  # noqa: E402  (tests/ is on the path)
from kerncc.kernels.reference import KERNELS, fp8_quantize

pytestmark = pytest.mark.gpu
BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


@pytest.fixture(scope="module")
def gpu():
    g = Gpu()
    yield g
    g.close()


def weight(n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)) * np.exp(rng.uniform(-4, 4, (n, 1)))
    w[:, :3] = 0  # exact zeros, and (below) a block of them
    return w.astype(np.float32).astype(BF16)


def i32(v: int) -> ctypes.c_int32:
    return ctypes.c_int32(v)


@pytest.mark.parametrize("n, k", [(256, 256), (300, 4112), (12288, 4096)])
def test_quantize_gives_the_reference_bits(gpu, n, k):
    w = weight(n, k, n)
    w[:128, -128:] = 0
    bn, bk = -(-n // 128), -(-k // 128)
    dq, ds = gpu.upload(np.zeros((n, k), np.uint8)), gpu.upload(np.zeros((bn, bk), np.float32))
    gpu.launch("fp8", "fp8_quantize_bf16", (bk, bn), 256, [gpu.upload(w), dq, ds, i32(n), i32(k)])
    q, s = fp8_quantize(w)
    assert np.array_equal(gpu.download(dq, np.zeros((n, k), np.uint8)), q.view(np.uint8))
    assert np.array_equal(gpu.download(ds, np.zeros((bn, bk), np.float32)), s)


@pytest.mark.parametrize("grid", [1, 97, 4096])
def test_dequantize_gives_the_reference_bits_on_any_grid(gpu, grid):
    n, k = 300, 4112
    q, s = fp8_quantize(weight(n, k, 1))
    out = gpu.upload(np.zeros((n, k), BF16))
    gpu.launch("fp8", "fp8_dequantize_bf16", grid, 256,
               [gpu.upload(q), gpu.upload(s), out, i32(n), i32(k)])
    want = np.zeros((n, k), BF16)
    KERNELS["fp8_dequantize_bf16"](None, q.view(np.uint8).reshape(-1), s.view(np.uint8).reshape(-1),
                                   want.view(np.uint8).reshape(-1), n, k)
    assert np.array_equal(gpu.download(out, want).view(np.uint16), want.view(np.uint16))


def test_bf16_scales_widen_to_the_reference_bits(gpu):
    x = (np.random.default_rng(5).standard_normal(5000) * 1e-3).astype(np.float32).astype(BF16)
    out = gpu.upload(np.zeros(5000, np.float32))
    gpu.launch("fp8", "cast_bf16_f32", 7, 256, [gpu.upload(x), out, i32(5000)])
    assert np.array_equal(gpu.download(out, np.zeros(5000, np.float32)), x.astype(np.float32))


GEMVS = ("gemv_fp8_bf16", "gemv_fp8_bf16_tc")
TC_THREADS = {"gemv_fp8_bf16_tc": 256}


def gemv_launch(gpu, entry: str, m: int, n: int, args: list, grid: int | None = None) -> None:
    """One launch of an FP8 GEMV on its own geometry (the old kernel: a warp per row of W; the
    tensor-core ones: a block per 16-row tile and 8 rows of A, unless `grid` says otherwise)."""
    if entry == "gemv_fp8_bf16":
        gpu.launch("fp8", entry, -(-n // 8), 256, args)
        return
    blocks = grid if grid is not None else max(1, -(-n // 16) * -(-m // 8))
    gpu.launch("fp8", entry, blocks, TC_THREADS[entry], args)


@pytest.mark.parametrize("entry", GEMVS)
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("m, n, k", [(1, 4096, 4096), (3, 1024, 4112), (8, 384, 12288),
                                     (33, 136, 512)])
def test_gemv_matches_the_reference(gpu, entry, mode, m, n, k):
    q, s = fp8_quantize(weight(n, k, 2))
    rng = np.random.default_rng(3)
    a = rng.standard_normal((m, k)).astype(np.float32).astype(BF16)
    c0 = rng.standard_normal((m, n)).astype(np.float32)
    c0 = c0 if mode == 2 else c0.astype(BF16)
    dc = gpu.upload(c0)
    gemv_launch(gpu, entry, m, n, [gpu.upload(a), gpu.upload(q), gpu.upload(s), dc, i32(m),
                                   i32(n), i32(k), i32(mode)])
    got = gpu.download(dc, c0).astype(np.float32)
    want = c0.copy()
    KERNELS["gemv_fp8_bf16"](None, a.view(np.uint8).reshape(-1), q.view(np.uint8).reshape(-1),
                             s.view(np.uint8).reshape(-1), want.view(np.uint8).reshape(-1),
                             m, n, k, mode)
    want = want.astype(np.float32)
    scale = np.abs(want).max()
    # f32 sums in two orders (k products of magnitude <= scale), then at most one bf16 ulp
    bound = scale * (k * 2.0 ** -22 + (2.0 ** -8 if mode != 2 else 0))
    assert np.abs(got - want).max() <= bound
    assert np.isfinite(got).all() and scale > 0


def raw_fp8(n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random e4m3 bytes (every finite code, subnormals and both zeros included) and f32 block
    scales spread over 2^-6 .. 2^6, so a chunk scaled by its neighbour's block shows."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 256, (n, k), dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x38  # no NaN codes: 1.0 instead
    bn, bk = -(-n // 128), -(-k // 128)
    s = np.exp2(rng.uniform(-6, 6, (bn, bk))).astype(np.float32)
    return q, s


def activations(m: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)) * np.exp(rng.uniform(-2, 2, (m, 1)))
    a[a == 0] = 1.0
    return a.astype(np.float32).astype(BF16)


def run_tc(gpu, entry, a, q, s, c0, mode, grid=None) -> np.ndarray:
    """C after one launch of `entry`, checked to leave the 64 bytes past C untouched."""
    m, k = a.shape
    n = q.shape[0]
    guard = np.full(64, 0xA5, np.uint8)
    dc = gpu.upload(np.concatenate([c0.view(np.uint8).reshape(-1), guard]))
    gemv_launch(gpu, entry, m, n, [gpu.upload(a), gpu.upload(q), gpu.upload(s), dc, i32(m),
                                   i32(n), i32(k), i32(mode)], grid)
    out = gpu.download(dc, np.zeros(c0.nbytes + 64, np.uint8))
    assert np.array_equal(out[c0.nbytes:], guard), "a store past C"
    return out[:c0.nbytes].view(c0.dtype).reshape(c0.shape)


def assert_near_reference(a, q, s, c0, got, mode) -> None:
    """Within f32 reordering of the reference (relative to the sum of |products| of each
    output, which a wrong pairing of k, a missed chunk or a wrong scale exceed by far), plus
    one bf16 rounding in the bf16 modes."""
    m, k = a.shape
    n = q.shape[0]
    want = c0.copy()
    KERNELS["gemv_fp8_bf16_tc"](None, a.view(np.uint8).reshape(-1), q.reshape(-1),
                                s.view(np.uint8).reshape(-1), want.view(np.uint8).reshape(-1),
                                m, n, k, mode)
    want = want.astype(np.float32)
    wdq = np.abs(q.view(FP8).astype(np.float32))
    wdq *= np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[:n, :k]
    magnitude = np.abs(a.astype(np.float32)) @ wdq.T
    bound = magnitude * 2.0 ** -14 + (np.abs(want) * 2.0 ** -7 if mode != 2 else 0)
    got = got.astype(np.float32)
    assert np.isfinite(got).all() and (magnitude > 0).all()
    worst = np.unravel_index(np.argmax(np.abs(got - want) - bound), got.shape)
    assert (np.abs(got - want) <= bound).all(), (worst, got[worst], want[worst])


def start_c(m: int, n: int, mode: int, seed: int) -> np.ndarray:
    c0 = np.random.default_rng(seed).standard_normal((m, n)).astype(np.float32)
    return c0 if mode == 2 else c0.astype(BF16)


EIGHT_B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # qkv, o, gate_up, down


@pytest.mark.parametrize("entry", TC_THREADS)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n, k", EIGHT_B)
def test_tc_gemv_matches_the_reference_at_the_8b_shapes(gpu, entry, m, n, k):
    q, s = raw_fp8(n, k, n + k)
    a = activations(m, k, m)
    for mode in (0, 1, 2):
        c0 = start_c(m, n, mode, mode)
        assert_near_reference(a, q, s, c0, run_tc(gpu, entry, a, q, s, c0, mode), mode)


@pytest.mark.parametrize("entry", TC_THREADS)
def test_tc_gemv_matches_the_reference_at_the_8b_lm_head(gpu, entry):
    n, k = 151936, 4096
    q, s = raw_fp8(n, k, 7)
    a = activations(1, k, 8)
    c0 = start_c(1, n, 0, 9)
    assert_near_reference(a, q, s, c0, run_tc(gpu, entry, a, q, s, c0, 0), 0)


@pytest.mark.parametrize("entry", TC_THREADS)
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("m, n, k", [(1, 16, 16), (2, 17, 48), (5, 40, 144), (8, 129, 272),
                                     (7, 300, 4112), (9, 24, 2064), (1, 1, 64), (20, 72, 1040)])
def test_tc_gemv_matches_the_reference_at_odd_shapes(gpu, entry, mode, m, n, k):
    q, s = raw_fp8(n, k, n)
    a = activations(m, k, k)
    c0 = start_c(m, n, mode, m)
    assert_near_reference(a, q, s, c0, run_tc(gpu, entry, a, q, s, c0, mode), mode)


@pytest.mark.parametrize("entry", TC_THREADS)
@pytest.mark.parametrize("n, k", [(4096, 4096), (136, 2064)])
def test_tc_gemv_rows_do_not_depend_on_m_place_or_grid(gpu, entry, n, k):
    """A row of C gets the same bits alone (m = 1), in a batch of 20 at any place, on every
    grid and on a second launch: the kernel's claim that decode results are batch-invariant."""
    q, s = raw_fp8(n, k, 11)
    a = activations(20, k, 12)
    c0 = np.zeros((20, n), np.float32)
    batch = run_tc(gpu, entry, a, q, s, c0, 2)
    assert np.array_equal(run_tc(gpu, entry, a, q, s, c0, 2), batch)
    for grid in (1, 7):
        assert np.array_equal(run_tc(gpu, entry, a, q, s, c0, 2, grid), batch)
    for i in (0, 5, 13, 19):
        alone = run_tc(gpu, entry, a[i:i + 1], q, s, c0[:1], 2)
        assert np.array_equal(alone[0], batch[i]), i
    moved = np.roll(a, 3, axis=0)  # row i now sits at i + 3 of its group of 8 (or the next)
    assert np.array_equal(run_tc(gpu, entry, moved, q, s, c0, 2), np.roll(batch, 3, axis=0))


@pytest.mark.parametrize("tensor_cores", [True, False])
def test_an_fp8_model_gives_the_cpu_tokens_on_cuda(tmp_path, monkeypatch, tensor_cores):
    from hf.fp8_models import write_fp8
    from hf.models import write_model
    from kerncc.hf.importer import import_model
    from kerncc.lower import open_target
    from kerncc.runtime import Chain
    from reference_loop import alone

    from kerncc.runtime.backends import fp8_gemv

    monkeypatch.setattr(fp8_gemv, "TENSOR_CORES", tensor_cores)
    sizes = {"hidden": 256, "heads": 2, "kv_heads": 1, "head_dim": 128, "intermediate": 512,
             "vocab": 300, "layers": 2}
    bf16 = write_model(tmp_path / "bf16", "qwen3", seed=9, **sizes)
    fp8 = write_fp8(bf16, tmp_path / "fp8")
    limits = {"max_tokens": 64, "max_seqs": 4, "max_context": 256}
    prompt = [(i * 37) % 290 + 1 for i in range(40)]
    for folder, quantize in ((fp8, None), (bf16, "fp8")):
        path = import_model(folder, tmp_path / f"{folder.name}.json", quantize=quantize,
                            **limits).path
        (tmp_path / "model.safetensors").unlink(missing_ok=True)
        (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
        runs = {}
        for backend in ("cpu", "cuda"):
            with Chain(open_target(path, "cut,slice-derive,emit"), backend=backend) as chain:
                result = alone(chain, prompt, 12)
            runs[backend] = (result.tokens, result.logits)
        assert_same_greedy(runs["cpu"], runs["cuda"], folder.name)


def assert_same_greedy(cpu, cuda, what: str, near_tie: float = 2e-2) -> None:
    """Equal tokens, and logits within bf16 GEMM-order differences; a token may differ only
    where the cpu's top two logits are a near tie (then the runs part ways after it)."""
    (tokens, logits), (got_tokens, got_logits) = cpu, cuda
    scale = np.abs(logits).max()
    same = next((i for i, (a, b) in enumerate(zip(tokens, got_tokens)) if a != b), len(tokens))
    if same < len(tokens):
        top = np.sort(logits[same])[-2:]
        assert top[1] - top[0] < near_tie * scale, f"{what}: token {same} differs"
    assert np.abs(got_logits[:same + 1] - logits[:same + 1]).max() < 5e-2 * scale, what
    assert same >= len(tokens) // 2, f"{what}: only {same} tokens agree"
