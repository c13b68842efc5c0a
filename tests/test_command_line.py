"""The command line a user expects (issue 16): version, `python -m`, one JSON document per
`--format json`, usage errors from the command given, help for every flag, standard input,
`fmt -i`, limits before the work, a summarised and streamed `run`, and a fast `--help`."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kerncc import __version__
from kerncc.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
LAYERS3 = str(ROOT / "golden" / "inputs" / "layers3.json")


def _kerncc(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kerncc", *args], capture_output=True,
                          text=True, input=stdin, timeout=120, cwd=ROOT,
                          env={**os.environ, "KERNCC_NO_PROGRESS": "1"})


# --------------------------------------------------------------------------- 1: version


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        main([flag])
    assert exit.value.code == 0
    assert capsys.readouterr().out == f"kerncc {__version__}\n"


def test_python_dash_m_is_the_command() -> None:
    done = _kerncc("verify", LAYERS3)
    assert done.returncode == 0, done.stderr
    assert "verified" in done.stderr and "forward" in done.stdout
    assert _kerncc("--version").stdout == f"kerncc {__version__}\n"


# --------------------------------------------------------------------------- 3: one JSON document


def _one_json(capsys, argv: list[str], code: int = 0):
    assert main(argv) == code
    return json.loads(capsys.readouterr().out)  # the whole of stdout: exactly one document


def test_dump_json_after_a_cut_is_one_document(capsys) -> None:
    stages = _one_json(capsys, ["dump", LAYERS3, "-p", "cut{at=10}", "--format", "json"])
    assert isinstance(stages, list) and len(stages) == 2
    assert all(s["schema_version"] == 5 for s in stages)
    whole = _one_json(capsys, ["dump", LAYERS3, "--format", "json"])
    assert whole["model"] == "layers3"


def test_check_json_on_success(capsys, tmp_path) -> None:
    assert main(["lower", LAYERS3, "-p", "cut{at=10}", "-o", str(tmp_path / "st")]) == 0
    capsys.readouterr()
    proof = _one_json(capsys, ["check", LAYERS3, str(tmp_path / "st" / "stage0.json"),
                               str(tmp_path / "st" / "stage1.json"), "--format", "json"])
    assert proof["ok"] is True and proof["programs"] >= 1


def test_verify_json_gives_fields(capsys, tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    doc = _one_json(capsys, ["verify", "--format", "json", LAYERS3, str(bad)], code=1)
    good, broken = doc["files"]
    assert doc["ok"] is False and good["ok"] and not broken["ok"] and broken["diagnostics"]
    summary = good["protocol"]
    assert set(summary) >= {"axes", "fills", "tables", "forwards", "once", "derive"}
    assert summary["axes"]["rows"]["var"] == "tokens"
    assert {"name": "token_ids", "fill": "token", "dtype": "i32", "axis": "rows",
            "width": 1} in summary["fills"]
    assert any(f["emits"] == "next_tokens" for f in summary["forwards"])


def test_liveness_report_honours_format_and_program(capsys) -> None:
    report = _one_json(capsys, ["dump", LAYERS3, "--pass", "liveness", "--format", "json",
                                "--program", "decode"])
    (stage,) = report["stages"]
    assert list(stage) == ["decode"] and stage["decode"]["peak_bytes"] > 0
    assert main(["dump", LAYERS3, "--pass", "liveness", "--program", "decode"]) == 0
    text = capsys.readouterr().out
    assert "program decode:" in text and "program prefill:" not in text
    assert main(["dump", LAYERS3, "--pass", "liveness", "--format", "dot"]) == 0
    assert capsys.readouterr().out.startswith("digraph")
    assert main(["dump", LAYERS3, "--pass", "liveness", "--program", "nope"]) == 1
    assert "no program `nope`" in capsys.readouterr().err


# --------------------------------------------------------------------------- 10: exit codes


def test_unknown_flag_prints_the_commands_usage(capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["verify", "--bogus", LAYERS3])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kerncc verify") and "unrecognized arguments: --bogus" in err


def test_help_states_the_exit_codes() -> None:
    text = build_parser().format_help()
    assert "1  the input is wrong" in text and "2  usage error" in text


# --------------------------------------------------------------------------- 13: help, stdin, -i


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def test_every_flag_has_help() -> None:
    parser = build_parser()
    missing = [f"{name} {a.option_strings or a.dest}" for name, sub in _subparsers(parser)
               for a in sub._actions if not a.help]
    assert missing == []


def test_backend_help_states_its_default() -> None:
    run = dict(_subparsers(build_parser()))["run"]
    (backend,) = [a for a in run._actions if "--backend" in a.option_strings]
    assert "KERNCC_BACKEND" in backend.help and "cpu" in backend.help


def test_dash_reads_standard_input() -> None:
    text = Path(LAYERS3).read_text()
    done = _kerncc("verify", "-", stdin=text)
    assert done.returncode == 0 and "<stdin>" not in done.stdout and "verified" in done.stderr
    kir = _kerncc("fmt", LAYERS3, "--to", "kir").stdout
    assert _kerncc("fmt", "-", "--to", "json", stdin=kir).stdout == _kerncc("fmt", LAYERS3).stdout
    older = text.replace('"schema_version": 5', '"schema_version": 4')
    broken = _kerncc("verify", "-", stdin=older)
    assert broken.returncode == 1 and "<stdin>:" in broken.stderr


def test_fmt_in_place(tmp_path, capsys) -> None:
    canonical = Path(LAYERS3).read_text()
    target = tmp_path / "m.json"
    target.write_text(json.dumps(json.loads(canonical)))  # one line: not canonical
    assert main(["fmt", "--check", str(target)]) == 1
    assert main(["fmt", "-i", str(target)]) == 0
    assert target.read_text() == canonical and main(["fmt", "--check", str(target)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]  # no temporary left behind
    assert main(["fmt", "-i", "--to", "kir", str(target)]) == 1
    assert "-i rewrites a file in its own form" in capsys.readouterr().err


# --------------------------------------------------------------------------- 15: fast help


PROBE = """
import sys
from kerncc.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("IMPORTED=" + ",".join(m for m in ("numpy", "kerncc.example", "lark")
                             if m in sys.modules), file=sys.stderr)
