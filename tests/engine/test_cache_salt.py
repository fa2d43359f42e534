"""vLLM's cache_salt: a prompt's cached prefix blocks serve only requests of the same salt; the tokens are the same."""

from __future__ import annotations

import pytest

from tokenloom import LLM, BeamSearchParams, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = list(range(3, 40))  # two full blocks of 16, and some


@pytest.mark.parametrize("core_process", [False, True])
def test_a_salted_prompt_hits_only_its_own_salts_blocks(tiny_llama, core_process):
    with LLM(str(tiny_llama), dtype="float32", core_process=core_process) as llm:
        runs = [("one", 0), ("two", 0), (None, 0), ("one", 32), (None, 32), ("two", 32)]
        outputs = []
        for salt, cached in runs:
            prompt = {"prompt_token_ids": PROMPT} if salt is None else {"prompt_token_ids": PROMPT, "cache_salt": salt}
            [output] = llm.generate([prompt], GREEDY, use_tqdm=False)
            assert output.metrics.num_cached_tokens == cached, (salt, cached)
            outputs.append(output.outputs[0].token_ids)
        assert all(tokens == outputs[0] for tokens in outputs)
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            llm.generate([{"prompt_token_ids": PROMPT, "cache_salt": ""}], GREEDY, use_tqdm=False)


def test_a_salted_beam_search_finds_its_beams_past_and_answers_as_unsalted(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32")
    params = BeamSearchParams(beam_width=3, max_tokens=20, ignore_eos=True)
    [plain] = llm.beam_search([{"prompt_token_ids": PROMPT}], params)
    hits_before = llm.engine.core.scheduler.kv.prefix_cache_hits
    [salted] = llm.beam_search([{"prompt_token_ids": PROMPT, "cache_salt": "mine"}], params)
    assert [b.tokens for b in salted.sequences] == [b.tokens for b in plain.sequences]
    # Each step after the first reads its beams' past from blocks under the search's own salt (its steps' requests
    # carry it): at least the prompt's two full blocks a beam.
    assert llm.engine.core.scheduler.kv.prefix_cache_hits - hits_before >= 19 * 32
