"""The `kerncc` command line: verify, fmt, dump, lower, check, report, passes (and run, example).

Exit codes: 0 success, 1 the input is wrong (every problem printed, one per line, located),
2 usage errors (argparse). A `KernccError` never shows a traceback; anything else is a bug in
kerncc and says so, with the traceback only under KERNCC_DEBUG=1 (kerncc/config.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path
from typing import Callable, TextIO

from kerncc import config
from kerncc.diagnostics import KernccError, placed
from kerncc.cli.args import limit_flags, no_stdin


EXIT_CODES = """exit status:
  0  success
  1  the input is wrong: every problem printed, one per line, located (file:line:col)
  2  usage error: an unknown flag, a missing argument, flags that contradict each other
     (the command's usage is printed)
  3  a bug in kerncc (KERNCC_DEBUG=1 shows the traceback)
141  standard output was closed before all was written (a reader such as `head` stopped
     reading): kerncc stops quietly, as a program the pipe's SIGPIPE stopped would"""

# What a command's help says of `-`: only commands that read a manifest from it.
STDIN_NOTE = "`-` in place of a FILE reads standard input."
# A process that SIGPIPE stopped exits 128 + 13 in a shell; kerncc (which Python keeps from
# that signal) says the same, so `set -o pipefail` sees the output was cut short.
OUTPUT_CLOSED = 141


# Objects the cyclic collector's youngest generation takes before a collection (CPython: 700).
# A command builds a manifest and its analyses, hundreds of thousands of small objects that
# live until it ends and hold almost no cycles (lowering the 36-layer example leaves ~4000
# cyclic objects in all); at 700 the collector walked them again and again, ~10% of a
# lowering. Reference counting still frees everything acyclic at once. `serve` keeps
# CPython's default: a long-lived server trades throughput for short pauses.
GC_YOUNG_THRESHOLD = 50_000
LONG_LIVED_COMMANDS = frozenset({"serve"})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, argv)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return 2
    _apply_limits(args)
    before = gc.get_threshold()
    if args.command not in LONG_LIVED_COMMANDS:
        gc.set_threshold(GC_YOUNG_THRESHOLD)
    try:
        code = _dispatch(args, argv)
        sys.stdout.flush()  # a closed pipe is told here, not by the interpreter at exit
        return code
    except BrokenPipeError:
        return _output_closed()
    finally:
        gc.unfreeze()  # as it was: main() may run inside another program
        gc.set_threshold(*before)


def _dispatch(args: argparse.Namespace, argv: list[str] | None) -> int:
    try:
        return args.handler(args) or 0
    except KernccError as err:
        report(err, getattr(args, "diag_format", "text"), sys.stderr,
               getattr(args, "max_errors", None))
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        raise  # main's: the output's reader left
    except Exception as err:  # noqa: BLE001 - the last line of defence: a bug, said plainly
        return internal_error(err, argv)


def _output_closed() -> int:
    """Standard output's reader left (`| head -1`): exit OUTPUT_CLOSED with no word more.
    Standard output is pointed at /dev/null first, or the interpreter's last flush would
    print its own BrokenPipeError."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor (main() run inside another program)
        pass
    return OUTPUT_CLOSED


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse `argv`; an unknown flag is reported by the command it was given to, with that
    command's usage (argparse alone reports it with the top level's)."""
    args, extra = parser.parse_known_args(argv)
    owner = getattr(args, "command_parser", None) or parser
    if extra:
        owner.error(f"unrecognized arguments: {' '.join(extra)}")
    # Flags that parse but that the rest of the command line leaves unread (a command's
    # `check_usage`): told now, as argparse tells a conflict, before anything loads.
    check = getattr(args, "check_usage", None)
    problem = check(args) if check is not None else None
    if problem:
        owner.error(problem)
    return args


def _apply_limits(args: argparse.Namespace) -> None:
    """`--max-file-size` bounds every file this command reads (kerncc.files)."""
    from kerncc.bundle.format import MAX_FILE_SIZE
    from kerncc.files import set_max_file_size

    set_max_file_size(getattr(args, "max_file_size", None) or MAX_FILE_SIZE)


def internal_error(err: Exception, argv: list[str] | None) -> int:
    if config.debug():
        raise err
    command = " ".join(["kerncc", *(argv if argv is not None else sys.argv[1:])])
    print(f"kerncc: internal error: {type(err).__name__}: {err}\n"
          f"  this is a bug in kerncc; please report it with the input and this command:\n"
          f"  {command}\n  (KERNCC_DEBUG=1 shows the traceback)", file=sys.stderr)
    return 3


