"""The one exception the server answers with: an HTTP status and OpenAI's error body."""

from __future__ import annotations

from typing import Any

from tokenloom.utils import without_source_locations


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 429: "rate_limit_error", 404: "not_found_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )
        message = without_source_locations(self.message) or self.message
        return {"error": {"message": message, "type": kind, "param": self.param, "code": self.code}}
