"""Imported Hugging Face models on the GPU against transformers itself, side by side.

    python -m bench.hf_fidelity [--out DIR] [--cases qwen3,llama3,...] [--doc FILE]

For each case a small random model is built with transformers (its own config class and
modeling code), given unit-variance random weights, saved with `save_pretrained` (sharded
where the case says, in the case's dtype) and imported with `kerncc import`. kerncc runs it on
the cuda backend (chunked prefill, then greedy decode over the paged cache); transformers runs
the same checkpoint in float32 and in bf16 over the same tokens. Printed per case: max |diff| /
max |logit| of kerncc against transformers float32, the same for transformers' own bf16 run
(the rounding a bf16 model carries anyway), and greedy tokens equal to float32's argmax
(teacher-forced on kerncc's tokens), near-ties counted apart. The `example` case loads the
example model's folder with transformers as written (AutoModelForCausalLM, AutoTokenizer) and
compares its logits, ids and rendered chat templates with kerncc's. Results go to
--out/results.json; --doc docs/benchmarks.md also writes the table between the file's
`hf_fidelity` markers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from bench.report import Report, say

REPORT = Report("hf_fidelity")
PROMPT_LEN, NEW, NEAR_TIE = 96, 16, 1e-2

CASES = {
    # name: (family, config fields, save dtype, shard size)
    "qwen3-tied-sharded": ("qwen3", dict(hidden_size=1024, intermediate_size=3072,
                                         num_hidden_layers=8, num_attention_heads=16,
                                         num_key_value_heads=8, head_dim=128,
                                         tie_word_embeddings=True, rope_theta=1e6),
                           "bfloat16", "40MB"),
    "qwen3-f32-file": ("qwen3", dict(hidden_size=512, intermediate_size=1536,
                                     num_hidden_layers=4, num_attention_heads=8,
                                     num_key_value_heads=4, head_dim=64,
                                     tie_word_embeddings=False, rope_theta=1e6),
                       "float32", None),
    "llama3-rope-g3": ("llama", dict(hidden_size=768, intermediate_size=2048,
                                     num_hidden_layers=6, num_attention_heads=12,
                                     num_key_value_heads=4, head_dim=64,
                                     tie_word_embeddings=True, rope_theta=500000.0,
                                     rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                   "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 64}),
                       "bfloat16", None),
    "mistral-f16-file": ("mistral", dict(hidden_size=1024, intermediate_size=2816,
                                         num_hidden_layers=6, num_attention_heads=16,
                                         num_key_value_heads=4, head_dim=64,
                                         sliding_window=None, tie_word_embeddings=False),
                         "float16", "30MB"),
}
VOCAB, CONTEXT = 8000, 256


def hf_model(family: str, fields: dict, seed: int):
    import torch
    import transformers as tf

    classes = {"qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
               "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
               "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}
    config_cls, model_cls = classes[family]
    config = config_cls(vocab_size=VOCAB, max_position_embeddings=CONTEXT, rms_norm_eps=1e-6,
                        attn_implementation="eager", **fields)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():  # unit-variance activations: weights ~ 1/sqrt(fan_in), norms ~ 1
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.uniform_(0.8, 1.2)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    return model


def hf_logits(folder: Path, family: str, ids: list[int], dtype) -> np.ndarray:
    import torch
    import transformers as tf

    cls = {"qwen3": tf.Qwen3ForCausalLM, "llama": tf.LlamaForCausalLM,
           "mistral": tf.MistralForCausalLM}[family]
    model = cls.from_pretrained(folder, dtype=dtype, attn_implementation="eager").cuda().eval()
    with torch.no_grad():
        out = model(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
    del model
    torch.cuda.empty_cache()
    return out


def run_case(name: str, root: Path) -> dict:
    import torch

    from kerncc.hf.importer import import_model
    from kerncc.lower import open_target
    from bench.gpu import greedy
    from kerncc.runtime import Chain

    family, fields, dtype, shard = CASES[name]
    folder = root / name
    model = hf_model(family, fields, seed=len(name))
    model.to(getattr(torch, dtype)).save_pretrained(
        folder, safe_serialization=True, **({"max_shard_size": shard} if shard else {}))
    del model
    files = sorted(p.name for p in folder.iterdir())
    started = time.perf_counter()
    done = import_model(folder, max_tokens=128, max_seqs=2, max_context=CONTEXT)
    import_s = time.perf_counter() - started
    rng = np.random.default_rng(len(name))
    prompt = [int(t) for t in rng.integers(0, VOCAB, PROMPT_LEN)]
    chain = Chain(open_target(done.path), backend="cuda")
    tokens, ours = greedy(chain, prompt, NEW)
    del chain
    sequence = prompt + tokens[:-1]
    f32 = hf_logits(folder, family, sequence, torch.float32)[PROMPT_LEN - 2:]
    b16 = hf_logits(folder, family, sequence, torch.bfloat16)[PROMPT_LEN - 2:]
    scale = float(np.abs(f32).max())
    argmax = [int(np.argmax(r)) for r in f32[1:]]
    ties = sum(1 for r, t in zip(f32[1:], tokens) if int(np.argmax(r)) != t
               and np.sort(r)[-1] - np.sort(r)[-2] < NEAR_TIE * scale)
    return {
        "case": name, "files": files, "import_s": round(import_s, 3),
        "kv_repeat": done.hf.kv_repeat, "derive": "convert" in done.manifest["programs"],
        "kerncc_vs_f32": float(np.abs(ours - f32).max()) / scale,
        "hf_bf16_vs_f32": float(np.abs(b16 - f32).max()) / scale,
        "tokens_equal": sum(a == b for a, b in zip(argmax, tokens)), "tokens": len(tokens),
        "near_ties": ties, "max_logit": scale,
    }


TEMPLATES = {  # chat templates exercising what transformers' renderer provides
    "example": None,  # the example's own (tokenizer_config.json)
    "globals": ("{{ bos_token or '' }}{% for m in messages %}{% if m.role == 'system' and "
                "not loop.first %}{{ raise_exception('system first') }}{% endif %}"
                "{% if loop.index0 > 3 %}{% break %}{% endif %}{{ m.role | upper }}: "
                "{{ m.content | tojson }}{{ eos_token }}\n{% endfor %}"
                "{% if add_generation_prompt %}ASSISTANT:{% endif %}"),
    "generation": ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
                   "{{ m.content }}{% endgeneration %}{% else %}<{{ m.role }}>{{ m.content }}"
                   "{% endif %}\n{% endfor %}"),
}
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo \"x\""},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]
TEXTS = ["hello world", "the quick brown fox\njumps", "<|im_start|>user\nhi<|im_end|>", "é ü 中"]


def example_checks(root: Path) -> dict:
    """The example folder as transformers loads it: the model (logits against kerncc's cuda
    run) and the tokenizer (ids and chat templates against TextCodec)."""
    import torch
    import transformers as tf

    from kerncc.example import generate
    from kerncc.hf.tokenizer import TextCodec
    from kerncc.lower import open_target
    from bench.gpu import greedy
    from kerncc.runtime import Chain

    folder = root / "example"
    manifest, _ = generate(folder, "tiny")
    prompt = [1, 2, 3, 40, 50, 60, 70, 80]
    tokens, logits = greedy(Chain(open_target(manifest), backend="cuda"), prompt, 8)
    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        ids = torch.tensor([prompt + tokens[:-1]], device="cuda")
        f32 = model(ids).logits[0].float().cpu().numpy()[len(prompt) - 2:]
    scale = float(np.abs(f32).max())
    out = {"case": "example", "model_class": type(model).__name__,
           "kerncc_vs_f32": float(np.abs(logits - f32).max()) / scale,
           "tokens_equal": sum(int(np.argmax(r)) == t for r, t in zip(f32[1:], tokens)),
           "tokens": len(tokens)}
    hf_tok = tf.AutoTokenizer.from_pretrained(folder)
    codec = TextCodec.from_dir(folder)
    out["encode_equal"] = [hf_tok(t).input_ids == codec.encode(t) for t in TEXTS]
    out["decode_equal"] = [hf_tok.decode(codec.encode(t)) == codec.decode(codec.encode(t))
                           for t in TEXTS]
    rendered = {}
    for name, template in TEMPLATES.items():
        theirs = hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                            **({"chat_template": template} if template else {}))
        if template:
            (folder / "chat_template.jinja").write_text(template)
        ours = TextCodec.from_dir(folder).apply_chat_template(MESSAGES)
        rendered[name] = theirs == ours
        if theirs != ours:
            out[f"template_{name}"] = [theirs, ours]
    out["templates_equal"] = rendered
    out["eos"] = list(codec.eos_token_ids)
    return out


def rows(result: dict) -> None:
    """One case's rows: kerncc and transformers' own bf16 against transformers in float32."""
    case = result["case"]
    if "error" in result:
        REPORT.row(case, "FAILED", result["error"].strip().splitlines()[-1][:300])
    elif case == "example":
        REPORT.row(case, f"{result['model_class']} as written: kerncc vs HF f32 (max |diff| / "
                   "max |logit|); greedy = f32 argmax", f"{result['kerncc_vs_f32']:.2e}; "
                   f"{result['tokens_equal']}/{result['tokens']}")
        REPORT.row(case, "tokenizer vs AutoTokenizer: encode, decode, chat templates equal",
                   f"{sum(result['encode_equal'])}/{len(result['encode_equal'])}, "
                   f"{sum(result['decode_equal'])}/{len(result['decode_equal'])}, "
                   f"{sum(result['templates_equal'].values())}/{len(result['templates_equal'])}")
    else:
        REPORT.row(case, "kerncc vs HF f32 / HF bf16 vs HF f32 (max |diff| / max |logit|); "
                   "greedy = f32 argmax; near-ties", f"{result['kerncc_vs_f32']:.2e} / "
                   f"{result['hf_bf16_vs_f32']:.2e}; {result['tokens_equal']}/"
                   f"{result['tokens']}; {result['near_ties']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hf_fidelity",
                                     description=__doc__.splitlines()[0])
    REPORT.add_options(parser)
    parser.add_argument("--cases", default=",".join([*CASES, "example"]),
                        help="comma-separated (default: all)")
    args = parser.parse_args(argv)
    unknown = set(args.cases.split(",")) - {*CASES, "example"}
    if unknown:
        parser.error(f"unknown cases: {', '.join(sorted(unknown))}")
    results = REPORT.results.setdefault("cases", [])
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases.split(","):
            say(f"== {name}")
            try:
                results.append(example_checks(Path(tmp)) if name == "example"
                               else run_case(name, Path(tmp)))
                say(json.dumps(results[-1]))
            except Exception:  # noqa: BLE001 - one failing case is reported, the rest run
                traceback.print_exc()
                results.append({"case": name, "error": traceback.format_exc(limit=3)})
            rows(results[-1])
    from bench.gpu import device_name

    status = REPORT.finish(args, device_name(), argv)
    return status or (0 if all("error" not in r for r in results) else 1)


if __name__ == "__main__":
    sys.exit(main())
