"""Our model code against transformers on the same tiny random weights: logits agree in float32."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import TINY_ARCHS, TINY_VOCAB, hf_oracle

from tokenloom import EngineConfig, LLMEngine
from tokenloom.core.request import Request
from tokenloom.core.scheduler_output import ScheduledRequest
from tokenloom.model.registry import UnsupportedModelError
from tokenloom.sampling_params import SamplingParams
from tokenloom.utils import cdiv

BLOCK = 4


def engine_for(path) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(model=str(path), num_kv_blocks=128, block_size=BLOCK))


def logits_of_chunk(engine: LLMEngine, request: Request, start: int, end: int) -> torch.Tensor:
    """Runs tokens [start, end) of the request through the paged model; returns logits of every row."""
    blocks = list(range(cdiv(end, BLOCK)))
    item = ScheduledRequest(request, start, request.all_token_ids[start:end], blocks, sample=True)
    inputs = engine.core.runner.prepare_inputs([item])
    with torch.inference_mode():
        hidden = engine.core.runner.model(inputs.input_ids, inputs.positions, engine.core.runner.kv_caches, inputs.meta)
        return engine.core.runner.model.compute_logits(hidden)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_prompt_logits_match_transformers(tiny_checkpoints, arch):
    path = tiny_checkpoints[arch]
    engine = engine_for(path)
    tokens = torch.randint(0, TINY_VOCAB, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    request = Request("x", tokens, SamplingParams())
    ours = logits_of_chunk(engine, request, 0, len(tokens))
    with torch.inference_mode():
        theirs = hf_oracle(path)(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("arch", "bounds"),
    [
        ("llama", [0, 7, 13, 22, 23, 24, 25, 26, 27, 28, 29, 30]),  # chunks that start mid-block, then decodes
        ("qwen3", [0, 7, 13, 22, 23, 24, 25, 26, 27, 28, 29, 30]),
        ("llama", [0, 150, 301, 302, 303]),  # chunks longer than one attention tile, over a long past
    ],
)
def test_chunked_prefill_and_decode_logits_match_transformers(tiny_checkpoints, arch, bounds):
    """Chunks after the first and single-token decodes read earlier KV from the paged cache."""
    path = tiny_checkpoints[arch]
    engine = engine_for(path)
    tokens = torch.randint(0, TINY_VOCAB, (bounds[-1],), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        reference = hf_oracle(path)(torch.tensor([tokens])).logits[0]
    request = Request("x", tokens, SamplingParams())
    for start, end in itertools.pairwise(bounds):
        ours = logits_of_chunk(engine, request, start, end)
        torch.testing.assert_close(ours, reference[start:end], atol=1e-4, rtol=1e-4)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        LLMEngine(EngineConfig.from_kwargs(model=str(tmp_path)))


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        LLMEngine(EngineConfig.from_kwargs(model=str(tmp_path / "nope")))
