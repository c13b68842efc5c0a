"""A PyTorch eager reference of the example model: the baseline kerncc's runtime is timed against.

`TorchQwen(model_dir, device)` reads what `kerncc example qwen` writes (`config.json`,
`model.safetensors`) and serves one sequence the way a PyTorch user would write it by hand:
bf16 weights on the device, plain functions over plain tensors, `F.linear` matmuls,
`F.scaled_dot_product_attention` (grouped-query via `enable_gqa`), no torch.compile and no
CUDA graphs, everything under `torch.inference_mode()`.

The math is tests/oracle.py's (HF `Qwen3ForCausalLM`): bf16 rounding after every linear,
norm, rope, activation and residual add; RMS norms in f32; q/k norms per head; neox rope with
cos/sin built by HF's f32 recipe and applied in f32; SiLU-gated MLP; the final norm's f32
weight rounded to bf16; logits f32 from rows [0, vocab) of the padded lm_head. One place
differs: attention runs in SDPA's bf16 kernels, which keep the softmax probabilities in less
than the oracle's f32 (logits then agree within ~1% of the largest; with SDPA in f32 most
prompts agree to f32 rounding). Choices a tuned eager baseline makes and the oracle does not,
each the same math in fewer launches: q/k/v and gate/up are each one matmul over concatenated
weights; q and k heads are normed and rotated together; norms use `F.rms_norm`; only the last
row goes through the final norm and lm_head (f32 out of a bf16 matmul via `out_dtype` on
CUDA, an f32 copy of lm_head elsewhere).

The KV cache is preallocated: per layer one contiguous K and one V tensor of
[1, kv_heads, max_context, head_dim] bf16, filled in place; attention reads the prefix
[0, length) as a view. `prefill(tokens)` appends a chunk to the cached sequence (causal
within the chunk; a chunk after cached tokens uses an explicit mask), `decode(token)` appends
one token, `reset()` empties the cache, `generate(prompt, max_new)` is greedy decoding from a
fresh cache: the first token from prefill's last row, as kerncc's serving does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from bench.gpu import torch_ms
from kerncc.example.config import QwenConfig
from kerncc.checkpoint.safetensors import SafeTensors

BF16 = torch.bfloat16
F32 = torch.float32


# ---------------------------------------------------------------------------------------------
# Weights


def to_torch(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A bf16 device tensor from a safetensors array (bf16 via its bits; f32 rounded)."""
    if array.dtype == np.float32:
        return torch.from_numpy(np.array(array)).to(device=device, dtype=BF16)
    bits = np.array(array).view(np.int16)  # numpy has no bf16 torch understands
    return torch.from_numpy(bits).view(BF16).to(device)


