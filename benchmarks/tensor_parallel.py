"""Tensor parallelism on this machine: mixed-N offline with 1 rank and with 2, and what the all-reduces cost a step.

    .venv/bin/python benchmarks/tensor_parallel.py [--num-requests 32] [--dtype auto]

The model is a random Llama of SmolLM2-135M's size whose heads split in two (SmolLM2's 9 heads and 3 KV heads do
not): hidden 512, 8 heads of 64, 4 KV heads, MLP 1536, 30 layers, a 49,152-token vocabulary. Speed does not depend
on the weights' values. With 2 ranks each process gets one of the two cores. The all-reduce time is what rank 0
spends inside ``torch.distributed.all_reduce`` (60 per step: one after attention, one after the MLP, per layer):
the transfer over loopback plus any wait for the other rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

import torch
import torch.distributed as dist
from offline_throughput import machine, mixed_workload

from tokenloom import LLM, SamplingParams
from tokenloom.bench.provenance import git_commit

SPLITTABLE_135M = dict(
    vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
    num_key_value_heads=4, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, eos_token_id=2, bos_token_id=1,
)  # fmt: skip


class AllReduceClock:
    """Counts rank 0's all-reduce calls and the seconds spent in them."""

    def __init__(self) -> None:
        self.calls, self.seconds = 0, 0.0
        self._all_reduce = dist.all_reduce

    def __enter__(self) -> AllReduceClock:
        def timed(tensor, *args, **kwargs):
            started = time.perf_counter()
            result = self._all_reduce(tensor, *args, **kwargs)
            self.seconds += time.perf_counter() - started
            self.calls += 1
            return result

        dist.all_reduce = timed
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._all_reduce


def run(path: str, ranks: int, work, dtype: str) -> dict[str, float]:
    llm = LLM(path, dtype=dtype, tensor_parallel_size=ranks, max_num_seqs=64)
    try:
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [7] * 40}] * 2, warm, use_tqdm=False)
        steps_before = llm.stats().num_steps
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in work.max_tokens]
        with AllReduceClock() as clock:
            started = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in work.prompts], params, use_tqdm=False)
            seconds = time.perf_counter() - started
        steps = llm.stats().num_steps - steps_before
    finally:
        llm.shutdown()
    return {"seconds": seconds, "steps": steps, "all_reduce_s": clock.seconds, "calls": clock.calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    import transformers

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**SPLITTABLE_135M)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp)
        work = mixed_workload(args.num_requests, 0, SPLITTABLE_135M["vocab_size"])
        results = {ranks: run(tmp, ranks, work, args.dtype) for ranks in (1, 2)}
    load_after = os.getloadavg()
    print(f"commit {git_commit()}; {machine()}; dtype {args.dtype}")
    print(f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print(f"mixed-{args.num_requests}: {work.prompt_tokens} prompt tokens, {work.output_tokens} output tokens")
    print("| ranks | seconds | output tok/s | steps | all-reduce per step | all-reduce share of the time |")
    print("|---:|---:|---:|---:|---:|---:|")
    for ranks, r in results.items():
        per_step = r["all_reduce_s"] / r["steps"] * 1e3
        share = r["all_reduce_s"] / r["seconds"]
        print(
            f"| {ranks} | {r['seconds']:.1f} | {work.output_tokens / r['seconds']:.0f} | {r['steps']:.0f} | "
            f"{per_step:.1f} ms ({r['calls'] / max(r['steps'], 1):.0f} calls) | {share:.0%} |"
        )


if __name__ == "__main__":
    main()
