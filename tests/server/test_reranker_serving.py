"""vLLM's command line for Qwen3-Reranker (--hf-overrides): /score and /rerank answer with the scores LLM.score gives
for each (query, document) pair joined into one prompt, and usage counts those prompts."""

from __future__ import annotations

import functools
import json

import httpx
import pytest
from server_process import ServerProcess

from tokenloom import LLM

post = functools.partial(httpx.post, timeout=60)  # a slow CI machine's first requests take seconds

OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
             "is_original_qwen3_reranker": True}  # fmt: skip
QUERY = "<Query>: where is the Eiffel tower?\n"
DOCUMENTS = ["<Document>: Bananas are yellow.", "<Document>: It stands in Paris.", "<Document>: Paris, France"]


def test_score_and_rerank_through_a_served_reranker(tiny_chat_model):
    llm = LLM(str(tiny_chat_model), dtype="float32", hf_overrides=OVERRIDES)
    offline = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    scores = [o.outputs.score for o in offline]
    flags = ("--served-model-name", "tiny", "--hf-overrides", json.dumps(OVERRIDES))
    with ServerProcess("--model", str(tiny_chat_model), *flags) as proc:
        scored = post(f"{proc.url}/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
        assert [d["score"] for d in scored["data"]] == pytest.approx(scores, abs=1e-5)
        assert scored["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in offline)  # the query each time
        ranked = post(f"{proc.url}/rerank", json={"query": QUERY, "documents": DOCUMENTS}).json()
        order = sorted(range(3), key=lambda i: -scores[i])
        assert [r["index"] for r in ranked["results"]] == order
        assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(sorted(scores, reverse=True))
        # Generation and embeddings are still served by the same model.
        reply = post(f"{proc.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        embedded = post(f"{proc.url}/v1/embeddings", json={"input": "Hi", "encoding_format": "float"}).json()
        assert len(embedded["data"][0]["embedding"]) == 64
        proc.wait_idle()
