"""A request's changes to chosen logits before sampling: its ``allowed_token_ids`` (vLLM's: every other token
banned, -inf), its ``logit_bias`` (OpenAI's: a value added to a token's logit), while its output is shorter than
``min_tokens`` its stop tokens banned so that they cannot be sampled, as vLLM's MinTokensLogitsProcessor and
transformers' ``min_new_tokens`` do, and the last token of each of its ``bad_words`` where the output ends with the
word's other tokens (vLLM's bad words; transformers' ``bad_words_ids`` over the output).

They touch a few rows (the biases a few logits of each), so they are applied where they are, in place, as the
penalties are (penalties.py), and before them, in vLLM's order. Raw logprobs are taken before any.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from tokenloom.core.request import PLACEHOLDER_TOKEN
from tokenloom.model.loader import Tokenizer
from tokenloom.model.step_inputs import to_device
from tokenloom.sampling_params import SamplingParams


def bad_word_sequences(tokenizer: Tokenizer, words: Sequence[str]) -> list[list[int]]:
    """vLLM's token sequences of bad words: each word (its leading spaces stripped) alone, and after a space where
    that is another first token and as many tokens (a word inside a text)."""
    sequences = []
    for word in words:
        bare = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if not bare:  # a word of characters the tokenizer drops: nothing to ban
            continue
        sequences.append(bare)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return sequences


def changed_rows(params: Sequence[SamplingParams], output_index: Sequence[int]) -> list[int]:
    """The rows whose logits this module changes: allowed tokens, a logit bias, bad words, or an output still short
    of its min_tokens (row r samples its request's output token output_index[r])."""
    assert len(params) == len(output_index), "an output index a row"
    # min_tokens is 0 for nearly every request: the index is read only where it is not (a step's host time)
    return [row for row, p in enumerate(params)
            if p.logit_bias or p.allowed_token_ids or p.bad_words_token_ids
            or (p.min_tokens and output_index[row] < p.min_tokens)]  # fmt: skip


def apply_token_biases(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_index: Sequence[int],
    eos_token_ids: Sequence[int],
    history_of: Callable[[int], Sequence[int]] | None = None,
) -> Callable[[], None]:
    """Bans every token but a row's allowed ones, adds its logit bias to its logits and, where its output index is
    below its min_tokens, -inf to its stop tokens (its stop_token_ids, and the model's end-of-sequence ids unless it
    ignores them), and to its bad words' last tokens where due, in place; returns what puts the changed logits back
    (the runner samples row by row from the model's logits after a failure). history_of(row): the row's request's
    output tokens and then its drafts (row r's output so far is its first output_index[r]), read only for a row
    whose bad words have several tokens."""
    rows = changed_rows(params, output_index)
    if not rows:
        return lambda: None
    allowed = [row for row in rows if params[row].allowed_token_ids]
    restore_rows = _keep_only_allowed(logits, allowed, [params[row].allowed_token_ids or [] for row in allowed])

    def history(row: int) -> Sequence[int] | None:
        return history_of(row) if history_of is not None and params[row].bad_words_read_the_output else None

    entries = {row: _row_entries(params[row], output_index[row], eos_token_ids, history(row)) for row in rows}
    restore_entries = _add_biases(logits, {row: entry for row, entry in entries.items() if len(entry[0])})

    def restore() -> None:
        restore_entries()
        restore_rows()  # last: the whole rows as the model gave them

    return restore


def _keep_only_allowed(logits: torch.Tensor, rows: list[int], allowed: list[list[int]]) -> Callable[[], None]:
    """Sets every logit of these rows but their allowed tokens' to -inf; returns what puts the rows back."""
    if not rows:
        return lambda: None
    device = logits.device
    index = to_device(np.asarray(rows, dtype=np.int64), device)
    original = logits[index]
    keep = torch.zeros_like(original, dtype=torch.bool)
    counts = [len(tokens) for tokens in allowed]
    at = np.repeat(np.arange(len(rows), dtype=np.int64), counts)
    tokens = np.concatenate([np.asarray(t, dtype=np.int64) for t in allowed])
    keep[to_device(at, device), to_device(tokens, device)] = True
    logits[index] = original.masked_fill(~keep, float("-inf"))

    def restore() -> None:
        logits[index] = original

    return restore


def _add_biases(logits: torch.Tensor, entries: dict[int, tuple[np.ndarray, np.ndarray]]) -> Callable[[], None]:
    """Adds each row's values to its tokens' logits (entries: row -> (tokens, values)); returns what puts them back."""
    if not entries:
        return lambda: None
    device = logits.device
    rows = np.fromiter(entries, dtype=np.int64, count=len(entries))
    where = (
        to_device(np.repeat(rows, [len(tokens) for tokens, _ in entries.values()]), device),
        to_device(np.concatenate([tokens for tokens, _ in entries.values()]), device),
    )
    original = logits[where]
    # accumulate: a token both biased and banned gets both (-inf), whichever comes first
    values = np.concatenate([values for _, values in entries.values()])
    logits.index_put_(where, to_device(values, device), accumulate=True)

    def restore() -> None:
        logits.index_put_(where, original)

    return restore


def _row_entries(
    params: SamplingParams, output_index: int, eos_token_ids: Sequence[int], history: Sequence[int] | None
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, values to add) of one row."""
    bias = params.logit_bias or {}
    tokens = list(bias)
    values = list(bias.values())
    banned = _bad_words_due(params.bad_words_token_ids or [], history, output_index)
    if output_index < params.min_tokens:
        banned += [*params.stop_token_ids, *([] if params.ignore_eos else eos_token_ids)]
    tokens += banned
    values += [float("-inf")] * len(banned)
    return np.asarray(tokens, dtype=np.int64), np.asarray(values, dtype=np.float32)


def _bad_words_due(words: Sequence[Sequence[int]], history: Sequence[int] | None, output_index: int) -> list[int]:
    """The last token of each bad word whose other tokens end the output so far (the output only, as vLLM reads it,
    not the prompt)."""
    banned = []
    for word in words:
        before = len(word) - 1
        if before == 0:
            banned.append(word[0])
            continue
        if before > output_index:
            continue
        assert history is not None and len(history) >= output_index, "a row whose bad words read its output has it"
        tail = history[output_index - before : output_index]
        assert PLACEHOLDER_TOKEN not in tail, "bad words read settled tokens: no step is scheduled ahead of them"
        if list(tail) == list(word[:-1]):
            banned.append(word[-1])
    return banned
