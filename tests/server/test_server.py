"""The HTTP server, for real: a uvicorn process on 127.0.0.1, the official openai client and httpx."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import openai
import pytest
from server_process import TINY_KV_POOL_ARGS, HeldRequest, ServerProcess

from tokenloom.outputs import CompletionOutput, JoinedDeltas, Logprob, RequestMetrics, RequestOutput
from tokenloom.server.chat import ChatShape
from tokenloom.server.completions import CompletionShape
from tokenloom.server.guard import Guard
from tokenloom.server.tenants import Tenant

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    proc = ServerProcess(
        "--model",
        str(tiny_chat_model),
        "--api-key",
        KEY,
        "--max-body-bytes",
        "20000",
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
    )
    yield proc
    proc.stop()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models_version_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny") == client.models.list().data[0]  # OpenAI's GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.body["code"] == "model_not_found"
    assert httpx.get(f"{server.url}/v1/models/tiny").status_code == 401  # behind the key, as the list
    version = httpx.get(f"{server.url}/version", headers=AUTH).json()
    assert version["engine_config"]["max_model_len"] == 512 and "version" in version
    assert version["quantization"] is None  # not a GGUF: its weights as stored
    assert version["weight_bytes"] > 0  # what the engine measured its weights to hold
    assert httpx.get(f"{server.url}/health").status_code == 200  # public
    assert httpx.get(f"{server.url}/ready").json()["status"] == "ready"


def test_completion_usage_counts(server, client, tiny_chat_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_chat_model))
    prompt = "The quick brown fox jumps over the lazy dog"
    result = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert result.usage.completion_tokens == 7 and result.usage.total_tokens == result.usage.prompt_tokens + 7
    assert result.choices[0].finish_reason == "length"
    by_ids = client.completions.create(
        model="tiny", prompt=tokenizer.encode(prompt), max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_ids.choices[0].text == result.choices[0].text


def test_streamed_chat_equals_the_whole_answer(client):
    messages = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]


def test_chat_logprobs(client):
    result = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    assert all(len(item.top_logprobs) == 2 and item.logprob <= 0 for item in content)


def test_logit_bias_and_min_tokens_reach_every_choice_streamed_or_not(client, tiny_chat_model):
    """OpenAI's logit_bias (token ids as strings, values in [-100, 100]): +100 makes a token every greedy choice,
    -100 bans it; min_tokens keeps an answer going past an end-of-sequence it would choose at once."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_chat_model))
    (paris,), (london,) = tokenizer.encode(" Paris"), tokenizer.encode(" London")
    greedy = dict(model="tiny", max_tokens=3, temperature=0)
    forced = client.completions.create(prompt="The capital is", n=2, logit_bias={str(paris): 100, str(london): 99},
                                       **greedy)  # fmt: skip
    assert [c.text for c in forced.choices] == [" Paris" * 3] * 2
    chunks = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], stream=True,
                                            logit_bias={str(paris): -100, str(london): 99}, **greedy)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " London" * 3
    eos = str(tokenizer.eos_token_id)
    at_once = client.completions.create(prompt="hi", logit_bias={eos: 100}, **greedy)
    assert at_once.usage.completion_tokens == 1 and at_once.choices[0].finish_reason == "stop"
    later = client.completions.create(prompt="hi", logit_bias={eos: 100}, extra_body={"min_tokens": 2}, **greedy)
    assert later.usage.completion_tokens == 3 and later.choices[0].finish_reason == "stop"


