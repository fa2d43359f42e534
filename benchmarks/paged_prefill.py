"""Prefill chunks that have a past: read in the paged cache by one operator call a layer, or gathered chunk by chunk.

    .venv/bin/python benchmarks/paged_prefill.py [--rounds 3]

The embedded model in bf16 on a CPU where the bf16 prefill operator is built (AVX-512 BF16, no AMX), offline, three
workloads whose prefill chunks mostly have a past:
  chunked   4 prompts of 4,000 token ids, --max-num-batched-tokens 512 (every chunk after a prompt's first has one),
            max_tokens 1: prefill tok/s
  prefix    32 requests sharing a 1,500-token prefix, each 40 tokens of its own and max_tokens 16 (the prefix is a
            cache hit after the first): requests/s
  beam      LLM.beam_search of 8 prompts (100-400 token ids), 4 beams over 48 tokens: answer tok/s
Each workload runs with the paged operator ("paged"), with it but every chunk's key blocks packed for that chunk
alone ("unshared": no packed block shared between chunks over the same cache slots), and with the pasts gathered
into one buffer per chunk and layer, then the contiguous operator ("gathered": the code before the paged one),
alternated round by round in one process (the same engine; StepInputBuilder.pages_prefills and
step_inputs.shared_key_blocks switched), each round with fresh token ids so nothing of a round before is a cache
hit. Prints medians and the ratios. A benchmark, not a test: CI never runs it.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

import numpy as np

from tokenloom import LLM, BeamSearchParams, SamplingParams
from tokenloom.bench.provenance import git_commit, machine_info
from tokenloom.model import step_inputs

PAGED = step_inputs.StepInputBuilder.pages_prefills
SHARED = step_inputs.shared_key_blocks
MODES = ("paged", "unshared", "gathered")


def unshared_key_blocks(segments: np.ndarray, tables: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Every chunk's key blocks its own units (the paged operator without sharing)."""
    count = -(-segments[:, 2] // step_inputs.PACKED_KEYS)
    inside = np.arange(int(count.max()))[None, :] < count[:, None]
    units = np.full(inside.shape, -1, dtype=np.int64)
    units[inside] = np.arange(int(inside.sum()))
    return units, np.stack(np.nonzero(inside), axis=1).astype(np.int64)


def ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(count)]


def chunked(llm: LLM, rng: random.Random) -> tuple[float, str]:
    prompts = [{"prompt_token_ids": ids(rng, 4000)} for _ in range(4)]
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return 16000 / (time.perf_counter() - start), "prefill tok/s"


def prefix(llm: LLM, rng: random.Random) -> tuple[float, str]:
    shared = ids(rng, 1500)
    llm.generate([{"prompt_token_ids": shared}], SamplingParams(max_tokens=1), use_tqdm=False)  # the prefix cached
    prompts = [{"prompt_token_ids": shared + ids(rng, 40)} for _ in range(32)]
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    return 32 / (time.perf_counter() - start), "requests/s"


def beam(llm: LLM, rng: random.Random) -> tuple[float, str]:
    prompts = [{"prompt_token_ids": ids(rng, rng.randint(100, 400))} for _ in range(8)]
    start = time.perf_counter()
    llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=48, ignore_eos=True))
    return 8 * 4 * 48 / (time.perf_counter() - start), "answer tok/s"


WORKLOADS: dict[str, Callable[[LLM, random.Random], tuple[float, str]]] = {
    "chunked": chunked,
    "prefix": prefix,
    "beam": beam,
}


def use_mode(mode: str) -> None:
    step_inputs.StepInputBuilder.pages_prefills = PAGED if mode != "gathered" else property(lambda self: False)  # type: ignore[method-assign]
    step_inputs.shared_key_blocks = SHARED if mode == "paged" else unshared_key_blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"commit {git_commit()}; {machine_info()}; load average {os.getloadavg()[0]:.2f}", flush=True)
    llm = LLM(max_num_batched_tokens=512, max_model_len=8192)
    if not llm.engine.core.runner.inputs.use_prefill_op:  # type: ignore[union-attr]
        raise SystemExit("the bf16 prefill operator is not in use on this machine (no AVX-512 BF16, or AMX)")
    rng = random.Random(0)
    results: dict[tuple[str, str], list[float]] = {}
    units: dict[str, str] = {}
    chunked(llm, rng)  # warm-up: the operators' first calls
    for round_ in range(args.rounds):
        for name, workload in WORKLOADS.items():
            for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
                use_mode(mode)
                value, units[name] = workload(llm, rng)
                results.setdefault((name, mode), []).append(value)
                print(f"round {round_ + 1} {name:8s} {mode:8s} {value:8.1f} {units[name]}", flush=True)
    use_mode("paged")
    print("\n| workload | paged | unshared | gathered | paged / unshared | paged / gathered |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in WORKLOADS:
        paged, unshared, gathered = (statistics.median(results[(name, mode)]) for mode in MODES)
        print(
            f"| {name} ({units[name]}) | {paged:.1f} | {unshared:.1f} | {gathered:.1f} | {paged / unshared:.2f}x "
            f"| {paged / gathered:.2f}x |"
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
