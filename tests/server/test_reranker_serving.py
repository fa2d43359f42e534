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
        # vLLM's /classify and /pooling: each text's probabilities, LLM.classify's (the reranker's score of it).
        classified = [o.outputs.probs for o in llm.classify(DOCUMENTS, use_tqdm=False)]
        answer = post(f"{proc.url}/classify", json={"model": "tiny", "input": DOCUMENTS}).json()
        assert answer["id"].startswith("classify-") and answer["object"] == "list"
        assert [d["probs"] for d in answer["data"]] == [pytest.approx(p, abs=1e-5) for p in classified]
        assert {(d["label"], d["num_classes"]) for d in answer["data"]} == {("LABEL_0", 1)}
        assert answer["usage"]["prompt_tokens"] == sum(len(llm.get_tokenizer().encode(d)) for d in DOCUMENTS)
        pooled = post(f"{proc.url}/pooling", json={"input": DOCUMENTS}).json()
        assert [d["data"] for d in pooled["data"]] == [d["probs"] for d in answer["data"]]
        # Generation and embeddings are still served by the same model.
        reply = post(f"{proc.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        embedded = post(f"{proc.url}/v1/embeddings", json={"input": "Hi", "encoding_format": "float"}).json()
        assert len(embedded["data"][0]["embedding"]) == 64
        proc.wait_idle()


# A score template as vLLM's examples give Qwen3-Reranker one: the pair as a "query" and a "document" message.
TEMPLATE = """<|im_start|>system
Judge whether the Document meets the requirements of the Query. Answer only "yes" or "no".<|im_end|>
<|im_start|>user
<Instruct>: {{ instruction | default("Find passages that answer the query") }}
<Query>: {{ (messages | selectattr("role", "equalto", "query") | first).content }}
<Document>: {{ (messages | selectattr("role", "equalto", "document") | first).content }}<|im_end|>
<|im_start|>assistant
"""


def test_a_served_rerankers_pairs_go_through_its_chat_template(tiny_chat_model, tmp_path):
    """With --chat-template, as vLLM renders a pair for a reranker: the query and document messages through it, the
    request's instruction beside them; the score that of the rendered prompt."""
    template = tmp_path / "reranker.jinja"
    template.write_text(TEMPLATE)
    llm = LLM(str(tiny_chat_model), dtype="float32", hf_overrides=OVERRIDES)
    tokenizer = llm.get_tokenizer()

    def offline(instruction: str | None) -> list[float]:
        extra = {} if instruction is None else {"instruction": instruction}
        texts = [tokenizer.apply_chat_template([{"role": "query", "content": "where is the tower?"},
                                                {"role": "document", "content": d}], chat_template=TEMPLATE,
                                               tokenize=False, **extra) for d in DOCUMENTS]  # fmt: skip
        prompts = [{"prompt_token_ids": tokenizer.encode(t)} for t in texts]
        return [o.outputs.embedding[0] for o in llm.embed(prompts, llm.engine.classifier, use_tqdm=False)]

    flags = ("--served-model-name", "tiny", "--hf-overrides", json.dumps(OVERRIDES), "--chat-template", str(template))
    with ServerProcess("--model", str(tiny_chat_model), *flags) as proc:
        body = {"query": "where is the tower?", "documents": DOCUMENTS}
        ranked = post(f"{proc.url}/rerank", json=body).json()["results"]
        scores = [r["relevance_score"] for r in sorted(ranked, key=lambda r: r["index"])]
        assert scores == pytest.approx(offline(None), abs=1e-5)
        told = post(f"{proc.url}/v1/rerank", json={**body, "instruction": "Judge relevance"}).json()["results"]
        assert [r["relevance_score"] for r in sorted(told, key=lambda r: r["index"])] == pytest.approx(
            offline("Judge relevance"), abs=1e-5
        )
        assert offline("Judge relevance") != pytest.approx(offline(None), abs=1e-4), "the instruction changed them"
        reserved = post(f"{proc.url}/rerank", json={**body, "chat_template_kwargs": {"tokenize": True}})
        assert reserved.status_code == 400 and reserved.json()["error"]["param"] == "chat_template_kwargs"
