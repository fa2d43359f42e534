"""What stands in front of every endpoint, as plain ASGI: the bearer key, the body limits, and the last resort.

A body is bounded three ways: its own size (413), the time it takes to arrive (408: a body sent a byte at a time
holds its connection and its bytes no longer than that), and the bytes of all bodies held by requests in flight, from
the first byte read until the response ends (429 at once past it). Without the last, a client opening thousands of
connections, each sending most of a 1 MB body, held ~0.8 MB of the server's memory per connection for as long as it
liked (benchmarks/RESULTS.md): connections cost no more than the file descriptor limit allowed.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which hides the client's disconnect from the endpoint: here
the body is read once (counted as its bytes arrive, so a chunked body cannot slip past the limit), handed on, and
every later ``receive()`` reaches the server itself, where a hang-up shows as ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from tokenloom.server.errors import APIError
from tokenloom.server.tenants import Tenant

logger = logging.getLogger(__name__)

# Starlette's own ASGI types, so the server's receive and send pass as they are.
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PUBLIC_PATHS = frozenset({"/health", "/ready"})


class ByteBudget:
    """Bytes (or characters) held by requests in flight, against a limit, taken and given back on one event loop (no
    lock): the bodies read (here), what responses may hold (response_budget.py), the text being tokenized
    (text_budget.py)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> bool:
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give_back(self, size: int) -> None:
        self.held -= size
        assert self.held >= 0, "a request gave back more than it took"


class BodyReader:
    """Reads a request's body within its limits: its size (413), its deadline (408) and the bytes of bodies in
    flight (429); ``on_reject(code)`` counts refusals. Used by the guard and by the Ray Serve ingress."""

    def __init__(
        self,
        max_body_bytes: int,
        on_reject: Callable[[str], None],
        max_inflight_body_bytes: int | None = None,
        body_timeout: float = 30.0,
    ) -> None:
        self.max_body_bytes = max_body_bytes
        self.on_reject = on_reject
        self.budget = ByteBudget(max_inflight_body_bytes if max_inflight_body_bytes is not None else 2**62)
        self.body_timeout = body_timeout

    async def read(self, receive: Receive) -> bytes | None:
        """The whole body (None if the client left first). Its bytes are taken from the budget as they arrive: a
        body read whole holds len(body) of it, which the caller gives back (budget.give_back) when the request
        ends; one that is not (a refusal, a hang-up) gives back what it took here."""
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.body_timeout
        try:
            while True:
                try:
                    message = await asyncio.wait_for(receive(), timeout=max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise self._refused(408, f"the request body did not arrive within {self.body_timeout:g} s",
                                        "body_timeout") from None  # fmt: skip
                if message["type"] == "http.disconnect":
                    self.budget.give_back(size)
                    return None
                chunk = message.get("body", b"")
                if size + len(chunk) > self.max_body_bytes:
                    raise self.too_large()
                if not self.budget.take(len(chunk)):
                    busy = f"the server holds {self.budget.limit} bytes of request bodies in flight; retry shortly"
                    raise self._refused(429, busy, "server_busy", {"Retry-After": "1"})
                size += len(chunk)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        except BaseException:
            self.budget.give_back(size)
            raise

    def too_large(self) -> APIError:
        self.on_reject("body_too_large")
        return APIError(413, f"request body over {self.max_body_bytes} bytes", None, "body_too_large")

    def _refused(self, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> APIError:
        """A refusal while the body arrives: counted, and the connection closed after it (the rest of the body is
        not read)."""
        self.on_reject(code)
        return APIError(status, message, None, code, headers={**(headers or {}), "Connection": "close"})


class Guard:
    """Authenticates (401), bounds the body (413, 408, 429), and turns any unhandled exception into an OpenAI-style
    500.

    The tenant a key belongs to is put in ``scope["state"]["tenant"]``, and the monotonic time the request was read
    whole in ``scope["state"]["arrival_time"]``; ``on_reject(reason)`` counts refusals.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        key_owners: list[tuple[bytes, Tenant]],
        default_tenant: Tenant,
        on_reject: Callable[[str], None],
        on_response: Callable[[str, str, int, float], None] | None = None,
        handler_of: Callable[[str], str] = lambda path: path,
        max_inflight_body_bytes: int | None = None,
        body_timeout: float = 30.0,
    ) -> None:
        self.app = app
        self.bodies = BodyReader(max_body_bytes, on_reject, max_inflight_body_bytes, body_timeout)
        self.on_response = on_response  # (handler, method, status, seconds) of each answered request
        self.handler_of = handler_of  # a path as a bounded label: the route, or "none" for any unknown path
        self.key_owners = key_owners
        self.default_tenant = default_tenant
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status, began = False, 500, time.monotonic()

        async def tracked_send(message: Message) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, tracked_send)
        except APIError as error:
            if not started:
                await send_error(tracked_send, error)
        except Exception:
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not started:  # else the response is cut; the server closes that connection
                await send_error(tracked_send, APIError(500, "internal server error", None, "internal_error"))
        finally:
            if self.on_response is not None:
                path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
                self.on_response(self.handler_of(path), scope["method"], status, time.monotonic() - began)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.bodies.max_body_bytes:
            raise self.bodies.too_large()
        tenant = self._tenant_of(headers.get("authorization", "")) if self.key_owners else self.default_tenant
        if tenant is None and scope["path"] not in PUBLIC_PATHS:
            self.on_reject("unauthorized")
            raise APIError(401, "a valid API key is required (Authorization: Bearer KEY)", None, "invalid_api_key")
        scope.setdefault("state", {})["tenant"] = tenant
        body = b""  # its bytes are held of the body budget until the request ends
        if scope["method"] in ("POST", "PUT", "PATCH"):
            read = await self.bodies.read(receive)
            if read is None:
                return  # the client left before sending its body
            body = read
            receive = _replay(body, receive)
        try:
            # A request arrives when it has been read whole; FCFS order and TTFT count from here, not from when its
            # handler got past tokenization (worker threads finish a burst's requests in any order).
            scope["state"]["arrival_time"] = time.monotonic()
            await self.app(scope, receive, send)
        finally:
            self.bodies.budget.give_back(len(body))

    def _tenant_of(self, header: str) -> Tenant | None:
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        # Compare against every key, in constant time each, so timing says nothing about which was close.
        matches = [t for key, t in self.key_owners if hmac.compare_digest(token.encode(), key)]
        return matches[0] if matches else None


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body once, then the server's own receive (where a disconnect shows)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def send_error(send: Send, error: APIError) -> None:
    payload = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


async def until_disconnected(receive: Receive) -> None:
    """Returns when the client has hung up; only for use once the body has been read."""
    while (await receive())["type"] != "http.disconnect":
        pass
