"""numpy references of the kernel library (same ABI as the CUDA kernels) and of the GEMM externs.

The cpu backend runs these in place of the cubins. `KERNELS` is keyed by CUDA entry name
(extern "C"), `EXTERNS` by extern name without the `extern:` prefix.

Call convention: `fn(launch, *args)`. `launch` has `grid`, `block` (3-tuples) and
`shared_mem`; the references read none of them: they compute the whole result the grid covers
from the row counts in the scalar params (the manifest sizes grids from the same vars).
Each arg follows the launch's params in order:
* a pointer (buffer or state param): a 1-D uint8 `np.ndarray` viewing the allocation from the
  pointed byte to its end; results are written in place through `.view(dtype)` of a prefix;
* a scalar: a numpy scalar of the param type (np.int32, np.int64, np.float32, np.uint8);
* `bytes<n>`: a `bytes` object (no kernel here takes one).

Results equal the CUDA kernels' up to float rounding: bf16 is `ml_dtypes.bfloat16` (round to
nearest even, as `__float2bfloat16`), arithmetic is f32 and the bf16 roundings sit where the
CUDA code rounds. Everything is deterministic (same inputs and shapes give the same bits).

GEMM extern ABI (kerncc's definition; kern's real ABI is not published). All matrices are
row-major and dense; W is in PyTorch `Linear.weight` layout [n, k]:
* `cublaslt_bf16_tn`     params [in buffer<bf16> A, in buffer<bf16> W, out buffer<bf16> C,
                         i32 m, i32 n, i32 k]: C[m, n] = bf16(f32(A[m, k]) @ f32(W[n, k])^T).
* `cublaslt_bf16_tn_acc` same params but C is `inout buffer<bf16>`:
                         C = bf16(f32(C) + f32(A) @ f32(W)^T) (one rounding, beta = 1).
* `cublas_bf16_tn_f32`   C is `out buffer<f32>`: C = f32(A) @ f32(W)^T, not rounded to bf16.
In cuBLAS's column-major terms each is C^T[n, m] = op(W)=T · A^T with lda = ldb = k,
ldc = n ("TN"), f32 compute; a GPU backend maps them to cuBLASLt matmuls of that shape.

Layouts shared with the CUDA code: packed qkv rows [q: nq*hd | k: nk*hd | v: nk*hd]; a KV
state slot s holds [K: nk*hd | V: nk*hd] bf16 at byte s*4*nk*hd; key j of a sequence is in
slot block_table[seq, j // 16] * 16 + j % 16.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from kerncc.kernels import logits_ref, sampling_ref

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)
PAGE = 16
DECODE_SPLIT = 128  # keys per split of attn_decode_split_bf16 (attention.cu DC_SPLIT)
LOG2E = np.float32(1.4426950408889634)


def view(ptr: np.ndarray, dtype: np.dtype, count: int) -> np.ndarray:
    """The first `count` elements of dtype at a pointer arg (writable, shares memory)."""
    nbytes = int(count) * np.dtype(dtype).itemsize
    if ptr.size < nbytes:
        raise ValueError(f"pointer arg holds {ptr.size} bytes, kernel needs {nbytes}")
    return ptr[:nbytes].view(dtype)


def bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=F32).astype(BF16)


def f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(F32)


def _norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """HF RMSNorm over the last axis: bf16(bf16(x * r) * w) with r = 1/sqrt(mean(x^2) + eps)."""
    xf = f32(x)
    r = (np.float32(1.0) / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + np.float32(eps)))
    return bf16(f32(bf16(xf * r)) * f32(w))


# ---- embed ---------------------------------------------------------------------------------


def embedding_gather_bf16(launch: Any, ids, table, out, rows, hidden) -> None:
    idx = view(ids, I32, rows).astype(np.int64)
    n = int(idx.max()) + 1 if rows else 0
    tab = view(table, BF16, n * hidden).reshape(n, hidden)
    view(out, BF16, rows * hidden).reshape(rows, hidden)[...] = tab[idx]


# ---- norm ----------------------------------------------------------------------------------


def rmsnorm_bf16(launch: Any, x, w, y, rows, cols, eps) -> None:
    xs = view(x, BF16, rows * cols).reshape(rows, cols)
    view(y, BF16, rows * cols).reshape(rows, cols)[...] = _norm(xs, view(w, BF16, cols), eps)


def add_rmsnorm_bf16(launch: Any, residual, x, w, y, rows, cols, eps) -> None:
    res = view(residual, BF16, rows * cols).reshape(rows, cols)
    res[...] = bf16(f32(res) + f32(view(x, BF16, rows * cols).reshape(rows, cols)))
    view(y, BF16, rows * cols).reshape(rows, cols)[...] = _norm(res, view(w, BF16, cols), eps)


def head_rmsnorm_bf16(launch: Any, qkv, w, rows, nq, nk, hd, eps) -> None:
    heads = view(qkv, BF16, rows * (nq + 2 * nk) * hd).reshape(rows, nq + 2 * nk, hd)
    weights = view(w, BF16, 2 * hd).reshape(2, hd)
    heads[:, :nq] = _norm(heads[:, :nq], weights[0], eps)
    heads[:, nq:nq + nk] = _norm(heads[:, nq:nq + nk], weights[1], eps)


def rmsnorm_last_bf16(launch: Any, x, w, y, seqs, rows_per_seq, cols, eps) -> None:
    rows = int(seqs) * int(rows_per_seq)
    last = view(x, BF16, rows * cols).reshape(seqs, rows_per_seq, cols)[:, -1]
    view(y, BF16, seqs * cols).reshape(seqs, cols)[...] = _norm(last, view(w, BF16, cols), eps)


def rmsnorm_last_varlen_bf16(launch: Any, x, w, y, cu_seqlens, seqs, cols, eps) -> None:
    ends = view(cu_seqlens, I32, seqs + 1)[1:].astype(np.int64)
    last = view(x, BF16, int(ends.max()) * cols).reshape(-1, cols)[ends - 1]
    view(y, BF16, seqs * cols).reshape(seqs, cols)[...] = _norm(last, view(w, BF16, cols), eps)


# ---- rope ----------------------------------------------------------------------------------


def rope_table_f32(launch: Any, table, max_pos, hd, theta) -> None:
    half = int(hd) // 2
    inv_freq = np.power(np.float64(theta), -2.0 * np.arange(half, dtype=np.float64) / int(hd))
    angle = np.arange(int(max_pos), dtype=np.float64)[:, None] * inv_freq[None, :]
    out = view(table, F32, max_pos * hd).reshape(max_pos, hd)
    out[:, :half] = np.cos(angle)
    out[:, half:] = np.sin(angle)


def llama3_inv_freq(hd: int, theta: float, factor: float, low_freq: float, high_freq: float,
                    original: int) -> np.ndarray:
    """Llama 3 `rope_scaling` frequencies (float64), as rope_table_llama3_f32 computes them."""
    base = np.power(np.float64(theta), -2.0 * np.arange(hd // 2, dtype=np.float64) / hd)
    wavelen = 2.0 * np.pi / base
    smooth = (original / wavelen - low_freq) / (high_freq - low_freq)
    blended = (1.0 - smooth) * base / factor + smooth * base
    inv_freq = np.where(wavelen >= original / high_freq, blended, base)
    return np.where(wavelen > original / low_freq, base / factor, inv_freq)


def rope_table_llama3_f32(launch: Any, table, max_pos, hd, theta, factor, low_freq, high_freq,
                          original) -> None:
    half = int(hd) // 2
    inv_freq = llama3_inv_freq(int(hd), float(theta), float(factor), float(low_freq),
                               float(high_freq), int(original))
    angle = np.arange(int(max_pos), dtype=np.float64)[:, None] * inv_freq[None, :]
    out = view(table, F32, max_pos * hd).reshape(max_pos, hd)
    out[:, :half] = np.cos(angle)
    out[:, half:] = np.sin(angle)


def rope_neox_bf16(launch: Any, qkv, positions, table, rows, nq, nk, hd) -> None:
    half = int(hd) // 2
    heads = view(qkv, BF16, rows * (nq + 2 * nk) * hd).reshape(rows, nq + 2 * nk, hd)
    pos = view(positions, I32, rows).astype(np.int64)
    rows_tab = view(table, F32, (int(pos.max()) + 1) * hd).reshape(-1, hd)[pos]
    cos, sin = rows_tab[:, None, :half], rows_tab[:, None, half:]
    x = f32(heads[:, :nq + nk])
    x1, x2 = x[..., :half], x[..., half:]
    heads[:, :nq + nk, :half] = bf16(x1 * cos - x2 * sin)
    heads[:, :nq + nk, half:] = bf16(x2 * cos + x1 * sin)


# ---- kv cache and attention ----------------------------------------------------------------


def kv_slots(kv: np.ndarray, nk: int, hd: int) -> np.ndarray:
    """A KV state as [slots, 2 (k, v), nk, hd] bf16."""
    token_bytes = 4 * int(nk) * int(hd)
    slots = kv.size // token_bytes
    return view(kv, BF16, slots * 2 * nk * hd).reshape(slots, 2, nk, hd)


def kv_write_bf16(launch: Any, qkv, slot_mapping, kv, rows, nq, nk, hd) -> None:
    rows_kv = view(qkv, BF16, rows * (nq + 2 * nk) * hd).reshape(rows, nq + 2 * nk, hd)
    slots = view(slot_mapping, I32, rows).astype(np.int64)
    keep = slots >= 0  # a padding row owns no slot
    cache = kv_slots(kv, nk, hd)
    cache[slots[keep]] = rows_kv[keep, nq:].reshape(-1, 2, nk, hd)


def qk_norm_rope_kv_bf16(launch: Any, qkv, w, positions, table, slot_mapping, kv, rows, nq, nk,
                         hd, eps) -> None:
    """head_rmsnorm_bf16, rope_neox_bf16 and kv_write_bf16 in sequence (one launch on a GPU)."""
    head_rmsnorm_bf16(launch, qkv, w, rows, nq, nk, hd, eps)
    rope_neox_bf16(launch, qkv, positions, table, rows, nq, nk, hd)
    kv_write_bf16(launch, qkv, slot_mapping, kv, rows, nq, nk, hd)


def _gather_keys(cache: np.ndarray, table_row: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """K and V ([n, nk, hd] f32) of keys 0..n-1 of the sequence whose page row is table_row."""
    keys = np.arange(n)
    slots = table_row[keys // PAGE].astype(np.int64) * PAGE + keys % PAGE
    kv = f32(cache[slots])
    return kv[:, 0], kv[:, 1]


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray,
            scale: float) -> np.ndarray:
    """Softmax attention in f32. q [rows, nq, hd]; k, v [keys, nk, hd]; visible [rows, keys]."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    s = np.einsum("rhd,khd->hrk", q, k) * np.float32(scale)
    s = np.where(visible[None], s, np.float32(-np.inf))
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hrk,khd->rhd", p, v).astype(F32)


