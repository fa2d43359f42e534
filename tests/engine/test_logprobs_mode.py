"""--logprobs-mode, as vLLM's: a token's logprobs are the model's (raw_logprobs, the default), its raw logits, or what
the token was chosen from (processed_*: after logit_bias and penalties, and for a sampled request its temperature
and top-k), checked against transformers' float32 logits of the same prompt."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import hf_oracle

from tokenloom import LLM, SamplingParams

PROMPT = [5, 17, 33, 2, 91, 64, 12]


@pytest.fixture(scope="module")
def next_logits(tiny_llama) -> torch.Tensor:
    """transformers' float32 logits for the token after PROMPT."""
    with torch.inference_mode():
        return hf_oracle(tiny_llama)(torch.tensor([PROMPT])).logits[0, -1].float()


def first_entry(tiny_llama, mode: str, params: SamplingParams, **engine) -> tuple[int, float, dict[int, float]]:
    """The first generated token, its shown value and its alternatives' (with its own), under this logprobs_mode."""
    llm = LLM(str(tiny_llama), dtype="float32", logprobs_mode=mode, **engine)
    [output] = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    completion = output.outputs[0]
    token = completion.token_ids[0]
    entry = {t: lp.logprob for t, lp in completion.logprobs[0].items()}
    return token, entry[token], entry


def top(values: torch.Tensor, k: int) -> dict[int, float]:
    best = values.topk(k)
    return dict(zip(best.indices.tolist(), best.values.tolist(), strict=True))


def test_raw_logprobs_and_raw_logits_are_the_models(tiny_llama, next_logits):
    greedy = SamplingParams(temperature=0, max_tokens=2, logprobs=5, logit_bias={7: 3.0})
    for mode, expected in (("raw_logprobs", next_logits.log_softmax(-1)), ("raw_logits", next_logits)):
        token, _, entry = first_entry(tiny_llama, mode, greedy)
        assert entry == pytest.approx({**top(expected, 5), token: float(expected[token])}, abs=1e-4), mode


def test_processed_logits_hold_the_bias_and_processed_logprobs_the_tempered_top_k(tiny_llama, next_logits):
    biased = next_logits.clone()
    biased[7] += 3.0
    greedy = SamplingParams(temperature=0, max_tokens=2, logprobs=5, logit_bias={7: 3.0})
    token, _, entry = first_entry(tiny_llama, "processed_logits", greedy)
    assert token == int(biased.argmax()) and entry == pytest.approx(top(biased, 5), abs=1e-4)

    sampled = SamplingParams(temperature=0.5, top_k=3, seed=7, max_tokens=2, logprobs=6)
    token, _, entry = first_entry(tiny_llama, "processed_logprobs", sampled)
    kept = top(next_logits / 0.5, 3)
    normaliser = math.log(sum(math.exp(v) for v in kept.values()))
    finite = {t: v for t, v in entry.items() if math.isfinite(v)}
    assert finite == pytest.approx({t: v - normaliser for t, v in kept.items()}, abs=1e-4)
    assert len(entry) == 6 and token in finite  # the other three candidates were filtered out: -inf


def test_prompt_logprobs_follow_the_mode(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    shown = {}
    for mode in ("raw_logprobs", "processed_logits"):
        llm = LLM(str(tiny_llama), dtype="float32", logprobs_mode=mode)
        [output] = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
        shown[mode] = [entry[t].logprob for entry, t in zip(output.prompt_logprobs[1:], PROMPT[1:], strict=True)]
    with torch.inference_mode():
        logits = hf_oracle(tiny_llama)(torch.tensor([PROMPT])).logits[0, :-1].float()
    targets = torch.tensor(PROMPT[1:]).unsqueeze(1)
    assert shown["processed_logits"] == pytest.approx(logits.gather(1, targets).squeeze(1).tolist(), abs=1e-4)
    assert shown["raw_logprobs"] == pytest.approx(
        logits.log_softmax(-1).gather(1, targets).squeeze(1).tolist(), abs=1e-4
    )


class KnowsTheAnswer:
    """Proposes the next three tokens of the plain run's answer, the third one wrong: two accepted, one rejected."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]]) -> None:
        self.answers = answers

    def propose(self, request_id: str, prompt: list[int], output: list[int], max_tokens: int) -> list[int]:
        ahead = self.answers[tuple(prompt)][len(output) : len(output) + 3]
        return [*ahead[:2], (ahead[2] + 1) % 512] if len(ahead) == 3 else ahead

    def finished(self, request_id: str, output: list[int]) -> None:
        pass


def test_verified_drafts_show_what_plain_decoding_shows(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True, logit_bias={7: 2.0})
    prompts = [{"prompt_token_ids": [4, 5, 4, 5, 4, 5, 4]}, {"prompt_token_ids": PROMPT}]
    shown, answers = {}, {}
    for speculate in (False, True):
        spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}} if speculate else {}
        llm = LLM(str(tiny_llama), dtype="float32", logprobs_mode="processed_logprobs", **spec)
        if speculate:
            llm.engine.core.speculator.proposer = KnowsTheAnswer(answers)
            llm.engine.core.speculator.gate.dynamic = False
        outputs = llm.generate(prompts, params, use_tqdm=False)
        answers.update((tuple(o.prompt_token_ids), o.outputs[0].token_ids) for o in outputs)
        shown[speculate] = [[{t: lp.logprob for t, lp in e.items()} for e in o.outputs[0].logprobs] for o in outputs]
        if speculate:
            stats = llm.stats()
            assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    for plain, verified in zip(shown[False], shown[True], strict=True):
        assert [sorted(e) for e in plain] == [sorted(e) for e in verified]
        for a, b in zip(plain, verified, strict=True):
            assert a == pytest.approx(b, abs=1e-4)
