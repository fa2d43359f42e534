"""The engine core in its own process against the thread front: mixed-64 served, and /health under that load.

    .venv/bin/python benchmarks/core_process.py [--rounds 2]

One `tokenloom serve` at a time (default flags, then the same with --core-process), alternating for `--rounds`
rounds, each serving the mixed-64 workload of benchmarks/vs_vllm.py while a client asks /health every 100 ms;
prints out tok/s, TTFT, ITL and /health latency (p50, p99, max) per run. Loopback only, bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

import httpx
from vs_vllm import MODEL_NAME, Run, mixed_64

from tokenloom.bench.local_server import LocalServer
from tokenloom.bench.provenance import git_commit

HEALTH_INTERVAL_S = 0.1


async def health_latencies(url: str, stop: asyncio.Event) -> list[float]:
    latencies = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not stop.is_set():
            sent = time.perf_counter()
            response = await client.get("/health")
            assert response.status_code == 200
            latencies.append(time.perf_counter() - sent)
            await asyncio.sleep(HEALTH_INTERVAL_S)
    return latencies


async def serve_under_watch(url: str, run: Run) -> list[float]:
    stop = asyncio.Event()
    watcher = asyncio.create_task(health_latencies(url, stop))
    await mixed_64(url, run, 0)  # a fresh server each run: nothing cached from an earlier one
    stop.set()
    return await watcher


def one_run(label: str, flags: list[str]) -> str:
    with LocalServer("--served-model-name", MODEL_NAME, *flags) as server:
        run = Run(label)
        health = asyncio.run(serve_under_watch(server.url, run))
    q = statistics.quantiles(health, n=100)
    return f"{run.row()} {1000 * q[49]:.1f} / {1000 * q[98]:.1f} / {1000 * max(health):.0f} ms |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"commit {git_commit()}; load average before: {os.getloadavg()[0]:.2f}")
    header = "| front | out tok/s | TTFT p50 / p95 | ITL p50 / p95 | E2E p95 | (prefill) | errors |"
    print(header + " /health p50 / p99 / max |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for _ in range(args.rounds):
        print(one_run("thread beside the event loop (default)", []), flush=True)
        print(one_run("core in its own process (--core-process)", ["--core-process"]), flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
