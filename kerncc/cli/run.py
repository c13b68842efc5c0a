"""The runtime's commands: `kerncc run` (serve a prompt) and `kerncc example` (write a model).

`kerncc run BUNDLE_OR_MANIFEST --prompt 1,2,3` loads every stage (a manifest is lowered in
process with `--pipeline`, default `emit`), prefills the prompt in chunks and decodes greedily
(kerncc.runtime.generate). Progress goes to stderr; the last line, on stdout, is the generated
token ids separated by spaces, so scripts can take `tail -1`. `kerncc example qwen` writes the
example model (manifest, checkpoint, config) with kerncc.example.generate.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kerncc import config
from kerncc.diagnostics import KernccError

if TYPE_CHECKING:  # numpy loads only when a command runs: `kerncc --help` stays fast
    import numpy as np


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", ",").split(",") if t]
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
    from kerncc.runtime import Chain
    from kerncc.runtime.generate import Generator, check_request, request_limits
    from kerncc.runtime.trace import Timeline

    started = time.perf_counter()
    bundle = open_target(args.target, args.pipeline)
    # Before any weight loads: a request that cannot finish is refused at once.
    check_request(request_limits([s.manifest for s in bundle.stages]), args.prompt,
                  args.max_new, max_new_name="--max-new", prompt_name="--prompt")
    weights = args.weights or bundle.checkpoint
    if weights is not None and not Path(weights).exists():
        raise KernccError.single(f"checkpoint `{weights}` does not exist (give --weights FILE)")
    if weights is None and _binds_weights(bundle):
        raise KernccError.single(_no_checkpoint(args.target))
    if args.devices and args.backend != "cuda":
        raise KernccError.single("--devices needs --backend cuda")
    for flag, path in (("--trace", args.trace), ("--logits", args.logits)):
        if path is not None and Path(path).is_dir():
            raise KernccError.single(f"{flag} `{path}` is a directory; give a file name")
    timeline = Timeline() if args.trace else None
    chain = Chain(bundle, backend=args.backend, checkpoint=weights, interpret=args.interpret,
                  devices=args.devices, graphs=args.graphs, trace=timeline)
    generator = Generator(chain)
    loaded = time.perf_counter()
    say = _say if args.verbosity >= 0 else _silent
    say(f"loaded {len(bundle.stages)} stage(s) on {chain} in {loaded - started:.2f} s "
        f"(weights: {weights or 'none'})")
    stream = TokenStream(sys.stdout)
    result = generator.generate(args.prompt, args.max_new, args.chunk, on_token=stream)
    stream.end()
    say(f"ran {len(result.steps)} programs in {time.perf_counter() - loaded:.2f} s: "
        + summarise_steps(result.steps, verbose=args.verbosity > 0))
    if timeline is not None:
        _write(args.trace, "--trace", timeline.write)
        say(f"wrote a trace of {len(timeline.spans)} spans to {args.trace} "
             "(open it in https://ui.perfetto.dev)")
    if args.logits:
        _save_logits(args.logits, result.logits, say)
    return 0


class TokenStream:
    """Prints each token as it comes, on one line: when it ends, that line holds every
    generated token space separated (what `tail -1` of `kerncc run` has always given)."""

    def __init__(self, out) -> None:
        self.out = out
        self.count = 0

    def __call__(self, token: int) -> None:
        self.out.write(("" if self.count == 0 else " ") + str(token))
        self.out.flush()
        self.count += 1

    def end(self) -> None:
        self.out.write("\n")
        self.out.flush()


def summarise_steps(steps: list[tuple[str, int]], verbose: bool = False) -> str:
    """Runs per program and the rows they took (a row: one token of one sequence), e.g.
    `prefill 1 run of 2 rows, decode 254 runs of 1 row`; verbose adds every run in order."""
    runs: dict[str, list[int]] = {}
    for program, rows in steps:
        runs.setdefault(program, []).append(rows)
    parts = [_program_runs(program, rows) for program, rows in runs.items()]
    text = ", ".join(parts)
    if verbose:
        text += "\n  in order (program×rows): " + " ".join(f"{p}×{r}" for p, r in steps)
    return text


def _program_runs(program: str, rows: list[int]) -> str:
    def plural(n: int, word: str) -> str:
        return f"{n} {word}" + ("" if n == 1 else "s")

    if len(set(rows)) == 1:
        return f"{program} {plural(len(rows), 'run')} of {plural(rows[0], 'row')}"
    return (f"{program} {plural(len(rows), 'run')}, {plural(sum(rows), 'row')} "
            f"({min(rows)}..{max(rows)} a run)")


def _silent(message: str) -> None:
    """`--quiet`: no progress lines (errors still print)."""


def _binds_weights(bundle) -> bool:
    """Whether some stage reads weights from a checkpoint (`bind`)."""
    return any(buf.bind for stage in bundle.stages for buf in stage.manifest.buffers.values())


def _no_checkpoint(target: str) -> str:
    """The missing checkpoint, said of what the user named (not of a temporary bundle)."""
    from kerncc.runtime.bundle import WEIGHTS_BESIDE_MANIFEST

    if Path(target).is_dir():
        return (f"no checkpoint: the bundle `{target}` binds weights but records no checkpoint "
                "(give --weights FILE)")
    return (f"no checkpoint: `{target}` binds weights but no `{WEIGHTS_BESIDE_MANIFEST}` lies "
            "beside it (give --weights FILE)")


def _write(path: str, flag: str, write) -> None:
    """Write an output file (its directory made as needed); OS failures are clean errors."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write(path)
    except OSError as err:
        raise KernccError.single(f"{flag} `{path}`: cannot write: {err.strerror or err}") from None


