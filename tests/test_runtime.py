"""The runtime's contracts: bundle checks, loading, runs, host-input checks, chains, the CLI.

Everything runs the tiny example model on the cpu backend; each error test damages one thing
and expects one clear KernccError that names it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from kerncc.lower import lower_to_bundle
from kerncc.cli.main import main
from kerncc.diagnostics import KernccError
from kerncc.example import generate
from kerncc.runtime import Bundle, Chain, Session
from kerncc.runtime.backends.cpu import CpuBackend
from kerncc.runtime import model_runner
from kerncc.runtime.model_runner import ModelRunner, check_request, request_limits
from kerncc.runtime.memory import default_token_capacity
from kerncc.checkpoint.safetensors import load_file
from kerncc.serve.engine import Config, Engine, Request, serve_prompts
from reference_loop import alone


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, Path]:
    return generate(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="module")
def bundle_dir(model) -> Path:
    manifest, _ = model
    out = manifest.parent / "two"
    pipeline = "cut{at-label=l1.input_norm},share-states,slice-once,slice-derive,emit"
    assert main(["lower", str(manifest), "-p", pipeline, "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def whole(model) -> Session:
    return Session(lower_to_bundle(model[0]))


@pytest.fixture
def damaged(bundle_dir, tmp_path) -> Path:
    """A copy of the bundle to break (its checkpoint path re-made relative to the copy)."""
    copy = tmp_path / "bundle"
    shutil.copytree(bundle_dir, copy)
    index = json.loads((copy / "bundle.json").read_text())
    index["checkpoint"] = os.path.relpath((bundle_dir / index["checkpoint"]).resolve(), copy)
    (copy / "bundle.json").write_text(json.dumps(index))
    return copy


def prefill_inputs(n: int, start: int = 0) -> tuple[dict, dict]:
    inputs = {"token_ids": np.arange(n) + 5, "positions": np.arange(start, start + n),
              "slot_mapping": np.arange(start, start + n), "seq_lens": [start + n],
              "block_table": np.zeros((1, 16), np.int32),
              "cu_seqlens": [0] + [n] * 4}  # one sequence of a packed chunk (seqs <= 4)
    return inputs, {"tokens": n, "seqs": 1}


def error_text(err: pytest.ExceptionInfo) -> str:
    return str(err.value)

# ---- bundles -----------------------------------------------------------------------------


def test_a_bundle_reads_its_stages(bundle_dir):
    bundle = Bundle(bundle_dir)
    assert len(bundle.stages) == 2
    assert [e["buffer"] for e in bundle.edges] == ["residual"]
    assert bundle.checkpoint is not None and bundle.checkpoint.name == "model.safetensors"
    assert all(s.stage_py is not None for s in bundle.stages)


def test_a_stage_recorded_without_stage_py_runs_from_its_plan(damaged, bundle_dir):
    index = json.loads((damaged / "bundle.json").read_text())
    index["stages"][1]["stage_py_sha256"] = None
    (damaged / "bundle.json").write_text(json.dumps(index))
    with pytest.raises(KernccError, match="stage 1 has a `stage.py`.* records none") as err:
        Bundle(damaged)  # null, but a stage.py is there: it would run unpinned
    assert str(damaged / "stage1" / "stage.py") in error_text(err)
    (damaged / "stage1" / "stage.py").unlink()
    chain = Chain(damaged)
    assert chain.sessions[1].stage.stage_py is None and not chain.sessions[1].generated
    inputs, vars = prefill_inputs(6)
    expected = Chain(bundle_dir).run("prefill", inputs, vars)
    got = chain.run("prefill", inputs, vars)
    assert expected.keys() == got.keys()
    for name in expected:
        assert np.array_equal(expected[name], got[name]), name


def test_a_missing_file_is_named(damaged):
    (damaged / "stage1" / "plan.json").unlink()
    with pytest.raises(KernccError, match="plan.json") as err:
        Bundle(damaged)
    assert "missing" in error_text(err)


def test_a_tampered_file_is_caught_by_its_hash(damaged):
    path = damaged / "stage0" / "manifest.json"
    path.write_text(path.read_text().replace('"max": 64', '"max": 65'))
    with pytest.raises(KernccError, match="sha256") as err:
        Bundle(damaged)
    assert str(path) in error_text(err)


def test_a_malformed_index_is_located(damaged):
    (damaged / "bundle.json").write_text('{"format": "kerncc-bundle/1", "stages": [}')
    with pytest.raises(KernccError, match="not valid JSON") as err:
        Bundle(damaged)
    assert err.value.diagnostics[0].location.line == 1


def test_not_a_bundle(tmp_path):
    with pytest.raises(KernccError, match="the bundle index .*bundle.json` is missing"):
        Bundle(tmp_path)
    with pytest.raises(KernccError, match="does not exist"):
        Bundle.open(tmp_path / "nothing.json")


def test_an_unknown_kernel_names_the_launch(damaged):
    plan_path = damaged / "stage0" / "plan.json"
    plan_path.write_text(plan_path.read_text().replace('"rmsnorm_bf16"', '"rmsnorm_bf17"'))
    index = json.loads((damaged / "bundle.json").read_text())
    index["stages"][0]["plan_sha256"] = hashlib.sha256(plan_path.read_bytes()).hexdigest()
    (damaged / "bundle.json").write_text(json.dumps(index))
    with pytest.raises(KernccError, match="rmsnorm_bf17") as err:
        Session(damaged, 0)
    assert "program `decode` call 1 (`l0.input_norm`, op `rmsnorm`) launch 0" in error_text(err)

# ---- loading -------------------------------------------------------------------------------


def test_a_missing_weight_tensor_is_named(model, bundle_dir):
    tensors = load_file(model[1])
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KernccError, match="up_proj.weight` is not in the checkpoint") as err:
        Session(bundle_dir, 1, checkpoint=tensors)
    assert "l1.gate_up_proj.w" in error_text(err)


def test_no_checkpoint_at_all(damaged):
    index = json.loads((damaged / "bundle.json").read_text())
    index["checkpoint"] = None
    (damaged / "bundle.json").write_text(json.dumps(index))
    with pytest.raises(KernccError, match="none was given"):
        Session(damaged, 0)


def test_derive_ran_at_load_and_cannot_run_again(bundle_dir, model):
    session = Session(bundle_dir, 1)
    expected = load_file(model[1])["model.norm.weight"]
    np.testing.assert_array_equal(session.read("final_norm.w").astype(np.float32),
                                  expected.astype(session.read("final_norm.w").dtype))
    assert session.memory.staging is None
    with pytest.raises(KernccError, match="derive program"):
        session.run("convert")
    assert "convert" not in session.programs


def test_the_first_token_comes_from_the_last_chunk_when_the_chunk_hands_one_back(
        whole, monkeypatch):
    """The example's prefill writes next_tokens: the whole prompt goes through chunks and no
    one-row step feeds a prompt token. kern-serve's order (the prompt's last token through
    the one-row program), kept for chunk programs that hand back nothing, gives the same
    tokens here."""
    prompt = [5, 6, 7, 8, 9, 10, 11]
    assert ModelRunner(whole).chunk_emits
    ours = alone(whole, prompt, 4, chunk=3)
    assert ours.steps == [("prefill", 3), ("prefill", 3), ("prefill", 1)] + [("decode", 1)] * 3
    monkeypatch.setattr(model_runner, "chunk_tokens", lambda protocol: False)
    assert not ModelRunner(whole).chunk_emits
    kern = alone(whole, prompt, 4, chunk=3)
    assert kern.steps == [("prefill", 3), ("prefill", 3)] + [("decode", 1)] * 4
    assert ours.tokens == kern.tokens


@pytest.mark.parametrize("ahead", [False, True])
def test_decode_steps_stage_all_but_the_token_while_the_step_before_runs(whole, bundle_dir,
                                                                         monkeypatch, ahead):
    """Once a decode call is issued the runner writes the next step's positions, slots,
    lengths and page table (Session/Chain.stage_inputs), so the step itself sends only its
    token, or, a step ahead (Config.ahead), nothing but the first (the others' tokens are fed
    on the device); the tokens and logits are those of a run that writes every input with
    its step."""
    prompt = [5, 6, 7, 8, 9, 10, 11]
    for runner in (whole, Chain(bundle_dir)):
        calls: list[tuple] = []
        real_submit, real_stage = runner.submit, runner.stage_inputs

        def submit(program, inputs=None, vars=None, *args, **kwargs):
            calls.append(("submit", program, sorted(inputs or {})))
            return real_submit(program, inputs, vars, *args, **kwargs)

        def stage(inputs, vars=None):
            calls.append(("stage", sorted(inputs)))
            return real_stage(inputs, vars)

        monkeypatch.setattr(runner, "submit", submit)
        monkeypatch.setattr(runner, "stage_inputs", stage)
        staged = alone(runner, prompt, 5, chunk=4, ahead=ahead)
        every = ["block_table", "cu_seqlens", "positions", "seq_lens", "slot_mapping",
                 "token_ids"]
        moved = ["positions", "seq_lens", "slot_mapping"]  # the page table stays as it was
        # two chunks (the last hands back token 1), then a step for each of tokens 2 to 5,
        # each after the first staged after the decode call before it (and a step ahead:
        # its token fed on the device)
        fed = ["token_ids"] if not ahead else []
        assert calls == [("submit", "prefill", every)] * 2 + [("submit", "decode", every)] + [
            ("stage", moved), ("submit", "decode", fed)] * 3 + [("stage", moved)]
        monkeypatch.setattr(model_runner, "_plain_inputs", lambda sessions: frozenset())
        plain = alone(runner, prompt, 5, chunk=4, ahead=ahead)
        monkeypatch.undo()
        assert staged.tokens == plain.tokens
        np.testing.assert_array_equal(staged.logits, plain.logits)


def test_no_step_past_the_last_is_staged(whole):
    """A request that fills the page table to its last slot runs: the runner stages the
    next step only when generation may still need it."""
    limit = 16 * 16  # block_table [seqs, 16], 16 tokens a page
    prompt = [int(t) for t in np.random.default_rng(5).integers(1, 256, limit - 3)]
    result = alone(whole, prompt, 3, chunk=64)
    assert len(result.tokens) == 3


def test_token_capacity_covers_every_sequence_at_the_context_bound(whole):
    # seqs <= 4, block_table [seqs, 16] at 16 tokens per page.
    assert default_token_capacity(whole.manifest) == 4 * 16 * 16
    assert whole.memory.state_bytes["kv.0"] == 4 * 16 * 16 * 128

# ---- running -------------------------------------------------------------------------------


def test_run_returns_the_outputs_at_the_current_vars(whole):
    inputs, vars = prefill_inputs(5)
    out = whole.run("prefill", inputs, vars)
    assert set(out) == {"logits", "next_tokens"}
    assert out["logits"].shape == (1, 256) and out["next_tokens"].shape == (1,)
    assert int(out["next_tokens"][0]) == int(np.argmax(out["logits"][0]))
    np.testing.assert_array_equal(whole.read("positions"), np.arange(5))


def test_a_wrong_input_shape_is_refused(whole):
    inputs, vars = prefill_inputs(5)
    inputs["positions"] = np.arange(4)
    with pytest.raises(KernccError, match="input `positions` has the wrong shape") as err:
        whole.run("prefill", inputs, vars)
    assert err.value.messages() == ["the value is [4], but the buffer is [tokens], [5] at tokens=5"]


def test_an_out_of_domain_input_names_the_element(whole):
    inputs, vars = prefill_inputs(5)
    inputs["positions"] = np.array([0, 1, 2, 300, 4])
    with pytest.raises(KernccError, match="outside its domain") as err:
        whole.run("prefill", inputs, vars)
    message = err.value.diagnostics[0].message
    assert "element [3] is 300, above 255" in message and "`rope`" in message
    inputs, vars = prefill_inputs(5)
    inputs["block_table"] = np.full((1, 16), 64)  # 1024 slots / 16 = pages 0..63
    with pytest.raises(KernccError, match=r"element \[0, 0\] is 64, above 63"):
        whole.run("prefill", inputs, vars)
    inputs, vars = prefill_inputs(5)
    inputs["seq_lens"] = [0]
    with pytest.raises(KernccError, match=r"element \[0\] is 0, below 1: the domain's min"):
        whole.run("prefill", inputs, vars)


def test_inputs_must_convert_without_loss(whole):
    inputs, vars = prefill_inputs(2)
    inputs["token_ids"] = np.array([1.5, 2.0])
    with pytest.raises(KernccError, match="wrong element type"):
        whole.run("prefill", inputs, vars)
    inputs["token_ids"] = np.array([1, 2**40])
    with pytest.raises(KernccError, match="does not fit int32"):
        whole.run("prefill", inputs, vars)


def test_vars_and_names_are_checked(whole):
    with pytest.raises(KernccError, match=r"var `tokens` = 65 is outside \[1, 64\]"):
        whole.run("prefill", {}, {"tokens": 65})
    with pytest.raises(KernccError, match="not a var"):
        whole.run("prefill", {}, {"rows": 2})
    with pytest.raises(KernccError, match="no program `nope`"):
        whole.run("nope")
    with pytest.raises(KernccError, match="only input and inout"):
        whole.run("prefill", {"logits": np.zeros((1, 256), np.float32)})


def test_write_infers_vars_from_the_shape(whole):
    whole.write("positions", np.array([7, 8, 9]))
    np.testing.assert_array_equal(whole.read("positions", {"tokens": 3}), [7, 8, 9])

# ---- chains and serving --------------------------------------------------------------------


def test_a_chain_hands_crossing_buffers_on(bundle_dir, whole):
    chain = Chain(bundle_dir)
    inputs, vars = prefill_inputs(6)
    got = chain.run("prefill", inputs, vars)
    expected = whole.run("prefill", inputs, vars)
    assert got["logits"].tobytes() == expected["logits"].tobytes()
    with pytest.raises(KernccError, match="no stage of the bundle takes input `logits`"):
        chain.run("prefill", {"logits": 0}, vars)


def test_generation_limits(bundle_dir):
    chain = Chain(bundle_dir)
    runner = ModelRunner(chain)
    assert runner.stride == 16 and runner.width == 16
    with pytest.raises(KernccError, match="empty"):
        alone(chain, [], 2)
    with pytest.raises(KernccError, match=r"chunk 65 is outside \[1, 64\]"):
        alone(chain, [1, 2], 2, chunk=65)
    # Refused before any run (it used to fail after 57 steps, at the 257th token).
    limits = request_limits([s.manifest for s in chain.sessions])
    with pytest.raises(KernccError, match="need 259 positions, but a sequence holds at most 256"):
        check_request(limits, list(range(200)), 60)
    engine = Engine(chain, Config(chunk=64))
    with pytest.raises(KernccError, match="max_tokens 60: the prompt's 200 tokens and 60 new "
                       "ones need 259 positions, but a sequence holds at most 256"):
        engine.submit(Request(list(range(200)), 60))
    assert engine.pool.free == engine.pool.pages and engine.waiting == 0

# ---- the command line ----------------------------------------------------------------------


def test_run_reports_bad_input_without_a_traceback(damaged, capsys):
    (damaged / "stage1" / "manifest.json").write_text("{}")
    assert main(["run", str(damaged), "--prompt", "1,2"]) == 1
    err = capsys.readouterr().err
    assert "sha256" in err and "Traceback" not in err


def test_run_a_manifest_prints_tokens_last(model, capsys):
    assert main(["run", str(model[0]), "--prompt", "4,5,6", "--max-new", "2", "--chunk", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out[-1].split()) == 2


def test_example_refuses_a_bad_size(tmp_path, capsys):
    assert main(["example", "qwen", "-o", str(tmp_path), "--head-dim", "12"]) == 1
    assert "head_dim" in capsys.readouterr().err

# ---- launch records: packs, scratch, `when`, expressions -----------------------------------

PROBE = {
    "schema_version": 5, "model": "probe", "vars": {"tokens": {"max": 8}},
    "buffers": {
        "w": {"dtype": "f32", "shape": ["tokens", 4], "kind": "workspace"},
        "x": {"dtype": "f32", "shape": ["tokens", 4], "kind": "input",
              "domain": {"min": -1.0, "max": 1.0}},
        "y": {"dtype": "f32", "shape": ["tokens", 4], "kind": "output"},
    },
    "modules": {"k": {"source": "k.cubin", "sha256": "0" * 64}},
    "ops": {"copy": {"params": ["in buffer<f32>", "out buffer<f32>", "i32"], "impl": {
        "scratch": {"tmp": {"dtype": "f32", "shape": ["tokens"]}},
        "launches": [
            {"module": "k", "entry": "probe",
             "params": ["in buffer<f32>", "out buffer<f32>", "i32", "bytes<24>", "f32"],
             "block": [32, 1, 1], "grid": [{"ceil_div": ["tokens", 2]}, 1, 1],
             "args": [{"param": 0}, {"param": 1}, {"param": 2},
                      {"pack": {"size": 24, "fields": [{"at": 0, "param": 0},
                                                       {"at": 8, "var": "tokens"},
                                                       {"at": 16, "scratch": "tmp"}]}},
                      {"f32": 0.5}]},
            {"module": "k", "entry": "probe", "block": [32, 1, 1], "grid": [1, 1, 1],
             "when": {"var": "tokens", "min": 3}},
        ]}}},
    "programs": {"p": {"calls": [
        {"label": "first", "op": "copy", "args": [{"buf": "x"}, {"buf": "w"}, {"var": "tokens"}]},
        {"label": "second", "op": "copy",
         "args": [{"buf": "w"}, {"buf": "y"}, {"expr": {"mul": ["tokens", 3]}}]},
    ]}},
}


class Recorder(CpuBackend):
    """The cpu backend with one extra kernel, `probe`, that records what it was given."""

    def __init__(self) -> None:
        self.launches: list[tuple] = []

    def check_kernel(self, entry, module):
        if entry != "probe":
            super().check_kernel(entry, module)

    def launch_kernel(self, geometry, args):
        if geometry.entry != "probe":
            return super().launch_kernel(geometry, args)
        self.launches.append((geometry.grid, [self.describe(a) for a in args]))

    def describe(self, arg):
        if isinstance(arg, np.ndarray):
            return ("ptr", self.address(arg), arg.size)
        return arg if isinstance(arg, bytes) else (type(arg).__name__, arg.item())


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Bundle:
    path = tmp_path_factory.mktemp("probe") / "probe.json"
    path.write_text(json.dumps(PROBE))
    return lower_to_bundle(path)


@pytest.mark.parametrize("interpret", [False, True])
def test_launch_records_resolve_packs_scratch_and_gates(probe, interpret):
    backend = Recorder()
    session = Session(probe, backend=backend, interpret=interpret)
    assert session.generated != interpret
    session.run("p", {"x": np.zeros((2, 4), np.float32)}, {"tokens": 2})
    session.run("p", {}, {"tokens": 5})
    grids = [grid for grid, _ in backend.launches]
    assert grids == [(1, 1, 1), (1, 1, 1), (3, 1, 1), (1, 1, 1), (3, 1, 1), (1, 1, 1)]
    (_, first), (_, second) = backend.launches[0], backend.launches[1]
    x, w, tokens, pack, half = first
    assert x == ("ptr", backend.address(session.memory.buffer("x")), 128)
    assert w[1] == backend.address(session.memory.arena)
    assert tokens == ("int32", 2) and half == ("float32", 0.5)
    assert second[2] == ("int32", 6)  # `mul: [tokens, 3]`
    address, count, scratch = struct.unpack("<Qi4xQ", pack)
    offset = session.stage.plan["arena"]["programs"]["p"]["offsets"]["op:copy/scratch:tmp@0"]
    assert (address, count) == (x[1], 2)
    assert scratch == backend.address(session.memory.arena) + offset


def test_float_domains_are_checked(probe):
    session = Session(probe, backend=Recorder())
    x = np.zeros((1, 4), np.float32)
    x[0, 2] = 1.5
    with pytest.raises(KernccError, match=r"element \[0, 2\] is 1.5, above 1.0"):
        session.run("p", {"x": x}, {"tokens": 1})


def test_serving_downloads_only_the_logits_and_the_token(bundle_dir):
    # Stage 1 writes `residual` (inout, crossing from stage 0) every run; `run` hands it back,
    # but the generator must not pay a download of it per chunk.
    chain = Chain(bundle_dir)
    assert "residual" in chain.run("decode", {"token_ids": [3], "positions": [0],
                                              "slot_mapping": [0], "seq_lens": [1],
                                              "block_table": [[0] * 16]})
    seen: list[set[str]] = []
    original = chain.submit

    def submit(*args, **kwargs):
        pending = original(*args, **kwargs)
        seen.append(set(pending._outputs))
        return pending

    chain.submit = submit
    alone(chain, [5, 6, 7, 8, 9], 3, 2)
    assert seen and all(names <= {"logits", "next_tokens"} for names in seen)
    assert all("logits" in names for names in seen)


def test_an_input_serving_cannot_fill_is_placed_in_the_stage_manifest(damaged):
    """A stage manifest edited after emit (its hash updated) so that `token_ids` lost its
    fill: the driver refuses it, pointing at the buffer in that stage's manifest.json."""
    path = damaged / "stage0" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["buffers"]["token_ids"]["fill"]
    path.write_text(json.dumps(manifest, indent=1))
    index = json.loads((damaged / "bundle.json").read_text())
    index["stages"][0]["manifest_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    index["stages"][0]["stage_py_sha256"] = None  # its header names the old manifest's sha256
    (damaged / "stage0" / "stage.py").unlink()
    (damaged / "bundle.json").write_text(json.dumps(index))
    with pytest.raises(KernccError, match="reads input `token_ids`, which is neither") as err:
        ModelRunner(Chain(damaged))
    where = err.value.diagnostics[0].location
    assert where.pointer == "/buffers/token_ids" and where.file == str(path)
    assert path.read_text().splitlines()[where.line - 1].strip().startswith('"token_ids"')


def test_a_submit_does_not_re_derive_the_programs_writes(whole, monkeypatch):
    """On a GPU a submit's host time is the pipeline's pace: which buffers a program hands back
    is worked out at its first run only (re-deriving it cost 1.5 ms a chunk on the small
    model, which starved two H200s; docs/benchmarks.md)."""
    from kerncc.runtime import session as session_module

    inputs, vars = prefill_inputs(4)
    whole.submit("prefill", inputs, vars).result()
    calls = []
    real = session_module.call_access
    monkeypatch.setattr(session_module, "call_access",
                        lambda *args: calls.append(args) or real(*args))
    for _ in range(3):
        outputs = whole.submit("prefill", inputs, vars).result()
    assert calls == [] and outputs  # the same outputs, no analysis


def test_a_chain_closes_only_the_backends_it_made(bundle_dir):
    """Chain.close (and the end of a `with` block) closes the backends the chain made from a
    name and leaves a backend object passed in to its caller; on the cpu backend closing
    holds nothing to give back, so the chain still runs (the cuda backend's release is
    tests/test_cuda.py's)."""
    closed = []

    class Recording(CpuBackend):
        def close(self) -> None:
            closed.append(self)

    mine = Recording()
    with Chain(bundle_dir, backend=mine) as chain:
        assert len(alone(chain, [3, 1, 4], 2, 64).tokens) == 2
    assert closed == []  # the caller's backend stays open
    made = Chain(bundle_dir, backend="cpu")
    made.backends[0].close = lambda: closed.append("made")
    with made:
        pass
    assert closed == ["made"]
    made.close()
    assert closed == ["made", "made"]  # each close closes what the chain made, nothing else

# ---- arguments of the library API -----------------------------------------------------------


@pytest.mark.parametrize("prompt, match", [
    ("1,2,3", "prompt"), ([1.5, 2], r"prompt position 0: 1\.5 is not a whole number"),
    (["a"], "prompt position 0"), (np.array([[1, 2, 3]]), "one list of token ids"),
    ([True, 2], "prompt position 0"), (None, "the prompt is empty")])
def test_generate_refuses_a_prompt_that_is_not_token_ids(bundle_dir, prompt, match):
    """A float id was truncated (1.5 ran as 1), a string or a 2-D array failed inside numpy or
    Python's comparisons."""
    with pytest.raises(KernccError, match=match):
        serve_prompts(Chain(bundle_dir), [prompt], 2)


def test_generate_takes_a_numpy_prompt(bundle_dir):
    """`if not prompt` on an array of several ids raised numpy's "truth value is ambiguous"."""
    chain = Chain(bundle_dir)
    listed = alone(chain, [3, 1, 4], 3).tokens
    assert alone(chain, np.array([3, 1, 4], np.int64), 3).tokens == listed
    assert alone(chain, (3, 1, 4), 3).tokens == listed


@pytest.mark.parametrize("kwargs, match", [
    ({"max_new": float("nan")}, "max_new nan: expected a whole number"),
    ({"max_new": 2.5}, "max_new 2.5: expected a whole number"),
    ({"max_new": "2"}, "max_new '2': expected a whole number"),
    ({"max_new": None}, "max_new None: expected a whole number"),
    ({"max_new": True}, "max_new True: expected a whole number"),
    ({"max_new": 2, "chunk": 0}, r"chunk 0 is outside \[1, 64\]"),
    ({"max_new": 2, "chunk": 1.5}, "chunk 1.5: expected a whole number"),
    ({"max_new": 2, "chunk": "2"}, "chunk '2': expected a whole number"),
    ({"max_new": 2, "params": {"temperature": 1.0}}, "params: expected sampling_hook.Params"),
    ({"max_new": 2, "stop_ids": 5}, "stop_ids: expected token ids"),
    ({"max_new": 2, "listener": "print"}, "listener: expected a Listener")])
def test_serving_refuses_arguments_of_the_wrong_kind(bundle_dir, kwargs, match):
    """max_new nan generated nothing, 2.5 generated three tokens, chunk 0 meant the default;
    the rest failed as TypeError or AttributeError from deep inside."""
    with pytest.raises(KernccError, match=match):
        serve_prompts(Chain(bundle_dir), [[3, 1, 4]], **kwargs)


@pytest.mark.parametrize("value", ["3", float("nan"), None, 3.5, True])
def test_a_var_that_is_not_a_whole_number_is_refused(whole, value):
    """nan and None failed inside int() (ValueError, TypeError); "3" was said to be outside
    [1, 64] as if it were the number 3."""
    inputs, _ = prefill_inputs(3)
    with pytest.raises(KernccError, match=r"var `tokens` = .* is not a whole number|outside"):
        whole.run("prefill", inputs, {"tokens": value, "seqs": 1})
    with pytest.raises(KernccError, match="var `tokens`"):
        whole.write("positions", np.arange(3), {"tokens": value})
    if isinstance(value, str):
        with pytest.raises(KernccError, match=r"var `tokens` = '3' is not a whole number"):
            whole.run("prefill", inputs, {"tokens": value, "seqs": 1})


def test_inputs_and_vars_must_be_mappings(whole, bundle_dir):
    inputs, vars = prefill_inputs(3)
    for runner in (whole, Chain(bundle_dir)):
        with pytest.raises(KernccError, match="inputs: expected a mapping"):
            runner.run("prefill", list(inputs.items()), vars)
        with pytest.raises(KernccError, match="vars: expected a mapping"):
            runner.run("prefill", inputs, [3, 1])


def test_an_input_numpy_cannot_make_an_array_of_is_named(whole):
    """A ragged list failed as numpy's 'inhomogeneous shape' ValueError."""
    inputs, vars = prefill_inputs(3)
    inputs["block_table"] = [[0, 1], [2]]
    with pytest.raises(KernccError, match="input `block_table` is not an array"):
        whole.run("prefill", inputs, vars)


def test_a_chain_refuses_a_program_no_stage_has(bundle_dir):
    """Chain.run of an unknown program skipped every stage and handed back {}."""
    chain = Chain(bundle_dir)
    for program in ("nope", None, 3):
        with pytest.raises(KernccError, match="no stage of the bundle has program"):
            chain.run(program, {}, {})


def test_session_and_chain_arguments_are_checked(bundle_dir):
    """Each failed deep inside (TypeError, AttributeError, an allocation of -2048 bytes) or was
    taken silently (graphs "nope" on cpu, token_capacity 0 as the default)."""
    bundle = Bundle(bundle_dir)
    cases = [({"stage": "0"}, "stage '0': expected a whole number"),
             ({"stage": 1.0}, "stage 1.0: expected a whole number"),
             ({"graphs": "nope"}, "unknown graph policy `nope`"),
             ({"token_capacity": 0}, "token_capacity 0: expected a whole number of at least 1"),
             ({"token_capacity": -16}, "token_capacity -16"),
             ({"token_capacity": "16"}, "token_capacity '16'"),
             ({"backend": 3}, "backend: expected a backend name or object, got int")]
    for kwargs, match in cases:
        with pytest.raises(KernccError, match=match):
            Session(bundle, **kwargs)
        if "stage" not in kwargs:
            with pytest.raises(KernccError, match=match):
                Chain(bundle, **kwargs)
    with pytest.raises(KernccError, match="bundle: expected a Bundle or the path"):
        Session(3)
    with pytest.raises(KernccError, match="trace: expected a Timeline"):
        Chain(bundle, trace="trace.json")
    for runner in ("bundle", None):
        with pytest.raises(KernccError, match="expected a Session or a Chain"):
            ModelRunner(runner)


def test_read_and_write_check_their_vars_and_values(whole):
    """Session.read/write with vars that were no mapping failed as AttributeError or
    TypeError, and write of a ragged list as numpy's ValueError."""
    with pytest.raises(KernccError, match="vars: expected a mapping"):
        whole.read("positions", [3])
    with pytest.raises(KernccError, match="vars: expected a mapping"):
        whole.write("positions", [7, 8, 9], [3])
    with pytest.raises(KernccError, match="input `positions` is not an array"):
        whole.write("positions", [[7], [8, 9]])