"""


@pytest.mark.parametrize("argv,allowed", [(["--help"], ""), (["run", "--help"], ""),
                                           (["verify", LAYERS3], "lark")])
def test_help_and_verify_import_no_numpy(argv: list[str], allowed: str) -> None:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    imported = done.stderr.strip().splitlines()[-1]
    assert imported in ("IMPORTED=", f"IMPORTED={allowed}")


def test_example_flags_match_the_config() -> None:
    import attrs

    from kerncc.cli.run import OVERRIDE_HELP, OVERRIDES
    from kerncc.example.config import QwenConfig

    attrs.resolve_types(QwenConfig)
    numbers = {f.name: f.type for f in attrs.fields(QwenConfig) if f.type in (int, float)}
    assert OVERRIDES == numbers and set(OVERRIDE_HELP) == set(OVERRIDES)


# --------------------------------------------------------------------------- 4, 6: run


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from kerncc.example import generate

    manifest, _ = generate(tmp_path_factory.mktemp("tiny"), "tiny")
    return manifest


def test_limits_are_checked_before_the_weights_load(tiny, tmp_path, capsys) -> None:
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a checkpoint")  # loading it would fail: the limits come first
    base = ["run", str(tiny), "--weights", str(garbage)]
    assert main([*base, "--prompt", "1,2,3", "--max-new", "300"]) == 1
    err = capsys.readouterr().err
    assert "--max-new 300" in err and "at most --max-new 254" in err and "loaded" not in err
    assert main([*base, "--prompt", "1,2,256,3", "--max-new", "2"]) == 1
    err = capsys.readouterr().err
    assert "--prompt position 2: token id 256" in err and "0..255" in err


def test_check_request_names_what_the_caller_calls_things(tiny) -> None:
    from kerncc.diagnostics import KernccError
    from kerncc.lower import lower_to_bundle
    from kerncc.runtime.model_runner import FIELDS, FLAGS, check_request, request_limits

    limits = request_limits([s.manifest for s in lower_to_bundle(tiny).stages])
    assert limits.context == 256 and limits.token_high == 255
    check_request(limits, [1] * 200, 57)  # 256 positions: fits exactly
    with pytest.raises(KernccError, match="max_tokens 58: .* need 257 positions") as err:
        check_request(limits, [1] * 200, 58, FIELDS)
    assert err.value.diagnostics[0].location.pointer == "/max_tokens"
    with pytest.raises(KernccError, match=r"prompt position 2: token id -1 is outside 0\.\.255"
                       ) as err:
        check_request(limits, [1, 2, -1], 3, FIELDS)
    assert err.value.diagnostics[0].location.pointer == "/prompt/2"
    with pytest.raises(KernccError, match="--max-new 0: generate at least 1 token") as err:
        check_request(limits, [1, 2], 0, FLAGS)
    assert err.value.diagnostics[0].location.pointer == ""  # flags have no JSON pointer
    with pytest.raises(KernccError, match="the prompt is empty"):
        check_request(limits, [], 1)


def test_run_summarises_and_streams(tiny, capsys) -> None:
    assert main(["run", str(tiny), "--prompt", "1,2,3", "--max-new", "4"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and len(out.splitlines()[-1].split()) == 4
    # the whole prompt in one chunk, which hands back the first token; the last is never fed
    assert "ran 4 programs" in err and "prefill 1 run of 3 rows, decode 3 runs of 1 row" in err
    assert "×" not in err
    assert main(["run", str(tiny), "--prompt", "1,2,3", "--max-new", "4", "-v"]) == 0
    assert "prefill×3 decode×1 decode×1 decode×1" in capsys.readouterr().err
    assert main(["run", str(tiny), "--prompt", "1,2,3", "--max-new", "4", "--quiet"]) == 0
    quiet_out, quiet_err = capsys.readouterr()
    assert quiet_out == out and quiet_err == ""


def test_the_engine_hands_each_token_over_as_it_comes(tiny) -> None:
    from kerncc.lower import lower_to_bundle
    from kerncc.runtime import Chain
    from kerncc.serve.engine import Config, Engine, Request

    engine = Engine(Chain(lower_to_bundle(tiny)), Config(max_running=1))
    seen: list[tuple[int, int]] = []

    class Listener:  # each token arrives mid-run: the sequence still holds its pages
        def token(self, request, token):
            seen.append((token, engine.pool.pages - engine.pool.free))

        def done(self, request):
            seen.append((None, engine.pool.pages - engine.pool.free))

    request = engine.submit(Request([5, 6, 7], 4, listener=Listener()))
    engine.run_until_idle()
    assert [t for t, _ in seen] == request.generated + [None]
    # every token but the last is heard while the sequence runs on (the last one and the end
    # are told together, once it has ended and given its pages back)
    assert len(seen) == 5 and all(held > 0 for _, held in seen[:-2])
    assert seen[-2:] == [(request.generated[-1], 0), (None, 0)]


def test_summarise_steps() -> None:
    from kerncc.cli.run import summarise_steps

    steps = [("prefill", 8), ("prefill", 3), ("decode", 1), ("decode", 1)]
    assert summarise_steps(steps) == "prefill 2 runs, 11 rows (3..8 a run), decode 2 runs of 1 row"


def test_stages_default_is_shown_as_plain_cut_means() -> None:
    from kerncc.pipeline import describe_passes

    (line,) = [ln for ln in describe_passes().splitlines() if ln.strip().startswith("stages=")]
    assert "(default: 2)" in line


# --------------------------------------------------------------------------- 9: located errors


@pytest.mark.parametrize("argv,message", [
    (["lower", LAYERS3, "-p", "cut,emit", "-o", "FILE"], "exists and is not a directory"),
    (["lower", LAYERS3, "-p", "cut{stages=1}"], "cut{stages=1}: a cut has at least 2 stages"),
    (["run", LAYERS3, "--pipeline", "cut", "--prompt", "1"], "must end in `emit`"),
])
def test_problems_outside_the_manifest_are_not_located_in_it(argv, message, tmp_path,
                                                             capsys) -> None:
    (tmp_path / "FILE").write_text("")
    argv = [str(tmp_path / "FILE") if a == "FILE" else a for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "layers3.json:1:1" not in err and "\n  {" not in err
    assert err.count(message) == 1


@pytest.mark.parametrize("command", [["run", "--prompt", "1,2"], ["serve", "--port", "1"]])
def test_a_missing_checkpoint_is_said_once_of_the_users_file(tiny, tmp_path, capsys,
                                                             command) -> None:
    """run and serve alike (serve said it of its temporary bundle and named `kerncc run`),
    before serve takes its port."""
    pytest.importorskip("uvicorn")
    alone = tmp_path / "model.json"
    alone.write_text(tiny.read_text())
    assert main([command[0], str(alone), *command[1:]]) == 1
    err = capsys.readouterr().err
    assert err.count("no checkpoint") == 1 and str(alone) in err and "kerncc-bundle-" not in err


# --------------------------------------------------------------------------- 12: example


def test_example_refuses_a_folder_holding_a_model(tmp_path, capsys) -> None:
    out = tmp_path / "m"
    assert main(["example", "qwen", "-o", str(out), "--layers", "1"]) == 0
    before = (out / "model.json").read_text()
    assert main(["example", "qwen", "-o", str(out), "--layers", "3"]) == 1
    err = capsys.readouterr().err
    assert "already holds a model" in err and "--force" in err
    assert (out / "model.json").read_text() == before  # untouched
    assert main(["example", "qwen", "-o", str(out), "--layers", "3", "--force"]) == 0
    assert (out / "model.json").read_text() != before


def test_writes_show_progress_on_a_terminal_only(tmp_path, monkeypatch, capsys) -> None:
    from kerncc import progress

    assert main(["example", "qwen", "-o", str(tmp_path / "quiet"), "--layers", "1"]) == 0
    assert "\r" not in capsys.readouterr().err  # not a terminal: not a byte
    monkeypatch.setattr(progress, "should_draw", lambda stream: True)
    assert main(["example", "qwen", "-o", str(tmp_path / "tty"), "--layers", "1"]) == 0
    err = capsys.readouterr().err
    assert "generating weights" in err and "writing model.safetensors [" in err


# --------------------------------------------------------------------------- 11: balanced cuts


def test_balanced_cuts_prefer_layer_boundaries_within_a_few_percent(tiny, tmp_path) -> None:
    from kerncc.analysis.balance import balanced_points
    from kerncc.example import generate
    from kerncc.manifest import reader

    deep, _ = generate(tmp_path / "deep", "tiny", layers=36)
    man = reader.load(deep)
    calls = man.programs["decode"].calls
    labels = [calls[a].label for a in balanced_points(man, 4)["decode"]]
    assert labels == ["l9.input_norm", "l18.input_norm", "l27.input_norm"]  # not l27.qkv_proj
    small = reader.load(tiny)
    calls = small.programs["decode"].calls
    # Before: 8 and 15 (l0.act: gate_up's output crosses). Now as balanced, and fewer bytes.
    assert [calls[a].label for a in balanced_points(small, 3)["decode"]] == [
        "l0.gate_up_proj", "l1.o_proj"]


@settings(max_examples=60)
@given(st.data())
def test_the_pick_is_the_fewest_bytes_among_the_nearly_best_balanced(data) -> None:
    import itertools

    from kerncc.analysis import balance

    n = data.draw(st.integers(3, 12))
    costs = data.draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    legal = sorted(data.draw(st.sets(st.integers(1, n - 1), min_size=1)))
    crossing = {a: data.draw(st.integers(0, 9)) for a in legal}
    stages = data.draw(st.integers(2, 4))
    picked = balance._pick(costs, legal, crossing, stages)
    cuts = list(itertools.combinations(legal, stages - 1))
    if not cuts:
        assert len(picked) < stages - 1
        return

    def heaviest(points):
        bounds = [0, *points, len(costs)]
        return max(sum(costs[x:y]) for x, y in itertools.pairwise(bounds))

    bound = min(heaviest(p) for p in cuts) * (1 + balance.BALANCE_SLACK)
    within = [p for p in cuts if heaviest(p) <= bound]
    assert tuple(picked) in within
    assert sum(crossing[a] for a in picked) == min(sum(crossing[a] for a in p) for p in within)


def test_the_readme_states_the_exit_codes() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "exit code 1" in readme and "exit code 2" in readme


def test_lower_json_without_output_is_one_document(capsys) -> None:
    stages = _one_json(capsys, ["lower", LAYERS3, "-p", "cut{at=10}", "--format", "json"])
    assert [s["cut"]["stage"] for s in stages] == [0, 1]
    assert main(["lower", LAYERS3, "-p", "cut{stages=1}", "--format", "json"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and json.loads(err)["diagnostics"]


def test_stdin_cannot_be_emitted_but_can_be_lowered_and_checked(tmp_path) -> None:
    text = Path(LAYERS3).read_text()
    done = _kerncc("lower", "-", "-p", "cut,emit", "-o", str(tmp_path / "b"), stdin=text)
    assert done.returncode == 1 and "save it to a file" in done.stderr
    assert not (tmp_path / "b").exists()
    assert _kerncc("lower", LAYERS3, "-p", "cut{at=10}", "-o", str(tmp_path / "s")).returncode == 0
    done = _kerncc("check", "-", str(tmp_path / "s" / "stage0.json"),
                   str(tmp_path / "s" / "stage1.json"), stdin=text)
    assert done.returncode == 0 and done.stdout.startswith("proved:")


@pytest.mark.parametrize("argv", [["run", LAYERS3, "--prompt", "1"], ["example", "qwen", "-o", "x"],
                                  ["dump", LAYERS3], ["lower", LAYERS3, "-p", "emit"],
                                  ["check", LAYERS3], ["fmt", LAYERS3], ["report", "x"],
                                  ["serve", LAYERS3]])
def test_every_command_reports_its_own_usage(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        main([*argv, "--bogus"])  # a complete command line plus an unknown flag
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: kerncc {argv[0]}") and "unrecognized arguments: --bogus" in err



# --------------------------------------------------------------------------- run: bad flags


def usage_error(argv: list[str], capsys) -> str:
    """What `kerncc ARGV` says on stderr, having exited 2 with its command's usage (flags that
    contradict each other are usage errors, as argparse's own conflicts are) and printed
    nothing on stdout."""
    with pytest.raises(SystemExit) as exit:
        main(argv)
    out, err = capsys.readouterr()
    assert exit.value.code == 2, err
    assert err.startswith(f"usage: kerncc {argv[0]}") and out == "", err
    return err


def test_sampling_flags_are_refused_where_they_would_be_ignored(tiny, capsys) -> None:
    """Several prompts are served greedily, and greedy decoding reads no top-k, top-p or seed:
    those flags were silently dropped (the run printed greedy tokens as if it had sampled)."""
    base = ["run", str(tiny), "--max-new", "2"]
    err = usage_error([*base, "--prompt", "1,2", "--prompt", "3", "--temperature", "1"], capsys)
    assert "--temperature 1.0" in err and "give one --prompt" in err
    assert "loaded" not in err
    for flag, value in (("--top-k", "5"), ("--top-p", "0.5"), ("--seed", "3")):
        err = usage_error([*base, "--prompt", "1,2", flag, value], capsys)
        assert f"{flag} {value}" in err and "--temperature" in err, err
        assert "loaded" not in err
        err = usage_error([*base, "--prompt", "1,2", "--prompt", "3", flag, value], capsys)
        assert f"{flag} {value}" in err and "give one --prompt" in err, err
    # a value out of range is bad input (exit 1), whatever else the flags say, said once and
    # of the flag (it came twice, once more under the request body's pointer)
    assert main([*base, "--prompt", "1,2", "--prompt", "3", "--top-p", "0"]) == 1
    err = capsys.readouterr().err
    assert err == "error: --top-p 0.0: must be in (0, 1] (1 is off)\n", err
    assert main([*base, "--prompt", "1,2", "--temperature", "1", "--top-k", "5",
                 "--seed", "3"]) == 0
    capsys.readouterr()


def test_devices_without_the_cuda_backend_is_a_usage_error(tiny, capsys) -> None:
    """It exited 1 like bad input while the placement flags' conflicts exited 2."""
    err = usage_error(["run", str(tiny), "--prompt", "1,2", "--backend", "cpu", "--devices",
                       "0"], capsys)
    assert "--devices needs --backend cuda" in err and "loaded" not in err
    err = usage_error(["serve", str(tiny), "--backend", "cpu", "--devices", "0,1",
                       "--transport", "host"], capsys)
    assert "--devices needs --backend cuda" in err and "--transport" in err, err


