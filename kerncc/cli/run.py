"""The runtime's commands: `kerncc run` (serve a prompt) and `kerncc example` (write a model).

`kerncc run BUNDLE_OR_MANIFEST --prompt 1,2,3` loads every stage (a manifest is lowered in
process with `--pipeline`, default `emit`), prefills the prompt in chunks and decodes greedily
(kerncc.runtime.generate), or samples with `--temperature/--top-k/--top-p/--seed`
(kerncc.runtime.sampling; the seed defaults to 0, so a sampled run repeats). Progress goes to stderr; the last line, on stdout, is the generated
token ids separated by spaces, so scripts can take `tail -1`. `kerncc example qwen` writes the
example model (manifest, checkpoint, config) with kerncc.example.generate.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import attrs
import numpy as np

from kerncc import config
from kerncc.cli import placement
from kerncc.diagnostics import KernccError


def _token_ids(text: str) -> list[int]:
    parts = re.split(r"\s*,\s*|\s+", text.strip())
    if "" in parts:  # `1,,2`, `1,`: a list with a hole is a typo, not a shorter prompt
        raise argparse.ArgumentTypeError(f"expected token ids like 1,2,3, got `{text}` "
                                         "(an empty entry)")
    try:
        ids = [int(t) for t in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids like 1,2,3, got `{text}`") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative token ids, got `{text}`")
    return ids


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got `{text}`") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number of at least 1, got {value}")
    return value


def _devices(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected device ids like 0,1, got `{text}`") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected device ids like 0,1, got `{text}`")
    return ids


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# kerncc run


def cmd_run(args: argparse.Namespace) -> int:
    from kerncc.lower import open_target
    from kerncc.runtime.generate import Generator
    from kerncc.runtime.trace import Timeline

    from kerncc.cli.hf import TextRun, check_run_args

    check_run_args(args)
    started = time.perf_counter()
    bundle = open_target(args.target, args.pipeline)
    several = args.prompt is not None and len(args.prompt) > 1
    if several and getattr(args, "format", "text") == "json":
        raise KernccError.single("--format json prints one prompt's run; give one --prompt")
    text = None if several else TextRun.of(args, bundle)  # ids, eos ids, streamed text
    weights = args.weights or bundle.checkpoint
    stale = bundle.check_checkpoint(weights, given=args.weights is not None)
    if stale:
        _say(f"warning: {stale}")
    if args.devices and args.backend != "cuda":
        raise KernccError.single("--devices needs --backend cuda")
    for flag, path in (("--trace", args.trace), ("--logits", args.logits)):
        if path is not None and Path(path).is_dir():
            raise KernccError.single(f"{flag} `{path}` is a directory; give a file name")
    timeline = Timeline() if args.trace else None
    chain = placement.make(args, bundle, checkpoint=weights, interpret=args.interpret,
                           graphs=args.graphs, trace=timeline,
                           allow_nonfinite=args.allow_nonfinite)
    sampling = _sampling(args)
    loaded = time.perf_counter()
    _say(f"loaded {len(bundle.stages)} stage(s) on {chain} in {loaded - started:.2f} s "
         f"(weights: {weights or 'none'})")
    if several:  # several prompts are served together (kerncc.serve)
        from kerncc.serve.run import run_prompts

        return run_prompts(chain, args.prompt, args.max_new, args.chunk, args.logits,
                           args.trace)
    generator = Generator(chain)
    result = generator.generate(text.prompt, args.max_new, args.chunk, stop=text.stop,
                                sampling=sampling)
    text.end_stream()
    _say(f"ran {len(result.steps)} steps in {time.perf_counter() - loaded:.2f} s: "
         + ", ".join(f"{p}×{rows}" for p, rows in result.steps))
    if timeline is not None:
        _write(args.trace, "--trace", timeline.write)
        _say(f"wrote a trace of {len(timeline.spans)} spans to {args.trace} "
             "(open it in https://ui.perfetto.dev)")
    if args.logits:
        _save_logits(args.logits, result.logits)
    text.finish(result.tokens)
    return 0


def _sampling(args: argparse.Namespace):
    """The run's SamplingParams from --temperature/--top-k/--top-p/--seed (greedy default)."""
    from kerncc.runtime.sampling import SamplingParams

    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    if not params.greedy:
        _say(f"sampling: temperature {params.temperature}, top-k {params.top_k or 'off'}, "
             f"top-p {params.top_p}, seed {params.seed}")
    return params


def _number(kind: type):
    def parse(text: str):
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got `{text}`") from None
    return parse


