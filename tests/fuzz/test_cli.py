"""Command lines: every command with flags and values drawn from its own vocabulary (and from
the others'), in process; and a few real `kerncc` processes.

Each case gets a directory holding copies of a manifest, a kir text, the tiny model's
checkpoint and bundle, and runs there, so that every path a command line names (inputs and
outputs alike: `-o`, `--dump-dir`, `--logits`, `--trace`) is inside it. The contract: exit 0
or 1, or 2 with argparse's usage line; never an internal error; the input copies unchanged.
The subprocess cases check what only a real process shows: the console script, exit codes,
stderr without a traceback, a reader that closes the pipe early.
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.random_manifests import examples

from . import harness
from .harness import fresh_dir, run_cli
from .mutate import INTERESTING_INTS
from .seeds import GOLDEN_INPUTS

INPUTS = ("in/model.json", "in/model.kir", "in/layers3.json", "in/bundle", "in/model.safetensors",
          "in", "in/missing.json", "in/bundle/bundle.json", "-", "")
OUTPUTS = ("out", "out/deeper/dir", "in", "out.npy", "out.json", "in/model.json",
           "in/model.json", "in/bundle")
# `example -o FILE`, `run --trace DIR`, `run --logits` into a missing directory and token ids
# past int32 were internal errors; test_regressions.py holds each case.
SPECS = ("cut,slice-derive,emit", "cut{at=3}", "default", "emit", "cut{stages=9},emit", "nope",
         "cut{at=", "liveness")
WORDS = ("liveness", "cut", "emit", "prefill", "decode", "nope", "0", "-1", "1,2", "1,2,3", "x",
         "é", "--", "-", "--help", "qwen", "tiny", "small", "cpu", "cuda", "json", "kir", "dot",
         "text", *map(str, INTERESTING_INTS[:12]))
COMMANDS = {
    "verify": {"": INPUTS, "--format": ("text", "json", "xml"), "--unsampled": None},
    "fmt": {"": INPUTS, "--to": ("json", "kir", "yaml"), "--check": None},
    "dump": {"": INPUTS, "--format": ("kir", "json", "dot"), "-p": SPECS,
             "--pass": ("liveness", "cut", "plan-memory", "nope", "emit"),
             "--program": ("prefill", "decode", "nope"), "--print-ir-after": ("cut", "nope"),
             "--print-ir-after-all": None, "--time-passes": None, "--no-verify": None,
             "--dump-dir": OUTPUTS},
    "lower": {"": INPUTS, "-p": SPECS, "-o": OUTPUTS, "--format": ("text", "json"),
              "--print-ir-after-change": None, "--time-passes": None, "--no-verify": None,
              "--dump-dir": OUTPUTS},
    "check": {"": INPUTS, "--format": ("text", "json")},
    "passes": {"--markdown": None},
    "run": {"": INPUTS, "--backend": ("cpu", "cpu", "cuda"),
            "--prompt": ("1,2", "1", "", "a", "-1", "1,,2", "0,0,0,0,0,0,0,0,0", "99999999999"),
            "--max-new": ("0", "1", "2", "-1", "x"), "--chunk": ("0", "1", "2", "65", "-3"),
            "--weights": INPUTS, "--logits": OUTPUTS, "--pipeline": SPECS, "--interpret": None,
            "--trace": OUTPUTS},
    "example": {"": ("qwen", "llama"), "-o": OUTPUTS, "--size": ("tiny", "huge"),
                "--layers": ("0", "1", "2", "-1"), "--heads": ("0", "3", "x"),
                "--head-dim": ("12", "16", "0")},
}
OUTPUT_FLAGS = ("-o", "--dump-dir", "--logits", "--trace")
# A real `kerncc` prints a traceback only for a bug; a usage error is argparse's line.
USAGE_PREFIX = "usage: kerncc"


def case_dir(fuzz_root: Path, tiny_bundle) -> Path:
    """A fresh directory with `in/`: the inputs every command line may name."""
    case = fresh_dir(fuzz_root)
    inputs = case / "in"
    inputs.mkdir()
    shutil.copy(tiny_bundle.manifest, inputs / "model.json")
    shutil.copy(tiny_bundle.checkpoint, inputs / "model.safetensors")
    shutil.copy(GOLDEN_INPUTS / "layers3.json", inputs / "layers3.json")
    shutil.copy(GOLDEN_INPUTS / "kitchen_sink.kir", inputs / "model.kir")
    shutil.copytree(tiny_bundle.dir, inputs / "bundle")
    return case


@st.composite
def command_lines(draw: st.DrawFn) -> list[str]:
    """A command, its positional inputs, then flags with values, in any order, now and then
    a flag or value of another command, or a word from nowhere."""
    command = draw(st.sampled_from(sorted(COMMANDS)))
    flags = COMMANDS[command]
    argv = [command]
    if "" in flags:
        argv += draw(st.lists(st.sampled_from(flags[""]), min_size=1, max_size=2))
    for _ in range(draw(st.integers(0, 4))):
        stray = draw(st.integers(0, 7)) == 0
        if stray:
            argv.append(draw(st.sampled_from(WORDS + tuple(f for c in COMMANDS.values()
                                                           for f in c if f))))
            continue
        flag = draw(st.sampled_from(sorted(f for f in flags if f) or [""]))
        values = flags.get(flag)
        argv += [flag] if values is None else [flag, draw(st.sampled_from(values))]
    if command == "run" and "--prompt" not in argv and draw(st.booleans()):
        argv += ["--prompt", "1,2", "--max-new", "1"]
    return [a for a in argv if a != "" or draw(st.booleans())]


@settings(max_examples=examples(150, 2500))
@given(data=st.data())
def test_random_command_lines(data: st.DataObject, tiny_bundle, fuzz_root: Path) -> None:
    argv = data.draw(command_lines(), label="argv")
    case = case_dir(fuzz_root, tiny_bundle)
    outputs = [value for flag, value in itertools.pairwise(argv) if flag in OUTPUT_FLAGS]
    writes_inputs = any(value.startswith("in") for value in outputs)
    with harness.unchanged(*(() if writes_inputs else (case / "in",))):
        outcome = run_cli(argv, cwd=case, usage_ok=True)
    harness.count(f"cli: {argv[0]}")
    if outcome.code == harness.USAGE:
        assert USAGE_PREFIX in outcome.err, outcome.describe()
    harness.tally("cli: exit 0", outcome.code == 0)
    shutil.rmtree(case)
    harness.case("cli: command lines")


# ------------------------------------------------------------------------------ processes

def kerncc(*argv: str, cwd: Path, stdin: bytes = b"") -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "kerncc"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "kerncc"]
    return subprocess.run([*command, *argv], cwd=cwd, input=stdin, capture_output=True,
                          timeout=120, check=False)


PROCESS_CASES = {
    "verify a broken manifest": (("verify", "in/broken.json"), 1, "in/broken.json:"),
    "verify bytes that are not UTF-8": (("verify", "in/binary.json"), 1, "in/binary.json:1:1"),
    "lower a refused pipeline": (("lower", "in/model.json", "-p", "cut,emit,cut", "-o", "out"),
                                 1, "pipeline:1:5"),
    "check a tampered bundle": (("check", "in/tampered"), 1, "plan.json"),
    "run a tampered bundle": (("run", "in/tampered", "--prompt", "1,2", "--max-new", "1"), 1,
                              "plan.json"),
    "a usage error": (("lower", "in/model.json"), 2, USAGE_PREFIX),
    "fmt a kir text": (("fmt", "in/model.kir"), 0, ""),
    "run the tiny bundle": (("run", "in/bundle", "--prompt", "1,2", "--max-new", "1"), 0, ""),
}


@pytest.mark.parametrize("name", sorted(PROCESS_CASES))
def test_real_processes(name: str, tiny_bundle, fuzz_root: Path) -> None:
    argv, code, where = PROCESS_CASES[name]
    case = case_dir(fuzz_root, tiny_bundle)
    (case / "in" / "broken.json").write_text((GOLDEN_INPUTS / "broken.json").read_text())
    (case / "in" / "binary.json").write_bytes(b"\xff\xfe{}")
    shutil.copytree(case / "in" / "bundle", case / "in" / "tampered")
    with open(case / "in" / "tampered" / "stage1" / "plan.json", "a") as plan:
        plan.write(" ")
    with harness.unchanged(case / "in"):
        done = kerncc(*argv, cwd=case)
    harness.count("cli: subprocess")
    err = done.stderr.decode()
    assert done.returncode == code, f"{argv}: exit {done.returncode}\n{err}"
    assert "Traceback" not in err and "internal error" not in err, err
    assert where in err, f"{argv}: {where!r} not in\n{err}"
    assert not (case / "out").exists()
    harness.case("cli: processes")


def test_a_reader_that_closes_the_pipe(tiny_bundle, fuzz_root: Path) -> None:
    """`kerncc fmt big.json | head -1`: the broken pipe is not an error worth a traceback."""
    case = case_dir(fuzz_root, tiny_bundle)
    script = Path(sys.executable).parent / "kerncc"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "kerncc"]
    fmt = subprocess.Popen([*command, "fmt", "in/model.json", "--to", "kir"], cwd=case,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert fmt.stdout is not None and fmt.stderr is not None
    fmt.stdout.read(10)
    fmt.stdout.close()
    err = fmt.stderr.read().decode()
    assert fmt.wait(timeout=120) in (0, 1, -13), err  # -13: SIGPIPE, as any Unix filter
    assert "Traceback" not in err and "internal error" not in err, err
    harness.count("cli: subprocess")
    harness.case("cli: processes")
