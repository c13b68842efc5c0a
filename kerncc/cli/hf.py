"""The command line of Hugging Face models: `kerncc import`, and text for `kerncc run`.

`register(sub)` adds `import` and gives the existing `run` its text flags (`--text`,
`--chat`, `--ignore-eos`, `--format json`, `--tokenizer DIR`; `--prompt` becomes one of the
three prompt forms). `TextRun.of(args, bundle)` is what `run` calls around generation: the
prompt ids (given, or encoded from text / a chat message), a `stop` that ends at an eos id
and streams the ids or the decoded text to stdout as they come (it is the engine's listener),
`end_stream()` that ends the streamed line, and `finish(tokens)` that prints the JSON object
of `--format json`.

The tokenizer of a bundle is the model folder of the manifest it was lowered from (bundle.json
`input.path`, kept relative to the bundle): emit copies nothing, so a bundle never carries
files that run code; bundle.json records the tokenizer files there (`tokenizer`) and the codec
refuses one that differs (`tokenizer_pins`); `--tokenizer DIR` names another folder, used as it
is. `kerncc import --max-file-size` bounds the tokenizer files it checks as serve's flag does.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import attrs

from kerncc.diagnostics import KernccError
from kerncc.cli.args import limit_flags, positive


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# kerncc import


def cmd_import(args: argparse.Namespace) -> int:
    from kerncc.hf.importer import import_model
    from kerncc.hf.tokenizer import check_files

    check_files(args.directory)  # bounded as run and serve read them (--max-file-size)
    done = import_model(args.directory, args.output, args.max_tokens, args.max_seqs,
                        args.max_context, quantize=getattr(args, "quantize", None))
    c = done.config
    _say(f"imported {done.hf.architecture} ({c.layers} layers, hidden {c.hidden}, vocab "
         f"{c.vocab}{', tied head' if done.hf.tied else ''}) over {done.checkpoint.name}: "
         f"tokens <= {c.max_tokens}, seqs <= {c.max_seqs}, context <= {c.max_context}")
    if done.hf.kv_repeat > 1:
        _say(f"kv heads repeated {done.hf.kv_repeat}x in the manifest ({done.hf.kv_heads} -> "
             f"{c.kv_heads}): the attention kernels take 1, 2, 4 or 8 q heads per kv head")
    if not done.beside:
        _say(f"note: the checkpoint is not beside {done.path}; run it with --weights "
             f"{done.checkpoint}")
    print(done.path)
    return 0


# ---------------------------------------------------------------------------------------------
# kerncc run: text


def model_dir(target: str, bundle: Any) -> Path | None:
    """The model folder a run target came from: a manifest's directory, or the directory of
    the manifest a bundle records as its input."""
    path = Path(target)
    if not path.is_dir():
        return path.parent
    recorded = (bundle.index.get("input") or {}).get("path")
    return (path / recorded).resolve().parent if isinstance(recorded, str) else None


def tokenizer_dir(args: argparse.Namespace, bundle: Any) -> Path | None:
    """The folder of the tokenizer and the eos ids: --tokenizer, else the model's."""
    given = getattr(args, "tokenizer", None)
    return Path(given) if given else model_dir(args.target, bundle)


def tokenizer_pins(args: argparse.Namespace, bundle: Any) -> Any:
    """The tokenizer files the bundle records (kerncc.bundle.reader.TokenizerPins), which the
    files the codec reads must be; None with --tokenizer (the user's folder, used as it is)."""
    from kerncc.bundle.reader import tokenizer_pins as pins

    if getattr(args, "tokenizer", None):
        return None
    return pins(bundle.index, bundle.dir)


def prompt_eos(args: argparse.Namespace, bundle: Any) -> tuple[int, ...]:
    """The eos ids that end a prompt given as ids (one, or several served together): the
    tokenizer folder's, none with --ignore-eos."""
    from kerncc.hf.tokenizer import model_eos_ids

    if getattr(args, "ignore_eos", False):
        return ()
    return model_eos_ids(tokenizer_dir(args, bundle))


