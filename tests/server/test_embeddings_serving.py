"""POST /v1/embeddings through the official openai client: the vectors LLM.embed gives, whatever the encoding; and
what an embeddings request may not carry refused with a clear 400."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
import transformers
from server_process import ServerProcess

from tokenloom import LLM

HI = [{"role": "user", "content": "Hi"}]
TEXTS = ["The capital of France is Paris.", "Rivers flow to the sea", "Hello"]


@pytest.fixture(scope="module")
def served(tiny_chat_model):
    proc = ServerProcess("--model", str(tiny_chat_model), "--served-model-name", "tiny")
    try:
        yield proc
        proc.wait_idle()  # no request outlived its answer, refused or not
    finally:
        proc.stop()


def test_the_openai_client_gets_the_offline_embeddings(tiny_chat_model, served):
    offline = [o.outputs.embedding for o in LLM(str(tiny_chat_model), dtype="float32").embed(TEXTS, use_tqdm=False)]
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=60)
    reply = client.embeddings.create(model="tiny", input=TEXTS)  # the client asks for base64, and decodes it
    assert [d.index for d in reply.data] == [0, 1, 2] and reply.model == "tiny"
    for data, expected in zip(reply.data, offline, strict=True):
        torch.testing.assert_close(torch.tensor(data.embedding), torch.tensor(expected), atol=1e-6, rtol=0)
    # The prompts' tokens, none for the token each request samples and drops.
    assert reply.usage.total_tokens == reply.usage.prompt_tokens > len(TEXTS)
    plain = httpx.post(f"{served.url}/v1/embeddings", timeout=60,
                       json={"input": TEXTS[0], "encoding_format": "float", "dimensions": 8}).json()  # fmt: skip
    cut = torch.nn.functional.normalize(torch.tensor(offline[0][:8]), dim=0)  # offline's are normalized already
    assert plain["object"] == "list" and plain["id"].startswith("embd-")
    torch.testing.assert_close(torch.tensor(plain["data"][0]["embedding"]), cut, atol=1e-6, rtol=0)
    generated = served.metric("tokenloom:generation_tokens_total")
    prompt_tokens = served.metric("tokenloom:prompt_tokens_total")
    [ids] = client.embeddings.create(model="tiny", input=[[1, 2, 3, 4]], encoding_format="float").data
    assert len(ids.embedding) == 64
    # Its prompt is counted; the token it sampled and dropped is not a generated one.
    assert served.metric("tokenloom:prompt_tokens_total") == prompt_tokens + 4
    assert served.metric("tokenloom:generation_tokens_total") == generated
    assert served.metric("tokenloom:request_generation_tokens_sum") == 0


def test_a_conversation_is_embedded_through_the_chat_template(tiny_chat_model, served):
    """vLLM's chat form: messages instead of input, the template applied without the assistant's turn unless asked,
    one vector, the one of those token ids as input."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_chat_model)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Paris?"}]
    counted = []
    for opened in (False, True):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=opened, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
        body = {"messages": messages, "encoding_format": "float"} | ({"add_generation_prompt": True} if opened else {})
        reply = httpx.post(f"{served.url}/v1/embeddings", json=body, timeout=60).json()
        [data] = reply["data"]
        as_input = httpx.post(f"{served.url}/v1/embeddings", json={"input": ids, "encoding_format": "float"}).json()
        counted.append(reply["usage"]["prompt_tokens"])
        assert counted[-1] == len(ids)
        expected = torch.tensor(as_input["data"][0]["embedding"])  # from cached blocks: a row computed apart
        torch.testing.assert_close(torch.tensor(data["embedding"]), expected, atol=1e-6, rtol=0)
    assert counted[1] > counted[0], "add_generation_prompt opened the assistant's turn"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "Hi", "stream": True}, "stream"),
        ({"input": "Hi", "temperature": 0.5}, "temperature"),
        ({"input": "Hi", "dimensions": 65}, "dimensions"),
        ({"input": []}, "prompt"),
        ({"input": ["Hi"] * 129}, "input"),
        ({"input": "Hi", "model": "other"}, "model"),
        ({"input": "Hi", "messages": HI}, "input"),
        ({}, "input"),
        ({"messages": HI, "reasoning_effort": "low"}, "reasoning_effort"),
        ({"messages": HI, "add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ],
)
def test_what_an_embeddings_request_may_not_carry_is_a_400(served, body, param):
    reply = httpx.post(f"{served.url}/v1/embeddings", json=body, timeout=60)
    assert reply.status_code in (400, 404), reply.text
    assert reply.json()["error"]["param"] == param, reply.text