def report(err: KernccError, fmt: str, out: TextIO, max_errors: int | None = None) -> None:
    if fmt == "json":
        print(json.dumps({"error": err.headline,
                          "diagnostics": [d.to_json() for d in err.diagnostics]}, indent=2),
              file=out)
        return
    from kerncc.diagnostics import render_error
    print(render_error(err, max_errors=max_errors), file=out)


# ------------------------------------------------------------------------- commands


def cmd_verify(args: argparse.Namespace) -> int:
    """Verify every file; text: the summary on stdout, errors on stderr. JSON: one document
    on stdout, `{"ok": ..., "files": [...]}`, whatever happened."""
    results = [_verify_one(path, args.unsampled, args.diag_format, args.max_errors)
               for path in args.files]
    if args.diag_format == "json":
        print(json.dumps({"ok": all(r["ok"] for r in results), "files": results}, indent=2))
    return 0 if all(r["ok"] for r in results) else 1


def _verify_one(path: str, unsampled: bool, fmt: str, max_errors: int | None = None) -> dict:
    """One file's result as JSON; in text form it is printed here."""
    from kerncc import protocol

    try:
        verified, found = _verify_file(path, unsampled)
    except KernccError as err:
        if fmt != "json":
            from kerncc.diagnostics import render_error
            print(render_error(err, default_file=path, max_errors=max_errors),
                  file=sys.stderr)
        return {"file": path, "ok": False, "error": err.headline,
                "diagnostics": [d.to_json() for d in err.diagnostics]}
    man = verified.manifest
    if fmt != "json":
        print(f"{path}: `{man.model}` schema v{man.schema_version}, verified", file=sys.stderr)
        for line in protocol.summary_lines(found) if found is not None else ():
            print(line)
    return {"file": path, "ok": True, "model": man.model, "schema_version": man.schema_version,
            "protocol": protocol.summary_json(found) if found is not None else None}


def _load(path: str) -> tuple:
    """The input manifest and its locator (kerncc.source), frozen out of the cyclic collector.

    A loaded manifest is a frozen tree that lives until the command ends; without gc.freeze
    every older-generation collection of the work that follows (a lowering's analyses) walked
    all of it again. main() unfreezes when the command ends.
    """
    from kerncc.source import load_with_locator

    loaded = load_with_locator(path)
    gc.freeze()
    return loaded


def _verify_file(path: str, unsampled: bool):
    """The verified manifest and its serving protocol (None without a driven program); every
    error at its line:col."""
    from kerncc.verify import verify

    manifest, locate = _load(path)
    with placed(locate):
        verified = verify(manifest)
        return verified, _protocol_of(verified, unsampled)


def _protocol_of(verified, unsampled: bool):
    from kerncc import protocol

    if not verified.manifest.driven_programs():
        return None
    check = protocol.check_unsampled if unsampled else protocol.check
    return check(verified)


def cmd_fmt(args: argparse.Namespace) -> int:
    from kerncc import source
    from kerncc.manifest.reader import STDIN, read_text

    if args.in_place and (args.file == STDIN or args.to or args.check):
        raise KernccError.single("-i rewrites a file in its own form: not with `-`, --to or "
                                 "--check")
    current = read_text(args.file)
    kir_text = source.is_kir(args.file) or (args.file == STDIN and
                                            not source.looks_like_json(current))
    name = source.STDIN_NAME if args.file == STDIN else args.file
    man, _ = source.loads_with_locator(current, name, kir_text)
    text = _to_text(man, args.to or ("kir" if kir_text else "json"))
    if args.check:
        if current != text:
            print(f"{name}: not in canonical form", file=sys.stderr)
            return 1
        return 0
    if args.in_place:
        return _rewrite(args.file, current, text)
    sys.stdout.write(text)
    return 0


def _rewrite(path: str, current: str, text: str) -> int:
    """`fmt -i`: replace the file at once (a renamed sibling), only when it changes."""
    from kerncc.atomic import write_text_atomic

    if current != text:
        try:
            write_text_atomic(path, text)
        except OSError as err:
            raise KernccError.single(f"cannot rewrite `{path}`: {err.strerror or err}") from None
        print(f"{path}: rewritten in canonical form", file=sys.stderr)
    return 0


def _to_text(man, fmt: str) -> str:
    from kerncc import kir
    from kerncc.manifest import writer

    return kir.dumps(man) if fmt == "kir" else writer.dumps(man)