@attrs.define
class TextRun:
    """One run's prompt, stop rule and output (see the module docstring)."""

    prompt: list[int]
    eos: tuple[int, ...]
    codec: Any  # TextCodec | None
    stream: Any  # TextStream while text streams to stdout, else None
    json: bool
    stopped: bool = False
    streamed: bool = False  # some text is on stdout's line

    @classmethod
    def of(cls, args: argparse.Namespace, bundle: Any) -> TextRun:
        from kerncc.hf.tokenizer import TextCodec

        folder = tokenizer_dir(args, bundle)
        text, chat = getattr(args, "text", None), getattr(args, "chat", None)
        as_json = getattr(args, "format", "text") == "json"
        wants_text = text is not None or chat is not None
        codec = None
        # ids in, JSON out: text is a bonus there, so no tokenizers library means text null
        bonus = as_json and not wants_text and importlib.util.find_spec("tokenizers") is None
        if folder is not None and (wants_text or as_json) and not bonus:
            codec = TextCodec.from_dir(folder, tokenizer_pins(args, bundle))
        if wants_text and codec is None:
            raise KernccError.single(f"--text and --chat need a tokenizer.json in the model "
                                     f"folder ({folder or 'unknown: give --tokenizer DIR'})")
        prompt = args.prompt[0] if args.prompt else None  # several: no TextRun
        if text is not None:
            prompt = codec.encode(text)
        elif chat is not None:
            prompt = codec.encode(codec.apply_chat_template(
                [{"role": "user", "content": chat}], add_generation_prompt=True),
                add_special_tokens=False)  # the template writes its own
        if not prompt:
            raise KernccError.single("the prompt encodes to no tokens")
        eos: tuple[int, ...] = ()
        if not getattr(args, "ignore_eos", False):
            eos = codec.eos_token_ids if codec is not None else prompt_eos(args, bundle)
        stream = codec.stream() if wants_text and not as_json else None
        return cls(list(prompt), tuple(eos), codec, stream, as_json)

    def stop(self, token: int) -> bool:
        """True at an eos id. The token streams to stdout as it comes: its id (an eos id too)
        when ids stream, else its text (an eos id's none)."""
        if self.streams_ids:
            self._write(f"{' ' if self.streamed else ''}{token}")
        if token in self.eos:
            self.stopped = True
            return True
        if self.stream is not None:
            self._write(self.stream.push(token))
        return False

    def _write(self, piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()
        self.streamed = self.streamed or bool(piece)

    def token(self, request: Any, token: int) -> None:
        """The engine's listener: each token as the engine hands it over (it stops at the
        same eos ids)."""
        self.stop(token)

    def done(self, request: Any) -> None:
        """Nothing to do: the run's summary follows once the engine is idle."""

    def end_stream(self) -> None:
        """The streamed line (text or ids) ends as generation ends (before the progress
        lines)."""
        if self.stream is not None:
            print(self.stream.flush(), flush=True)
        elif self.streams_ids:
            print(flush=True)

    def interrupt(self) -> None:
        """Ctrl-C: end the streamed line, if something is on it."""
        if self.streamed:
            self.end_stream()

    @property
    def streams_ids(self) -> bool:
        """Whether the ids print as they come (no text stream, no JSON at the end)."""
        return self.stream is None and not self.json

    def finish(self, tokens: list[int]) -> None:
        """With --format json, the last line on stdout: one JSON object (the ids and text
        streamed already otherwise)."""
        if self.json:
            text = None if self.codec is None else self.codec.decode(
                tokens[:-1] if self.stopped else tokens)
            print(json.dumps({"prompt_ids": self.prompt, "ids": tokens, "text": text,
                              "stop": "eos" if self.stopped else "length"},
                             ensure_ascii=False), flush=True)


# ---------------------------------------------------------------------------------------------
# registration


def _run_flags(run: argparse.ArgumentParser) -> None:
    for action in run._actions:  # --prompt becomes one of three prompt forms
        if action.dest == "prompt":
            action.required = False
            action.default = None
    run.add_argument("--text", metavar="TEXT", help="a prompt as text (needs tokenizer.json)")
    run.add_argument("--chat", metavar="MESSAGE",
                     help="a user message, through the tokenizer's chat template")
    run.add_argument("--ignore-eos", action="store_true",
                     help="generate --max-new tokens even past an eos token")
    run.add_argument("--format", choices=("text", "json"), default="text",
                     help="json: one object with prompt ids, ids and text")
    run.add_argument("--tokenizer", metavar="DIR",
                     help="the folder of tokenizer.json, used as it is (default: the model's "
                     "folder, held to the tokenizer files bundle.json records)")


def check_run_args(args: argparse.Namespace) -> None:
    """A --tokenizer folder that is there (one that is not gave no eos ids, and the run went
    on past eos). Exactly one of --prompt, --text, --chat is a usage error, checked at parse
    time (kerncc.cli.args.prompt_conflict)."""
    tokenizer = getattr(args, "tokenizer", None)
    if tokenizer and not Path(tokenizer).is_dir():
        raise KernccError.single(f"--tokenizer {tokenizer}: no such folder")


def register(sub: argparse._SubParsersAction) -> None:
    """Add `import`, and the text flags of `run` (registered before this by cli_runtime)."""
    p = sub.add_parser("import", help="a manifest over a Hugging Face checkpoint folder")
    p.add_argument("directory", metavar="DIR",
                   help="folder with config.json and model.safetensors (or a shard index)")
    p.add_argument("-o", "--output", metavar="OUT.json", help="default: DIR/model.json")
    sizes = (("--max-tokens", "rows of one call"), ("--max-seqs", "sequences of one call"),
             ("--max-context", "longest sequence (a multiple of 16)"))
    for flag, what in sizes:
        p.add_argument(flag, type=positive, metavar="N", help=what)
    p.add_argument("--quantize", choices=("fp8",),
                   help="fp8: the layers' linear weights as block-scaled e4m3 (128 x 128 "
                        "blocks, f32 scales), quantized at load; the checkpoint stays as it is")
    limit_flags(p)  # --max-file-size bounds the tokenizer files read, as serve's does
    p.set_defaults(handler=cmd_import, format="text")
    run = sub.choices.get("run")
    if run is not None:
        _run_flags(run)
