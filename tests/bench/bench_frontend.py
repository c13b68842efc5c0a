"""Front-end speed on a 36-layer Qwen-like model (~1200 calls over three driven programs).

Prints, measured side by side in one run, each step's time and its ratio to `json.loads` of the
same file: load (strict parse), verify, the dataflow graph, and `lower -p cut`. Targets
(issues 2-4): load+verify and the graph well under a second; `lower -p cut` under 1 s.

    python tests/bench/bench_frontend.py [--layers 36] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from kerncc.manifest import reader
from kerncc.example.qwen import generate
from kerncc.analysis import cache
from kerncc.analysis.dataflow import build_graph
from kerncc.ir import IR
from kerncc.pipeline import resolve_pipeline, run_pipeline
from kerncc.verify import verify


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path, _ = generate(tmp, "tiny", layers=args.layers)
        text = Path(path).read_text()
    man = reader.loads(text)
    calls = sum(len(p.calls) for p in man.programs.values())
    base = best_of(args.repeat, lambda: json.loads(text))
    rows = [
        ("load (strict parse)", best_of(args.repeat, lambda: reader.loads(text))),
        # verify and the analyses are cached per manifest object: time the work, not the memo.
        ("verify", best_of(args.repeat, lambda: verify.compute(man))),
        ("dataflow graph", best_of(args.repeat, lambda: build_graph(man))),
        ("lower -p cut (incl. verify of stages)",
         best_of(args.repeat, lambda: (cache.clear(), run_pipeline(
             IR.from_manifest(man), resolve_pipeline("cut"))))),
    ]
    print(f"model: {args.layers} layers, {calls} calls, {len(text) / 1e6:.2f} MB JSON")
    print(f"{'step':<40} {'ms':>9} {'x json.loads':>13}")
    print(f"{'json.loads':<40} {base * 1e3:>9.2f} {1.0:>13.1f}")
    for name, seconds in rows:
        print(f"{name:<40} {seconds * 1e3:>9.2f} {seconds / base:>13.1f}")
    total = rows[0][1] + rows[1][1]
    print(f"{'load + verify':<40} {total * 1e3:>9.2f} {total / base:>13.1f}")


if __name__ == "__main__":
    main()
