"""Tenants: who a bearer key belongs to, and the caps that keep one tenant from crowding out the others.

[[tenant]]
name = "alice"
keys = ["sk-alice-1"]
priority = 0                  # lower runs first under the priority policy
weight = 1.0                  # share under the fair policy
max_concurrent_requests = 8   # sequences in flight: a request with n = 4 holds 4
max_tokens = 1024             # cap on a request's max_tokens
max_input_tokens = 4096
requests_per_minute = 600
tokens_per_minute = 200000    # prompt tokens plus max_tokens, counted when a request is admitted
isolate_prefix_cache = true   # cached prefix blocks shared only among this tenant's requests
"""

from __future__ import annotations

import json
import math
import threading
import time
import tomllib
from collections import deque
from dataclasses import dataclass, fields
from pathlib import Path

from tokenloom.server.errors import APIError

WINDOW_S = 60.0
RESERVED_NAME = "default"  # the tenant of the server's own --api-key keys


@dataclass(frozen=True)
class Tenant:
    name: str
    keys: tuple[str, ...]
    priority: int = 0
    weight: float = 1.0
    max_concurrent_requests: int | None = None
    max_tokens: int | None = None
    max_input_tokens: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    # The tenant's requests share cached prefix blocks only among themselves: no other tenant can tell from a faster
    # first token that this one sent a prompt (its requests' cache salts are all its own).
    isolate_prefix_cache: bool = False

    def cache_salt(self, requested: str | None) -> str | None:
        """The salt the engine hashes a request's prefix blocks under: the client's (vLLM's cache_salt), and for an
        isolated tenant its name too. Written as a JSON pair, no salt a client sends equals a tenant's."""
        if not self.isolate_prefix_cache:
            return None if requested is None else json.dumps([None, requested])
        return json.dumps([self.name, requested])


def load_tenants(path: str | Path) -> list[Tenant]:
    """Reads the TOML file; any unknown field, missing key or duplicate key is a clear error."""
    data = tomllib.loads(Path(path).read_text())
    known = {f.name for f in fields(Tenant)}
    tenants: list[Tenant] = []
    seen_keys: set[str] = set()
    for i, entry in enumerate(data.get("tenant", [])):
        unknown = set(entry) - known
        if unknown:
            raise ValueError(f"tenant #{i + 1}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
        if not entry.get("name") or not entry.get("keys"):
            raise ValueError(f"tenant #{i + 1}: needs a name and at least one key")
        if entry["name"] == RESERVED_NAME:
            raise ValueError(f"tenant #{i + 1}: {RESERVED_NAME!r} is the name of the --api-key keys (the operator's)")
        keys = tuple(entry["keys"])
        if seen_keys & set(keys):
            raise ValueError(f"tenant {entry['name']!r}: a key is already used by another tenant")
        seen_keys |= set(keys)
        tenants.append(Tenant(**{**entry, "keys": keys}))
    if not tenants:
        raise ValueError(f"{path} defines no [[tenant]]")
    return tenants


class TenantLimiter:
    """Per-tenant concurrency, request-rate and token-rate accounting; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[str, int] = {}
        self._requests: dict[str, deque[float]] = {}
        self._tokens: dict[str, deque[tuple[float, int]]] = {}

    def check_caps(self, tenant: Tenant, prompt_tokens: int, max_tokens: int | None, sequences: int = 1) -> None:
        """Per-request caps: 400, since sending the same request again cannot succeed."""
        cap = tenant.max_concurrent_requests
        if cap is not None and sequences > cap:
            raise APIError(
                400,
                f"the request asks for {sequences} sequences (prompts times n), over this key's cap of {cap} at once",
                "n",
                "concurrency_over_cap",
            )
        if tenant.max_tokens is not None and max_tokens is not None and max_tokens > tenant.max_tokens:
            raise APIError(
                400,
                f"max_tokens {max_tokens} is over this key's cap of {tenant.max_tokens}",
                "max_tokens",
                "max_tokens_over_cap",
            )
        if tenant.max_input_tokens is not None and prompt_tokens > tenant.max_input_tokens:
            raise APIError(
                400,
                f"the prompt has {prompt_tokens} tokens, over this key's cap of {tenant.max_input_tokens}",
                "prompt",
                "input_over_cap",
            )

    def acquire(self, tenant: Tenant, tokens: int, sequences: int = 1) -> None:
        """Takes a concurrency slot per sequence and charges the rate windows, or raises 429 with a Retry-After.

        The cap counts sequences, not HTTP requests: one request with n = 128 runs 128 of them."""
        now = time.monotonic()
        with self._lock:
            requests = self._requests.setdefault(tenant.name, deque())
            charged = self._tokens.setdefault(tenant.name, deque())
            while requests and now - requests[0] > WINDOW_S:
                requests.popleft()
            while charged and now - charged[0][0] > WINDOW_S:
                charged.popleft()
            active = self._active.get(tenant.name, 0)
            if tenant.max_concurrent_requests is not None and active + sequences > tenant.max_concurrent_requests:
                cap = tenant.max_concurrent_requests
                raise _too_many(
                    f"{active} sequences in flight, {sequences} more asked for, the cap is {cap}",
                    "concurrency_limit",
                    1,
                )
            if tenant.requests_per_minute is not None and len(requests) >= tenant.requests_per_minute:
                raise _too_many(
                    f"over {tenant.requests_per_minute} requests per minute",
                    "request_rate_limit",
                    WINDOW_S - (now - requests[0]),
                )
            used = sum(n for _, n in charged)
            if tenant.tokens_per_minute is not None and used + tokens > tenant.tokens_per_minute:
                wait = WINDOW_S - (now - charged[0][0]) if charged else WINDOW_S
                raise _too_many(f"over {tenant.tokens_per_minute} tokens per minute", "token_rate_limit", wait)
            self._active[tenant.name] = active + sequences
            requests.append(now)
            charged.append((now, tokens))

    def release(self, tenant: Tenant, sequences: int = 1) -> None:
        with self._lock:
            self._active[tenant.name] -= sequences
            assert self._active[tenant.name] >= 0


def _too_many(message: str, code: str, retry_after: float) -> APIError:
    return APIError(429, message, None, code, headers={"Retry-After": str(max(1, math.ceil(retry_after)))})
