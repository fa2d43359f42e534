"""``POST /v1/embeddings``: OpenAI's embeddings (vLLM's for a decoder-only model): each input's vector is the final
hidden state of its last token, normalized (pooling_params.py). Admitted like a completion (tenant caps, the queue,
the response budget), each input one request of a single greedy token that is dropped. vLLM's chat form takes
``messages`` instead of ``input``: one conversation through the chat template, embedded as one prompt."""

from __future__ import annotations

import base64
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Literal, cast

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from tokenloom.outputs import RequestOutput
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams, StructuredOutputsParams
from tokenloom.server.chat import chat_template_tokenizer, templated
from tokenloom.server.errors import APIError
from tokenloom.server.protocol import (
    MAX_CHOICES,
    ChatMessage,
    ChatTemplateOptions,
    StreamOptions,
    Text,
    TokenId,
    _Common,
)
from tokenloom.server.response_models import Usage
from tokenloom.server.serving import check_model, serve_generation, tokenized
from tokenloom.server.state import ERROR_RESPONSES, ServerState, server_state
from tokenloom.server.streaming import UsageCount

router = APIRouter()

# What an embeddings request may carry: OpenAI's fields, and vLLM's that apply to a prompt alone. A generation
# field (stream, temperature, ...) is refused by name, not ignored.
EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user", "normalize",
                              "truncate_prompt_tokens", "request_id", "priority", "cache_salt", "messages",
                              "add_generation_prompt", "continue_final_message", "chat_template_kwargs"})  # fmt: skip


class EmbeddingRequest(_Common, ChatTemplateOptions):
    """OpenAI's request (``input``) or vLLM's chat form (``messages``, through the chat template): one of the two."""

    input: Text | list[TokenId] | Annotated[list[Text], Field(min_length=1)] | list[list[TokenId]] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool = False  # vLLM's default for a conversation embedded: no assistant's turn opened
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    normalize: bool = True  # vLLM's

    def refuse_generation_fields(self) -> None:
        extra = sorted(self.model_fields_set - EMBEDDING_FIELDS)
        if extra:
            raise APIError(400, f"{extra[0]} is not a field of an embeddings request", extra[0], "unsupported")

    def inputs(self) -> list[str | list[int]]:
        given = self.input
        assert given is not None, "the chat form has no inputs"
        one = isinstance(given, str) or all(isinstance(t, int) for t in given)
        inputs = [cast(str | list[int], given)] if one else list(cast(list[str | list[int]], given))
        if not inputs or len(inputs) > MAX_CHOICES:
            raise APIError(400, f"input must hold 1 to {MAX_CHOICES} texts or token lists", "input", "invalid_value")
        return inputs

    def requested_max_tokens(self) -> int | None:
        return 1  # the one token every request samples, dropped

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        defaults: dict[str, float] | None = None,
        structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        return SamplingParams.for_embedding(PoolingParams(self.dimensions, self.normalize))


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


@router.post("/v1/embeddings", responses={200: {"model": EmbeddingResponse}, **ERROR_RESPONSES})
async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
    state = server_state(raw)
    check_model(body, state)
    body.refuse_generation_fields()
    prompts = await _prompts(state, body)
    return await serve_generation(state, raw, body, prompts, None, EmbeddingShape(body.encoding_format))


async def _prompts(state: ServerState, body: EmbeddingRequest) -> list[list[int]]:
    """The inputs' token ids, or the conversation's through the chat template (one prompt)."""
    if (body.input is None) == (body.messages is None):
        raise APIError(400, "send exactly one of input and messages", "input", "invalid_value")
    if body.messages is None:
        return [await tokenized(state, text) for text in body.inputs()]
    tokenizer = chat_template_tokenizer(state, "send the text as input")
    conversation = [m.for_template() for m in body.messages]
    return [await templated(state.text_budget, tokenizer, conversation, body)]


class EmbeddingShape:
    """How /v1/embeddings words its outputs: whole only (embeddings are not streamed)."""

    id_prefix = "embd-"
    end_frame: str | None = None

    def __init__(self, encoding_format: Literal["float", "base64"]) -> None:
        self.encoding_format = encoding_format

    def response(
        self, request_id: str, created: int, model: str, finals: list[RequestOutput], logprobs: bool, usage: Usage
    ) -> BaseModel:
        data = [EmbeddingData(index=i, embedding=self._encoded(final)) for i, final in enumerate(finals)]
        counted = EmbeddingUsage(prompt_tokens=usage.prompt_tokens, total_tokens=usage.prompt_tokens)
        return EmbeddingResponse(id=request_id, created=created, model=model, data=data, usage=counted)

    def _encoded(self, final: RequestOutput) -> list[float] | str:
        if final.embedding is None:
            raise APIError(500, f"the embedding failed: {final.error}", None, "server_error")
        if self.encoding_format == "float":
            return final.embedding
        # OpenAI's base64: the float32 values' little-endian bytes (the openai client asks for it, and decodes it).
        return base64.b64encode(np.asarray(final.embedding, dtype="<f4").tobytes()).decode()

    def sse_frames(
        self, streams: list[AsyncIterator[RequestOutput]], logprobs: bool, request_id: str, created: int, model: str,
        counting: UsageCount, options: StreamOptions,
    ) -> AsyncGenerator[str]:  # fmt: skip
        raise AssertionError("an embeddings request is never streamed: stream is refused as a generation field")

    def error_frame(self, error: APIError) -> str:
        raise AssertionError("an embeddings request is never streamed")
