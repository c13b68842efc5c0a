"""`kerncc import DIR`: a kern v5 manifest over a Hugging Face checkpoint, from its headers only.

`import_model(dir, output, ...)` reads DIR/config.json (kerncc.hf.config) and the checkpoint's
tensor table (kerncc.hf.checkpoint: `model.safetensors`, or the shards of
`model.safetensors.index.json`), checks that every tensor the architecture needs is there
with the right shape and a dtype the manifest can bind (bf16 as is; f16 and f32 through
`source` buffers that the derive program casts at load), and builds the manifest with the
example's builder (kerncc.example.qwen.manifest): the weights bind the Hugging Face tensor
names, so the checkpoint is never rewritten or copied. FP8 checkpoints (block-wise e4m3 with
`weight_scale_inv`, as Qwen3-8B-FP8 ships) bind their e4m3 weights and f32 scales as they are;
`quantize="fp8"` quantizes a bf16 checkpoint's linears to the same layout at load (the derive
program), so even then nothing is written beside the checkpoint. The manifest is verified before it is
written (atomically: a temporary file, fsynced, renamed into place), so a refused import
writes nothing; an existing output is replaced only when it is a kern manifest (an earlier
import), never the checkpoint, config.json or any other file of the user's.

The checkpoint is found beside the manifest (kerncc.checkpoint.shards.checkpoint_beside): the default
output DIR/model.json is what `kerncc run` and `kerncc lower ... emit` find without
`--weights`; a manifest written elsewhere needs `--weights DIR/<checkpoint>`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs

from kerncc.atomic import write_text_atomic
from kerncc.diagnostics import Diagnostic, KernccError, Location, pointer
from kerncc.example.checkpoint import hf as layer_tensor
from kerncc.example.config import QwenConfig
from kerncc.example.qwen import FP8, Binding, manifest, scale_tensor
from kerncc.hf.checkpoint import KERN_DTYPES, Table, read_table
from kerncc.hf.config import HFConfig, read_config

MAX_CAST = 2**31 - 1  # the cast kernels count elements in an i32
QUANTIZE = ("fp8",)  # --quantize: block-wise e4m3 weights, quantized at load
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FP8_BLOCK = 128
# projections bound before another in one manifest weight (q, k before v; gate beside up)
CONCATENATED = ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj")
FP8_ALIGN = 16  # the FP8 GEMV reads 16 weights at a time (kernels/fp8.cu): k % 16 == 0


@attrs.frozen
class Imported:
    """What an import wrote, and what it was built from."""

    path: Path
    manifest: dict
    hf: HFConfig
    config: QwenConfig
    checkpoint: Path  # model.safetensors or the shard index
    beside: bool  # the checkpoint is beside the manifest (found without --weights)


def expected_shapes(hf: HFConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the manifest binds, with its shape in the checkpoint."""
    h, hd, kv = hf.hidden, hf.head_dim, hf.kv_heads
    shapes = {"model.embed_tokens.weight": (hf.vocab, h), "model.norm.weight": (h,)}
    if not hf.tied:
        shapes["lm_head.weight"] = (hf.vocab, h)
    for i in range(hf.layers):
        layer = {
            "input_layernorm": (h,), "post_attention_layernorm": (h,),
            "self_attn.q_proj": (hf.heads * hd, h), "self_attn.k_proj": (kv * hd, h),
            "self_attn.v_proj": (kv * hd, h), "self_attn.o_proj": (h, hf.heads * hd),
            "mlp.gate_proj": (hf.intermediate, h), "mlp.up_proj": (hf.intermediate, h),
            "mlp.down_proj": (h, hf.intermediate),
        }
        if hf.qk_norm:
            layer.update({"self_attn.q_norm": (hd,), "self_attn.k_norm": (hd,)})
        shapes.update({layer_tensor(i, name): shape for name, shape in layer.items()})
    return shapes


def is_linear(name: str) -> bool:
    """A layer's projection weight: what FP8 checkpoints hold in e4m3."""
    return name.startswith("model.layers.") and any(name.endswith(f".{x}.weight")
                                                   for x in LINEARS)