@pytest.mark.parametrize("several", [False, True])
@pytest.mark.parametrize("flag", ["--trace", "--logits"])
def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(
        tiny, tmp_path, capsys, flag, several) -> None:
    """A path under a file failed only after the whole run (its tokens printed, then exit 1),
    and with several prompts as an internal error (exit 3) from the trace's mkdir."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    target = blocker / "deeper" / "out"
    prompts = ["--prompt", "1,2"] + (["--prompt", "3"] if several else [])
    argv = ["run", str(tiny), *prompts, "--max-new", "1", flag, str(target)]
    if several and flag == "--logits":  # one prompt's flag: a usage error before the path's
        err = usage_error(argv, capsys)
        assert "--logits saves one prompt's logits" in err and "loaded" not in err
        assert blocker.read_text() == "not a directory"
        return
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 1, err
    assert f"{flag} `{target}`" in err and f"`{blocker}` is not a directory" in err
    assert out == "" and "loaded" not in err
    assert blocker.read_text() == "not a directory"


@pytest.mark.parametrize("failure, code", [(OSError(28, "No space left on device"), 1),
                                           (KeyboardInterrupt(), 130)])
def test_logits_are_written_whole_or_not_at_all(tiny, tmp_path, capsys, monkeypatch,
                                                failure, code) -> None:
    """--logits was written in place: a full disk or a Ctrl-C mid-write left a torn .npy where
    the previous run's file had been."""
    import numpy as np

    target = tmp_path / "logits.npy"
    target.write_bytes(b"the previous run's logits")

    def torn(file, array, *args, **kwargs):
        file.write(b"\x93NUMPY half of it")
        raise failure

    monkeypatch.setattr(np, "save", torn)
    argv = ["run", str(tiny), "--prompt", "1,2", "--max-new", "1", "--logits", str(target)]
    assert main(argv) == code
    capsys.readouterr()
    assert target.read_bytes() == b"the previous run's logits"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logits.npy"]
    monkeypatch.undo()
    assert main(argv) == 0
    assert np.load(target).shape[1] == 256


