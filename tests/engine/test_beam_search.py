"""Beam search: the selection on hand-made logprobs, and whole searches against transformers' beam search."""

import pytest
import torch
from conftest import hf_oracle

from tokenloom import LLM, BeamSearchParams
from tokenloom.beam_search import BeamSearch
from tokenloom.outputs import Logprob

EOS = 9


def logprobs(**by_token: float) -> dict[int, Logprob]:
    """A step's candidates, ranked by logprob: t3=-0.5 is token 3 at logprob -0.5."""
    ranked = sorted(by_token.items(), key=lambda item: -item[1])
    return {int(name[1:]): Logprob(value, rank) for rank, (name, value) in enumerate(ranked, start=1)}


def test_the_best_continuations_of_all_beams_live_on_and_an_eos_one_is_complete():
    search = BeamSearch([1, 2], BeamSearchParams(beam_width=2, max_tokens=3), {EOS})
    search.advance([logprobs(t3=-0.1, t4=-0.5, t9=-3.0, t5=-4.0)])
    assert [beam.tokens for beam in search.live] == [[1, 2, 3], [1, 2, 4]]
    assert [beam.tokens for beam in search.complete] == [[1, 2, 9]]  # EOS is never a live beam
    # Both children of the second beam beat the first beam's: the first beam leaves no descendant.
    search.advance([logprobs(t6=-2.0, t7=-2.5), logprobs(t8=-0.2, t5=-0.3)])
    assert [beam.tokens for beam in search.live] == [[1, 2, 4, 8], [1, 2, 4, 5]]
    assert [beam.cum_logprob for beam in search.live] == pytest.approx([-0.7, -0.8])
    search.advance([logprobs(t9=-0.05, t3=-2.0), logprobs(t3=-1.0, t4=-1.5)])
    assert search.done
    answers = search.answers()
    # Scored by cumulative logprob over length (prompt included, EOS not): -0.75 / 4 beats -1.8 / 5 and -3.0 / 2.
    assert [(beam.tokens, beam.finish_reason) for beam in answers] == [
        ([1, 2, 4, 8, 9], "stop"),
        ([1, 2, 4, 5, 3], "length"),
    ]
    assert search.score(answers[0]) == pytest.approx(-0.75 / 4)
    outputs = search.completion_outputs(lambda tokens: " ".join(map(str, tokens)))
    assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in outputs] == [
        ([4, 8], "4 8", "stop", EOS),  # the EOS left out of the answer
        ([4, 5, 3], "4 5 3", "length", None),
    ]
    assert outputs[0].cumulative_logprob == pytest.approx(-0.75) and outputs[0].logprobs is None


def test_length_penalty_ignore_eos_and_the_answers_logprobs():
    params = BeamSearchParams(beam_width=1, max_tokens=2, length_penalty=0.0, include_stop_str_in_output=True)
    search = BeamSearch([1], params, {EOS}, top_logprobs=1)
    search.advance([logprobs(t3=-0.2, t9=-0.3, t4=-0.4)])
    search.advance([logprobs(t5=-0.5, t6=-0.6)])
    # No length penalty: the summed logprob alone, so the short EOS answer (-0.3) beats -0.7.
    [answer] = search.completion_outputs(str)
    assert answer.token_ids == [9] and answer.finish_reason == "stop"  # the EOS kept in the answer
    assert answer.logprobs == [{3: Logprob(-0.2, 1), 9: Logprob(-0.3, 2)}]  # the top one, and the chosen one

    ignoring = BeamSearch([1], dataclass_replace(params, ignore_eos=True), {EOS})
    ignoring.advance([logprobs(t9=-0.1, t3=-0.2)])
    assert [beam.tokens for beam in ignoring.live] == [[1, 9]] and not ignoring.complete


def dataclass_replace(params: BeamSearchParams, **changes) -> BeamSearchParams:
    import dataclasses

    return dataclasses.replace(params, **changes)


def test_the_complete_beams_kept_are_only_the_best_beam_width():
    search = BeamSearch([1], BeamSearchParams(beam_width=2, max_tokens=10), {EOS})
    for step in range(6):
        search.advance([logprobs(t9=-1.0 - step, t3=-0.1, t4=-0.2) for _ in search.live])
    assert len(search.complete) == 2  # a search's memory stays bounded, whatever its length
    best_complete = max(search.complete, key=search.score)
    assert search.score(best_complete) == pytest.approx(-1.0 / 1)  # the first EOS, after the prompt alone


