"""One long prompt arriving into a busy decode batch: the others' inter-token latency with and without the
stall-free prefill limits (issue 5, scenario 3).

    .venv/bin/python benchmarks/stall_free_prefill.py [--long-prompt 3000] [--threshold 256]

Eight requests decode; after 10 steps a long prompt arrives. Every step that gives the eight a token is one
inter-token gap for each of them, so the step times while the long prompt is prefilled are their ITL.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tokenloom import EngineConfig, LLMEngine, SamplingParams


def itl_during_long_prefill(long_prompt: int, **config) -> tuple[list[float], float]:
    engine = LLMEngine(EngineConfig.from_kwargs(max_num_seqs=16, max_num_batched_tokens=1024, **config))
    rng = random.Random(0)
    decode = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i in range(8):
        engine.add_request([rng.randrange(100, 49000) for _ in range(32)], decode, request_id=f"d{i}")
    for _ in range(10):
        engine.step()
    long = engine.add_request(
        [rng.randrange(100, 49000) for _ in range(long_prompt)],
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        request_id="long",
    )
    gaps = []
    while long.first_token_time is None:
        start = time.perf_counter()
        engine.step()
        gaps.append(time.perf_counter() - start)
    return gaps, long.first_token_time - long.arrival_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long-prompt", type=int, default=3000)
    parser.add_argument("--threshold", type=int, default=256)
    args = parser.parse_args()
    print(f"load average: {os.getloadavg()[0]:.2f}")
    for label, config in (
        ("no limits", {}),
        (
            f"long_prefill_token_threshold={args.threshold}, max_num_partial_prefills=1",
            {"long_prefill_token_threshold": args.threshold, "max_num_partial_prefills": 1},
        ),
    ):
        gaps, ttft = itl_during_long_prefill(args.long_prompt, **config)
        p95 = sorted(gaps)[int(0.95 * (len(gaps) - 1))]
        print(
            f"{label}: {len(gaps)} steps to prefill {args.long_prompt} tokens; decoders' ITL median "
            f"{statistics.median(gaps) * 1e3:.0f} ms, p95 {p95 * 1e3:.0f} ms, max {max(gaps) * 1e3:.0f} ms; "
            f"long prompt's TTFT {ttft:.2f} s"
        )


if __name__ == "__main__":
    main()
