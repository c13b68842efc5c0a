"""plan-memory, emit and bundle checking (passes/plan_memory.py, passes/emit.py,
kerncc/bundle/plan.py, kerncc/bundle/stage_py.py, kerncc/bundle/check.py, docs/bundle.md)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import shutil
from pathlib import Path

import attrs
import pytest

from kerncc import manifest as m
from kerncc import symbolic
from kerncc.manifest import reader
from kerncc.bundle.check import check_bundle
from kerncc.bundle.plan import scratch_slot
from kerncc.cli.main import main
from kerncc.diagnostics import KernccError
from kerncc.example.qwen import generate
from kerncc.ir import IR
from kerncc.passes import emit as emit_mod
from kerncc.passes.cut import cut_ir
from kerncc.passes.emit import Emit, whole_protocol
from kerncc.passes.plan_memory import PlanMemory, plan_stage, workspace_intervals
from kerncc.lower import lower as lower_file
from kerncc.lower import run_lowering, with_output
from kerncc.pipeline import resolve_pipeline, run_pipeline
from kerncc.runtime import Bundle
from tests.random_manifests import Xorshift, random_manifest
from kerncc.verify import verify

GOLDEN_MODEL = Path(__file__).resolve().parent.parent / "golden" / "bundles" / "cut-two"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example model, 2 layers, with its checkpoint beside it."""
    path, _ = generate(tmp_path_factory.mktemp("qwen"), "tiny", layers=2)
    return path


@pytest.fixture
def mini(tmp_path: Path) -> Path:
    """The golden bundles' 3-layer model (scratch, packs, `when`, a module file beside it)."""
    for name in ("model.json", "gemm.cubin"):
        shutil.copy(GOLDEN_MODEL / name, tmp_path / name)
    return tmp_path / "model.json"


def lower(path: Path, spec: str) -> IR:
    """What `kerncc lower` does: load, verify, run the spec through the driver."""
    man = m.load(str(path))
    verify(man)
    return run_lowering(IR.from_manifest(man, source=str(path)), resolve_pipeline(spec),
                        input_name=str(path))


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir())


# ---------------------------------------------------------------------------------------------
# plan-memory


def _manifest(calls: list[tuple[str, list[str]]], scratch: bool = False) -> m.Manifest:
    """One driven program; op `f` reads its first buffer and writes its second."""
    op: dict = {"params": ["in buffer<bf16>", "out buffer<bf16>"],
                "impl": {"launches": [{"entry": "extern:x"}]}}
    if scratch:
        op["impl"] = {"scratch": {"t": {"dtype": "f32", "shape": ["tokens", 4]}},
                      "launches": [{"entry": "extern:x",
                                    "params": ["in buffer<bf16>", "out buffer<f32>"],
                                    "args": [{"param": 0}, {"scratch": "t"}]},
                                   {"entry": "extern:x"}]}
    names = {b for _, args in calls for b in args}
    kinds = {"x": "input", "y": "output"}
    raw = {"schema_version": 5, "model": "t", "vars": {"tokens": {"max": 64, "axis": "rows"}},
           "buffers": {b: {"dtype": "bf16", "shape": ["tokens", 8],
                           "kind": kinds.get(b, "workspace")} for b in names},
           "modules": {}, "ops": {"f": op},
           "programs": {"p": {"batch": {"groups": 1, "rows": "tokens"}, "calls": [
               {"label": label, "op": "f", "args": [{"buf": a}, {"buf": b}]}
               for label, (a, b) in calls]}}}
    return reader.from_raw(raw)


CHAIN = [("c0", ["x", "a"]), ("c1", ["a", "b"]), ("c2", ["b", "a"]), ("c3", ["a", "c"]),
         ("c4", ["c", "y"])]


RING = [("c0", ["x", "a"]), ("c1", ["a", "b"]), ("c2", ["b", "c"]), ("c3", ["c", "a"]),
        ("c4", ["a", "y"])]


def test_workspaces_live_in_segments_split_by_overwrites() -> None:
    man = _manifest(RING)
    got = {(iv.name, iv.start, iv.end) for iv in workspace_intervals(man, "p")}
    # `a` dies at c1 (its last read) and is written again at c3: two segments.
    assert got == {("a", 0, 1), ("a", 3, 4), ("b", 1, 2), ("c", 2, 3)}
    whole = {(iv.name, iv.start, iv.end) for iv in workspace_intervals(man, "p", True)}
    assert whole == {("a", 0, 4), ("b", 1, 2), ("c", 2, 3)}
    # Adjacent segments (read at c1, overwritten at c2) are one: the bytes are busy throughout.
    adjacent = {(iv.name, iv.start, iv.end) for iv in workspace_intervals(_manifest(CHAIN), "p")}
    assert ("a", 0, 3) in adjacent


