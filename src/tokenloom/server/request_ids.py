"""vLLM's --enable-request-id-headers: every HTTP response carries X-Request-Id."""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"


class RequestIdHeaders:
    """The request's own X-Request-Id comes back on its response; for a request without one, the id its handler
    named the response after (``request.state.request_id``: serving.py), else a new one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name == HEADER), None)
        state = scope.setdefault("state", {})  # the handler's request.state: copies of the scope share it

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                named = state.get("request_id")
                value = given or (named.encode() if named else uuid.uuid4().hex.encode())
                message = {**message, "headers": [*message.get("headers", []), (HEADER, value)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
