"""Top-1 agreement with transformers' float32 logits, per --kv-cache-dtype, on the real model (issue 24).

    .venv/bin/python benchmarks/kv_accuracy.py [--dtypes bfloat16 float32] [--new-tokens 64] [--chats 3]
        [--kv-dtypes auto int8 fp8_e4m3 fp8_e5m2] [--quantization int8 [--nearest]]
        [--vllm-args '--kv-cache-dtype fp8' ...]

Teacher-forced: each prompt is extended by transformers' own greedy continuation; our engine then runs the prompt
as one chunk and every following token as a single-token decode step, so each position counted reads the whole
context from the paged cache (in its 8-bit form where one is chosen) through the decode operator. A second pass
runs the same sequence as chunks of 16 tokens, where each chunk reads its past from the cache through the prefill
path. Agreement is counted over the positions after the prompt. Then a few chat prompts are answered greedily with
each cache dtype, printed to be read.

With --vllm-args (repeatable), vLLM-CPU serves the same weights with those flags (benchmarks/vs_vllm.py's server,
in bf16, chunked prefill at 16 tokens a step so each chunk reads its past from vLLM's cache, as our "chunks of 16"
pass does) and the same sequences are sent teacher-forced: the whole sequence as the prompt, `prompt_logprobs=1`,
one greedy token; vLLM's top-1 at each position is the token ranked 1 there.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import sys
from pathlib import Path

import httpx

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from transformers import AutoModelForCausalLM

from tokenloom import LLM, EngineConfig, LLMEngine, SamplingParams
from tokenloom.core.request import Request
from tokenloom.core.scheduler_output import ScheduledRequest
from tokenloom.model.loader import resolve_checkpoint_dir
from tokenloom.utils import cdiv

sys.path.insert(0, str(Path(__file__).parent))

# The prompts of the bf16 test (tests/model/test_dtype.py).
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The dog",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Paris is the capital of France. Berlin is the capital of",
    "Once upon a time, in a small village by the sea, there lived",
    "The three primary colors are red, yellow and",
    "In mathematics, a prime number is a natural number greater than 1 that",
]
CHATS = [
    "What is the capital of Japan? Answer in one sentence.",
    "Write a Python function that reverses a string.",
    "Give me three tips for sleeping better.",
]
KV_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")


def teacher_sequences(engine: LLMEngine, new_tokens: int) -> list[tuple[list[int], int, torch.Tensor]]:
    """Each prompt extended by transformers' float32 greedy continuation: (the ids, the prompt's length, the oracle's
    float32 logits at every position)."""
    path = resolve_checkpoint_dir(None)[1]
    oracle = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    sequences = []
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        with torch.inference_mode():
            generated = oracle.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)[0]
            sequences.append((generated.tolist(), len(ids), oracle(generated[None]).logits[0]))
    return sequences


def step_logits(engine: LLMEngine, request: Request, start: int, end: int) -> torch.Tensor:
    """Logits of positions [start, end), run as one scheduled chunk over the cache the earlier chunks filled."""
    blocks = list(range(cdiv(end, engine.config.cache.block_size)))
    item = ScheduledRequest(request, start, request.all_token_ids[start:end], blocks, sample=True)
    runner = engine.core.runner
    inputs = runner.prepare_inputs([item])
    with torch.inference_mode():
        hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
        return runner.model.compute_logits(hidden)


def agreement(engine: LLMEngine, sequences: list[tuple[list[int], int, torch.Tensor]], chunk: int) -> float:
    agree = total = 0
    for ids, prompt_len, reference in sequences:
        request = Request("x", ids, SamplingParams())
        bounds = [0, *range(prompt_len, len(ids), chunk), len(ids)]
        ours = torch.cat([step_logits(engine, request, a, b) for a, b in itertools.pairwise(bounds)])
        agree += int((ours[prompt_len:].argmax(-1) == reference[prompt_len:]).sum())
        total += len(ids) - prompt_len
    return agree / total


def vllm_top1(url: str, ids: list[int]) -> list[int]:
    """vLLM's top-1 token after each position of ids, teacher-forced (its prompt logprobs, then one greedy token)."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1,
            "logprobs": 1, "return_tokens_as_token_ids": True}  # fmt: skip
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status().json()["choices"][0]
    ranked = [
        next(int(token) for token, entry in position.items() if entry["rank"] == 1)
        for position in choice["prompt_logprobs"][1:]  # position i's entry is the token after i - 1
    ]
    last = choice["logprobs"]["tokens"][0]  # "token_id:N"
    return [*ranked, int(last.split(":")[1])]


