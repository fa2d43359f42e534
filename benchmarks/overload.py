"""Overload: offer ten times what the server completes, for a minute, and check that it passes the load back.

    .venv/bin/python benchmarks/overload.py [--factor 10] [--duration 60] [--max-tokens 32]

1. Calibrate: 16 chat requests at once against a fresh server; capacity = their completed req/s.
2. Offer factor x capacity as Poisson arrivals for `duration` seconds, streaming, while /health is polled.
3. Report: every request's answer (200, 429 with Retry-After, 503 or anything else), /health latency p50/p95,
   RSS before and after, and whether running, waiting and KV usage went back to 0.

The server runs with its admission limits on (a bounded queue and a queue timeout); without them overload only
grows the queue. Loopback only; the number of requests and the time are bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from collections import Counter

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import httpx

from tokenloom.bench.local_server import LocalServer

SERVER_FLAGS = ("--max-num-queued-requests", "32", "--queue-timeout", "10")


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + " ", name + "{")))


async def chat(client: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[int, bool]:
    body = {
        "messages": [{"role": "user", "content": f"Request {i}: tell me about rivers and the sea."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for _ in response.aiter_lines():
                pass
            return response.status_code, "retry-after" in response.headers
    except httpx.HTTPError:
        return -1, False


async def calibrate(url: str, max_tokens: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(chat(client, i, max_tokens) for i in range(16)))
    assert all(status == 200 for status, _ in results), results
    return 16 / (time.perf_counter() - start)


async def offer(url: str, rate: float, duration: float, max_tokens: int) -> tuple[list[tuple[int, bool]], list[float]]:
    rng = random.Random(0)
    health: list[float] = []
    done = asyncio.Event()

    async def poll_health(client: httpx.AsyncClient) -> None:
        while not done.is_set():
            start = time.perf_counter()
            response = await client.get("/health")
            assert response.status_code == 200
            health.append(time.perf_counter() - start)
            await asyncio.sleep(0.5)

    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=100)
    async with (
        httpx.AsyncClient(base_url=url, timeout=180, limits=limits) as client,
        httpx.AsyncClient(base_url=url, timeout=30) as health_client,
    ):
        poller = asyncio.create_task(poll_health(health_client))
        tasks, start, i = [], time.perf_counter(), 0
        while time.perf_counter() - start < duration:
            tasks.append(asyncio.create_task(chat(client, i, max_tokens)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        done.set()
        await poller
    return results, health


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--factor", type=float, default=10.0)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    with LocalServer(*SERVER_FLAGS) as server:
        capacity = asyncio.run(calibrate(server.url, args.max_tokens))
        rss_before = metric(server.url, "process_resident_memory_bytes")
        rate = args.factor * capacity
        print(f"capacity {capacity:.2f} req/s; offering {rate:.1f} req/s for {args.duration:.0f}s")
        started = time.perf_counter()
        results, health = asyncio.run(offer(server.url, rate, args.duration, args.max_tokens))
        elapsed = time.perf_counter() - started
        settled = all(
            server_metric == 0
            for server_metric in (
                metric(server.url, "tokenloom:num_requests_running"),
                metric(server.url, "tokenloom:num_requests_waiting"),
                metric(server.url, "tokenloom:kv_cache_usage_perc"),
            )
        )
        rss_after = metric(server.url, "process_resident_memory_bytes")
    statuses = Counter(status for status, _ in results)
    retry_after = sum(1 for status, has in results if status == 429 and has)
    quantiles = statistics.quantiles(health, n=20)
    print(f"requests offered: {len(results)} over {args.duration:.0f}s; all answered {elapsed:.0f}s after the first")
    print("answers: " + ", ".join(f"{status}: {n}" for status, n in sorted(statuses.items())))
    print(f"429s with Retry-After: {retry_after} of {statuses.get(429, 0)}")
    print(f"/health: {len(health)} polls, p50 {1000 * quantiles[9]:.1f} ms, p95 {1000 * quantiles[18]:.1f} ms")
    print(f"RSS before {rss_before / 2**20:.0f} MiB, after {rss_after / 2**20:.0f} MiB")
    print(f"running, waiting and KV usage back to 0: {settled}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
