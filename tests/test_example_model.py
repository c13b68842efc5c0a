"""The example model: generator determinism, manifest structure, and an end-to-end run.

The end-to-end test runs the generated manifest's programs call by call through the numpy
references with a tiny executor written here (one byte array per buffer and state, weights
assembled from `bind`) and compares the logits with the independent oracle. It proves that
manifest, references and oracle agree; the real runtime replaces the executor later.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from kerncc.kernels import library
from kerncc.kernels.reference import EXTERNS, KERNELS

from kerncc.example import generate, make_config
from tests.oracle import Oracle
from kerncc.example.qwen import LAYER_CALLS
from kerncc.checkpoint.safetensors import load_file

DRIVEN = ("prefill", "decode", "decode_batch")
DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "f32": np.dtype(np.float32),
          "i32": np.dtype(np.int32)}
SCALARS = {"i32": np.int32, "i64": np.int64, "f32": np.float32, "u8": np.uint8}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[dict, Path]:
    manifest_path, weights_path = generate(tmp_path_factory.mktemp("tiny"), "tiny")
    return json.loads(manifest_path.read_text()), weights_path


# ---- generator -----------------------------------------------------------------------------


def file_hashes(paths) -> list[str]:
    return [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths]


def test_same_seed_same_bytes(tmp_path):
    first = file_hashes(generate(tmp_path / "a", "tiny", seed=7))
    second = file_hashes(generate(tmp_path / "b", "tiny", seed=7))
    other = file_hashes(generate(tmp_path / "c", "tiny", seed=8))
    assert first == second
    assert first[0] == other[0] and first[1] != other[1]  # the seed changes weights only


def test_overrides_and_limits(tmp_path):
    manifest_path, _ = generate(tmp_path, "tiny", layers=3, vocab=300, max_seqs=2)
    m = json.loads(manifest_path.read_text())
    assert sorted(m["states"]) == ["kv.0", "kv.1", "kv.2"]
    assert m["vars"]["seqs"]["max"] == 2 and m["buffers"]["logits"]["shape"] == ["seqs", 300]
    with pytest.raises(ValueError, match="head_dim"):
        make_config("tiny", head_dim=12)
    with pytest.raises(ValueError, match="unknown overrides"):
        make_config("tiny", hiddn=8)


def test_small_config_shapes():
    c = make_config("small")
    assert (c.layers, c.hidden, c.heads, c.kv_heads, c.head_dim) == (24, 2048, 16, 8, 128)
    assert (c.intermediate, c.vocab, c.kv_bytes_per_token) == (6144, 32000, 4096)
    assert c.max_seqs == 128  # decode_batch takes up to 128 sequences


def test_the_batched_decode_launches_fewer_attention_blocks_than_splits():
    """decode (one sequence) gets a split block per DECODE_SPLIT keys of max_context; the
    batched decode 8 per (sequence, kv head) that loop (kernels/attention.cu), so 32 short
    sequences do not launch 8192 blocks; a model with fewer splits keeps one per split."""
    from kerncc.example.qwen import attn_decode_op

    small, tiny = make_config("small"), make_config("tiny")
    assert (small.decode_splits, small.decode_batch_blocks) == (32, 8)
    assert tiny.decode_batch_blocks == tiny.decode_splits == 2
    grid = lambda op: op["impl"]["launches"][0]["grid"]
    assert grid(attn_decode_op(small, small.decode_splits)) == ["seqs", 8, 32]
    assert grid(attn_decode_op(small, small.decode_batch_blocks)) == ["seqs", 8, 8]



def test_head_dim_128_prefills_on_the_wgmma_kernel_and_others_on_mma_sync():
    """attention_sm90a.cu serves head dim 128 only (128 pairs a block of 384 threads, its
    shared memory as the kernel's WG_SMEM); the tiny model's head dim 16 keeps attention.cu's
    kernel (64 pairs a block of 256). Both name the packed-prefill contract's params, and the
    numpy reference answers to either entry."""
    from kerncc.example.qwen import (SM90A_PREFILL_BLOCK, SM90A_PREFILL_SMEM, attn_prefill_op,
                                     attn_prefill_smem)
    from kerncc.kernels import library
    from kerncc.kernels.reference import KERNELS

    small, tiny = make_config("small"), make_config("tiny")
    wg = attn_prefill_op(small)["impl"]["launches"][0]
    mma = attn_prefill_op(tiny)["impl"]["launches"][0]
    assert (wg["entry"], wg["module"]) == ("attn_prefill_varlen_sm90a_bf16", "attention_sm90a")
    assert wg["grid"] == [{"ceil_div": ["tokens", 128 // small.group]}, small.kv_heads, "seqs"]
    assert (wg["block"], wg["shared_mem"]) == ([SM90A_PREFILL_BLOCK, 1, 1], SM90A_PREFILL_SMEM)
    assert SM90A_PREFILL_SMEM <= 227 * 1024  # an H200 block's dynamic shared memory limit
    assert (mma["entry"], mma["module"]) == ("attn_prefill_varlen_bf16", "attention")
    assert mma["grid"] == [{"ceil_div": ["tokens", 64 // tiny.group]}, tiny.kv_heads, "seqs"]
    assert (mma["block"], mma["shared_mem"]) == ([256, 1, 1], attn_prefill_smem(tiny.head_dim))
    assert wg["params"] == mma["params"]
    source = (Path(library.__file__).parent / "attention_sm90a.cu").read_text()
    assert f"#define WG_THREADS {SM90A_PREFILL_BLOCK}" in source
    assert KERNELS["attn_prefill_varlen_sm90a_bf16"] is KERNELS["attn_prefill_varlen_bf16"]

# ---- manifest structure --------------------------------------------------------------------


def test_top_level_in_struct_order(tiny):
    m, _ = tiny
    assert list(m) == ["schema_version", "model", "vars", "states", "buffers", "modules", "ops",
                       "programs"]
    for section in ("vars", "states", "buffers", "modules", "ops", "programs"):
        assert list(m[section]) == sorted(m[section], key=str.encode)


def test_layers_sit_at_the_same_call_index_in_every_driven_program(tiny):
    m, _ = tiny
    layers = len(m["states"])
    labels = {p: [c["label"] for c in m["programs"][p]["calls"]] for p in DRIVEN}
    assert labels["prefill"] == labels["decode"] == labels["decode_batch"]
    expected = ["embed"] + [f"l{i}.{name}" for i in range(layers) for name in LAYER_CALLS]
    assert labels["prefill"] == expected + ["final_norm", "lm_head", "argmax"]
    assert labels["prefill"].index("l1.qkv_proj") == 2 + len(LAYER_CALLS)


def test_programs_and_serving_io(tiny):
    m, _ = tiny
    p = m["programs"]
    # packed prefill: several sequences per chunk, split by cu_seqlens (issue 19)
    assert p["prefill"]["batch"] == {"groups": m["vars"]["seqs"]["max"], "rows": "tokens"}
    assert p["decode"]["batch"] == {"groups": 1, "rows": 1}
    assert p["decode_batch"]["batch"] == {"groups": m["vars"]["seqs"]["max"], "rows": 1}
    assert p["load"]["once"] and p["convert"]["derive"]
    fills = {b["fill"]: n for n, b in m["buffers"].items() if "fill" in b}
    assert fills == {"token": "token_ids", "position": "positions", "slot": "slot_mapping",
                     "seq_len": "seq_lens", "tokens": "next_tokens", "cu_seqlens": "cu_seqlens"}
    assert m["buffers"]["block_table"]["domain"] == {"index_into": "kv.0", "stride": 16}
    kinds = {b["kind"] for b in m["buffers"].values()}
    assert kinds == {"input", "output", "weight", "source", "carry", "workspace"}


def test_binds_use_every_segment_form(tiny):
    m, _ = tiny
    b = m["buffers"]
    assert [s["tensor"].split(".")[-2] for s in b["l0.qkv_proj.w"]["bind"]] == \
        ["q_proj", "k_proj", "v_proj"]
    assert "interleave" in b["l0.gate_up_proj.w"]["bind"][0]
    assert b["lm_head.w"]["bind"][0]["rows"] == [0, 256]


def test_modules_are_the_library_cubins(tiny):
    m, _ = tiny
    index = library.index()
    for name, module in m["modules"].items():
        assert module == {"source": f"{name}.cubin", "sha256": index[name]["sha256"]}
        assert library.cubin_path(name).exists()
    for op in m["ops"].values():
        for launch in op["impl"]["launches"]:
            if "module" in launch:
                assert launch["entry"] in index[launch["module"]]["entries"]


def test_the_verifier_and_protocol_accept_it(tiny, tmp_path):
    from kerncc import protocol, verify
    from kerncc.manifest import reader

    path = tmp_path / "model.json"
    path.write_text(json.dumps(tiny[0], indent=2) + "\n")
    protocol.check(verify.verify(reader.load(path)))


# ---- a direct executor ---------------------------------------------------------------------


def evaluate(expr: Any, env: dict[str, int]) -> int:
    if isinstance(expr, int):
        return expr
    if isinstance(expr, str):
        return env[expr]
    (kind, (a, b)), = expr.items()
    if kind == "ceil_div":
        return -(-evaluate(a, env) // b)
    if kind == "mul":
        return evaluate(a, env) * b
    return evaluate(a, env) + evaluate(b, env)


def buffer_bytes(buffer: dict, env: dict[str, int]) -> int:
    dims = [evaluate(d, env) for d in buffer["shape"]]
    return int(np.prod(dims)) * DTYPES[buffer["dtype"]].itemsize


def assemble(buffer: dict, tensors: dict[str, np.ndarray]) -> bytes:
    """A weight's bytes: bind segments laid end to end (rows/cols ranges, interleave)."""
    pieces = []
    for seg in buffer["bind"]:
        t = tensors[seg["tensor"]]
        mat = t.reshape(t.shape[0], -1)
        if "rows" in seg:
            mat = mat[seg["rows"][0]:seg["rows"][1]]
        if "cols" in seg:
            mat = mat[:, seg["cols"][0]:seg["cols"][1]]
        if "interleave" in seg:
            n = seg["interleave"]["rows"]
            other = tensors[seg["interleave"]["with"]].reshape(mat.shape)
            blocks = [mat.reshape(-1, n, mat.shape[1]), other.reshape(-1, n, mat.shape[1])]
            mat = np.stack(blocks, axis=1).reshape(-1, mat.shape[1])
        pieces.append(mat.astype(DTYPES[buffer["dtype"]]).tobytes())
    return b"".join(pieces)


class Executor:
    """Runs programs of a manifest through the reference kernels, one byte array per name."""

    def __init__(self, manifest: dict, weights: Path, kv_slots: int) -> None:
        self.m = manifest
        env = {name: v["max"] for name, v in manifest["vars"].items()}
        self.mem = {name: np.zeros(buffer_bytes(b, env), np.uint8)
                    for name, b in manifest["buffers"].items()}
        for name, s in manifest["states"].items():
            self.mem[name] = np.zeros(s["bytes_per_token"] * kv_slots, np.uint8)
        tensors = load_file(weights)
        for name, b in manifest["buffers"].items():
            if "bind" in b:
                data = assemble(b, tensors)
                assert len(data) == self.mem[name].size, name
                self.mem[name][:] = np.frombuffer(data, np.uint8)

    def array(self, name: str, dtype: str = "i32") -> np.ndarray:
        return self.mem[name].view(DTYPES[dtype])

    def run(self, program: str, env: dict[str, int], inputs: dict[str, np.ndarray]) -> None:
        for name, values in inputs.items():
            flat = np.asarray(values, np.int32).reshape(-1)
            self.array(name)[: flat.size] = flat
        for call in self.m["programs"][program]["calls"]:
            self.call(call, env)

    def value(self, arg: dict, ptype: str, env: dict[str, int]) -> Any:
        if "buf" in arg:
            return self.mem[arg["buf"]][arg.get("offset", 0):]
        if "state" in arg:
            return self.mem[arg["state"]][arg.get("offset", 0):]
        if "var" in arg:
            return SCALARS[ptype](env[arg["var"]])
        if "expr" in arg:
            return SCALARS[ptype](evaluate(arg["expr"], env))
        (kind, literal), = arg.items()
        return SCALARS[kind](literal)

    def call(self, call: dict, env: dict[str, int]) -> None:
        op = self.m["ops"][call["op"]]
        values = [self.value(a, t, env) for a, t in zip(call["args"], op["params"])]
        for launch in op["impl"]["launches"]:
            when = launch.get("when")
            if when and not when.get("min", 0) <= env[when["var"]] <= when.get("max", 1 << 64):
                continue  # spec 1.8: a launch does nothing outside its `when`
            params = launch.get("params", op["params"])
            args = launch.get("args", [{"param": i} for i in range(len(params))])
            launch_values = [values[a["param"]] if "param" in a else self.value(a, t, env)
                             for a, t in zip(args, params)]
            entry = launch["entry"]
            if entry.startswith("extern:"):
                EXTERNS[entry.removeprefix("extern:")](None, *launch_values)
                continue
            info = SimpleNamespace(grid=tuple(evaluate(g, env) for g in launch["grid"]),
                                   block=tuple(launch["block"]), shared_mem=0)
            KERNELS[entry](info, *launch_values)


# ---- end to end ----------------------------------------------------------------------------


class Sequence:
    """A sequence's pages (a shuffled set of KV blocks) and its tokens so far."""

    def __init__(self, pages: list[int], width: int, prompt: list[int]) -> None:
        self.table = np.array(pages + [0] * (width - len(pages)), np.int32)
        self.tokens = list(prompt)
        self.cached = 0  # tokens already in the KV cache

    def slots(self, positions: range) -> list[int]:
        return [int(self.table[p // 16]) * 16 + p % 16 for p in positions]


def prefill(ex: Executor, seq: Sequence, rows: int) -> None:
    positions = range(seq.cached, seq.cached + rows)
    ex.run("prefill", {"tokens": rows, "seqs": 1}, {
        "token_ids": seq.tokens[seq.cached:seq.cached + rows],
        "positions": list(positions), "slot_mapping": seq.slots(positions),
        "seq_lens": [positions.stop], "block_table": seq.table,
        "cu_seqlens": [0] + [rows] * 4,  # one sequence of a packed chunk (seqs <= 4)
    })
    seq.cached = positions.stop


def decode(ex: Executor, seqs: list[Sequence], program: str) -> None:
    """One new row per sequence: the last token of each, not yet in the cache."""
    n = len(seqs)
    ex.run(program, {"tokens": n, "seqs": n}, {
        "token_ids": [s.tokens[-1] for s in seqs],
        "positions": [s.cached for s in seqs],
        "slot_mapping": [s.slots(range(s.cached, s.cached + 1))[0] for s in seqs],
        "seq_lens": [s.cached + 1 for s in seqs],
        "block_table": np.stack([s.table for s in seqs]),
    })
    for s in seqs:
        s.cached += 1


def check_logits(ex: Executor, oracle: Oracle, seqs: list[Sequence], what: str) -> None:
    vocab = oracle.config.vocab
    logits = ex.array("logits", "f32")[: len(seqs) * vocab].reshape(len(seqs), vocab)
    sampled = ex.array("next_tokens")[: len(seqs)]
    for b, seq in enumerate(seqs):
        expected = oracle.logits(seq.tokens)[-1]
        err = float(np.max(np.abs(logits[b] - expected)) / np.max(np.abs(expected)))
        print(f"{what} seq {b} ({len(seq.tokens)} tokens): max relative error {err:.2e}")
        assert err < 3e-2, what
        assert int(sampled[b]) == int(np.argmax(logits[b]))
        assert int(sampled[b]) == int(np.argmax(expected)), what
        seq.tokens.append(int(sampled[b]))


def test_prefill_then_decode_matches_the_oracle(tiny):
    m, weights = tiny
    c = make_config("tiny")
    oracle = Oracle(weights)
    ex = Executor(m, weights, kv_slots=c.max_seqs * c.max_context)
    ex.run("convert", {}, {})
    ex.run("load", {}, {})
    rng = np.random.default_rng(3)
    width = c.pages_per_seq
    pages = rng.permutation(c.max_seqs * width).tolist()
    a = Sequence(pages[:width], width, rng.integers(0, c.vocab, 21).tolist())
    b = Sequence(pages[width:2 * width], width, rng.integers(0, c.vocab, 6).tolist())

    prefill(ex, a, 13)  # two chunks: the second attends to the first through the cache
    prefill(ex, a, 8)
    check_logits(ex, oracle, [a], "prefill")
    for step in range(2):
        decode(ex, [a], "decode")
        check_logits(ex, oracle, [a], f"decode {step}")
    prefill(ex, b, 6)
    check_logits(ex, oracle, [b], "prefill b")
    decode(ex, [a, b], "decode_batch")
    check_logits(ex, oracle, [a, b], "decode_batch")
    assert a.tokens[21:] == oracle.greedy(a.tokens[:21], 4)