def test_several_prompts_stop_at_eos_as_each_alone_does(tiny, tmp_path, capsys) -> None:
    """Several prompts never stopped at eos, so a line went on past where that prompt alone
    stops, and --ignore-eos and --tokenizer (whose folder names the eos ids) did nothing."""
    base = ["run", str(tiny), "--max-new", "12", "-q"]

    def lines(*flags: str) -> list[str]:
        assert main([*base, *flags]) == 0
        out, err = capsys.readouterr()
        assert err == ""  # --quiet: no summary either
        return out.splitlines()

    stops, runs = lines("--prompt", "3,7")[-1], lines("--prompt", "1,2,3")[-1]
    assert stops.split()[-1] == "2" and len(stops.split()) < 12  # config.json: eos 2
    assert "2" not in runs.split() and len(runs.split()) == 12
    assert lines("--prompt", "3,7", "--prompt", "1,2,3") == [stops, runs]
    past = lines("--prompt", "3,7", "--ignore-eos")[-1]
    assert len(past.split()) == 12
    assert lines("--prompt", "3,7", "--prompt", "1,2,3", "--ignore-eos") == [past, runs]
    other = tmp_path / "tokenizer"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"eos_token_id": int(stops.split()[1])}))
    alone = lines("--prompt", "3,7", "--tokenizer", str(other))[-1]
    assert alone == " ".join(stops.split()[:2])
    assert lines("--prompt", "3,7", "--prompt", "1,2,3", "--tokenizer", str(other)) == [
        alone, runs]


