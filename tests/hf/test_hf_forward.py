"""Imported Hugging Face checkpoints run right: kerncc's cpu backend against a float32 forward.

For each architecture a small random checkpoint in the HF layout (sharded and tied variants,
bf16 / f16 / f32 files, Llama 3 rope scaling, a head group the kernels cannot take directly)
is imported, run through `kerncc run`'s driver (chunked prefill, then decode over the paged
cache) and compared with tests/hf/models.py's numpy forward, which is written from the
transformers modeling code: the logits agree within bf16 rounding (max |diff| / max |logit|),
and greedy tokens are equal except where the float32 top two are a near-tie.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kerncc.hf.importer import import_model
from kerncc.lower import open_target
from kerncc.runtime import Chain
from reference_loop import alone

from .models import config_json, forward, v5_layout, write_model

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
CASES = {
    # name: (family, write_model options)
    "qwen3-tied-sharded": ("qwen3", {"tied": True, "shards": 2}),
    "qwen3-f32": ("qwen3", {"dtype": "f32", "theta": 1e6}),
    "llama-untied": ("llama", {}),
    "llama3-scaled-g3-sharded": ("llama", {"heads": 6, "kv_heads": 2, "hidden": 96,
                                           "rope_scaling": LLAMA3, "shards": 3,
                                           "theta": 500000.0}),
    "mistral-f16-tied": ("mistral", {"dtype": "f16", "tied": True, "heads": 8, "kv_heads": 1}),
    # config.json as transformers 5 writes it: rope_parameters, no architectures
    "llama3-v5-config": ("llama", {"rope_scaling": LLAMA3, "theta": 500000.0, "v5": True}),
}
PROMPT = [5, 17, 42, 99, 3, 150, 77, 8, 61, 120, 33, 190]
NEW = 6
TOLERANCE = 2e-2  # of max |logit|: bf16 weights and activations through every layer
NEAR_TIE = 2e-2  # a top-two gap below this fraction of max |logit| may flip the argmax


def run(path, prompt: list[int], new: int) -> tuple[list[int], np.ndarray]:
    chain = Chain(open_target(path), backend="cpu")
    result = alone(chain, prompt, new)
    return result.tokens, result.logits


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_float32_forward(tmp_path, case):
    family, options = CASES[case]
    options = dict(options)
    if options.pop("v5", False):
        options["config"] = v5_layout(config_json(family, **options))
    folder = write_model(tmp_path / case, family, seed=len(case), **options)
    done = import_model(folder, max_tokens=32, max_seqs=2, max_context=128)
    tokens, logits = run(done.path, PROMPT, NEW)
    # The driver's runs: the whole prompt in one chunk (its last row, position len-1, gives
    # the first token), then one row per token but the last: positions len ... len-2+NEW.
    sequence = PROMPT + tokens[:-1]
    expected = forward(folder, sequence)[len(PROMPT) - 1:]
    assert len(expected) == NEW
    assert logits.shape == expected.shape
    scale = np.abs(expected).max()
    error = np.abs(logits - expected).max() / scale
    assert error < TOLERANCE, f"{case}: max |diff| / max |logit| = {error:.4f}"
    assert np.abs(expected).std() > 0.1 * scale  # not a degenerate (flat) model
    for row, token in enumerate(tokens):
        best = np.sort(expected[row])[-2:]
        if token != int(np.argmax(expected[row])):
            assert best[1] - best[0] < NEAR_TIE * scale, f"{case}: token {row} differs"


def test_the_scaled_rope_matters(tmp_path):
    """The llama3 table is in use: without the scaling the logits move past tolerance."""
    folder = write_model(tmp_path / "m", "llama", rope_scaling=LLAMA3, seed=3)
    done = import_model(folder, max_tokens=32, max_seqs=2, max_context=128)
    tokens, logits = run(done.path, PROMPT, 2)  # rows: positions len-1 (the chunk's), len
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = None
    (folder / "config.json").write_text(json.dumps(config))
    unscaled = forward(folder, PROMPT + tokens[:1])[len(PROMPT) - 1:]
    error = np.abs(logits[:2] - unscaled).max() / np.abs(unscaled).max()
    assert error > TOLERANCE


def test_a_bundle_cut_in_two_gives_the_same_tokens(tmp_path):
    from kerncc.cli.main import main

    folder = write_model(tmp_path / "m", "llama", tied=True, shards=2, seed=5)
    done = import_model(folder, max_tokens=32, max_seqs=2, max_context=128)
    assert main(["lower", str(done.path), "-p", "cut,slice-derive,emit", "-o",
                 str(tmp_path / "out")]) == 0
    index = json.loads((tmp_path / "out" / "bundle.json").read_text())
    assert index["checkpoint"] == "../m/model.safetensors.index.json"
    assert len(index["stages"]) == 2
    whole, _ = run(done.path, PROMPT, NEW)
    cut, _ = run(tmp_path / "out", PROMPT, NEW)
    assert whole == cut
