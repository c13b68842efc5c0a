"""The example model: a Qwen3-style decoder as a v5 manifest plus a random checkpoint.

`generate(out_dir, size, **overrides)` writes `model.json` (kern's canonical style: keys in
struct order, maps sorted, 2-space indent), `model.safetensors` (deterministic random bf16
weights under HF Qwen3 names) and `config.json` (HF-style, read by the oracle).

The manifest, per layer i (9 calls, layer i starting at call 1 + 9*i in every driven
program, so `l{i}.qkv_proj` is call 2 + 9*i everywhere):
  input_norm, qkv_proj, qk_rope_kv, attention, o_proj, post_norm, gate_up_proj, act,
  down_proj
(`qk_rope_kv`: q/k head norms, rope and the KV-cache write in one launch)
framed by `embed` (call 0) and `final_norm`, `lm_head`, `argmax` (the last three).
Programs: `prefill` (a chunk of `tokens` rows packing up to `seqs` sequences end to end,
split by `cu_seqlens`, over a paged KV cache that may already hold earlier chunks),
`decode` (one row), `decode_batch` (one row for each of up to `seqs` sequences), `load`
(once: rope cos/sin table) and `convert` (derive: f32 `model.norm.weight` source cast to a
bf16 carry). Binds show each segment form: q/k/v laid end to end, gate/up
interleaved, lm_head rows [0, vocab) of the checkpoint tensor.

`manifest(config, model, binding)` is the one manifest builder: the example and the Hugging
Face importer (`kerncc.hf.importer`) both call it. `Binding` says what the checkpoint holds:
each tensor's dtype (a tensor that is not bf16 binds a `source` buffer `<name>.src` cast into
the bf16 carry `<name>.w` by the derive program `convert`), tied embeddings, and kv heads
replicated by bind rows for head groups the attention kernels cannot take. A config without
q/k norms (Llama) gets a `rope_kv` op (rope, then the KV-cache write) in place of
`qk_rope_kv`; Llama 3 rope scaling gets its own rope table kernel.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from kerncc.example.checkpoint import checkpoint, hf
from kerncc.example.config import PAGE, QwenConfig, make_config
from kerncc.kernels import library
from kerncc.checkpoint.safetensors import save_file

IN_BF16, OUT_BF16, INOUT_BF16 = "in buffer<bf16>", "out buffer<bf16>", "inout buffer<bf16>"
IN_I32, OUT_I32 = "in buffer<i32>", "out buffer<i32>"
IN_F32, OUT_F32 = "in buffer<f32>", "out buffer<f32>"
IN_STATE, INOUT_STATE = "in state", "inout state"

LAYER_CALLS = ("input_norm", "qkv_proj", "qk_rope_kv", "attention", "o_proj",
               "post_norm", "gate_up_proj", "act", "down_proj")
# The checkpoint dtypes a weight may bind: bf16 as is, the others cast at load (derive).
CASTS = {"f32": ("cast_bf16", "cast_f32_bf16"), "f16": ("cast_f16_bf16", "cast_f16_bf16")}


@attrs.frozen
class Binding:
    """What the checkpoint holds, as far as the manifest's binds care."""

    dtypes: Mapping[str, str]  # checkpoint tensor name -> kern dtype (bf16, f16, f32, fp8e4m3)
    tied: bool = False  # lm_head is the embedding table (no lm_head.weight)
    kv_repeat: int = 1  # manifest kv heads per checkpoint kv head (bind rows repeat them)
    quantize: bool = False  # bf16 linears quantized to block-scaled FP8 at load (derive)


def layer_call_names(c: QwenConfig) -> tuple[str, ...]:
    """The calls of a layer: LAYER_CALLS, with `rope_kv` in place of `qk_rope_kv` for a
    model without q/k norms."""
    return LAYER_CALLS if c.qk_norm else tuple(
        "rope_kv" if name == "qk_rope_kv" else name for name in LAYER_CALLS)


# ---- JSON pieces ---------------------------------------------------------------------------


def buf(name: str, offset: int = 0) -> dict:
    return {"buf": name, "offset": offset} if offset else {"buf": name}


def var(name: str) -> dict:
    return {"var": name}


def i32(value: int) -> dict:
    return {"i32": int(value)}


def f32(value: float) -> dict:
    return {"f32": float(value)}  # the runtime rounds it to f32 when it packs the launch


def param(i: int) -> dict:
    return {"param": i}


def ceil_div(e: Any, d: int) -> dict:
    return {"ceil_div": [e, d]}


