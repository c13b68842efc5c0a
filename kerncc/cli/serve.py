"""`kerncc serve BUNDLE_OR_MANIFEST`: load the stages, start the engine, serve HTTP on uvicorn.

Registered beside `run` (kerncc.cli.main registers it). SIGTERM or Ctrl-C drains: admission
stops (new requests and /health get 503), the requests being answered get `--drain-timeout`
seconds to finish, then each one left is cancelled (a stream ends with an error event and
`[DONE]`, a plain request gets a 503 in OpenAI's shape) and the process exits 0. A second
Ctrl-C ends the drain at once.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from kerncc import config
from kerncc.cli import placement
from kerncc.diagnostics import KernccError
from kerncc.cli.args import limit_flags, no_stdin, non_negative, open_run_target, port, \
    positive, seconds
from kerncc.cli.hf import check_run_args, tokenizer_pins
from kerncc.cli.run import TARGET_NOT_STDIN, check_chunk, checkpoint_for
from kerncc.serve import access, guard

LOG = logging.getLogger("kerncc.serve")

DRAIN_TIMEOUT = 30.0  # seconds requests may go on after SIGTERM (--drain-timeout)
BODY_TIMEOUT = 60.0  # seconds to send a request's body (--body-timeout)
GRACE = 5.0  # seconds uvicorn waits for connections after the drain (only writes are left)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn  # noqa: F401 - the extra is needed before anything loads
    except ImportError:
        raise KernccError.single("`kerncc serve` needs the serve extra: "
                                 "pip install 'kerncc[serve]'") from None
    check_run_args(args)  # --tokenizer, a folder that is there
    bundle = open_run_target(args.target, args.pipeline)
    check_chunk(args.chunk, bundle)
    weights = checkpoint_for(args, bundle)
    folders = [Path(args.tokenizer)] if args.tokenizer else \
        [bundle.dir, Path(weights).parent if weights else None, Path(args.target).parent]
    codec = _tokenizer(folders, args.tokenizer, tokenizer_pins(args, bundle))
    _logging()
    warn_if_open(args.host, args.api_key or config.api_key())
    # Before the stages start: a port already taken costs no load and leaves nothing to undo.
    sock = _bind(args.host, args.port)
    try:  # the engine core and the front ends in processes of their own, or (0) all here
        serve = _serve_apart if args.api_workers else _serve_here
        return serve(args, bundle, weights, codec, sock)
    finally:
        sock.close()


def _serve_here(args: argparse.Namespace, bundle: Any, weights: Any, codec: Any,
                sock: socket.socket) -> int:
    """Start the stages, the engine and uvicorn on `sock`, in this process; the stages are
    closed however this ends (a failed start left stage processes running)."""
    _print_memory(bundle, getattr(args, "kv_tokens", None))
    with placement.make(args, bundle, checkpoint=weights) as chain:  # thread, process or ray
        engine = make_engine(args, chain)
        model = model_name(args, bundle)
        server = _server(args, engine, model, codec)
        _say(f"{engine_line(model, chain, engine)}; tokenizer: "
             f"{'yes' if server.text else 'none'}; {listening(sock)}")
        run_uvicorn(args, server, sock)
    _say("stopped")
    return 0


def _server(args: argparse.Namespace, engine: Any, model: str, codec: Any) -> Any:
    """The HTTP server over `engine` (an Engine, or a front end's CoreClient)."""
    from kerncc.serve.http import Server

    return Server(engine, model, codec, lenient=args.lenient,
                  api_key=args.api_key or config.api_key(), body_timeout=args.body_timeout)


def make_engine(args: argparse.Namespace, chain: Any) -> Any:
    """The engine over `chain`, and what the server holds from its start on (bundle, stages,
    engine, graphs) moved out of the cyclic collector: an old-generation collection walked
    all of it between two steps (a 50 ms stall of every stream, the engine alone at 32
    streams on an H100). main() unfreezes when the command ends."""
    from kerncc.serve.engine import Config, Engine

    engine = Engine(chain, Config(max_running=args.max_seqs, max_queue=args.max_queue,
                                  chunk=args.chunk, prefix_cache=args.prefix_cache,
                                  step_tokens=args.step_tokens, hold_steps=args.hold_steps))
    gc.collect()
    gc.freeze()
    return engine


def model_name(args: argparse.Namespace, bundle: Any) -> str:
    return args.served_model_name or bundle.stages[0].manifest.model


def engine_line(model: str, chain: Any, engine: Any) -> str:
    """What serves: the model, the runner and its KV pool (and, where the pool is smaller
    than every sequence at the context bound, by `--kv-tokens` or fitted to the device:
    runtime/footprint.py fitting_capacity, how many pages that would take)."""
    from kerncc.runtime.memory import chain_token_capacity

    full = chain_token_capacity(s.manifest for s in chain.bundle.stages) // engine.stride
    short = f" (of {full} for every sequence at the context bound)" \
        if engine.pool.pages < full else ""
    return f"`{model}` on {chain}, {engine.pool.pages} KV pages of {engine.stride} tokens{short}"


def listening(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"listening on http://{host}:{port}"


def uvicorn_config(args: argparse.Namespace, server: Any) -> Any:
    import uvicorn

    from kerncc.serve.http import create_app

    return uvicorn.Config(create_app(server), log_level="warning", lifespan="on",
                          timeout_graceful_shutdown=GRACE,
                          http=guard.protocol(args.header_timeout, args.max_waiting))


def run_uvicorn(args: argparse.Namespace, server: Any, sock: socket.socket) -> None:
    """uvicorn on `sock` (already listening), draining on SIGTERM (`_Uvicorn`)."""
    _Uvicorn(uvicorn_config(args, server), server, args.drain_timeout).run(sockets=[sock])


# ------------------------------------------------------------------------ apart

START_TIMEOUT = 3600.0  # seconds the core may take to load (a checkpoint of many GB)
RESTARTS = 5  # front ends restarted in a row (each within RESTART_WINDOW) before giving up
RESTART_WINDOW = 60.0
LOST_GRACE = 1.0  # seconds the front ends have to answer their requests once the core is gone


def _serve_apart(args: argparse.Namespace, bundle: Any, weights: Any, codec: Any,
                 sock: socket.socket) -> int:
    """The engine core in a process of its own (kerncc.serve.core), `--api-workers` front ends
    in theirs (kerncc.serve.client under uvicorn), all on the one listening `sock` handed down;
    this process watches them: a front end that dies is restarted, a core that dies ends the
    server (exit 1), SIGTERM drains the front ends, then stops the core."""
    import multiprocessing
    import tempfile

    _print_memory(bundle, getattr(args, "kv_tokens", None))
    fork = multiprocessing.get_context("fork")  # the bundle, tokenizer and socket, inherited
    with tempfile.TemporaryDirectory(prefix="kerncc-serve-") as folder:
        inbox = f"ipc://{folder}/core"
        outboxes = [f"ipc://{folder}/front-{i}" for i in range(args.api_workers)]
        theirs, mine = fork.Pipe(duplex=False)
        core = fork.Process(target=_core_main, name="kerncc-core", daemon=False,
                            args=(args, bundle, weights, codec, inbox, outboxes, mine))
        core.start()
        mine.close()
        try:
            said = _started(core, theirs)
            fronts = [_front(fork, args, bundle, codec, sock, inbox, outboxes, i, core.pid)
                      for i in range(args.api_workers)]
            _say(f"{said}; tokenizer: {'yes' if codec else 'none'}; engine core pid "
                 f"{core.pid}, {args.api_workers} API worker(s); {listening(sock)}")
            return _watch(args, bundle, codec, sock, inbox, outboxes, core, fronts, fork)
        finally:
            _end_core(core)


def _started(core: Any, pipe: Any) -> str:
    """The core's line once it serves (bounded, and while it lives); its load error raised."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if pipe.poll(0.2):
            kind, text = pipe.recv()
            if kind == "error":
                core.join(30)
                raise KernccError.single(text)
            return text
        if not core.is_alive():
            raise KernccError.single(f"the engine core ended while it started (exit code "
                                     f"{core.exitcode})")
    raise KernccError.single(f"the engine core did not start within {START_TIMEOUT:g} s")


def _core_main(args: argparse.Namespace, bundle: Any, weights: Any, codec: Any, inbox: str,
               outboxes: list[str], pipe: Any) -> None:
    """The engine core's process: load the stages, serve the front ends until the watcher
    stops it (SIGUSR1; SIGTERM once the watcher is gone)."""
    from kerncc.serve.core import Core

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C drains the front ends first
    watcher = os.getppid()
    _end_with(watcher)
    code = 0
    try:
        with placement.make(args, bundle, checkpoint=weights) as chain:
            engine = make_engine(args, chain)
            core = Core(engine, inbox, outboxes, codec)
            # The watcher orders the stop (SIGUSR1, after the front ends drained); a SIGTERM
            # to the whole process group is its to order too, unless the watcher is gone.
            signal.signal(signal.SIGUSR1, lambda *_: core.stop())
            signal.signal(signal.SIGTERM,
                          lambda *_: None if os.getppid() == watcher else core.stop())
            pipe.send(("ready", engine_line(model_name(args, bundle), chain, engine)))
            core.run()
    except KernccError as err:
        pipe.send(("error", err.headline))
        code = 1
    except BaseException as err:  # noqa: BLE001 - said to the watcher, which exits 1
        pipe.send(("error", f"the engine core failed: {type(err).__name__}: {err}"))
        code = 1
    sys.stderr.flush()
    os._exit(code)  # never the forking process's exit handlers


def _front(fork: Any, args: argparse.Namespace, bundle: Any, codec: Any, sock: socket.socket,
           inbox: str, outboxes: list[str], worker: int, core_pid: int) -> Any:
    process = fork.Process(target=_front_main, name=f"kerncc-api-{worker}", daemon=False,
                           args=(args, bundle, codec, sock, inbox, outboxes[worker], worker,
                                 core_pid))
    process.start()
    return process


def _front_main(args: argparse.Namespace, bundle: Any, codec: Any, sock: socket.socket,
                inbox: str, outbox: str, worker: int, core_pid: int) -> None:
    """A front end's process: uvicorn on the shared socket over a CoreClient."""
    from kerncc.serve.client import CoreClient

    watcher = os.getppid()
    _end_with(watcher)
    code = 0
    try:
        client = CoreClient(inbox, outbox, worker,
                            alive=lambda: _alive(core_pid) and os.getppid() == watcher)
        server = _server(args, client, model_name(args, bundle), codec)
        run_uvicorn(args, server, sock)
        code = 1 if client.fault is not None and not server.draining else 0
    except KernccError as err:
        _say(f"API worker {worker}: {err.headline}")
        code = 1
    sys.stderr.flush()
    os._exit(code)


def _end_with(watcher: int) -> None:
    """This process is sent SIGTERM when the watcher ends, however it ends (Linux's
    PR_SET_PDEATHSIG): a watcher killed outright leaves no core or front end behind holding
    the port. Elsewhere nothing is asked."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        asked = libc.prctl(1, int(signal.SIGTERM), 0, 0, 0) == 0  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if asked and os.getppid() != watcher:  # it ended before the kernel was asked
        os.kill(os.getpid(), signal.SIGTERM)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended and not yet reaped, does not); a check
    that cannot be made (no file descriptor left to read /proc) says it runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        return True


def _watch(args: argparse.Namespace, bundle: Any, codec: Any, sock: socket.socket,
           inbox: str, outboxes: list[str], core: Any, fronts: list[Any], fork: Any) -> int:
    """Watch the processes until the server ends; its exit code."""
    from multiprocessing.connection import wait

    stopping: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        if not stopping and signum == signal.SIGTERM:  # Ctrl-C reached them already
            for front in fronts:
                if front.is_alive():
                    os.kill(front.pid, signal.SIGTERM)
        stopping.append(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    restarts: list[float] = []
    while True:
        wait([core.sentinel, *(f.sentinel for f in fronts)], timeout=0.5)
        if not core.is_alive():
            why = (f"signal {-core.exitcode}" if core.exitcode and core.exitcode < 0
                   else f"exit code {core.exitcode}")
            _say(f"the engine core died ({why}): every request in flight was answered 500; "
                 "the server stops")
            time.sleep(LOST_GRACE)  # the front ends answer their requests, then end
            for front in fronts:
                front.terminate()
                front.join(10)
            return 1
        for i, front in enumerate(fronts):
            if front.is_alive() or stopping:
                continue
            now = time.monotonic()
            restarts = [t for t in restarts if now - t < RESTART_WINDOW] + [now]
            if len(restarts) > RESTARTS:
                _say(f"API worker {i} keeps ending (exit code {front.exitcode}): the server "
                     "stops")
                return _stop_all(core, fronts, 1)
            _say(f"API worker {i} ended (exit code {front.exitcode}): restarted")
            fronts[i] = _front(fork, args, bundle, codec, sock, inbox, outboxes, i, core.pid)
        if stopping and not any(f.is_alive() for f in fronts):
            code = _stop_all(core, fronts, 0)
            _say("stopped")
            return code


def _stop_all(core: Any, fronts: list[Any], code: int) -> int:
    for front in fronts:
        if front.is_alive():
            front.terminate()
        front.join(10)
    _end_core(core)
    return code


def _end_core(core: Any) -> None:
    """Stop the engine core (SIGUSR1: it cancels what is left and ends), killed if it has
    not ended within 30 s."""
    if core.is_alive():
        try:
            os.kill(core.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
        core.join(30)
    if core.is_alive():
        core.kill()
        core.join()


def _say(line: str) -> None:
    print(f"kerncc serve: {line}", file=sys.stderr, flush=True)


def _print_memory(bundle: Any, kv_tokens: int | None = None) -> None:
    """The planned device memory of every stage at `--kv-tokens` (default: the bundle's pool),
    before any weight moves (a load that does not fit is refused then, naming what to lower)."""
    from kerncc.runtime.footprint import bundle_footprints, summary

    for f in bundle_footprints([(s.manifest, s.plan) for s in bundle.stages], kv_tokens):
        _say(summary(f))


def warn_if_open(host: str, key: str | None) -> bool:
    """Warn (and say so) when the server listens beyond loopback without an API key."""
    if key or access.loopback(host):
        return False
    LOG.warning("listening on %s without an API key: anyone who reaches it may use the "
                "model (--api-key or KERNCC_API_KEY asks clients for one)", host)
    return True


class _Stderr(logging.StreamHandler):
    """The server's own lines (warnings, the access log) on whatever sys.stderr is now."""
    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("kerncc serve: %(message)s"))

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _logging() -> None:
    logger = logging.getLogger("kerncc.serve")
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        logger.addHandler(_Stderr())
        logger.setLevel(logging.INFO)


def _tokenizer(folders: list[Path | None], given: str | None, pins: Any = None) -> Any:
    """The first folder's tokenizer; one named by --tokenizer must be there (a flag the
    server ignored would leave text prompts refused with no word of why). `pins`: the
    tokenizer files the bundle records, which the files found must be."""
    from kerncc.serve import text

    found = text.load(folders, pins)
    if found is not None or not given:
        return found
    raise KernccError.single(f"--tokenizer {given}: no tokenizer.json in that folder")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        # Listening now: a client that reads "listening on" and connects before uvicorn has
        # started waits in the backlog instead of being refused.
        sock.listen(2048)
    except OSError as err:
        sock.close()
        raise KernccError.single(f"cannot listen on {host}:{port}: "
                                 f"{err.strerror or err}") from None
    return sock


class _Uvicorn:
    """uvicorn's server, told to stop admitting the moment a signal arrives, which drains
    (Server.drain) before uvicorn's own shutdown closes the listening socket: during the
    drain a new request is answered 503, not refused a connection."""
    def __new__(cls, uv, server, drain_timeout: float):  # made lazily: uvicorn is optional
        import uvicorn

        class Draining(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:
                server.draining = True
                super().handle_exit(sig, frame)
                # A shutdown asked for is a clean exit (uvicorn would re-raise the signal).
                self._captured_signals.clear()

            async def shutdown(self, sockets=None) -> None:
                await server.drain(drain_timeout, lambda: self.force_exit)
                await super().shutdown(sockets)

        return Draining(uv)


def register(sub: argparse._SubParsersAction) -> None:
    """Add `serve` to the `kerncc` command line (called by kerncc.cli.main)."""
    p = sub.add_parser("serve", help="serve a bundle over HTTP (OpenAI-compatible)")
    p.set_defaults(command_parser=p)  # usage errors print serve's usage (kerncc.cli.main.parse)
    p.add_argument("target", metavar="BUNDLE_OR_MANIFEST", type=no_stdin(TARGET_NOT_STDIN),
                   help="a bundle directory or a manifest file (lowered with --pipeline)")
    placement.add_arguments(p)
    p.add_argument("--host", default="127.0.0.1", metavar="ADDR",
                   help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, metavar="N",
                   help="port (default 8000; 0: any free)")
    p.add_argument("--max-queue", type=positive, default=256, metavar="N",
                   help="requests waiting for admission before new ones get 429 (default 256)")
    p.add_argument("--max-seqs", type=positive, metavar="N",
                   help="sequences served at once (default: as many as the bundle's decode "
                   "step takes, 128 for the small example)")
    p.add_argument("--chunk", type=positive, metavar="N",
                   help="prefill rows per step (default: the rows bound)")
    p.add_argument("--step-tokens", type=positive, metavar="N",
                   help="rows a step feeds, decode and prefill together: a decode row for "
                   "each of --max-seqs sequences, prefill the rest (the same every step), a "
                   "page's worth at least (default: no budget, a whole chunk of prefill "
                   "beside every decode step)")
    p.add_argument("--hold-steps", type=non_negative, default=8, metavar="N",
                   help="a burst's streams start together: a sequence primed while the prompts "
                   "admitted with it are fed waits for them, if that is at most N steps of "
                   "prefill (default 8; 0: each decodes as soon as its prompt is fed)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="compute every prompt from its first token (default: full prompt "
                   "pages are kept and shared by later prompts that begin alike)")
    p.add_argument("--weights", metavar="FILE", help="safetensors checkpoint (default: the "
                   "bundle's)")
    p.add_argument("--tokenizer", metavar="DIR", help="folder of the tokenizer files, used "
                   "as it is (default: the bundle's, the checkpoint's, the manifest's, each held "
                   "to the tokenizer files bundle.json records)")
    p.add_argument("--api-key", metavar="KEY",
                   help="answer only clients that send `Authorization: Bearer KEY` (401 "
                   "otherwise; /health stays open); default: KERNCC_API_KEY, else none")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name in the API (default: the manifest's `model`)")
    p.add_argument("--drain-timeout", type=seconds, default=DRAIN_TIMEOUT, metavar="SECONDS",
                   help="on SIGTERM, how long the requests being answered may go on before "
                   f"they are cancelled (default {DRAIN_TIMEOUT:g})")
    p.add_argument("--header-timeout", type=seconds, default=guard.HEADER_TIMEOUT,
                   metavar="SECONDS", help="time a client has to send a request's headers; "
                   f"then 408 and the connection is closed (default {guard.HEADER_TIMEOUT:g})")
    p.add_argument("--body-timeout", type=seconds, default=BODY_TIMEOUT, metavar="SECONDS",
                   help="time a client has to send a request's body; then 408 (default "
                   f"{BODY_TIMEOUT:g})")
    p.add_argument("--max-waiting-connections", dest="max_waiting", type=positive,
                   default=guard.MAX_WAITING, metavar="N",
                   help="connections waiting for a request's headers; past N, those waiting "
                   f"longest (over {guard.TRIM_AGE:g} s) are closed (default {guard.MAX_WAITING})")
    p.add_argument("--api-workers", type=non_negative, default=1, metavar="N",
                   help="front-end processes (HTTP, tokens to text, stop strings, streaming) "
                   "sharing the port, apart from the engine core's process (default 1); 0: "
                   "one process serves everything")
    p.add_argument("--lenient", action="store_true",
                   help="accept and ignore (logging them) request fields the server does not "
                   "know, instead of a 400")
    p.add_argument("--pipeline", metavar="SPEC",
                   help="passes lowering a manifest target (default: emit)")
    limit_flags(p)  # --max-file-size bounds the bundle's files and the tokenizer's
    p.set_defaults(handler=cmd_serve, format="text")  # check_usage: placement.unread
