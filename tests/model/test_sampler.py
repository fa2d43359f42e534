"""The sampler's filters and penalties, checked on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from tokenloom.model.penalties import TokenCounts, apply_penalties
from tokenloom.model.sampler import (
    Sampler,
    SamplingBatch,
    filter_top_k_top_p_min_p,
    mask_disallowed,
)
from tokenloom.sampling_params import SamplingParams


def batch_of(*params: SamplingParams) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(list(params), [None] * n, [None] * n)


def kept(row: torch.Tensor) -> set[int]:
    return {i for i, v in enumerate(row.tolist()) if v != -math.inf}


def test_top_k_top_p_min_p_keep_the_right_tokens():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = probs.log().repeat(4, 1)
    params = [
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.75),  # 0.5 + 0.2 = 0.7 < 0.75, so 0.15 is needed too
        SamplingParams(min_p=0.3),  # keep p >= 0.15
        SamplingParams(top_p=0.01),  # always keeps the best token
    ]
    filtered = filter_top_k_top_p_min_p(logits, params)
    assert [kept(row) for row in filtered] == [{0, 1}, {0, 1, 2}, {0, 1, 2}, {0}]


def test_penalties():
    logits = torch.tensor([[2.0, 2.0, -1.0, 0.5]]).repeat(3, 1)
    params = [
        SamplingParams(presence_penalty=1.0),
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(repetition_penalty=2.0),
    ]
    counts = [TokenCounts([3], with_prompt=p.repetition_penalty != 1.0) for p in params]
    for seen in counts:
        seen.update([0, 0, 2])
    out = logits.clone()
    apply_penalties(out, params, list(counts))
    assert out[0].tolist() == [1.0, 2.0, -2.0, 0.5]
    assert out[1].tolist() == [1.0, 2.0, -1.5, 0.5]
    assert out[2].tolist() == [1.0, 2.0, -2.0, 0.25]  # repetition also covers the prompt's token 3


def test_greedy_rows_take_the_argmax_and_random_rows_follow_the_distribution():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[0.0, math.log(3.0), -50.0]])
    greedy = sampler(logits, batch_of(SamplingParams(temperature=0)))
    assert greedy[0].token_id == 1
    draws = [sampler(logits, batch_of(SamplingParams(temperature=1.0)))[0].token_id for _ in range(2000)]
    share = draws.count(1) / len(draws)
    assert 0.70 < share < 0.80  # p = 0.75
    assert 2 not in draws


def test_seeded_rows_repeat():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.randn(1, 100)

    def draw(seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        batch = SamplingBatch([SamplingParams(temperature=1.0)], [g], [None])
        return [sampler(logits, batch)[0].token_id for _ in range(20)]

    assert draw(3) == draw(3)
    assert draw(3) != draw(4)


def test_logprobs_are_of_the_raw_distribution():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    (result,) = sampler(logits, batch_of(SamplingParams(temperature=0, logprobs=2)))
    expected = torch.log_softmax(logits, -1)[0]
    assert result.token_id == 2
    assert result.logprob == pytest.approx(expected[2].item(), abs=1e-6)
    assert [t for t, _ in result.top_logprobs] == [2, 1]


def test_a_grammar_mask_leaves_only_the_allowed_tokens_of_its_rows():
    vocab = 100  # not a multiple of 32: the last word is partly past the vocabulary
    allowed = {1: {0, 31, 32, 63, 99}, 3: {5}}
    bitmask = torch.zeros(2, 4, dtype=torch.int32)
    for i, tokens in enumerate(allowed.values()):
        for t in tokens:
            bitmask[i, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)  # bit 31 wraps to the sign bit
    logits = torch.randn(4, vocab)
    masked = logits.clone()
    mask_disallowed(masked, list(allowed), bitmask)
    for row in range(4):
        keep = allowed.get(row, set(range(vocab)))
        expected = torch.full((vocab,), float("-inf"))
        expected[list(keep)] = logits[row, list(keep)]
        assert torch.equal(masked[row], expected)
