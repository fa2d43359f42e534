"""What the endpoints that answer with vectors of prompts rather than text share (/v1/embeddings, /score, /rerank):
each prompt is one request of a single greedy token that is dropped, its vector read from its last prompt row
(pooling_params.py); a generation field is refused by name, and nothing is streamed."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import ClassVar, Literal, cast

from fastapi import Request
from pydantic import BaseModel, PrivateAttr

from tokenloom.outputs import RequestOutput
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams, StructuredOutputsParams
from tokenloom.server.errors import APIError
from tokenloom.server.protocol import MAX_CHOICES, StreamOptions, _Common
from tokenloom.server.response_models import Usage
from tokenloom.server.serving import check_model
from tokenloom.server.state import ServerState, server_state
from tokenloom.server.streaming import UsageCount

COMMON_FIELDS = frozenset({"model", "user", "truncate_prompt_tokens", "request_id", "priority", "cache_salt"})


class PooledRequest(_Common):
    """A request answered with its prompts' vectors: FIELDS are what it may carry (the generation fields it inherits
    are refused by name, not ignored)."""

    FIELDS: ClassVar[frozenset[str]] = COMMON_FIELDS
    ENDPOINT: ClassVar[str]
    _scored_by: PoolingParams | None = PrivateAttr(default=None)  # the classifier's pooling, where the model is one

    def refuse_generation_fields(self) -> None:
        extra = sorted(self.model_fields_set - self.FIELDS)
        if extra:
            raise APIError(400, f"{extra[0]} is not a field of {self.ENDPOINT} request", extra[0], "unsupported")

    def requested_max_tokens(self) -> int | None:
        return 1  # the one token every request samples, dropped

    def score_with(self, classifier: PoolingParams) -> None:
        """Its prompts are classified (scored) by the model's classifier rather than embedded."""
        self._scored_by = classifier

    def pooling(self) -> PoolingParams:
        """The classifier's pooling where the model is one (score_with), else this endpoint's own."""
        return self._scored_by or self.own_pooling()

    def own_pooling(self) -> PoolingParams:
        return PoolingParams()

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        defaults: dict[str, float] | None = None,
        structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        return SamplingParams.for_embedding(self.pooling())


class PooledList(BaseModel):
    """What a pooled endpoint's response starts with (vLLM's and OpenAI's): its data and usage follow."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str


def prompts_only(usage: Usage) -> Usage:
    """A pooled request's usage, as vLLM counts it: its prompts' tokens, no completion (its one token is dropped)."""
    return Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=0, total_tokens=usage.prompt_tokens)


def listed_inputs(given: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """A pooled request's inputs as a list: one text or token list, or a list of them (1 to MAX_CHOICES)."""
    one = isinstance(given, str) or all(isinstance(t, int) for t in given)
    inputs = [cast(str | list[int], given)] if one else list(cast(list[str | list[int]], given))
    if not inputs or len(inputs) > MAX_CHOICES:
        raise APIError(400, f"input must hold 1 to {MAX_CHOICES} texts or token lists", "input", "invalid_value")
    return inputs


def checked_state(body: PooledRequest, raw: Request) -> ServerState:
    """The server's state, once the request names a model served here and carries no generation field."""
    state = server_state(raw)
    check_model(body, state)
    body.refuse_generation_fields()
    return state


class PooledShape:
    """How a pooled endpoint words its outputs: whole only."""

    end_frame: str | None = None

    @staticmethod
    def vector(final: RequestOutput) -> list[float]:
        if final.embedding is None:
            raise APIError(500, f"the embedding failed: {final.error}", None, "server_error")
        return final.embedding

    def sse_frames(
        self, streams: list[AsyncIterator[RequestOutput]], logprobs: bool, request_id: str, created: int, model: str,
        counting: UsageCount, options: StreamOptions,
    ) -> AsyncGenerator[str]:  # fmt: skip
        raise AssertionError("a pooled request is never streamed: stream is refused as a generation field")

    def error_frame(self, error: APIError) -> str:
        raise AssertionError("a pooled request is never streamed")