def cmd_dump(args: argparse.Namespace) -> int:
    ir = _lower(args, args.pipeline, upto=args.pass_name)
    report = ir.reports.get(args.pass_name) if args.pass_name else None
    if report is not None and hasattr(report, "to_text") and args.format in ("kir", "json"):
        return _print_report(args.pass_name, report, args.format, args.program)
    if args.format in ("dot", "svg"):
        from kerncc.dot import render_dot, render_svg
        source = render_dot(ir, args.program)
        sys.stdout.write(source if args.format == "dot" else render_svg(source))
        return 0
    if args.program is not None:
        raise KernccError.single("--program picks the program to draw (--format dot or svg) "
                                 "or of an analysis report (--pass liveness)")
    if args.format == "json":
        sys.stdout.write(_stages_json(ir.stages))
    else:
        sys.stdout.write(ir.to_text())
    return 0


def _stages_json(stages) -> str:
    """One JSON document: the manifest, or after a cut the array of stage manifests."""
    from kerncc.manifest import writer

    texts = [writer.dumps(s).rstrip("\n") for s in stages]
    if len(texts) == 1:
        return texts[0] + "\n"
    return "[\n" + ",\n".join(texts) + "\n]\n"


def _print_report(name: str, report, fmt: str, program: str | None) -> int:
    """An analysis pass's report: text, or one JSON document; of one program if asked."""
    import inspect

    render = report.to_json if fmt == "json" else report.to_text
    if fmt == "json" and not hasattr(report, "to_json"):
        raise KernccError.single(f"the `{name}` report has no JSON form (use --format kir)")
    kwargs = {}
    if program is not None:
        if "program" not in inspect.signature(render).parameters:
            raise KernccError.single(f"the `{name}` report is not per program: "
                                     "--program does not apply")
        kwargs["program"] = program
    result = render(**kwargs)
    sys.stdout.write(json.dumps(result, indent=2) + "\n" if fmt == "json" else result + "\n")
    return 0


def cmd_lower(args: argparse.Namespace) -> int:
    from kerncc.manifest import writer
    from kerncc.atomic import atomic_directory

    ir = _lower(args, args.pipeline, out=args.output)
    if args.output and "emit" not in ir.history:
        try:
            with atomic_directory(args.output) as tmp:
                for index, stage in enumerate(ir.stages):
                    (tmp / f"stage{index}.json").write_text(writer.dumps(stage),
                                                            encoding="utf-8")
        except OSError as err:
            raise KernccError.elsewhere(f"cannot write the stages to `{args.output}`: "
                                        f"{err.strerror or err}") from None
        print(f"wrote {len(ir.stages)} stage manifests to {args.output}", file=sys.stderr)
    elif not args.output:
        sys.stdout.write(_stages_json(ir.stages) if args.diag_format == "json" else ir.to_text())
    return 0


def _lower(args: argparse.Namespace, spec: str | None, upto: str | None = None,
           out: str | None = None):
    """Load, verify, run the pipeline (`spec`, then up to the pass `upto`); the final IR."""
    from kerncc.ir import IR
    from kerncc.lower import run_lowering, with_output
    from kerncc.pipeline import instruments_from_args, resolve_pipeline

    manifest, locate = _load(args.file)
    ir = _verified(IR.from_manifest(manifest, source=args.file), locate)
    text = ",".join(t for t in (spec, upto) if t and not (t == upto and spec and upto in spec))
    if not text:
        return ir
    passes = resolve_pipeline(text)
    if args.file == "-" and any(p.name == "emit" for p in passes):
        raise KernccError.elsewhere("a bundle records its input manifest's file, and `-` "
                                    "(standard input) is none: save it to a file to emit it")
    instruments = instruments_from_args(
        getattr(args, "print_ir_after", None), getattr(args, "print_ir_after_all", False),
        getattr(args, "print_ir_after_change", False), getattr(args, "time_passes", False),
        getattr(args, "dump_dir", None), sys.stderr)
    with placed(locate):
        return run_lowering(ir, with_output(passes, out) if out else passes, instruments,
                            verify=not getattr(args, "no_verify", False), input_name=args.file)


def _verified(ir, locate: Callable):
    """Verify the input once before any pass: a pipeline only takes a valid manifest."""
    from kerncc.verify import verify

    with placed(locate):
        verify(ir.whole)
    return ir


