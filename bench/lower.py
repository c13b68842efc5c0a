"""The front end and the lowering of a 36-layer Qwen-like model (~1200 calls), on the CPU.

    python -m bench.lower [--layers 36] [--repeat 5] [--profile STEP] [--cli-only]
        [--baseline DIR] [--doc docs/benchmarks.md]

It generates the example model (kerncc.example.qwen, size `tiny`, 36 layers: 3 driven programs
of 400 calls). First the front end, each step best of --repeat against `json.loads` of the same
text: load (strict parse), verify, the dataflow graph, `lower -p cut`. Then it times
parse+verify, each pass (cut, share-states, slice-once, slice-derive, plan-memory), the
symbolic check, and emit (with `check=false`: the check has its own row), each with its share
of the total, and the ratio of the total to `json.loads` of the same file. It also runs the
same pipeline through the runner (`run_pipeline`, verifying after each pass) as `kerncc lower`
does, and prints every program's arena against its lower bound. Target: total < 2 s.
`--profile PASS` prints the cProfile top functions of that step.

Then the command-line ratio of issue 14: `kerncc lower M -p default,emit` against
`kerncc verify M` of the same file, each a fresh process (imports and all), run alternately
`--repeat` times side by side; it prints the best wall time and the CPU time (user + sys,
steadier on a shared machine) of each and their ratios. Goal: lower / verify <= 2.0.
--doc docs/benchmarks.md writes the rows between the file's `lower` markers.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import pstats
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.report import Report
from kerncc import manifest as m
from kerncc.analysis import cache
from kerncc.analysis.dataflow import build_graph
from kerncc.example.qwen import generate
from kerncc.ir import IR
from kerncc.passes.cut import Cut
from kerncc.passes.emit import Emit
from kerncc.passes.plan_memory import PlanMemory
from kerncc.passes.share_states import ShareStates
from kerncc.passes.slicing import SliceDerive, SliceOnce
from kerncc.manifest import reader
from kerncc.pipeline import resolve_pipeline, run_pipeline
from kerncc.symbolic import check_stages
from kerncc.verify import verify

REPORT = Report("lower")
TARGET_S = 2.0
CLI_RATIO_GOAL = 2.0


def best_of(repeat: int, fn: Callable[[], Any]) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def frontend(layers: int, repeat: int) -> None:
    """Each front-end step's best time against `json.loads` of the same text."""
    with tempfile.TemporaryDirectory() as tmp:
        path, _ = generate(tmp, "tiny", layers=layers)
        text = Path(path).read_text()
    man = reader.loads(text)
    base = best_of(repeat, lambda: json.loads(text))
    rows = [
        ("load (strict parse)", best_of(repeat, lambda: reader.loads(text))),
        # verify and the analyses are cached per manifest object: time the work, not the memo
        ("verify", best_of(repeat, lambda: verify.compute(man))),
        ("dataflow graph", best_of(repeat, lambda: build_graph(man))),
        ("lower -p cut (incl. verify of the stages)",
         best_of(repeat, lambda: (cache.clear(), run_pipeline(
             IR.from_manifest(man), resolve_pipeline("cut"))))),
    ]
    rows.append(("load + verify", rows[0][1] + rows[1][1]))
    REPORT.row("front end", "json.loads, ms", f"{base * 1e3:.2f}")
    for name, seconds in rows:
        REPORT.row("front end", f"{name}: ms, x json.loads (best of {repeat})",
                   f"{seconds * 1e3:.2f}, {seconds / base:.1f}x")


def timed(label: str, action: Callable[[], Any], profile: str | None) -> tuple[Any, float]:
    profiler = cProfile.Profile() if profile == label else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    result = action()
    if profiler:
        profiler.disable()
    elapsed = time.perf_counter() - start
    if profiler:
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(25)
    return result, elapsed


def parse_and_verify(path: Path) -> IR:
    man = m.load(str(path))
    verify(man)
    return IR.from_manifest(man, source=str(path))


