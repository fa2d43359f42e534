"""vLLM's ``POST /tokenize`` and ``POST /detokenize``."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from tokenloom.server.chat import templated
from tokenloom.server.errors import APIError
from tokenloom.server.protocol import DetokenizeRequest, TokenizeRequest
from tokenloom.server.response_models import DetokenizeResponse, TokenizeResponse
from tokenloom.server.serving import check_model, require_tokenizer
from tokenloom.server.state import ERROR_RESPONSES, server_state

router = APIRouter()


@router.post("/tokenize", responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, raw: Request) -> TokenizeResponse:
    """As vLLM's: a prompt's tokens (or a conversation's, through the chat template), counted."""
    state = server_state(raw)
    check_model(body, state)
    tokenizer = require_tokenizer(state.engine)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send exactly one of prompt and messages", "prompt", "invalid_value")
    if body.messages is not None:
        conversation = [m.for_template() for m in body.messages]
        ids = await templated(state.text_budget, tokenizer, conversation, body)
    else:
        prompt, special = body.prompt, body.add_special_tokens
        assert prompt is not None  # exactly one of the two, checked above
        ids = list(await state.text_budget.run(len(prompt), tokenizer.encode, prompt, add_special_tokens=special))
    strs = [tokenizer.convert_ids_to_tokens(i) for i in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=state.engine.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize", responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, raw: Request) -> DetokenizeResponse:
    state = server_state(raw)
    check_model(body, state)
    tokenizer = require_tokenizer(state.engine)
    vocab = state.engine.vocab_size
    if any(t >= vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", "tokens", "invalid_value")
    return DetokenizeResponse(prompt=await asyncio.to_thread(tokenizer.decode, body.tokens))
