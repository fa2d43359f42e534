"""LLM.embed (vLLM's): each prompt's last-token final hidden state, normalized, equal to transformers' in float32
whatever the batch, its chunks and the prefix cache; and through the core process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_oracle

from tokenloom import LLM, PoolingParams, SamplingParams

PROMPTS = [list(range(5, 12)), list(range(40, 140)), [7, 3, 400, 2, 9, 11, 300, 1, 5, 6, 8, 13, 21, 34, 55, 89, 144]]


def oracle_states(path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' final hidden state (after the last norm) of each prompt's last token."""
    model = hf_oracle(path)
    with torch.no_grad():
        return [model.model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_embeddings_are_transformers_last_hidden_states_normalized(tiny_checkpoints, arch):
    path = tiny_checkpoints[arch]
    expected = oracle_states(path, PROMPTS)
    llm = LLM(str(path), dtype="float32")
    got = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    assert [o.prompt_token_ids for o in got] == PROMPTS and all(o.finished for o in got)
    for output, state in zip(got, expected, strict=True):
        assert output.outputs.hidden_size == state.shape[0]
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), F.normalize(state, dim=0), atol=1e-5, rtol=0)
    [cut] = llm.embed({"prompt_token_ids": PROMPTS[1]}, PoolingParams(dimensions=16), use_tqdm=False)
    torch.testing.assert_close(torch.tensor(cut.outputs.embedding), F.normalize(expected[1][:16], dim=0), atol=1e-5,
                               rtol=0)  # fmt: skip
    [raw] = llm.embed({"prompt_token_ids": PROMPTS[0]}, PoolingParams(normalize=False), use_tqdm=False)
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding), expected[0], atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="at most the model's hidden size"):
        llm.embed({"prompt_token_ids": PROMPTS[0]}, PoolingParams(dimensions=10_000), use_tqdm=False)


def test_embeddings_in_chunks_beside_generation_and_from_the_prefix_cache(tiny_llama):
    """Prompts prefilled in chunks of 16 in the same steps as decoding requests, then again from cached blocks: the
    same vectors, and the generated tokens those of a run alone."""
    expected = [F.normalize(state, dim=0) for state in oracle_states(tiny_llama, PROMPTS)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = LLM(str(tiny_llama), dtype="float32").generate([{"prompt_token_ids": PROMPTS[1]}], greedy, use_tqdm=False)
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=16, enable_prefix_caching=True)
    engine = llm.engine
    generating = engine.add_request(PROMPTS[1], greedy)
    embedding = SamplingParams.for_embedding(PoolingParams())
    for _ in range(3):  # the generating request's prompt is in; it decodes beside the embedding prompts
        engine.step()
    requests = [engine.add_request(p, embedding) for p in PROMPTS]
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    assert finals[generating.request_id].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert llm.stats().generated_tokens == 24, "an embedding's sampled token, dropped, is not counted as generated"
    for request, vector in zip(requests, expected, strict=True):
        torch.testing.assert_close(torch.tensor(finals[request.request_id].embedding), vector, atol=1e-5, rtol=0)
        assert finals[request.request_id].outputs[0].token_ids == [], "its output is its vector, not its token"
    hits = llm.stats().prefix_cache_hits
    again = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    assert llm.stats().prefix_cache_hits - hits >= 96  # the long prompt's six full blocks
    for output, vector in zip(again, expected, strict=True):
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), vector, atol=1e-5, rtol=0)


def test_embeddings_through_the_core_process(tiny_llama):
    expected = [F.normalize(state, dim=0) for state in oracle_states(tiny_llama, PROMPTS)]
    with LLM(str(tiny_llama), dtype="float32", core_process=True) as llm:
        got = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for output, vector in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), vector, atol=1e-5, rtol=0)


@pytest.mark.real_model
def test_the_real_models_embeddings_in_float32_and_bfloat16(real_model_dir):
    texts = ["The capital of France is Paris.", "Rivers flow into the sea, and the sea into the clouds."]
    llm = LLM(str(real_model_dir), dtype="float32")
    prompts = [llm.tokenizer.encode(text) for text in texts]
    expected = [F.normalize(state, dim=0) for state in oracle_states(real_model_dir, prompts)]
    exact = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    llm.shutdown()
    for output, vector in zip(exact, expected, strict=True):
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), vector, atol=1e-4, rtol=0)
    bf16 = LLM(str(real_model_dir), dtype="bfloat16")
    faster = bf16.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for output, vector in zip(faster, expected, strict=True):
        assert float(torch.tensor(output.outputs.embedding) @ vector) > 0.999  # cosine (unit vectors): 0.99997 here


def test_score_pairs_texts_one_to_many_or_pair_by_pair_by_the_cosine_of_their_embeddings(tiny_llama):
    """LLM.score, as vLLM's with an embedding model: the cosine similarity of transformers' last hidden states."""
    states = oracle_states(tiny_llama, PROMPTS)
    llm = LLM(str(tiny_llama), dtype="float32")
    query, *documents = ({"prompt_token_ids": p} for p in PROMPTS)
    one_to_many = llm.score(query, documents, use_tqdm=False)
    expected = [F.cosine_similarity(states[0], state, dim=0).item() for state in states[1:]]
    assert [o.outputs.score for o in one_to_many] == pytest.approx(expected, abs=1e-5)
    assert one_to_many[0].prompt_token_ids == PROMPTS[0] + PROMPTS[1]
    pairwise = llm.score(documents, [query, query], use_tqdm=False)
    assert [o.outputs.score for o in pairwise] == pytest.approx(expected, abs=1e-5)  # cosine is symmetric
    assert llm.score(query, query, use_tqdm=False)[0].outputs.score == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        llm.score(documents, [query, query, query], use_tqdm=False)