def _attend_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray,
                 scale: float) -> np.ndarray:
    """Causal attention row by row: row r sees exactly keys 0..pos[r] (k, v hold at least
    those). Each row's sums run over its own keys only, in the same shapes whatever else is in
    the call, so a row's bits do not depend on the chunk it is fed in (batch invariance)."""
    out = np.empty(q.shape, F32)
    for r in range(q.shape[0]):
        n = int(pos[r]) + 1
        out[r] = _attend(q[r:r + 1], k[:n], v[:n], np.ones((1, n), bool), scale)[0]
    return out


def attn_prefill_bf16(launch: Any, qkv, kv, block_table, positions, out, rows, nq, nk, hd,
                      width, scale) -> None:
    """f32 softmax; the CUDA kernel (tensor cores) rounds P to bf16 for its P.V product, so the
    two agree within bf16 tolerance rather than by rounding point."""
    q = f32(view(qkv, BF16, rows * (nq + 2 * nk) * hd).reshape(rows, -1, hd)[:, :nq])
    pos = view(positions, I32, rows).astype(np.int64)
    k, v = _gather_keys(kv_slots(kv, nk, hd), view(block_table, I32, width), int(pos.max()) + 1)
    o = _attend_rows(q, k, v, pos, scale)
    view(out, BF16, rows * nq * hd).reshape(rows, nq, hd)[...] = bf16(o)