def vllm_agreement(extra: list[str], sequences: list[tuple[list[int], int, torch.Tensor]]) -> float:
    from vs_vllm import vllm_server

    flags = ["--max-num-batched-tokens", "16", "--enable-chunked-prefill", *extra]
    agree = total = 0
    with vllm_server(Path("~/venv-vllm").expanduser(), "bfloat16", flags) as url:
        for ids, prompt_len, reference in sequences:
            theirs = torch.tensor(vllm_top1(url, ids))
            agree += int((theirs[prompt_len:] == reference[prompt_len:]).sum())
            total += len(ids) - prompt_len
    return agree / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--chats", type=int, default=3)
    parser.add_argument("--kv-dtypes", nargs="+", default=list(KV_DTYPES))
    parser.add_argument("--quantization", default=None, help="8-bit weights for every engine measured (int8)")
    parser.add_argument("--vllm-args", action="append", default=[], help="flags for one vLLM server (repeatable)")
    parser.add_argument(
        "--nearest", action="store_true", help="int8 codes rounded to the nearest, not by GPTQ (the ablation)"
    )
    args = parser.parse_args()
    if args.nearest:  # the runner is given no calibration, so it rounds each weight to its nearest code
        import tokenloom.engine.core

        tokenloom.engine.core.calibration_for = lambda *_: None
    engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=64))
    sequences = [(ids, n, logits.argmax(-1)) for ids, n, logits in teacher_sequences(engine, args.new_tokens)]
    engine.shutdown()
    positions = sum(len(ids) - n for ids, n, _ in sequences)
    print(f"top-1 agreement with transformers float32, over {positions} positions after the prompts")
    print("| model dtype | --quantization | --kv-cache-dtype | decode steps | chunks of 16 |")
    print("|---|---|---|---|---|")
    weights = {} if args.quantization is None else {"quantization": args.quantization}
    for dtype in args.dtypes:
        for kv in args.kv_dtypes:
            engine = LLMEngine(EngineConfig.from_kwargs(dtype=dtype, kv_cache_dtype=kv, num_kv_blocks=64, **weights))
            decode, chunked = agreement(engine, sequences, 1), agreement(engine, sequences, 16)
            print(f"| {dtype} | {args.quantization or '-'} | {kv} | {decode:.1%} | {chunked:.1%} |", flush=True)
            engine.shutdown()
    for extra in args.vllm_args:
        chunked = vllm_agreement(shlex.split(extra), sequences)
        print(f"| vLLM-CPU bfloat16 {extra} | - | - | - | {chunked:.1%} |", flush=True)
    for kv in args.kv_dtypes if args.chats else []:
        llm = LLM(kv_cache_dtype=kv, num_kv_blocks=64, **weights)
        outputs = llm.chat([[{"role": "user", "content": c}] for c in CHATS[: args.chats]],
                           SamplingParams(max_tokens=60, temperature=0))  # fmt: skip
        for chat, output in zip(CHATS, outputs, strict=False):
            answer = output.outputs[0].text.strip()
            print(f"\n[{args.quantization or 'weights as loaded'}, KV {kv}] {chat}\n  -> {answer!r}")
        llm.shutdown()


if __name__ == "__main__":
    main()
