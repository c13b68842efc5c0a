"""config.json of real checkpoints (the fields kerncc import reads, as published on the Hub).

Qwen3 0.6B/1.7B/4B/8B and Llama 3.2 1B/3B, Llama 3.1 8B: the shapes the real-shape tests
import over header-only checkpoints (tests/hf/test_hf_real_shapes.py).
"""

from __future__ import annotations

QWEN3_COMMON = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 40960,
    "max_window_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
LLAMA3_COMMON = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001,
    "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 131072,
    "mlp_bias": False, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}


def _rope(factor: float) -> dict:
    return {"factor": factor, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3"}


CONFIGS: dict[str, dict] = {
    "Qwen3-0.6B": {**QWEN3_COMMON, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_attention_heads": 16, "num_hidden_layers": 28,
                   "tie_word_embeddings": True},
    "Qwen3-1.7B": {**QWEN3_COMMON, "hidden_size": 2048, "intermediate_size": 6144,
                   "num_attention_heads": 16, "num_hidden_layers": 28,
                   "tie_word_embeddings": True},
    "Qwen3-4B": {**QWEN3_COMMON, "hidden_size": 2560, "intermediate_size": 9728,
                 "num_attention_heads": 32, "num_hidden_layers": 36, "max_window_layers": 36,
                 "tie_word_embeddings": True},
    "Qwen3-8B": {**QWEN3_COMMON, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_attention_heads": 32, "num_hidden_layers": 36, "max_window_layers": 36,
                 "tie_word_embeddings": False},
    "Llama-3.2-1B": {**LLAMA3_COMMON, "head_dim": 64, "hidden_size": 2048,
                     "intermediate_size": 8192, "num_attention_heads": 32,
                     "num_hidden_layers": 16, "rope_scaling": _rope(32.0),
                     "tie_word_embeddings": True},
    "Llama-3.2-3B": {**LLAMA3_COMMON, "head_dim": 128, "hidden_size": 3072,
                     "intermediate_size": 8192, "num_attention_heads": 24,
                     "num_hidden_layers": 28, "rope_scaling": _rope(32.0),
                     "tie_word_embeddings": True},
    # Llama 3.1's config.json has no head_dim: hidden_size / num_attention_heads = 128.
    "Llama-3.1-8B": {**LLAMA3_COMMON, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_attention_heads": 32, "num_hidden_layers": 32,
                     "rope_scaling": _rope(8.0), "tie_word_embeddings": False},
}