def attn_prefill_varlen_bf16(launch: Any, qkv, kv, block_table, positions, cu_seqlens, out,
                             rows, seqs, nq, nk, hd, width, scale) -> None:
    """attn_prefill_bf16 per sequence of a packed chunk: sequence s's rows are
    [cu_seqlens[s], cu_seqlens[s+1]), its pages row s of block_table."""
    q = f32(view(qkv, BF16, rows * (nq + 2 * nk) * hd).reshape(rows, -1, hd)[:, :nq])
    pos = view(positions, I32, rows).astype(np.int64)
    cu = view(cu_seqlens, I32, seqs + 1).astype(np.int64)
    tables = view(block_table, I32, seqs * width).reshape(seqs, width)
    cache = kv_slots(kv, nk, hd)
    o = view(out, BF16, rows * nq * hd).reshape(rows, nq, hd)
    for s in range(int(seqs)):
        start, end = int(cu[s]), min(int(cu[s + 1]), int(rows))
        if end <= start:
            continue
        k, v = _gather_keys(cache, tables[s], int(pos[start:end].max()) + 1)
        o[start:end] = bf16(_attend_rows(q[start:end], k, v, pos[start:end], scale))


def attn_decode_split_bf16(launch: Any, qkv, kv, block_table, seq_lens, part, seqs, nq, nk, hd,
                           width, max_splits, scale) -> None:
    """Per split s of DECODE_SPLIT keys of sequence b and q head h, the softmax partial
    [m | l | o[0..hd)] at part[b, h, s] (f32): scores in log2 units (q.k * scale * log2 e),
    m their max, l = sum 2^(score - m), o = sum 2^(score - m) v. Entries of splits past the
    sequence are left alone, as on the GPU. f32 throughout, like the CUDA kernel (which sums in
    another order and uses ex2.approx): the two agree within float rounding."""
    q = f32(view(qkv, BF16, seqs * (nq + 2 * nk) * hd).reshape(seqs, -1, hd)[:, :nq])
    lens = view(seq_lens, I32, seqs)
    tables = view(block_table, I32, seqs * width).reshape(seqs, width)
    cache = kv_slots(kv, nk, hd)
    entries = view(part, F32, seqs * nq * max_splits * (hd + 2)).reshape(seqs, nq, max_splits,
                                                                         hd + 2)
    scale2 = np.float32(scale) * LOG2E
    for b in range(int(seqs)):
        n = min(int(lens[b]), max_splits * DECODE_SPLIT)
        if n <= 0:
            continue
        splits = -(-n // DECODE_SPLIT)
        k, v = _gather_keys(cache, tables[b], n)
        k = np.repeat(k, nq // nk, axis=1)  # [n, nq, hd]
        v = np.repeat(v, nq // nk, axis=1)
        padded = np.full((nq, splits * DECODE_SPLIT), -np.inf, F32)
        padded[:, :n] = np.einsum("hd,khd->hk", q[b], k) * scale2
        scores = padded.reshape(nq, splits, DECODE_SPLIT)
        m = scores.max(axis=-1)
        p = np.exp2(scores - m[..., None])  # 0 past the sequence
        vs = np.zeros((splits * DECODE_SPLIT, nq, hd), F32)
        vs[:n] = v
        entries[b, :, :splits, 0] = m
        entries[b, :, :splits, 1] = p.sum(axis=-1)
        entries[b, :, :splits, 2:] = np.einsum(
            "hsk,skhd->hsd", p, vs.reshape(splits, DECODE_SPLIT, nq, hd))


def attn_decode_combine_bf16(launch: Any, part, seq_lens, out, seqs, nq, hd, max_splits) -> None:
    """Merges the partials of splits 0..ceil(len / DECODE_SPLIT)-1 of every (sequence, q head)
    in order: row = bf16(O / L), O = sum_s o_s 2^(m_s - M), L = sum_s l_s 2^(m_s - M),
    M = max_s m_s. An empty sequence writes zeros."""
    lens = view(seq_lens, I32, seqs)
    entries = view(part, F32, seqs * nq * max_splits * (hd + 2)).reshape(seqs, nq, max_splits,
                                                                         hd + 2)
    o = view(out, BF16, seqs * nq * hd).reshape(seqs, nq, hd)
    for b in range(int(seqs)):
        splits = min(-(-int(lens[b]) // DECODE_SPLIT), max_splits) if lens[b] > 0 else 0
        if splits == 0:
            o[b] = 0
            continue
        m = entries[b, :, :splits, 0]
        w = np.exp2(m - m.max(axis=-1, keepdims=True))
        total = (entries[b, :, :splits, 1] * w).sum(axis=-1)
        acc = (entries[b, :, :splits, 2:] * w[..., None]).sum(axis=1)
        o[b] = bf16(acc * (np.float32(1) / total)[:, None])


# ---- activation, sampling, conversion ------------------------------------------------------


def silu_mul_bf16(launch: Any, gate_up, act, rows, inter, block) -> None:
    pieces = view(gate_up, BF16, rows * 2 * inter).reshape(rows, inter // block, 2, block)
    g, u = f32(pieces[:, :, 0]), f32(pieces[:, :, 1])
    with np.errstate(over="ignore"):  # exp(-g) = inf gives silu = -0, as expf does on the GPU
        s = f32(bf16(g / (np.float32(1) + np.exp(-g))))
    view(act, BF16, rows * inter).reshape(rows, inter // block, block)[...] = bf16(s * u)


def argmax_f32(launch: Any, logits, tokens, rows, vocab) -> None:
    x = view(logits, F32, rows * vocab).reshape(rows, vocab)
    view(tokens, I32, rows)[...] = np.argmax(x, axis=1).astype(I32)


def cast_f32_bf16(launch: Any, x, y, n) -> None:
    view(y, BF16, n)[...] = bf16(view(x, F32, n))


def cast_f16_bf16(launch: Any, x, y, n) -> None:
    view(y, BF16, n)[...] = bf16(view(x, np.dtype(np.float16), n).astype(F32))


# ---- GEMM externs --------------------------------------------------------------------------


def _matmul_tn(a, w, m, n, k) -> np.ndarray:
    """f32(A) @ f32(W)^T one row at a time: BLAS sums a row in an order that depends on how
    many rows the call has (small m takes other kernels), so a batched product would give a
    sequence other bits when it is served with others. Row by row, each row's bits are the
    same whatever the batch (and the same as a one-row call's)."""
    A = f32(view(a, BF16, m * k).reshape(m, k))
    WT = f32(view(w, BF16, n * k).reshape(n, k)).T
    out = np.empty((m, n), F32)
    for i in range(m):
        out[i:i + 1] = A[i:i + 1] @ WT
    return out


def cublaslt_bf16_tn(launch: Any, a, w, c, m, n, k) -> None:
    view(c, BF16, m * n).reshape(m, n)[...] = bf16(_matmul_tn(a, w, m, n, k))


def cublaslt_bf16_tn_acc(launch: Any, a, w, c, m, n, k) -> None:
    C = view(c, BF16, m * n).reshape(m, n)
    C[...] = bf16(f32(C) + _matmul_tn(a, w, m, n, k))


def cublas_bf16_tn_f32(launch: Any, a, w, c, m, n, k) -> None:
    view(c, F32, m * n).reshape(m, n)[...] = _matmul_tn(a, w, m, n, k)


GEMV_MODES = (cublaslt_bf16_tn, cublaslt_bf16_tn_acc, cublas_bf16_tn_f32)  # gemv.cu's `mode`


def gemv_bf16_tn(launch: Any, a, w, c, m, n, k, mode) -> None:
    """kernels/gemv.cu's gemv_bf16_tn_mb{1..4}[_w16][_t2|_t3] (the entries that exist) (any m: blocks of 8 * MB rows): the
    extern `mode` names (0 bf16, 1 bf16 accumulating, 2 f32), the same function summed in a
    fixed order."""
    if not 0 <= mode < len(GEMV_MODES):
        raise ValueError(f"gemv mode {mode} is not 0, 1 or 2")
    GEMV_MODES[mode](launch, a, w, c, m, n, k)


def _int_scalars(fn: Callable[..., None]) -> Callable[..., None]:
    """Integer scalar args as Python ints, so size arithmetic cannot wrap at 32 bits."""

    @functools.wraps(fn)
    def call(launch: Any, *args: Any) -> None:
        fn(launch, *(int(a) if isinstance(a, np.integer) else a for a in args))

    return call


KERNELS: dict[str, Callable[..., None]] = {
    fn.__name__: _int_scalars(fn)
    for fn in (
        embedding_gather_bf16,
        rmsnorm_bf16,
        add_rmsnorm_bf16,
        head_rmsnorm_bf16,
        rmsnorm_last_bf16,
        rmsnorm_last_varlen_bf16,
        rope_table_f32,
        rope_neox_bf16,
        kv_write_bf16,
        qk_norm_rope_kv_bf16,
        attn_prefill_bf16,
        attn_prefill_varlen_bf16,
        attn_decode_split_bf16,
        attn_decode_combine_bf16,
        silu_mul_bf16,
        argmax_f32,
        cast_f32_bf16,
        cast_f16_bf16,
        rope_table_llama3_f32,
    )
}
GEMV_ENTRIES = ("gemv_bf16_tn_mb1", "gemv_bf16_tn_mb2_t2", "gemv_bf16_tn_mb4_w16_t2",
                "gemv_bf16_tn_mb4_t2", "gemv_bf16_tn_mb4_t3", "gemv_bf16_tn_mb1_w16",
                "gemv_bf16_tn_mb2_w16_t2", "gemv_bf16_tn_mb3_w16_t2", "gemv_bf16_tn_mb8_t4_smem",
                "gemv_bf16_tn_mb4_t4_smem", "gemv_bf16_tn_seq")  # gemv.cu: one function
KERNELS.update({name: _int_scalars(gemv_bf16_tn) for name in GEMV_ENTRIES})


EXTERNS: dict[str, Callable[..., None]] = {
    fn.__name__: _int_scalars(fn)
    for fn in (cublaslt_bf16_tn, cublaslt_bf16_tn_acc, cublas_bf16_tn_f32)
}

# Numba-CUDA twins (kernels/*_nb.py): the same ABI and bits as their CUDA C entries.
KERNELS["silu_mul_bf16_nb"] = KERNELS["silu_mul_bf16"]
# the wgmma kernel (attention_sm90a.cu) computes what the mma.sync one does (bf16 tolerance)
KERNELS["attn_prefill_varlen_sm90a_bf16"] = KERNELS["attn_prefill_varlen_bf16"]
KERNELS["embedding_gather_bf16_nb"] = KERNELS["embedding_gather_bf16"]
# the decode split on tensor cores (attention.cu) computes what the CUDA-core one does
KERNELS["attn_decode_split_tc_bf16"] = KERNELS["attn_decode_split_bf16"]
# ... and so does its pipelined form (the tensor-core split's bits, for any grid z)
KERNELS["attn_decode_split_pipe_tc_bf16"] = KERNELS["attn_decode_split_bf16"]


def sample_f32(launch: Any, logits, params, tokens, n, stride, vocab) -> None:
    """tokens[b] = the sampled token of params row b (the kernel's ABI; pointers are uint8
    views; the algorithm is kernels/sampling_ref.py)."""
    words = sampling_ref.PARAM_WORDS
    rows = view(params, np.uint32, n * words).reshape(n, words)
    out = view(tokens, I32, n)
    for b in range(n):
        row, temperature, top_k, top_p, seed, sequence, step = sampling_ref.unpack(rows[b])
        x = view(logits[row * stride * 4:], F32, vocab)
        out[b] = sampling_ref.sample_row(x, temperature, top_k, top_p, seed, sequence, step)


KERNELS["sample_f32"] = _int_scalars(sample_f32)


# ---- logits processing (kernels/logits.cu; the algorithm is kernels/logits_ref.py) ---------


def _logits_args(logits, words, n, vocab, stride):
    rows = view(words, np.uint32, n * logits_ref.LOGIT_WORDS).reshape(n, -1)
    used = int(rows[:, 0].max()) + 1 if n else 0
    x = view(logits, F32, used * stride).reshape(used, stride)
    slots = int(rows[:, 5].max()) + 1 if n else 0
    return rows, x, slots


def logits_process_f32(launch: Any, logits, words, counts, seen, bias, allow, step_allow, n,
                       vocab, stride) -> None:
    rows, x, slots = _logits_args(logits, words, n, vocab, stride)
    masks = logits_ref.mask_words(vocab)
    logits_ref.process_logits(
        x, rows, view(counts, I32, slots * vocab).reshape(slots, vocab),
        view(seen, np.uint8, slots * vocab).reshape(slots, vocab),
        view(bias, F32, slots * vocab).reshape(slots, vocab),
        view(allow, np.uint32, slots * masks).reshape(slots, masks),
        view(step_allow, np.uint32, n * masks).reshape(n, masks))


def logits_logprobs_f32(launch: Any, logits, words, results, n, vocab, stride) -> None:
    rows, x, _ = _logits_args(logits, words, n, vocab, stride)
    out = view(results, F32, n * logits_ref.RESULT_WORDS).reshape(n, -1)
    logits_ref.logprobs(x, rows, out, vocab)


def logits_accept_f32(launch: Any, logits, words, tokens, counts, seen, results, n, vocab,
                      stride) -> None:
    rows, x, slots = _logits_args(logits, words, n, vocab, stride)
    logits_ref.accept(x, rows, view(tokens, I32, x.shape[0]),
                      view(counts, I32, slots * vocab).reshape(slots, vocab),
                      view(seen, np.uint8, slots * vocab).reshape(slots, vocab),
                      view(results, F32, n * logits_ref.RESULT_WORDS).reshape(n, -1))


for _fn in (logits_process_f32, logits_logprobs_f32, logits_accept_f32):
    KERNELS[_fn.__name__] = _int_scalars(_fn)


# ---- FP8 weights (kernels/fp8.cu) ----------------------------------------------------------

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_BLOCK = 128
FP8_MAX = np.float32(448.0)


def fp8_blocks(n: int, k: int) -> tuple[int, int]:
    """The scale grid of a [n, k] weight: one f32 per 128 x 128 block."""
    return -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)


def fp8_expand(scales: np.ndarray, n: int, k: int) -> np.ndarray:
    """The [n, k] f32 scale of every element (its block's)."""
    return np.repeat(np.repeat(scales, FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)[:n, :k]


def fp8_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 [n, k], f32 scales) of a [n, k] weight, as fp8_quantize_bf16 computes them:
    S = block amax / 448 (NaNs ignored; 1 for an all-zero block), Q = e4m3(f32(w) / S)
    rounded to nearest even and saturated to +-448. `kerncc import --quantize fp8` and the
    tests' FP8 checkpoints use this function, so both give the same bytes."""
    x = f32(w)
    n, k = x.shape
    bn, bk = fp8_blocks(n, k)
    padded = np.zeros((bn * FP8_BLOCK, bk * FP8_BLOCK), F32)
    padded[:n, :k] = np.abs(x)
    tiles = padded.reshape(bn, FP8_BLOCK, bk, FP8_BLOCK)
    amax = np.fmax.reduce(np.fmax.reduce(tiles, axis=3), axis=1).astype(F32)
    scales = np.where(amax > 0, amax / FP8_MAX, np.float32(1)).astype(F32)
    with np.errstate(all="ignore"):
        q = np.clip(x / fp8_expand(scales, n, k), -FP8_MAX, FP8_MAX).astype(FP8)
    return q, scales


def fp8_dequantize(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The f32 value of every weight: f32(Q) * S of its block (exact in f32)."""
    n, k = q.shape
    return f32(q) * fp8_expand(scales, n, k)


def fp8_quantize_bf16(launch: Any, w, q, s, n, k) -> None:
    bn, bk = fp8_blocks(n, k)
    values, scales = fp8_quantize(view(w, BF16, n * k).reshape(n, k))
    view(q, FP8, n * k).reshape(n, k)[...] = values
    view(s, F32, bn * bk).reshape(bn, bk)[...] = scales


def fp8_dequantize_bf16(launch: Any, q, s, w, n, k) -> None:
    bn, bk = fp8_blocks(n, k)
    values = view(q, FP8, n * k).reshape(n, k)
    scales = view(s, F32, bn * bk).reshape(bn, bk)
    view(w, BF16, n * k).reshape(n, k)[...] = bf16(fp8_dequantize(values, scales))


def gemv_fp8_bf16(launch: Any, a, w, s, c, m, n, k, mode) -> None:
    """C (=, += or f32 =) f32(A) @ (f32(Q) * S)^T, row by row (as _matmul_tn, so a row's
    bits do not depend on the batch); the CUDA kernel sums the same products in another
    fixed order (f32 rounding apart)."""
    if not 0 <= mode < len(GEMV_MODES):
        raise ValueError(f"gemv mode {mode} is not 0, 1 or 2")
    bn, bk = fp8_blocks(n, k)
    WT = fp8_dequantize(view(w, FP8, n * k).reshape(n, k),
                        view(s, F32, bn * bk).reshape(bn, bk)).T
    A = f32(view(a, BF16, m * k).reshape(m, k))
    out = np.empty((m, n), F32)
    for i in range(m):
        out[i:i + 1] = A[i:i + 1] @ WT
    if mode == 2:
        view(c, F32, m * n).reshape(m, n)[...] = out
        return
    C = view(c, BF16, m * n).reshape(m, n)
    C[...] = bf16(out + f32(C)) if mode == 1 else bf16(out)


def cast_bf16_f32(launch: Any, x, y, n) -> None:
    view(y, F32, n)[...] = f32(view(x, BF16, n))


KERNELS.update({fn.__name__: _int_scalars(fn)
                for fn in (fp8_quantize_bf16, fp8_dequantize_bf16, gemv_fp8_bf16,
                           cast_bf16_f32)})
# The tensor-core FP8 GEMVs (8 and 16 warps) compute gemv_fp8_bf16's function, summed in
# another fixed order (kernels/fp8.cu): the same reference.
KERNELS["gemv_fp8_bf16_tc"] = KERNELS["gemv_fp8_bf16"]
