"""min_tokens and logit_bias against transformers in float32: greedy tokens equal token for token whatever the
batching (chunked prefill, preemption, steps scheduled ahead, drafts verified).

transformers' ``min_new_tokens`` sets the end-of-sequence ids' logits to -inf until the output is long enough (as
vLLM's min_tokens does with every stop token id); a logit bias is a value added to a token's logit before sampling
(OpenAI's logit_bias), here a LogitsProcessor of the test's on transformers' side.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import TINY_VOCAB, hf_oracle
from test_spec_decode import KnowingProposer
from transformers import LogitsProcessor, LogitsProcessorList

from tokenloom import LLM, SamplingParams
from tokenloom.config import EngineConfig
from tokenloom.engine.llm_engine import LLMEngine

MAX_TOKENS = 10
MIN_TOKENS = 5
EOS = TINY_VOCAB - 1  # the tiny checkpoints' end-of-sequence id
UNDER_PRESSURE = dict(max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=12, block_size=8)  # preempts
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


class AddBias(LogitsProcessor):
    def __init__(self, bias: dict[int, float]) -> None:
        self.bias = bias

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for token, value in self.bias.items():
            scores[:, token] += value
        return scores


def work(n: int = 6, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    # Repeated runs in the prompts give the n-gram proposer drafts to make.
    return [[rng.randrange(EOS) for _ in range(rng.randint(3, 12))] * 3 for _ in range(n)]


@pytest.fixture(scope="module")
def cases(tiny_llama):
    """Per prompt: its params and transformers' greedy tokens under them. The bias bans the plain greedy output's
    first token and favours two others; the biased output's second token is made a stop token, which min_tokens
    bans there: so each prompt's expected tokens differ from plain greedy's at index 0 (the bias) and from the
    biased output's at index 1 (min_tokens)."""
    prompts = work()
    plain = LLM(str(tiny_llama)).generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    oracle = hf_oracle(tiny_llama)
    params, expected = [], []
    for prompt, output in zip(prompts, plain, strict=True):
        first = output.outputs[0].token_ids[0]
        bias = {first: -100.0, (first + 7) % EOS: 4.0, (first + 11) % EOS: 2.5}
        stop = oracle_tokens(oracle, prompt, AddBias(bias))[1]
        stopping = dict(stop_token_ids=[stop], min_tokens=MIN_TOKENS)
        params.append(SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logit_bias=bias, **stopping))
        expected.append(
            oracle_tokens(oracle, prompt, AddBias(bias), min_new_tokens=MIN_TOKENS, eos_token_id=[stop, EOS])
        )
        assert expected[-1][0] != first and expected[-1][1] != stop
    return [{"prompt_token_ids": p} for p in prompts], params, expected


def oracle_tokens(oracle, prompt: list[int], *processors: LogitsProcessor, **stopping) -> list[int]:
    with torch.no_grad():
        tokens = oracle.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
            logits_processor=LogitsProcessorList(processors), **stopping,
        )  # fmt: skip
    return tokens[0, len(prompt) :].tolist()


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# Each way a batch may be formed and read: the engine's tokens must not depend on it.
BATCHING_MODES = pytest.mark.parametrize(
    "knobs",
    [{}, UNDER_PRESSURE, {"async_scheduling": True}, {**UNDER_PRESSURE, "async_scheduling": True},
     {"speculative_config": NGRAM}],
    ids=["roomy", "chunked + preempted", "scheduled ahead", "scheduled ahead + preempted", "drafts verified"],
)  # fmt: skip


