"""A `kerncc serve` server inside a test: uvicorn on a thread, on a free port of 127.0.0.1.

By default the front end and the engine core are apart as `kerncc serve` runs them
(kerncc.serve.core, kerncc.serve.client): the core on a thread of its own behind real ZeroMQ
sockets (ipc, in a temporary folder), the front end's Server over a CoreClient; `split=False`
serves the Engine in the front end's process (`kerncc serve --api-workers 0`)."""

from __future__ import annotations

import contextlib
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import attrs
import uvicorn

from kerncc.serve.engine import Config, Engine
from kerncc.serve.http import Server, create_app
from kerncc.serve.text import Text

SPLIT = True  # the front end apart from the engine core, as `kerncc serve` runs by default


@contextlib.contextmanager
def serving(chain: Any, model: str, codec: Any = None, runner: Any = None, split: bool = SPLIT,
            **config: Any) -> Iterator[tuple[str, Server]]:
    """Serve `chain` as `model` (text through `codec` when given); yields the base URL and the
    Server. `runner` replaces the model runner's Session or Chain (a test's stand-in for a
    faulty stage)."""
    engine = Engine(chain, Config(**{"max_running": 4, **config}))
    if runner is not None:
        engine.model.runner = runner
    text = Text(codec) if codec is not None else None
    with contextlib.ExitStack() as stack:
        front = stack.enter_context(core_apart(engine, text)).clients[0] if split else engine
        server = Server(front, model, text)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        uv = uvicorn.Server(uvicorn.Config(create_app(server), log_level="warning"))
        thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        for _ in range(250):  # bounded: 5 s
            if uv.started:
                break
            time.sleep(0.02)
        assert uv.started, "the test server did not start"
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
        finally:
            uv.should_exit = True
            thread.join(10)
            sock.close()


@attrs.define
class Apart:
    """An engine core on a thread and its front ends' clients (`core_apart`)."""

    core: Any
    clients: list[Any]
    inbox: str
    outboxes: list[str]


@contextlib.contextmanager
def core_apart(engine: Engine, text: Any = None, workers: int = 1) -> Iterator[Apart]:
    """`engine` served by a Core on a thread, over ipc sockets in a temporary folder, to
    `workers` CoreClients."""
    from kerncc.serve.client import CoreClient
    from kerncc.serve.core import Core

    with tempfile.TemporaryDirectory(prefix="kerncc-ipc-") as folder:
        inbox = f"ipc://{folder}/core"
        outboxes = [f"ipc://{folder}/front-{i}" for i in range(workers)]
        core = Core(engine, inbox, outboxes, text)
        thread = threading.Thread(target=core.run, name="kerncc-test-core", daemon=True)
        thread.start()
        clients = [CoreClient(inbox, outbox, i, alive=thread.is_alive, hello_timeout=30)
                   for i, outbox in enumerate(outboxes)]
        try:
            yield Apart(core, clients, inbox, outboxes)
        finally:
            core.stop()
            thread.join(10)
            for client in clients:
                client.close()
