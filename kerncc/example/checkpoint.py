"""The example model's checkpoint: deterministic random weights under HF Qwen3 tensor names.

Everything is bf16 except `model.norm.weight` (f32, cast by the manifest's `derive` program);
`lm_head.weight` has exactly vocab rows, so transformers loads the file as written. Values
come from one seeded numpy Generator drawn in a fixed order, so a seed gives the same bytes.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from kerncc.example.config import QwenConfig

BF16 = np.dtype(ml_dtypes.bfloat16)


def hf(i: int, name: str) -> str:
    return f"model.layers.{i}.{name}.weight"


def random_bf16(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Random bf16 built from random bits: fast enough for billions of weights.

    sign and 7 mantissa bits random, exponent uniform over four octaves below 2^b; such
    values have a standard deviation of about 0.88 * 2^b, so b is picked from `std`.
    """
    b = round(math.log2(std / 0.88))
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    exponent = (127 + b - 3 + ((bits >> 7) & 3)).astype(np.uint16) << 7
    return ((bits & 0x807F) | exponent).view(BF16)


def norm_weight(rng: np.random.Generator, n: int, dtype: np.dtype = BF16) -> np.ndarray:
    return rng.uniform(0.8, 1.2, size=n).astype(np.float32).astype(dtype)


def layer_tensors(c: QwenConfig, rng: np.random.Generator, i: int) -> dict[str, np.ndarray]:
    h, hd, inter = c.hidden, c.head_dim, c.intermediate

    def proj(rows: int, cols: int) -> np.ndarray:
        return random_bf16(rng, (rows, cols), 1 / math.sqrt(cols))  # unit-variance outputs

    return {
        hf(i, "input_layernorm"): norm_weight(rng, h),
        hf(i, "self_attn.q_proj"): proj(c.heads * hd, h),
        hf(i, "self_attn.k_proj"): proj(c.kv_heads * hd, h),
        hf(i, "self_attn.v_proj"): proj(c.kv_heads * hd, h),
        hf(i, "self_attn.q_norm"): norm_weight(rng, hd),
        hf(i, "self_attn.k_norm"): norm_weight(rng, hd),
        hf(i, "self_attn.o_proj"): proj(h, c.heads * hd),
        hf(i, "post_attention_layernorm"): norm_weight(rng, h),
        hf(i, "mlp.gate_proj"): proj(inter, h),
        hf(i, "mlp.up_proj"): proj(inter, h),
        hf(i, "mlp.down_proj"): proj(h, inter),
    }


def checkpoint(c: QwenConfig) -> dict[str, np.ndarray]:
    """HF Qwen3 tensors; `model.norm.weight` is f32 (the derive program casts it)."""
    from kerncc.progress import progress  # a bar on a terminal only

    rng = np.random.default_rng(c.seed)
    tensors = {"model.embed_tokens.weight": random_bf16(rng, (c.vocab, c.hidden), 1.0)}
    for i in progress(range(c.layers), "generating weights", unit="layers"):
        tensors.update(layer_tensors(c, rng, i))
    tensors["model.norm.weight"] = norm_weight(rng, c.hidden, np.dtype(np.float32))
    # Drawn padded past vocab and cut back, so the values are those of the earlier padded
    # checkpoint (and the example's tokens did not change when the padding went).
    head = random_bf16(rng, (c.padded_vocab, c.hidden), 1 / math.sqrt(c.hidden))
    tensors["lm_head.weight"] = np.ascontiguousarray(head[:c.vocab])
    return tensors
