"""A `kerncc serve` server inside a test: uvicorn on a thread, on a free port of 127.0.0.1."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from kerncc.serve.engine import Config, Engine
from kerncc.serve.http import Server, create_app
from kerncc.serve.text import Text


@contextlib.contextmanager
def serving(chain: Any, model: str, codec: Any = None, runner: Any = None,
            **config: Any) -> Iterator[tuple[str, Server]]:
    """Serve `chain` as `model` (text through `codec` when given); yields the base URL and the
    Server. `runner` replaces the model runner's Session or Chain (a test's stand-in for a faulty stage)."""
    engine = Engine(chain, Config(**{"max_running": 4, **config}))
    if runner is not None:
        engine.model.runner = runner
    server = Server(engine, model, Text(codec) if codec is not None else None)
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
