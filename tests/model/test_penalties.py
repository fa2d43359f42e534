"""Penalties from the counts each request keeps from step to step: the dense definition's values, bit for bit."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from tokenloom.core.request import PLACEHOLDER_TOKEN
from tokenloom.model.penalties import SeenTokens, TokenCounts, apply_penalties
from tokenloom.model.sampler import Sampler, SamplingBatch
from tokenloom.sampling_params import SamplingParams

VOCAB = 300


def dense_penalties(logits: torch.Tensor, params: list[SamplingParams], prompts, outputs) -> torch.Tensor:
    """The definition, over the whole vocabulary: every row's output counts and prompt tokens made from scratch."""
    counts = torch.zeros(logits.shape)
    in_prompt = torch.zeros(logits.shape, dtype=torch.bool)
    for row, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        if output:
            counts[row] = torch.bincount(torch.tensor(output), minlength=VOCAB).float()
        in_prompt[row, prompt] = True
    frequency = torch.tensor([p.frequency_penalty for p in params]).unsqueeze(1)
    presence = torch.tensor([p.presence_penalty for p in params]).unsqueeze(1)
    repetition = torch.tensor([p.repetition_penalty for p in params]).unsqueeze(1)
    out = logits - frequency * counts - presence * (counts > 0).float()
    penalised = torch.where(out > 0, out / repetition, out * repetition)
    return torch.where(in_prompt | (counts > 0), penalised, out)


@dataclass
class Sampling:
    """What SeenTokens reads of a request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)


def test_counts_kept_from_step_to_step_penalize_as_the_dense_definition():
    rng = random.Random(0)
    params = [
        SamplingParams(presence_penalty=0.7),
        SamplingParams(frequency_penalty=-0.4),  # negative: a token is encouraged the more it comes
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.3),
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(temperature=0),  # no penalties: its row is left alone
        SamplingParams(frequency_penalty=1.0),  # no prompt kept: its distinct outputs outgrow the first arrays
    ]
    requests = [
        Sampling(str(i), [rng.randrange(VOCAB) for _ in range(rng.randint(0, 200))], p) for i, p in enumerate(params)
    ]
    seen = SeenTokens()
    for step in range(60):
        for request in requests:  # a step adds one token, or a few (accepted drafts)
            request.output_token_ids += [rng.randrange(VOCAB) for _ in range(rng.choice([1, 1, 3]))]
        logits = torch.randn(len(requests), VOCAB) * 4
        logits[:, :7] = float("-inf")  # a grammar's mask
        counts = [seen.of(request) for request in requests]
        got = logits.clone()
        restore = apply_penalties(got, params, counts)
        want = dense_penalties(
            logits, params, [r.prompt_token_ids for r in requests], [r.output_token_ids for r in requests]
        )
        assert torch.equal(got, want), step
        restore()
        assert torch.equal(got, logits), "restored: the model's logits again"
    assert counts[4] is None and len(seen) == 5
    assert counts[5] is not None and counts[5].size > 64, "the arrays grew past their first size"
    for request in requests:
        seen.drop(request.request_id)
    assert len(seen) == 0


def test_a_last_token_still_on_the_device_is_counted_there():
    """With asynchronous scheduling a step's batch holds each request's last token as a placeholder; the token itself
    is the row's input on the device: penalties count it from there, as if the host had it."""
    rng = random.Random(1)
    params = [
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.2),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(temperature=0),
        SamplingParams(frequency_penalty=-0.5, repetition_penalty=0.9),
    ]
    requests = [
        Sampling(str(i), [rng.randrange(20) for _ in range(rng.randint(0, 8))], p) for i, p in enumerate(params)
    ]
    seen = SeenTokens()
    for step in range(30):
        last = [rng.randrange(20) for _ in requests]  # a small vocabulary: last tokens often seen before
        for request in requests:
            request.output_token_ids.append(PLACEHOLDER_TOKEN)
        logits = torch.randn(len(requests), VOCAB) * 4
        counts = [seen.of(request) for request in requests]
        assert all(c is None or c.pending for c in counts)
        got = logits.clone()
        restore = apply_penalties(got, params, counts, torch.tensor(last))
        for request, token in zip(requests, last, strict=True):
            request.output_token_ids[-1] = token  # read from the device: the placeholder settled
        want = dense_penalties(
            logits, params, [r.prompt_token_ids for r in requests], [r.output_token_ids for r in requests]
        )
        assert torch.equal(got, want), step
        restore()
        assert torch.equal(got, logits), "restored: the model's logits again"


def test_counts_hold_each_distinct_token_once():
    counts = TokenCounts([5, 3, 5, 9], with_prompt=True)
    counts.update([3, 3])
    counts.update([3, 3, 7, 3])  # the output so far: its last two tokens are new
    held = dict(zip(counts.ids[: counts.size].tolist(), counts.counts[: counts.size].tolist(), strict=True))
    assert held == {3: 3.0, 5: 0.0, 9: 0.0, 7: 1.0}
    without_prompt = TokenCounts([5, 3], with_prompt=False)
    without_prompt.update([8])
    assert without_prompt.ids[: without_prompt.size].tolist() == [8]


def test_a_failed_sample_leaves_the_model_logits_for_the_retry_row_by_row(monkeypatch):
    """The runner samples row by row after a batch fails: each row must start from the model's logits again."""
    sampler = Sampler(torch.device("cpu"), seed=0)
    params = [SamplingParams(temperature=1.0, repetition_penalty=1.5), SamplingParams(temperature=1.0)]
    counts = [TokenCounts([1, 2, 3], with_prompt=True), None]
    logits = torch.randn(2, VOCAB)
    model_logits = logits.clone()

    def fails(*args):
        raise RuntimeError("a row's sampling failed")

    monkeypatch.setattr(sampler, "_sample_random", fails)
    with pytest.raises(RuntimeError, match="failed"):
        sampler.sample(logits, SamplingBatch(params, [None, None], counts))
    assert torch.equal(logits, model_logits)
