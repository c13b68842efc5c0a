"""FP8 checkpoints for the tests, in the layout block-wise FP8 models ship (Qwen3-8B-FP8).

`write_fp8(source, target)` copies a bf16 Hugging Face folder (tests/hf/models.py) with every
layer linear as e4m3 `weight` plus f32 `weight_scale_inv` [ceil(out/128), ceil(in/128)]
(quantized by the kernel library's reference, the function `kerncc import --quantize fp8`
runs at load) and config.json's `quantization_config`; `write_dequantized(source, target)`
writes the same folder with those linears as bf16(f32(fp8) * scale): the bf16 model the FP8
one stands for.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

from kerncc.checkpoint.safetensors import load_file, save_file
from kerncc.kernels.reference import fp8_dequantize, fp8_quantize

QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": [128, 128]}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.rsplit(".", 2)[-2] in LINEARS \
        and name.endswith(".weight")


def _copy_text(source: Path, target: Path, quantized: bool) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.suffix == ".json" and path.name != "model.json":
            shutil.copy(path, target / path.name)
    config = json.loads((source / "config.json").read_text())
    if quantized:
        config["quantization_config"] = dict(QUANTIZATION)
    (target / "config.json").write_text(json.dumps(config, indent=2))


def write_fp8(source: Path, target: Path) -> Path:
    """The FP8 form of the one-file bf16 checkpoint in `source`."""
    _copy_text(source, target, quantized=True)
    tensors = {}
    for name, value in load_file(source / "model.safetensors").items():
        if not is_linear(name):
            tensors[name] = value
            continue
        tensors[name], tensors[name + "_scale_inv"] = fp8_quantize(value)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def write_dequantized(source: Path, target: Path) -> Path:
    """The bf16 model an FP8 folder (write_fp8's) stands for."""
    _copy_text(source, target, quantized=False)
    raw = load_file(source / "model.safetensors")
    tensors = {name: value for name, value in raw.items()
               if not name.endswith("_scale_inv") and value.dtype != ml_dtypes.float8_e4m3fn}
    for name, value in raw.items():
        if value.dtype == ml_dtypes.float8_e4m3fn:
            dequantized = fp8_dequantize(value, raw[name + "_scale_inv"])
            tensors[name] = dequantized.astype(ml_dtypes.bfloat16)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    assert not any(v.dtype == np.dtype(ml_dtypes.float8_e4m3fn) for v in tensors.values())
    return target