@pytest.mark.parametrize("several", [False, True])
def test_a_tokenizer_folder_that_is_not_there_is_refused(tiny, tmp_path, capsys,
                                                         several) -> None:
    """A mistyped --tokenizer read no eos ids, so the run quietly went on past eos."""
    prompts = ["--prompt", "3,7"] + (["--prompt", "1,2,3"] if several else [])
    missing = tmp_path / "nowhere"
    assert main(["run", str(tiny), *prompts, "--tokenizer", str(missing)]) == 1
    out, err = capsys.readouterr()
    assert f"--tokenizer {missing}: no such folder" in err
    assert out == "" and "loaded" not in err


@pytest.mark.parametrize("flag", [["--logits", "out.npy"], ["-v"]])
def test_single_prompt_flags_are_refused_with_several_before_the_weights_load(
        tiny, tmp_path, capsys, flag) -> None:
    """--logits was refused only after the weights loaded; -v did nothing."""
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a checkpoint")  # loading it would fail: the refusal comes first
    argv = ["run", str(tiny), "--weights", str(garbage), "--prompt", "1,2", "--prompt", "3",
            *[str(tmp_path / f) if f.endswith(".npy") else f for f in flag]]
    err = usage_error(argv, capsys)
    assert flag[0] in err and "give one --prompt" in err, err
    assert "loaded" not in err and "checkpoint" not in err