def test_a_search_of_no_beam_or_no_token_is_refused():
    # A width whose steps need more logprobs than --max-logprobs allows: tests/engine/test_max_logprobs.py.
    with pytest.raises(ValueError, match="beam_width must be >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        BeamSearchParams(beam_width=2, max_tokens=0)


def _transformers_beams(model, prompt: list[int], width: int, max_tokens: int) -> tuple[list[list[int]], list[float]]:
    """transformers' beams (without EOS) and their summed logprobs (its scores are the sums over max_tokens)."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        num_beams=width, num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens,
        eos_token_id=None, pad_token_id=1, length_penalty=1.0, early_stopping=False,
        output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip
    ids = torch.tensor([prompt])
    assert 1 not in prompt  # the pad token: transformers would mask it out of the prompt
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    sums = (out.sequences_scores * max_tokens).tolist()
    return [row[len(prompt) :].tolist() for row in out.sequences], sums


@pytest.mark.parametrize("chunked", [False, True])
def test_beam_search_equals_transformers_in_float32(tiny_llama, chunked):
    """Without EOS every beam runs max_tokens, and both searches keep the beam_width best sums at each step: the
    same beams, best first. Two prompts share each step's batch; chunked prefill splits the steps' prompts."""
    prompts = [[0, 5, 17, 3, 42, 11, 8, 2, 60, 33, 7, 19, 4, 25, 90, 12, 6], [0, 70, 71, 72]]
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    options = {"max_num_batched_tokens": 16, "enable_chunked_prefill": True} if chunked else {}
    with LLM(str(tiny_llama), dtype="float32", block_size=4, **options) as llm:
        outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        hits = llm.stats().prefix_cache_hits
    assert hits > 0  # each step's beams computed their last block again, not their whole context
    for prompt, output in zip(prompts, outputs, strict=True):
        beams, sums = _transformers_beams(hf_oracle(tiny_llama), prompt, 3, 10)
        assert [beam.tokens[len(prompt) :] for beam in output.sequences] == beams
        assert all(beam.tokens[: len(prompt)] == prompt for beam in output.sequences)
        assert [beam.cum_logprob for beam in output.sequences] == pytest.approx(sums, abs=1e-4)
        assert all(beam.finish_reason == "length" for beam in output.sequences)


@pytest.mark.parametrize("core_process", [False, True])
def test_beam_search_of_text_prompts_answers_with_the_prompts_text_first(tiny_chat_model, core_process):
    with LLM(str(tiny_chat_model), dtype="float32", core_process=core_process) as llm:
        prompt_ids = llm.tokenizer.encode("Once upon a time")
        [output] = llm.beam_search("Once upon a time", BeamSearchParams(beam_width=2, max_tokens=4))
        with pytest.raises(ValueError, match="exceed the model's context"):
            llm.beam_search("Hi", BeamSearchParams(beam_width=2, max_tokens=llm.engine.max_model_len))
    assert len(output.sequences) == 2
    for beam in output.sequences:
        assert beam.tokens[: len(prompt_ids)] == prompt_ids  # vLLM's: a sequence's tokens and text hold the prompt
        assert beam.text.startswith("Once upon a time") and beam.finish_reason in ("stop", "length")


def test_beam_search_under_a_lora_adapter_equals_transformers_with_it_merged(tiny_llama, tmp_path):
    from lora_files import merged_oracle, write_adapter

    from tokenloom import LoRARequest

    adapter = write_adapter(tmp_path / "adapter", tiny_llama, seed=3)
    prompt = [0, 70, 71, 72, 5, 6]
    with LLM(str(tiny_llama), dtype="float32", enable_lora=True) as llm:
        [output] = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(3, 8, ignore_eos=True),
                                   lora_request=LoRARequest("adapter", 1, str(adapter)))  # fmt: skip
        [base] = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(3, 8, ignore_eos=True))
    beams, _ = _transformers_beams(merged_oracle(tiny_llama, adapter), prompt, 3, 8)
    assert [beam.tokens[len(prompt) :] for beam in output.sequences] == beams
    assert [beam.tokens for beam in base.sequences] != [beam.tokens for beam in output.sequences]  # it did apply
