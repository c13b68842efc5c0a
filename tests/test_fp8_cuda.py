"""kernels/fp8.cu on the GPU against its numpy references, and an FP8 model end to end
(marked `gpu`: skipped without a CUDA driver).

Quantize and dequantize compute each value alone with the references' roundings (f32 division,
e4m3 round to nearest even with saturation; one bf16 rounding), so they must give the
references' bits. The GEMV sums the same f32 products in another fixed order: within f32
rounding of the reference, plus one bf16 rounding in the bf16 modes. An FP8-quantized model
gives the cpu backend's greedy tokens on cuda.
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


@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("m, n, k", [(1, 4096, 4096), (3, 1024, 4112), (8, 384, 12288),
                                     (33, 136, 512)])
def test_gemv_matches_the_reference(gpu, mode, m, n, k):
    q, s = fp8_quantize(weight(n, k, 2))
    rng = np.random.default_rng(3)
    a = rng.standard_normal((m, k)).astype(np.float32).astype(BF16)
    c0 = rng.standard_normal((m, n)).astype(np.float32)
    c0 = c0 if mode == 2 else c0.astype(BF16)
    dc = gpu.upload(c0)
    gpu.launch("fp8", "gemv_fp8_bf16", -(-n // 8), 256,
               [gpu.upload(a), gpu.upload(q), gpu.upload(s), dc, i32(m), i32(n), i32(k),
                i32(mode)])
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


def test_an_fp8_model_gives_the_cpu_tokens_on_cuda(tmp_path):
    from hf.fp8_models import write_fp8
    from hf.models import write_model
    from kerncc.hf.importer import import_model
    from kerncc.lower import open_target
    from kerncc.runtime import Chain
    from reference_loop import alone

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
