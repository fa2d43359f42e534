"""POST /v1/embeddings through the official openai client: the vectors LLM.embed gives, whatever the encoding; vLLM's
/score and /rerank over them; and what such a request may not carry refused with a clear 400."""

from __future__ import annotations

import functools

import httpx
import openai
import pytest
import torch
import transformers
from server_process import ServerProcess

from tokenloom import LLM

post = functools.partial(httpx.post, timeout=60)  # a slow CI machine's first requests take seconds

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
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)
    reply = client.embeddings.create(model="tiny", input=TEXTS)  # the client asks for base64, and decodes it
    assert [d.index for d in reply.data] == [0, 1, 2] and reply.model == "tiny"
    for data, expected in zip(reply.data, offline, strict=True):
        torch.testing.assert_close(torch.tensor(data.embedding), torch.tensor(expected), atol=1e-6, rtol=0)
    # The prompts' tokens, none for the token each request samples and drops.
    assert reply.usage.total_tokens == reply.usage.prompt_tokens > len(TEXTS)
    plain = post(f"{served.url}/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "float", "dimensions": 8})
    plain = plain.json()
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
        reply = post(f"{served.url}/v1/embeddings", json=body).json()
        [data] = reply["data"]
        as_input = post(f"{served.url}/v1/embeddings", json={"input": ids, "encoding_format": "float"}).json()
        counted.append(reply["usage"]["prompt_tokens"])
        assert counted[-1] == len(ids)
        expected = torch.tensor(as_input["data"][0]["embedding"])  # from cached blocks: a row computed apart
        torch.testing.assert_close(torch.tensor(data["embedding"]), expected, atol=1e-6, rtol=0)
    assert counted[1] > counted[0], "add_generation_prompt opened the assistant's turn"


def test_score_and_rerank_are_the_cosines_llm_score_gives(tiny_chat_model, served):
    """/score (and /v1/score) one to many and pair by pair; /rerank (and /v1, /v2) the documents by that score, the
    best first, top_n of them."""
    llm = LLM(str(tiny_chat_model), dtype="float32")
    offline = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS, use_tqdm=False)]
    assert offline[0] == pytest.approx(1.0, abs=1e-5)
    scored = post(f"{served.url}/score", json={"text_1": TEXTS[0], "text_2": TEXTS}).json()
    assert scored["object"] == "list" and scored["id"].startswith("score-") and scored["model"] == "tiny"
    assert [d["index"] for d in scored["data"]] == [0, 1, 2] and {d["object"] for d in scored["data"]} == {"score"}
    assert [d["score"] for d in scored["data"]] == pytest.approx(offline, abs=1e-5)
    assert scored["usage"]["prompt_tokens"] == scored["usage"]["total_tokens"] > 2 * len(TEXTS)
    pairwise = post(f"{served.url}/v1/score", json={"text_1": TEXTS[::-1], "text_2": TEXTS[::-1]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx([1.0] * 3, abs=1e-5)
    order = sorted(range(3), key=lambda i: -offline[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = post(f"{served.url}{path}", json={"query": TEXTS[0], "documents": TEXTS, "top_n": 2}).json()
        assert ranked["id"].startswith("rerank-") and ranked["usage"]["total_tokens"] > 2 * len(TEXTS)
        assert [r["index"] for r in ranked["results"]] == order[:2]
        assert [r["document"]["text"] for r in ranked["results"]] == [TEXTS[i] for i in order[:2]]
        assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx([offline[i] for i in order[:2]])
    every = post(f"{served.url}/rerank", json={"query": "Paris", "documents": TEXTS}).json()["results"]
    assert sorted(r["index"] for r in every) == [0, 1, 2]


def test_vllms_other_spellings_of_a_score_and_what_jina_and_cohere_clients_send(tiny_chat_model, served):
    """/score's sides as data_1/data_2, queries/documents or queries/items; /rerank's return_documents false (Jina's
    and Cohere's field); max_tokens_per_doc and max_tokens_per_query: each side cut to its first tokens."""
    expected = [
        d["score"] for d in post(f"{served.url}/score", json={"text_1": TEXTS[0], "text_2": TEXTS}).json()["data"]
    ]
    for first, second in (("data_1", "data_2"), ("queries", "documents"), ("queries", "items")):
        scored = post(f"{served.url}/score", json={first: TEXTS[0], second: TEXTS}).json()
        assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=1e-6), (first, second)
    mixed = post(f"{served.url}/score", json={"text_1": TEXTS[0], "documents": TEXTS})
    assert mixed.status_code == 400 and mixed.json()["error"]["param"] == "text_1"
    bare = post(f"{served.url}/rerank", json={"query": TEXTS[0], "documents": TEXTS, "return_documents": False}).json()
    assert all(r["document"] is None for r in bare["results"]) and len(bare["results"]) == 3
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_chat_model)
    first_tokens = [tokenizer.decode(tokenizer.encode(t, add_special_tokens=False)[:3]) for t in TEXTS]
    short = post(f"{served.url}/rerank", json={"query": TEXTS[1], "documents": first_tokens}).json()["results"]
    cut = post(f"{served.url}/rerank", json={"query": TEXTS[1], "documents": TEXTS, "max_tokens_per_doc": 3}).json()
    assert [r["index"] for r in cut["results"]] == [r["index"] for r in short]
    assert [r["relevance_score"] for r in cut["results"]] == pytest.approx([r["relevance_score"] for r in short])
    assert [r["document"]["text"] for r in cut["results"]] == [TEXTS[r["index"]] for r in cut["results"]]  # as sent
    query_cut = post(f"{served.url}/score", json={"text_1": TEXTS[1], "text_2": TEXTS[1], "max_tokens_per_query": 3})
    alone = post(f"{served.url}/score", json={"text_1": first_tokens[1], "text_2": TEXTS[1]})
    assert query_cut.json()["data"][0]["score"] == pytest.approx(alone.json()["data"][0]["score"], abs=1e-6)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/score", {"text_1": TEXTS[:2], "text_2": TEXTS}, "text_1"),
        ("/score", {"text_1": "a", "text_2": []}, "text_2"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "temperature": 0.5}, "temperature"),
        ("/rerank", {"query": "a", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
        ("/v2/rerank", {"query": "a", "documents": ["b"], "stream": True}, "stream"),
        ("/rerank", {"query": "a", "documents": ["b"] * 129}, "documents"),
    ],
)
def test_what_a_score_or_rerank_request_may_not_carry_is_a_400(served, path, body, param):
    reply = post(f"{served.url}{path}", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text


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
    reply = post(f"{served.url}/v1/embeddings", json=body)
    assert reply.status_code in (400, 404), reply.text
    assert reply.json()["error"]["param"] == param, reply.text


def test_pooling_answers_with_the_embeddings_and_classify_refuses_a_model_that_is_not_a_classifier(served):
    """vLLM's /pooling: each input's pooled output as it is (an embedding model's vectors, /v1/embeddings' values);
    /classify: a 400 for a model not served as a classifier, as vLLM's."""
    embedded = post(f"{served.url}/v1/embeddings", json={"input": TEXTS, "encoding_format": "float"}).json()
    pooled = post(f"{served.url}/pooling", json={"model": "tiny", "input": TEXTS}).json()
    assert pooled["id"].startswith("pool-") and pooled["object"] == "list" and pooled["model"] == "tiny"
    assert [(d["index"], d["object"]) for d in pooled["data"]] == [(0, "pooling"), (1, "pooling"), (2, "pooling")]
    assert [d["data"] for d in pooled["data"]] == [d["embedding"] for d in embedded["data"]]
    assert pooled["usage"]["prompt_tokens"] == pooled["usage"]["total_tokens"] == embedded["usage"]["prompt_tokens"]
    assert pooled["usage"]["completion_tokens"] == 0  # vLLM's usage: the one token each request samples is dropped
    refused = post(f"{served.url}/classify", json={"model": "tiny", "input": TEXTS[0]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
    generating = post(f"{served.url}/pooling", json={"input": "Hi", "max_tokens": 3})  # not a pooling field
    assert generating.status_code == 400 and generating.json()["error"]["param"] == "max_tokens"
