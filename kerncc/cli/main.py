"""The `kerncc` command line: verify, fmt, dump, lower, check, report, passes (and run, example).

Exit codes: 0 success, 1 the input is wrong (every problem printed, one per line, located),
2 usage errors (argparse). A `KernccError` never shows a traceback; anything else is a bug in
kerncc and says so, with the traceback only under KERNCC_DEBUG=1 (kerncc/config.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, TextIO

from kerncc import config
from kerncc.diagnostics import KernccError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return 2
    _apply_limits(args)
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
        return 0
    except Exception as err:  # noqa: BLE001 - the last line of defence: a bug, said plainly
        return internal_error(err, argv)


def _apply_limits(args: argparse.Namespace) -> None:
    """`--max-file-size` bounds every file this command reads (kerncc.bundle.files)."""
    from kerncc.bundle.files import set_max_file_size
    from kerncc.bundle.format import MAX_FILE_SIZE

    set_max_file_size(getattr(args, "max_file_size", None) or MAX_FILE_SIZE)


def limit_flags(p: argparse.ArgumentParser) -> None:
    """`--max-errors` and `--max-file-size`, on every command that reads files."""
    from kerncc.bundle.format import MAX_FILE_SIZE
    from kerncc.diagnostics import MAX_ERRORS

    p.add_argument("--max-errors", type=_count, default=MAX_ERRORS, metavar="N",
                   help=f"print at most N diagnostics, count the rest (default {MAX_ERRORS})")
    p.add_argument("--max-file-size", type=_count, metavar="BYTES",
                   help=f"the largest manifest, bundle.json, plan or module read (default "
                   f"{MAX_FILE_SIZE})")


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got `{text}`") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number of at least 1, got {value}")
    return value


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
    failed = 0
    for path in args.files:
        try:
            verified, lines = _verify_file(path, args.unsampled)
        except KernccError as err:
            failed = 1
            _report_for_file(err, path, args.diag_format, args.max_errors)
            continue
        if args.diag_format == "json":
            print(json.dumps({"file": path, "ok": True, "summary": lines}))
            continue
        man = verified.manifest
        print(f"{path}: `{man.model}` schema v{man.schema_version}, verified", file=sys.stderr)
        for line in lines:
            print(line)
    return failed


def _verify_file(path: str, unsampled: bool):
    """The verified manifest and its protocol summary; every error at its line:col."""
    from kerncc.source import load_with_locator
    from kerncc.verify import verify

    manifest, locate = load_with_locator(path)
    try:
        verified = verify(manifest)
        return verified, _protocol_lines(verified, unsampled)
    except KernccError as err:
        raise err.located(locate) from None


def _protocol_lines(verified, unsampled: bool) -> list[str]:
    from kerncc import protocol

    if not verified.manifest.driven_programs():
        return []
    check = protocol.check_unsampled if unsampled else protocol.check
    return protocol.summary_lines(check(verified))


def _report_for_file(err: KernccError, path: str, fmt: str, max_errors: int | None = None
                     ) -> None:
    if fmt == "json":
        print(json.dumps({"file": path, "ok": False, "error": err.headline,
                          "diagnostics": [d.to_json() for d in err.diagnostics]}))
        return
    from kerncc.diagnostics import render_error
    print(render_error(err, default_file=path, max_errors=max_errors), file=sys.stderr)


def cmd_fmt(args: argparse.Namespace) -> int:
    from kerncc import source

    man = source.load(args.file)
    text = _to_text(man, args.to or ("kir" if args.file.endswith(".kir") else "json"))
    if args.check:
        current = Path(args.file).read_text(encoding="utf-8")
        if current != text:
            print(f"{args.file}: not in canonical form", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


def _to_text(man, fmt: str) -> str:
    from kerncc import kir
    from kerncc.manifest import writer

    return kir.dumps(man) if fmt == "kir" else writer.dumps(man)


def cmd_dump(args: argparse.Namespace) -> int:
    ir = _lower(args, args.pipeline, upto=args.pass_name)
    if args.pass_name and args.pass_name in ir.reports and hasattr(ir.reports[args.pass_name],
                                                                  "to_text"):
        sys.stdout.write(ir.reports[args.pass_name].to_text() + "\n")
        return 0
    if args.format in ("dot", "svg"):
        from kerncc.dot import render_dot, render_svg
        source = render_dot(ir, args.program)
        sys.stdout.write(source if args.format == "dot" else render_svg(source))
    elif args.format == "json":
        from kerncc.manifest import writer
        sys.stdout.write("".join(writer.dumps(s) for s in ir.stages))
    else:
        sys.stdout.write(ir.to_text())
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
            raise KernccError.single(f"cannot write the stages to `{args.output}`: "
                                     f"{err.strerror or err}") from None
        print(f"wrote {len(ir.stages)} stage manifests to {args.output}", file=sys.stderr)
    elif not args.output:
        sys.stdout.write(ir.to_text())
    return 0


def _lower(args: argparse.Namespace, spec: str | None, upto: str | None = None,
           out: str | None = None):
    """Load, verify, run the pipeline (`spec`, then up to the pass `upto`); the final IR."""
    import attrs

    from kerncc.ir import IR
    from kerncc.pipeline import (instruments_from_args, pass_spec, resolve_pipeline,
                                 run_pipeline)
    from kerncc.source import load_with_locator

    manifest, locate = load_with_locator(args.file)
    ir = _verified(IR.from_manifest(manifest, source=args.file), locate)
    text = ",".join(t for t in (spec, upto) if t and not (t == upto and spec and upto in spec))
    if not text:
        return ir
    passes = resolve_pipeline(text)
    if out:
        passes = _with_output(passes, out)
    printed = ",".join(str(pass_spec(p)) for p in passes)
    ir = attrs.evolve(ir, pipeline=printed, history=tuple(p.name for p in passes))
    instruments = instruments_from_args(
        getattr(args, "print_ir_after", None), getattr(args, "print_ir_after_all", False),
        getattr(args, "print_ir_after_change", False), getattr(args, "time_passes", False),
        getattr(args, "dump_dir", None), sys.stderr)
    try:
        return run_pipeline(ir, passes, instruments, verify=not getattr(args, "no_verify", False),
                            input_name=args.file)
    except KernccError as err:
        raise err.located(locate) from None


def _verified(ir, locate: Callable):
    """Verify the input once before any pass: a pipeline only takes a valid manifest."""
    from kerncc.verify import verify

    try:
        verify(ir.whole)
    except KernccError as err:
        raise err.located(locate) from None
    return ir


def _with_output(passes, out: str):
    """`-o OUT` sets `emit{out=...}` when the pipeline emits and names no directory."""
    import attrs

    return tuple(attrs.evolve(p, out=p.out or out) if p.name == "emit" else p for p in passes)


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
        missing = [p for p in paths if not Path(p).exists()]
        if missing:
            raise KernccError.single(f"`{missing[0]}` does not exist (check takes a bundle "
                                     "directory, WHOLE BUNDLE, or WHOLE STAGE0 STAGE1 ...)")
        if len(paths) < 3:
            raise KernccError.single("check takes a bundle directory, WHOLE BUNDLE, or WHOLE "
                                     "STAGE0 STAGE1 ...")
        whole, locate = load_with_locator(paths[0])
        stages = [source.load(p) for p in paths[1:]]
        try:
            proof = check_stages(whole, stages)
        except KernccError as err:  # its pointers are the whole manifest's calls
            raise err.located(locate) from None
    print(f"proved: {len(proof.programs)} driven programs, {proof.outputs} outputs, "
          f"{proof.carries} carries, {proof.regions} state regions equal the whole's")
    return 0


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
    parser = argparse.ArgumentParser(
        prog="kerncc", description="Compile kern GPU-kernel manifests (schema v5).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("verify", help="verify manifests as kern does; print the protocol summary")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--format", dest="diag_format", choices=("text", "json"), default="text")
    p.add_argument("--unsampled", action="store_true",
                   help="do not require a forward that hands back tokens (host-sampled models)")
    limit_flags(p)
    p.set_defaults(handler=cmd_verify)

    p = sub.add_parser("fmt", help="print the canonical form of a manifest")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--to", choices=("json", "kir"), help="output form (default: the input's)")
    p.add_argument("--check", action="store_true", help="exit 1 when FILE is not canonical")
    limit_flags(p)
    p.set_defaults(handler=cmd_fmt)

    p = sub.add_parser("dump", help="print the IR after a pipeline (kir, json or dot)")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--format", choices=("kir", "json", "dot", "svg"), default="kir",
                   help="svg: the dot picture drawn by graphviz (needs `dot` on PATH)")
    p.add_argument("-p", "--pipeline", help="passes to run first")
    p.add_argument("--pass", dest="pass_name", metavar="NAME",
                   help="run up to this pass and print its result (for analyses: the report)")
    p.add_argument("--program", help="the program to draw (dot, svg)")
    _instrument_flags(p)
    limit_flags(p)
    p.set_defaults(handler=cmd_dump)

    p = sub.add_parser("lower", help="run a pass pipeline; write stages or bundles")
    p.add_argument("file", metavar="FILE")
    p.add_argument("-p", "--pipeline", required=True, help="e.g. cut{at=218},slice-derive,emit")
    p.add_argument("-o", "--output", metavar="OUT", help="output directory")
    p.add_argument("--format", dest="diag_format", choices=("text", "json"), default="text",
                   help="diagnostics format")
    _instrument_flags(p)
    limit_flags(p)
    p.set_defaults(handler=cmd_lower)

    p = sub.add_parser("check", help="prove that stages (or a bundle) compute the whole",
                       usage="kerncc check [options] BUNDLE | WHOLE BUNDLE | WHOLE STAGE0 "
                       "STAGE1 ...")
    p.add_argument("files", nargs="+", metavar="PATH",
                   help="a bundle directory (proved against the input it records), the whole "
                   "manifest and a bundle, or the whole manifest and its stage files")
    p.add_argument("--format", dest="diag_format", choices=("text", "json"), default="text")
    limit_flags(p)
    p.set_defaults(handler=cmd_check)

    p = sub.add_parser("report", help="summarise a bundle: stages, calls, crossings, states, "
                       "memory, modules")
    p.add_argument("bundle", metavar="BUNDLE", help="a bundle directory (kerncc lower ... emit)")
    p.add_argument("--format", dest="diag_format", choices=("text", "json"), default="text",
                   help="the report and its diagnostics as text or JSON")
    limit_flags(p)
    p.set_defaults(handler=cmd_report)

    p = sub.add_parser("passes", help="list the passes with their options")
    p.add_argument("--markdown", action="store_true", help="the reference as markdown")
    p.set_defaults(handler=cmd_passes)

    _extra_commands(sub)
    return parser


def _instrument_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--print-ir-after", action="append", metavar="PASS",
                   help="print the IR after these passes (repeatable, or comma separated)")
    p.add_argument("--print-ir-after-all", action="store_true")
    p.add_argument("--print-ir-after-change", action="store_true")
    p.add_argument("--time-passes", action="store_true")
    p.add_argument("--dump-dir", metavar="DIR", help="write the IR after each pass here")
    p.add_argument("--no-verify", action="store_true", help="skip verification after each pass")


def _extra_commands(sub) -> None:
    """Commands whose rooms land later register here (run, example)."""
    for module in ("kerncc.cli.run", "kerncc.cli.hf", "kerncc.cli.serve"):
        try:
            __import__(module, fromlist=["register"]).register(sub)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise


if __name__ == "__main__":
    raise SystemExit(main())
