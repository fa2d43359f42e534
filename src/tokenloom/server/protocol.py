"""The request bodies of the OpenAI API that tokenloom accepts, and its error body."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tokenloom.sampling_params import SamplingParams


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
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    # Unknown fields are tolerated (clients send extras such as "user"); unsupported known ones are refused below.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int | None = None  # else the tenant's
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise APIError(400, "n > 1 is not supported; send several requests instead", "n", "unsupported")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported", "best_of", "unsupported")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias", "unsupported")
        for name in ("tools", "tool_choice", "functions", "function_call", "suffix", "echo"):
            value = (self.model_extra or {}).get(name)
            if value not in (None, False, "", [], "none"):
                raise APIError(400, f"{name} is not supported by tokenloom", name, "unsupported")
        response_format = (self.model_extra or {}).get("response_format")
        if response_format and response_format.get("type", "text") != "text":
            raise APIError(400, "only the text response_format is supported", "response_format", "unsupported")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens", "invalid_value")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                seed=self.seed,
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
            )
        except ValueError as error:
            raise APIError(400, str(error).removeprefix("SamplingParams: "), None, "invalid_value") from error


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
            raise APIError(400, "batched prompts are not supported; send one prompt per request", "prompt")
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = [p.get("text", "") for p in self.content if p.get("type") == "text"]
            if len(parts) != len(self.content):
                raise APIError(400, "only text content parts are supported", "messages")
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