def test_ctrl_c_ends_the_streamed_line_first(tiny, capsys, monkeypatch) -> None:
    """Ctrl-C mid-stream printed `interrupted` on the same line as the tokens (`66interrupted`
    on a terminal, where stdout and stderr meet)."""
    from kerncc.serve.engine import Engine

    def interrupted(self):
        self._apply_commands()  # the submitted request, admitted
        (request,) = self.requests.values()
        for token in (66, 67):
            request.listener.token(request, token)
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "run_until_idle", interrupted)
    assert main(["run", str(tiny), "--prompt", "1,2,3", "--max-new", "4"]) == 130
    out, err = capsys.readouterr()
    assert out == "66 67\n" and err.endswith("interrupted\n")


@pytest.mark.parametrize("command", ["run", "serve"])
def test_a_pipeline_for_a_bundle_directory_is_refused(tiny, tmp_path, capsys, command) -> None:
    """A bundle directory is already lowered: --pipeline was accepted and lowered nothing."""
    bundle = tmp_path / "bundle"
    assert main(["lower", str(tiny), "-p", "emit", "-o", str(bundle)]) == 0
    capsys.readouterr()
    prompt = ["--prompt", "1,2"] if command == "run" else []
    missing = ["--weights", str(tmp_path / "missing.safetensors")]  # bounded if accepted
    assert main([command, str(bundle), *prompt, *missing, "--pipeline",
                 "cut,slice-derive,emit"]) == 1
    err = capsys.readouterr().err
    assert f"--pipeline cut,slice-derive,emit: `{bundle}` is a bundle directory" in err, err