def _write(path: str, flag: str, write) -> None:
    """Write an output file (its directory made as needed); OS failures are clean errors."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write(path)
    except OSError as err:
        raise KernccError.single(f"{flag} `{path}`: cannot write: {err.strerror or err}") from None


def _save_logits(path: str, logits: np.ndarray | None) -> None:
    if logits is None:
        raise KernccError.single("the served programs write no `logits` output to save")

    def save(target: str) -> None:
        with open(target, "wb") as out:  # np.save(name) would append .npy to other names
            np.save(out, logits)

    _write(path, "--logits", save)
    _say(f"wrote logits {list(logits.shape)} to {path}")


# ---------------------------------------------------------------------------------------------
# kerncc example


def _override_fields() -> dict[str, type]:
    """QwenConfig fields a flag may set (`--kv-heads 2`), with their types."""
    from kerncc.example.config import QwenConfig

    attrs.resolve_types(QwenConfig)
    return {f.name: f.type for f in attrs.fields(QwenConfig) if f.type in (int, float)}


def cmd_example(args: argparse.Namespace) -> int:
    from kerncc.example import generate

    overrides = {name: getattr(args, name) for name in _override_fields()
                 if getattr(args, name, None) is not None}
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise KernccError.single(f"`{out}` exists and is not a directory (-o names the "
                                 "directory to write the example into)")
    try:
        paths = generate(out, args.size, **overrides)
    except ValueError as err:
        raise KernccError.single(str(err)) from None
    except OSError as err:
        raise KernccError.single(f"cannot write the example into `{out}`: "
                                 f"{err.strerror or err}") from None
    for path in (*paths, Path(args.output) / "config.json"):
        print(path)
    return 0


# ---------------------------------------------------------------------------------------------
# registration


def register(sub: argparse._SubParsersAction) -> None:
    """Add `run` and `example` to the `kerncc` command line (called by kerncc.cli.main)."""
    p = sub.add_parser("run", help="serve prompts: chunked prefill, then decode (greedy, or "
                       "sampled with --temperature)")
    p.add_argument("target", metavar="BUNDLE_OR_MANIFEST",
                   help="a bundle directory (kerncc lower ... -p ...,emit) or a manifest file")
    p.add_argument("--backend", choices=("cpu", "cuda"), default=config.default_backend())
    p.add_argument("--prompt", type=_token_ids, required=True, action="append",
                   help="token ids, e.g. 1,2,3; several --prompt are served together, one "
                   "output line each")
    p.add_argument("--max-new", type=_positive, default=8, help="tokens to generate (default 8)")
    p.add_argument("--chunk", type=_positive, help="prefill chunk rows (default: the rows bound)")
    p.add_argument("--weights", metavar="FILE", help="safetensors checkpoint (file or "
                   "directory; default: the bundle's, or model.safetensors beside a manifest)")
    p.add_argument("--logits", metavar="OUT.npy", help="save every step's logits here")
    p.add_argument("--pipeline", default="emit",
                   help="passes lowering a manifest target (default: emit)")
    p.add_argument("--devices", type=_devices, metavar="0,1",
                   help="GPUs to spread the stages over, in order (cuda backend)")
    p.add_argument("--graphs", choices=("auto", "marked", "off"), default="auto",
                   help="CUDA graphs: for `graph` programs and repeated chunk sizes (auto, the "
                   "default), for `graph` programs only (marked), or none (off)")
    p.add_argument("--trace", metavar="FILE.json",
                   help="write a Chrome/Perfetto trace of every stage's items and transfers")
    p.add_argument("--temperature", type=_number(float), default=0.0,
                   help="sample at this temperature (default 0: greedy, the model's argmax)")
    p.add_argument("--top-k", type=_number(int), default=0,
                   help="sample among the k most likely tokens (default 0: off)")
    p.add_argument("--top-p", type=_number(float), default=1.0,
                   help="sample among the fewest tokens holding this probability (default 1: off)")
    p.add_argument("--seed", type=_number(int), default=0,
                   help="the sampling seed, 0..2**64-1 (default 0: a run repeats)")
    p.add_argument("--interpret", action="store_true",
                   help="interpret plan.json's launch records instead of running stage.py")
    placement.add_arguments(p)
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="load weights holding NaN or infinity (refused by default)")
    from kerncc.cli.main import limit_flags
    limit_flags(p)
    p.set_defaults(handler=cmd_run, format="text")

    p = sub.add_parser("example", help="write an example model (manifest and checkpoint)")
    p.add_argument("model", choices=("qwen",), help="which example")
    p.add_argument("--size", choices=("tiny", "small"), default="tiny")
    p.add_argument("-o", "--output", required=True, metavar="DIR")
    for name, kind in _override_fields().items():
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, metavar="N",
                       help=f"override `{name}`")
    p.set_defaults(handler=cmd_example, format="text")
