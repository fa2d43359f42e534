"""dtype "auto": chosen from what the hardware reports, and bfloat16 close enough to transformers' float32."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from conftest import hf_oracle

from tokenloom import EngineConfig, LLMEngine
from tokenloom.core.request import Request
from tokenloom.model import platform
from tokenloom.sampling_params import SamplingParams
from tokenloom.utils import cdiv

pytestmark = pytest.mark.native_dtype


@pytest.mark.parametrize(
    ("capabilities", "expected"),
    [
        ({"avx512_bf16": True, "amx_bf16": False, "avx2": True}, torch.bfloat16),
        ({"avx512_bf16": False, "amx_bf16": True, "avx2": True}, torch.bfloat16),
        ({"avx512_bf16": False, "amx_bf16": False, "avx2": True}, torch.float32),  # AVX2 only: bf16 is emulated
        ({}, torch.float32),  # a CPU torch knows nothing about
    ],
)
def test_auto_follows_the_cpus_bf16_support(monkeypatch, capabilities, expected):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
    assert platform.resolve_dtype("auto", torch.device("cpu")) == expected


def test_explicit_dtypes_are_kept_whatever_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": True})
    assert platform.resolve_dtype("float32", torch.device("cpu")) == torch.float32
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {})
    assert platform.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_auto_on_this_machine_matches_its_cpu_flags():
    """The real detection, on whatever CPU runs the tests, agrees with the kernel's own flags."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        pytest.skip("no /proc/cpuinfo here")
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    assert platform.cpu_has_native_bf16() == native
    assert platform.resolve_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if native else torch.float32)


def test_engine_reports_the_dtype_it_chose(tiny_llama, monkeypatch):
    monkeypatch.setattr(platform, "cpu_has_native_bf16", lambda: True)
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama), num_kv_blocks=16))
    assert engine.dtype == torch.bfloat16
    assert engine.core.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert next(engine.core.runner.model.parameters()).dtype == torch.bfloat16
    monkeypatch.setattr(platform, "cpu_has_native_bf16", lambda: False)
    assert LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama), num_kv_blocks=16)).dtype == torch.float32


PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Photosynthesis is the process by which plants convert light into chemical energy. It takes place in",
    "Q: What is 12 times 12?\nA: 144.\nQ: What is 7 times 8?\nA:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who every morning",
    "The three primary colours are red, blue and",
    "To make a cup of tea, first boil the water, then",
    "import numpy as np\n\ndef mean_squared_error(a, b):\n",
    "The water cycle describes how water evaporates from the surface of the earth, rises into the atmosphere,",
    "Dear hiring manager, I am writing to apply for the position of",
    "The French Revolution began in 1789 and",
    "In mathematics, a prime number is a natural number greater than 1 that",
]


@pytest.mark.real_model
def test_bfloat16_top1_agrees_with_transformers_float32(real_model_dir):
    """Teacher-forced on the real model: our bfloat16 argmax equals transformers' float32 one at >= 98% of positions.

    Each prompt is extended by 48 of transformers' own greedy tokens, so positions inside generated text count too.
    The sequence runs as a first chunk, eight single-token decodes (the decode operator) and a last chunk, each
    reading the bfloat16 KV of the ones before from the paged cache.
    """
    oracle = hf_oracle(real_model_dir)
    engine = LLMEngine(EngineConfig.from_kwargs(dtype="bfloat16", num_kv_blocks=64, block_size=16))
    assert engine.core.runner.kv_caches[0][0].dtype == torch.bfloat16
    tokenizer = engine.tokenizer
    agree = total = 0
    eos = set(engine.core.model_config.eos_token_ids)
    for generated in greedy_extensions(oracle, [tokenizer.encode(prompt) for prompt in PROMPTS], 48, eos):
        with torch.inference_mode():
            reference = oracle(torch.tensor([generated])).logits[0].argmax(-1)
        request = Request("x", generated, SamplingParams())
        middle = len(generated) // 2
        bounds = [0, *range(middle, middle + 9), len(generated)]
        ours = torch.cat([_logits(engine, request, start, end) for start, end in itertools.pairwise(bounds)])
        agree += int((ours.float().argmax(-1) == reference).sum())
        total += len(generated)
    assert agree / total >= 0.98, f"top-1 agreement {agree}/{total}"


def greedy_extensions(oracle, prompts: list[list[int]], num_new: int, eos: set[int]) -> list[list[int]]:
    """Each prompt followed by up to num_new of the oracle's greedy tokens (to its first EOS), generated as one
    left-padded batch: one generate call instead of one per prompt (a tenth of the time on two cores)."""
    width, pad = max(len(ids) for ids in prompts), min(eos)
    padded = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    with torch.inference_mode():
        rows = oracle.generate(padded, attention_mask=mask, max_new_tokens=num_new, do_sample=False, pad_token_id=pad)
    extended = []
    for ids, row in zip(prompts, rows[:, width:].tolist(), strict=True):
        ends = [i for i, token in enumerate(row) if token in eos]
        extended.append(ids + (row[: ends[0] + 1] if ends else row))
    return extended


def _logits(engine: LLMEngine, request: Request, start: int, end: int) -> torch.Tensor:
    from tokenloom.core.scheduler_output import ScheduledRequest

    blocks = list(range(cdiv(end, engine.config.cache.block_size)))
    item = ScheduledRequest(request, start, request.all_token_ids[start:end], blocks, sample=True)
    inputs = engine.core.runner.prepare_inputs([item])
    with torch.inference_mode():
        hidden = engine.core.runner.model(inputs.input_ids, inputs.positions, engine.core.runner.kv_caches, inputs.meta)
        return engine.core.runner.model.compute_logits(hidden)