def ceil(n: int, d: int) -> int:
    return -(-n // d)


def mul(e: Any, c: int) -> dict:
    return {"mul": [e, c]}


def norm_block(cols: int) -> int:
    """Threads of a row-norm block: one per 8 columns, whole warps, at most 256."""
    return min(256, 32 * ceil(ceil(cols, 8), 32))


def vector(n: int, width: int) -> int:
    """The elements a thread handles at once: `width` when n is a multiple of it, else 1
    (the kernels' own test, so the grid covers exactly what they step over)."""
    return width if n % width == 0 else 1


def kernel_launch(entry: str, params: list[str], args: list[dict], grid: list[Any], block: int,
                  shared_mem: int = 0) -> dict:
    """One launch of a library kernel: its params, the args that feed them, its geometry."""
    launch = {
        "module": library.module_of(entry),
        "entry": entry,
        "params": params,
        "block": [block, 1, 1],
        "grid": grid + [1] * (3 - len(grid)),
    }
    if shared_mem:
        launch["shared_mem"] = shared_mem  # dynamic bytes
    launch["args"] = args
    return launch


def kernel_op(params: list[str], entry: str, scalars: list[str], consts: list[dict],
              grid: list[Any], block: int, shared_mem: int = 0) -> dict:
    """An op of one kernel launch: the op's params forwarded, then launch-private constants."""
    args = [param(i) for i in range(len(params))] + consts
    launch = kernel_launch(entry, params + scalars, args, grid, block, shared_mem)
    return {"params": params, "impl": {"launches": [launch]}}


def qk_rope_kv_op(c: QwenConfig, grid: list[Any], block: int) -> dict:
    return kernel_op([INOUT_BF16, IN_BF16, IN_I32, IN_F32, IN_I32, INOUT_STATE, "i32"],
                     "qk_norm_rope_kv_bf16", ["i32"] * 3 + ["f32"],
                     [i32(c.heads), i32(c.kv_heads), i32(c.head_dim), f32(c.eps)], grid, block)


def attn_decode_op(c: QwenConfig, blocks: int) -> dict:
    """Flash-decoding in two launches (kernels/attention.cu): per (sequence, kv head, split of
    DECODE_SPLIT keys) the softmax partials of the G q heads go to the f32 workspace of param 5
    (`attn_partials`), then per (sequence, q head) the splits are merged in order into out.
    `blocks` split blocks per (sequence, kv head) each take every blocks-th split (the same
    bits for any count)."""
    nq, nk, hd, splits = c.heads, c.kv_heads, c.head_dim, c.decode_splits
    params = [IN_BF16, IN_STATE, IN_I32, IN_I32, OUT_BF16, OUT_F32, "i32"]
    # head dims of 32, 64, 96, 128 on tensor cores, others on CUDA cores: the same function
    # and partials, not the same bits
    entry = "attn_decode_split_tc_bf16" if hd % 32 == 0 else "attn_decode_split_bf16"
    split = kernel_launch(
        entry, [IN_BF16, IN_STATE, IN_I32, IN_I32, OUT_F32] + ["i32"] * 6
        + ["f32"], [param(0), param(1), param(2), param(3), param(5), param(6), i32(nq), i32(nk),
                    i32(hd), i32(c.pages_per_seq), i32(splits), f32(1.0 / math.sqrt(hd))],
        ["seqs", nk, blocks], 256)
    combine = kernel_launch(
        "attn_decode_combine_bf16", [IN_F32, IN_I32, OUT_BF16] + ["i32"] * 4,
        [param(5), param(3), param(4), param(6), i32(nq), i32(hd), i32(splits)], ["seqs", nq], 128)
    return {"params": params, "impl": {"launches": [split, combine]}}


def rope_kv_op(c: QwenConfig) -> dict:
    """Rope on the q and k heads in place, then the KV-cache write (no q/k norms): the
    kernels rope_neox_bf16 and kv_write_bf16, 4 and 8 elements per thread (head_dim % 16 == 0)."""
    nq, nk, hd = c.heads, c.kv_heads, c.head_dim
    params = [INOUT_BF16, IN_I32, IN_F32, IN_I32, INOUT_STATE, "i32"]
    heads = [i32(nq), i32(nk), i32(hd)]
    rope = kernel_launch("rope_neox_bf16", [INOUT_BF16, IN_I32, IN_F32] + ["i32"] * 4,
                         [param(0), param(1), param(2), param(5)] + heads,
                         [ceil_div(mul("tokens", (nq + nk) * hd // 8), 256)], 256)
    write = kernel_launch("kv_write_bf16", [IN_BF16, IN_I32, INOUT_STATE] + ["i32"] * 4,
                          [param(0), param(3), param(4), param(5)] + heads,
                          [ceil_div(mul("tokens", nk * hd // 4), 256)], 256)
    return {"params": params, "impl": {"launches": [rope, write]}}


def rope_table_op(c: QwenConfig) -> dict:
    """The once program's rope cos/sin table: plain, or with Llama 3 frequency scaling."""
    geometry = [ceil(c.max_context * c.head_dim // 2, 256)]
    sizes = [i32(c.max_context), i32(c.head_dim), f32(c.rope_theta)]
    if c.rope_scaling is None:
        return kernel_op([OUT_F32], "rope_table_f32", ["i32", "i32", "f32"], sizes, geometry,
                         256)
    factor, low, high, original = c.rope_scaling
    return kernel_op([OUT_F32], "rope_table_llama3_f32", ["i32", "i32"] + ["f32"] * 4 + ["i32"],
                     sizes + [f32(factor), f32(low), f32(high), i32(original)], geometry, 256)


def cast_op_name(c: QwenConfig, dtype: str, n: int) -> str:
    """`cast_bf16` (f32) or `cast_f16_bf16` of `hidden` elements; other sizes suffixed _n."""
    name = CASTS[dtype][0]
    return name if n == c.hidden else f"{name}_{n}"


def cast_ops(c: QwenConfig, casts: list[tuple[str, str, int]]) -> dict[str, dict]:
    """One op per (dtype, element count) the derive program casts to bf16."""
    out = {}
    for _, dtype, n in casts:
        out[cast_op_name(c, dtype, n)] = kernel_op([f"in buffer<{dtype}>", OUT_BF16],
                                                   CASTS[dtype][1], ["i32"], [i32(n)],
                                                   [ceil(n, 256)], 256)
    return out


def attn_prefill_smem(hd: int) -> int:
    """attn_prefill_bf16's dynamic shared memory: 576 rows of hd bf16 + 16 bytes (attention.cu)."""
    return 576 * (2 * hd + 16)


# attn_prefill_varlen_sm90a_bf16 (kernels/attention_sm90a.cu): head dim 128 only, 128 (row, q
# head) pairs a block of three warpgroups (one copies, two compute), its dynamic shared memory
# WG_SMEM: 1024 bytes of alignment slack, Q (32 KB), three stages of K and V tiles (64 KB
# each), the stages' mbarriers and the block's last position (64 bytes).
SM90A_PREFILL_HD = 128
SM90A_PREFILL_BLOCK = 384
SM90A_PREFILL_SMEM = 1024 + 32768 + 3 * 65536 + 64


def attn_prefill_op(c: QwenConfig) -> dict:
    """The packed prefill's attention: sequence s's rows are [cu_seqlens[s], cu_seqlens[s+1]),
    grid z = s. Head dim 128 runs on Hopper's wgmma (attention_sm90a.cu, 128 pairs a block);
    other head dims on the mma.sync kernel (attention.cu, 64 pairs a block). Both compute the
    same function (the numpy reference is one), not the same bits."""
    nq, nk, hd = c.heads, c.kv_heads, c.head_dim
    params = [IN_BF16, IN_STATE, IN_I32, IN_I32, IN_I32, OUT_BF16, "i32", "i32"]
    consts = [i32(nq), i32(nk), i32(hd), i32(c.pages_per_seq), f32(1.0 / math.sqrt(hd))]
    if hd == SM90A_PREFILL_HD:
        return kernel_op(params, "attn_prefill_varlen_sm90a_bf16", ["i32"] * 4 + ["f32"], consts,
                         [ceil_div("tokens", 128 // c.group), nk, "seqs"],
                         SM90A_PREFILL_BLOCK, SM90A_PREFILL_SMEM)
    return kernel_op(params, "attn_prefill_varlen_bf16", ["i32"] * 4 + ["f32"], consts,
                     [ceil_div("tokens", 64 // c.group), nk, "seqs"], 256, attn_prefill_smem(hd))


def gemm_op(c_param: str, extern: str, n: int, k: int) -> dict:
    """(A, W, C, m) → extern (A, W, C, m, n, k) with n, k fixed by the model."""
    params = [IN_BF16, IN_BF16, c_param, "i32"]
    launch = {
        "entry": f"extern:{extern}",
        "params": params + ["i32", "i32"],
        "args": [param(i) for i in range(4)] + [i32(n), i32(k)],
    }
    return {"params": params, "impl": {"launches": [launch]}}


def weight(dtype: str, shape: list[int], bind: list[dict], kind: str = "weight") -> dict:
    return {"dtype": dtype, "shape": shape, "kind": kind, "bind": bind}


def workspace(dtype: str, shape: list[Any]) -> dict:
    return {"dtype": dtype, "shape": shape, "kind": "workspace"}


def sorted_map(items: dict) -> dict:
    return {k: items[k] for k in sorted(items, key=lambda s: s.encode())}


# ---- ops -----------------------------------------------------------------------------------


def ops(c: QwenConfig) -> dict[str, dict]:
    nq, nk, hd, eps = c.heads, c.kv_heads, c.head_dim, f32(c.eps)
    rows = "tokens"
    return {
        # embed and silu_mul have Numba-CUDA twins (embedding_gather_bf16_nb, silu_mul_bf16_nb:
        # same bits). A one-off probe on an H200: the embedding twin takes the CUDA C
        # time, the silu_mul twin 1.03x it; the example keeps the CUDA C entries (not slower).
        "embed": kernel_op([IN_I32, IN_BF16, OUT_BF16, "i32"], "embedding_gather_bf16",
                           ["i32"], [i32(c.hidden)], [rows], 128),
        # a block per row (kernels/norm.cu); rmsnorm_last too, per sequence
        "rmsnorm": kernel_op([IN_BF16, IN_BF16, OUT_BF16, "i32"], "rmsnorm_bf16",
                             ["i32", "f32"], [i32(c.hidden), eps], [rows], norm_block(c.hidden)),
        "add_rmsnorm": kernel_op([INOUT_BF16, IN_BF16, IN_BF16, OUT_BF16, "i32"],
                                 "add_rmsnorm_bf16", ["i32", "f32"], [i32(c.hidden), eps],
                                 [rows], norm_block(c.hidden)),
        # q/k head norms, rope and the KV-cache write of a layer in one launch
        # (kernels/qk_rope_kv.cu; any grid is correct): for a prefill chunk a block of 8 warps
        # per row (at head dim 128 a warp takes 4 of the row's heads, sharing its table row
        # and KV slot); for a decode step's few rows a warp per head, a row over several blocks
        **({"qk_rope_kv": qk_rope_kv_op(c, [rows, 1], 256),
            "qk_rope_kv_step": qk_rope_kv_op(c, [rows, -(-(nq + 2 * nk) // 4)], 128)}
           if c.qk_norm else {"rope_kv": rope_kv_op(c)}),
        "attn_prefill": attn_prefill_op(c),
        # a block per split for one sequence (the most parallel); fewer, looping, for a batch
        "attn_decode": attn_decode_op(c, c.decode_splits),
        "attn_decode_batch": attn_decode_op(c, c.decode_batch_blocks),
        # silu_mul steps over its outputs 8 at a time when the sizes allow (kernels/
        # activation.cu); any grid is correct, this one has no idle threads.
        "silu_mul": kernel_op([IN_BF16, OUT_BF16, "i32"], "silu_mul_bf16", ["i32", "i32"],
                              [i32(c.intermediate), i32(c.gate_up_block)],
                              [ceil_div(mul(rows, c.intermediate // vector(
                                  math.gcd(c.intermediate, c.gate_up_block), 8)), 256)], 256),
        "final_norm": kernel_op([IN_BF16, IN_BF16, OUT_BF16, "i32", "i32"], "rmsnorm_last_bf16",
                                ["i32", "f32"], [i32(c.hidden), eps], ["seqs"],
                                norm_block(c.hidden)),
        "final_norm_packed": kernel_op([IN_BF16, IN_BF16, OUT_BF16, IN_I32, "i32"],
                                       "rmsnorm_last_varlen_bf16", ["i32", "f32"],
                                       [i32(c.hidden), eps], ["seqs"], norm_block(c.hidden)),
        "argmax": kernel_op([IN_F32, OUT_I32, "i32"], "argmax_f32", ["i32"], [i32(c.vocab)],
                            ["seqs"], 256),
        "rope_table": rope_table_op(c),
        "qkv_proj": gemm_op(OUT_BF16, "cublaslt_bf16_tn", c.qkv_dim, c.hidden),
        "o_proj": gemm_op(OUT_BF16, "cublaslt_bf16_tn", c.hidden, nq * hd),
        "gate_up_proj": gemm_op(OUT_BF16, "cublaslt_bf16_tn", 2 * c.intermediate, c.hidden),
        "down_proj": gemm_op(INOUT_BF16, "cublaslt_bf16_tn_acc", c.hidden, c.intermediate),
        "lm_head": gemm_op(OUT_F32, "cublas_bf16_tn_f32", c.vocab, c.hidden),
    }


# ---- buffers and states --------------------------------------------------------------------


def bind_tensors(bind: list[dict]) -> list[str]:
    """The checkpoint tensors a bind names, in order."""
    names = []
    for seg in bind:
        names.append(seg["tensor"])
        if "interleave" in seg:
            names.append(seg["interleave"]["with"])
    return names


def bound(b: Binding, base: str, shape: list[int], bind: list[dict]) -> dict[str, dict]:
    """The bf16 buffer `<base>.w` bound to `bind`: a weight when the checkpoint holds bf16,
    else a source `<base>.src` of the file's dtype and a carry the derive program fills."""
    dtypes = {b.dtypes.get(name, "bf16") for name in bind_tensors(bind)}
    if len(dtypes) != 1:
        raise ValueError(f"the tensors of `{base}` ({', '.join(bind_tensors(bind))}) differ "
                         f"in dtype: {', '.join(sorted(dtypes))}")
    dtype = dtypes.pop()
    if dtype == "bf16":
        return {f"{base}.w": weight("bf16", shape, bind)}
    if dtype not in CASTS:
        raise ValueError(f"the tensors of `{base}` are {dtype}, not bf16, f16 or f32")
    return {f"{base}.src": weight(dtype, shape, bind, kind="source"),
            f"{base}.w": {"dtype": "bf16", "shape": shape, "kind": "carry"}}


# ---- FP8 linears -----------------------------------------------------------------------------
# A linear whose checkpoint tensors are e4m3 binds `<base>.w` fp8e4m3 [n, k] to them and
# `<base>.s` f32 [ceil(n/128), ceil(k/128)] to their `weight_scale_inv` tensors (the layout of
# block-wise FP8 checkpoints); with `Binding.quantize` a bf16 linear binds a source `<base>.src`
# that the derive program quantizes into those two carries (kernels/fp8.cu). Decode runs
# gemv_fp8_bf16 on them (the cuda backend launches its tensor-core form where it can:
# runtime/backends/fp8_gemv.py); prefill dequantizes into op scratch and runs the bf16 GEMM.

LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
FP8 = "fp8e4m3"
FP8_BLOCK = 128
SCALE_SUFFIX = "_scale_inv"


def scale_tensor(name: str) -> str:
    """`...proj.weight` -> `...proj.weight_scale_inv`."""
    return name + SCALE_SUFFIX


def scale_rows(rows: list[int], base: str) -> list[int]:
    if any(r % FP8_BLOCK for r in rows):
        raise ValueError(f"the FP8 weight `{base}` binds rows {rows}, not on its "
                         f"{FP8_BLOCK}-row scale blocks")
    return [r // FP8_BLOCK for r in rows]


def scale_bind(bind: list[dict], base: str) -> list[dict]:
    """The bind of a linear's block scales: its segments' tensors' scale tensors, row ranges
    and interleave blocks in scale rows (each a whole number of 128-row blocks)."""
    out = []
    for seg in bind:
        scaled = {"tensor": scale_tensor(seg["tensor"])}
        if "rows" in seg:
            scaled["rows"] = scale_rows(seg["rows"], base)
        if "interleave" in seg:
            scaled["interleave"] = {"with": scale_tensor(seg["interleave"]["with"]),
                                    "rows": scale_rows([seg["interleave"]["rows"]], base)[0]}
        out.append(scaled)
    return out


def scale_shape(shape: list[int]) -> list[int]:
    return [-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK)]


def linear(b: Binding, base: str, shape: list[int], bind: list[dict]) -> dict[str, dict]:
    """A linear's weight: FP8 with its scales when the checkpoint holds e4m3 (or when bf16
    is quantized at load), else as `bound` gives it."""
    dtypes = {b.dtypes.get(name, "bf16") for name in bind_tensors(bind)}
    if dtypes == {FP8}:
        return {f"{base}.w": weight(FP8, shape, bind), **scales(b, base, shape, bind)}
    if dtypes == {"bf16"} and b.quantize:
        return {f"{base}.src": weight("bf16", shape, bind, kind="source"),
                f"{base}.w": {"dtype": FP8, "shape": shape, "kind": "carry"},
                f"{base}.s": {"dtype": "f32", "shape": scale_shape(shape), "kind": "carry"}}
    return bound(b, base, shape, bind)


def scales(b: Binding, base: str, shape: list[int], bind: list[dict]) -> dict[str, dict]:
    """`<base>.s` f32 bound to the scale tensors; bf16 scales (Qwen3's dense FP8 models ship
    them) bind a source `<base>.s.src` that the derive program widens to the f32 carry."""
    sbind = scale_bind(bind, base)
    dtypes = {b.dtypes.get(name, "f32") for name in bind_tensors(sbind)}
    if dtypes == {"f32"}:
        return {f"{base}.s": weight("f32", scale_shape(shape), sbind)}
    if dtypes != {"bf16"}:
        raise ValueError(f"the scales of `{base}` are {', '.join(sorted(dtypes))}, not all f32 "
                         "or all bf16")
    return {f"{base}.s.src": weight("bf16", scale_shape(shape), sbind, kind="source"),
            f"{base}.s": {"dtype": "f32", "shape": scale_shape(shape), "kind": "carry"}}


def scale_casts_of(buffers: dict[str, dict]) -> list[tuple[str, int]]:
    """(base, elements) of every bf16 scale source the derive program widens to f32."""
    return [(name.removesuffix(".s.src"), math.prod(b["shape"]))
            for name, b in sorted(buffers.items()) if name.endswith(".s.src")]


def scale_cast_ops(casts: list[tuple[str, int]]) -> dict[str, dict]:
    return {f"cast_bf16_f32_{n}": kernel_op([IN_BF16, OUT_F32], "cast_bf16_f32", ["i32"],
                                            [i32(n)], [ceil(n, 256)], 256) for _, n in casts}


def fp8_linears(buffers: dict[str, dict]) -> frozenset[str]:
    """The bases (`l3.qkv_proj`) of the linears whose weights are FP8."""
    return frozenset(name.removesuffix(".w") for name, b in buffers.items()
                     if name.endswith(".w") and b["dtype"] == FP8)


def quantizes_of(buffers: dict[str, dict]) -> list[tuple[str, int, int]]:
    """(base, n, k) of every bf16 source the derive program quantizes to FP8."""
    return [(name.removesuffix(".src"), *b["shape"]) for name, b in sorted(buffers.items())
            if b["kind"] == "source" and not name.endswith(".s.src")
            and buffers[name.removesuffix(".src") + ".w"]["dtype"] == FP8]


def linear_shapes(c: QwenConfig) -> dict[str, tuple[int, int, str]]:
    """Each linear's (n, k) and its output param (down_proj accumulates into the residual)."""
    return {"qkv_proj": (c.qkv_dim, c.hidden, OUT_BF16),
            "o_proj": (c.hidden, c.heads * c.head_dim, OUT_BF16),
            "gate_up_proj": (2 * c.intermediate, c.hidden, OUT_BF16),
            "down_proj": (c.hidden, c.intermediate, INOUT_BF16)}


def fp8_ops(c: QwenConfig, used: frozenset[str]) -> dict[str, dict]:
    """The FP8 form of every linear that some layer holds in FP8: `<name>_fp8` (prefill:
    dequantize into op scratch, then the bf16 GEMM) and `<name>_fp8_step` (decode: the FP8
    GEMV)."""
    out = {}
    for name, (n, k, c_param) in linear_shapes(c).items():
        if not any(base.endswith("." + name) for base in used):
            continue
        params = [IN_BF16, "in buffer<fp8e4m3>", IN_F32, c_param, "i32"]
        mode = 1 if c_param == INOUT_BF16 else 0
        extern = "cublaslt_bf16_tn_acc" if mode else "cublaslt_bf16_tn"
        dequantize = kernel_launch("fp8_dequantize_bf16", ["in buffer<fp8e4m3>", IN_F32,
                                                           OUT_BF16, "i32", "i32"],
                                   [param(1), param(2), {"scratch": "w"}, i32(n), i32(k)],
                                   [ceil(n * k, 4096)], 256)
        gemm = {"entry": f"extern:{extern}", "params": [IN_BF16, IN_BF16, c_param] + ["i32"] * 3,
                "args": [param(0), {"scratch": "w"}, param(3), param(4), i32(n), i32(k)]}
        out[f"{name}_fp8"] = {"params": params, "impl": {
            "scratch": {"w": {"dtype": "bf16", "shape": [n, k]}},
            "launches": [dequantize, gemm]}}
        out[f"{name}_fp8_step"] = kernel_op(params, "gemv_fp8_bf16", ["i32", "i32", "i32"],
                                            [i32(n), i32(k), i32(mode)], [ceil(n, 8)], 256)
    return out


def bf16_ops(c: QwenConfig, fp8: frozenset[str]) -> dict[str, dict]:
    """`ops(c)` less the bf16 linears that every layer holds in FP8 (an op nobody calls is
    refused by verify)."""
    return {name: op for name, op in ops(c).items()
            if name not in LINEARS or any(f"l{i}.{name}" not in fp8 for i in range(c.layers))}


def quantize_op_name(n: int, k: int) -> str:
    return f"fp8_quantize_{n}x{k}"


def quantize_ops(quantizes: list[tuple[str, int, int]]) -> dict[str, dict]:
    return {quantize_op_name(n, k): kernel_op(
        [IN_BF16, "out buffer<fp8e4m3>", OUT_F32], "fp8_quantize_bf16", ["i32", "i32"],
        [i32(n), i32(k)], [ceil(k, FP8_BLOCK), ceil(n, FP8_BLOCK)], 256)
        for _, n, k in quantizes}


def kv_bind(c: QwenConfig, b: Binding, tensor: str) -> list[dict]:
    """k_proj or v_proj whole, or with each checkpoint kv head repeated `kv_repeat` times."""
    if b.kv_repeat == 1:
        return [{"tensor": tensor}]
    hd, r = c.head_dim, b.kv_repeat
    return [{"tensor": tensor, "rows": [(j // r) * hd, (j // r + 1) * hd]}
            for j in range(c.kv_heads)]


def layer_weights(c: QwenConfig, b: Binding, i: int) -> dict[str, dict]:
    h, qkv = c.hidden, c.qkv_dim
    out = {
        **bound(b, f"l{i}.input_norm", [h], [{"tensor": hf(i, "input_layernorm")}]),
        **linear(b, f"l{i}.qkv_proj", [qkv, h], [
            {"tensor": hf(i, "self_attn.q_proj")},
            *kv_bind(c, b, hf(i, "self_attn.k_proj")),
            *kv_bind(c, b, hf(i, "self_attn.v_proj")),
        ]),
        **linear(b, f"l{i}.o_proj", [h, c.heads * c.head_dim],
                [{"tensor": hf(i, "self_attn.o_proj")}]),
        **bound(b, f"l{i}.post_norm", [h], [{"tensor": hf(i, "post_attention_layernorm")}]),
        **linear(b, f"l{i}.gate_up_proj", [2 * c.intermediate, h], [{
            "tensor": hf(i, "mlp.gate_proj"),
            "interleave": {"with": hf(i, "mlp.up_proj"), "rows": c.gate_up_block},
        }]),
        **linear(b, f"l{i}.down_proj", [h, c.intermediate], [{"tensor": hf(i, "mlp.down_proj")}]),
    }
    if c.qk_norm:
        out.update(bound(b, f"l{i}.qk_norm", [2, c.head_dim], [
            {"tensor": hf(i, "self_attn.q_norm")},
            {"tensor": hf(i, "self_attn.k_norm")},
        ]))
    return out


def io_buffers(c: QwenConfig) -> dict[str, dict]:
    rows, seqs = ["tokens"], ["seqs"]
    return {
        "token_ids": {"dtype": "i32", "shape": rows, "kind": "input", "fill": "token",
                      "domain": {"index_into": "embed.w"}},
        "positions": {"dtype": "i32", "shape": rows, "kind": "input", "fill": "position",
                      "domain": {"index_into": "rope"}},
        "slot_mapping": {"dtype": "i32", "shape": rows, "kind": "input", "fill": "slot",
                         "domain": {"index_into": "kv.0"}},
        "seq_lens": {"dtype": "i32", "shape": seqs, "kind": "input", "fill": "seq_len",
                     "domain": {"min": 1, "max": c.max_context}},
        "cu_seqlens": {"dtype": "i32", "shape": [c.max_seqs + 1], "kind": "input",
                       "fill": "cu_seqlens", "domain": {"min": 0, "max": c.max_tokens}},
        "block_table": {"dtype": "i32", "shape": ["seqs", c.pages_per_seq], "kind": "input",
                        "domain": {"index_into": "kv.0", "stride": PAGE}},
        "next_tokens": {"dtype": "i32", "shape": seqs, "kind": "output", "fill": "tokens"},
        "logits": {"dtype": "f32", "shape": ["seqs", c.vocab], "kind": "output"},
    }


def model_buffers(c: QwenConfig, b: Binding) -> dict[str, dict]:
    h, embed = c.hidden, "model.embed_tokens.weight"
    head = [{"tensor": embed}] if b.tied else [{"tensor": "lm_head.weight", "rows": [0, c.vocab]}]
    out = {
        **bound(b, "embed", [c.vocab, h], [{"tensor": embed}]),
        **bound(b, "lm_head", [c.vocab, h], head),
        **bound(b, "final_norm", [h], [{"tensor": "model.norm.weight"}]),
        "rope": {"dtype": "f32", "shape": [c.max_context, c.head_dim], "kind": "carry"},
    }
    for i in range(c.layers):
        out.update(layer_weights(c, b, i))
    return out


def casts_of(buffers: dict[str, dict]) -> list[tuple[str, str, int]]:
    """(base name, source dtype, elements) of every source the derive program casts."""
    out = []
    for name in sorted(buffers, key=str.encode):
        buf_ = buffers[name]
        if buf_["kind"] == "source" and buf_["dtype"] != "bf16":  # bf16 sources quantize
            out.append((name.removesuffix(".src"), buf_["dtype"], math.prod(buf_["shape"])))
    return out


def workspaces(c: QwenConfig) -> dict[str, dict]:
    t = "tokens"
    return {
        "residual": workspace("bf16", [t, c.hidden]),
        "normed": workspace("bf16", [t, c.hidden]),
        "qkv": workspace("bf16", [t, c.qkv_dim]),
        "attn_out": workspace("bf16", [t, c.heads * c.head_dim]),
        "o_out": workspace("bf16", [t, c.hidden]),
        "gate_up": workspace("bf16", [t, 2 * c.intermediate]),
        "act": workspace("bf16", [t, c.intermediate]),
        "final_normed": workspace("bf16", ["seqs", c.hidden]),
        # attn_decode's split partials: [m | l | o[hd]] per (q head, split) of each sequence.
        "attn_partials": workspace("f32", ["seqs", c.heads * c.decode_splits * (c.head_dim + 2)]),
    }


# ---- programs ------------------------------------------------------------------------------


def call(label: str, op: str, *args: dict) -> dict:
    return {"label": label, "op": op, "args": list(args)}


def layer_calls(c: QwenConfig, i: int, prefill: bool, batched: bool = False,
                fp8: frozenset[str] = frozenset()) -> list[dict]:
    """Layer i's calls; prefill, decode and the batched decode differ only in the attention
    op (and an FP8 linear's op: `fp8_ops`)."""
    rows, pre = var("tokens"), f"l{i}."

    def w(name: str) -> dict:
        return buf(f"{pre}{name}.w")

    def proj(name: str, x: str, out: str) -> dict:
        if pre + name not in fp8:
            return call(pre + name, name, buf(x), w(name), buf(out), rows)
        op = f"{name}_fp8" if prefill else f"{name}_fp8_step"
        return call(pre + name, op, buf(x), w(name), buf(f"{pre}{name}.s"), buf(out), rows)

    if prefill:
        attention = call(pre + "attention", "attn_prefill", buf("qkv"), {"state": f"kv.{i}"},
                         buf("block_table"), buf("positions"), buf("cu_seqlens"),
                         buf("attn_out"), rows, var("seqs"))
    else:
        attention = call(pre + "attention", "attn_decode_batch" if batched else "attn_decode",
                         buf("qkv"), {"state": f"kv.{i}"},
                         buf("block_table"), buf("seq_lens"), buf("attn_out"),
                         buf("attn_partials"), var("seqs"))
    if c.qk_norm:
        rope = call(pre + "qk_rope_kv", "qk_rope_kv" if prefill else "qk_rope_kv_step",
                    buf("qkv"), w("qk_norm"),
                    buf("positions"), buf("rope"), buf("slot_mapping"), {"state": f"kv.{i}"},
                    rows)
    else:
        rope = call(pre + "rope_kv", "rope_kv", buf("qkv"), buf("positions"), buf("rope"),
                    buf("slot_mapping"), {"state": f"kv.{i}"}, rows)
    calls = [
        call(pre + "input_norm", "rmsnorm", buf("residual"), w("input_norm"), buf("normed"), rows),
        proj("qkv_proj", "normed", "qkv"),
        rope,
        attention,
        proj("o_proj", "attn_out", "o_out"),
        call(pre + "post_norm", "add_rmsnorm", buf("residual"), buf("o_out"), w("post_norm"),
             buf("normed"), rows),
        proj("gate_up_proj", "normed", "gate_up"),
        call(pre + "act", "silu_mul", buf("gate_up"), buf("act"), rows),
        proj("down_proj", "act", "residual"),
    ]
    assert [x["label"] for x in calls] == [pre + name for name in layer_call_names(c)]
    return calls


def forward_calls(c: QwenConfig, prefill: bool, batched: bool = False,
                  fp8: frozenset[str] = frozenset()) -> list[dict]:
    rows, seqs = var("tokens"), var("seqs")
    calls = [call("embed", "embed", buf("token_ids"), buf("embed.w"), buf("residual"), rows)]
    for i in range(c.layers):
        calls += layer_calls(c, i, prefill, batched, fp8)
    # The last row of each sequence feeds the head: row cu_seqlens[s+1]-1 of a packed prefill
    # chunk, every row of a decode call.
    if prefill:
        final_norm = call("final_norm", "final_norm_packed", buf("residual"),
                          buf("final_norm.w"), buf("final_normed"), buf("cu_seqlens"), seqs)
    else:
        final_norm = call("final_norm", "final_norm", buf("residual"), buf("final_norm.w"),
                          buf("final_normed"), seqs, i32(1))
    calls += [
        final_norm,
        call("lm_head", "lm_head", buf("final_normed"), buf("lm_head.w"), buf("logits"), seqs),
        call("argmax", "argmax", buf("logits"), buf("next_tokens"), seqs),
    ]
    return calls


def programs(c: QwenConfig, casts: list[tuple[str, str, int]],
             quantizes: list[tuple[str, int, int]] = (),
             fp8: frozenset[str] = frozenset(),
             scale_casts: list[tuple[str, int]] = ()) -> dict[str, dict]:
    out = {
        # packed: up to `seqs` sequences per chunk, split by `cu_seqlens` (spec §4.4, §6.2)
        "prefill": {"batch": {"groups": c.max_seqs, "rows": "tokens"},
                    "calls": forward_calls(c, True, fp8=fp8)},
        "decode": {"batch": {"groups": 1, "rows": 1}, "graph": True,
                   "calls": forward_calls(c, False, fp8=fp8)},
        "decode_batch": {"batch": {"groups": c.max_seqs, "rows": 1}, "graph": True,
                         "calls": forward_calls(c, False, batched=True, fp8=fp8)},
        "load": {"once": True, "calls": [call("rope_table", "rope_table", buf("rope"))]},
    }
    derive = [call(f"{base}.cast", cast_op_name(c, dtype, n), buf(f"{base}.src"),
                   buf(f"{base}.w")) for base, dtype, n in casts]
    derive += [call(f"{base}.quantize", quantize_op_name(n, k), buf(f"{base}.src"),
                    buf(f"{base}.w"), buf(f"{base}.s")) for base, n, k in quantizes]
    derive += [call(f"{base}.s.cast", f"cast_bf16_f32_{n}", buf(f"{base}.s.src"),
                    buf(f"{base}.s")) for base, n in scale_casts]
    if derive:
        out["convert"] = {"derive": True, "calls": derive}
    return out


def modules(op_map: dict[str, dict]) -> dict[str, dict]:
    used = {x["module"] for o in op_map.values() for x in o["impl"]["launches"] if "module" in x}
    index = library.index()
    return {name: {"source": Path(index[name]["file"]).name, "sha256": index[name]["sha256"]}
            for name in used}


def manifest(c: QwenConfig, model: str, binding: Binding | None = None) -> dict[str, Any]:
    """The manifest of model `c` over a checkpoint as `binding` describes it (default: the
    example's own checkpoint: bf16 with an f32 final norm, untied)."""
    b = binding or example_binding(c)
    model_bufs = model_buffers(c, b)
    casts = casts_of(model_bufs)
    quantizes, fp8 = quantizes_of(model_bufs), fp8_linears(model_bufs)
    scale_casts = scale_casts_of(model_bufs)
    op_map = {**bf16_ops(c, fp8), **cast_ops(c, casts), **fp8_ops(c, fp8),
              **quantize_ops(quantizes), **scale_cast_ops(scale_casts)}
    return {
        "schema_version": 5,
        "model": model,
        "vars": {
            "seqs": {"max": c.max_seqs, "axis": "groups"},
            "tokens": {"max": c.max_tokens, "axis": "rows"},
        },
        "states": sorted_map({f"kv.{i}": {"bytes_per_token": c.kv_bytes_per_token}
                              for i in range(c.layers)}),
        "buffers": sorted_map({**io_buffers(c), **model_bufs, **workspaces(c)}),
        "modules": sorted_map(modules(op_map)),
        "ops": sorted_map(op_map),
        "programs": sorted_map(programs(c, casts, quantizes, fp8, scale_casts)),
    }


def example_binding(c: QwenConfig) -> Binding:
    """The example checkpoint's binding: bf16 except the f32 `model.norm.weight`."""
    return Binding({"model.norm.weight": "f32"})


# ---- entry point ---------------------------------------------------------------------------


def generate(out_dir: str | Path, size: str = "tiny", **overrides: float
             ) -> tuple[Path, Path]:
    """Write model.json, model.safetensors, config.json and the text files (TEXT_FILES);
    return (manifest, weights) paths."""
    from kerncc.example.text import tokenizer_files

    c = make_config(size, **overrides)
    texts = tokenizer_files(c)  # before writing anything: a vocabulary too small fails here
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path, weights_path = out / "model.json", out / "model.safetensors"
    text = json.dumps(manifest(c, f"kerncc-qwen3-{size}"), indent=2, ensure_ascii=False)
    manifest_path.write_text(text + "\n")
    (out / "config.json").write_text(json.dumps(c.to_hf(), indent=2) + "\n")
    for name, body in texts.items():
        (out / name).write_text(body)
    save_file(checkpoint(c), weights_path, metadata={"format": "pt"})
    return manifest_path, weights_path