def test_vllms_text_fields_reach_the_output(client, tiny_chat_model):
    """include_stop_str_in_output, skip_special_tokens and allowed_token_ids, as a vLLM client sends them
    (extra_body)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_chat_model))
    greedy = dict(model="tiny", temperature=0, max_tokens=12)
    stopped = client.completions.create(prompt="Once upon a time", stop=["e ti"], **greedy,
                                        extra_body={"include_stop_str_in_output": True})  # fmt: skip
    assert stopped.choices[0].text == " time ti" and stopped.choices[0].finish_reason == "stop"
    eos = str(tokenizer.eos_token_id)
    shown = client.completions.create(prompt="hi", logit_bias={eos: 100}, **{**greedy, "max_tokens": 2},
                                      extra_body={"ignore_eos": True, "skip_special_tokens": False})  # fmt: skip
    assert shown.choices[0].text == tokenizer.eos_token * 2
    (paris,), (london,) = tokenizer.encode(" Paris"), tokenizer.encode(" London")
    sampled = client.completions.create(prompt="hi", n=3, seed=1, **{**greedy, "temperature": 1.0},
                                        extra_body={"allowed_token_ids": [paris, london]})  # fmt: skip
    assert all(re.fullmatch("( Paris| London)+", c.text) for c in sampled.choices), [c.text for c in sampled.choices]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server, client, tiny_chat_model):
    """vLLM's truncate_prompt_tokens: the last k tokens of the prompt (-1: the context's worth), counted and echoed
    as what the model read; 0 or more than the context is a 400."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_chat_model))
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog again and again")
    cut = client.completions.create(model="tiny", prompt=ids, max_tokens=1, echo=True,
                                    extra_body={"truncate_prompt_tokens": 5})  # fmt: skip
    assert cut.usage.prompt_tokens == 5 and cut.choices[0].text.startswith(tokenizer.decode(ids[-5:]))
    whole = client.completions.create(model="tiny", prompt=ids, max_tokens=1, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids)
    for keep in (0, 513):  # the server's context is 512
        body = {"model": "tiny", "prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": keep}
        response = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=30, json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "truncate_prompt_tokens"