@attrs.frozen
class Layer:
    """One decoder layer's weights, q/k/v and gate/up concatenated along the output rows."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qk_norm: torch.Tensor  # [heads + kv_heads, head_dim]: q_norm's row per q head, then k_norm's
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def load_layer(c: QwenConfig, get: Callable[[str], torch.Tensor], i: int) -> Layer:
    def w(name: str) -> torch.Tensor:
        return get(f"model.layers.{i}.{name}.weight")

    qk_norm = [w("self_attn.q_norm").expand(c.heads, -1),
               w("self_attn.k_norm").expand(c.kv_heads, -1)]
    return Layer(
        input_norm=w("input_layernorm"),
        qkv=torch.cat([w("self_attn.q_proj"), w("self_attn.k_proj"), w("self_attn.v_proj")]),
        qk_norm=torch.cat(qk_norm),
        o_proj=w("self_attn.o_proj"), post_norm=w("post_attention_layernorm"),
        gate_up=torch.cat([w("mlp.gate_proj"), w("mlp.up_proj")]), down=w("mlp.down_proj"))


# ---------------------------------------------------------------------------------------------
# The math (bf16 tensors in and out; f32 inside where the oracle computes in f32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Qwen3RMSNorm: normalise in f32, round, then scale by the bf16 weight (rounds).

    F.rms_norm without a weight computes in f32 and rounds once, as HF's module does before
    its weight; passing the weight would skip that rounding.
    """
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def rope_table(c: QwenConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_context, head_dim] f32, as HF's Qwen3RotaryEmbedding builds them."""
    exponent = torch.arange(0, c.head_dim, 2, dtype=torch.int64).to(F32) / c.head_dim
    inv_freq = 1.0 / (c.rope_theta ** exponent)
    freqs = torch.arange(c.max_context, dtype=F32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rope on [n, heads, head_dim] in f32 (cos/sin [n, 1, head_dim]), rounded once."""
    x32 = x.float()
    return (x32 * cos + rotate_half(x32) * sin).to(BF16)


def causal_mask(start: int, n: int, device: torch.device) -> torch.Tensor:
    """[n, start + n] bool: row r (position start + r) sees keys at positions <= its own."""
    keys = torch.arange(start + n, device=device)
    rows = torch.arange(start, start + n, device=device)
    return keys[None, :] <= rows[:, None]


# ---------------------------------------------------------------------------------------------
# The model


class TorchQwen:
    """Eager PyTorch forward of the example model over a preallocated KV cache (one sequence)."""

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cuda") -> None:
        path = Path(model_dir)
        self.config = QwenConfig.load(path / "config.json")
        self.device = torch.device(device)
        with torch.inference_mode():
            self._load(path / "model.safetensors")
            self.cos, self.sin = rope_table(self.config, self.device)
            self.k_cache, self.v_cache = self._cache(), self._cache()
        self.length = 0  # tokens in the cache

    def _load(self, weights: Path) -> None:
        c = self.config
        with SafeTensors(weights) as f:
            def get(name: str) -> torch.Tensor:
                return to_torch(f.get(name), self.device)

            self.embed = get("model.embed_tokens.weight")
            self.layers = [load_layer(c, get, i) for i in range(c.layers)]
            # HF loads the f32 norm weight into a bf16 model: the weight itself is rounded.
            self.norm = get("model.norm.weight")
            self.lm_head = get("lm_head.weight")[: c.vocab].contiguous()  # padded past vocab
        self._lm_head_f32 = None if self._mm_to_f32_works() else self.lm_head.float()

    def _mm_to_f32_works(self) -> bool:
        """Whether this device multiplies bf16 into f32 directly (CUDA); else an f32 lm_head."""
        probe = torch.ones(1, 8, dtype=BF16, device=self.device)
        try:
            torch.mm(probe, probe.t(), out_dtype=F32)
        except (RuntimeError, NotImplementedError, TypeError):
            return False
        return True

    def _cache(self) -> list[torch.Tensor]:
        c = self.config
        shape = (1, c.kv_heads, c.max_context, c.head_dim)
        return [torch.zeros(shape, dtype=BF16, device=self.device) for _ in range(c.layers)]

    # ------------------------------------------------------------------------ serving

    def reset(self) -> None:
        """Forget the cached sequence (the cache's contents are overwritten as it refills)."""
        self.length = 0

    @torch.inference_mode()
    def prefill(self, tokens: list[int]) -> torch.Tensor:
        """Append `tokens` to the sequence; the logits [vocab] (f32) of its last row."""
        if not tokens:
            raise ValueError("prefill needs at least one token")
        return self._forward(tokens)

    @torch.inference_mode()
    def decode(self, token: int) -> torch.Tensor:
        """Append one token; its logits [vocab] (f32)."""
        return self._forward([token])

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_new: int) -> list[int]:
        """The `max_new` tokens greedy decoding appends to `prompt`, from an empty cache."""
        self.reset()
        generated: list[int] = []
        logits = self.prefill(prompt)
        while len(generated) < max_new:
            generated.append(int(torch.argmax(logits)))
            if len(generated) < max_new:
                logits = self.decode(generated[-1])
        return generated

    # ------------------------------------------------------------------------ forward

    def _forward(self, tokens: list[int]) -> torch.Tensor:
        c = self.config
        start, n = self.length, len(tokens)
        if start + n > c.max_context:
            raise ValueError(f"the sequence needs {start + n} tokens, the cache holds "
                             f"{c.max_context}")
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        return self.forward_ids(ids)

    def forward_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """`_forward` of token ids already on the device: no host copy, so a CUDA graph can
        capture it (at a fixed cache length: the length is read when it is captured)."""
        c = self.config
        start, n = self.length, ids.shape[0]
        x = F.embedding(ids, self.embed)
        cos, sin = self.cos[start:start + n, None], self.sin[start:start + n, None]
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, c.eps)
            x = x + self._attention(i, layer, h, cos, sin, start)
            h = rms_norm(x, layer.post_norm, c.eps)
            x = x + self._mlp(layer, h)
        self.length = start + n
        return self._logits(rms_norm(x[-1:], self.norm, c.eps))

    def _attention(self, i: int, layer: Layer, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, start: int) -> torch.Tensor:
        c = self.config
        n, end = x.shape[0], start + x.shape[0]
        qkv = F.linear(x, layer.qkv).view(n, c.heads + 2 * c.kv_heads, c.head_dim)
        # q and k heads are normed (per head) and rotated together: the same math, fewer launches.
        qk = apply_rope(rms_norm(qkv[:, : c.heads + c.kv_heads], layer.qk_norm, c.eps), cos, sin)
        q, k, v = qk[:, : c.heads], qk[:, c.heads:], qkv[:, c.heads + c.kv_heads:]
        # [n, heads, d] -> [1, heads, n, d], the layout of the cache and of SDPA.
        self.k_cache[i][0, :, start:end] = k.transpose(0, 1)
        self.v_cache[i][0, :, start:end] = v.transpose(0, 1)
        keys, values = self.k_cache[i][:, :, :end], self.v_cache[i][:, :, :end]
        query = q.transpose(0, 1).unsqueeze(0)
        # SDPA's is_causal aligns the diagonal top-left: right only when no key precedes the chunk.
        mask = causal_mask(start, n, self.device) if start and n > 1 else None
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                             is_causal=start == 0 and n > 1, enable_gqa=True)
        return F.linear(out[0].transpose(0, 1).reshape(n, c.heads * c.head_dim), layer.o_proj)

    def _mlp(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer.down)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """f32 logits [vocab] of one final-normed row [1, hidden] (bf16 values, f32 products)."""
        if self._lm_head_f32 is not None:
            return (h.float() @ self._lm_head_f32.t())[0]
        return torch.mm(h, self.lm_head.t(), out_dtype=F32)[0]


def decode_step_ms(ref: TorchQwen, prompt: list[int], reps: int = 100) -> tuple[float, float]:
    """GPU ms of one decode step after `prompt`, (eager, eager captured in one CUDA graph).

    The step is captured at the cache length after the prompt (warmed up on a side stream
    first) and replayed `reps` times back to back at that length, between two events; the
    eager step is timed the same way (its time is mostly the host's, issuing ~25 kernels a
    layer from Python).
    """
    ref.reset()
    ref.prefill(prompt)
    start = ref.length
    ids = torch.tensor([17], dtype=torch.int64, device=ref.device)

    def step() -> torch.Tensor:
        ref.length = start
        return ref.forward_ids(ids)

    def timed(fn: Callable[[], object], n: int) -> float:
        with torch.inference_mode():
            return torch_ms(fn, n)

    eager = timed(step, max(reps // 2, 1))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        step()
    replay = timed(graph.replay, reps)
    ref.reset()
    return eager, replay
