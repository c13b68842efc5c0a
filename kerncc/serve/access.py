"""Who may use the server and what it was asked: the API key check and the access log.

`Access` is ASGI middleware in front of every route. With a key (`kerncc serve --api-key`, or
KERNCC_API_KEY) a request without `Authorization: Bearer <key>` gets 401 in OpenAI's error
shape, on every route but /health (a load balancer's probe has no key). Every HTTP request,
answered or refused, leaves one line on the `kerncc.serve.access` logger: client, method,
path, status, seconds.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import time
from collections.abc import Callable
from typing import Any

LOG = logging.getLogger("kerncc.serve.access")
OPEN = frozenset({"/health"})


def loopback(host: str) -> bool:
    """Whether `host` (an address to listen on) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Access:
    """The key check and the access log (see the module docstring)."""

    def __init__(self, app: Any, key: Callable[[], str | None] = lambda: None) -> None:
        self.app, self.key = app, key  # read a request at a time: a server's may change

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), [0]

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self._allowed(scope):
                await self.app(scope, receive, sending)
            else:
                await _refuse(sending)
        finally:
            client = scope.get("client") or ("-", 0)
            LOG.info("%s:%s %s %s %s %.3fs", client[0], client[1], scope["method"],
                     scope["path"], status[0] or "-", time.perf_counter() - start)

    def _allowed(self, scope: dict) -> bool:
        key = self.key()
        if not key or scope["path"] in OPEN:
            return True
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode())


async def _refuse(send: Any) -> None:
    body = json.dumps({"error": {
        "message": "a valid API key is needed: send `Authorization: Bearer <key>` (the key "
                   "`kerncc serve` was given with --api-key or KERNCC_API_KEY)",
        "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"),
                            (b"www-authenticate", b"Bearer"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