@pytest.mark.parametrize("command", [["run", "--prompt", "1,2"],
                                     ["run", "--prompt", "1,2", "--prompt", "3"],
                                     ["serve", "--port", "1"]])
def test_a_chunk_past_the_rows_bound_is_refused_before_anything_loads(tiny, tmp_path, capsys,
                                                                      command) -> None:
    """Before the checkpoint is even looked for (here there is none)."""
    pytest.importorskip("uvicorn")
    alone = tmp_path / "model.json"
    alone.write_text(tiny.read_text())
    assert main([command[0], str(alone), *command[1:], "--chunk", "65"]) == 1
    err = capsys.readouterr().err
    assert "--chunk 65 is outside [1, 64]" in err and "checkpoint" not in err


# --------------------------------------------------------------------------- trip points


@pytest.mark.parametrize("argv, said", [
    (["run", "-", "--prompt", "1"], "argument BUNDLE_OR_MANIFEST: `-` (standard input) cannot "
     "be a bundle or a manifest to run"),
    (["serve", "-"], "argument BUNDLE_OR_MANIFEST: `-` (standard input) cannot be a bundle"),
    (["report", "-"], "argument BUNDLE: `-` (standard input) cannot be a bundle: a bundle is a "
     "folder"),
    (["check", "-"], "`-` (standard input) cannot be a bundle: a bundle is a folder"),
    (["check", "-", "somewhere"], "`-` (standard input) cannot be WHOLE against a bundle"),
    (["check", "-", "a.json", "-"], "`-` (standard input) can stand for one manifest only"),
])
def test_stdin_where_no_manifest_can_come_from_it_is_a_usage_error(argv, said, capsys) -> None:
    """`-` used to reach the command, which said `-` does not exist, or asked for a prompt."""
    err = usage_error(argv, capsys)
    assert said in err, err


