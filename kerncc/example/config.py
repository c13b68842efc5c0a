"""The example model's configuration: sizes, presets, checks against the kernels' limits.

`QwenConfig` is shared by the generator (`qwen.py`), the test oracle (`tests/oracle.py`) and the
Hugging Face importer (`kerncc.hf`, which builds one from a checkpoint's config.json); the
example saves it beside the checkpoint as an HF `config.json` (with kerncc's serving sizes
under `"kerncc"`, a key transformers keeps as an attribute) so the oracle can rebuild it from
the files alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from kerncc.kernels.reference import DECODE_SPLIT

# decode_batch's attention blocks per (sequence, kv head): QwenConfig.decode_batch_blocks
DECODE_BATCH_BLOCKS = 8

PAGE = 16  # KV block size: slots per page-table entry
BOS_ID, EOS_ID = 0, 2  # the example tokenizer's <|endoftext|> and <|im_end|> (text.py)

SIZES: dict[str, dict[str, int]] = {
    # CI: runs through the numpy references in seconds.
    "tiny": {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16,
             "intermediate": 128, "vocab": 256, "max_tokens": 64, "max_seqs": 4,
             "max_context": 256, "seed": 0,
             "interleave": 32},  # several gate/up blocks, so the interleave is exercised
    # GPU benchmarks: Qwen3-1.7B-like shapes with a 32k vocab.
    "small": {"layers": 24, "hidden": 2048, "heads": 16, "kv_heads": 8, "head_dim": 128,
              "intermediate": 6144, "vocab": 32000, "max_tokens": 2048, "max_seqs": 128,
              "max_context": 4096, "seed": 0},
}


@attrs.frozen
class QwenConfig:
    """A Qwen3-style decoder plus the serving limits its manifest declares."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_tokens: int  # var `tokens` max: rows of one call
    max_seqs: int  # var `seqs` max: sequences of one call
    max_context: int  # longest sequence: rope table rows, page-table width * 16
    seed: int
    rope_theta: float = 1_000_000.0
    eps: float = 1e-6
    interleave: int = 0  # gate/up interleave block (rows); 0 = min(128, intermediate)
    qk_norm: bool = True  # Qwen3's q/k head RMSNorms (Llama has none)
    # Llama 3 `rope_scaling` (factor, low_freq_factor, high_freq_factor, original context)
    rope_scaling: tuple[float, float, float, int] | None = None

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def qkv_dim(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def gate_up_block(self) -> int:
        return self.interleave or min(128, self.intermediate)

    @property
    def padded_vocab(self) -> int:
        """Rows the checkpoint's lm_head is drawn with (then cut to vocab): kept so the
        example's weights stay those of its earlier, padded checkpoint."""
        return (self.vocab // 128 + 1) * 128

    @property
    def pages_per_seq(self) -> int:
        return self.max_context // PAGE

    @property
    def decode_splits(self) -> int:
        """Splits of DECODE_SPLIT keys that attn_decode needs to cover max_context keys."""
        return -(-self.max_context // DECODE_SPLIT)

    @property
    def decode_batch_blocks(self) -> int:
        """Grid z of the batched decode's attention: blocks per (sequence, kv head), each taking
        splits z, z + Z, ... (kernels/attention.cu). Fewer than `decode_splits` so that short
        sequences do not launch mostly blocks that only exit: at 32 sequences of 512 keys a
        block per split launches 8192 blocks, 7168 of them idle."""
        return min(self.decode_splits, DECODE_BATCH_BLOCKS)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.kv_heads * self.head_dim * 2  # k and v, bf16

    def problems(self) -> list[str]:
        """Shapes the kernels cannot run (see kernels/*.cu); empty when fine."""
        sizes = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
                 "max_tokens", "max_seqs", "max_context")
        small = [name for name in sizes if getattr(self, name) < 1]
        if small:  # the checks below divide by these, and so does the generator
            return [f"{', '.join(small)} must be positive"]
        checks = [
            (self.heads % self.kv_heads == 0, "heads must be a multiple of kv_heads"),
            (32 % self.group == 0 and self.group <= 8, "heads/kv_heads must be 1, 2, 4 or 8"),
            (self.head_dim % 16 == 0 and self.head_dim <= 128, "head_dim must be 16k <= 128"),
            (self.hidden % 8 == 0, "hidden must be a multiple of 8"),
            (self.intermediate % self.gate_up_block == 0, "intermediate % interleave != 0"),
            (self.max_context % PAGE == 0, f"max_context must be a multiple of {PAGE}"),
            (self.max_seqs <= self.max_tokens, "max_seqs must not exceed max_tokens"),
        ]
        return [message for ok, message in checks if not ok]

    def to_hf(self) -> dict[str, Any]:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_context,
            "rms_norm_eps": self.eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "hidden_act": "silu",
            "attention_bias": False,
            "use_sliding_window": False,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "kerncc": {"max_tokens": self.max_tokens, "max_seqs": self.max_seqs,
                       "seed": self.seed, "interleave": self.gate_up_block},
        }

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> QwenConfig:
        extra = hf.get("kerncc", {})
        return cls(
            layers=hf["num_hidden_layers"], hidden=hf["hidden_size"],
            heads=hf["num_attention_heads"], kv_heads=hf["num_key_value_heads"],
            head_dim=hf["head_dim"], intermediate=hf["intermediate_size"],
            vocab=hf["vocab_size"], max_context=hf["max_position_embeddings"],
            rope_theta=hf["rope_theta"], eps=hf["rms_norm_eps"],
            max_tokens=extra.get("max_tokens", 1), max_seqs=extra.get("max_seqs", 1),
            seed=extra.get("seed", 0), interleave=extra.get("interleave", 0),
        )

    @classmethod
    def load(cls, path: str | Path) -> QwenConfig:
        return cls.from_hf(json.loads(Path(path).read_text()))


def make_config(size: str = "tiny", **overrides: float) -> QwenConfig:
    if size not in SIZES:
        raise ValueError(f"unknown size `{size}` (known: {', '.join(SIZES)})")
    unknown = set(overrides) - set(attrs.fields_dict(QwenConfig))
    if unknown:
        raise ValueError(f"unknown overrides {sorted(unknown)}")
    config = QwenConfig(**{**SIZES[size], **overrides})
    problems = config.problems()
    if problems:
        raise ValueError("unsupported example model: " + "; ".join(problems))
    return config