def test_arena_reuses_dead_bytes_and_reports_bounds() -> None:
    arena = plan_stage(_manifest(CHAIN)).programs["p"]
    lay = arena.layout
    assert lay.naive == 3 * 1024 and lay.lower_bound == 2 * 1024
    assert lay.total == lay.lower_bound
    # `b` and `c` are never live at the same call: they may share bytes, `a` may not.
    assert lay.offsets["a"] != lay.offsets["b"] and lay.offsets["a"] != lay.offsets["c"]


def test_scratch_gets_a_slot_per_call_live_only_there() -> None:
    arena = plan_stage(_manifest(CHAIN, scratch=True)).programs["p"]
    slots = [iv for iv in arena.intervals if iv.name.startswith("op:")]
    assert [(iv.name, iv.start, iv.end, iv.bytes) for iv in slots] == [
        (f"op:f/scratch:t@{i}", i, i, 64 * 4 * 4) for i in range(5)]
    assert arena.layout.total == arena.layout.lower_bound


def test_plan_memory_report_and_dump(mini: Path) -> None:
    ir = lower(mini, "cut{at=4},plan-memory")
    report = ir.reports["plan-memory"]
    assert len(report.stages) == 2 and report.worst_ratio() == 1.0
    assert report.stages[1].manifest is ir.stages[1]
    text = report.to_text()
    assert text.startswith("stage 0: arena ")
    assert "op:mix/scratch:tmp@" in text
    code, out, _ = cli("dump", str(mini), "-p", "cut{at=4}", "--pass", "plan-memory")
    assert code == 0 and out == text + "\n"


def test_arena_is_within_five_percent_of_the_bound_on_the_example(qwen: Path) -> None:
    for spec in ("plan-memory", "cut,plan-memory", "cut{stages=3},plan-memory"):
        report = lower(qwen, spec).reports["plan-memory"]
        assert report.worst_ratio() <= 1.05, spec


def test_whole_life_is_an_option(mini: Path) -> None:
    ir = IR.from_manifest(m.load(str(mini)))
    segments = PlanMemory().run(ir).reports["plan-memory"].stages[0]
    whole = PlanMemory(whole_life=True).run(ir).reports["plan-memory"].stages[0]
    assert segments.bytes < whole.bytes


# ---------------------------------------------------------------------------------------------
# emit: the bundle


def test_lower_with_exactly_the_documented_pipeline(qwen: Path) -> None:
    out = qwen.parent / "documented"
    code, _, err = cli("lower", str(qwen), "-p", "cut,slice-derive,emit", "-o", str(out))
    assert code == 0, err
    index = json.loads((out / "bundle.json").read_text())
    assert index["pipeline"] == "cut,slice-derive,plan-memory,emit"
    assert index["input"]["path"] == "../model.json"
    assert index["input"]["sha256"] == hashlib.sha256(qwen.read_bytes()).hexdigest()
    assert index["checkpoint"] == "../model.safetensors"
    assert [s["dir"] for s in index["stages"]] == ["stage0", "stage1"]
    assert index["edges"] and index["proof"]["checked"] is True
    assert index["stages"][0]["host_inputs"] == IR.from_manifest(m.load(str(qwen))).host_inputs(0)
    code, out_text, _ = cli("check", str(out))
    assert code == 0 and out_text.startswith("proved:")


def test_every_stage_is_kerns_canonical_and_verifies(qwen: Path, tmp_path: Path) -> None:
    ir = lower(qwen, f"cut{{stages=3}},share-states,slice-once,slice-derive,"
                     f"emit{{out=\"{tmp_path / 'b'}\"}}")
    for k, stage in enumerate(ir.stages):
        text = (tmp_path / "b" / f"stage{k}" / "manifest.json").read_text()
        assert text == m.dumps(stage)
        verify(m.loads(text))


