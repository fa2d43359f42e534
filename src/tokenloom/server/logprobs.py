"""Logprobs as the OpenAI API words them: chat's ``content`` entries, completions' parallel arrays, prompt logprobs."""

from __future__ import annotations

from typing import Any

from tokenloom.model.loader import Tokenizer
from tokenloom.outputs import RequestOutput


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def chat_logprobs_body(output: RequestOutput, tokenizer: Tokenizer | None, start: int = 0) -> dict[str, Any]:
    """OpenAI's chat logprobs of the output's tokens from `start` on."""
    completion = output.outputs[0]
    content = []
    for token_id, entry in zip(completion.token_ids[start:], (completion.logprobs or [])[start:], strict=False):
        text = _token_text(tokenizer, token_id)
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda x: x[1].rank or 0)
        content.append(
            {
                "token": text,
                "logprob": entry[token_id].logprob,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": _token_text(tokenizer, t),
                        "logprob": lp.logprob,
                        "bytes": list(_token_text(tokenizer, t).encode()),
                    }
                    for t, lp in top
                ],
            }
        )
    return {"content": content}


def completion_logprobs_body(
    output: RequestOutput, tokenizer: Tokenizer | None, start: int = 0, offset: int = 0
) -> tuple[dict[str, Any], int]:
    """OpenAI's completion logprobs of the output's tokens from `start` on, whose text begins at `offset`; and the
    offset after them (for the next stream chunk)."""
    completion = output.outputs[0]
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(completion.token_ids[start:], (completion.logprobs or [])[start:], strict=False):
        text = _token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(entry[token_id].logprob)
        top_logprobs.append({_token_text(tokenizer, t): lp.logprob for t, lp in entry.items() if lp.rank is not None})
        offsets.append(offset)
        offset += len(text)
    body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
    return body, offset


def prompt_logprobs_body(output: RequestOutput, tokenizer: Tokenizer | None) -> tuple[dict[str, Any], int]:
    """Completion logprobs of the prompt's tokens (the first has none: nothing predicts it), and the offset after."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = 0
    entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
    for token_id, entry in zip(output.prompt_token_ids, entries, strict=True):
        text = _token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(None if entry is None else entry[token_id].logprob)
        top = None if entry is None else {_token_text(tokenizer, t): lp.logprob for t, lp in entry.items() if lp.rank}
        top_logprobs.append(top)
        offsets.append(offset)
        offset += len(text)
    body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
    return body, offset