def _save_logits(path: str, logits: np.ndarray | None, say=_say) -> None:
    import numpy as np

    if logits is None:
        raise KernccError.single("the served programs write no `logits` output to save")

    def save(target: str) -> None:
        with open(target, "wb") as out:  # np.save(name) would append .npy to other names
            np.save(out, logits)

    _write(path, "--logits", save)
    say(f"wrote logits {list(logits.shape)} to {path}")


# ---------------------------------------------------------------------------------------------
# kerncc example


OVERRIDES: dict[str, type] = {
    "layers": int, "hidden": int, "heads": int, "kv_heads": int, "head_dim": int,
    "intermediate": int, "vocab": int, "max_tokens": int, "max_seqs": int, "max_context": int,
    "seed": int, "rope_theta": float, "eps": float, "interleave": int}
"""QwenConfig's number fields, spelled out so that building the flags imports no numpy (a test
holds them equal to the class's)."""

OVERRIDE_HELP = {
    "layers": "decoder layers", "hidden": "hidden size", "heads": "attention heads",
    "kv_heads": "key/value heads", "head_dim": "dimension of one head",
    "intermediate": "MLP intermediate size", "vocab": "vocabulary size",
    "max_tokens": "most rows one call takes (var `tokens`)",
    "max_seqs": "most sequences one call takes (var `seqs`)",
    "max_context": "longest sequence, in tokens", "seed": "seed of the random weights",
    "rope_theta": "RoPE base", "eps": "RMSNorm epsilon",
    "interleave": "gate/up interleave block rows (0: min(128, intermediate))"}


def _override_fields() -> dict[str, type]:
    """QwenConfig fields a flag may set (`--kv-heads 2`), with their types."""
    return OVERRIDES


def config_number_fields() -> dict[str, type]:
    """The number fields QwenConfig declares (what OVERRIDES must equal)."""
    import attrs

    from kerncc.example.config import QwenConfig

    attrs.resolve_types(QwenConfig)
    return {f.name: f.type for f in attrs.fields(QwenConfig) if f.type in (int, float)}


EXAMPLE_FILES = ("model.json", "model.safetensors", "config.json")


