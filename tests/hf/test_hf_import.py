"""`kerncc import`: the shared builder, where the checkpoint is found, and every refusal.

Importing the example's own folder gives the example's manifest byte for byte (one builder);
bad config fields, tensors and shard indexes are errors naming the file and the field or
tensor, and a refused import writes nothing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kerncc.cli.main import main
from kerncc.diagnostics import KernccError
from kerncc.example import generate
from kerncc.hf.importer import import_model
from kerncc.checkpoint.safetensors import load_file, save_file

from .models import write_model


def test_importing_the_example_gives_the_example_manifest(tmp_path):
    manifest, _ = generate(tmp_path / "ex", "tiny")
    done = import_model(tmp_path / "ex", tmp_path / "ex" / "imported.json")
    expected = json.loads(manifest.read_text())
    assert done.manifest["model"] == "ex"
    done.manifest["model"] = expected["model"]
    assert json.dumps(done.manifest, indent=2) + "\n" == manifest.read_text()


def test_the_example_checkpoint_has_exactly_vocab_head_rows(tmp_path):
    _, weights = generate(tmp_path, "tiny", vocab=300)
    tensors = load_file(weights)
    assert tensors["lm_head.weight"].shape == (300, 64)
    assert tensors["model.embed_tokens.weight"].shape == (300, 64)


def test_cli_import_then_run_finds_the_checkpoint(tmp_path, capsys):
    folder = write_model(tmp_path / "m", "qwen3", shards=2, tied=True)
    assert main(["import", str(folder), "--max-tokens", "16", "--max-seqs", "2",
                 "--max-context", "64"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == str(folder / "model.json")
    assert "Qwen3ForCausalLM" in out.err and "tied head" in out.err
    raw = json.loads((folder / "model.json").read_text())
    assert raw["vars"]["tokens"]["max"] == 16 and raw["buffers"]["rope"]["shape"] == [64, 16]
    assert raw["buffers"]["lm_head.w"]["bind"] == [{"tensor": "model.embed_tokens.weight"}]
    assert main(["run", str(folder / "model.json"), "--backend", "cpu", "--prompt", "1,2,3",
                 "--max-new", "3", "--ignore-eos"]) == 0
    assert len(capsys.readouterr().out.split()) == 3


def test_a_manifest_written_elsewhere_says_how_to_run_it(tmp_path, capsys):
    folder = write_model(tmp_path / "m", "llama")
    assert main(["import", str(folder), "-o", str(tmp_path / "other" / "x.json"),
                 "--max-context", "64"]) == 0
    assert "--weights" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "other" / "x.json"), "--backend", "cpu", "--prompt",
                 "1,2", "--max-new", "2", "--weights", str(folder / "model.safetensors")]) == 0


# ---- refusals ------------------------------------------------------------------------------


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize("changes, message", [
    ({"hidden_size": ...}, "missing field `hidden_size`"),
    ({"num_hidden_layers": "2"}, "field `num_hidden_layers` must be a positive whole number"),
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"attention_bias": True}, "attention_bias true is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act `gelu`"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type \"yarn\""),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "missing field `low_freq_factor`"),
    ({"head_dim": 24}, "head_dim 24 is not supported"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quant_method \"awq\""),
    ({"quantization_config": {"quant_method": "fp8"}}, "weight_block_size null"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                              "activation_scheme": "static"}}, "activation_scheme \"static\""),
    ({"tie_word_embeddings": "yes"}, "field `tie_word_embeddings` must be true or false"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers 1000000000 is past kerncc's limit"),
    ({"rms_norm_eps": float("nan")}, "field `rms_norm_eps` must be a positive finite number"),
])
def test_bad_config_names_the_field(tmp_path, changes, message):
    folder = write_model(tmp_path / "m", "llama")
    edit_config(folder, **changes)
    with pytest.raises(KernccError) as err:
        import_model(folder)
    assert message in str(err.value) and "config.json" in str(err.value)
    assert not (folder / "model.json").exists()


def test_config_problems_are_all_reported_at_once(tmp_path):
    folder = write_model(tmp_path / "m", "qwen3")
    edit_config(folder, hidden_size=..., use_sliding_window=True, vocab_size=0)
    with pytest.raises(KernccError) as err:
        import_model(folder)
    pointers = {d.location.pointer for d in err.value.diagnostics}
    assert pointers == {"/hidden_size", "/use_sliding_window", "/vocab_size"}


def test_a_sliding_window_must_cover_the_context(tmp_path):
    folder = write_model(tmp_path / "m", "mistral")
    edit_config(folder, sliding_window=64)
    with pytest.raises(KernccError, match="sliding_window 64 is shorter"):
        import_model(folder, max_context=128)
    assert import_model(folder, max_context=64).config.max_context == 64


def test_config_json_that_is_not_json(tmp_path):
    folder = write_model(tmp_path / "m", "llama")
    (folder / "config.json").write_text("{\n  \"a\": ")
    with pytest.raises(KernccError, match="not JSON") as err:
        import_model(folder)
    assert err.value.diagnostics[0].location.line == 2


def rewrite(folder: Path, change) -> None:
    path = folder / "model.safetensors"
    tensors = dict(load_file(path))
    change(tensors)
    save_file(tensors, path)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
     "tensor `model.layers.1.mlp.up_proj.weight` is missing"),
    (lambda t: t.update({"lm_head.weight": t["lm_head.weight"][:, :32].copy()}),
     "tensor `lm_head.weight` has shape [200, 32], but config.json implies [200, 64]"),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype("int32")}),
     "tensor `model.norm.weight` is I32"),
])
def test_bad_tensors_name_the_tensor(tmp_path, change, message):
    folder = write_model(tmp_path / "m", "llama")
    rewrite(folder, change)
    with pytest.raises(KernccError) as err:
        import_model(folder)
    assert message in str(err.value) and "model.safetensors" in str(err.value)
    assert not (folder / "model.json").exists()


def test_a_padded_head_binds_its_first_vocab_rows(tmp_path):
    import numpy as np

    folder = write_model(tmp_path / "m", "llama")
    rewrite(folder, lambda t: t.update({"lm_head.weight": np.concatenate(
        [t["lm_head.weight"], t["lm_head.weight"][:56]])}))
    done = import_model(folder)
    assert done.manifest["buffers"]["lm_head.w"]["bind"] == [
        {"tensor": "lm_head.weight", "rows": [0, 200]}]


def test_an_index_naming_a_missing_shard(tmp_path):
    folder = write_model(tmp_path / "m", "qwen3", shards=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(KernccError, match="shard `model-00002-of-00002.safetensors` does not "
                                          "exist") as err:
        import_model(folder)
    assert "model.safetensors.index.json" in str(err.value)


@pytest.mark.parametrize("shard", ["../elsewhere.safetensors", "/etc/passwd", 3])
def test_an_index_reaching_outside_its_folder(tmp_path, shard):
    folder = write_model(tmp_path / "m", "qwen3", shards=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = shard
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KernccError, match="is not a file name beside the index"):
        import_model(folder)


def test_an_index_whose_shard_lacks_the_tensor(tmp_path):
    folder = write_model(tmp_path / "m", "qwen3", shards=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = "model.norm.weight"
    other = {s for s in index["weight_map"].values() if s != index["weight_map"][name]}
    index["weight_map"][name] = other.pop()
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KernccError, match=f"tensor `{name}` is mapped to shard"):
        import_model(folder)


def test_no_checkpoint_at_all(tmp_path):
    folder = write_model(tmp_path / "m", "qwen3")
    (folder / "model.safetensors").unlink()
    with pytest.raises(KernccError, match="no model.safetensors or model.safetensors.index"):
        import_model(folder)


def test_cli_errors_are_clean(tmp_path, capsys):
    assert main(["import", str(tmp_path / "nothing")]) == 1
    assert "is not a directory" in capsys.readouterr().err
    folder = write_model(tmp_path / "m", "llama")
    edit_config(folder, rope_theta="big")
    assert main(["import", str(folder)]) == 1
    err = capsys.readouterr().err
    assert "config.json: /rope_theta: field `rope_theta` must be a positive finite number" in err
    assert "Traceback" not in err


FIELDS = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
          "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
          "rope_parameters", "tie_word_embeddings", "hidden_act", "attention_bias",
          "sliding_window", "eos_token_id", "kerncc", "layer_types", "quantization_config")
JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**12) | st.text(max_size=8)
                    | st.floats(allow_nan=True, allow_infinity=True),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.sampled_from(["rope_type", "factor", "rope_theta",
                                                       "low_freq_factor", "x"]), inner,
                                      max_size=3), max_leaves=6)


@settings(max_examples=150)
@given(family=st.sampled_from(["qwen3", "llama", "mistral"]),
       changes=st.dictionaries(st.sampled_from(FIELDS), JSON | st.just(...), max_size=4))
def test_any_config_is_parsed_or_refused_cleanly(family, changes):
    """Whatever a config holds: an HFConfig whose builder config the kernels can take, or a
    KernccError naming config.json; never another exception."""
    from kerncc.hf.config import parse_config

    from .models import config_json

    raw = config_json(family)
    for key, value in changes.items():
        if value is ...:
            raw.pop(key, None)
        else:
            raw[key] = value
    try:
        hf = parse_config("config.json", raw)
        c = hf.model(max_context=64) if hf.max_position_embeddings >= 64 else hf.model()
    except KernccError as err:
        assert "config.json" in str(err)
        return
    assert c.problems() == [] or all(isinstance(p, str) for p in c.problems())
    assert math.isfinite(c.eps) and math.isfinite(c.rope_theta)