def steps(out: Path) -> list[tuple[str, Callable[[IR], IR]]]:
    def check(ir: IR) -> IR:
        check_stages(ir.whole, list(ir.stages))
        return ir

    passes = [Cut(stages=2), ShareStates(), SliceOnce(), SliceDerive(), PlanMemory()]
    out_steps: list[tuple[str, Callable[[IR], IR]]] = [(p.name, p.run) for p in passes]
    out_steps.append(("check", check))
    out_steps.append(("emit", Emit(out=str(out / "bundle"), check=False).run))
    return out_steps


def run(layers: int, profile: str | None) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        path, _ = generate(tmp, "tiny", layers=layers)
        text = path.read_text()
        _, json_s = timed("json", lambda: json.loads(text), None)
        ir, parse_s = timed("parse+verify", lambda: parse_and_verify(path), profile)
        calls = sum(len(p.calls) for p in ir.whole.programs.values())
        rows = [("parse+verify", parse_s)]
        for name, step in steps(Path(tmp)):
            ir, seconds = timed(name, functools.partial(step, ir), profile)
            rows.append((name, seconds))
        total = sum(s for _, s in rows)
        print(f"{layers} layers, {calls} calls, {len(text) / 1e6:.2f} MB of JSON")
        for name, seconds in rows + [("total", total)]:
            REPORT.row("passes", f"{name}: ms, share", f"{seconds * 1e3:.1f}, "
                       f"{100 * seconds / total:.0f}%")
        REPORT.row("passes", "total / json.loads", f"{total / json_s:.1f}x")
        print_arenas(ir)
        runner_s = run_runner(path, Path(tmp) / "runner")
        REPORT.row("passes", "run_pipeline `cut,share-states,slice-once,slice-derive,emit`, "
                   "verifying after each pass (as `kerncc lower`): ms", f"{runner_s * 1e3:.1f}")
        status = "ok" if total < TARGET_S else "OVER TARGET"
        print(f"target: total < {TARGET_S:.1f} s: {status}")
        return total


def print_arenas(ir: IR) -> None:
    report = ir.reports["plan-memory"]
    print(f"arenas (worst ratio to the lower bound: {report.worst_ratio():.3f}):")
    for s, stage in enumerate(report.stages):
        for name, arena in sorted(stage.programs.items()):
            lay = arena.layout
            if lay.total:
                print(f"  stage {s} {name:<13} {lay.total:>9} B  bound {lay.lower_bound:>9} B  "
                      f"{arena.ratio:.3f}x  naive {lay.naive:>9} B")


def run_runner(path: Path, out: Path) -> float:
    ir = parse_and_verify(path)
    spec = f'cut,share-states,slice-once,slice-derive,emit{{out="{out}"}}'
    start = time.perf_counter()
    run_pipeline(ir, spec)
    return time.perf_counter() - start


