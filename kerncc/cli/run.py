"""The runtime's commands: `kerncc run` (serve a prompt) and `kerncc example` (write a model).

`kerncc run BUNDLE_OR_MANIFEST --prompt 1,2,3` loads every stage (a manifest is lowered in
process with `--pipeline`, default `emit`) and serves the prompts through the engine
(kerncc.serve.engine, as `kerncc serve` does; one prompt or several together): chunked prefill,
then greedy decoding, or sampling with `--temperature/--top-k/--top-p/--seed` (the seed
defaults to 0, so a sampled run repeats). Progress goes to stderr; the last line, on stdout,
is the generated token ids separated by spaces (a line per prompt), so scripts can take
`tail -1`. `kerncc example qwen` writes the
example model (manifest, checkpoint, config) with kerncc.example.generate.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kerncc.atomic import write_atomic
from kerncc.cli import placement
from kerncc.diagnostics import KernccError
from kerncc.cli.args import (limit_flags, no_stdin, number, open_run_target,
                             positive, prompt_conflict, token_ids)

if TYPE_CHECKING:  # numpy loads only when a command runs: `kerncc --help` stays fast
    import numpy as np


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# kerncc run


def cmd_run(args: argparse.Namespace) -> int:
    from kerncc.runtime.model_runner import FLAGS, check_request, request_limits
    from kerncc.runtime.trace import Timeline

    from kerncc.cli.hf import TextRun, check_run_args, prompt_eos

    check_run_args(args)
    several = args.prompt is not None and len(args.prompt) > 1
    say = _say if args.verbosity >= 0 else lambda message: None  # --quiet: errors only
    sampling = _check_flags(args, say)
    started = time.perf_counter()
    bundle = open_run_target(args.target, args.pipeline)
    text = None if several else TextRun.of(args, bundle)  # ids, eos ids, streamed text
    if text is not None:  # before any weight loads: a request that cannot finish is refused
        check_request(request_limits([s.manifest for s in bundle.stages]), text.prompt,
                      args.max_new, FLAGS)
    check_chunk(args.chunk, bundle)
    weights = checkpoint_for(args, bundle)
    timeline = Timeline() if args.trace else None
    chain = placement.make(args, bundle, checkpoint=weights, interpret=args.interpret,
                           graphs=args.graphs, trace=timeline,
                           allow_nonfinite=args.allow_nonfinite)
    with chain:  # closed however the run ends (called as a function, stages outlived it)
        say(f"loaded {len(bundle.stages)} stage(s) on {chain} in "
            f"{time.perf_counter() - started:.2f} s (weights: {weights or 'none'})")
        stop_ids = prompt_eos(args, bundle) if text is None else text.eos
        return _serve(args, chain, text, sampling, stop_ids, timeline, say)


def _serve(args: argparse.Namespace, chain, text, sampling, stop_ids, timeline, say) -> int:
    """Serve the prompts on the loaded `chain` through the engine: one prompt's tokens stream
    as they come (`text`: its TextRun), then the summary and files; several print a line each
    once all are done."""
    from kerncc.serve.engine import serve_prompts
    from kerncc.serve.sampling_hook import Params

    loaded = time.perf_counter()
    prompts = args.prompt if text is None else [text.prompt]
    params = Params(sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed)
    try:  # one prompt's ids or text stream as they come (TextRun); JSON prints at the end
        requests, engine = serve_prompts(
            chain, prompts, args.max_new, args.chunk, stop_ids=stop_ids, params=params,
            listener=text, runs=text is not None, logits=bool(args.logits))
    except KeyboardInterrupt:  # the streamed line ends before `interrupted` is said
        if text is not None:
            text.interrupt()
        raise
    elapsed = time.perf_counter() - loaded
    if text is None:
        calls, rows = engine.calls, engine.rows
        say(f"served {len(prompts)} prompts together in {elapsed:.2f} s: "
            + ", ".join(f"{p} {calls[p]} calls ({rows[p]} rows)" for p in sorted(calls)))
    else:
        text.end_stream()
        steps = [(program, n) for program, n, _ in requests[0].runs]
        say(f"ran {len(steps)} programs in {elapsed:.2f} s: "
            + summarise_steps(steps, verbose=args.verbosity > 0))
    if timeline is not None:
        _write(args.trace, "--trace", timeline.write)
        say(f"wrote a trace of {len(timeline.spans)} spans to {args.trace} "
            "(open it in https://ui.perfetto.dev)")
    if args.logits:
        _save_logits(args.logits, _stacked(requests[0].runs), say)
    if text is not None:
        text.finish(requests[0].generated)
    for request in requests if text is None else ():
        print(" ".join(str(t) for t in request.generated), flush=True)
    return 0


def _stacked(runs) -> np.ndarray | None:
    """The last row's logits of every run, in order (None when no program wrote them)."""
    import numpy as np

    rows = [row for _, _, row in runs if row is not None]
    return np.stack(rows) if rows else None


