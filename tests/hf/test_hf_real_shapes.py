"""Real model shapes import, verify and lower with a cut, over header-only checkpoints.

Each config of tests/hf/real_configs.py gets a checkpoint holding only safetensors headers
(the tensor table, no data: what `kerncc import` reads), sharded like the Hub's. The import
verifies the manifest; `lower -p cut{stages=2},slice-derive,emit` must prove the two stages
against the whole, and the stages' weights must add up to the checkpoint's parameters.
`python tests/hf/test_hf_real_shapes.py` prints the stage memory table of docs/hf-import.md.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import pytest

if __name__ == "__main__":  # run as a script: make `tests` importable as a package root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hf.models import tensor_shapes, write_model
    from hf.real_configs import CONFIGS
else:
    from .models import tensor_shapes, write_model
    from .real_configs import CONFIGS

from kerncc.cli.main import main
from kerncc.hf.importer import import_model
from kerncc.runtime.memory import numpy_dtype

CUT = "cut{stages=2},slice-derive,emit"
RESIDENT = ("weight", "carry")


def nbytes(buffer: dict, vars_: dict) -> int:
    dims = [vars_[d]["max"] if isinstance(d, str) else d for d in buffer["shape"]]
    return math.prod(dims) * numpy_dtype(buffer["dtype"]).itemsize


def stage_memory(bundle: Path) -> list[dict[str, int]]:
    """Per stage: resident weight bytes (weights and carries), the arena, KV bytes a token."""
    index = json.loads((bundle / "bundle.json").read_text())
    out = []
    for stage in index["stages"]:
        man = json.loads((bundle / stage["dir"] / "manifest.json").read_text())
        plan = json.loads((bundle / stage["dir"] / "plan.json").read_text())
        vars_ = man.get("vars", {})
        out.append({
            "weights": sum(nbytes(b, vars_) for b in man["buffers"].values()
                           if b["kind"] in RESIDENT),
            "arena": plan["arena"].get("bytes", 0),
            "kv_per_token": sum(s.get("bytes_per_token", 0)
                                for s in man.get("states", {}).values()),
        })
    return out


def lower(name: str, root: Path) -> tuple[object, Path]:
    config = CONFIGS[name]
    folder = write_model(root / name, "", config=config, header_only=True, shards=2)
    done = import_model(folder, max_tokens=2048, max_seqs=8, max_context=8192)
    out = root / name / "out"
    assert main(["lower", str(done.path), "-p", CUT, "-o", str(out)]) == 0
    return done, out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_real_config_imports_and_lowers_with_a_cut(tmp_path, name):
    done, out = lower(name, tmp_path)
    config = CONFIGS[name]
    index = json.loads((out / "bundle.json").read_text())
    assert index["proof"]["checked"] and len(index["stages"]) == 2
    assert index["checkpoint"] == "../model.safetensors.index.json"
    memory = stage_memory(out)
    # Every checkpoint parameter is bound once, as bf16 (tied heads bind the table twice).
    params = sum(math.prod(s) for s in tensor_shapes(config).values())
    if config["tie_word_embeddings"]:
        params += config["vocab_size"] * config["hidden_size"]
    rope = 8192 * done.config.head_dim * 4  # the f32 cos/sin carry, in both stages
    repeat_extra = 0
    if done.hf.kv_repeat > 1:  # k and v rows repeated in the manifest
        kv = 2 * config["num_key_value_heads"] * done.config.head_dim * config["hidden_size"]
        repeat_extra = (done.hf.kv_repeat - 1) * kv * config["num_hidden_layers"] * 2
    assert sum(m["weights"] for m in memory) == 2 * params + repeat_extra + 2 * rope
    assert min(m["weights"] for m in memory) > 0.3 * max(m["weights"] for m in memory)


def test_llama_3b_repeats_its_kv_heads():
    """24 q heads over 8 kv heads (3 per group) run as 24 over 24."""
    from kerncc.hf.config import parse_config

    hf = parse_config("config.json", CONFIGS["Llama-3.2-3B"])
    assert (hf.kv_repeat, hf.model().kv_heads, hf.model().group) == (3, 24, 1)
    assert parse_config("config.json", CONFIGS["Llama-3.1-8B"]).kv_repeat == 1


def table() -> str:
    """The docs table: per config, each stage's resident weights, arena and KV per token."""
    rows = ["| model | stage 0 weights | stage 1 weights | arena (each) | KV / token (each) |",
            "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for name in CONFIGS:
            _, out = lower(name, Path(tmp))
            m = stage_memory(out)
            rows.append(f"| {name} | {m[0]['weights'] / 2**30:.2f} GiB | "
                        f"{m[1]['weights'] / 2**30:.2f} GiB | "
                        f"{m[0]['arena'] / 2**20:.0f} / {m[1]['arena'] / 2**20:.0f} MiB | "
                        f"{m[0]['kv_per_token'] // 1024} / {m[1]['kv_per_token'] // 1024} KiB |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
