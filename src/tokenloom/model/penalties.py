"""Presence, frequency (OpenAI) and repetition (Hugging Face) penalties: the token counts each request keeps from
step to step, and the logits they change.

A penalty changes only the logits of tokens a request has seen, so it is applied where they are: each row's
distinct seen ids are gathered, changed and put back in place (``apply_penalties``), and the counts behind them grow
by the tokens each step adds (``TokenCounts.update``). Rebuilding every penalized row's counts from its whole prompt and
output into a dense [rows, vocab] tensor at every step cost 50 ms a step at 64 running requests with 1,024-token
prompts and 215-300 ms at 256, two orders above the rest of a step's host work (benchmarks/RESULTS.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch
from numpy.typing import ArrayLike, DTypeLike

from tokenloom.core.request import PLACEHOLDER_TOKEN
from tokenloom.model.step_inputs import to_device
from tokenloom.sampling_params import SamplingParams


class TokenCounts:
    """One request's seen tokens: each distinct id its output holds (and its prompt's, where it penalises
    repetition) with how many times the output holds it, in arrays a step concatenates with the other rows'."""

    def __init__(self, prompt_token_ids: Sequence[int], with_prompt: bool) -> None:
        prompt = np.unique(np.asarray(prompt_token_ids if with_prompt else [], dtype=np.int64))
        self.size = len(prompt)  # distinct ids so far: ids[:size], counts[:size]
        self.ids = np.empty(max(64, 2 * self.size), dtype=np.int64)
        self.counts = np.zeros(len(self.ids), dtype=np.float32)  # in the output; a prompt's id may have none
        self.ids[: self.size] = prompt
        self._position = dict(zip(prompt.tolist(), range(self.size), strict=True))
        self._counted = 0  # of the output's tokens
        # Its last token is a placeholder: sampled by a step still on the device (asynchronous scheduling), it is
        # counted there, by apply_penalties from the step's inputs.
        self.pending = False

    def update(self, output_token_ids: Sequence[int]) -> None:
        """Counts the output's tokens since the last update, all but a placeholder at its end (``pending``)."""
        self.pending = bool(output_token_ids) and output_token_ids[-1] == PLACEHOLDER_TOKEN
        end = len(output_token_ids) - self.pending
        assert end >= self._counted, "a live request's output never shrinks"
        for token in output_token_ids[self._counted : end]:
            self._add(token)
        self._counted = end

    def _add(self, token: int) -> None:
        assert token != PLACEHOLDER_TOKEN, "one step at most is in flight: only the last token may be a placeholder"
        at = self._position.get(token)
        if at is None:
            if self.size == len(self.ids):
                self.ids = np.concatenate([self.ids, np.empty_like(self.ids)])
                self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
            at = self.size
            self.ids[at] = token
            self._position[token] = at
            self.size += 1
        self.counts[at] += 1.0


class Sampled(Protocol):
    """What the counts read of a request that samples (core/request.py's Request)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams


class SeenTokens:
    """The TokenCounts of each live request with penalties, by request id: made at its first sampled step, brought
    up to its output at every one after, dropped when the request ends."""

    def __init__(self) -> None:
        self._by_request: dict[str, TokenCounts] = {}

    def of(self, request: Sampled) -> TokenCounts | None:
        """The request's counts, up to its output; None for a request without penalties."""
        params = request.sampling_params
        if not params.uses_penalties:
            return None
        counts = self._by_request.get(request.request_id)
        if counts is None:
            counts = TokenCounts(request.prompt_token_ids, with_prompt=params.repetition_penalty != 1.0)
            self._by_request[request.request_id] = counts
        counts.update(request.output_token_ids)
        return counts

    def drop(self, request_id: str) -> None:
        self._by_request.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._by_request)


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    counts: list[TokenCounts | None],
    last_tokens: torch.Tensor | None = None,
) -> Callable[[], None]:
    """Applies each row's penalties to its logits in place (rows without counts are left alone): a seen token's
    logit less frequency x its output count and presence if the output has it, then divided by repetition if
    positive, else multiplied by it: the arithmetic of the dense form, on the seen tokens only. A row whose counts
    are ``pending`` counts its last token too, read on the device from last_tokens (each row's input token, the
    request's last). Returns what puts the changed logits back. In place, because a copy of a step's logits cost
    more than the penalties (18 ms for 256 rows of 49,152 on our CPUs, the fresh pages' faults)."""
    kept = [(row, seen) for row, seen in enumerate(counts) if seen is not None and (seen.size or seen.pending)]
    if not kept:
        return lambda: None
    device = logits.device
    rows = _to(device, [row for row, _ in kept])
    factors = _to(device, [(params[r].frequency_penalty, params[r].presence_penalty, params[r].repetition_penalty)
                           for r, _ in kept], np.float32)  # fmt: skip
    of_entry = _to(device, np.repeat(np.arange(len(kept)), [seen.size for _, seen in kept]))  # each entry's row
    where = (rows[of_entry], _to(device, np.concatenate([seen.ids[: seen.size] for _, seen in kept])))
    entry_counts = _to(device, np.concatenate([seen.counts[: seen.size] for _, seen in kept]))
    pending = _to(device, [i for i, (_, seen) in enumerate(kept) if seen.pending])
    if len(pending):
        assert last_tokens is not None, "a pending row's last token is read from the step's inputs"
        last = torch.full((len(kept),), -1, dtype=torch.int64, device=device)
        last[pending] = last_tokens[rows[pending]].long()
        is_last = where[1] == last[of_entry]
        entry_counts = entry_counts + is_last.float()
    original = logits[where]
    logits.index_put_(where, _penalized(original, entry_counts, factors[of_entry]))
    restores = [(where, original)]
    if len(pending):  # a last token not seen before is seen now, once
        at = (rows[pending], last[pending])
        current = logits[at]
        seen_before = torch.zeros(len(kept), device=device).index_add_(0, of_entry, is_last.float())[pending] > 0
        fresh = _penalized(current, torch.ones_like(current), factors[pending])
        logits.index_put_(at, torch.where(seen_before, current, fresh))
        restores.insert(0, (at, current))  # first: where it was seen before, `current` is already penalized

    def restore() -> None:
        for index, values in restores:
            logits.index_put_(index, values)

    return restore


def _penalized(values: torch.Tensor, counts: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """Logits of seen tokens, penalized: factors [n, 3] are each one's frequency, presence and repetition."""
    frequency, presence, repetition = factors.unbind(1)
    values = values - frequency * counts - presence * (counts > 0).float()
    return torch.where(values > 0, values / repetition, values * repetition)


def _to(device: torch.device, values: ArrayLike, dtype: DTypeLike = np.int64) -> torch.Tensor:
    return to_device(np.asarray(values, dtype=dtype), device)  # as step inputs go: the host does not wait
