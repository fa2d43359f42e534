"""The response budget (--max-inflight-response-bytes): what a request may make the server hold is charged at
admission, and all requests in flight stay within the budget, whatever n, max_tokens and logprobs they ask for. And
the text budget: how much text is tokenized at once."""

from __future__ import annotations

import asyncio
import gc
import threading
import tracemalloc
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers
from server_process import HeldRequest, ServerProcess, poll_until

from tokenloom.cli import build_parser, config_from_args, engine_config_from_args
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams
from tokenloom.server.errors import APIError
from tokenloom.server.launch import build_server
from tokenloom.server.response_budget import ResponseBudget, response_charge
from tokenloom.server.text_budget import TextBudget
from tokenloom.server_config import ServerConfig

KIB = 1024


def test_a_request_is_charged_its_fixed_cost_its_held_tokens_and_its_logprobs():
    plain = SamplingParams(max_tokens=100)
    assert response_charge([7], [plain], n=1) == 64 * KIB + 16 * KIB  # a lone sequence's tokens: bounded by the KV
    # Two choices: each one's tokens wait for the other's, 256 B each.
    assert response_charge([7], [plain], n=2) == 64 * KIB + 2 * 16 * KIB + 2 * 100 * 256
    assert response_charge([7, 9], [plain, plain], n=1) == 64 * KIB + 2 * 16 * KIB + 2 * 100 * 256
    # Logprobs 5: each token's own, five alternatives and the entry, 1,280 B each.
    assert response_charge([7], [SamplingParams(max_tokens=100, logprobs=5)], n=1) == 80 * KIB + 100 * 7 * 1280
    # The prompt's logprobs: per prompt token, whatever the output.
    echo = SamplingParams(max_tokens=1, prompt_logprobs=0)
    assert response_charge([10], [echo], n=1) == 80 * KIB + 10 * 2 * 1280
    # Streamed, a logprob is what the output side keeps of it (each chunk is rendered alone): 384 B.
    streamed = SamplingParams(max_tokens=100, logprobs=5)
    assert response_charge([7], [streamed], n=1, streamed=True) == 80 * KIB + 100 * 7 * 384
    # An embedding: each of its values, 112 B, as wide as the model unless it asks for fewer dimensions.
    embedding = SamplingParams.for_embedding(PoolingParams())
    assert response_charge([7, 9], [embedding] * 2, n=1, hidden_size=512) == 96 * KIB + 2 * 512 * 112 + 2 * 256
    cut = SamplingParams.for_embedding(PoolingParams(dimensions=8))
    assert response_charge([7], [cut], n=1, hidden_size=512) == 80 * KIB + 8 * 112


def test_the_budget_refuses_what_can_never_fit_and_what_does_not_fit_now():
    budget = ResponseBudget(1000)
    with pytest.raises(APIError) as alone:
        budget.take_or_refuse(1001)
    assert alone.value.status == 400 and alone.value.code == "response_too_large"
    budget.take_or_refuse(600)
    with pytest.raises(APIError) as now:
        budget.take_or_refuse(500)
    assert now.value.status == 429 and now.value.headers["Retry-After"] == "1"
    budget.take_or_refuse(400)
    budget.give_back(600)
    budget.take_or_refuse(500)
    assert budget.held == 900


HELD = {"model": "tiny", "prompt": "hold", "max_tokens": 1900, "logprobs": 5, "ignore_eos": True}
HELD_CHARGE = 80 * KIB + 1900 * 7 * 384  # streamed: 5.2 MB
BESIDE = {"model": "tiny", "prompt": "beside", "max_tokens": 600, "logprobs": 20, "ignore_eos": True}
BESIDE_CHARGE = 80 * KIB + 600 * 22 * 1280  # whole: 17.0 MB


