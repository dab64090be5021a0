"""The HTTP edge's guards: a request gate (413 for oversized bodies, 503 while draining, a count of
requests in flight) and a uvicorn server whose SIGTERM drains instead of closing at once.

Why an ASGI middleware and not FastAPI dependencies: the body limit must hold before any route
parses the body (a multi-GB JSON would be read and parsed first), and the drain gate must answer
every route, unknown ones included, in OpenAI's error format.

Drain (SIGTERM while serving): the gate answers every new request 503; requests in flight go on
for up to `server.shutdown_timeout_s`; those still running then end with a 503 error (their
scheduler work is aborted), and uvicorn shuts down. A second SIGTERM, or SIGINT, stops at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from typing import Any

import uvicorn

from moeserve.server.http2_probe import quiet_http2_probes

logger = logging.getLogger("moeserve.server")

_BODY_METHODS = {"POST", "PUT", "PATCH"}


def _error(message: str, type: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": None,
                                 "code": code}}).encode()


async def send_error(send: Any, status: int, message: str, type: str, code: str) -> None:
    body = _error(message, type, code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 503:
        headers.append((b"retry-after", b"1"))
    if status == 413:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestGate:
    """ASGI middleware in front of the app: `max_body` bytes per request body (413 beyond,
    checked on Content-Length and on the bytes actually read), 503 for everything once
    `draining`, and `active`, the number of HTTP requests being answered."""

    def __init__(self, app: Any, max_body: int):
        self.app, self.max_body = app, max_body
        self.draining = False
        self.active = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining:
            await send_error(send, 503, "The server is shutting down; retry on another replica.",
                             "server_error", "server_shutting_down")
            return
        self.active += 1
        try:
            if not await self._declared_size_ok(scope, send):
                return
            if scope["method"] in _BODY_METHODS:
                receive = await self._buffer_body(receive, send)
                if receive is None:
                    return
            await self.app(scope, receive, send)
        finally:
            self.active -= 1

    async def _declared_size_ok(self, scope: dict, send: Any) -> bool:
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is None:
            return True
        try:
            size = int(declared)
        except ValueError:
            await send_error(send, 400, "invalid Content-Length header",
                             "invalid_request_error", "invalid_content_length")
            return False
        if size > self.max_body:
            await self._too_large(send, size)
            return False
        return True

    async def _buffer_body(self, receive: Any, send: Any) -> Any:
        """Read the whole body (at most max_body bytes) and return a `receive` that replays it;
        None when an error was sent instead (or the client left)."""
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body:
                await self._too_large(send, total)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed() -> dict:
            return replay.pop() if replay else await receive()

        return replayed

    async def _too_large(self, send: Any, size: int) -> None:
        await send_error(send, 413, f"Request body of {size}+ bytes is larger than the limit of "
                         f"{self.max_body} bytes (server.max_request_bytes).",
                         "invalid_request_error", "request_too_large")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM drains (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, gate: RequestGate, manager: Any,
                 shutdown_timeout_s: float):
        quiet_http2_probes(config)  # a router's HTTP/2 probe is no warning (http2_probe.py)
        super().__init__(config)
        self.gate, self.manager, self.shutdown_timeout_s = gate, manager, shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig != signal.SIGTERM or self.gate.draining or self._loop is None:
            super().handle_exit(sig, frame)  # SIGINT, a second SIGTERM: stop now
            return
        self.gate.draining = True  # from here every new request is a 503
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.get_running_loop().create_task(self.drain())

    async def drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout_s
        logger.info("received SIGTERM: draining %d request(s) in flight for up to %.0f s "
                    "(server.shutdown_timeout_s), new requests get 503; then shutting down",
                    self.gate.active, self.shutdown_timeout_s)
        while self.gate.active and loop.time() < deadline and not self.should_exit:
            await asyncio.sleep(0.05)
        if self.gate.active:
            cut = self.manager.fail_all("The server is shutting down "
                                        "(server.shutdown_timeout_s passed).")
            logger.warning("shutdown timeout: %d request(s) still running end with 503 "
                           "(%d generation(s) aborted)", self.gate.active, cut)
            while self.gate.active and loop.time() < deadline + 5:
                await asyncio.sleep(0.05)
        else:
            logger.info("drained: no request in flight; shutting down")
        self.should_exit = True
