"""The Numba-CUDA cubins on the GPU (marked `gpu`): twins bitwise equal to their CUDA C
entries, and `sample_f32` against the numpy reference of the same algorithm.

* silu_mul_bf16_nb / embedding_gather_bf16_nb: the same bits as silu_mul_bf16 /
  embedding_gather_bf16 on the wide and the narrow paths and on grids smaller than the work;
  the embedding also bitwise equal to the reference (a copy), silu_mul within an ulp of it
  (expf rounds apart from numpy's exp).
* sample_f32: greedy is the first argmax (as argmax_f32, ties included); the tokens equal the
  reference's on random rows (exact integer algorithm past expf); top-k 1 is greedy; top-p
  never leaves the nucleus; a launch repeats itself; and over many steps of one seed the
  draws follow softmax(logits / T) (total variation).
* Session.sample on the cuda backend of the tiny example equals the reference on the same
  device logits.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from test_elementwise_cuda import Gpu, bf16_bits, close_bf16, u8

from kerncc.kernels.reference import KERNELS
from kerncc.runtime.sampling import SamplingParams, pack

pytestmark = pytest.mark.gpu
SHIFTS = [0, 4, 8]


@pytest.fixture(scope="module")
def gpu():
    g = Gpu()
    yield g
    g.close()


def i32(v: int) -> ctypes.c_int32:
    return ctypes.c_int32(v)


@pytest.mark.parametrize("rows, inter, block", [(37, 384, 128), (5, 120, 40), (9, 36, 12),
                                                (512, 6144, 128)])
@pytest.mark.parametrize("grid", ["full", "small"])
def test_silu_mul_twins(gpu, rows, inter, block, grid):
    rng = np.random.default_rng(rows + inter)
    gate_up = bf16_bits(rng.standard_normal((rows, 2 * inter)).astype(np.float32) * 3)
    gate_up[0, :4] = bf16_bits(np.array([-100.0, 100.0, 0.0, -0.0], np.float32))  # exp limits
    want = np.zeros(rows * inter, np.uint16)
    KERNELS["silu_mul_bf16"](None, u8(gate_up), u8(want), rows, inter, block)
    blocks = max(-(-rows * inter // 8 // 256), 1) if grid == "full" else 1
    for shift in SHIFTS:
        got = {}
        for module, entry in (("activation", "silu_mul_bf16"), ("activation_nb",
                                                                 "silu_mul_bf16_nb")):
            src, out = gpu.upload(gate_up), gpu.upload(np.zeros_like(want), shift)
            gpu.launch(module, entry, blocks, 256, [src, out, i32(rows), i32(inter), i32(block)])
            got[entry] = gpu.download(out, want)
        assert np.array_equal(got["silu_mul_bf16"], got["silu_mul_bf16_nb"]), \
            f"shift {shift}: {np.sum(got['silu_mul_bf16'] != got['silu_mul_bf16_nb'])} differ"
        close_bf16(got["silu_mul_bf16_nb"], want)


@pytest.mark.parametrize("rows, hidden, vocab", [(7, 64, 50), (300, 2048, 32000)])
def test_embedding_twins(gpu, rows, hidden, vocab):
    rng = np.random.default_rng(hidden)
    table = bf16_bits(rng.standard_normal((vocab, hidden)).astype(np.float32))
    ids = rng.integers(0, vocab, rows).astype(np.int32)
    want = np.zeros((rows, hidden), np.uint16)
    KERNELS["embedding_gather_bf16"](None, u8(ids), u8(table), u8(want), rows, hidden)
    for module, entry in (("embed", "embedding_gather_bf16"), ("embed_nb",
                                                            "embedding_gather_bf16_nb")):
        d_ids, d_tab = gpu.upload(ids), gpu.upload(table)
        out = gpu.upload(np.zeros_like(want))
        gpu.launch(module, entry, rows, 128, [d_ids, d_tab, out, i32(rows), i32(hidden)])
        assert np.array_equal(gpu.download(out, want), want), entry


def launch_sample(gpu, logits: np.ndarray, words: np.ndarray) -> np.ndarray:
    n, vocab = words.shape[0], logits.shape[1]
    d_logits, d_words = gpu.upload(logits), gpu.upload(words)
    out = gpu.upload(np.full(n, -1, np.int32))
    gpu.launch("sampling_nb", "sample_f32", n, 1024,
               [d_logits, d_words, out, i32(n), i32(vocab), i32(vocab)])
    return gpu.download(out, np.zeros(n, np.int32))


def reference(logits: np.ndarray, words: np.ndarray) -> np.ndarray:
    out = np.zeros(words.shape[0], np.int32)
    KERNELS["sample_f32"](None, u8(logits), u8(words), u8(out), words.shape[0],
                          logits.shape[1], logits.shape[1])
    return out


CASES = [SamplingParams(1.0, seed=1), SamplingParams(0.7, top_k=50, seed=2),
         SamplingParams(1.3, top_p=0.9, seed=3), SamplingParams(0.9, top_k=40, top_p=0.8, seed=4),
         SamplingParams(0.0), SamplingParams(2.0, top_k=1, seed=5),
         SamplingParams(0.5, top_p=0.05, seed=2**64 - 1),
         SamplingParams(1.0, top_k=5000, top_p=0.99, seed=8), SamplingParams(3.0, top_k=2, seed=9)]


@pytest.mark.parametrize("vocab", [1000, 32000, 151936])
def test_sample_matches_reference(gpu, vocab):
    rng = np.random.default_rng(vocab)
    rows = 8
    logits = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    logits[3, 10:20] = logits[3].max() + 1  # a tie at the top
    picks = [(r, p, (r * 7, s)) for r in range(rows) for s in range(4) for p in CASES]
    words = pack([r for r, _, _ in picks], [p for _, p, _ in picks], [c for _, _, c in picks],
                 vocab)
    got, want = launch_sample(gpu, logits, words), reference(logits, words)
    same = float(np.mean(got == want))
    assert same >= 0.99, f"GPU equals the reference on {same:.4f} of {got.size} draws"
    assert np.array_equal(got, launch_sample(gpu, logits, words)), "a launch does not repeat"
    # (top-k 1 keeps every tie of the top, so row 3's ten tied maxima are not argmax's)
    greedy = [i for i, (r, p, _) in enumerate(picks) if p.greedy or (p.top_k == 1 and r != 3)]
    firsts = np.argmax(logits, axis=1)
    assert all(got[i] == firsts[picks[i][0]] for i in greedy), "greedy / top-k 1 is not argmax"
    argmax = np.zeros(rows, np.int32)
    d_logits, out = gpu.upload(logits), gpu.upload(argmax)
    gpu.launch("sampling", "argmax_f32", rows, 256, [d_logits, out, i32(rows), i32(vocab)])
    assert np.array_equal(gpu.download(out, argmax), firsts), "argmax_f32 disagrees"


def test_sample_distribution_and_nucleus(gpu):
    logits = np.log(np.array([[0.35, 0.25, 0.15, 0.1, 0.07, 0.05, 0.02, 0.01]], np.float32))
    draws = 40000
    for params, keep in ((SamplingParams(1.0, seed=11), 8), (SamplingParams(0.5, seed=12), 8),
                         (SamplingParams(1.0, top_p=0.58, seed=13), 2)):
        words = pack([0] * draws, [params] * draws, [(0, s) for s in range(draws)], 8)
        got = launch_sample(gpu, logits, words)
        z = logits[0].astype(np.float64) / params.temperature
        p = np.exp(z - z.max())
        p[keep:] = 0
        p /= p.sum()
        seen = np.bincount(got, minlength=8) / draws
        assert 0.5 * np.abs(seen - p).sum() < 0.01, (params, seen, p)
        assert got.max() < keep, f"top-p kept token {got.max()} past the nucleus"


def test_session_sample_on_cuda(tmp_path):
    from kerncc.example import generate
    from kerncc.lower import lower_to_bundle
    from kerncc.runtime import Chain
    from kerncc.runtime.sampling import sample_logits
    from reference_loop import alone

    manifest, _ = generate(tmp_path / "q", "tiny")
    chain = Chain(lower_to_bundle(manifest), backend="cuda")
    params = SamplingParams(0.9, top_k=30, top_p=0.95, seed=7)
    first = alone(chain, [1, 2, 3], 6, sampling=params).tokens
    assert first == alone(chain, [1, 2, 3], 6, sampling=params).tokens
    session = chain.sessions[-1]
    counters = [(0, s) for s in range(64)]
    got = session.sample("logits", [0] * 64, [params] * 64, counters)
    want = sample_logits(session.read("logits"), [0] * 64, [params] * 64, counters)
    assert np.mean(got == want) >= 0.95 and len(set(got.tolist())) > 1
    greedy = alone(chain, [1, 2, 3], 6).tokens
    assert greedy == alone(chain, [1, 2, 3], 6, sampling=SamplingParams()).tokens
