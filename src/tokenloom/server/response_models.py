"""The OpenAI API's bodies as tokenloom writes them: responses, stream chunks and the error body (the requests it
reads are protocol.py's)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from tokenloom.server.protocol import ToolCall


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens the prefix cache served


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # vLLM's --enable-prompt-tokens-details


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenloom"
    max_model_len: int
    root: str | None = None  # what is served: the checkpoint, or a LoRA adapter's directory
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# vLLM's prompt_logprobs: per prompt token (None for the first, which nothing predicts), by token id, the prompt's
# token and the top alternatives: {"logprob", "rank", "decoded_token"}.
PromptLogprobs = list[dict[str, dict[str, Any]] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: the prompt's and the completion's ids
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: str = "assistant"  # or --response-role's, or the continued message's
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning: str | None = None  # the thought, with --reasoning-parser (vLLM's field, and its older name below)
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatDelta(BaseModel):
    """What a chat stream chunk adds to the message: only the fields given are sent (the role with the first, content
    or tool-call deltas after, nothing with the finish reason), as OpenAI and vLLM send them."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # deltas: index, then id, type and name with a call's first
    reasoning: str | None = None  # with --reasoning-parser: the thought as it grows, under both of vLLM's names
    reasoning_content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    token_ids: list[int] | None = None  # vLLM's return_token_ids: the tokens since the last chunk (sent when set)


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: with the choice's first chunk
    token_ids: list[int] | None = None


ChunkObject = Literal["text_completion", "chat.completion.chunk"]


class StreamChunk(BaseModel):
    """One Server-Sent Event of a stream: a choice's chunk, or (choices empty) the usage at the end. Sent as
    ``model_dump(exclude_unset=True)``: usage only where a chunk carries it, a delta only with its fields."""

    id: str
    object: ChunkObject
    created: int
    model: str
    choices: list[CompletionStreamChoice | ChatStreamChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # a chat stream's first chunk, with vLLM's return_token_ids

    def sent(self) -> str:
        """The event's JSON, by pydantic's serializer: a third of json.dumps over model_dump's dict (3 against 8 us a
        chunk), which a server streaming tens of thousands of tokens a second pays for each."""
        return self.model_dump_json(exclude_unset=True)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error tokenloom sends has this body, as OpenAI's API does."""

    error: ErrorDetail