def test_logprobs_name_their_tokens_by_id_when_asked(client, tiny_chat_model):
    """vLLM's return_tokens_as_token_ids: "token_id:N" for each token and alternative of the logprobs, streamed or
    not, N the token the text was made of."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_chat_model))
    as_ids = {"return_tokens_as_token_ids": True}
    whole = client.completions.create(model="tiny", prompt="Once upon a", max_tokens=4, temperature=0, logprobs=2,
                                       extra_body=as_ids)  # fmt: skip
    tokens = whole.choices[0].logprobs.tokens
    ids = [int(t.removeprefix("token_id:")) for t in tokens]
    assert all(t.startswith("token_id:") for t in tokens) and tokenizer.decode(ids) == whole.choices[0].text
    assert all(key.startswith("token_id:") for top in whole.choices[0].logprobs.top_logprobs for key in top)
    chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                            temperature=0, logprobs=True, top_logprobs=1, stream=True,
                                            extra_body=as_ids)  # fmt: skip
    content = [item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    assert content and all(item.token.startswith("token_id:") for item in content)
    assert all(alt.token.startswith("token_id:") for item in content for alt in item.top_logprobs)


def test_authentication(server):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    missing = httpx.post(f"{server.url}/v1/completions", json=body)
    wrong = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer sk-nope"})
    for response in (missing, wrong):
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0).models.list()


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens", "invalid_value"),
        ({"prompt": "hi", "n": 129}, "n", "invalid_value"),  # OpenAI's cap on choices
        ({"prompt": ["hi"] * 65, "n": 2}, "n", "invalid_value"),  # prompts times n over 128
        ({"prompt": "hi", "best_of": 3}, "best_of", "unsupported"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),  # no stream
        ({"prompt": "word " * 600, "max_tokens": 4}, "max_tokens", "context_length_exceeded"),
        ({"prompt": "hi", "max_tokens": 600}, "max_tokens", "context_length_exceeded"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature", "invalid_value"),
        ({"prompt": "hi", "top_p": 0}, "top_p", "invalid_value"),
        ({"max_tokens": 4}, "prompt", "invalid_value"),
    ],
)
def test_bad_requests_get_openai_style_400(server, body, param, code):
    response = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", **body}, headers=AUTH)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == code and error["message"]


def test_oversized_body_gets_413(server):
    response = httpx.post(
        f"{server.url}/v1/completions", headers=AUTH, json={"model": "tiny", "prompt": "x" * 30000, "max_tokens": 2}
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "body_too_large"


def test_disconnect_mid_stream_frees_everything(server):
    body = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data:")]
        assert received
    # The client is gone: within a few steps nothing runs and no KV block is held.
    assert server.wait_for_metric("tokenloom:num_requests_running", lambda v: v == 0, headers=AUTH) == 0
    assert server.wait_for_metric("tokenloom:kv_cache_usage_perc", lambda v: v == 0, headers=AUTH) == 0
    assert server.metric("tokenloom:request_success_total", AUTH) >= 0
    assert server.metric("tokenloom:generation_tokens_total", AUTH) < 400 + 200  # it stopped early


def test_twenty_concurrent_streams_complete(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.completions.create(
            model="tiny", prompt=f"Request number {i}:", max_tokens=12, stream=True, extra_body={"ignore_eos": True}
        )
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(20)))

    before = server.metric("tokenloom:time_to_first_token_seconds_count", AUTH)
    results = asyncio.run(main())
    assert [reason for _, reason in results] == ["length"] * 20
    assert (
        server.wait_for_metric("tokenloom:time_to_first_token_seconds_count", lambda v: v >= before + 20, headers=AUTH)
        >= before + 20
    )


def test_queue_limit_gives_429(tiny_chat_model):
    proc = ServerProcess("--model", str(tiny_chat_model), "--max-num-seqs", "1", "--max-num-queued-requests", "1")
    url = f"{proc.url}/v1/completions"
    long = {"prompt": "long", "max_tokens": 1500, "ignore_eos": True}
    try:
        running = HeldRequest(url, long)
        assert proc.wait_for_metric("tokenloom:num_requests_running", lambda v: v == 1) == 1
        queued = HeldRequest(url, long)
        assert proc.wait_for_metric("tokenloom:num_requests_waiting", lambda v: v == 1) == 1
        refused = httpx.post(url, json={"prompt": "one more", "max_tokens": 2}, timeout=60)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        assert int(refused.headers["Retry-After"]) >= 1
        assert proc.metric('tokenloom:requests_rejected_total{reason="queue_full",tenant="default"}') == 1
        running.release()
        queued.release()
        assert running.status == queued.status == 200
    finally:
        proc.stop()


def test_a_prompt_admitted_before_its_requests_next_is_refused_is_aborted(tiny_chat_model):
    """Two prompts in one request, the queue room for one: the second gets 429 and the first, admitted but never
    read, is aborted at once rather than left queued to run 1,500 tokens for no one."""
    proc = ServerProcess("--model", str(tiny_chat_model), "--max-num-seqs", "1", "--max-num-queued-requests", "1")
    url = f"{proc.url}/v1/completions"
    long = {"max_tokens": 1500, "ignore_eos": True}
    try:
        running = HeldRequest(url, {"prompt": "long", **long})
        assert proc.wait_for_metric("tokenloom:num_requests_running", lambda v: v == 1) == 1
        refused = httpx.post(url, json={"prompt": ["one", "two"], **long}, timeout=60)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        aborted = 'tokenloom:request_success_total{finished_reason="abort"}'
        assert proc.wait_for_metric(aborted, lambda v: v == 1, absent=0.0) == 1  # not left to run to "length"
        running.release()
        assert running.status == 200
        proc.wait_idle()
    finally:
        proc.stop()


def test_later_choices_and_beam_steps_are_not_refused_by_the_queue_their_request_passed(tiny_chat_model):
    """A queue of one: an n = 3 request's later choices, and a 3-wide beam search's steps of 3 requests, all join it."""
    proc = ServerProcess("--model", str(tiny_chat_model), "--max-num-queued-requests", "1")
    url = f"{proc.url}/v1/completions"
    try:
        for body in ({"n": 3, "temperature": 1.0}, {"n": 3, "use_beam_search": True}):
            reply = httpx.post(url, json={"prompt": "Once upon", "max_tokens": 6, **body}, timeout=120)
            assert reply.status_code == 200, reply.text
            choices = reply.json()["choices"]
            assert [c["index"] for c in choices] == [0, 1, 2] and all(c["finish_reason"] for c in choices)
        assert proc.metric("tokenloom:requests_rejected_total", absent=0.0) == 0
        proc.wait_idle()
    finally:
        proc.stop()


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemptions_under_a_tiny_kv_pool_are_counted(tiny_chat_model, preemption_mode):
    # 24 blocks of 16 hold 384 tokens; each request grows to ~295, so any two running together must preempt.
    proc = ServerProcess(
        "--model",
        str(tiny_chat_model),
        *TINY_KV_POOL_ARGS,
        "--preemption-mode",
        preemption_mode,
        "--swap-space",
        "0.01",
    )
    try:
        statuses: list[int] = []

        def send(i: int) -> None:
            body = {"prompt": f"Story {i}: " + "once more " * 20, "max_tokens": 250, "ignore_eos": True}
            statuses.append(httpx.post(f"{proc.url}/v1/completions", json=body, timeout=120).status_code)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert statuses == [200] * 4
        assert proc.metric("tokenloom:num_preemptions_total") > 0
        other = "recompute" if preemption_mode == "swap" else "swap"
        assert proc.metric(f'tokenloom:num_preemptions_total{{mode="{preemption_mode}"}}') > 0
        assert proc.metric(f'tokenloom:num_preemptions_total{{mode="{other}"}}') == 0
        assert proc.metric("tokenloom:generation_tokens_total") == 1000
        # counted per request from its DELTA outputs, as the histogram of whole requests
        assert proc.metric("tokenloom:request_generation_tokens_sum") == 1000
        assert proc.metric("tokenloom:request_generation_tokens_count") == 4
        # Every step's tokens: each prompt token not served from the cache, each output token but the last,
        # and under recompute the tokens computed again.
        computed_once = (
            proc.metric("tokenloom:prompt_tokens_total") - proc.metric("tokenloom:prefix_cache_hits_total") + 1000 - 4
        )
        computed = proc.metric("tokenloom:iteration_tokens_total_sum")
        assert computed == computed_once if preemption_mode == "swap" else computed > computed_once
        assert proc.metric("tokenloom:iteration_tokens_total_count") > 0
        assert proc.wait_for_metric("tokenloom:kv_cache_usage_perc", lambda v: v == 0) == 0
        assert proc.metric("tokenloom:swap_space_usage_perc") == 0
        assert proc.metric("tokenloom:num_requests_swapped") == 0
    finally:
        proc.stop()


def test_sigterm_drains_in_flight_request_and_exits_zero(tiny_chat_model):
    proc = ServerProcess("--model", str(tiny_chat_model), "--drain-timeout", "60")
    try:
        body = {"prompt": "Drain me", "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{proc.url}/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert json.loads(first[5:])["choices"]
            proc.process.send_signal(15)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        finals = [json.loads(line[5:]) for line in rest[:-1]]
        assert finals[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.process.wait(timeout=60) == 0
    finally:
        proc.stop()


@pytest.mark.real_model
def test_real_model_chat_says_paris():
    import torch

    from tokenloom.model.quantization import gguf_linear_available

    proc = ServerProcess("--max-num-seqs", "4")
    try:
        version = httpx.get(f"{proc.url}/version", timeout=10).json()
        from_blocks = version["dtype"] == "float32" and gguf_linear_available(torch.device("cpu"))
        assert version["quantization"] == ("gguf" if from_blocks else None)  # the embedded GGUF's own blocks
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=30,
            temperature=0,
        )
        assert "Paris" in reply.choices[0].message.content
    finally:
        proc.stop()


TENANTS = """
[[tenant]]
name = "alice"
keys = ["sk-alice"]
max_concurrent_requests = 1
max_tokens = 2000
max_input_tokens = 40

