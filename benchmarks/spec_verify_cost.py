"""What verifying drafts costs a step: step time against decode rows, context length and drafts per request.

    .venv/bin/python benchmarks/spec_verify_cost.py [--reps 10]

Runs the real runner (SmolLM2-135M, engine defaults, bf16 where the CPU has it) on hand-made steps: n requests,
each decoding its last token at a context of ctx tokens with k drafts after it (k = 0 is plain decoding), and prints
milliseconds per step. A draft is worth verifying when its chance of acceptance beats the share of a step its token
costs; this table is where that share comes from (the engine fits the same line to its own steps as it runs: see
SpeculationGate in src/tokenloom/core/spec_decode.py).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tokenloom import LLM, SamplingParams
from tokenloom.core.request import Request
from tokenloom.core.scheduler_output import ScheduledRequest


def step_ms(runner, n: int, ctx: int, k: int, block_size: int, reps: int) -> float:
    blocks_each = (ctx + k) // block_size + 1
    items = []
    for i in range(n):
        request = Request(f"r{i}", list(range(1, ctx + 1)), SamplingParams(temperature=0, max_tokens=100))
        blocks = list(range(i * blocks_each, (i + 1) * blocks_each))
        items.append(ScheduledRequest(request, ctx - 1, [5] + [7] * k, blocks, True, [7] * k))
    runner.execute(items)
    started = time.perf_counter()
    for _ in range(reps):
        runner.execute(items)
    return (time.perf_counter() - started) / reps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    llm = LLM(None, max_num_seqs=64, num_kv_blocks=4096)
    core = llm.engine.core
    print(f"load average {os.getloadavg()[0]:.2f}")
    print("| requests | context | k=0 | k=2 | k=4 | k=8 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in (1, 4, 16, 64):
        for ctx in (300, 2000):
            if n * ((ctx + 8) // 16 + 1) > core.num_kv_blocks:
                continue
            row = [step_ms(core.runner, n, ctx, k, core.config.cache.block_size, args.reps) for k in (0, 2, 4, 8)]
            print(f"| {n} | {ctx} | " + " | ".join(f"{ms:.1f}" for ms in row) + " |", flush=True)


if __name__ == "__main__":
    main()