def cmd_example(args: argparse.Namespace) -> int:
    from kerncc.example import generate

    overrides = {name: getattr(args, name) for name in _override_fields()
                 if getattr(args, name, None) is not None}
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise KernccError.single(f"`{out}` exists and is not a directory (-o names the "
                                 "directory to write the example into)")
    held = [name for name in EXAMPLE_FILES if (out / name).exists()]
    if held and not args.force:
        raise KernccError.single(f"`{out}` already holds a model ({', '.join(held)}); give "
                                 "--force to overwrite it, or another -o")
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


RUN_DESCRIPTION = """Serve a prompt: chunked prefill, then greedy decode.

The prompt minus its last token goes through the chunk program in chunks of up to --chunk rows
(a row is one token of one sequence); the last token goes through the one-row program, whose
token is the first generated; each further token is fed back one row at a time. Generated
tokens stream to stdout as they come; the last line on stdout is all of them, space separated.
Progress and the summary go to stderr."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add `run` and `example` to the `kerncc` command line (called by kerncc.cli)."""
    p = sub.add_parser("run", help="serve a prompt: chunked prefill, then greedy decode",
                       description=RUN_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(command_parser=p)  # usage errors print run's usage (kerncc.cli.main.parse)
    p.add_argument("target", metavar="BUNDLE_OR_MANIFEST",
                   help="a bundle directory (kerncc lower ... -p ...,emit) or a manifest file")
    p.add_argument("--backend", choices=("cpu", "cuda"), default=config.default_backend(),
                   help="where the kernels run (default: $KERNCC_BACKEND, else cpu; now "
                   f"{config.default_backend()})")
    p.add_argument("--prompt", type=_token_ids, required=True, help="token ids, e.g. 1,2,3")
    p.add_argument("--max-new", type=_positive, default=8, help="tokens to generate (default 8)")
    p.add_argument("--chunk", type=_positive, help="prefill chunk rows (default: the rows bound)")
    p.add_argument("--weights", metavar="FILE", help="safetensors checkpoint (file or "
                   "directory; default: the bundle's, or model.safetensors beside a manifest)")
    p.add_argument("--logits", metavar="OUT.npy",
                   help="save the last row's logits of every run here, one row per run in "
                   "order: each prefill chunk's, then one per generated token (prompt 1,2,3 "
                   "with --max-new 4: 5 rows, the first the chunk 1,2's)")
    p.add_argument("--pipeline", default="emit",
                   help="passes lowering a manifest target (default: emit)")
    p.add_argument("--devices", type=_devices, metavar="0,1",
                   help="GPUs to spread the stages over, in order (cuda backend)")
    p.add_argument("--graphs", choices=("auto", "marked", "off"), default="auto",
                   help="CUDA graphs: for `graph` programs and repeated chunk sizes (auto, the "
                   "default), for `graph` programs only (marked), or none (off)")
    p.add_argument("--trace", metavar="FILE.json",
                   help="write a Chrome/Perfetto trace of every stage's items and transfers")
    p.add_argument("--interpret", action="store_true",
                   help="interpret plan.json's launch records instead of running stage.py")
    loud = p.add_mutually_exclusive_group()
    loud.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=-1,
                      help="print only the tokens (and errors): no progress or summary")
    loud.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=1,
                      help="the summary lists every run in order (program×rows)")
    p.set_defaults(handler=cmd_run, format="text", verbosity=0)

    p = sub.add_parser("example", help="write an example model (manifest and checkpoint)")
    p.set_defaults(command_parser=p)
    p.add_argument("model", choices=("qwen",), help="which example (a Qwen3-style decoder)")
    p.add_argument("--size", choices=("tiny", "small"), default="tiny",
                   help="tiny: 2 layers, 256-token vocab, runs on CPU in seconds (the default); "
                   "small: Qwen3-1.7B-like shapes, a 2.7 GB checkpoint, for GPUs")
    p.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="the directory to write model.json, model.safetensors, config.json into")
    p.add_argument("--force", action="store_true",
                   help="overwrite a model already in the directory")
    for name, kind in _override_fields().items():
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, metavar="N",
                       help=f"{OVERRIDE_HELP.get(name, name)} (default: the size's)")
    p.set_defaults(handler=cmd_example, format="text")