def _child_run(argv: list[str], path: str | None = None) -> tuple[float, float]:
    """One fresh `python -m kerncc ...` process: (wall seconds, CPU seconds user + sys).

    `path` goes first on PYTHONPATH: a directory whose `kerncc` is another checkout's.
    """
    # As installed: bytecode cached (an environment with PYTHONDONTWRITEBYTECODE would make
    # every run compile its imports, charging the command that imports more twice).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if path:
        env["PYTHONPATH"] = path
    start = time.perf_counter()
    # Run from the model's folder: `-m` puts the working directory first on sys.path, and a
    # checkout's own `kerncc/` there would shadow `path`.
    child = subprocess.Popen([sys.executable, "-m", "kerncc", *argv], env=env,
                             cwd=os.path.dirname(argv[1]), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    # Reaped with wait4, not subprocess's wait(timeout), which polls at up to 50 ms intervals
    # and so added up to 50 ms to a wall time; the timer is the timeout.
    killer = threading.Timer(600, child.kill)
    killer.start()
    try:
        _, status, usage = os.wait4(child.pid, 0)
    finally:
        killer.cancel()
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise subprocess.CalledProcessError(child.returncode, child.args)
    return wall, usage.ru_utime + usage.ru_stime


def cli_ratio(layers: int, repeat: int, baseline: str | None = None) -> float:
    """Best-of-`repeat` `kerncc lower -p default,emit` over `kerncc verify`, side by side
    (and the same pair for a `baseline` checkout, interleaved, when given)."""
    with tempfile.TemporaryDirectory() as tmp:
        path, _ = generate(tmp, "tiny", layers=layers)
        runs = _pairs(str(path), tmp, repeat, [None, baseline] if baseline else [None])
    if baseline:
        base = runs.pop("baseline")
        (vw, vc), (lw, lc) = (_best(base["verify"]), _best(base["lower"]))
        print(f"baseline ({baseline}): verify wall {vw * 1e3:.0f} ms, CPU {vc * 1e3:.0f} ms; "
              f"lower wall {lw * 1e3:.0f} ms, CPU {lc * 1e3:.0f} ms: {lw / vw:.2f}x wall, "
              f"{lc / vc:.2f}x CPU")
    return _report(runs["this"], layers, repeat)


def _pairs(model: str, tmp: str, repeat: int, paths: list[str | None]) -> dict[str, dict]:
    runs = {"baseline" if p else "this": {"verify": [], "lower": []} for p in paths}
    for p in paths:  # warm the bytecode caches
        _child_run(["lower", model, "-p", "default,emit", "-o", os.path.join(tmp, "warm")], p)
    for i in range(repeat):
        for p in paths:
            which = runs["baseline" if p else "this"]
            which["verify"].append(_child_run(["verify", model], p))
            out = os.path.join(tmp, f"out{i}{'b' if p else ''}")
            which["lower"].append(_child_run(["lower", model, "-p", "default,emit", "-o", out],
                                             p))
    return runs


def _best(runs: list[tuple[float, float]]) -> tuple[float, float]:
    """The least wall time and the least CPU time of a command's runs."""
    return min(w for w, _ in runs), min(c for _, c in runs)


def _report(runs: dict[str, list[tuple[float, float]]], layers: int, repeat: int) -> float:
    best = {name: _best(r) for name, r in runs.items()}
    wall = best["lower"][0] / best["verify"][0]
    cpu = best["lower"][1] / best["verify"][1]
    print(f"kerncc verify M{layers}: best wall {best['verify'][0] * 1e3:.0f} ms, "
          f"CPU {best['verify'][1] * 1e3:.0f} ms (of {repeat})")
    print(f"kerncc lower M{layers} -p default,emit: best wall {best['lower'][0] * 1e3:.0f} ms, "
          f"CPU {best['lower'][1] * 1e3:.0f} ms (of {repeat})")
    status = "ok" if cpu <= CLI_RATIO_GOAL else "OVER GOAL"
    print(f"lower / verify: {wall:.2f}x wall, {cpu:.2f}x CPU (goal <= {CLI_RATIO_GOAL:.1f}x): "
          f"{status}")
    REPORT.row("command line", f"`kerncc verify` / `kerncc lower -p default,emit`: best CPU ms "
               f"(of {repeat})", f"{best['verify'][1] * 1e3:.0f} / {best['lower'][1] * 1e3:.0f}")
    REPORT.row("command line", "lower / verify: wall, CPU (goal <= 2.0x)",
               f"{wall:.2f}x, {cpu:.2f}x")
    return cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lower",
                                     description=__doc__.splitlines()[0])
    REPORT.add_options(parser)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--profile", metavar="STEP", help="cProfile one step (e.g. emit)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each command (best of)")
    parser.add_argument("--cli-only", action="store_true", help="only the command-line ratio")
    parser.add_argument("--baseline", metavar="DIR",
                        help="also time the kerncc package under DIR (put first on PYTHONPATH)")
    args = parser.parse_args(argv)
    if not args.cli_only:
        frontend(args.layers, args.repeat)
    total = 0.0 if args.cli_only else run(args.layers, args.profile)
    ratio = cli_ratio(args.layers, args.repeat, args.baseline)
    import platform

    status = REPORT.finish(args, f"{platform.processor() or platform.machine()}, "
                           f"{os.cpu_count()} cores, Python {platform.python_version()}", argv)
    return status or (0 if total < TARGET_S and ratio <= CLI_RATIO_GOAL else 1)


if __name__ == "__main__":
    raise SystemExit(main())
