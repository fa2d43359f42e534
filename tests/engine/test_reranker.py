"""A causal LM served as a reranker, as vLLM serves Qwen3-Reranker (--hf-overrides: a classifier made from the LM
head's rows for "no" and "yes"): LLM.score joins each (query, document) pair into one prompt, and its score is
sigmoid(logit(yes) - logit(no)) at the last token, transformers' in float32; what --hf-overrides may not hold is
refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import hf_oracle

from tokenloom import LLM
from tokenloom.config import EngineConfig
from tokenloom.hf_overrides import HFOverrides

QWEN3_RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                  "is_original_qwen3_reranker": True}  # fmt: skip
QUERY = "<Query>: where is the Eiffel tower?\n"
DOCUMENTS = ["<Document>: It stands in Paris.", "<Document>: Bananas are yellow.", "<Document>: Paris, France"]


def oracle_scores(path, prompts: list[list[int]], no: int, yes: int) -> list[float]:
    model = hf_oracle(path)
    with torch.no_grad():
        return [torch.sigmoid(model(torch.tensor([p])).logits[0, -1, [yes, no]] @ torch.tensor([1.0, -1.0])).item()
                for p in prompts]  # fmt: skip


def test_a_reranker_scores_each_pair_joined_by_its_yes_and_no_logits(tiny_chat_model):
    llm = LLM(str(tiny_chat_model), dtype="float32", hf_overrides=QWEN3_RERANKER)
    tokenizer = llm.get_tokenizer()
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    joined = [tokenizer.encode(QUERY + document) for document in DOCUMENTS]
    expected = oracle_scores(tiny_chat_model, joined, no, yes)
    assert max(expected) - min(expected) > 1e-3, "the documents score apart"
    scored = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    assert [o.outputs.score for o in scored] == pytest.approx(expected, abs=1e-5)
    assert [o.prompt_token_ids for o in scored] == joined
    pairwise = llm.score([QUERY] * 3, DOCUMENTS, use_tqdm=False)  # N:N, the same pairs
    assert [o.outputs.score for o in pairwise] == pytest.approx(expected, abs=1e-5)
    with LLM(str(tiny_chat_model), dtype="float32", hf_overrides=QWEN3_RERANKER, core_process=True) as apart:
        assert [o.outputs.score for o in apart.score(QUERY, DOCUMENTS, use_tqdm=False)] == pytest.approx(expected)
    # Token ids: the query's, then the document's.
    ids = [tokenizer.encode(QUERY), tokenizer.encode(DOCUMENTS[1])]
    [by_ids] = llm.score({"prompt_token_ids": ids[0]}, {"prompt_token_ids": ids[1]}, use_tqdm=False)
    assert by_ids.prompt_token_ids == ids[0] + ids[1]
    assert by_ids.outputs.score == pytest.approx(oracle_scores(tiny_chat_model, [ids[0] + ids[1]], no, yes)[0])
    # LLM.classify: each prompt's probabilities, the classifier's score of it alone; a model that is not one refuses.
    classified = llm.classify(DOCUMENTS, use_tqdm=False)
    alone = [tokenizer.encode(document) for document in DOCUMENTS]
    assert [o.outputs.probs for o in classified] == [pytest.approx([p], abs=1e-5) for p in oracle_scores(
        tiny_chat_model, alone, no, yes)]  # fmt: skip
    assert {o.outputs.num_classes for o in classified} == {1} and [o.prompt_token_ids for o in classified] == alone
    with pytest.raises(ValueError, match="classifier"):
        LLM(str(tiny_chat_model), dtype="float32").classify(DOCUMENTS[0])
    one_token = {"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["yes"],
                 "method": "no_post_processing"}  # fmt: skip
    one_token_llm = LLM(str(tiny_chat_model), dtype="float32", hf_overrides=one_token)
    single = one_token_llm.score(QUERY, DOCUMENTS[0], use_tqdm=False)
    model = hf_oracle(tiny_chat_model)
    with torch.no_grad():
        logit = model(torch.tensor([joined[0]])).logits[0, -1, yes]
    assert single[0].outputs.score == pytest.approx(torch.sigmoid(logit).item(), abs=1e-5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({**QWEN3_RERANKER, "rope_scaling": {"factor": 2}}, r"unknown key\(s\) \['rope_scaling'\]"),
        ({**QWEN3_RERANKER, "architectures": ["Qwen3ForCausalLM"]}, "ForSequenceClassification"),
        ({**QWEN3_RERANKER, "classifier_from_token": ["no", "maybe", "yes"]}, "one or two tokens"),
        ({**QWEN3_RERANKER, "classifier_from_token": ["yes"]}, "reads two tokens"),
        ({**QWEN3_RERANKER, "is_original_qwen3_reranker": False}, "needs method"),
        ({**QWEN3_RERANKER, "is_original_qwen3_reranker": False, "method": "no_post_processing"}, "one token"),
        ({**QWEN3_RERANKER, "is_original_qwen3_reranker": False, "method": "mean"}, "method must be"),
        ({"architectures": ["Qwen3ForSequenceClassification"]}, "head is not loaded"),
        ("{not json", "not valid JSON"),
    ],
)
def test_what_hf_overrides_may_not_hold_is_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(hf_overrides=overrides)


def test_a_classifier_token_outside_the_vocabulary_is_refused_at_start(tiny_chat_model):
    overrides = {**QWEN3_RERANKER, "classifier_from_token": ["no", "definitely-not-a-token"]}
    with pytest.raises(ValueError, match="'definitely-not-a-token' is not a token of this model's vocabulary"):
        LLM(str(tiny_chat_model), dtype="float32", hf_overrides=overrides)
    assert EngineConfig.from_kwargs(hf_overrides=json.dumps(QWEN3_RERANKER)).model.hf_overrides == HFOverrides(
        ("Qwen3ForSequenceClassification",), ("no", "yes"), True
    )


def test_scores_and_embeddings_are_the_same_over_two_tensor_parallel_ranks(tiny_chat_model):
    """Rank 0 holds the whole LM head (the reranker's rows) and the whole final row (the embedding)."""
    with LLM(str(tiny_chat_model), dtype="float32", hf_overrides=QWEN3_RERANKER) as one:
        scores = [o.outputs.score for o in one.score(QUERY, DOCUMENTS, use_tqdm=False)]
        vectors = [o.outputs.embedding for o in one.embed(DOCUMENTS, use_tqdm=False)]
    with LLM(str(tiny_chat_model), dtype="float32", hf_overrides=QWEN3_RERANKER, tensor_parallel_size=2) as two:
        assert [o.outputs.score for o in two.score(QUERY, DOCUMENTS, use_tqdm=False)] == pytest.approx(scores, abs=1e-6)
        for output, vector in zip(two.embed(DOCUMENTS, use_tqdm=False), vectors, strict=True):
            torch.testing.assert_close(torch.tensor(output.outputs.embedding), torch.tensor(vector), atol=1e-6, rtol=0)
