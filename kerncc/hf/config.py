"""Hugging Face `config.json` of a decoder checkpoint: parsed, typed, checked against the kernels.

`read_config(path)` gives an `HFConfig` for `Qwen3ForCausalLM`, `LlamaForCausalLM` and
`MistralForCausalLM` (the Llama layer: no attention bias, SiLU-gated MLP, RMSNorm, rotate-half
rope); anything the manifest builder cannot express (another architecture, attention or MLP
bias, a sliding window shorter than the served context, rope scaling other than `llama3`,
quantization other than block-wise FP8, head sizes the kernels cannot take) is refused naming
the field. Rope
parameters are read in both layouts: transformers 4's `rope_theta` + `rope_scaling` and
transformers 5's `rope_parameters`. Every problem of a file is collected into one
`KernccError`, each diagnostic naming the file and the field's JSON pointer.

`HFConfig.model(...)` turns it into the builder's `QwenConfig` at given serving sizes.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import attrs

from kerncc.diagnostics import Diagnostic, KernccError, Location, pointer
from kerncc.example.config import PAGE, QwenConfig
from kerncc.files import read_json

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama",
                 "MistralForCausalLM": "mistral"}
# Defaults of the transformers config classes where a field may be left out.
HEAD_DIM_DEFAULT = {"qwen3": 128}
ROPE_THETA_DEFAULT = 10_000.0
GROUPS = (1, 2, 4, 8)  # q heads per kv head the attention kernels take (attention.cu)
DEFAULT_CONTEXT = 8192  # --max-context when not given (capped by max_position_embeddings)


@attrs.frozen
class Llama3Rope:
    """`rope_scaling` of type llama3."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@attrs.frozen
