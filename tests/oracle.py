"""An independent numpy forward of the example model: the oracle the manifest is checked against.

Written from the architecture (HF `Qwen3ForCausalLM`), not from the manifest or the kernel
library: it reads the raw checkpoint tensors by their HF names and recomputes the whole
sequence with no cache. bf16 rounding sits where HF's bf16 modules round (after every linear,
norm, rope, activation and residual add); arithmetic is f32. The rope cos/sin follow HF's f32
recipe. Results agree with the kernels within bf16 tolerance, not bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np

from kerncc.example.config import QwenConfig
from kerncc.checkpoint.safetensors import load_file

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


def bf16(x: np.ndarray) -> np.ndarray:
    """Round to bf16 and come back to f32 (values stay f32 arrays between steps)."""
    return np.asarray(x, dtype=F32).astype(BF16).astype(F32)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return bf16(weight * bf16(x / np.sqrt(variance + np.float32(eps))))


def linear(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    return bf16(x @ weight.T)


def rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class Oracle:
    """`Oracle(weights_path, config)`; config defaults to `config.json` beside the weights."""

    def __init__(self, weights_path: str | Path, config: QwenConfig | None = None) -> None:
        path = Path(weights_path)
        self.config = config or QwenConfig.load(path.parent / "config.json")
        # All weights as f32 copies of their bf16 (or f32) values.
        self.tensors = {name: t.astype(F32) for name, t in load_file(path).items()}

    def weight(self, name: str) -> np.ndarray:
        return self.tensors[name]

    def layer(self, i: int, name: str) -> np.ndarray:
        return self.tensors[f"model.layers.{i}.{name}.weight"]

    def rope(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin [n, head_dim] as HF's Qwen3RotaryEmbedding builds them (f32)."""
        c = self.config
        exponent = np.arange(0, c.head_dim, 2, dtype=np.int64).astype(F32) / np.float32(c.head_dim)
        inv_freq = (np.float32(1.0) / (np.float32(c.rope_theta) ** exponent)).astype(F32)
        freqs = np.arange(n, dtype=F32)[:, None] * inv_freq[None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)
        return np.cos(emb).astype(F32), np.sin(emb).astype(F32)

    def attention(self, i: int, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        c = self.config
        n = x.shape[0]
        q = linear(x, self.layer(i, "self_attn.q_proj")).reshape(n, c.heads, c.head_dim)
        k = linear(x, self.layer(i, "self_attn.k_proj")).reshape(n, c.kv_heads, c.head_dim)
        v = linear(x, self.layer(i, "self_attn.v_proj")).reshape(n, c.kv_heads, c.head_dim)
        q = rms_norm(q, self.layer(i, "self_attn.q_norm"), c.eps)
        k = rms_norm(k, self.layer(i, "self_attn.k_norm"), c.eps)
        q = bf16(q * cos[:, None] + rotate_half(q) * sin[:, None])
        k = bf16(k * cos[:, None] + rotate_half(k) * sin[:, None])
        k = np.repeat(k, c.group, axis=1)  # grouped-query: each kv head serves `group` q heads
        v = np.repeat(v, c.group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.float32(np.sqrt(c.head_dim))
        scores = np.where(np.tril(np.ones((n, n), bool))[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        out = bf16(np.einsum("hqk,khd->qhd", probs, v)).reshape(n, c.heads * c.head_dim)
        return linear(out, self.layer(i, "self_attn.o_proj"))

    def mlp(self, i: int, x: np.ndarray) -> np.ndarray:
        gate = linear(x, self.layer(i, "mlp.gate_proj"))
        up = linear(x, self.layer(i, "mlp.up_proj"))
        with np.errstate(over="ignore"):
            act = bf16(bf16(gate / (np.float32(1) + np.exp(-gate))) * up)
        return linear(act, self.layer(i, "mlp.down_proj"))

    def hidden(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """Final-normed hidden states [n, hidden] of a whole sequence."""
        c = self.config
        ids = np.asarray(token_ids, dtype=np.int64)
        x = self.weight("model.embed_tokens.weight")[ids]
        cos, sin = self.rope(len(ids))
        for i in range(c.layers):
            h = rms_norm(x, self.layer(i, "input_layernorm"), c.eps)
            x = bf16(x + self.attention(i, h, cos, sin))
            h = rms_norm(x, self.layer(i, "post_attention_layernorm"), c.eps)
            x = bf16(x + self.mlp(i, h))
        # HF loads the f32 norm weight into a bf16 model: the weight itself is rounded.
        return rms_norm(x, bf16(self.weight("model.norm.weight")), c.eps)

    def logits(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """Logits [n, vocab] (f32) for every position of the sequence."""
        lm_head = self.weight("lm_head.weight")[: self.config.vocab]  # padded past vocab
        return (self.hidden(token_ids) @ lm_head.T).astype(F32)

    def greedy(self, prompt: list[int], max_new: int) -> list[int]:
        """The `max_new` tokens greedy decoding appends to `prompt`."""
        tokens = list(prompt)
        for _ in range(max_new):
            tokens.append(int(np.argmax(self.logits(tokens)[-1])))
        return tokens[len(prompt):]