[[tenant]]
name = "bob"
keys = ["sk-bob"]
requests_per_minute = 2
"""


def test_tenants_caps_and_limits(tmp_path, tiny_chat_model):
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    proc = ServerProcess("--model", str(tiny_chat_model), "--tenants", str(path))
    alice, bob = {"Authorization": "Bearer sk-alice"}, {"Authorization": "Bearer sk-bob"}
    url = f"{proc.url}/v1/completions"
    try:
        over_cap = httpx.post(url, json={"prompt": "hi", "max_tokens": 2001}, headers=alice)
        assert over_cap.status_code == 400 and over_cap.json()["error"]["code"] == "max_tokens_over_cap"
        too_long = httpx.post(url, json={"prompt": "word " * 60, "max_tokens": 5}, headers=alice)
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "input_over_cap"
        assert httpx.post(url, json={"prompt": "hi"}, headers={"Authorization": "Bearer sk-eve"}).status_code == 401

        # Alice's first request holds her only slot while it runs; poll until the engine is running it.
        held = HeldRequest(url, {"prompt": "hold", "max_tokens": 2000, "ignore_eos": True}, alice)
        assert proc.wait_for_metric("tokenloom:num_requests_running", lambda v: v == 1, headers=alice) == 1
        second = httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, headers=alice)
        assert second.status_code == 429 and second.json()["error"]["code"] == "concurrency_limit"
        assert int(second.headers["Retry-After"]) >= 1
        # Another tenant is not held back by alice's cap.
        assert httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, headers=bob).status_code == 200
        held.release()
        # The slot is free again once the stream ended (here: alice hung up, and the server aborted her request).
        assert proc.wait_for_metric("tokenloom:num_requests_running", lambda v: v == 0, headers=alice) == 0
        assert httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, headers=alice).status_code == 200

        assert httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, headers=bob).status_code == 200
        third = httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, headers=bob)
        assert third.status_code == 429 and third.json()["error"]["code"] == "request_rate_limit"
        assert 1 <= int(third.headers["Retry-After"]) <= 60
        assert proc.metric('tokenloom:requests_rejected_total{reason="concurrency_limit",tenant="alice"}', alice) == 1
    finally:
        proc.stop()


def test_tenant_file_errors_are_clear(tmp_path):
    from tokenloom.server.tenants import load_tenants

    path = tmp_path / "bad.toml"
    path.write_text('[[tenant]]\nname = "x"\nkeys = ["k"]\nmax_tokns = 5\n')
    with pytest.raises(ValueError, match=r"unknown field.*max_tokns"):
        load_tenants(path)
    path.write_text('[[tenant]]\nname = "x"\nkeys = ["k"]\n[[tenant]]\nname = "y"\nkeys = ["k"]\n')
    with pytest.raises(ValueError, match="already used"):
        load_tenants(path)


def test_queue_timeout_gives_503(tiny_chat_model):
    proc = ServerProcess("--model", str(tiny_chat_model), "--max-num-seqs", "1", "--queue-timeout", "0.2")
    url = f"{proc.url}/v1/completions"
    try:
        long_running = HeldRequest(url, {"prompt": "long", "max_tokens": 1500, "ignore_eos": True})
        assert proc.wait_for_metric("tokenloom:num_requests_running", lambda v: v == 1) == 1
        waited = httpx.post(url, json={"prompt": "short", "max_tokens": 2}, timeout=60)
        long_running.release()
        assert waited.status_code == 503 and waited.json()["error"]["code"] == "queue_timeout"
        assert proc.wait_for_metric("tokenloom:kv_cache_usage_perc", lambda v: v == 0) == 0
    finally:
        proc.stop()


def test_a_request_arrives_when_its_body_has_been_read():
    """The guard stamps a request's arrival (what FCFS order and TTFT count from) once the whole body is in, before
    any handler runs: a request's place in the queue does not depend on how fast its tokenization finished."""
    seen: dict[str, float] = {}

    async def app(scope, receive, send) -> None:
        seen["arrival"] = scope["state"]["arrival_time"]
        seen["handler"] = time.monotonic()
        await receive()

    guard = Guard(app, 1000, [], Tenant(name="default", keys=()), on_reject=lambda reason: None)
    chunks = [{"type": "http.request", "body": b'{"a":', "more_body": True}, {"type": "http.request", "body": b"1}"}]
    sent: list[float] = []

    async def receive():
        await asyncio.sleep(0.05)
        sent.append(time.monotonic())
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    async def send(message) -> None:
        raise AssertionError(f"nothing is sent here: {message}")

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(guard(scope, receive, send))
    assert sent[1] <= seen["arrival"] <= seen["handler"]  # after the last chunk, before the handler