def _check_flags(args: argparse.Namespace, say):
    """The flags that need no bundle, checked before anything loads; the run's SamplingParams.
    (Flags that contradict each other were refused as usage errors already: `conflicts`.)"""
    for flag, path in (("--trace", args.trace), ("--logits", args.logits)):
        if path is not None:
            _check_output(flag, path)
    sampling = _sampling(args)
    if not sampling.greedy:
        say(f"sampling: temperature {sampling.temperature}, top-k {sampling.top_k or 'off'}, "
            f"top-p {sampling.top_p}, seed {sampling.seed}")
    return sampling


# Why `kerncc run -` / `kerncc serve -` is refused (kerncc.cli.args.no_stdin).
TARGET_NOT_STDIN = ("a bundle or a manifest to run: a bundle is a folder, and a manifest is "
                    "run with the checkpoint beside it; give its path")


def conflicts(args: argparse.Namespace) -> str | None:
    """The usage error of `kerncc run` flags that contradict each other or that the rest of the
    command line leaves unread (kerncc.cli.main.parse: exit 2 with run's usage, before
    anything loads), the placement flags' among them."""
    several = args.prompt is not None and len(args.prompt) > 1
    problems = [prompt_conflict(args), placement.unread(args),
                _several_conflict(args) if several else None]
    # sampling values out of range are bad input, said as such by the run (exit 1)
    if _valid_sampling(args):
        problems.append(_sampling_conflict(args, several))
    return "; ".join(p for p in problems if p) or None


def _sampling_conflict(args: argparse.Namespace, several: bool) -> str | None:
    """Sampling flags where nothing samples: several prompts are decoded greedily, and greedy
    decoding reads no top-k, top-p or seed."""
    if several and args.temperature != 0:
        return (f"--temperature {args.temperature}: several prompts are decoded greedily; "
                "give one --prompt to sample")
    if several and _sampling_flags(args):
        return (f"{_sampling_flags(args)}: several prompts are decoded greedily, which reads "
                "no sampling flag (--temperature 0); give one --prompt to sample")
    if args.temperature == 0 and _sampling_flags(args):
        return (f"{_sampling_flags(args)}: greedy decoding (--temperature 0) reads no "
                "sampling flag; give --temperature T to sample")
    return None


def _valid_sampling(args: argparse.Namespace) -> bool:
    try:
        _sampling(args)
    except KernccError:
        return False
    return True


def _sampling_flags(args: argparse.Namespace) -> str:
    """The sampling flags given besides --temperature, as the command line said them."""
    return ", ".join(f"{flag} {value}" for flag, value, off in (
        ("--top-k", args.top_k, 0), ("--top-p", args.top_p, 1.0), ("--seed", args.seed, None))
        if value != off)


