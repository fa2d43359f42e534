"""``POST /v1/completions``: OpenAI's completions, vLLM's extras; how its outputs are worded, whole and streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from tokenloom.model.loader import Tokenizer
from tokenloom.outputs import RequestOutput
from tokenloom.server.logprobs import (
    completion_logprobs_body,
    logprob_namer,
    prompt_logprobs_body,
    vllm_prompt_logprobs,
)
from tokenloom.server.protocol import CompletionRequest
from tokenloom.server.response_models import (
    ChunkObject,
    CompletionChoice,
    CompletionResponse,
    CompletionStreamChoice,
    Usage,
)
from tokenloom.server.serving import check_model, serve_generation, tokenized
from tokenloom.server.state import ERROR_RESPONSES, server_state
from tokenloom.server.streaming import ChoiceChunks, text_deltas

router = APIRouter()


@router.post("/v1/completions", responses={200: {"model": CompletionResponse}, **ERROR_RESPONSES})
async def completions(body: CompletionRequest, raw: Request) -> Response:
    state = server_state(raw)
    check_model(body, state)
    body.refuse_unsupported()
    structured = body.structured_output()
    prompts = [await tokenized(state, prompt) for prompt in body.prompts()]
    shape = CompletionShape(
        state.engine.tokenizer, body.echo, state.names_tokens_by_id(body.return_tokens_as_token_ids),
        body.prompt_logprobs is not None,
        body.return_token_ids,
    )  # fmt: skip
    return await serve_generation(state, raw, body, prompts, body.logprobs, shape, structured)


class CompletionShape(ChoiceChunks):
    """How /v1/completions words a request's outputs: whole, and as stream chunks. With ``echo`` the prompt comes
    first (in the first chunk of a stream), with its tokens' logprobs when logprobs are asked for."""

    chunk_object: ChunkObject = "text_completion"
    id_prefix = "cmpl-"

    def __init__(
        self, tokenizer: Tokenizer | None, echo: bool = False, token_ids_as_text: bool = False,
        prompt_logprobs: bool = False, token_ids: bool = False,
    ) -> None:  # fmt: skip
        self.token_ids = token_ids  # vLLM's return_token_ids
        self.tokenizer = tokenizer
        self.echo = echo
        self.prompt_logprobs = prompt_logprobs  # vLLM's field: each choice carries its prompt's
        self.namer = logprob_namer(tokenizer, token_ids_as_text)  # names the logprobs' tokens

    def response(
        self, request_id: str, created: int, model: str, finals: list[RequestOutput], logprobs: bool, usage: Usage
    ) -> BaseModel:
        choices = []
        for index, final in enumerate(finals):
            completion = final.outputs[0]
            prefix, lp, offset = self._echoed(final, logprobs)
            if logprobs:
                lp = _joined(lp, completion_logprobs_body(final, self.namer, 0, offset)[0])
            prompt_lp = vllm_prompt_logprobs(final, self.namer) if self.prompt_logprobs else None
            ids = {"prompt_token_ids": final.prompt_token_ids, "token_ids": completion.token_ids}
            choices.append(
                CompletionChoice(
                    index=index, text=prefix + completion.text, logprobs=lp, finish_reason=completion.finish_reason,
                    prompt_logprobs=prompt_lp, **(ids if self.token_ids else {}),
                )
            )  # fmt: skip
        return CompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage)

    async def chunks(
        self, stream: AsyncIterator[RequestOutput], logprobs: bool
    ) -> AsyncIterator[tuple[CompletionStreamChoice, RequestOutput]]:
        """A chunk for every step that gave the request a token, as vLLM streams: its text may be empty (the bytes of
        an unfinished character, or text held back while it may begin a stop string), but the client learns the
        token came (TTFT is timed on it). Each carries the logprobs of the tokens since the last, when asked for."""
        text_offset, first = 0, True
        async for delta, finish_reason, output in text_deltas(stream):
            prefix, lp = "", None
            if first:
                prefix, lp, text_offset = self._echoed(output, logprobs)
                first = False
            if logprobs:
                new, text_offset = completion_logprobs_body(output, self.namer, 0, text_offset)
                lp = _joined(lp, new)
            choice = CompletionStreamChoice(index=0, text=prefix + delta, logprobs=lp, finish_reason=finish_reason)
            yield choice, output

    def _echoed(self, output: RequestOutput, logprobs: bool) -> tuple[str, dict[str, Any] | None, int]:
        """(the prompt's text, its logprobs, the text offset after it) under echo; else nothing."""
        if not self.echo:
            return "", None, 0
        prompt = output.prompt if output.prompt is not None else _decoded(self.tokenizer, output.prompt_token_ids)
        if not logprobs:
            return prompt, None, len(prompt)
        body, offset = prompt_logprobs_body(output, self.namer)
        return prompt, body, offset


def _joined(first: dict[str, Any] | None, second: dict[str, Any]) -> dict[str, Any]:
    """Two runs of completion logprobs as one (prompt, then completion)."""
    return second if first is None else {key: first[key] + second[key] for key in second}


def _decoded(tokenizer: Tokenizer | None, token_ids: list[int]) -> str:
    return "" if tokenizer is None else str(tokenizer.decode(token_ids))