def _fp8_problems(hf: HFConfig, table: Table, name: str, shape: tuple[int, ...],
                  where: Path) -> list[Diagnostic]:
    """An e4m3 tensor: allowed for a linear of an FP8 config, with its f32 scale tensor of
    one value per 128 x 128 block."""
    if not hf.fp8 or not is_linear(name):
        why = "config.json declares no fp8 quantization_config" if not hf.fp8 else \
            "only the layers' linear weights may be FP8"
        return [Diagnostic(f"tensor `{name}` is F8_E4M3, but {why}",
                           Location(pointer(name), file=str(where)))]
    problems = []
    if any(name.endswith(f".{x}.weight") for x in CONCATENATED) and shape[0] % FP8_BLOCK:
        problems.append(Diagnostic(
            f"tensor `{name}` has {shape[0]} rows, not whole {FP8_BLOCK}-row scale blocks, so "
            "its scales cannot be laid beside the next projection's (import the bf16 "
            "checkpoint with --quantize fp8 instead)", Location(pointer(name), file=str(where))))
    scale = scale_tensor(name)
    found = table.tensors.get(scale)
    blocks = tuple(-(-d // FP8_BLOCK) for d in shape)
    if found is None:
        return problems + [Diagnostic(f"tensor `{scale}` is missing (the block scales of the "
                                      f"FP8 `{name}`)", Location(pointer(scale), file=str(where)))]
    at = table.reference.parent / found.file
    if found.dtype not in ("F32", "BF16") or found.shape != blocks:
        problems.append(Diagnostic(f"tensor `{scale}` is {found.dtype} {list(found.shape)}, but "
                                   f"the scales of `{name}` are F32 or BF16 {list(blocks)}",
                                   Location(pointer(scale), file=str(at))))
    return problems


def check_tensors(hf: HFConfig, table: Table, quantize: str | None = None) -> None:
    """Every expected tensor present, of its shape and a bindable dtype; all problems at once."""
    problems = []
    for name, shape in expected_shapes(hf).items():
        found = table.tensors.get(name)
        where = table.reference if found is None else table.reference.parent / found.file
        if found is None:
            problems.append(Diagnostic(f"tensor `{name}` is missing (config.json needs it)",
                                       Location(pointer(name), file=str(where))))
            continue
        rows_ok = name == "lm_head.weight" and found.shape[1:] == shape[1:] \
            and len(found.shape) == 2 and found.shape[0] >= shape[0]  # padded heads bind rows
        if found.shape != shape and not rows_ok:
            problems.append(Diagnostic(f"tensor `{name}` has shape {list(found.shape)}, but "
                                       f"config.json implies {list(shape)}",
                                       Location(pointer(name), file=str(where))))
        if found.dtype == "F8_E4M3":
            problems += _fp8_problems(hf, table, name, shape, where)
        elif quantize and is_linear(name) and found.dtype != "BF16":
            problems.append(Diagnostic(f"tensor `{name}` is {found.dtype}: --quantize "
                                       f"{quantize} takes BF16 linear weights",
                                       Location(pointer(name), file=str(where))))
        elif found.dtype not in KERN_DTYPES:
            problems.append(Diagnostic(f"tensor `{name}` is {found.dtype}, not BF16, F16 or F32",
                                       Location(pointer(name), file=str(where))))
        elif found.dtype != "BF16" and math.prod(found.shape) > MAX_CAST:
            problems.append(Diagnostic(f"tensor `{name}` is {found.dtype} and too large to cast "
                                       f"at load ({math.prod(found.shape)} elements)",
                                       Location(pointer(name), file=str(where))))
    if problems:
        raise KernccError(f"{table.reference}: the checkpoint does not fit config.json",
                          problems)


def binding(hf: HFConfig, table: Table, quantize: str | None = None) -> Binding:
    dtypes = {name: FP8 if table.tensors[name].dtype == "F8_E4M3" else table.kern_dtype(name)
              for name in expected_shapes(hf)}
    dtypes.update({scale_tensor(name): table.kern_dtype(scale_tensor(name))
                   for name, dtype in list(dtypes.items()) if dtype == FP8})
    return Binding(dtypes, tied=hf.tied, kv_repeat=hf.kv_repeat, quantize=quantize == "fp8")


def _fp8_sizes(hf: HFConfig, b: Binding) -> list[str]:
    """Sizes the FP8 GEMV cannot take, when some linear is FP8."""
    if not b.quantize and FP8 not in b.dtypes.values():
        return []
    return [f"{name} {value} is not a multiple of {FP8_ALIGN} (FP8 linears read {FP8_ALIGN} "
            "weights at a time)"
            for name, value in (("hidden_size", hf.hidden), ("intermediate_size",
                                                             hf.intermediate))
            if value % FP8_ALIGN]


def _verified(raw: dict) -> None:
    """The built manifest passes kern's rules (a builder bug must not reach a file)."""
    from kerncc.manifest import reader
    from kerncc.verify import verify

    verify(reader.from_raw(raw))


MAX_MANIFEST = 1 << 26  # far past any imported manifest; a larger file is not one of ours


def _is_manifest(path: Path) -> bool:
    """Whether the file at `path` holds a kern manifest (what an earlier import wrote)."""
    from kerncc.files import FileRefused, read_regular

    try:
        if path.stat().st_size > MAX_MANIFEST:  # a checkpoint shard is not read to find out
            return False
        raw = json.loads(read_regular(path, "output", MAX_MANIFEST))
    except (OSError, FileRefused, ValueError, RecursionError):
        return False
    return isinstance(raw, dict) and "schema_version" in raw and "programs" in raw


def _check_output(path: Path) -> None:
    """The output may be new or an earlier manifest; anything else there is the user's (the
    checkpoint, config.json, their notes) and is never replaced."""
    if path.is_dir():
        raise KernccError.single(f"-o `{path}` is a directory; give the manifest's file name")
    if (path.exists() or path.is_symlink()) and not _is_manifest(path):
        raise KernccError.single(f"`{path}` exists and is not a kern manifest; refusing to "
                                 "overwrite it (give another -o, or remove it)")


def _check_quantize(quantize: str | None, hf: HFConfig) -> None:
    if quantize is None:
        return
    if quantize not in QUANTIZE:
        raise KernccError.single(f"--quantize {quantize}: expected one of {', '.join(QUANTIZE)}")
    if hf.fp8:
        raise KernccError.single(f"{hf.path}: the checkpoint is FP8 already "
                                 "(quantization_config); import it without --quantize")


def build(directory: str | Path, max_tokens: int | None = None, max_seqs: int | None = None,
          max_context: int | None = None, quantize: str | None = None
          ) -> tuple[dict, HFConfig, QwenConfig, Table]:
    """(manifest, HF config, builder config, tensor table) of the checkpoint in `directory`;
    nothing is written."""
    directory = Path(directory)
    if not directory.is_dir():
        raise KernccError.single(f"`{directory}` is not a directory (expected a Hugging Face "
                                 "model folder with config.json and safetensors)")
    hf = read_config(directory)
    _check_quantize(quantize, hf)
    table = read_table(directory)
    check_tensors(hf, table, quantize)
    c = hf.model(max_tokens, max_seqs, max_context)
    b = binding(hf, table, quantize)
    problems = c.problems() + _fp8_sizes(hf, b)
    if problems:
        raise KernccError(f"{hf.path}: the kernels cannot serve this model",
                          [Diagnostic(p, Location("", file=hf.path)) for p in problems])
    label = directory.resolve().name or "model"
    try:
        raw = manifest(c, label, b)
    except ValueError as err:  # an FP8 bind off its scale blocks (kerncc.example.qwen)
        raise KernccError.single(f"{hf.path}: {err}") from None
    _verified(raw)
    return raw, hf, c, table


def import_model(directory: str | Path, output: str | Path | None = None,
                 max_tokens: int | None = None, max_seqs: int | None = None,
                 max_context: int | None = None, quantize: str | None = None) -> Imported:
    """Build the manifest of the checkpoint in `directory` and write it to `output`
    (default DIR/model.json); `quantize="fp8"` makes the bf16 linears block-scaled FP8,
    quantized at load by the derive program."""
    raw, hf, c, table = build(directory, max_tokens, max_seqs, max_context, quantize)
    path = Path(output) if output is not None else Path(directory) / "model.json"
    _check_output(path)
    text = json.dumps(raw, indent=2, ensure_ascii=False) + "\n"
    try:
        write_text_atomic(path, text)
    except OSError as err:
        raise KernccError.single(f"cannot write `{path}`: {err.strerror or err}") from None
    beside = path.resolve().parent == table.reference.resolve().parent
    return Imported(path, raw, hf, c, table.reference, beside)
