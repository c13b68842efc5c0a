"""A decode GEMV and the small kernel before it as one launch, on the GPU (marked `gpu`: skipped
without a CUDA driver).

kernels/gemv.cu's `gemv_rmsnorm_bf16_tn_mb1[_w16]` and `gemv_silu_bf16_tn_mb1[_w16]` compute
the rmsnorm or silu_mul in the GEMV's activation loads (runtime/backends/fuse.py joins the
launches). What must hold: the fused launch gives the two launches' bits, both the GEMM's output
and the small kernel's (which its blocks write too), for every mode (bf16, accumulating, f32), m
from 1 to 8, whole and partial tiles, k a whole number of the warps' rounds or not, and any
thread count of the norm's launch; and through whole models, the same tokens and logits with the
fusion on and off, at batch 1 and batched, eagerly and in CUDA graphs, whole and in 2 stages,
with the pairs really fused.
"""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

from bundles import close_chains, cuda_chain, same_generations, same_served, whole_and_two
from gpu_driver import Gpu  # noqa: E402  (tests/ is on the path)
from kerncc.kernels import library
from kerncc.kernels.reference import KERNELS
from kerncc.runtime.backends import gemv

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)


MODULES = {entry: name for name in ("norm", "activation", "gemv")
           for entry in library.index()[name]["entries"]}


class Kernels(Gpu):
    """The norm, activation and gemv modules' entries by name alone; the fused ones may take
    the dynamic shared memory the backend gives them."""

    def __init__(self) -> None:
        super().__init__()
        for entry in gemv.FUSED_ENTRIES:
            self.allow_shared("gemv", entry, gemv.FUSED_SHARED_MAX)

    def run(self, entry: str, grid: int, block: int, args: list, shared: int = 0) -> None:
        self.launch(MODULES[entry], entry, grid, block, args, shared)


@pytest.fixture(scope="module")
def gpu():
    g = Kernels()
    yield g
    g.close()


def random_bf16(rng, shape, scale: float) -> np.ndarray:
    x = rng.standard_normal(shape).astype(np.float32) * scale
    x[x == 0] = scale  # never zeros
    return x.astype(BF16)


def bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint16 if x.dtype == BF16 else np.uint32)


def c_start(rng, mode: int, m: int, n: int) -> np.ndarray:
    if mode == 2:
        return np.full(m * n, np.nan, np.float32)
    return random_bf16(rng, (m * n,), 1.0) if mode == 1 else np.full(m * n, np.nan, BF16)


def plain_entry(m: int, n: int) -> str:
    return gemv.entry_for(m, n)


def fused_entry(kind: str, m: int, n: int) -> str:
    return f"gemv_{kind}_bf16_tn_mb1" + ("_w16" if plain_entry(m, n).endswith("_w16") else "")


NORM_CASES = [  # (m, n, k, the norm's threads, mode)
    (1, 4096, 2048, 256, 0), (1, 2048, 2048, 256, 1), (8, 4096, 2048, 256, 0),
    (3, 2048, 2048, 128, 2), (5, 100, 72, 32, 0), (2, 40, 264, 1024, 1), (8, 2056, 6144, 768, 0),
]