def test_requests_in_flight_stay_within_the_budget_and_give_it_back_when_they_end(tiny_chat_model):
    """A 20 MiB budget: a stream with logprobs holds 5.2 MB of it; a request charged 17 MB beside it gets 429 (a plain
    request beside it is served), two choices of that one can never fit (400, through the official client), and
    once the stream hangs up its charge comes back and the 17 MB request is served."""
    budget = 20 << 20
    assert BESIDE_CHARGE < budget < HELD_CHARGE + BESIDE_CHARGE
    limit = ("--max-inflight-response-bytes", str(budget), "--max-model-len", "2048")
    with ServerProcess(str(tiny_chat_model), "--served-model-name", "tiny", *limit) as proc:
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as alone:
            client.completions.create(model="tiny", prompt="beside", max_tokens=600, logprobs=20, n=2)
        assert alone.value.code == "response_too_large" and "--max-inflight-response-bytes" in alone.value.message
        held = HeldRequest(f"{proc.url}/v1/completions", HELD)
        try:
            assert poll_until(lambda: held.status, lambda status: status is not None) == 200  # admitted
            assert proc.metric("tokenloom:inflight_response_bytes") == HELD_CHARGE
            beside = httpx.post(f"{proc.url}/v1/completions", json=BESIDE, timeout=60)
            assert beside.status_code == 429 and beside.headers["Retry-After"] == "1", beside.text
            assert beside.json()["error"]["code"] == "response_budget_full"
            plain = client.completions.create(model="tiny", prompt="Hi", max_tokens=3)
            assert plain.choices[0].finish_reason == "length"
        finally:
            held.release()
        served = poll_until(
            lambda: httpx.post(f"{proc.url}/v1/completions", json=BESIDE, timeout=60).status_code,
            lambda status: status == 200,
        )
        assert served == 200
        assert proc.wait_for_metric("tokenloom:inflight_response_bytes", lambda held: held == 0) == 0
        assert proc.metric('tokenloom:requests_rejected_total{reason="response_too_large"}') == 1
        assert proc.metric('tokenloom:requests_rejected_total{reason="response_budget_full"}') >= 1


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": CHAT, "n": 4, "max_tokens": 100, "logprobs": True, "top_logprobs": 20}),
        ("/v1/completions", {"prompt": "one two three " * 60, "echo": True, "max_tokens": 1, "logprobs": 20}),
        ("/v1/completions", {"prompt": "hi", "n": 64, "max_tokens": 50}),
        ("/v1/chat/completions", {"messages": CHAT, "n": 128, "max_tokens": 1}),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "n": 4, "max_tokens": 100, "logprobs": True, "top_logprobs": 20, "stream": True},
        ),
    ],
    ids=["chat-top-logprobs", "completions-echo", "completions-n", "chat-n-one-token", "chat-streamed-top-logprobs"],
)
def test_what_a_request_holds_stays_under_its_charge(tiny_chat_model, path, body):
    """Traced in one process, a request's memory at its peak (held outputs, the rendered response) is under what
    the budget charged it: the charge's figures are upper bounds (benchmarks/response_memory.py, every kind)."""
    peak, charged = traced_peak_and_charge(tiny_chat_model, path, {"ignore_eos": True, **body})
    assert 0 < peak < charged, (peak, charged)


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_what_an_embeddings_request_holds_stays_under_its_charge(tmp_path, encoding_format):
    """128 vectors of a 2,048-wide model, held until the last is done and rendered whole: ~20 MiB, where the
    request's fixed costs were all it was charged before (2 MiB), so a few hundred such requests took gigabytes."""
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=2048, intermediate_size=64, num_hidden_layers=1, num_attention_heads=16,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    body = {"input": [[i + 1, 2, 3] for i in range(128)], "encoding_format": encoding_format}
    peak, charged = traced_peak_and_charge(tmp_path, "/v1/embeddings", body)
    assert 128 * 2048 * 40 < peak < charged, (peak, charged)


def traced_peak_and_charge(model: Path, path: str, body: dict[str, object]) -> tuple[int, int]:
    """One request served in this process (httpx over ASGI): its traced memory at its peak, and what the response
    budget held for it; the charge must have come back when it ends."""
    args = build_parser().parse_args(["serve", str(model), "--served-model-name", "tiny"])
    args.model = args.model_tag
    app, engine = build_server(config_from_args(ServerConfig, args), engine_config_from_args(args))
    budget = app.state.tokenloom.response_budget

    async def served() -> tuple[int, int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            try:
                request = asyncio.create_task(client.post(path, json={"model": "tiny", **body}))
                charged = 0
                while not request.done():
                    charged = max(charged, budget.held)
                    await asyncio.sleep(0.005)
                response = await request
                assert response.status_code == 200, response.text
                del response
                return tracemalloc.get_traced_memory()[1] - before, charged
            finally:
                tracemalloc.stop()

    engine.start()
    try:
        peak, charged = asyncio.run(served())
    finally:
        engine.shutdown()
    assert budget.held == 0, "the charge came back"
    return peak, charged


def test_text_past_the_budget_waits_for_the_tokenizing_before_it_and_a_cancelled_one_holds_until_its_thread_ends():
    """A budget of 10 characters: two texts of 8 run one after the other, never at once; a text of 50 runs alone
    (it still runs); a request cancelled while its thread tokenizes keeps its characters until the thread ends."""
    budget = TextBudget(10)
    started: list[str] = []
    gates = {name: threading.Event() for name in ("a", "b", "big", "cancelled")}

    def tokenize(name: str) -> str:
        started.append(name)
        assert gates[name].wait(timeout=30)
        return name

    async def scenario() -> None:
        first = asyncio.create_task(budget.run(8, tokenize, "a"))
        second = asyncio.create_task(budget.run(8, tokenize, "b"))
        await _until(lambda: started == ["a"])
        await asyncio.sleep(0.05)  # the second has had its chances to start, and waits
        assert started == ["a"] and budget.chars.held == 8
        gates["a"].set()
        assert await first == "a"
        await _until(lambda: started == ["a", "b"])
        big = asyncio.create_task(budget.run(50, tokenize, "big"))  # clamped to the limit: waits for b
        await asyncio.sleep(0.05)
        assert started == ["a", "b"]
        gates["b"].set()
        assert await second == "b"
        await _until(lambda: started[-1] == "big")
        gates["big"].set()
        assert await big == "big" and budget.chars.held == 0
        cancelled = asyncio.create_task(budget.run(10, tokenize, "cancelled"))
        await _until(lambda: started[-1] == "cancelled")
        cancelled.cancel()
        await asyncio.sleep(0.05)
        assert budget.chars.held == 10  # the thread still tokenizes
        gates["cancelled"].set()
        await _until(lambda: budget.chars.held == 0)

    asyncio.run(scenario())


async def _until(condition) -> None:
    for _ in range(3000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")