def _several_conflict(args: argparse.Namespace) -> str | None:
    """The flags of one prompt's run, refused with several (their run would ignore them)."""
    if getattr(args, "format", "text") == "json":
        return "--format json prints one prompt's run; give one --prompt"
    if args.logits:
        return "--logits saves one prompt's logits; give one --prompt"
    if args.verbosity > 0:  # the engine counts calls per program, not their order
        return "--verbose lists one prompt's runs in order; give one --prompt"
    return None


def _check_output(flag: str, path: str) -> None:
    """Refuse an output file that cannot be written, before any work (it used to fail after
    the whole run): a directory, or a path through a file."""
    target = Path(path)
    if target.is_dir():
        raise KernccError.single(f"{flag} `{path}` is a directory; give a file name")
    folder = target.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise KernccError.single(f"{flag} `{path}`: cannot write: `{folder}` is not a directory")


def _sampling(args: argparse.Namespace):
    """The run's SamplingParams from --temperature/--top-k/--top-p/--seed (greedy default)."""
    from kerncc.runtime.sampling import SamplingParams

    seed = 0 if args.seed is None else args.seed  # 0 by default: a sampled run repeats
    try:
        return SamplingParams(args.temperature, args.top_k, args.top_p, seed)
    except KernccError as err:  # said once, of the flag (its pointer is a request body's)
        raise KernccError.single(_flag_error(err.headline)) from None


def _flag_error(message: str) -> str:
    """`sampling parameter `top_p` = 2.0: RULE` as the command line says it: `--top-p 2.0: RULE`."""
    found = re.fullmatch(r"sampling parameter `(\w+)` = (.*?): (.*)", message, re.S)
    if found is None:
        return message
    name, value, rule = found.groups()
    return f"--{name.replace('_', '-')} {value}: {rule}"


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


def check_chunk(chunk: int | None, bundle) -> None:
    """--chunk against the stages' rows bound, before any weight loads (the engine refuses
    it too, but only once the stages are up)."""
    if chunk is None:
        return
    from kerncc.runtime.model_runner import chain_protocol

    rows = chain_protocol([s.manifest for s in bundle.stages]).rows
    if chunk > rows.max:
        raise KernccError.single(f"--chunk {chunk} is outside [1, {rows.max}] "
                                 f"(`{rows.var}` <= {rows.max})")


def checkpoint_for(args: argparse.Namespace, bundle) -> str | None:
    """The checkpoint a run or serve loads: --weights, else the bundle's; refused when it is
    not there or when the stages bind weights and there is none, said of what the user named
    (run and serve alike); a checkpoint other than the one the bundle was built beside is a
    warning."""
    weights = args.weights or bundle.checkpoint
    if weights is not None and not Path(weights).exists():
        raise KernccError.single(f"checkpoint `{weights}` does not exist (give --weights FILE)")
    if weights is None and _binds_weights(bundle):
        raise KernccError.single(_no_checkpoint(args.target))
    stale = bundle.check_checkpoint(weights, given=args.weights is not None)
    if stale:
        _say(f"warning: {stale}")
    return weights


def _binds_weights(bundle) -> bool:
    """Whether some stage reads weights from a checkpoint (`bind`)."""
    return any(buf.bind for stage in bundle.stages for buf in stage.manifest.buffers.values())


def _no_checkpoint(target: str) -> str:
    """The missing checkpoint, said of what the user named (not of a temporary bundle)."""
    from kerncc.checkpoint.shards import CHECKPOINT_FILE, SHARD_INDEX

    if Path(target).is_dir():
        return (f"no checkpoint: the bundle `{target}` binds weights but records no checkpoint "
                "(give --weights FILE)")
    return (f"no checkpoint: `{target}` binds weights but neither `{CHECKPOINT_FILE}` nor "
            f"`{SHARD_INDEX}` lies beside it (give --weights FILE)")


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

    def save(target: str) -> None:  # np.save(name) would append .npy to other names
        write_atomic(target, lambda out: np.save(out, logits))

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


