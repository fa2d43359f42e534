"""--max-logprobs, as vLLM's: the most alternatives per token a request may ask for (20 unless set; -1 the vocabulary),
for sampled tokens, prompt tokens and a beam search's candidates alike."""

from __future__ import annotations

import math

import pytest
from conftest import TINY_VOCAB

from tokenloom import LLM, BeamSearchParams, SamplingParams
from tokenloom.config import EngineConfig

PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


def test_by_default_a_request_may_ask_for_20_and_no_more(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32")
    [output] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, logprobs=20), use_tqdm=False)
    assert all(len(entry) in (20, 21) for entry in output.outputs[0].logprobs)  # and the sampled one if not in them
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"Requested {field} of 21, which is greater than max allowed: 20"):
            llm.generate([PROMPT], SamplingParams(max_tokens=2, **{field: 21}), use_tqdm=False)
    with pytest.raises(ValueError, match=f"Requested logprobs of {TINY_VOCAB}, which is greater than max allowed: 20"):
        llm.generate([PROMPT], SamplingParams(max_tokens=2, logprobs=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="at most 10 beams"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=11, max_tokens=2))
    assert llm.stats().kv_blocks_in_use == 0


@pytest.mark.parametrize("asked", [TINY_VOCAB, -1])  # -1: the whole vocabulary, as vLLM's
def test_minus_one_allows_the_whole_vocabulary(tiny_llama, asked):
    llm = LLM(str(tiny_llama), dtype="float32", max_logprobs=-1)
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=asked, prompt_logprobs=asked)
    [output] = llm.generate([PROMPT], params, use_tqdm=False)
    entries = [*output.outputs[0].logprobs, *output.prompt_logprobs[1:]]
    for entry in entries:
        assert sorted(entry) == list(range(TINY_VOCAB))
        assert sum(math.exp(lp.logprob) for lp in entry.values()) == pytest.approx(1.0, abs=1e-4)
        assert sorted(lp.rank for lp in entry.values()) == list(range(1, TINY_VOCAB + 1))


def test_a_wider_beam_search_needs_a_higher_cap(tiny_llama):
    narrow = LLM(str(tiny_llama), dtype="float32", max_logprobs=20)
    params = BeamSearchParams(beam_width=12, max_tokens=3, ignore_eos=True)
    with pytest.raises(ValueError, match="beam_width=12 reads 24 logprobs a step; --max-logprobs allows 20"):
        narrow.beam_search([PROMPT], params)
    wide = LLM(str(tiny_llama), dtype="float32", max_logprobs=24)
    [search] = wide.beam_search([PROMPT], params)
    assert len(search.sequences) == 12
    scores = [beam.cum_logprob for beam in search.sequences]
    assert scores == sorted(scores, reverse=True) and len({tuple(b.tokens) for b in search.sequences}) == 12


def test_the_cap_is_checked_when_the_engine_is_configured():
    with pytest.raises(ValueError, match="max_logprobs must be >= 0, or -1"):
        EngineConfig.from_kwargs(max_logprobs=-2)
