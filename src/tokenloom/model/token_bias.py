"""A request's fixed changes to chosen logits before sampling: its ``allowed_token_ids`` (vLLM's: every other
token banned, -inf), its ``logit_bias`` (OpenAI's: a value added to a token's logit) and, while its output is
shorter than ``min_tokens``, its stop tokens banned so that they cannot be sampled, as vLLM's
MinTokensLogitsProcessor and transformers' ``min_new_tokens`` do.

They touch a few rows (the biases a few logits of each), so they are applied where they are, in place, as the
penalties are (penalties.py), and before them, in vLLM's order. Raw logprobs are taken before any.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from tokenloom.model.step_inputs import to_device
from tokenloom.sampling_params import SamplingParams


def changed_rows(params: Sequence[SamplingParams], output_index: Sequence[int]) -> list[int]:
    """The rows whose logits this module changes: allowed tokens, a logit bias, or an output still short of its
    min_tokens (row r samples its request's output token output_index[r])."""
    assert len(params) == len(output_index), "an output index a row"
    # min_tokens is 0 for nearly every request: the index is read only where it is not (a step's host time)
    return [row for row, p in enumerate(params)
            if p.logit_bias or p.allowed_token_ids or (p.min_tokens and output_index[row] < p.min_tokens)]  # fmt: skip


def apply_token_biases(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_index: Sequence[int],
    eos_token_ids: Sequence[int],
) -> Callable[[], None]:
    """Bans every token but a row's allowed ones, adds its logit bias to its logits and, where its output index is
    below its min_tokens, -inf to its stop tokens (its stop_token_ids, and the model's end-of-sequence ids unless it
    ignores them), in place; returns what puts the changed logits back (the runner samples row by row from the
    model's logits after a failure)."""
    rows = changed_rows(params, output_index)
    if not rows:
        return lambda: None
    allowed = [row for row in rows if params[row].allowed_token_ids]
    restore_rows = _keep_only_allowed(logits, allowed, [params[row].allowed_token_ids or [] for row in allowed])
    entries = {row: _row_entries(params[row], output_index[row], eos_token_ids) for row in rows}
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
    params: SamplingParams, output_index: int, eos_token_ids: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, values to add) of one row."""
    bias = params.logit_bias or {}
    tokens = list(bias)
    values = list(bias.values())
    if output_index < params.min_tokens:
        banned = [*params.stop_token_ids, *([] if params.ignore_eos else eos_token_ids)]
        tokens += banned
        values += [float("-inf")] * len(banned)
    return np.asarray(tokens, dtype=np.int64), np.asarray(values, dtype=np.float32)