def _delta(text: str, tokens: list[int], finish_reason: str | None, logprobs: bool = False) -> RequestOutput:
    """A DELTA output, as the server asks the engine for: the step's tokens and text."""
    entries = [{t: Logprob(-0.5 * t, rank=1)} for t in tokens] if logprobs else None
    completion = CompletionOutput(0, text, tokens, finish_reason, logprobs=entries)
    metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.0, first_token_time=0.0, finished_time=None)
    return RequestOutput("r", None, [1, 2], [completion], finish_reason is not None, metrics)


def test_a_chat_stream_sends_the_logprobs_of_a_step_whose_text_waits_with_the_next_chunk():
    """An output whose text is held back (half a character) makes no content chunk after the first; its token's
    logprobs go with the next chunk, so the stream's logprobs cover every token once, in order."""

    async def stream():
        yield _delta("a", [101], None, logprobs=True)
        yield _delta("", [102], None, logprobs=True)  # the first half of "指": no chunk
        yield _delta("指", [103], None, logprobs=True)
        yield _delta("!", [104], "length", logprobs=True)

    async def chunks() -> list[dict]:
        return [choice.model_dump() async for choice, _ in ChatShape(None).chunks(stream(), logprobs=True)]

    sent = asyncio.run(chunks())
    assert [c["delta"].get("content") for c in sent] == ["a", "指", "!", None]
    carried = [[entry["token"] for entry in c["logprobs"]["content"]] if c["logprobs"] else [] for c in sent]
    assert carried == [["101"], ["102", "103"], ["104"], []]
    assert sent[1]["logprobs"]["content"][0]["logprob"] == -51.0


