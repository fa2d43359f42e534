"""What every route shares: the server's state on ``app.state.tokenloom``, and the error responses they declare."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from tokenloom.engine.async_engine import AsyncEngine
from tokenloom.server.lora_adapters import ServedAdapters
from tokenloom.server.metrics import ServerMetrics
from tokenloom.server.reasoning import ReasoningParser
from tokenloom.server.response_budget import ResponseBudget
from tokenloom.server.response_models import ErrorResponse
from tokenloom.server.response_store import ResponseStore
from tokenloom.server.responses_background import BackgroundResponses
from tokenloom.server.tenants import TenantLimiter
from tokenloom.server.text_budget import TextBudget
from tokenloom.server.tool_parsers import ToolCallParser
from tokenloom.server_config import ServerConfig

logger = logging.getLogger("tokenloom.requests")


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "Invalid request"),
        (401, "Missing or wrong API key"),
        (404, "Unknown model"),
        (413, "Request body too large"),
        (429, "Over a rate, concurrency, queue or memory limit (see Retry-After)"),
        (503, "Waited too long in the queue, or the server is shutting down"),
    )
}


@dataclass(frozen=True)
class VllmOptions:
    """What vLLM's serve flags set for every response (server_config.py says each)."""

    fastapi_docs: bool = True  # /docs, /redoc, /openapi.json (--disable-fastapi-docs: none)
    request_id_headers: bool = False  # X-Request-Id on every response
    force_include_usage: bool = False  # every stream ends with its usage
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" unless a request says otherwise
    response_role: str = "assistant"  # a chat reply's role when the request opens the assistant's turn
    score_template: bool = False  # --chat-template given: a reranker's pairs go through it (query and document roles)


@dataclass
class ServerState:
    """What the routes share, on ``app.state.tokenloom``."""

    engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str
    limiter: TenantLimiter
    version_info: dict[str, Any]
    sampling_defaults: dict[str, float] = field(default_factory=dict)  # from a generation_config.json
    aliases: tuple[str, ...] = ()  # more names clients may give as `model` (--served-model-name a b)
    tool_call_parser: ToolCallParser | None = None  # tool_choice "auto" is served only with one
    log_requests: bool = False
    max_log_len: int | None = None
    stream_interval: int = 1  # the fewest tokens a streamed chunk after the first carries (--stream-interval)
    response_store: ResponseStore | None = None  # the Responses API's kept responses (--responses-store-bytes)
    prompt_tokens_details: bool = False  # usage says the prompt tokens the prefix cache served (vLLM's flag)
    replica_id: str | None = None  # the Ray Serve replica this server is, named in the ids of the responses it keeps
    text_budget: TextBudget = field(default_factory=lambda: TextBudget.for_bodies_up_to(ServerConfig.max_body_bytes))
    response_budget: ResponseBudget = field(
        default_factory=lambda: ResponseBudget(ServerConfig.max_inflight_response_bytes)
    )
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser: a reply's thought apart from its answer
    options: VllmOptions = field(default_factory=VllmOptions)  # what vLLM's serve flags set for every response
    created_at: int = field(default_factory=lambda: int(time.time()))  # /v1/models: when this server started

    background: BackgroundResponses = field(init=False)  # the Responses API's background responses still running
    adapters: ServedAdapters = field(init=False)  # the LoRA adapters a request may name as its model

    def __post_init__(self) -> None:
        self.metrics.response_bytes.set_function(lambda: self.response_budget.held)
        self.background = BackgroundResponses(self.response_store)
        self.adapters = ServedAdapters(self.engine.check_adapter, self.model_name, {self.model_name, *self.aliases})

    def names_tokens_by_id(self, asked: bool | None) -> bool:
        """Whether a response's logprobs name their tokens "token_id:N": as the request asks, else the server's flag."""
        return self.options.return_tokens_as_token_ids if asked is None else asked

    def served_name(self, model: str | None) -> str:
        """The name a response gives as its model: the adapter's, for a request of one; the base model's otherwise."""
        return model if model is not None and self.adapters.get(model) is not None else self.model_name


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.tokenloom
    return state
