"""Two tenants on one engine: A floods long requests, B sends short chat; B's TTFT under fcfs and fair
(issue 5, scenario 1).

    .venv/bin/python benchmarks/fair_share.py [--flood 12] [--short 8]

Tenant A queues `--flood` requests of 1,500 prompt tokens and 200 output tokens at once; tenant B then sends a
60-token chat request every 8 engine steps. B's time to first token is measured in wall-clock seconds.
"""

from __future__ import annotations

import argparse
import os
import random
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tokenloom import EngineConfig, LLMEngine, SamplingParams


def run(policy: str, flood: int, short: int) -> tuple[list[float], float]:
    engine = LLMEngine(EngineConfig.from_kwargs(max_num_seqs=8, max_num_batched_tokens=1024, scheduling_policy=policy))
    rng = random.Random(0)
    long_params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i in range(flood):
        prompt = [rng.randrange(100, 49000) for _ in range(1500)]
        engine.add_request(prompt, long_params, request_id=f"A{i}", tenant="A")
    short_params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    b_requests, steps = [], 0

    def b_still_waiting() -> bool:
        return len(b_requests) < short or any(r.first_token_time is None for r in b_requests)

    while b_still_waiting() and engine.has_unfinished_requests():
        if steps % 8 == 0 and len(b_requests) < short:
            prompt = [rng.randrange(100, 49000) for _ in range(60)]
            b_requests.append(engine.add_request(prompt, short_params, request_id=f"B{steps}", tenant="B"))
        engine.step()
        steps += 1
    by_tenant = engine.stats().computed_tokens_by_tenant  # counted per scheduled token, as the scheduler gives them
    a_tokens, b_tokens = by_tenant.get("A", 0), by_tenant.get("B", 0)
    ttfts = sorted(r.first_token_time - r.arrival_time for r in b_requests if r.first_token_time is not None)
    return ttfts, b_tokens / max(1, a_tokens + b_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flood", type=int, default=12)
    parser.add_argument("--short", type=int, default=8)
    args = parser.parse_args()
    print(f"load average: {os.getloadavg()[0]:.2f}")
    results = {}
    for policy in ("fcfs", "fair"):
        start = time.perf_counter()
        ttfts, share = run(policy, args.flood, args.short)
        p95 = ttfts[int(0.95 * (len(ttfts) - 1))]
        results[policy] = p95
        print(
            f"{policy}: B's TTFT p50 {ttfts[len(ttfts) // 2]:.2f} s, p95 {p95:.2f} s over {len(ttfts)} requests; "
            f"B's share of the computed tokens while it was active {share:.1%} ({time.perf_counter() - start:.0f} s)"
        )
    print(f"fair / fcfs p95 TTFT of B: {results['fair'] / results['fcfs']:.2f}")


if __name__ == "__main__":
    main()