def cmd_passes(args: argparse.Namespace) -> int:
    from kerncc.pipeline.docgen import pass_reference_markdown
    from kerncc.pipeline import describe_passes

    sys.stdout.write(pass_reference_markdown() if args.markdown else describe_passes())
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from kerncc import source
    from kerncc.source import load_with_locator
    from kerncc.symbolic import check_stages

    paths = args.files
    if len(paths) in (1, 2) and Path(paths[-1]).is_dir():  # BUNDLE, or WHOLE BUNDLE
        from kerncc.bundle.check import check_bundle
        proof = check_bundle(paths[-1], whole=paths[0] if len(paths) == 2 else None)
    else:
        missing = [p for p in paths if p != "-" and not Path(p).exists()]
        if missing:
            raise KernccError.single(f"`{missing[0]}` does not exist (check takes a bundle "
                                     "directory, WHOLE BUNDLE, or WHOLE STAGE0 STAGE1 ...)")
        if len(paths) < 3:
            raise KernccError.single("check takes a bundle directory, WHOLE BUNDLE, or WHOLE "
                                     "STAGE0 STAGE1 ...")
        whole, locate = load_with_locator(paths[0])
        stages = [source.load(p) for p in paths[1:]]
        with placed(locate):  # its pointers are the whole manifest's calls
            proof = check_stages(whole, stages)
    if args.diag_format == "json":
        print(json.dumps({"ok": True, "programs": len(proof.programs), "outputs": proof.outputs,
                          "carries": proof.carries, "regions": proof.regions}, indent=2))
        return 0
    print(f"proved: {len(proof.programs)} driven programs, {proof.outputs} outputs, "
          f"{proof.carries} carries, {proof.regions} state regions equal the whole's")
    return 0


def _check_paths(args: argparse.Namespace) -> str | None:
    """`-` in `kerncc check`: one manifest, the WHOLE of WHOLE STAGE0 STAGE1 ... or a stage;
    never a bundle (a folder), nor WHOLE against a bundle (read from its file, whose sha256
    the bundle recorded)."""
    paths = args.files
    if paths.count("-") > 1:
        return "`-` (standard input) can stand for one manifest only"
    if "-" not in paths or len(paths) > 2:
        return None
    if paths[-1] == "-":
        return "`-` (standard input) cannot be a bundle: a bundle is a folder"
    return ("`-` (standard input) cannot be WHOLE against a bundle: the bundle recorded its "
            "input's sha256, read from the file; give its path")


def cmd_report(args: argparse.Namespace) -> int:
    from kerncc.bundle.report import read_report

    report = read_report(args.bundle)
    if args.diag_format == "json":
        print(json.dumps(report.to_json(), indent=2))
        return 0
    sys.stdout.write(report.to_text())
    return 0