class HFConfig:
    """What the importer needs of a checkpoint's config.json."""

    path: str
    architecture: str  # the `architectures` entry
    family: str  # qwen3, llama or mistral
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_position_embeddings: int
    eps: float
    rope_theta: float
    rope_scaling: Llama3Rope | None
    tied: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    serving: dict[str, int]  # the optional "kerncc" section: max_tokens, max_seqs, interleave
    fp8: bool = False  # quantization_config: block-wise e4m3 weights with weight_scale_inv

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"

    @property
    def kv_repeat(self) -> int:
        """Copies of each kv head the manifest needs so that heads / kv heads is a group the
        kernels take (Llama-3.2-3B's 24 / 8 = 3 becomes 24 / 24 = 1)."""
        group = self.heads // self.kv_heads
        return next(r for r in range(1, group + 1) if group % r == 0 and group // r in GROUPS)

    def model(self, max_tokens: int | None = None, max_seqs: int | None = None,
              max_context: int | None = None) -> QwenConfig:
        """The builder's config at these serving sizes (defaults: the "kerncc" section, then
        2048 rows, 128 sequences, min(max_position_embeddings, 8192) positions)."""
        context = max_context or min(self.max_position_embeddings, DEFAULT_CONTEXT) // PAGE * PAGE
        tokens = max_tokens or self.serving.get("max_tokens") or min(2048, context)
        seqs = max_seqs or self.serving.get("max_seqs") or min(128, tokens)
        problems = []
        if max_context is None and context < PAGE:  # the user gave no --max-context to blame
            problems.append(f"max_position_embeddings {self.max_position_embeddings} is shorter "
                            f"than one page of {PAGE} positions, the least kerncc serves")
        elif context % PAGE or context < PAGE:
            problems.append(f"--max-context {context} is not a positive multiple of {PAGE}")
        if context > self.max_position_embeddings:
            problems.append(f"--max-context {context} exceeds max_position_embeddings "
                            f"{self.max_position_embeddings}")
        if seqs > tokens:
            problems.append(f"--max-seqs {seqs} exceeds --max-tokens {tokens}")
        if self.sliding_window is not None and self.sliding_window < context:
            problems.append(f"sliding_window {self.sliding_window} is shorter than the served "
                            f"context {context} (the kernels attend to every key; give "
                            f"--max-context {self.sliding_window // PAGE * PAGE} or less)")
        if problems:
            raise KernccError(f"{self.path}: cannot serve these sizes",
                              [Diagnostic(p, Location("", file=self.path)) for p in problems])
        scaling = self.rope_scaling
        return QwenConfig(
            layers=self.layers, hidden=self.hidden, heads=self.heads,
            kv_heads=self.kv_heads * self.kv_repeat, head_dim=self.head_dim,
            intermediate=self.intermediate, vocab=self.vocab, max_tokens=tokens,
            max_seqs=seqs, max_context=context, seed=0, rope_theta=self.rope_theta,
            eps=self.eps, interleave=self.serving.get("interleave") or interleave(
                self.intermediate), qk_norm=self.qk_norm,
            rope_scaling=None if scaling is None else attrs.astuple(scaling))


def interleave(intermediate: int) -> int:
    """The gate/up interleave block: 128 rows, or the largest divisor of 128 that fits."""
    block = min(128, intermediate)
    return block if intermediate % block == 0 else math.gcd(intermediate, 128)


# ---------------------------------------------------------------------------------------------
# Reading fields


_MISSING = object()


class _Fields:
    """Typed reads of a JSON object's fields, collecting one diagnostic per problem."""

    def __init__(self, path: str, raw: dict[str, Any]) -> None:
        self.path, self.raw = path, raw
        self.problems: list[Diagnostic] = []

    def problem(self, message: str, *where: str | int) -> None:
        self.problems.append(Diagnostic(message, Location(pointer(*where), file=self.path)))

    def get(self, name: str, kind: str, default: Any = _MISSING, within: dict | None = None,
            prefix: tuple[str, ...] = ()) -> Any:
        """Field `name` of kind int, number, bool, str or int_list (an int or a list of ints);
        `null` counts as absent. Absent without a default, or of another type: a problem."""
        source = self.raw if within is None else within
        value = source.get(name)
        where = (*prefix, name)
        if value is None:
            if default is _MISSING:
                self.problem(f"missing field `{name}`", *where)
                return None
            return default
        if not _is(kind, value):
            self.problem(f"field `{name}` must be {_KINDS[kind]}, not {json.dumps(value)}",
                         *where)
            return None
        return value


_KINDS = {"int": "a whole number", "posint": "a positive whole number", "number": "a number",
          "posnumber": "a positive finite number",
          "bool": "true or false", "str": "a string", "int_list": "a token id or a list of them",
          "object": "an object", "list": "a list"}


def _finite(value: Any) -> bool:
    """A JSON number that converts to a finite float (a 400-digit integer does not: float()
    of it raises OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) if isinstance(value, float) else abs(value) <= sys.float_info.max


def _is(kind: str, value: Any) -> bool:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    checks = {
        "int": is_int and value >= 0,
        "posint": is_int and value > 0,
        "number": _finite(value),
        "posnumber": _finite(value) and value > 0,
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "int_list": (is_int and value >= 0) or (isinstance(value, list) and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)),
        "object": isinstance(value, dict),
        "list": isinstance(value, list),
    }
    return checks[kind]


def token_ids(value: Any) -> tuple[int, ...]:
    """An `eos_token_id` value (an id or a list of ids) as a tuple."""
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


# ---------------------------------------------------------------------------------------------
# The checks


def _architecture(f: _Fields) -> tuple[str, str]:
    """The architecture, from `architectures` (or, where a bare config has none, from
    `model_type`)."""
    by_type = {family: name for name, family in ARCHITECTURES.items()}
    model_type = f.raw.get("model_type")
    if f.raw.get("architectures") is None and isinstance(model_type, str) \
            and model_type in by_type:
        return by_type[model_type], model_type
    names = f.get("architectures", "list")
    if names is None:
        return "", ""
    known = [n for n in names if isinstance(n, str) and n in ARCHITECTURES]  # any JSON value
    if len(names) != 1 or not known:
        f.problem(f"architectures {json.dumps(names)} is not one of "
                  f"{', '.join(ARCHITECTURES)}", "architectures")
        return "", ""
    return known[0], ARCHITECTURES[known[0]]


FP8_BLOCK = [128, 128]


def _quantization(f: _Fields) -> bool:
    """Whether `quantization_config` declares block-wise FP8 weights (Qwen3-8B-FP8's layout:
    quant_method fp8, fmt e4m3, weight_block_size [128, 128], activations left dynamic, which
    kerncc keeps in bf16); any other quantization is refused naming the field."""
    q = f.get("quantization_config", "object", None)
    if q is None:
        return False
    where = "quantization_config"
    method, fmt = q.get("quant_method"), q.get("fmt", "e4m3")
    if method != "fp8":
        f.problem(f"quant_method {json.dumps(method)} is not supported (only fp8, block-wise "
                  "e4m3)", where, "quant_method")
    if fmt != "e4m3":
        f.problem(f"fmt {json.dumps(fmt)} is not supported (only e4m3)", where, "fmt")
    if q.get("weight_block_size") != FP8_BLOCK:
        f.problem(f"weight_block_size {json.dumps(q.get('weight_block_size'))} is not "
                  f"supported (only {FP8_BLOCK})", where, "weight_block_size")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        f.problem(f"activation_scheme {json.dumps(q.get('activation_scheme'))} is not "
                  "supported (only dynamic: activations stay bf16)", where, "activation_scheme")
    return True


def _refusals(f: _Fields, family: str) -> None:
    """Fields whose value the manifest builder cannot express."""
    act = f.get("hidden_act", "str", "silu")
    if act not in (None, "silu"):
        f.problem(f"hidden_act `{act}` is not supported (only silu)", "hidden_act")
    for name in ("attention_bias", "mlp_bias"):
        if f.get(name, "bool", False):
            f.problem(f"{name} true is not supported (the projections have no bias)", name)
    if family == "qwen3" and f.get("use_sliding_window", "bool", False):
        f.problem("use_sliding_window true is not supported", "use_sliding_window")
    layer_types = f.get("layer_types", "list", [])
    for i, kind in enumerate(layer_types or []):
        if kind != "full_attention":
            f.problem(f"layer type {json.dumps(kind)} is not supported (only full_attention)",
                      "layer_types", i)
            break


def _rope(f: _Fields) -> tuple[float, Llama3Rope | None]:
    """(theta, llama3 scaling or None) from rope_parameters (v5) or rope_theta/rope_scaling."""
    params = f.get("rope_parameters", "object", None)
    if params is not None:
        where: tuple[str, ...] = ("rope_parameters",)
        theta = f.get("rope_theta", "posnumber", ROPE_THETA_DEFAULT, params, where)
        scaling: dict | None = params
    else:
        where = ("rope_scaling",)
        theta = f.get("rope_theta", "posnumber", ROPE_THETA_DEFAULT)
        scaling = f.get("rope_scaling", "object", None)
    if scaling is None:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        f.problem(f"rope type {json.dumps(kind)} is not supported (default or llama3)",
                  *where, "rope_type")
        return theta, None
    values = [f.get(n, k, within=scaling, prefix=where) for n, k in (
        ("factor", "posnumber"), ("low_freq_factor", "posnumber"),
        ("high_freq_factor", "posnumber"),
        ("original_max_position_embeddings", "posint"))]
    if None in values:
        return theta, None
    original, limit = values[3], LIMITS["max_position_embeddings"]
    if original > limit:  # the once program passes it to its kernel as an i32
        f.problem(f"original_max_position_embeddings {original} is past kerncc's limit of "
                  f"{limit}", *where, "original_max_position_embeddings")
        return theta, None
    if values[0] <= 0 or values[2] <= values[1]:
        f.problem("llama3 rope scaling needs factor > 0 and high_freq_factor > low_freq_factor",
                  *where)
        return theta, None
    return theta, Llama3Rope(float(values[0]), float(values[1]), float(values[2]), values[3])


def _shapes(f: _Fields, family: str) -> dict[str, Any]:
    sizes = {key: f.get(name, "posint") for key, name in (
        ("layers", "num_hidden_layers"), ("hidden", "hidden_size"),
        ("heads", "num_attention_heads"), ("intermediate", "intermediate_size"),
        ("vocab", "vocab_size"), ("max_position_embeddings", "max_position_embeddings"))}
    heads, hidden = sizes["heads"], sizes["hidden"]
    sizes["kv_heads"] = f.get("num_key_value_heads", "posint", heads)
    implied = HEAD_DIM_DEFAULT.get(family, hidden // heads if heads and hidden else None)
    sizes["head_dim"] = f.get("head_dim", "posint", implied)
    return sizes


# Bounds far past any published model, so that an untrusted config cannot ask for a
# manifest of a billion layers (and sizes stay inside the kernels' i32 arithmetic).
LIMITS = {"num_hidden_layers": 1024, "hidden_size": 65536, "num_attention_heads": 1024,
          "intermediate_size": 1 << 20, "vocab_size": 1 << 22,
          "max_position_embeddings": 1 << 24}


def _kernel_limits(f: _Fields, s: dict[str, Any]) -> None:
    """Shapes the kernels cannot run (kernels/*.cu), each naming its field."""
    for name, limit in LIMITS.items():
        value = f.raw.get(name)
        if _is("posint", value) and value > limit:
            f.problem(f"{name} {value} is past kerncc's limit of {limit}", name)
    hd, heads, kv = s["head_dim"], s["heads"], s["kv_heads"]
    if hd is not None and (hd % 16 or hd > 128):
        f.problem(f"head_dim {hd} is not supported (the attention kernels take multiples of 16 "
                  "up to 128)", "head_dim")
    if s["hidden"] is not None and s["hidden"] % 8:
        f.problem(f"hidden_size {s['hidden']} is not a multiple of 8", "hidden_size")
    if heads is None or kv is None:
        return
    if heads % kv:  # any whole group is served (kv_repeat), so this is the one limit
        f.problem(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}",
                  "num_key_value_heads")


def parse_config(path: str, raw: Any) -> HFConfig:
    """The HFConfig of a parsed config.json; every problem collected into one KernccError."""
    if not isinstance(raw, dict):
        raise KernccError(f"{path}: bad config", [Diagnostic("config.json is not a JSON object",
                                                             Location("", file=path))])
    f = _Fields(path, raw)
    architecture, family = _architecture(f)
    _refusals(f, family)
    fp8 = _quantization(f)
    shapes = _shapes(f, family)
    _kernel_limits(f, shapes)
    theta, scaling = _rope(f)
    eps = f.get("rms_norm_eps", "posnumber", 1e-6)
    tied = f.get("tie_word_embeddings", "bool", False)
    window = f.get("sliding_window", "posint", None) if family == "mistral" else None
    eos = f.get("eos_token_id", "int_list", None)
    serving = f.get("kerncc", "object", {}) or {}
    serving = {k: f.get(k, "posint", None, serving, ("kerncc",))
               for k in ("max_tokens", "max_seqs", "interleave")}
    if f.problems:
        raise KernccError(f"{path}: cannot import this model", f.problems)
    return HFConfig(path=path, architecture=architecture, family=family, eps=float(eps),
                    rope_theta=float(theta), rope_scaling=scaling, tied=tied,
                    sliding_window=window, eos_token_ids=token_ids(eos),
                    serving={k: v for k, v in serving.items() if v is not None}, fp8=fp8,
                    **shapes)


def read_config(directory: str | Path) -> HFConfig:
    """The HFConfig of DIR/config.json."""
    path = Path(directory) / "config.json"
    return parse_config(str(path), read_json(path, "model config"))