def test_modules_come_from_the_library_and_beside_the_input(qwen: Path, mini: Path,
                                                            tmp_path: Path) -> None:
    lower(qwen, f"emit{{out=\"{tmp_path / 'q'}\"}}")
    plan = json.loads((tmp_path / "q" / "stage0" / "plan.json").read_text())
    assert plan["missing_modules"] == []
    for digest, info in plan["modules"].items():
        data = (tmp_path / "q" / "stage0" / info["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest
    lower(mini, f"emit{{out=\"{tmp_path / 'm'}\"}}")
    plan = json.loads((tmp_path / "m" / "stage0" / "plan.json").read_text())
    assert plan["missing_modules"] == ["ab" * 32]
    assert {i["source"]: i["file"] is not None for i in plan["modules"].values()} == {
        "gemm.cubin": True, "hf:kern/kernels/attn.cubin": False}


def test_a_module_file_with_the_wrong_bytes_is_missing(mini: Path, tmp_path: Path) -> None:
    (mini.parent / "gemm.cubin").write_bytes(b"changed")
    lower(mini, f"emit{{out=\"{tmp_path / 'm'}\"}}")
    plan = json.loads((tmp_path / "m" / "stage0" / "plan.json").read_text())
    assert len(plan["missing_modules"]) == 2
    assert not (tmp_path / "m" / "stage0" / "modules").exists()


def test_uncut_is_one_stage(mini: Path, tmp_path: Path) -> None:
    out = tmp_path / "b"
    code, _, err = cli("lower", str(mini), "-p", "emit", "-o", str(out))
    assert code == 0, err
    index = json.loads((out / "bundle.json").read_text())
    assert index["cut"] is None and index["edges"] == [] and len(index["stages"]) == 1
    assert index["checkpoint"] is None
    check_bundle(out)


def test_the_driver_records_the_schedule_without_out(tmp_path: Path) -> None:
    """The bundle records the pipeline the driver scheduled (required passes inserted,
    emit's `out` left out), handed to emit on the IR; emit reads no spec itself."""
    out = tmp_path / "b"
    lower_file(GOLDEN_MODEL / "model.json", "cut{at=4},emit{check=false}", out)
    index = json.loads((out / "bundle.json").read_text())
    assert index["pipeline"] == "cut{at=4},plan-memory,emit{check=false}"
    ir = IR.from_manifest(m.load(str(GOLDEN_MODEL / "model.json")))
    done = run_lowering(ir, with_output(resolve_pipeline("liveness,emit"), tmp_path / "c"))
    assert done.pipeline == "liveness,plan-memory,emit"
    assert done.history == ("liveness", "plan-memory", "emit")
    assert json.loads((tmp_path / "c" / "bundle.json").read_text())["pipeline"] == done.pipeline


def test_emit_needs_a_directory(mini: Path) -> None:
    with pytest.raises(KernccError, match="emit needs a directory"):
        lower(mini, "emit")


# ---------------------------------------------------------------------------------------------
# stage.py runs the plan's launches


class FakeRuntime:
    def __init__(self) -> None:
        self.launched: list[tuple[int, tuple | None, tuple]] = []

    def launch(self, site: int, grid: tuple | None, scalars: tuple) -> None:
        self.launched.append((site, grid, tuple(scalars)))


def load_stage_py(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def eval_json_expr(expr, env: dict[str, int]) -> int:
    if isinstance(expr, (int, str)):
        return m.eval_expr(expr, env)
    key, (a, b) = next(iter(expr.items()))
    if key == "add":
        return eval_json_expr(a, env) + eval_json_expr(b, env)
    value = eval_json_expr(a, env)
    return -(-value // b) if key == "ceil_div" else value * b


def _runs(when: dict | None, env: dict[str, int]) -> bool:
    if when is None:
        return True
    value = env[when["var"]]
    return when.get("min", value) <= value <= when.get("max", value)


def _var_scalars(args: list[dict], env: dict[str, int]) -> list[int]:
    out = []
    for arg in args:
        sources = [arg.get("scalar")] + [f.get("scalar") for f in
                                         arg.get("pack", {}).get("fields", [])]
        for s in sources:
            if s and ("var" in s or "expr" in s):
                out.append(eval_json_expr(s.get("var", s.get("expr")), env))
    return out


def expected_launches(plan: dict, program: str, env: dict[str, int]) -> list[tuple]:
    out = []
    for call in plan["programs"][program]["calls"]:
        for rec in call["launches"]:
            if not _runs(rec["when"], env):
                continue
            grid = (tuple(eval_json_expr(g, env) for g in rec["grid"])
                    if rec["kind"] == "kernel" else None)
            out.append((rec["site"], grid, tuple(_var_scalars(rec["args"], env))))
    return out


@pytest.mark.parametrize("tokens", [1, 5, 8])
def test_stage_py_issues_the_plans_launches(mini: Path, tmp_path: Path, tokens: int) -> None:
    ir = lower(mini, f"cut{{at=4,7}},slice-derive,emit{{out=\"{tmp_path / 'b'}\"}}")
    env = {"tokens": tokens}
    for k in range(len(ir.stages)):
        folder = tmp_path / "b" / f"stage{k}"
        plan = json.loads((folder / "plan.json").read_text())
        module = load_stage_py(folder / "stage.py", f"kerncc_test_stage_{k}_{tokens}")
        assert module.STAGE == k
        assert module.PLAN_SHA256 == hashlib.sha256((folder / "plan.json").read_bytes()
                                                    ).hexdigest()
        assert list(module.PROGRAMS) == list(plan["programs"])
        for name, function in module.PROGRAMS.items():
            rt = FakeRuntime()
            function(rt, env)
            assert rt.launched == expected_launches(plan, name, env)


def test_sites_number_the_stage_in_program_then_call_order(qwen: Path, tmp_path: Path) -> None:
    lower(qwen, f"cut,emit{{out=\"{tmp_path / 'b'}\"}}")
    plan = json.loads((tmp_path / "b" / "stage1" / "plan.json").read_text())
    sites = [rec["site"] for p in plan["programs"].values() for c in p["calls"]
             for rec in c["launches"]]
    assert sites == list(range(len(sites)))
    assert list(plan["programs"]) == sorted(plan["programs"])


def test_arena_pointers_are_arena_byte_offsets(mini: Path, tmp_path: Path) -> None:
    lower(mini, f"emit{{out=\"{tmp_path / 'b'}\"}}")
    plan = json.loads((tmp_path / "b" / "stage0" / "plan.json").read_text())
    offsets = plan["arena"]["programs"]["prefill"]["offsets"]
    calls = plan["programs"]["prefill"]["calls"]
    embed = calls[0]["launches"][0]["args"]  # embed writes the workspace `h`
    assert embed[2] == {"ptr": {"arena": "h", "offset": offsets["h"]}}
    mix = next(c for c in calls if c["op"] == "mix")
    slot = f"op:mix/scratch:tmp@{mix['index']}"
    assert mix["launches"][0]["args"][2] == {"ptr": {"scratch": slot, "offset": offsets[slot]}}


# ---------------------------------------------------------------------------------------------
# Refusals and atomicity


def test_a_failed_proof_writes_nothing(mini: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(whole, stages):
        raise KernccError.single("the stages do not compute the whole")

    monkeypatch.setattr(emit_mod, "check_stages", refuse)
    out = tmp_path / "out"
    with pytest.raises(KernccError, match="do not compute the whole"):
        lower(mini, f"cut{{at=4}},emit{{out=\"{out}\"}}")
    assert siblings(out) == ["gemm.cubin", "model.json"]
    ir = lower(mini, f"cut{{at=4}},emit{{out=\"{out}\",check=false}}")
    assert json.loads((out / "bundle.json").read_text())["proof"] == {"checked": False}
    assert ir.reports["emit"].proof is None


def test_a_failed_write_leaves_nothing(mini: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    written = []
    real = Path.write_bytes

    def flaky(self: Path, data: bytes) -> int:
        written.append(self)
        if len(written) == 3:
            raise OSError(28, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", flaky)
    out = tmp_path / "out"
    with pytest.raises(KernccError, match="No space left on device"):
        lower(mini, f"cut{{at=4}},emit{{out=\"{out}\"}}")
    assert siblings(out) == ["gemm.cubin", "model.json"]


def test_an_unwritable_target_is_refused(mini: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(KernccError, match="cannot write the bundle"):
        lower(mini, f"emit{{out=\"{blocker / 'out'}\"}}")
    assert siblings(blocker) == ["file", "gemm.cubin", "model.json"]


def test_a_directory_kerncc_did_not_write_is_refused(mini: Path, tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(KernccError, match="did not write"):
        lower(mini, f"emit{{out=\"{out}\"}}")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_an_old_bundle_is_replaced(mini: Path, tmp_path: Path) -> None:
    out = tmp_path / "b"
    lower(mini, f"cut{{at=4,7}},emit{{out=\"{out}\"}}")
    lower(mini, f"emit{{out=\"{out}\"}}")
    assert sorted(p.name for p in out.iterdir()) == [".kerncc-output", "bundle.json", "stage0"]
    assert siblings(out) == ["b", "gemm.cubin", "model.json"]


def test_a_stage_that_fails_its_checks_is_refused_at_the_wholes_call(mini: Path,
                                                                     tmp_path: Path) -> None:
    ir = cut_ir(IR.from_manifest(m.load(str(mini)), source=str(mini)), {"prefill": (4,)})
    stage = ir.stages[1]
    program = stage.programs["prefill"]
    bad = attrs.evolve(program.calls[1], args=program.calls[1].args[:-1])
    programs = {**stage.programs, "prefill": attrs.evolve(
        program, calls=(program.calls[0], bad) + program.calls[2:])}
    ir = attrs.evolve(ir, stages=(ir.stages[0], attrs.evolve(stage, programs=programs)))
    with pytest.raises(KernccError) as err:
        Emit(out=str(tmp_path / "b"), check=False).run(PlanMemory().run(ir))
    assert err.value.headline == emit_mod.STAGE_HEADLINE
    assert err.value.messages()[0].startswith("stage 1: ")
    assert err.value.diagnostics[0].location.pointer.startswith("/programs/prefill/calls/5")
    assert not (tmp_path / "b").exists()


def test_the_protocol_asked_of_stages_is_what_the_whole_fits(qwen: Path) -> None:
    assert whole_protocol(m.load(str(qwen))) == "sampled"
    assert whole_protocol(reader.from_raw(random_manifest(Xorshift(3)))) is None


# ---------------------------------------------------------------------------------------------
# check_bundle


@pytest.fixture
def bundle(mini: Path, tmp_path: Path) -> Path:
    out = tmp_path / "b"
    lower(mini, f"cut{{at=4}},slice-derive,emit{{out=\"{out}\"}}")
    return out


def test_check_bundle_proves_again(bundle: Path) -> None:
    proof = check_bundle(bundle)
    assert proof.to_json() == json.loads((bundle / "bundle.json").read_text())["proof"]


@pytest.mark.parametrize("path, change, message", [
    ("stage1/manifest.json", "append", "stage 1 manifest.json .* was changed after emit"),
    ("stage0/plan.json", "delete", "stage 0 plan.json .* is missing"),
    ("stage0/stage.py", "append", "stage 0 stage.py .* was changed"),
    ("../model.json", "append", "the input manifest .* was changed"),
    ("../model.json", "delete", "the input manifest .* is missing"),
    ("bundle.json", "delete", "the bundle index .* is missing"),
    ("stage0/modules", "tamper-module", "stage 0 module .* was changed"),
])
def test_check_bundle_names_missing_and_changed_files(bundle: Path, path: str, change: str,
                                                      message: str) -> None:
    target = bundle / path
    if change == "append":
        target.write_bytes(target.read_bytes() + b" ")
    elif change == "delete":
        target.unlink()
    else:
        next(target.iterdir()).write_bytes(b"tampered")
    with pytest.raises(KernccError, match=message):
        check_bundle(bundle)


def test_check_bundle_refuses_what_is_not_a_bundle(tmp_path: Path) -> None:
    with pytest.raises(KernccError, match="not a directory"):
        check_bundle(tmp_path / "nothing")
    (tmp_path / "bundle.json").write_text('{"format": "other/1"}')
    with pytest.raises(KernccError, match="format 'other/1'"):
        check_bundle(tmp_path)


def test_check_names_a_path_that_does_not_exist(tmp_path: Path) -> None:
    code, _, err = cli("check", str(tmp_path / "gone"))
    assert code == 1 and f"`{tmp_path / 'gone'}` does not exist" in err


def test_a_bundle_emitted_from_memory_needs_the_whole_named(mini: Path, tmp_path: Path) -> None:
    ir = IR.from_manifest(m.load(str(mini)))
    out = tmp_path / "b"
    run_pipeline(ir, f"cut{{at=4}},emit{{out=\"{out}\"}}")
    index = json.loads((out / "bundle.json").read_text())
    assert index["input"]["path"] is None and index["checkpoint"] is None
    with pytest.raises(KernccError, match="records no input manifest"):
        check_bundle(out)
    canonical = tmp_path / "canonical.json"
    canonical.write_text(m.dumps(ir.whole))
    assert check_bundle(out, whole=canonical).outputs == 1


def test_check_bundle_catches_a_stage_that_no_longer_computes_the_whole(
        bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = symbolic.check_stages

    def spy(whole, stages):
        calls.append(len(stages))
        return real(whole, stages)

    monkeypatch.setattr("kerncc.bundle.check.check_stages", spy)
    check_bundle(bundle)
    assert calls == [2]


def test_scratch_slots_are_named_as_documented() -> None:
    assert scratch_slot("attn", "tmp", 3) == "op:attn/scratch:tmp@3"


def _record_no_stage_py(bundle: Path, remove: bool) -> None:
    """Edit bundle.json the way docs/bundle.md allows: stage 0 records no stage.py (null)."""
    index = json.loads((bundle / "bundle.json").read_text())
    index["stages"][0]["stage_py_sha256"] = None
    (bundle / "bundle.json").write_text(json.dumps(index))
    if remove:
        (bundle / "stage0" / "stage.py").unlink()


def test_check_bundle_takes_a_stage_recorded_without_stage_py(bundle: Path) -> None:
    _record_no_stage_py(bundle, remove=True)
    assert check_bundle(bundle).outputs >= 1


def test_check_bundle_refuses_a_stage_py_the_bundle_does_not_pin(bundle: Path) -> None:
    _record_no_stage_py(bundle, remove=False)
    with pytest.raises(KernccError, match="records none \\(null\\)") as err:
        check_bundle(bundle)
    assert err.value.diagnostics[0].location.pointer == "/stages/0/stage_py_sha256"


def test_check_bundle_refuses_a_file_whose_hash_is_not_recorded(bundle: Path) -> None:
    """docs/bundle.md: the runtime does not check a sha256 bundle.json does not record, so
    check refuses such a bundle: what it proves must be what runs (issue 38.1)."""
    index = json.loads((bundle / "bundle.json").read_text())
    del index["stages"][1]["plan_sha256"]
    index["stages"][0]["manifest_sha256"] = None
    # stage.py's header names its plan's sha256: a stage that lets its plan change has none
    index["stages"][1]["stage_py_sha256"] = None
    (bundle / "stage1" / "stage.py").unlink()
    (bundle / "bundle.json").write_text(json.dumps(index))
    plan = bundle / "stage1" / "plan.json"
    plan.write_bytes(plan.read_bytes() + b"\n")
    with pytest.raises(KernccError, match="stage 0 records no `manifest_sha256`"):
        check_bundle(bundle)


def test_check_bundle_checks_each_plan_as_the_runtime_loads_it(bundle: Path) -> None:
    """A plan.json edited with its hash updated: check refuses it as Bundle() does, in it."""
    plan_path = bundle / "stage1" / "plan.json"
    plan = json.loads(plan_path.read_text())
    plan["arena"]["bytes"] = "big"
    plan_path.write_text(json.dumps(plan, indent=1))
    index = json.loads((bundle / "bundle.json").read_text())
    index["stages"][1]["plan_sha256"] = hashlib.sha256(plan_path.read_bytes()).hexdigest()
    (bundle / "bundle.json").write_text(json.dumps(index))
    with pytest.raises(KernccError) as err:
        check_bundle(bundle)
    where = err.value.diagnostics[0].location
    assert (where.file, where.pointer) == (str(plan_path), "/arena/bytes")
    assert '"bytes": "big"' in plan_path.read_text().splitlines()[where.line - 1]
    with pytest.raises(KernccError, match="expected an integer"):
        Bundle(bundle)


def test_outputs_get_the_modes_the_umask_gives(tmp_path):
    """A bundle folder and a file written all at once are readable as any file this process
    makes, not left at the temporary files' owner-only 0700 / 0600."""
    from kerncc import atomic

    with atomic.atomic_directory(tmp_path / "out") as tmp:
        (tmp / "bundle.json").write_text("{}")
    atomic.write_text_atomic(tmp_path / "model.json", "{}\n")
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~atomic._UMASK
    assert (tmp_path / "model.json").stat().st_mode & 0o777 == 0o666 & ~atomic._UMASK
    assert (tmp_path / "model.json").read_text() == "{}\n"