# ------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    from kerncc import __version__

    parser = argparse.ArgumentParser(
        prog="kerncc", description="Compile kern GPU-kernel manifests (schema v5).",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-V", "--version", action="version", version=f"kerncc {__version__}",
                        help="print kerncc's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = command(sub, "verify", "verify manifests as kern does; print the protocol summary")
    p.add_argument("files", nargs="+", metavar="FILE", help=FILE_HELP)
    _format_flag(p, "the summary and diagnostics as text, or as one JSON document on stdout")
    p.add_argument("--unsampled", action="store_true",
                   help="do not require a forward that hands back tokens (host-sampled models)")
    limit_flags(p)
    p.set_defaults(handler=cmd_verify)

    p = command(sub, "fmt", "print the canonical form of a manifest")
    p.add_argument("file", metavar="FILE", help=FILE_HELP)
    p.add_argument("--to", choices=("json", "kir"), help="output form (default: the input's)")
    p.add_argument("--check", action="store_true", help="exit 1 when FILE is not canonical")
    p.add_argument("-i", "--in-place", action="store_true",
                   help="rewrite FILE in its canonical form (atomically: a renamed sibling)")
    limit_flags(p)
    p.set_defaults(handler=cmd_fmt)

    p = command(sub, "dump", "print the IR after a pipeline (kir, json or dot)")
    p.add_argument("file", metavar="FILE", help=FILE_HELP)
    p.add_argument("--format", choices=("kir", "json", "dot", "svg"), default="kir",
                   help="kir: the textual IR (the default); json: one document, the manifest "
                   "or after a cut the array of stage manifests; dot: the dataflow picture's "
                   "source for graphviz; svg: that picture drawn (needs `dot` on PATH)")
    p.add_argument("-p", "--pipeline", help="passes to run first, e.g. cut{stages=3}")
    p.add_argument("--pass", dest="pass_name", metavar="NAME",
                   help="run up to this pass and print its result (for analyses: the report, "
                   "as text or --format json)")
    p.add_argument("--program", help="the program to draw (dot, svg; default: the first "
                   "driven one) or to report on (--pass liveness)")
    _instrument_flags(p)
    limit_flags(p)
    p.set_defaults(handler=cmd_dump, diag_format="text")

    p = command(sub, "lower", "run a pass pipeline; write stages or bundles")
    p.add_argument("file", metavar="FILE", help=FILE_HELP)
    p.add_argument("-p", "--pipeline", required=True, help="e.g. cut{at=218},slice-derive,emit")
    p.add_argument("-o", "--output", metavar="OUT", help="output directory (stage<k>.json, or "
                   "the bundle when the pipeline ends in emit)")
    _format_flag(p, "diagnostics as text, or as one JSON document on stderr; without -o the "
                 "stages as kir text, or as one JSON document (the array of stage manifests)")
    _instrument_flags(p)
    limit_flags(p)
    p.set_defaults(handler=cmd_lower)

    p = command(sub, "check", "prove that stages (or a bundle) compute the whole",
                "`-` in place of WHOLE or one STAGE manifest reads standard input (a BUNDLE is "
                "a folder, and\nWHOLE BUNDLE reads WHOLE from its file: the bundle records its "
                "sha256).")
    p.usage = "kerncc check [options] BUNDLE | WHOLE BUNDLE | WHOLE STAGE0 STAGE1 ..."
    p.add_argument("files", nargs="+", metavar="PATH",
                   help="a bundle directory (proved against the input it records), the whole "
                   "manifest and a bundle, or the whole manifest then every stage manifest")
    _format_flag(p, "the proof's counts and diagnostics as text, or as one JSON document")
    limit_flags(p)
    p.set_defaults(handler=cmd_check, check_usage=_check_paths)

    p = command(sub, "report", "summarise a bundle: stages, calls, crossings, states, "
                "memory, modules", stdin=None)
    p.add_argument("bundle", metavar="BUNDLE", type=no_stdin("a bundle: a bundle is a folder"),
                   help="a bundle directory (kerncc lower ... emit)")
    _format_flag(p, "the report and its diagnostics as text or JSON")
    limit_flags(p)
    p.set_defaults(handler=cmd_report)

    p = command(sub, "passes", "list the passes with their options", stdin=None)
    p.add_argument("--markdown", action="store_true", help="the reference as markdown")
    p.set_defaults(handler=cmd_passes)

    _extra_commands(sub)
    return parser


FILE_HELP = "a manifest: .json, or .kir text; `-` reads standard input"


def command(sub, name: str, help: str, stdin: str | None = STDIN_NOTE
            ) -> argparse.ArgumentParser:
    """A subcommand that reports its own usage errors (see `parse`) and lists exit codes, and
    what `-` reads (`stdin`; None: the command reads no manifest from standard input)."""
    epilog = EXIT_CODES + (f"\n\n{stdin}" if stdin else "")
    p = sub.add_parser(name, help=help, description=help[:1].upper() + help[1:] + ".",
                       epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(command_parser=p)
    return p


def _format_flag(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--format", dest="diag_format", choices=("text", "json"), default="text",
                   help=help)


def _instrument_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--print-ir-after", action="append", metavar="PASS",
                   help="print the IR after these passes (repeatable, or comma separated)")
    p.add_argument("--print-ir-after-all", action="store_true",
                   help="print the IR after every pass (on stderr)")
    p.add_argument("--print-ir-after-change", action="store_true",
                   help="print the IR after every pass that changed it (on stderr)")
    p.add_argument("--time-passes", action="store_true",
                   help="print each pass's wall time when the pipeline ends (on stderr)")
    p.add_argument("--dump-dir", metavar="DIR", help="write the IR after each pass here")
    p.add_argument("--no-verify", action="store_true", help="skip verification after each pass")


def _extra_commands(sub) -> None:
    """The command groups of their own modules: run and example, import, serve (`hf` adds its
    text flags to `run`, so it registers after it)."""
    for module in ("kerncc.cli.run", "kerncc.cli.hf", "kerncc.cli.serve"):
        try:
            __import__(module, fromlist=["register"]).register(sub)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise


if __name__ == "__main__":
    raise SystemExit(main())
