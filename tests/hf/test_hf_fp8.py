"""FP8 weights through `kerncc import` and the cpu backend.

An FP8 checkpoint (block-wise e4m3 with `weight_scale_inv`, tests/hf/fp8_models.py) imports
with its e4m3 weights and f32 scales bound as they are; `--quantize fp8` of the bf16 original
quantizes the same linears at load (the derive program), and the two run to the same bits.
Against the bf16 model of the dequantized weights (bf16(fp8 * scale)): prefill dequantizes
into that very bf16 weight before the bf16 GEMM, so its logits are bitwise the bf16 model's;
decode's FP8 GEMV multiplies the unrounded f32 weight (fp8 * scale), which differs from the bf16
weight by at most half a bf16 ulp (2^-9 relative), so its logits may differ by that much per
product: bounded here by 1e-2 of max |logit|, with greedy tokens equal.
Refusals name the file and the tensor or field.
"""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest

from kerncc.checkpoint.safetensors import load_file, save_file
from kerncc.cli.main import main
from kerncc.diagnostics import KernccError
from kerncc.hf.importer import import_model
from kerncc.lower import open_target
from kerncc.runtime import Chain
from reference_loop import alone

from .fp8_models import write_dequantized, write_fp8
from .models import write_model

# q, k and v rows whole 128-row scale blocks: 2 heads and 1 kv head of 128
SIZES = {"hidden": 128, "heads": 2, "kv_heads": 1, "head_dim": 128, "intermediate": 256,
         "vocab": 200, "layers": 2}
PROMPT = [5, 17, 42, 99, 3, 150, 77, 8, 61, 120, 33, 190]
NEW = 6
TOLERANCE = 1e-2  # of max |logit|: decode's f32 weights against their bf16 rounding
LIMITS = {"max_tokens": 32, "max_seqs": 2, "max_context": 128}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    bf16 = write_model(root / "bf16", "qwen3", seed=3, **SIZES)
    fp8 = write_fp8(bf16, root / "fp8")
    return {"bf16": bf16, "fp8": fp8, "dequantized": write_dequantized(fp8, root / "deq")}


def run(path, pipeline: str = "emit") -> tuple[list[int], np.ndarray]:
    chain = Chain(open_target(path, pipeline), backend="cpu")
    result = alone(chain, PROMPT, NEW)
    return result.tokens, result.logits


def test_an_fp8_checkpoint_binds_e4m3_weights_and_their_scales(folders, tmp_path):
    done = import_model(folders["fp8"], tmp_path / "m.json", **LIMITS)
    buffers = done.manifest["buffers"]
    assert buffers["l0.qkv_proj.w"]["dtype"] == "fp8e4m3"
    assert buffers["l0.qkv_proj.w"]["kind"] == "weight"
    assert buffers["l0.qkv_proj.s"]["shape"] == [4, 1]  # 512 rows, 128 columns
    assert [s["tensor"] for s in buffers["l0.qkv_proj.s"]["bind"]] == [
        f"model.layers.0.self_attn.{x}_proj.weight_scale_inv" for x in "qkv"]
    assert buffers["l1.gate_up_proj.s"]["bind"][0]["interleave"]["rows"] == 1
    assert buffers["lm_head.w"]["dtype"] == "bf16" and buffers["embed.w"]["dtype"] == "bf16"
    calls = {c["label"]: c["op"] for c in done.manifest["programs"]["decode"]["calls"]}
    assert calls["l0.down_proj"] == "down_proj_fp8_step"
    prefill = {c["label"]: c["op"] for c in done.manifest["programs"]["prefill"]["calls"]}
    assert prefill["l0.down_proj"] == "down_proj_fp8"
    assert "convert" not in done.manifest["programs"]  # nothing to cast or quantize


def test_quantize_at_import_writes_a_derive_program_and_nothing_else(folders, tmp_path):
    before = sorted(p.name for p in folders["bf16"].iterdir())
    done = import_model(folders["bf16"], tmp_path / "q.json", quantize="fp8", **LIMITS)
    assert sorted(p.name for p in folders["bf16"].iterdir()) == before
    buffers = done.manifest["buffers"]
    assert buffers["l0.o_proj.src"]["kind"] == "source"
    assert buffers["l0.o_proj.w"] == {"dtype": "fp8e4m3", "shape": [128, 256], "kind": "carry"}
    quantized = [c["label"] for c in done.manifest["programs"]["convert"]["calls"]]
    assert len(quantized) == 4 * SIZES["layers"]


def test_quantized_at_load_equals_the_fp8_checkpoint_bitwise(folders, tmp_path):
    fp8 = import_model(folders["fp8"], tmp_path / "a.json", **LIMITS).path
    quantized = import_model(folders["bf16"], tmp_path / "b.json", quantize="fp8",
                             **LIMITS).path
    (tmp_path / "model.safetensors").symlink_to(folders["fp8"] / "model.safetensors")
    tokens_a, logits_a = run(fp8)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors").symlink_to(folders["bf16"] / "model.safetensors")
    tokens_b, logits_b = run(quantized)
    assert tokens_a == tokens_b
    assert np.array_equal(logits_a, logits_b)


def test_fp8_logits_stay_within_fp8_rounding_of_the_dequantized_bf16_model(folders):
    fp8 = import_model(folders["fp8"], **LIMITS).path
    bf16 = import_model(folders["dequantized"], **LIMITS).path
    tokens, logits = run(fp8)
    tokens_ref, logits_ref = run(bf16)
    # prefill: the same bf16 weights (dequantized into scratch), the same GEMM
    assert np.array_equal(logits[0], logits_ref[0])
    scale = np.abs(logits_ref).max()
    error = np.abs(logits - logits_ref).max() / scale
    assert 0 < error < TOLERANCE, error  # decode differs by the weights' bf16 rounding only
    assert tokens == tokens_ref
    assert np.abs(logits_ref).std() > 0.1 * scale


