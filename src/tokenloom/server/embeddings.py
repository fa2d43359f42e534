"""``POST /v1/embeddings``: OpenAI's embeddings (vLLM's for a decoder-only model): each input's vector is the final
hidden state of its last token, normalized (pooling_params.py). Admitted like a completion (tenant caps, the queue,
the response budget), each input one request of a single greedy token that is dropped. vLLM's chat form takes
``messages`` instead of ``input``: one conversation through the chat template, embedded as one prompt."""

from __future__ import annotations

import base64
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from tokenloom.outputs import RequestOutput
from tokenloom.pooling_params import PoolingParams
from tokenloom.server.chat import chat_template_tokenizer, templated
from tokenloom.server.errors import APIError
from tokenloom.server.pooled import (
    COMMON_FIELDS,
    PooledList,
    PooledRequest,
    PooledShape,
    checked_state,
    listed_inputs,
)
from tokenloom.server.protocol import (
    ChatMessage,
    ChatTemplateOptions,
    Text,
    TokenId,
)
from tokenloom.server.response_models import Usage
from tokenloom.server.serving import serve_generation, tokenized
from tokenloom.server.state import ERROR_RESPONSES, ServerState

router = APIRouter()


class EmbeddingRequest(PooledRequest, ChatTemplateOptions):
    """OpenAI's request (``input``) or vLLM's chat form (``messages``, through the chat template): one of the two."""

    FIELDS = COMMON_FIELDS | {"input", "encoding_format", "dimensions", "normalize", "messages",
                              "add_generation_prompt", "continue_final_message", "chat_template_kwargs"}  # fmt: skip
    ENDPOINT = "an embeddings"

    input: Text | list[TokenId] | Annotated[list[Text], Field(min_length=1)] | list[list[TokenId]] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool = False  # vLLM's default for a conversation embedded: no assistant's turn opened
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    normalize: bool = True  # vLLM's

    def own_pooling(self) -> PoolingParams:
        return PoolingParams(self.dimensions, self.normalize)


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(PooledList):
    data: list[EmbeddingData]
    usage: EmbeddingUsage


@router.post("/v1/embeddings", responses={200: {"model": EmbeddingResponse}, **ERROR_RESPONSES})
async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
    state = checked_state(body, raw)
    prompts = await embedded_prompts(state, body)
    return await serve_generation(state, raw, body, prompts, None, EmbeddingShape(body.encoding_format))


async def embedded_prompts(state: ServerState, body: EmbeddingRequest) -> list[list[int]]:
    """The inputs' token ids, or the conversation's through the chat template (one prompt)."""
    if (body.input is None) == (body.messages is None):
        raise APIError(400, "send exactly one of input and messages", "input", "invalid_value")
    if body.input is not None:
        return [await tokenized(state, text) for text in listed_inputs(body.input)]
    assert body.messages is not None
    tokenizer = chat_template_tokenizer(state, "send the text as input")
    conversation = [m.for_template() for m in body.messages]
    return [await templated(state.text_budget, tokenizer, conversation, body)]


class EmbeddingShape(PooledShape):
    """How /v1/embeddings words its outputs."""

    id_prefix = "embd-"

    def __init__(self, encoding_format: Literal["float", "base64"]) -> None:
        self.encoding_format = encoding_format

    def response(
        self, request_id: str, created: int, model: str, finals: list[RequestOutput], logprobs: bool, usage: Usage
    ) -> BaseModel:
        data = [EmbeddingData(index=i, embedding=self.encoded(final)) for i, final in enumerate(finals)]
        counted = EmbeddingUsage(prompt_tokens=usage.prompt_tokens, total_tokens=usage.prompt_tokens)
        return EmbeddingResponse(id=request_id, created=created, model=model, data=data, usage=counted)

    def encoded(self, final: RequestOutput) -> list[float] | str:
        vector = self.vector(final)
        if self.encoding_format == "float":
            return vector
        # OpenAI's base64: the float32 values' little-endian bytes (the openai client asks for it, and decodes it).
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