def test_only_commands_that_read_stdin_say_so_in_their_help() -> None:
    helps = {name: p.format_help() for name, p in _subparsers(build_parser())}
    for name in ("verify", "fmt", "dump", "lower"):
        assert "`-` in place of a FILE reads standard input" in helps[name], name
    assert "`-` in place of WHOLE or one STAGE manifest" in helps["check"]
    for name in ("report", "passes", "run", "serve"):
        assert "standard input" not in helps[name].replace("\n", " "), name


def test_check_reads_the_whole_from_stdin(tmp_path) -> None:
    stages = tmp_path / "stages"
    assert _kerncc("lower", LAYERS3, "-p", "cut", "-o", str(stages)).returncode == 0
    text = Path(LAYERS3).read_text()
    done = _kerncc("check", "-", str(stages / "stage0.json"), str(stages / "stage1.json"),
                   stdin=text)
    assert done.returncode == 0 and "proved" in done.stdout, done.stderr


def test_prompt_forms_that_contradict_are_a_usage_error(tiny, capsys) -> None:
    """The README: flags that contradict each other exit 2 with the usage (it was 1)."""
    err = usage_error(["run", str(tiny), "--prompt", "1", "--text", "a"], capsys)
    assert "give exactly one of --prompt, --text and --chat (got --prompt, --text)" in err
    err = usage_error(["run", str(tiny)], capsys)
    assert "give exactly one of --prompt, --text and --chat" in err


def test_a_model_folder_is_not_a_bundle_and_the_error_says_what_to_give(tiny, capsys) -> None:
    folder = tiny.parent
    assert main(["run", str(folder), "--prompt", "1,2"]) == 1
    err = capsys.readouterr().err
    assert err == (f"error: `{folder}` is a folder but no bundle (it has no bundle.json); to "
                   f"run the manifest in it, give `{folder / 'model.json'}`\n"), err


@pytest.mark.parametrize("argv", [["fmt", LAYERS3], ["verify", "--format", "json", "BAD"]])
def test_a_closed_pipe_exits_141_quietly(argv, tmp_path) -> None:
    """`kerncc ... | head -1` under `set -o pipefail`: the output was cut short, so not 0 (it
    was), and no traceback nor Python's `Exception ignored` line. The pipe's reader is gone
    before kerncc starts, so its first write fails, whatever the timing."""
    bad = tmp_path / "bad.json"
    bad.write_text(Path(LAYERS3).read_text().replace('"schema_version": 5', '"schema_version": 4'))
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "kerncc",
                               *[str(bad) if a == "BAD" else a for a in argv]],
                              stdout=write, stderr=subprocess.PIPE, cwd=ROOT, timeout=120)
    finally:
        os.close(write)
    assert done.returncode == 141 and done.stderr == b"", done.stderr
