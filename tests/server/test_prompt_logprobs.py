"""Prompt logprobs and `echo`: each prompt token's logprob as transformers computes it, whatever the chunking."""

from __future__ import annotations

import functools
import itertools
import math

import openai
import pytest
import torch
from conftest import hf_oracle
from server_process import ServerProcess

from tokenloom import LLM, SamplingParams


def oracle_prompt_logprobs(model, prompt: list[int]) -> list[float]:
    """log p(prompt[i] | prompt[:i]) for i >= 1, in float32."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[i - 1, prompt[i]]) for i in range(1, len(prompt))]


def test_prompt_logprobs_equal_transformers_under_chunking_and_a_warm_prefix_cache(tiny_llama):
    prefix = list(range(3, 40))
    prompts = [[*prefix, 50, 51, 52], [*prefix, 60, 61], list(range(100, 170))]
    # A budget of 16 tokens splits every prompt into chunks; the first request leaves the prefix in the cache.
    llm = LLM(str(tiny_llama), max_num_batched_tokens=16, block_size=8, enable_prefix_caching=True)
    llm.generate([{"prompt_token_ids": [*prefix, 7]}], SamplingParams(max_tokens=1), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    oracle = hf_oracle(tiny_llama)
    for prompt, output in zip(prompts, outputs, strict=True):
        entries = output.prompt_logprobs
        assert entries is not None and len(entries) == len(prompt) and entries[0] is None
        got = [entry[token].logprob for entry, token in zip(entries[1:], prompt[1:], strict=True)]
        assert got == pytest.approx(oracle_prompt_logprobs(oracle, prompt), abs=1e-4)
        for entry in entries[1:]:
            ranked = sorted((lp.rank, lp.logprob) for lp in entry.values() if lp.rank is not None)
            assert [rank for rank, _ in ranked] == [1, 2, 3]
            assert all(a >= b for (_, a), (_, b) in itertools.pairwise(ranked))
        assert output.metrics.num_cached_tokens == 0  # computed whole, so every prompt token has its logits
    assert llm.stats().kv_blocks_in_use == 0


@pytest.fixture(scope="module")
def client(tiny_chat_model):
    with ServerProcess(str(tiny_chat_model), "--served-model-name", "tiny", "--max-num-batched-tokens", "8") as proc:
        yield openai.OpenAI(base_url=f"{proc.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_echo_returns_the_prompt_and_its_logprobs_before_the_completion(client, tiny_chat_model):
    from transformers import AutoTokenizer

    prompt = "The quick brown fox jumps over the lazy dog"
    reply = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=2, max_tokens=4, temperature=0)
    choice = reply.choices[0]
    ids = AutoTokenizer.from_pretrained(str(tiny_chat_model)).encode(prompt)
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and len(lp.tokens) == len(ids) + reply.usage.completion_tokens
    assert "".join(lp.tokens) == choice.text and lp.text_offset[len(ids)] == len(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = oracle_prompt_logprobs(hf_oracle(tiny_chat_model), ids)
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) <= 3 and all(math.isfinite(v) for v in top.values()) for top in lp.top_logprobs[1:])

    plain = client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=4, temperature=0)
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None

    stream = client.completions.create(
        model="tiny", prompt=prompt, echo=True, logprobs=2, max_tokens=4, temperature=0, stream=True
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[0].text.startswith(prompt)
    assert "".join(c.text for c in chunks) == choice.text
    assert [t for c in chunks if c.logprobs for t in c.logprobs.token_logprobs] == lp.token_logprobs


def test_vllms_prompt_logprobs_field_in_completions_and_chat(client, tiny_chat_model):
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), by token id, the prompt's own token with
    transformers' logprob and the ranked alternatives; a choice's in completions, the response's in chat; not
    streamed (a 400)."""
    from transformers import AutoTokenizer

    prompt = "The quick brown fox jumps over the lazy dog"
    ids = AutoTokenizer.from_pretrained(str(tiny_chat_model)).encode(prompt)
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 2})
    entries = reply.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    own = [entry[str(token)]["logprob"] for entry, token in zip(entries[1:], ids[1:], strict=True)]
    assert own == pytest.approx(oracle_prompt_logprobs(hf_oracle(tiny_chat_model), ids), abs=1e-4)
    for entry in entries[1:]:
        ranked = sorted((e["rank"], e["logprob"]) for e in entry.values() if e["rank"] is not None)
        assert [rank for rank, _ in ranked] == [1, 2] and ranked[0][1] >= ranked[1][1]
        assert all(isinstance(e["decoded_token"], str) for e in entry.values())
    assert client.completions.create(model="tiny", prompt=prompt, max_tokens=2).choices[0].model_extra.get(
        "prompt_logprobs"
    ) is None  # fmt: skip
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 1})  # fmt: skip
    chat_entries = chat.model_extra["prompt_logprobs"]
    assert len(chat_entries) == chat.usage.prompt_tokens and chat_entries[0] is None
    assert all(1 <= len(entry) <= 2 for entry in chat_entries[1:])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 2})  # fmt: skip


def test_max_logprobs_bounds_what_a_request_may_ask_for_with_a_clear_400(tiny_chat_model):
    with ServerProcess(str(tiny_chat_model), "--served-model-name", "tiny", "--max-logprobs", "30") as proc:
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="none", max_retries=0, timeout=60)
        completion = functools.partial(client.completions.create, model="tiny", prompt="Hello", max_tokens=2)
        reply = completion(logprobs=30, temperature=0)
        assert all(len(top) in (30, 31) for top in reply.choices[0].logprobs.top_logprobs)
        chat = functools.partial(client.chat.completions.create, model="tiny", max_tokens=2, logprobs=True)
        over = "which is greater than max allowed: 30"
        refusals = [
            (lambda: completion(logprobs=31), "logprobs", f"Requested logprobs of 31, {over}"),
            (lambda: completion(logprobs=-1), "logprobs", f"Requested logprobs of 49152, {over}"),  # the vocabulary
            # Asked for a billion, the answer is this 400, not the response budget's refusal.
            (lambda: chat(messages=[{"role": "user", "content": "Hi"}], top_logprobs=10**9), "logprobs", over),
            (lambda: completion(extra_body={"prompt_logprobs": 31}), "prompt_logprobs", over),
            (lambda: completion(n=16, extra_body={"use_beam_search": True}), "n", "so at most 15 beams"),
        ]
        for refuse, param, message in refusals:
            with pytest.raises(openai.BadRequestError) as refused:
                refuse()
            assert refused.value.body["param"] == param and message in refused.value.body["message"]
        proc.wait_idle()
