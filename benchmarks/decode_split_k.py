"""One user's decode at long contexts, the CPU decode operator's split-K against whole contexts, alternated in one
process (this machine's speed drifts between minutes).

    .venv/bin/python benchmarks/decode_split_k.py [--rounds 3] [--contexts 1024,4096] [--engines default int8]
                                                 [--mixed-64]

The operator cuts a (sequence, KV head) context of 1,024 keys or more into up to one split per thread (each of 512
keys or more) that any thread takes, then merges them (paged_attention.cpp); without it, a batch of one gives as many
pieces of work as the model has KV heads (3 for SmolLM2-135M), which leaves threads idle. The "whole" variant calls
the same operator with split_keys past any context. Each measure: one prompt of the context's length (random ids, the
same for both variants of a round: the second finds it in the prefix cache), its first token, then 128 tokens more,
greedy, ignore_eos; ms a token after the first (the decode alone). Medians over the rounds; both variants in each
round, in turn.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

from quantization_speed import mixed_64

from tokenloom import LLM, SamplingParams
from tokenloom.bench.provenance import cpu_flags
from tokenloom.model import cpu_kernel

ENGINES = {"default": {}, "int8": {"quantization": "int8"}}
WHOLE = 1 << 30  # split_keys past any context
DECODED = 128


def ms_per_token(llm: LLM, context: int, salt: int) -> float:
    prompt = {"prompt_token_ids": [100 + (i * 31 + salt) % 40000 for i in range(context)]}
    params = SamplingParams(temperature=0, max_tokens=DECODED + 1, ignore_eos=True)
    output = llm.generate(prompt, params, use_tqdm=False)[0]
    metrics = output.metrics
    assert metrics is not None and metrics.first_token_time is not None and metrics.finished_time is not None
    return 1000 * (metrics.finished_time - metrics.first_token_time) / DECODED


def with_split_keys(split_keys: int) -> Callable[..., object]:
    original = cpu_kernel.paged_decode_attention

    def call(*args: object, **kwargs: object) -> object:
        return original(*args, **{**kwargs, "split_keys": split_keys})

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    parser.add_argument("--mixed-64", action="store_true", help="a crowd's output tok/s instead of one user's decode")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"load average {os.getloadavg()[0]:.2f}; CPU flags: {cpu_flags()}")
    original = cpu_kernel.paged_decode_attention
    variants = {"whole": with_split_keys(WHOLE), "split-K": original}
    for name in args.engines:
        sizes = {"max_num_seqs": 64, "kv_cache_memory": 2**30} if args.mixed_64 else {"max_num_seqs": 8}
        llm = LLM(**sizes, **ENGINES[name])
        ms_per_token(llm, 64, -1)  # warm: the weights paged in, the operators built
        results: dict[tuple[int, str], list[float]] = {}
        for round_ in range(args.rounds):
            order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
            for context in [0] if args.mixed_64 else contexts:
                for variant in order:
                    cpu_kernel.paged_decode_attention = variants[variant]
                    try:
                        if args.mixed_64:
                            result = mixed_64(llm, 2 * round_ + (variant == "split-K"))
                        else:
                            result = ms_per_token(llm, context, round_)
                    finally:
                        cpu_kernel.paged_decode_attention = original
                    results.setdefault((context, variant), []).append(result)
        for context in [0] if args.mixed_64 else contexts:
            pairs = list(zip(results[(context, "whole")], results[(context, "split-K")], strict=True))
            whole, split = (statistics.median(side) for side in zip(*pairs, strict=True))
            rounds = ", ".join(f"{w:.1f}/{s:.1f}" for w, s in pairs)
            if args.mixed_64:
                print(f"{name:8s} mixed-64: whole {whole:6.1f} output tok/s, split-K {split:6.1f} "
                      f"({split / whole:.2f}x); rounds whole/split {rounds}")  # fmt: skip
            else:
                print(f"{name:8s} context {context:5d}: whole {whole:6.1f} ms a token, split-K {split:6.1f} "
                      f"({whole / split:.2f}x); rounds whole/split {rounds}")  # fmt: skip
        del llm
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
