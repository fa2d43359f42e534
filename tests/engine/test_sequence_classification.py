"""A *ForSequenceClassification checkpoint served as vLLM serves one: its own classification head (score.weight) at the
last prompt token, softmax over its labels (sigmoid for one), equal to transformers' in float32; LLM.classify and
/classify answer its probabilities with the checkpoint's label names, a one-label head scores pairs (/score, /rerank,
LLM.score) as a cross-encoder, and a request for text is refused: such a checkpoint has no LM head."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from server_process import ServerProcess

from tokenloom import LLM, SamplingParams
from tokenloom.model.config import ModelConfig

post = functools.partial(httpx.post, timeout=60)
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TEXTS = ["I loved every minute of it.", "The train leaves at noon.", "What a dreadful waste of time."]


def make_classifier(
    directory: Path, tokenizer_from: Path, arch: str, num_labels: int, problem_type: str | None = None
) -> Path:
    """A tiny random classifier with the real SmolLM2 tokenizer; three labels named, or one (a cross-encoder)."""
    import transformers

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, pad_token_id=2, eos_token_id=2, bos_token_id=1,
                  num_labels=num_labels, problem_type=problem_type)  # fmt: skip
    if num_labels == 3:
        common.update(id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    config = (
        transformers.LlamaConfig(**common, tie_word_embeddings=False)
        if arch == "llama"
        else transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    )
    torch.manual_seed(3)
    model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)  # logits far apart, so the labels differ between the texts
    model.save_pretrained(directory)
    shutil.copy(tokenizer_from / "tokenizer.json", directory / "tokenizer.json")
    shutil.copy(tokenizer_from / "tokenizer_config.json", directory / "tokenizer_config.json")
    return directory


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory, real_model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("classifiers")
    return {
        "three labels": make_classifier(root / "llama", real_model_dir, "llama", 3),
        "one label": make_classifier(root / "qwen3", real_model_dir, "qwen3", 1),
        "multi-label": make_classifier(root / "multi", real_model_dir, "llama", 3, "multi_label_classification"),
    }


def oracle_probabilities(path: Path, prompts: list[list[int]]) -> list[list[float]]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = [model(torch.tensor([p])).logits[0] for p in prompts]
    independent = model.config.problem_type == "multi_label_classification"
    return [(torch.sigmoid(x) if independent or x.numel() == 1 else torch.softmax(x, dim=0)).tolist() for x in logits]


def test_a_classifier_checkpoint_classifies_as_transformers_does(classifiers):
    path = classifiers["three labels"]
    config = ModelConfig.from_hf(__import__("json").loads((path / "config.json").read_text()))
    assert config.labels == ("negative", "neutral", "positive") and config.architecture == "LlamaForCausalLM"
    llm = LLM(str(path), dtype="float32")
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in TEXTS]
    expected = oracle_probabilities(path, prompts)
    classified = llm.classify(TEXTS, use_tqdm=False)
    assert [o.outputs.probs for o in classified] == [pytest.approx(p, abs=1e-5) for p in expected]
    assert [o.prompt_token_ids for o in classified] == prompts and classified[0].outputs.num_classes == 3
    assert len({max(range(3), key=p.__getitem__) for p in expected}) > 1, "the texts fall in different classes"
    with pytest.raises(ValueError, match="generates no text"):
        llm.generate(TEXTS[0], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"LLM\.classify"):
        llm.score(TEXTS[0], TEXTS[1])  # three labels are not a score
    # Its prompts' hidden states still embed (the last token's, normalized).
    assert len(llm.embed(TEXTS[0], use_tqdm=False)[0].outputs.embedding) == 64
    # A multi-label classifier's labels are independent: a sigmoid each, as transformers' problem_type says.
    multi = classifiers["multi-label"]
    independent = [o.outputs.probs for o in LLM(str(multi), dtype="float32").classify(TEXTS, use_tqdm=False)]
    assert independent == [pytest.approx(p, abs=1e-5) for p in oracle_probabilities(multi, prompts)]
    assert any(abs(sum(p) - 1) > 0.05 for p in independent)  # not a softmax


def test_a_one_label_classifier_scores_pairs_as_a_cross_encoder(classifiers):
    path = classifiers["one label"]
    llm = LLM(str(path), dtype="float32")
    tokenizer = llm.get_tokenizer()
    joined = [tokenizer.encode(TEXTS[0] + text) for text in TEXTS[1:]]
    expected = [p[0] for p in oracle_probabilities(path, joined)]
    scored = llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)
    assert [o.outputs.score for o in scored] == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="own classification head"):
        LLM(str(path), dtype="float32", hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
                                                      "classifier_from_token": ["yes"],
                                                      "method": "no_post_processing"})  # fmt: skip


def test_a_served_classifier_answers_classify_score_and_rerank_and_refuses_completions(classifiers):
    three, one = classifiers["three labels"], classifiers["one label"]
    offline = [o.outputs.probs for o in LLM(str(three), dtype="float32").classify(TEXTS, use_tqdm=False)]
    with ServerProcess("--model", str(three), "--served-model-name", "clf") as proc:
        answer = post(f"{proc.url}/classify", json={"model": "clf", "input": TEXTS}).json()
        assert [d["probs"] for d in answer["data"]] == [pytest.approx(p, abs=1e-5) for p in offline]
        assert [d["label"] for d in answer["data"]] == [LABELS[max(range(3), key=p.__getitem__)] for p in offline]
        assert {d["num_classes"] for d in answer["data"]} == {3}
        for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                           ("/score", {"text_1": TEXTS[0], "text_2": TEXTS[1]})):  # fmt: skip
            refused = post(f"{proc.url}{path}", json=body)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "model", path
        proc.wait_idle()
    scores = [o.outputs.score for o in LLM(str(one), dtype="float32").score(TEXTS[0], TEXTS[1:], use_tqdm=False)]
    with ServerProcess("--model", str(one), "--served-model-name", "ce") as proc:
        ranked = post(f"{proc.url}/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:]}).json()["results"]
        by_index = sorted(ranked, key=lambda r: r["index"])
        assert [r["relevance_score"] for r in by_index] == pytest.approx(scores, abs=1e-5)
        proc.wait_idle()