@BATCHING_MODES
def test_min_tokens_and_logit_bias_give_transformers_greedy_tokens(tiny_llama, cases, knobs):
    """With drafts, each row of a request's verification is a token further on: its min_tokens ban and its bias
    hold there as in plain decoding (drafts of the expected answer, three in ten of them wrong)."""
    prompts, params, expected = cases
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama), **knobs))
    if "speculative_config" in knobs:
        answers = {tuple(p["prompt_token_ids"]): e for p, e in zip(prompts, expected, strict=True)}
        engine.core.speculator.proposer = KnowingProposer(answers, num_tokens=3)
        engine.core.speculator.gate.dynamic = False
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt["prompt_token_ids"], p, request_id=str(i))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert [finished[str(i)] for i in range(len(prompts))] == expected
    stats = engine.stats()
    assert stats.kv_blocks_in_use == 0
    if "speculative_config" in knobs:
        assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_min_tokens_bans_the_stop_tokens_until_then_and_no_longer(tiny_llama):
    """The plain output's second token (index 1), made a stop token: with min_tokens 1 the output stops there as
    before; with min_tokens 5 no stop token comes before index 5 (so this output takes another path), the model's
    end-of-sequence id included unless the request ignores it."""
    llm = LLM(str(tiny_llama))
    prompt = {"prompt_token_ids": work(1)[0]}
    greedy = dict(temperature=0, max_tokens=MAX_TOKENS)
    plain = llm.generate(prompt, SamplingParams(**greedy, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    stop = plain[1]
    at_one = llm.generate(prompt, SamplingParams(**greedy, stop_token_ids=[stop], min_tokens=1), use_tqdm=False)
    assert at_one[0].outputs[0].token_ids == plain[:2] and at_one[0].outputs[0].finish_reason == "stop"
    later = llm.generate(prompt, SamplingParams(**greedy, stop_token_ids=[stop], min_tokens=5), use_tqdm=False)
    assert stop not in later[0].outputs[0].token_ids[:5] and len(later[0].outputs[0].token_ids) > 5
    # The model's EOS made the greedy choice (a +100 bias): banned below min_tokens, unless the request ignores it.
    forced = dict(greedy, logit_bias={EOS: 100.0}, min_tokens=3)
    banned = llm.generate(prompt, SamplingParams(**forced), use_tqdm=False)[0].outputs[0]
    assert banned.token_ids[:3] == plain[:3] and banned.token_ids[3:] == [EOS] and banned.finish_reason == "stop"
    ignored = llm.generate(prompt, SamplingParams(**forced, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == [EOS] * MAX_TOKENS


@pytest.mark.parametrize(("min_tokens", "text"), [(0, " ti"), (1, " ti"), (2, " time ti"), (3, " time time ti")])
def test_stop_strings_count_only_where_they_end_after_min_tokens(tiny_chat_model, min_tokens, text):
    """vLLM's rule: no stop string is looked for while the output has min_tokens tokens or fewer, and one that
    ended in that text is not found later; one that ends after it counts, wherever it starts. The tiny chat model
    says " time" over and over, and "me t" spans each two of them: with min_tokens 1 the first still counts (it ends
    in the second token's text), with 2 it does not."""
    llm = LLM(str(tiny_chat_model))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["me t"], min_tokens=min_tokens)
    (output,) = llm.generate("Once upon a time", params, use_tqdm=False)
    assert output.outputs[0].text == text
    assert output.outputs[0].finish_reason == "stop" and output.outputs[0].stop_reason == "me t"


def test_a_stop_string_stays_in_the_text_when_asked_and_is_then_not_held_back(tiny_chat_model):
    """vLLM's include_stop_str_in_output: the text ends after the stop string, and while the request runs no
    characters are held back as a stop string's possible start (they stay in the text whatever comes)."""
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_chat_model)))
    for i, include in enumerate((False, True)):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["e ti"],
                                include_stop_str_in_output=include)  # fmt: skip
        engine.add_request("Once upon a time", params, request_id=str(i))
    texts: dict[str, list[str]] = {"0": [], "1": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            texts[output.request_id].append(output.outputs[0].text)
    assert texts["0"][-1] == " tim" and texts["1"][-1] == " time ti"
    assert texts["0"][0] == " t" and texts["1"][0] == " time"  # " time" less the 3 characters "e ti" could start


def test_special_tokens_are_in_the_text_only_when_asked(tiny_chat_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_chat_model))
    eos = tokenizer.eos_token_id
    llm = LLM(str(tiny_chat_model))
    forced = dict(temperature=0, max_tokens=2, ignore_eos=True, logit_bias={eos: 100.0})
    (shown,) = llm.generate("Hello", SamplingParams(**forced, skip_special_tokens=False), use_tqdm=False)
    (skipped,) = llm.generate("Hello", SamplingParams(**forced), use_tqdm=False)
    assert shown.outputs[0].token_ids == skipped.outputs[0].token_ids == [eos, eos]
    assert shown.outputs[0].text == tokenizer.eos_token * 2 and skipped.outputs[0].text == ""


class KeepOnly(LogitsProcessor):
    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        kept = torch.full_like(scores, float("-inf"))
        kept[:, self.allowed] = scores[:, self.allowed]
        return kept


@pytest.mark.parametrize(
    "knobs", [{}, {**UNDER_PRESSURE, "async_scheduling": True}], ids=["roomy", "ahead + preempted"]
)
def test_allowed_token_ids_give_transformers_greedy_tokens(tiny_llama, knobs):
    """vLLM's allowed_token_ids: every other token's logit -inf, here 24 tokens that leave out each prompt's plain
    greedy first token, so every output takes another path."""
    prompts = work()
    oracle = hf_oracle(tiny_llama)
    greedy = dict(temperature=0, max_tokens=MAX_TOKENS)
    plain = LLM(str(tiny_llama)).generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**greedy),
                                          use_tqdm=False)  # fmt: skip
    firsts = {o.outputs[0].token_ids[0] for o in plain}
    allowed = sorted(random.Random(7).sample(sorted(set(range(EOS)) - firsts), 24))
    params = SamplingParams(**greedy, allowed_token_ids=allowed)
    expected = [oracle_tokens(oracle, prompt, KeepOnly(allowed)) for prompt in prompts]
    outputs = LLM(str(tiny_llama), **knobs).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert token_ids(outputs) == expected
    assert all(set(tokens) <= set(allowed) for tokens in expected)
