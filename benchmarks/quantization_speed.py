"""8-bit KV and 8-bit weights against the model's dtype, in one process and one sitting (issue 24).

    .venv/bin/python benchmarks/quantization_speed.py [--rounds 2] [--engines default "--quantization int8" ...]

Engines built once and measured in turn, alternating their order each round (this machine's speed drifts): the
default (dtype auto, the embedded GGUF dequantized: --quantization none, as the engine's default was before it served
a GGUF's blocks in float32), --kv-cache-dtype int8 and fp8_e4m3, --quantization int8 (and int8_w8a16), both, and
--quantization gguf (the embedded GGUF's blocks as stored). Workloads: mixed-64 (the 64
requests of offline_throughput.py at once, ignore_eos, greedy: output tok/s) and batch-1 decode (one 32-token prompt,
256 output tokens: tok/s after the first token). Medians over the rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

from offline_throughput import mixed_workload

from tokenloom import LLM, SamplingParams
from tokenloom.bench.provenance import cpu_flags

PLAIN = {"quantization": "none"}  # the GGUF dequantized, in the model's dtype
CONFIGS = {
    "default": PLAIN,
    "--kv-cache-dtype int8": {**PLAIN, "kv_cache_dtype": "int8"},
    "--kv-cache-dtype fp8_e4m3": {**PLAIN, "kv_cache_dtype": "fp8_e4m3"},
    "--quantization int8": {"quantization": "int8"},
    "--quantization int8_w8a16": {"quantization": "int8_w8a16"},
    "both": {"kv_cache_dtype": "int8", "quantization": "int8"},
    "--quantization gguf": {"quantization": "gguf"},
}


def mixed_64(llm: LLM, salt: int) -> float:
    work = mixed_workload(64, 0, 49152)
    prompts = [{"prompt_token_ids": [100 + (p[0] + salt * 7919) % 49000, *p[1:]]} for p in work.prompts]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in work.max_tokens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def batch_1(llm: LLM, salt: int) -> float:
    prompt = {"prompt_token_ids": [100 + (i * 31 + salt) % 40000 for i in range(32)]}
    first = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    prefill = time.perf_counter() - first
    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=257, ignore_eos=True), use_tqdm=False)
    return 256 / (time.perf_counter() - start - prefill)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engines", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), help="a subset to run")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}; CPU flags: {cpu_flags()}")
    engines = {name: LLM(max_num_seqs=64, kv_cache_memory=2**30, **CONFIGS[name]) for name in args.engines}
    results: dict[str, dict[str, list[float]]] = {name: {"mixed": [], "batch1": []} for name in engines}
    for round_ in range(args.rounds):
        order = list(engines) if round_ % 2 == 0 else list(engines)[::-1]
        for name in order:
            results[name]["mixed"].append(mixed_64(engines[name], round_ + 1))
            results[name]["batch1"].append(batch_1(engines[name], round_ + 1))
            print(f"round {round_ + 1} {name}: mixed-64 {results[name]['mixed'][-1]:.0f} tok/s, "
                  f"batch-1 decode {results[name]['batch1'][-1]:.1f} tok/s", flush=True)  # fmt: skip
    base = {k: statistics.median(v) for k, v in results["default"].items()}
    print(
        f"\n| engine (medians of {args.rounds}) | mixed-64 out tok/s | vs default | batch-1 decode tok/s | vs default |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, figures in results.items():
        mixed, single = statistics.median(figures["mixed"]), statistics.median(figures["batch1"])
        print(
            f"| {name} | {mixed:.0f} | {mixed / base['mixed']:.2f}x | {single:.1f} | {single / base['batch1']:.2f}x |"
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
