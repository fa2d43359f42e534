"""vLLM's bad words against transformers' ``bad_words_ids`` in float32: greedy tokens equal token for token
whatever the batching (chunked prefill, preemption, steps scheduled ahead, drafts verified), and the words as the
engine tokenizes them (alone, and after a space), offline and through the server.

A bad word's last token is banned where the output ends with its other tokens; transformers reads the prompt too,
vLLM (and so tokenloom) the output only, so the words here never begin with a prompt's last tokens.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from conftest import hf_oracle
from server_process import ServerProcess
from test_min_tokens_and_logit_bias import BATCHING_MODES, MAX_TOKENS, work
from test_spec_decode import KnowingProposer

from tokenloom import LLM, SamplingParams
from tokenloom.config import EngineConfig
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.model.token_bias import bad_word_sequences

GREEDY = dict(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def oracle_tokens(oracle, prompt: list[int], bad_words: list[list[int]]) -> list[int]:
    with torch.no_grad():
        tokens = oracle.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
            pad_token_id=0, bad_words_ids=bad_words or None,
        )  # fmt: skip
    return tokens[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def cases(tiny_llama):
    """Per prompt, three bad words chained so that each changes the answer: one token of the plain answer (banned
    everywhere), then two tokens of the answer without it (their second banned after the first), then three of the
    answer without both. Each word changes transformers' answer where it says."""
    prompts = work()
    oracle = hf_oracle(tiny_llama)
    words_of, expected = [], []
    for prompt in prompts:
        words: list[list[int]] = []
        answer = oracle_tokens(oracle, prompt, words)
        for length, at in ((1, 1), (2, 4), (3, 7)):
            word = answer[at - length + 1 : at + 1]
            assert word[0] not in prompt[-2:], "a word that begins in the prompt is read differently there"
            words.append(word)
            changed = oracle_tokens(oracle, prompt, words)
            assert changed[:at] == answer[:at] and changed[at] != answer[at], "each word changes the answer there"
            answer = changed
        words_of.append(words)
        expected.append(answer)
    params = [SamplingParams(**GREEDY, bad_words_token_ids=words) for words in words_of]
    return prompts, params, expected


@BATCHING_MODES
def test_bad_words_give_transformers_greedy_tokens(tiny_llama, cases, knobs):
    """With drafts, verification row j reads the output and the first j drafts: a draft that completes a bad word
    is rejected there (the drafts are the expected answer, three in ten of them wrong)."""
    prompts, params, expected = cases
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama), **knobs))
    if "speculative_config" in knobs:
        engine.core.speculator.proposer = KnowingProposer(
            {tuple(p): e for p, e in zip(prompts, expected, strict=True)}, num_tokens=3
        )
        engine.core.speculator.gate.dynamic = False
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt, p, request_id=str(i))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert [finished[str(i)] for i in range(len(prompts))] == expected
    assert engine.stats().kv_blocks_in_use == 0
    if "speculative_config" in knobs:
        assert 0 < engine.stats().spec_decode_num_accepted_tokens < engine.stats().spec_decode_num_draft_tokens


def test_single_token_bad_words_leave_steps_scheduled_ahead(tiny_llama, cases):
    """A word of one token is banned everywhere (no output read), so steps are still scheduled ahead beside it; a
    word of several tokens needs the output on the host, so none is while its request runs."""
    prompts, params, _ = cases
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama), async_scheduling=True))
    one_token = SamplingParams(**GREEDY, bad_words_token_ids=params[0].bad_words_token_ids[:1])
    engine.add_request(prompts[0], one_token, request_id="one")
    assert engine.core._may_schedule_ahead()
    engine.add_request(prompts[1], params[1], request_id="several")
    assert not engine.core._may_schedule_ahead()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.core._may_schedule_ahead()


def test_words_are_tokenized_alone_and_after_a_space(tiny_chat_model):
    """ " time" is what the tiny chat model says over and over after "Once upon a time": banned as a bad word (its
    spaced form), the answer never holds it."""
    llm = LLM(str(tiny_chat_model))
    tokenizer = llm.get_tokenizer()
    bare, spaced = (
        tokenizer.encode("time", add_special_tokens=False),
        tokenizer.encode(" time", add_special_tokens=False),
    )
    assert bad_word_sequences(tokenizer, ["time"]) == [bare, spaced] and bare != spaced
    assert bad_word_sequences(tokenizer, ["  time"]) == [bare, spaced]  # leading spaces stripped, as vLLM does
    plain, banned = llm.generate(
        ["Once upon a time"] * 2, [SamplingParams(**GREEDY), SamplingParams(**GREEDY, bad_words=["time"])],
        use_tqdm=False,
    )  # fmt: skip
    assert spaced[0] in plain.outputs[0].token_ids
    assert not {bare[0], spaced[0]} & set(banned.outputs[0].token_ids)
    assert "time" not in banned.outputs[0].text


def test_bad_words_through_the_server(tiny_chat_model):
    with ServerProcess(str(tiny_chat_model), "--served-model-name", "tiny", "--max-model-len", "256") as server:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
        plain = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        reply = httpx.post(f"{server.url}/v1/completions", json={**body, "bad_words": ["time"]}, timeout=60)
        assert "time" in plain and reply.status_code == 200 and "time" not in reply.json()["choices"][0]["text"]
        blank = httpx.post(f"{server.url}/v1/completions", json={**body, "bad_words": ["  "]}, timeout=60)
        assert blank.status_code == 400 and "bad_words" in blank.json()["error"]["message"]


def test_bad_word_token_ids_are_checked_against_the_vocabulary(tiny_llama):
    llm = LLM(str(tiny_llama))
    with pytest.raises(ValueError, match="bad_words"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(bad_words_token_ids=[[10**6]]), use_tqdm=False)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(bad_words=["x"]), use_tqdm=False)
