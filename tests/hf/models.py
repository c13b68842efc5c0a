"""Test models in the Hugging Face layout, and an independent float32 numpy forward of them.

`write_model(dir, family, ...)` writes config.json and random weights under the HF tensor
names (one file or two shards with model.safetensors.index.json; bf16, f16 or f32; tied or
untied), or only the header of each file (`header_only`: the tensor table without data, what
an import of a real-size model reads). `forward(dir, ids)` recomputes the logits of every
position in float32 from the checkpoint, written from transformers' Qwen3/Llama modeling code
(RMSNorm in f32 times the weight, q/k head norms for Qwen3, rotate-half rope with the default
or llama3 frequencies, repeat_kv grouped-query attention with a causal mask, SiLU-gated MLP,
tied or separate head); it shares no code with kerncc's kernels or builder.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from kerncc.checkpoint.safetensors import dtype_name, load_file, save_file

DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "f16": np.dtype(np.float16),
          "f32": np.dtype(np.float32)}
ARCH = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM"}


def config_json(family: str, *, layers: int = 2, hidden: int = 64, heads: int = 4,
                kv_heads: int = 2, head_dim: int = 16, intermediate: int = 96, vocab: int = 200,
                max_position: int = 256, tied: bool = False, theta: float = 10000.0,
                rope_scaling: dict | None = None, **extra: Any) -> dict:
    out = {
        "architectures": [ARCH[family]], "model_type": family, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": vocab, "max_position_embeddings": max_position, "rms_norm_eps": 1e-6,
        "rope_theta": theta, "rope_scaling": rope_scaling, "tie_word_embeddings": tied,
        "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2,
    }
    if family == "mistral":
        out["sliding_window"] = None
    out.update(extra)
    return out


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    h = config["hidden_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    nq, nk, inter = config["num_attention_heads"], config["num_key_value_heads"], \
        config["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = {"input_layernorm": (h,), "post_attention_layernorm": (h,),
                 "self_attn.q_proj": (nq * hd, h), "self_attn.k_proj": (nk * hd, h),
                 "self_attn.v_proj": (nk * hd, h), "self_attn.o_proj": (h, nq * hd),
                 "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                 "mlp.down_proj": (h, inter)}
        if config["model_type"] == "qwen3":
            layer.update({"self_attn.q_norm": (hd,), "self_attn.k_norm": (hd,)})
        shapes.update({f"{p}{k}.weight": v for k, v in layer.items()})
    return shapes


def random_tensors(config: dict, dtype: str, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in tensor_shapes(config).items():
        if len(shape) == 1:
            value = rng.uniform(0.7, 1.3, size=shape)
        elif name == "model.embed_tokens.weight":
            value = rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / math.sqrt(shape[1])
        out[name] = value.astype(np.float32).astype(DTYPES[dtype])
    return out


def _header_only(path: Path, shapes: dict[str, tuple[int, ...]], dtype: str) -> None:
    """A safetensors file holding only the header (offsets as if the data followed)."""
    entries, offset, size = {}, 0, DTYPES[dtype].itemsize
    for name in sorted(shapes):
        n = math.prod(shapes[name]) * size
        entries[name] = {"dtype": dtype_name(DTYPES[dtype]), "shape": list(shapes[name]),
                         "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def write_model(directory: Path, family: str, *, dtype: str = "bf16", shards: int = 1,
                seed: int = 0, header_only: bool = False, config: dict | None = None,
                **sizes: Any) -> Path:
    """A model folder: config.json and the checkpoint (see the module docstring)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = config or config_json(family, **sizes)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    shapes = tensor_shapes(config)
    names = sorted(shapes)
    files = ["model.safetensors"] if shards == 1 else [
        f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
    groups = [names[k::shards] for k in range(shards)]
    tensors = None if header_only else random_tensors(config, dtype, seed)
    for file, group in zip(files, groups, strict=True):
        if header_only:
            _header_only(directory / file, {n: shapes[n] for n in group}, dtype)
        else:
            save_file({n: tensors[n] for n in group}, directory / file,
                      metadata={"format": "pt"})
    if shards > 1:
        index = {"metadata": {}, "weight_map": {n: files[k] for k, g in enumerate(groups)
                                                for n in g}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return directory


# ---------------------------------------------------------------------------------------------
# The float32 forward (transformers' modeling code, in numpy)


def load_tensors(directory: Path) -> dict[str, np.ndarray]:
    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) \
        if index.exists() else ["model.safetensors"]
    out: dict[str, np.ndarray] = {}
    for f in files:
        out.update({k: v.astype(np.float32) for k, v in load_file(directory / f).items()})
    return out


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return w * (x / np.sqrt(variance + eps))


def v5_layout(config: dict) -> dict:
    """The config as transformers 5 writes it: `rope_parameters` holds theta and scaling, and
    a bare config has no `architectures`."""
    out = {k: v for k, v in config.items()
           if k not in ("rope_theta", "rope_scaling", "architectures")}
    out["rope_parameters"] = {"rope_type": "default", **(config.get("rope_scaling") or {}),
                              "rope_theta": config["rope_theta"]}
    return out


def inv_freq(config: dict) -> np.ndarray:
    hd = config["head_dim"]
    params = config.get("rope_parameters")
    theta = params["rope_theta"] if params else config["rope_theta"]
    base = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    scaling = params if params and params["rope_type"] == "llama3" else config.get(
        "rope_scaling")
    if not scaling:
        return base.astype(np.float32)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / base
    llama = np.where(wavelen > old / low, base / factor, base)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * llama / factor + smooth * llama
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, llama).astype(np.float32)


def rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def forward(directory: Path, ids: list[int]) -> np.ndarray:
    """Logits [len(ids), vocab] in float32."""
    config = json.loads((directory / "config.json").read_text())
    t = load_tensors(directory)
    n, eps = len(ids), config["rms_norm_eps"]
    hd = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    nq, nk = config["num_attention_heads"], config["num_key_value_heads"]
    freqs = np.arange(n, dtype=np.float32)[:, None] * inv_freq(config)[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[:, None], np.sin(emb)[:, None]
    x = t["model.embed_tokens.weight"][np.asarray(ids)]
    mask = np.tril(np.ones((n, n), bool))
    for i in range(config["num_hidden_layers"]):
        w = {k[len(f"model.layers.{i}."):-len(".weight")]: v for k, v in t.items()
             if k.startswith(f"model.layers.{i}.")}
        h = rms_norm(x, w["input_layernorm"], eps)
        q = (h @ w["self_attn.q_proj"].T).reshape(n, nq, hd)
        k = (h @ w["self_attn.k_proj"].T).reshape(n, nk, hd)
        v = (h @ w["self_attn.v_proj"].T).reshape(n, nk, hd)
        if config["model_type"] == "qwen3":
            q, k = rms_norm(q, w["self_attn.q_norm"], eps), rms_norm(k, w["self_attn.k_norm"], eps)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, nq // nk, axis=1), np.repeat(v, nq // nk, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        scores = np.where(mask[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(n, nq * hd)
        x = x + attn @ w["self_attn.o_proj"].T
        h = rms_norm(x, w["post_attention_layernorm"], eps)
        gate, up = h @ w["mlp.gate_proj"].T, h @ w["mlp.up_proj"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w["mlp.down_proj"].T
    x = rms_norm(x, t["model.norm.weight"], eps)
    head = t["model.embed_tokens.weight"] if config["tie_word_embeddings"] else t["lm_head.weight"]
    return (x @ head.T).astype(np.float32)