@pytest.mark.parametrize("m, n, k, threads, mode", NORM_CASES)
def test_the_fused_norm_gives_the_norm_and_gemvs_bits(gpu, m, n, k, threads, mode):
    rng = np.random.default_rng(m * 7919 + n + k + threads + mode)
    x = random_bf16(rng, (m, k), 3.0)
    gn = random_bf16(rng, (k,), 1.0)
    w = random_bf16(rng, (n, k), 1.0 / np.sqrt(k))
    c0 = c_start(rng, mode, m, n)
    eps = ctypes.c_float(1e-6)
    dx, dg, dw = gpu.upload(x), gpu.upload(gn), gpu.upload(w)
    y1, y2 = gpu.upload(np.full((m, k), np.nan, BF16)), gpu.upload(np.full((m, k), np.nan, BF16))
    c1, c2 = gpu.upload(c0), gpu.upload(c0)
    i32 = ctypes.c_int32
    gpu.run("rmsnorm_bf16", m, threads, [dx, dg, y1, i32(m), i32(k), eps])
    entry = plain_entry(m, n)
    grid, block = -(-n // 16), gemv.ENTRIES[entry]
    gpu.run(entry, grid, block, [y1, dw, c1, i32(m), i32(n), i32(k), i32(mode)])
    fused = fused_entry("rmsnorm", m, n)
    assert gemv.FUSED_ENTRIES[fused] == block
    gpu.run(fused, grid, block, [dx, dg, y2, eps, i32(threads), dw, c2, i32(m), i32(n),
                                    i32(k), i32(mode)], gemv.fused_shared(m, k))
    want_y, got_y = gpu.download(y1, x), gpu.download(y2, x)
    want_c, got_c = gpu.download(c1, c0), gpu.download(c2, c0)
    assert np.isfinite(got_c.astype(np.float32)).all() and np.abs(
        got_c.astype(np.float32)).max() > 0
    np.testing.assert_array_equal(bits(got_y), bits(want_y))
    np.testing.assert_array_equal(bits(got_c), bits(want_c))
    # and the numpy reference of the fused entry is the same function (within bf16 rounding)
    y3, c3 = np.zeros_like(x), c0.copy()
    KERNELS[fused](None, x.view(np.uint8).reshape(-1), gn.view(np.uint8).reshape(-1),
                   y3.view(np.uint8).reshape(-1), np.float32(1e-6), np.int32(threads),
                   w.view(np.uint8).reshape(-1), c3.view(np.uint8).reshape(-1), np.int32(m),
                   np.int32(n), np.int32(k), np.int32(mode))
    np.testing.assert_allclose(got_y.astype(np.float32), y3.astype(np.float32), rtol=2e-2,
                               atol=2e-2)
    np.testing.assert_allclose(got_c.astype(np.float32), c3.astype(np.float32), rtol=5e-2,
                               atol=5e-2)


SILU_CASES = [  # (m, n, k = inter, gate_up block, mode)
    (1, 2048, 6144, 128, 1), (1, 2048, 2048, 2048, 0), (8, 2048, 6144, 128, 1),
    (4, 4096, 2048, 64, 2), (3, 100, 72, 8, 0), (7, 2056, 264, 24, 1),
]


@pytest.mark.parametrize("m, n, k, piece, mode", SILU_CASES)
def test_the_fused_silu_mul_gives_the_activation_and_gemvs_bits(gpu, m, n, k, piece, mode):
    rng = np.random.default_rng(m * 104729 + n + k + piece + mode)
    gate_up = random_bf16(rng, (m, 2 * k), 2.0)
    gate_up[0, :8] = np.array([-1e30, 1e30, -90, 90, 0.5, -0.5, 1e-3, -3], np.float32).astype(BF16)
    w = random_bf16(rng, (n, k), 1.0 / np.sqrt(k))
    c0 = c_start(rng, mode, m, n)
    dgu, dw = gpu.upload(gate_up), gpu.upload(w)
    a1, a2 = gpu.upload(np.full((m, k), np.nan, BF16)), gpu.upload(np.full((m, k), np.nan, BF16))
    c1, c2 = gpu.upload(c0), gpu.upload(c0)
    i32 = ctypes.c_int32
    gpu.run("silu_mul_bf16", max(1, m * k // 8 // 256), 256,
               [dgu, a1, i32(m), i32(k), i32(piece)])
    entry = plain_entry(m, n)
    grid, block = -(-n // 16), gemv.ENTRIES[entry]
    gpu.run(entry, grid, block, [a1, dw, c1, i32(m), i32(n), i32(k), i32(mode)])
    gpu.run(fused_entry("silu", m, n), grid, block,
               [dgu, a2, i32(piece), dw, c2, i32(m), i32(n), i32(k), i32(mode)],
               gemv.fused_shared(m, k))
    like = np.zeros((m, k), BF16)
    np.testing.assert_array_equal(bits(gpu.download(a2, like)), bits(gpu.download(a1, like)))
    got_c, want_c = gpu.download(c2, c0), gpu.download(c1, c0)
    assert np.abs(got_c.astype(np.float32)).max() > 0
    np.testing.assert_array_equal(bits(got_c), bits(want_c))


# ---- whole models -------------------------------------------------------------------------

MODELS = {"tiny": {}, "k 2048": {"hidden": 256, "heads": 8, "kv_heads": 4, "head_dim": 128,
                                 "intermediate": 2048, "max_seqs": 8}}
PROMPTS = [[7], [3, 1, 4], list(range(5, 150))]


@pytest.fixture(scope="module", params=sorted(MODELS))
def bundles(request, tmp_path_factory) -> dict:
    return whole_and_two(tmp_path_factory.mktemp(request.param.replace(" ", "")),
                         **MODELS[request.param])


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("bundle", ["whole", "two"])
def test_fused_decode_gives_the_launches_bits(bundles, bundle, graphs):
    on, off = (cuda_chain(bundles[bundle], graphs, fuse_gemv=flag)
               for flag in (True, False))
    try:
        same_generations(on, off, PROMPTS)
        assert on.backend.fused > 0, "the decode GEMVs went out fused"
        assert off.backend.fused == 0
    finally:
        close_chains(on, off)


@pytest.mark.parametrize("running", [3, 8])
def test_batched_decode_fused_gives_the_launches_bits(bundles, running):
    prompts = [[(i * (13 + s)) % 251 + 1 for i in range(9 + 7 * s)] for s in range(running)]
    on, off = (cuda_chain(bundles["whole"], fuse_gemv=flag) for flag in (True, False))
    try:
        same_served(on, off, prompts)
        assert on.backend.fused > 0
    finally:
        close_chains(on, off)