def test_bf16_scales_are_widened_at_load(folders, tmp_path):
    """Qwen3's dense FP8 models ship bf16 `weight_scale_inv`: bound as sources and widened to
    the f32 scales by the derive program, they run to the bits of the same scales in f32."""
    def scales_as(dtype):
        return lambda t: t.update({n: v.astype(ml_dtypes.bfloat16).astype(dtype)
                                   for n, v in t.items() if n.endswith("_scale_inv")})

    narrow, wide = _copy(folders, tmp_path / "bf16"), _copy(folders, tmp_path / "f32")
    rewrite(narrow, scales_as(ml_dtypes.bfloat16))
    rewrite(wide, scales_as(np.float32))
    done = import_model(narrow, **LIMITS)
    buffers = done.manifest["buffers"]
    assert buffers["l0.o_proj.s.src"] == {**buffers["l0.o_proj.s.src"], "dtype": "bf16",
                                          "kind": "source"}
    assert buffers["l0.o_proj.s"] == {"dtype": "f32", "shape": [1, 2], "kind": "carry"}
    ops = [c["op"] for c in done.manifest["programs"]["convert"]["calls"]]
    assert len(ops) == 4 * SIZES["layers"] and all(o.startswith("cast_bf16_f32_") for o in ops)
    tokens, logits = run(done.path)
    tokens_f32, logits_f32 = run(import_model(wide, **LIMITS).path)
    assert tokens == tokens_f32 and np.array_equal(logits, logits_f32)


def test_an_fp8_model_cut_in_two_gives_the_whole_bits(folders):
    path = import_model(folders["fp8"], **LIMITS).path
    whole, cut = run(path), run(path, "cut,slice-derive,emit")
    assert whole[0] == cut[0] and np.array_equal(whole[1], cut[1])


def test_cli_import_quantize(folders, tmp_path, capsys):
    out = tmp_path / "cli.json"
    assert main(["import", str(folders["bf16"]), "-o", str(out), "--quantize", "fp8",
                 "--max-tokens", "32", "--max-seqs", "2", "--max-context", "128"]) == 0
    assert json.loads(out.read_text())["buffers"]["l0.qkv_proj.w"]["dtype"] == "fp8e4m3"
    with pytest.raises(SystemExit) as exit_:
        main(["import", str(folders["bf16"]), "--quantize", "int4"])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Refusals


def rewrite(folder, change) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _copy(folders, root, name="fp8"):
    import shutil

    target = root / name
    shutil.copytree(folders[name], target, ignore=shutil.ignore_patterns("model.json"))
    return target


SCALE = "model.layers.1.mlp.up_proj.weight_scale_inv"


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop(SCALE), f"tensor `{SCALE}` is missing"),
    (lambda t: t.update({SCALE: t[SCALE][:1]}), "are F32 or BF16 [2, 1]"),
    (lambda t: t.update({SCALE: t[SCALE].astype(np.float16)}), "is F16 [2, 1]"),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype(
        ml_dtypes.float8_e4m3fn)}), "only the layers' linear weights may be FP8"),
])
def test_bad_fp8_tensors_name_the_tensor(folders, tmp_path, change, message):
    folder = _copy(folders, tmp_path)
    rewrite(folder, change)
    with pytest.raises(KernccError) as err:
        import_model(folder, **LIMITS)
    assert message in str(err.value) and "model.safetensors" in str(err.value)
    assert not (folder / "model.json").exists()


def test_e4m3_without_a_quantization_config_is_refused(folders, tmp_path):
    folder = _copy(folders, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(KernccError, match="declares no fp8 quantization_config"):
        import_model(folder, **LIMITS)


def test_quantize_refuses_an_fp8_checkpoint_and_non_bf16_linears(folders, tmp_path):
    with pytest.raises(KernccError, match="FP8 already"):
        import_model(folders["fp8"], quantize="fp8", **LIMITS)
    f32 = write_model(tmp_path / "f32", "qwen3", dtype="f32", **SIZES)
    with pytest.raises(KernccError, match="is F32: --quantize fp8 takes BF16"):
        import_model(f32, quantize="fp8", **LIMITS)
    with pytest.raises(KernccError, match="expected one of fp8"):
        import_model(folders["bf16"], quantize="int4", **LIMITS)


def test_fp8_rows_off_the_scale_blocks_are_refused(tmp_path):
    """A kv head of 64 rows: k_proj's scales cannot be laid between q's and v's."""
    bf16 = write_model(tmp_path / "bf16", "qwen3", **{**SIZES, "head_dim": 64})
    fp8 = write_fp8(bf16, tmp_path / "fp8")
    with pytest.raises(KernccError) as err:
        import_model(fp8, **LIMITS)
    assert "tensor `model.layers.0.self_attn.k_proj.weight` has 64 rows" in str(err.value)
    assert "q_proj" not in str(err.value)  # 2 heads of 64: one whole block
    # quantized at load the scales are the manifest weight's own: any rows
    import_model(bf16, quantize="fp8", **LIMITS)


def test_fp8_sizes_the_gemv_cannot_take(tmp_path):
    folder = write_model(tmp_path / "odd", "qwen3", **{**SIZES, "hidden": 136,
                                                       "intermediate": 264})
    with pytest.raises(KernccError) as err:
        import_model(folder, quantize="fp8", **LIMITS)
    assert "hidden_size 136 is not a multiple of 16" in str(err.value)
    assert math.gcd(264, 16) != 16 and "intermediate_size 264" in str(err.value)