EXAMPLE_FILES = ("model.json", "model.safetensors", "config.json")


def cmd_example(args: argparse.Namespace) -> int:
    from kerncc.example import generate

    overrides = {name: getattr(args, name) for name in OVERRIDES
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

The prompt goes through the chunk program in chunks of up to --chunk rows (a row is one token
of one sequence); the last chunk hands back the first generated token (a chunk program that
hands back none: the prompt minus its last token in chunks, the last one through the one-row
program); each further token is fed back one row at a time. Generated
tokens stream to stdout as they come; the last line on stdout is all of them, space separated.
Progress and the summary go to stderr."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add `run` and `example` to the `kerncc` command line (called by kerncc.cli.main)."""
    p = sub.add_parser("run", help="serve prompts: chunked prefill, then decode (greedy, or sampled with --temperature)",
                       description=RUN_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(command_parser=p)  # usage errors print run's usage (kerncc.cli.main.parse)
    p.add_argument("target", metavar="BUNDLE_OR_MANIFEST", type=no_stdin(TARGET_NOT_STDIN),
                   help="a bundle directory (kerncc lower ... -p ...,emit) or a manifest file")
    p.add_argument("--prompt", type=token_ids, required=True, action="append",
                   help="token ids, e.g. 1,2,3; several --prompt are served together, one "
                   "output line each")
    p.add_argument("--max-new", type=positive, default=8, help="tokens to generate (default 8)")
    p.add_argument("--chunk", type=positive, help="prefill chunk rows (default: the rows bound)")
    p.add_argument("--weights", metavar="FILE", help="safetensors checkpoint (file or "
                   "directory; default: the bundle's, or model.safetensors beside a manifest)")
    p.add_argument("--logits", metavar="OUT.npy",
                   help="save the last row's logits of every run here, one row per run in "
                   "order: each prefill chunk's, then one per generated token (prompt 1,2,3 "
                   "with --max-new 4: 5 rows, the first the chunk 1,2's)")
    p.add_argument("--pipeline",
                   help="passes lowering a manifest target (default: emit)")
    p.add_argument("--graphs", choices=("auto", "marked", "off"), default="auto",
                   help="CUDA graphs: for `graph` programs and repeated chunk sizes (auto, the "
                   "default), for `graph` programs only (marked), or none (off)")
    p.add_argument("--trace", metavar="FILE.json",
                   help="write a Chrome/Perfetto trace of every stage's items and transfers")
    p.add_argument("--temperature", type=number(float), default=0.0,
                   help="sample at this temperature (default 0: greedy, the model's argmax)")
    p.add_argument("--top-k", type=number(int), default=0,
                   help="sample among the k most likely tokens (default 0: off; with "
                   "--temperature)")
    p.add_argument("--top-p", type=number(float), default=1.0,
                   help="sample among the fewest tokens holding this probability (default 1: off; "
                   "with --temperature)")
    p.add_argument("--seed", type=number(int), default=None,
                   help="the sampling seed, 0..2**64-1 (default 0: a run repeats; with "
                   "--temperature)")
    p.add_argument("--interpret", action="store_true",
                   help="interpret plan.json's launch records instead of running stage.py")
    placement.add_arguments(p)
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="load weights holding NaN or infinity (refused by default)")
    limit_flags(p)
    loud = p.add_mutually_exclusive_group()
    loud.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=-1,
                      help="print only the tokens (and errors): no progress or summary")
    loud.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=1,
                      help="the summary lists every run in order (program×rows)")
    p.set_defaults(handler=cmd_run, format="text", verbosity=0, check_usage=conflicts)

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
    for name, kind in OVERRIDES.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, metavar="N",
                       help=f"{OVERRIDE_HELP.get(name, name)} (default: the size's)")
    p.set_defaults(handler=cmd_example, format="text")
