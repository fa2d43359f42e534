"""The load generator: replays a trace against any OpenAI-compatible server with streaming chat requests.

Arrivals follow `vllm bench serve`: gaps drawn from a gamma distribution with shape `burstiness` and mean
1/rate (burstiness 1 is a Poisson process; below 1, burstier). Requests of one trace burst arrive together.
A request with `cancel_after_tokens` closes its stream after that many tokens, as a client that gave up.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable

import httpx

from tokenloom.bench.scorecard import RequestRecord
from tokenloom.bench.trace import TraceRequest


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each of n requests is sent; all at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(n):
        offsets.append(now)
        now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return offsets


def burst_aligned(requests: list[TraceRequest], offsets: list[float]) -> list[float]:
    """Requests of the same trace burst all go at the first one's time."""
    first: dict[int, float] = {}
    aligned = []
    for request, offset in zip(requests, offsets, strict=True):
        if request.burst is None:
            aligned.append(offset)
        else:
            aligned.append(first.setdefault(request.burst, offset))
    return aligned


async def send_one(
    client: httpx.AsyncClient, model: str | None, request: TraceRequest, start: float, ignore_eos: bool = False
) -> RequestRecord:
    """One streamed chat request, timed; ignore_eos (vLLM's extension, as `vllm bench serve --ignore-eos`) asks for
    all of its max_tokens."""
    record = RequestRecord(id=request.id, start=start)
    body: dict[str, object] = {
        "messages": request.messages,
        "max_tokens": request.max_tokens,
        "stream": True,
        # Usage in every chunk (vLLM's option): a chunk may carry several tokens (speculative decoding).
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "temperature": 0,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if model:
        body["model"] = model
    if request.priority:
        body["priority"] = request.priority
    sent = time.perf_counter()
    last, tokens_seen = None, 0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            record.status = response.status_code
            if response.status_code != 200:
                record.error = (await response.aread()).decode(errors="replace")[:300]
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    record.error = chunk["error"].get("message", "error")
                    break
                choices = chunk.get("choices") or []
                # A chunk with content carries a token, its text maybe empty (the first half of a character):
                # TTFT and the gaps are timed on it, as vLLM's benchmark times them. A chunk that carries k tokens
                # (its usage says so) counts k inter-token gaps of a k-th of its wait each: the latency per token.
                if choices and choices[0].get("delta", {}).get("content") is not None:
                    now = time.perf_counter()
                    carried = max(1, (chunk.get("usage") or {}).get("completion_tokens", tokens_seen + 1) - tokens_seen)
                    tokens_seen += carried
                    if last is None:
                        record.ttft = now - sent
                        carried -= 1
                    if carried and last is not None:
                        record.token_gaps.extend([(now - last) / carried] * carried)
                    last = now
                    record.output_tokens = max(record.output_tokens, tokens_seen)
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                    if request.cancel_after_tokens and len(record.token_gaps) + 1 >= request.cancel_after_tokens:
                        record.cancelled = True
                        break
    except httpx.HTTPError as error:
        record.error = f"{type(error).__name__}: {error}"
    record.e2e = time.perf_counter() - sent
    return record


ModelChoice = Callable[[TraceRequest], str | None]  # the model a request names (a LoRA adapter, say)


def adapter_choice(names: list[str], seed: int) -> ModelChoice:
    """Each request names one of `names`, drawn at random (as `vllm bench serve --lora-modules` does) from its
    id and the seed: the same request names the same adapter in every run."""
    if not names:
        raise ValueError("give at least one adapter name")
    return lambda request: random.Random(f"{seed}:{request.id}").choice(names)


async def run_load(
    base_url: str,
    requests: list[TraceRequest],
    offsets: list[float],
    model: str | ModelChoice | None = None,
    api_key: str | None = None,
    max_concurrency: int | None = None,
    duration_limit: float | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Sends every request at its offset, naming `model` (or, given a ModelChoice, the request's own); returns the
    records and the run's wall time."""
    model_of: ModelChoice = model if callable(model) else lambda _: model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or 1000, max_keepalive_connections=100)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def scheduled(client: httpx.AsyncClient, request: TraceRequest, offset: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, offset - (time.perf_counter() - t0)))
        if gate is None:
            record = await send_one(client, model_of(request), request, offset)
        else:
            async with gate:
                record = await send_one(client, model_of(request), request, offset)
        if on_done is not None:
            on_done(record)
        return record

    timeout = httpx.Timeout(duration_limit or 600.0, connect=10.0)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, limits=limits) as client:
        tasks = [asyncio.create_task(scheduled(client, r, o)) for r, o in zip(requests, offsets, strict=True)]
        done, pending = await asyncio.wait(tasks, timeout=duration_limit)
        for task in pending:
            task.cancel()
        records = [t.result() for t in tasks if t in done and not t.cancelled()]
        for request, task in zip(requests, tasks, strict=True):
            if task in pending:
                records.append(RequestRecord(id=request.id, start=0.0, error="not finished within the duration limit"))
    return records, time.perf_counter() - t0
