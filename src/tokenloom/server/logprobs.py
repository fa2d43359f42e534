"""Logprobs as the OpenAI API words them: chat's ``content`` entries, completions' parallel arrays, prompt logprobs.

All three read a token's entry the same way (``ranked``): its own logprob, and the alternatives the sampler ranked
(from 1, best first); an entry's other keys (the chosen token, when it was not among them) are not alternatives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenloom.model.loader import Tokenizer
from tokenloom.outputs import Logprob, RequestOutput

LOWEST_LOGPROB = -9999.0  # vLLM's floor for the logprobs it returns (-inf is not JSON)


class TokenIdsAsText:
    """vLLM's return_tokens_as_token_ids: each token of the logprobs named "token_id:N" instead of its text (a client
    that trains on the tokens reads them back exactly, where a token's text may not re-encode to it)."""

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(f"token_id:{token_id}" for token_id in token_ids)


def logprob_namer(tokenizer: Tokenizer | None, token_ids_as_text: bool) -> Tokenizer | None:
    """What names the tokens of a response's logprobs: the tokenizer (their text), or their ids."""
    return TokenIdsAsText() if token_ids_as_text else tokenizer


@dataclass
class TokenLogprobs:
    """One token as the API shows it: its text, its logprob and its ranked alternatives (None where nothing
    predicted the token: a prompt's first)."""

    text: str
    logprob: float | None
    top: list[tuple[str, float]] | None


def ranked(
    token_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None], tokenizer: Tokenizer | None
) -> list[TokenLogprobs]:
    """Each token with its entry, alternatives in rank order."""
    tokens = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            tokens.append(TokenLogprobs(_token_text(tokenizer, token_id), None, None))
            continue
        alternatives = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank is not None)
        top = [(_token_text(tokenizer, t), _shown(logprob)) for _, t, logprob in alternatives]
        tokens.append(TokenLogprobs(_token_text(tokenizer, token_id), _shown(entry[token_id].logprob), top))
    return tokens


def _shown(logprob: float) -> float:
    """A logprob as JSON can carry it: a token a grammar ruled out has -inf, shown as vLLM shows it (-9999.0)."""
    return max(logprob, LOWEST_LOGPROB)


def chat_logprobs_body(output: RequestOutput, tokenizer: Tokenizer | None, start: int = 0) -> dict[str, Any]:
    """OpenAI's chat logprobs of the output's tokens from `start` on."""
    return chat_logprobs_of(_generated(output, tokenizer, start))


def chat_logprobs_of(tokens: list[TokenLogprobs]) -> dict[str, Any]:
    """OpenAI's chat logprobs of these tokens."""
    content = [
        {
            "token": token.text,
            "logprob": token.logprob,
            "bytes": list(token.text.encode()),
            "top_logprobs": [
                {"token": text, "logprob": logprob, "bytes": list(text.encode())} for text, logprob in token.top or []
            ],
        }
        for token in tokens
    ]
    return {"content": content}


def completion_logprobs_body(
    output: RequestOutput, tokenizer: Tokenizer | None, start: int = 0, offset: int = 0
) -> tuple[dict[str, Any], int]:
    """OpenAI's completion logprobs of the output's tokens from `start` on, whose text begins at `offset`; and the
    offset after them (for the next stream chunk)."""
    return _parallel_arrays(_generated(output, tokenizer, start), offset)


def prompt_logprobs_body(output: RequestOutput, tokenizer: Tokenizer | None) -> tuple[dict[str, Any], int]:
    """Completion logprobs of the prompt's tokens (the first has none: nothing predicts it), and the offset after."""
    entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
    return _parallel_arrays(ranked(output.prompt_token_ids, entries, tokenizer), 0)


def vllm_prompt_logprobs(output: RequestOutput, tokenizer: Tokenizer | None) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: per prompt token, by token id, the token itself and the ranked alternatives."""
    entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
    return [None if entry is None else {str(t): _vllm_entry(t, lp, tokenizer) for t, lp in entry.items()}
            for entry in entries]  # fmt: skip


def _vllm_entry(token_id: int, logprob: Logprob, tokenizer: Tokenizer | None) -> dict[str, Any]:
    """vLLM's Logprob as JSON: the rank is None for the prompt's token where it was not among the top."""
    return {"logprob": _shown(logprob.logprob), "rank": logprob.rank, "decoded_token": _token_text(tokenizer, token_id)}


def _generated(output: RequestOutput, tokenizer: Tokenizer | None, start: int) -> list[TokenLogprobs]:
    """The first choice's tokens from `start` on that have logprobs."""
    completion = output.outputs[0]
    return generated_logprobs(completion.token_ids[start:], (completion.logprobs or [])[start:], tokenizer)


def generated_logprobs(
    token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], tokenizer: Tokenizer | None
) -> list[TokenLogprobs]:
    """Generated tokens with their entries, as far as both go."""
    count = min(len(token_ids), len(entries))
    return ranked(token_ids[:count], entries[:count], tokenizer)


def _parallel_arrays(tokens: list[TokenLogprobs], offset: int) -> tuple[dict[str, Any], int]:
    """Completions' shape: tokens, their logprobs, their alternatives by text and each token's text offset."""
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token.text)
    body = {
        "tokens": [token.text for token in tokens],
        "token_logprobs": [token.logprob for token in tokens],
        "top_logprobs": [None if token.top is None else dict(token.top) for token in tokens],
        "text_offset": offsets,
    }
    return body, offset


def _token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)