def test_joined_deltas_are_the_cumulative_output():
    joined = JoinedDeltas()
    for output in (_delta("Hel", [1, 2], None, True), _delta("", [3], None, True), _delta("lo", [4], "stop", True)):
        joined.add(output)
    whole = joined.output()
    completion = whole.outputs[0]
    assert (completion.text, completion.token_ids, completion.finish_reason) == ("Hello", [1, 2, 3, 4], "stop")
    assert [list(entry) for entry in completion.logprobs] == [[1], [2], [3], [4]] and whole.finished
    joined.add(_delta("!", [5], "stop", True))  # what was returned is not changed by what comes after
    assert completion.token_ids == [1, 2, 3, 4] and len(completion.logprobs) == 4


def test_a_completion_stream_sends_a_chunk_for_every_token_even_before_its_text_is_whole():
    """The first token of "指" is half its UTF-8 bytes, so its text is held back; the chunk still goes out at once
    (empty text), as vLLM sends it: a client times the first token on it, and the text comes whole after."""

    async def stream():
        yield _delta("", [101], None)  # the first half of a character: nothing to show yet
        yield _delta("指", [102], None)
        yield _delta("!", [103], "length")

    async def chunks() -> list[dict]:
        return [choice.model_dump() async for choice, _ in CompletionShape(None).chunks(stream(), logprobs=False)]

    sent = asyncio.run(chunks())
    assert [c["text"] for c in sent] == ["", "指", "!"]
    assert [c["finish_reason"] for c in sent] == [None, None, "length"]
