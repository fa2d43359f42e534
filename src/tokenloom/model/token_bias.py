"""A request's fixed changes to chosen logits before sampling: its ``logit_bias`` (OpenAI's: a value added to a
token's logit) and, while its output is shorter than ``min_tokens``, its stop tokens banned (-inf) so that they
cannot be sampled, as vLLM's MinTokensLogitsProcessor and transformers' ``min_new_tokens`` do.

Both touch a few logits of a few rows, so they are applied where they are, in place, by one indexed add, as the
penalties are (penalties.py), and before them, in vLLM's order. Raw logprobs are taken before either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from tokenloom.model.step_inputs import to_device
from tokenloom.sampling_params import SamplingParams


def biased_rows(params: Sequence[SamplingParams], output_index: Sequence[int]) -> list[int]:
    """The rows whose logits this module changes: a logit bias, or an output still short of its min_tokens (row
    r samples its request's output token output_index[r])."""
    assert len(params) == len(output_index), "an output index a row"
    # min_tokens is 0 for nearly every request: the index is read only where it is not (a step's host time)
    return [row for row, p in enumerate(params) if p.logit_bias or (p.min_tokens and output_index[row] < p.min_tokens)]


def apply_token_biases(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_index: Sequence[int],
    eos_token_ids: Sequence[int],
) -> Callable[[], None]:
    """Adds each row's logit bias to its logits and, where its output index is below its min_tokens, -inf to its
    stop tokens (its stop_token_ids, and the model's end-of-sequence ids unless it ignores them), in place; returns
    what puts the changed logits back (the runner samples row by row from the model's logits after a failure)."""
    rows = biased_rows(params, output_index)
    if not rows:
        return lambda: None
    entries = [_row_entries(params[row], output_index[row], eos_token_ids) for row in rows]
    counts = [len(tokens) for tokens, _ in entries]
    device = logits.device
    where = (
        to_device(np.repeat(np.asarray(rows, dtype=np.int64), counts), device),
        to_device(np.concatenate([tokens for tokens, _ in entries]), device),
    )
    original = logits[where]
    # accumulate: a token both biased and banned gets both (-inf), whichever comes first
    logits.index_put_(where, to_device(np.concatenate([values for _, values in entries]), device), accumulate=True)

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
