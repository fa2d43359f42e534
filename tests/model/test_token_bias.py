"""Logit biases and min_tokens' banned stop tokens on hand-made logits: where they land, what they leave alone, and
how they are undone."""

from __future__ import annotations

import math

import torch

from tokenloom.model.sampler import Sampler, SamplingBatch
from tokenloom.model.token_bias import apply_token_biases
from tokenloom.sampling_params import SamplingParams

EOS = 9
VOCAB = 12


def test_biases_and_bans_land_on_their_rows_and_tokens_and_are_undone_exactly():
    logits = torch.randn(4, VOCAB)
    before = logits.clone()
    params = [
        SamplingParams(logit_bias={3: 2.5, 7: -1.0}),
        SamplingParams(min_tokens=4, stop_token_ids=[5]),  # at index 3: 5 and EOS banned
        SamplingParams(min_tokens=4, stop_token_ids=[5]),  # at index 4: nothing banned
        SamplingParams(min_tokens=2, stop_token_ids=[5], ignore_eos=True, logit_bias={5: 1.0, 6: 0.5}),
    ]
    restore = apply_token_biases(logits, params, [0, 3, 4, 1], (EOS,))
    expected = before.clone()
    expected[0, 3] += 2.5
    expected[0, 7] -= 1.0
    expected[1, [5, EOS]] = -math.inf
    expected[3, 5] = -math.inf  # biased and banned: banned
    expected[3, 6] += 0.5  # its EOS is not banned: the request ignores it
    assert torch.equal(logits, expected)
    restore()
    assert torch.equal(logits, before)


def test_rows_without_bias_or_pending_min_tokens_are_not_touched():
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    restore = apply_token_biases(logits, [SamplingParams(), SamplingParams(min_tokens=1)], [0, 1], (EOS,))
    assert torch.equal(logits, before)
    restore()
    assert torch.equal(logits, before)


def test_a_bias_decides_greedy_sampling_and_raw_logprobs_ignore_it():
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 5.0
    params = SamplingParams(temperature=0, logit_bias={8: 100.0}, logprobs=1)
    (token,) = Sampler(torch.device("cpu"), 0)(logits.clone(), SamplingBatch([params], [None], [None]))
    assert token.token_id == 8
    assert token.top_logprobs is not None and token.top_logprobs[0][0] == 2  # the model's own distribution


def test_each_verification_row_is_banned_as_the_output_index_it_samples():
    """A request at output index 3 with min_tokens 5 verifies drafts [1, 2, 4]: rows sample indexes 3, 4, 5 and 6.
    EOS is every row's argmax but banned at indexes 3 and 4, where the drafts 1 and 2 come next; at index 5 EOS is
    allowed and beats the draft 4, so the kept tokens are 1, 2 and EOS."""
    logits = torch.zeros(4, VOCAB)
    logits[:, EOS] = 10.0
    logits[0, 1] = logits[1, 2] = logits[2, 4] = logits[3, 0] = 5.0
    params = SamplingParams(temperature=0, min_tokens=5)
    batch = SamplingBatch([params], [None], [None], output_index=[3])
    (kept,) = Sampler(torch.device("cpu"), 0, (EOS,)).verify(logits, batch, [[1, 2, 4]])
    assert [t.token_id for t in kept] == [1, 2, EOS]


def test_only_allowed_tokens_keep_their_logits_with_biases_and_bans_on_top_and_all_is_undone():
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    params = [
        SamplingParams(allowed_token_ids=[1, 4, EOS], logit_bias={4: 2.0, 6: 3.0}, min_tokens=2),
        SamplingParams(),
        SamplingParams(allowed_token_ids=[0]),
    ]
    restore = apply_token_biases(logits, params, [1, 0, 5], (EOS,))
    expected = torch.full_like(before, -math.inf)
    expected[0, 1] = before[0, 1]
    expected[0, 4] = before[0, 4] + 2.0  # allowed and biased; 6 is biased but not allowed; EOS allowed but banned
    expected[1] = before[1]
    expected[2, 0] = before[2, 0]
    assert torch.equal(logits, expected)
    restore()
    assert torch.equal(logits, before)
