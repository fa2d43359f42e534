"""KV pressure: the same arrivals served with recompute, swap and auto preemption (issue 5, scenario 2).

    .venv/bin/python benchmarks/kv_pressure.py [--requests 16] [--rate 1.0] [--kv-blocks 96]
        [--prompt-tokens 100-300] [--output-tokens 128-256] [--prefix-caching both|on|off] [--modes ...]
        [--kv-cache-dtypes auto,int8]

The embedded SmolLM2-135M serves `--requests` requests (prompts of 100-300 tokens, 128-256 output tokens,
distinct, so no prefix is shared between requests) arriving as a Poisson process of `--rate` requests per
second, with up to 16 running at once over a KV pool of `--kv-blocks` blocks of 16 tokens: the engine admits
as many prompts as fit, and as they grow it must preempt. Each mode gets the same arrivals, once with prefix
caching (a recompute victim's freed blocks stay findable until they are handed out again) and once without.
It reports generated tokens per second, p50/p95 end-to-end latency, preemptions by mode, tokens computed more
than once, and blocks copied to and from the host pool with the time the copies took.

With --kv-cache-dtypes auto,int8 each run is repeated per KV cache dtype with the same KV memory: the memory of
--kv-blocks blocks in the model's dtype, which an 8-bit cache divides into more blocks.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tokenloom import EngineConfig, LLMEngine, SamplingParams


def workload(
    n: int, rate: float, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int = 0
) -> list[tuple[float, list[int], int]]:
    """(arrival second, prompt token ids, max_tokens) per request."""
    rng = random.Random(seed)
    arrival, requests = 0.0, []
    for _ in range(n):
        prompt = [rng.randrange(100, 49000) for _ in range(rng.randint(*prompt_range))]
        requests.append((arrival, prompt, rng.randint(*output_range)))
        arrival += rng.expovariate(rate)
    return requests


def run(
    mode: str, requests: list[tuple[float, list[int], int]], kv_blocks: int, prefix_caching: bool, kv: str = "auto"
) -> dict:
    common = dict(max_num_seqs=16, max_num_batched_tokens=512, preemption_mode=mode)
    sizing = EngineConfig.from_kwargs(**common, num_kv_blocks=kv_blocks)
    memory = kv_blocks * LLMEngine(sizing).core.kv_bytes_per_block()  # of the model's dtype
    config = EngineConfig.from_kwargs(
        **common, kv_cache_memory=memory, kv_cache_dtype=kv, enable_prefix_caching=prefix_caching
    )
    engine = LLMEngine(config)
    pending = list(enumerate(requests))
    latencies, generated = [], 0
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][1][0] <= now:
            i, (_, prompt, max_tokens) = pending.pop(0)
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(prompt, params, request_id=str(i), arrival_time=time.monotonic())
        if not engine.has_unfinished_requests():
            time.sleep(min(0.05, max(0.0, pending[0][1][0] - now)))
            continue
        for output in engine.step():
            if output.finished:
                latencies.append(output.metrics.finished_time - output.metrics.arrival_time)
                generated += len(output.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    latencies.sort()
    once = sum(len(p) + m - 1 for _, p, m in requests)
    return {
        "seconds": elapsed,
        "tok_s": generated / elapsed,
        "e2e_p50": latencies[len(latencies) // 2],
        "e2e_p95": latencies[int(0.95 * (len(latencies) - 1))],
        "recompute": stats.num_preemptions_recompute,
        "swap": stats.num_preemptions_swap,
        "recomputed_tokens": stats.computed_tokens - once,
        "blocks_copied": stats.swapped_out_blocks + stats.swapped_in_blocks,
        "blocks_found_cached": stats.swap_in_cached_blocks,
        "copy_seconds": stats.swap_copy_seconds,
        "costs": engine.core.preemption_costs,
        "blocks": engine.core.num_kv_blocks,
    }


def span(text: str) -> tuple[int, int]:
    low, high = text.split("-")
    return int(low), int(high)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rate", type=float, default=1.0)
    parser.add_argument("--kv-blocks", type=int, default=96)
    parser.add_argument("--prompt-tokens", default="100-300", help="the range of prompt lengths, min-max")
    parser.add_argument("--output-tokens", default="128-256", help="the range of max_tokens, min-max")
    parser.add_argument("--prefix-caching", choices=["both", "on", "off"], default="both")
    parser.add_argument("--modes", default="recompute,swap,auto")
    parser.add_argument("--kv-cache-dtypes", default="auto", help="comma-separated; the same KV memory for each")
    args = parser.parse_args()
    requests = workload(args.requests, args.rate, span(args.prompt_tokens), span(args.output_tokens))
    print(f"load average: {os.getloadavg()[0]:.2f}")
    for prefix_caching in {"both": (True, False), "on": (True,), "off": (False,)}[args.prefix_caching]:
        print(f"prefix caching {'on' if prefix_caching else 'off'}:")
        results = {}
        for mode, kv in itertools.product(args.modes.split(","), args.kv_cache_dtypes.split(",")):
            r = results[mode if kv == "auto" else f"{mode}+{kv}"] = run(
                mode, requests, args.kv_blocks, prefix_caching, kv
            )
            print(
                f"{mode:>9} KV {kv} ({r['blocks']} blocks): {r['tok_s']:5.1f} tok/s, "
                f"e2e p50 {r['e2e_p50']:5.1f} s p95 {r['e2e_p95']:5.1f} s, "
                f"preemptions recompute {r['recompute']:3d} swap {r['swap']:3d}, "
                f"tokens computed again {r['recomputed_tokens']:5d}, blocks copied {r['blocks_copied']:4d} "
                f"in {r['copy_seconds']:.2f} s (+{r['blocks_found_cached']} found cached at swap-in) "
                f"({r['seconds']:.0f} s; load average {os.getloadavg()[0]:.2f})"
            )
            if mode == "auto" and kv == "auto":
                c = r["costs"]
                print(
                    f"           auto's measured costs at the end: {c.seconds_per_token * 1e3:.2f} ms per token "
                    f"recomputed; a copy {c.seconds_per_copy * 1e3:.2f} ms + {c.seconds_per_block_copy * 1e3:.2f} ms "
                    f"per block of 16 tokens"
                )
        base = results.get("recompute")
        for mode, r in results.items():
            if base and mode != "recompute":
                print(
                    f"  {mode} / recompute: throughput {r['tok_s'] / base['tok_s']:.2f}x, "
                    f"p95 e2e {r['e2e_p95'] / base['e2e_p95']:.2f}x"
                )


if __name__ == "__main__":
    main()
