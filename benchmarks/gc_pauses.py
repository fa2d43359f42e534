"""What Python's full collections cost a server's streams: `tokenloom serve` with its start-up heap frozen (the
default) against the same server with `TOKENLOOM_GC_FREEZE=0`, streaming over HTTP.

    .venv/bin/python benchmarks/gc_pauses.py [--rounds 2] [--workload decode-64]

A full collection (Python's oldest generation) walks every object the process holds; in a server those are mostly
what start-up made (torch, the tokenizer, the model's modules), and while it runs no stream gets its next token. So
its cost shows at the tail of the inter-token latency, not at the median: the table has ITL p99 and the longest gap.
"decode-64" (the default) is 64 streams of 256 tokens after 16-token prompts, all sent at once, so that the tail is
decode steps' and not long prefills' (mixed-64's p99 is its prompts' prefill chunks). The two servers stay up
together, measured one at a time, who goes first alternating by round (vs_vllm.py's client and workloads).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

import httpx
from vs_vllm import MODEL_NAME, WORKLOADS, Run, one_request, salted, wait_for_quiet_machine

from tokenloom.bench.local_server import LocalServer
from tokenloom.bench.provenance import cpu_flags, git_commit


async def decode_64(url: str, run: Run, round_: int) -> None:
    prompts = [salted([100 + 37 * i + j for j in range(16)], round_) for i in range(64)]
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=httpx.Limits(max_connections=128)) as client:
        await one_request(client, [7] * 40, 4, Run("warm-up"))
        start = time.perf_counter()
        await asyncio.gather(*(one_request(client, p, 256, run) for p in prompts))
        run.wall = time.perf_counter() - start


WORKLOADS = {"decode-64": decode_64, **WORKLOADS}
SERVERS = {"TOKENLOOM_GC_FREEZE=0": "0", "frozen start-up heap (default)": "1"}


def row(label: str, run: Run) -> str:
    gaps = sorted(run.itls)
    p99 = statistics.quantiles(gaps, n=100)[98]
    return (f"| {label} | {run.output_tokens / run.wall:.0f} | {1e3 * statistics.median(gaps):.0f} | "
            f"{1e3 * p99:.0f} | {1e3 * gaps[-1]:.0f} | {run.errors} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="decode-64")
    args = parser.parse_args()
    print(f"commit {git_commit()}; load average {os.getloadavg()[0]:.2f}; CPU flags: {cpu_flags()}")
    print("| server | out tok/s | ITL p50 ms | ITL p99 ms | longest gap ms | errors |\n|---|---:|---:|---:|---:|---:|")
    with contextlib.ExitStack() as stack:
        urls = {
            label: stack.enter_context(
                LocalServer("--served-model-name", MODEL_NAME, env={"TOKENLOOM_GC_FREEZE": value})
            ).url
            for label, value in SERVERS.items()
        }
        for round_ in range(args.rounds):
            for label, url in list(urls.items())[:: 1 if round_ % 2 == 0 else -1]:
                wait_for_quiet_machine()
                run = Run(label)
                asyncio.run(WORKLOADS[args.workload](url, run, round_))
                print(row(f"{label}, round {round_ + 1}", run), flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
