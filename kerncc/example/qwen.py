"""The example model: a Qwen3-style decoder as a v5 manifest plus a random checkpoint.

`generate(out_dir, size, **overrides)` writes `model.json` (kern's canonical style: keys in
struct order, maps sorted, 2-space indent), `model.safetensors` (deterministic random bf16
weights under HF Qwen3 names) and `config.json` (HF-style, read by the oracle).

The manifest, per layer i (9 calls, layer i starting at call 1 + 9*i in every driven
program, so `l{i}.qkv_proj` is call 2 + 9*i everywhere):
  input_norm, qkv_proj, qk_rope_kv, attention, o_proj, post_norm, gate_up_proj, act,
  down_proj
(`qk_rope_kv`: q/k head norms, rope and the KV-cache write in one launch)
framed by `embed` (call 0) and `final_norm`, `lm_head`, `argmax` (the last three).
Programs: `prefill` (a chunk of `tokens` rows packing up to `seqs` sequences end to end,
split by `cu_seqlens`, over a paged KV cache that may already hold earlier chunks),
`decode` (one row), `decode_batch` (one row for each of up to `seqs` sequences), `load`
(once: rope cos/sin table) and `convert` (derive: f32 `model.norm.weight` source cast to a
bf16 carry). Binds show each segment form: q/k/v laid end to end, gate/up
interleaved, lm_head rows [0, vocab) of a padded checkpoint tensor.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kerncc.example.checkpoint import checkpoint, hf
from kerncc.example.config import PAGE, QwenConfig, make_config
from kerncc.kernels import library
from kerncc.safetensors import save_file

IN_BF16, OUT_BF16, INOUT_BF16 = "in buffer<bf16>", "out buffer<bf16>", "inout buffer<bf16>"
IN_I32, OUT_I32 = "in buffer<i32>", "out buffer<i32>"
IN_F32, OUT_F32 = "in buffer<f32>", "out buffer<f32>"
IN_STATE, INOUT_STATE = "in state", "inout state"

LAYER_CALLS = ("input_norm", "qkv_proj", "qk_rope_kv", "attention", "o_proj",
               "post_norm", "gate_up_proj", "act", "down_proj")


# ---- JSON pieces ---------------------------------------------------------------------------


def buf(name: str, offset: int = 0) -> dict:
    return {"buf": name, "offset": offset} if offset else {"buf": name}


def var(name: str) -> dict:
    return {"var": name}


def i32(value: int) -> dict:
    return {"i32": int(value)}


def f32(value: float) -> dict:
    return {"f32": float(value)}  # the runtime rounds it to f32 when it packs the launch


def param(i: int) -> dict:
    return {"param": i}


def ceil_div(e: Any, d: int) -> dict:
    return {"ceil_div": [e, d]}


def ceil(n: int, d: int) -> int:
    return -(-n // d)


def mul(e: Any, c: int) -> dict:
    return {"mul": [e, c]}


def norm_block(cols: int) -> int:
    """Threads of a row-norm block: one per 8 columns, whole warps, at most 256."""
    return min(256, 32 * ceil(ceil(cols, 8), 32))


def vector(n: int, width: int) -> int:
    """The elements a thread handles at once: `width` when n is a multiple of it, else 1
    (the kernels' own test, so the grid covers exactly what they step over)."""
    return width if n % width == 0 else 1


def kernel_launch(entry: str, params: list[str], args: list[dict], grid: list[Any], block: int,
                  shared_mem: int = 0) -> dict:
    """One launch of a library kernel: its params, the args that feed them, its geometry."""
    launch = {
        "module": library.module_of(entry),
        "entry": entry,
        "params": params,
        "block": [block, 1, 1],
        "grid": grid + [1] * (3 - len(grid)),
    }
    if shared_mem:
        launch["shared_mem"] = shared_mem  # dynamic bytes
    launch["args"] = args
    return launch


def kernel_op(params: list[str], entry: str, scalars: list[str], consts: list[dict],
              grid: list[Any], block: int, shared_mem: int = 0) -> dict:
    """An op of one kernel launch: the op's params forwarded, then launch-private constants."""
    args = [param(i) for i in range(len(params))] + consts
    launch = kernel_launch(entry, params + scalars, args, grid, block, shared_mem)
    return {"params": params, "impl": {"launches": [launch]}}


def attn_decode_op(c: QwenConfig) -> dict:
    """Flash-decoding in two launches (kernels/attention.cu): per (sequence, kv head, split of
    DECODE_SPLIT keys) the softmax partials of the G q heads go to the f32 workspace of param 5
    (`attn_partials`), then per (sequence, q head) the splits are merged in order into out."""
    nq, nk, hd, splits = c.heads, c.kv_heads, c.head_dim, c.decode_splits
    params = [IN_BF16, IN_STATE, IN_I32, IN_I32, OUT_BF16, OUT_F32, "i32"]
    split = kernel_launch(
        "attn_decode_split_bf16", [IN_BF16, IN_STATE, IN_I32, IN_I32, OUT_F32] + ["i32"] * 6
        + ["f32"], [param(0), param(1), param(2), param(3), param(5), param(6), i32(nq), i32(nk),
                    i32(hd), i32(c.pages_per_seq), i32(splits), f32(1.0 / math.sqrt(hd))],
        ["seqs", nk, splits], 256)
    combine = kernel_launch(
        "attn_decode_combine_bf16", [IN_F32, IN_I32, OUT_BF16] + ["i32"] * 4,
        [param(5), param(3), param(4), param(6), i32(nq), i32(hd), i32(splits)], ["seqs", nq], 128)
    return {"params": params, "impl": {"launches": [split, combine]}}


def attn_prefill_smem(hd: int) -> int:
    """attn_prefill_bf16's dynamic shared memory: 576 rows of hd bf16 + 16 bytes (attention.cu)."""
    return 576 * (2 * hd + 16)


def gemm_op(c_param: str, extern: str, n: int, k: int) -> dict:
    """(A, W, C, m) → extern (A, W, C, m, n, k) with n, k fixed by the model."""
    params = [IN_BF16, IN_BF16, c_param, "i32"]
    launch = {
        "entry": f"extern:{extern}",
        "params": params + ["i32", "i32"],
        "args": [param(i) for i in range(4)] + [i32(n), i32(k)],
    }
    return {"params": params, "impl": {"launches": [launch]}}


def weight(dtype: str, shape: list[int], bind: list[dict], kind: str = "weight") -> dict:
    return {"dtype": dtype, "shape": shape, "kind": kind, "bind": bind}


def workspace(dtype: str, shape: list[Any]) -> dict:
    return {"dtype": dtype, "shape": shape, "kind": "workspace"}


def sorted_map(items: dict) -> dict:
    return {k: items[k] for k in sorted(items, key=lambda s: s.encode())}


# ---- ops -----------------------------------------------------------------------------------


def ops(c: QwenConfig) -> dict[str, dict]:
    nq, nk, hd, eps = c.heads, c.kv_heads, c.head_dim, f32(c.eps)
    heads = [i32(nq), i32(nk), i32(hd)]
    attn = heads + [i32(c.pages_per_seq), f32(1.0 / math.sqrt(hd))]
    rows = "tokens"
    return {
        "embed": kernel_op([IN_I32, IN_BF16, OUT_BF16, "i32"], "embedding_gather_bf16",
                           ["i32"], [i32(c.hidden)], [rows], 128),
        # a block per row (kernels/norm.cu); rmsnorm_last too, per sequence
        "rmsnorm": kernel_op([IN_BF16, IN_BF16, OUT_BF16, "i32"], "rmsnorm_bf16",
                             ["i32", "f32"], [i32(c.hidden), eps], [rows], norm_block(c.hidden)),
        "add_rmsnorm": kernel_op([INOUT_BF16, IN_BF16, IN_BF16, OUT_BF16, "i32"],
                                 "add_rmsnorm_bf16", ["i32", "f32"], [i32(c.hidden), eps],
                                 [rows], norm_block(c.hidden)),
        # q/k head norms, rope and the KV-cache write of a layer in one launch
        # (kernels/qk_rope_kv.cu): a warp per (row, head) over all nq + 2*nk heads
        "qk_rope_kv": kernel_op([INOUT_BF16, IN_BF16, IN_I32, IN_F32, IN_I32, INOUT_STATE,
                                 "i32"], "qk_norm_rope_kv_bf16", ["i32"] * 3 + ["f32"],
                                heads + [eps], [ceil_div(mul(rows, nq + 2 * nk), 4)], 128),
        # a packed chunk: sequence s's rows are [cu_seqlens[s], cu_seqlens[s+1]), grid z = s
        "attn_prefill": kernel_op([IN_BF16, IN_STATE, IN_I32, IN_I32, IN_I32, OUT_BF16, "i32",
                                   "i32"], "attn_prefill_varlen_bf16", ["i32"] * 4 + ["f32"],
                                  attn, [ceil_div(rows, 64 // c.group), nk, "seqs"], 256,
                                  attn_prefill_smem(hd)),
        "attn_decode": attn_decode_op(c),
        # silu_mul steps over its outputs 8 at a time when the sizes allow (kernels/
        # activation.cu); any grid is correct, this one has no idle threads.
        "silu_mul": kernel_op([IN_BF16, OUT_BF16, "i32"], "silu_mul_bf16", ["i32", "i32"],
                              [i32(c.intermediate), i32(c.gate_up_block)],
                              [ceil_div(mul(rows, c.intermediate // vector(
                                  math.gcd(c.intermediate, c.gate_up_block), 8)), 256)], 256),
        "final_norm": kernel_op([IN_BF16, IN_BF16, OUT_BF16, "i32", "i32"], "rmsnorm_last_bf16",
                                ["i32", "f32"], [i32(c.hidden), eps], ["seqs"],
                                norm_block(c.hidden)),
        "final_norm_packed": kernel_op([IN_BF16, IN_BF16, OUT_BF16, IN_I32, "i32"],
                                       "rmsnorm_last_varlen_bf16", ["i32", "f32"],
                                       [i32(c.hidden), eps], ["seqs"], norm_block(c.hidden)),
        "argmax": kernel_op([IN_F32, OUT_I32, "i32"], "argmax_f32", ["i32"], [i32(c.vocab)],
                            ["seqs"], 256),
        "rope_table": kernel_op([OUT_F32], "rope_table_f32", ["i32", "i32", "f32"],
                                [i32(c.max_context), i32(hd), f32(c.rope_theta)],
                                [ceil(c.max_context * hd // 2, 256)], 256),
        "cast_bf16": kernel_op([IN_F32, OUT_BF16], "cast_f32_bf16", ["i32"], [i32(c.hidden)],
                               [ceil(c.hidden, 256)], 256),
        "qkv_proj": gemm_op(OUT_BF16, "cublaslt_bf16_tn", c.qkv_dim, c.hidden),
        "o_proj": gemm_op(OUT_BF16, "cublaslt_bf16_tn", c.hidden, nq * hd),
        "gate_up_proj": gemm_op(OUT_BF16, "cublaslt_bf16_tn", 2 * c.intermediate, c.hidden),
        "down_proj": gemm_op(INOUT_BF16, "cublaslt_bf16_tn_acc", c.hidden, c.intermediate),
        "lm_head": gemm_op(OUT_F32, "cublas_bf16_tn_f32", c.vocab, c.hidden),
    }


# ---- buffers and states --------------------------------------------------------------------


def layer_weights(c: QwenConfig, i: int) -> dict[str, dict]:
    h, qkv = c.hidden, c.qkv_dim
    return {
        f"l{i}.input_norm.w": weight("bf16", [h], [{"tensor": hf(i, "input_layernorm")}]),
        f"l{i}.qkv_proj.w": weight("bf16", [qkv, h], [
            {"tensor": hf(i, "self_attn.q_proj")},
            {"tensor": hf(i, "self_attn.k_proj")},
            {"tensor": hf(i, "self_attn.v_proj")},
        ]),
        f"l{i}.qk_norm.w": weight("bf16", [2, c.head_dim], [
            {"tensor": hf(i, "self_attn.q_norm")},
            {"tensor": hf(i, "self_attn.k_norm")},
        ]),
        f"l{i}.o_proj.w": weight("bf16", [h, c.heads * c.head_dim],
                                 [{"tensor": hf(i, "self_attn.o_proj")}]),
        f"l{i}.post_norm.w": weight("bf16", [h],
                                    [{"tensor": hf(i, "post_attention_layernorm")}]),
        f"l{i}.gate_up_proj.w": weight("bf16", [2 * c.intermediate, h], [{
            "tensor": hf(i, "mlp.gate_proj"),
            "interleave": {"with": hf(i, "mlp.up_proj"), "rows": c.gate_up_block},
        }]),
        f"l{i}.down_proj.w": weight("bf16", [h, c.intermediate],
                                    [{"tensor": hf(i, "mlp.down_proj")}]),
    }


def io_buffers(c: QwenConfig) -> dict[str, dict]:
    rows, seqs = ["tokens"], ["seqs"]
    return {
        "token_ids": {"dtype": "i32", "shape": rows, "kind": "input", "fill": "token",
                      "domain": {"index_into": "embed.w"}},
        "positions": {"dtype": "i32", "shape": rows, "kind": "input", "fill": "position",
                      "domain": {"index_into": "rope"}},
        "slot_mapping": {"dtype": "i32", "shape": rows, "kind": "input", "fill": "slot",
                         "domain": {"index_into": "kv.0"}},
        "seq_lens": {"dtype": "i32", "shape": seqs, "kind": "input", "fill": "seq_len",
                     "domain": {"min": 1, "max": c.max_context}},
        "cu_seqlens": {"dtype": "i32", "shape": [c.max_seqs + 1], "kind": "input",
                       "fill": "cu_seqlens", "domain": {"min": 0, "max": c.max_tokens}},
        "block_table": {"dtype": "i32", "shape": ["seqs", c.pages_per_seq], "kind": "input",
                        "domain": {"index_into": "kv.0", "stride": PAGE}},
        "next_tokens": {"dtype": "i32", "shape": seqs, "kind": "output", "fill": "tokens"},
        "logits": {"dtype": "f32", "shape": ["seqs", c.vocab], "kind": "output"},
    }


def model_buffers(c: QwenConfig) -> dict[str, dict]:
    h = c.hidden
    out = {
        "embed.w": weight("bf16", [c.vocab, h], [{"tensor": "model.embed_tokens.weight"}]),
        "lm_head.w": weight("bf16", [c.vocab, h],
                            [{"tensor": "lm_head.weight", "rows": [0, c.vocab]}]),
        "final_norm.src": weight("f32", [h], [{"tensor": "model.norm.weight"}], kind="source"),
        "final_norm.w": {"dtype": "bf16", "shape": [h], "kind": "carry"},
        "rope": {"dtype": "f32", "shape": [c.max_context, c.head_dim], "kind": "carry"},
    }
    for i in range(c.layers):
        out.update(layer_weights(c, i))
    return out


def workspaces(c: QwenConfig) -> dict[str, dict]:
    t = "tokens"
    return {
        "residual": workspace("bf16", [t, c.hidden]),
        "normed": workspace("bf16", [t, c.hidden]),
        "qkv": workspace("bf16", [t, c.qkv_dim]),
        "attn_out": workspace("bf16", [t, c.heads * c.head_dim]),
        "o_out": workspace("bf16", [t, c.hidden]),
        "gate_up": workspace("bf16", [t, 2 * c.intermediate]),
        "act": workspace("bf16", [t, c.intermediate]),
        "final_normed": workspace("bf16", ["seqs", c.hidden]),
        # attn_decode's split partials: [m | l | o[hd]] per (q head, split) of each sequence.
        "attn_partials": workspace("f32", ["seqs", c.heads * c.decode_splits * (c.head_dim + 2)]),
    }


# ---- programs ------------------------------------------------------------------------------


def call(label: str, op: str, *args: dict) -> dict:
    return {"label": label, "op": op, "args": list(args)}


def layer_calls(i: int, prefill: bool) -> list[dict]:
    """Layer i's calls; prefill and decode differ only in the attention op."""
    rows, pre = var("tokens"), f"l{i}."

    def w(name: str) -> dict:
        return buf(f"{pre}{name}.w")

    if prefill:
        attention = call(pre + "attention", "attn_prefill", buf("qkv"), {"state": f"kv.{i}"},
                         buf("block_table"), buf("positions"), buf("cu_seqlens"),
                         buf("attn_out"), rows, var("seqs"))
    else:
        attention = call(pre + "attention", "attn_decode", buf("qkv"), {"state": f"kv.{i}"},
                         buf("block_table"), buf("seq_lens"), buf("attn_out"),
                         buf("attn_partials"), var("seqs"))
    calls = [
        call(pre + "input_norm", "rmsnorm", buf("residual"), w("input_norm"), buf("normed"), rows),
        call(pre + "qkv_proj", "qkv_proj", buf("normed"), w("qkv_proj"), buf("qkv"), rows),
        call(pre + "qk_rope_kv", "qk_rope_kv", buf("qkv"), w("qk_norm"), buf("positions"),
             buf("rope"), buf("slot_mapping"), {"state": f"kv.{i}"}, rows),
        attention,
        call(pre + "o_proj", "o_proj", buf("attn_out"), w("o_proj"), buf("o_out"), rows),
        call(pre + "post_norm", "add_rmsnorm", buf("residual"), buf("o_out"), w("post_norm"),
             buf("normed"), rows),
        call(pre + "gate_up_proj", "gate_up_proj", buf("normed"), w("gate_up_proj"),
             buf("gate_up"), rows),
        call(pre + "act", "silu_mul", buf("gate_up"), buf("act"), rows),
        call(pre + "down_proj", "down_proj", buf("act"), w("down_proj"), buf("residual"), rows),
    ]
    assert [x["label"] for x in calls] == [pre + name for name in LAYER_CALLS]
    return calls


def forward_calls(c: QwenConfig, prefill: bool) -> list[dict]:
    rows, seqs = var("tokens"), var("seqs")
    calls = [call("embed", "embed", buf("token_ids"), buf("embed.w"), buf("residual"), rows)]
    for i in range(c.layers):
        calls += layer_calls(i, prefill)
    # The last row of each sequence feeds the head: row cu_seqlens[s+1]-1 of a packed prefill
    # chunk, every row of a decode call.
    if prefill:
        final_norm = call("final_norm", "final_norm_packed", buf("residual"),
                          buf("final_norm.w"), buf("final_normed"), buf("cu_seqlens"), seqs)
    else:
        final_norm = call("final_norm", "final_norm", buf("residual"), buf("final_norm.w"),
                          buf("final_normed"), seqs, i32(1))
    calls += [
        final_norm,
        call("lm_head", "lm_head", buf("final_normed"), buf("lm_head.w"), buf("logits"), seqs),
        call("argmax", "argmax", buf("logits"), buf("next_tokens"), seqs),
    ]
    return calls


def programs(c: QwenConfig) -> dict[str, dict]:
    return {
        # packed: up to `seqs` sequences per chunk, split by `cu_seqlens` (spec §4.4, §6.2)
        "prefill": {"batch": {"groups": c.max_seqs, "rows": "tokens"},
                    "calls": forward_calls(c, True)},
        "decode": {"batch": {"groups": 1, "rows": 1}, "graph": True,
                   "calls": forward_calls(c, False)},
        "decode_batch": {"batch": {"groups": c.max_seqs, "rows": 1}, "graph": True,
                         "calls": forward_calls(c, False)},
        "load": {"once": True, "calls": [call("rope_table", "rope_table", buf("rope"))]},
        "convert": {"derive": True, "calls": [
            call("final_norm.cast", "cast_bf16", buf("final_norm.src"), buf("final_norm.w")),
        ]},
    }


def modules(op_map: dict[str, dict]) -> dict[str, dict]:
    used = {x["module"] for o in op_map.values() for x in o["impl"]["launches"] if "module" in x}
    index = library.index()
    return {name: {"source": Path(index[name]["file"]).name, "sha256": index[name]["sha256"]}
            for name in used}


def manifest(c: QwenConfig, model: str) -> dict[str, Any]:
    op_map = ops(c)
    return {
        "schema_version": 5,
        "model": model,
        "vars": {
            "seqs": {"max": c.max_seqs, "axis": "groups"},
            "tokens": {"max": c.max_tokens, "axis": "rows"},
        },
        "states": sorted_map({f"kv.{i}": {"bytes_per_token": c.kv_bytes_per_token}
                              for i in range(c.layers)}),
        "buffers": sorted_map({**io_buffers(c), **model_buffers(c), **workspaces(c)}),
        "modules": sorted_map(modules(op_map)),
        "ops": sorted_map(op_map),
        "programs": sorted_map(programs(c)),
    }


# ---- entry point ---------------------------------------------------------------------------


def generate(out_dir: str | Path, size: str = "tiny", **overrides: float
             ) -> tuple[Path, Path]:
    """Write model.json, model.safetensors and config.json; return (manifest, weights) paths."""
    c = make_config(size, **overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path, weights_path = out / "model.json", out / "model.safetensors"
    text = json.dumps(manifest(c, f"kerncc-qwen3-{size}"), indent=2, ensure_ascii=False)
    manifest_path.write_text(text + "\n")
    (out / "config.json").write_text(json.dumps(c.to_hf(), indent=2) + "\n")
    save_file(checkpoint(c), weights_path, metadata={"format": "pt"})
    return manifest_path, weights_path
