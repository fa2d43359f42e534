"""The embedded SmolLM2-135M-Instruct: greedy output equals transformers', token for token, under pressure."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import hf_oracle

from tokenloom import LLM, SamplingParams

pytestmark = pytest.mark.real_model

MAX_TOKENS = 24

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colours of the rainbow:",
    "In 1969, the first humans",
    "Photosynthesis is the process by which plants " * 6,
    "Q: What is 12 times 12?\nA:",
    "A long time ago in a small village by the sea, there lived an old fisherman who " * 3,
    "The three laws of thermodynamics state that " * 10,
]


def hf_greedy(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Plain greedy decoding with transformers' own KV cache, one prompt at a time."""
    out = []
    with torch.inference_mode():
        result = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_tokens):
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            result = model(torch.tensor([[token]]), past_key_values=result.past_key_values, use_cache=True)
    return out


PRESSURE = dict(max_num_seqs=8, max_num_batched_tokens=48, num_kv_blocks=20, block_size=16)


@pytest.fixture(scope="module")
def llm_under_pressure(real_model_dir):
    # A 48-token budget chunks every long prompt; 20 blocks of 16 cannot hold all eight requests at once.
    return LLM(str(real_model_dir), **PRESSURE)


@pytest.fixture(scope="module")
def transformers_outputs(real_model_dir, llm_under_pressure) -> dict[str, list[int]]:
    oracle = hf_oracle(real_model_dir)
    return {prompt: hf_greedy(oracle, llm_under_pressure.tokenizer.encode(prompt), MAX_TOKENS) for prompt in PROMPTS}


def assert_greedy_matches_transformers(llm: LLM, expected: dict[str, list[int]]) -> dict:
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    stats = llm.stats()
    assert stats.num_preemptions > 0, "the KV pool was meant to force preemptions"
    assert max(len(o.prompt_token_ids) for o in outputs) > 48, "some prompt was meant to be chunked"
    for output in outputs:
        assert output.outputs[0].token_ids == expected[output.prompt], f"diverged on {output.prompt!r}"
    assert stats.kv_blocks_in_use == 0 and stats.swap_blocks_in_use == 0
    return stats


def test_greedy_matches_transformers_with_chunking_and_preemption(llm_under_pressure, transformers_outputs):
    assert_greedy_matches_transformers(llm_under_pressure, transformers_outputs)


def test_greedy_matches_transformers_with_swap_preemption(real_model_dir, transformers_outputs):
    # Six swap slots hold the KV of a short victim but not of a long one, which falls back to recompute.
    llm = LLM(str(real_model_dir), **PRESSURE, preemption_mode="swap", num_swap_blocks=6)
    stats = assert_greedy_matches_transformers(llm, transformers_outputs)
    assert stats.num_preemptions_swap > 0 and stats.num_preemptions_recompute > 0


def test_stop_strings_end_generation_and_are_left_out(llm_under_pressure):
    params = SamplingParams(temperature=0, max_tokens=20, stop=[" Paris"])
    out = llm_under_pressure.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0]
    assert " Paris" not in out.text
    assert out.finish_reason == "stop" and out.stop_reason == " Paris"


def test_chat_answers_with_the_template(real_model_dir):
    llm = LLM(str(real_model_dir), max_num_seqs=2)
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # the model ended its turn with <|im_end|>
    assert "<|im_start|>" not in out.outputs[0].text


def test_cli_generate_answers_paris():
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenloom.cli",
            "generate",
            "--chat",
            "--prompt",
            "What is the capital of France?",
            "--max-tokens",
            "30",
            "--max-num-seqs",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_cli_reports_bad_flags_clearly():
    result = subprocess.run(
        [sys.executable, "-m", "tokenloom.cli", "generate", "--prompt", "hi", "--block-size", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "block_size must be a positive integer" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_lora_adapter_on_the_real_model_gives_transformers_tokens_with_it_merged(real_model_dir, tmp_path):
    """SmolLM2's shapes (9 heads of 64 over 3 KV heads, a tied head): an adapter on every linear, beside the base."""
    from lora_files import merged_oracle, write_adapter

    from tokenloom import LoRARequest

    adapter = write_adapter(tmp_path / "adapter", real_model_dir, seed=7, alpha=1.0)
    llm = LLM(str(real_model_dir), dtype="float32", enable_lora=True, max_lora_rank=8, max_num_batched_tokens=64)
    tokenizer = llm.get_tokenizer()
    assert tokenizer is not None
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    lora = LoRARequest("adapter", 1, str(adapter))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], params, use_tqdm=False,
                           lora_request=[None] * 3 + [lora] * 3)  # fmt: skip
    ours = [o.outputs[0].token_ids for o in outputs]
    base, merged = hf_oracle(real_model_dir), merged_oracle(real_model_dir, adapter)
    assert ours == [hf_greedy(base, p, 8) for p in prompts] + [hf_greedy(merged, p, 8) for p in prompts]
    assert ours[:3] != ours[3:]
