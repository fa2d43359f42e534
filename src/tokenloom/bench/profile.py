"""`tokenloom simulate profile`: the real engine's steps, measured over a grid of batch shapes, and a step model fitted.

For each context length C and number of decoding requests D in the grid, D requests with C-token prompts (random
token ids, so no prefix is shared) are prefilled (those steps are measured too: full budget chunks), then decoded
for a few steps, then joined by one prefill of P tokens for each P in the grid (a mixed step) and by one whose
prompt is a decoding request's prompt and a few tokens more (a prefix-cache hit: a short chunk after a long cached
past, as agent and RAG traces make), then aborted; then prefills of each lone size run alone, twice, and prompts
whose leading tokens a request before them left in the prefix cache. Each step is timed whole, `LLMEngine.step()`
from the schedule to the outputs, greedy as `bench serve` asks, and kept with its scheduled requests
(cost_model.Item), so the model can be refitted. A warm-up pass runs first and is not kept. Last, a server with
default flags and `--step-log` is started and timed over HTTP (measure_served): a small mixed trace, whose logged
steps say what a served step costs beyond the engine's own (cost_model.ServedOverhead), then requests one at a time
for the front's latency.
"""

from __future__ import annotations

import asyncio
import dataclasses
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tokenloom.bench.cost_model import (
    FittedStepModel,
    Profile,
    ServedOverhead,
    shapes_of,
)
from tokenloom.bench.loadgen import arrival_offsets, burst_aligned, run_load, send_one
from tokenloom.bench.local_server import LocalServer
from tokenloom.bench.provenance import cpu_flags, machine_info
from tokenloom.bench.scorecard import RequestRecord
from tokenloom.bench.trace import TraceRequest, chat_requests, make_trace
from tokenloom.config import EngineConfig
from tokenloom.core.scheduler_output import SchedulerOutput
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.engine.step_log import read_step_log
from tokenloom.metrics_text import find, parse
from tokenloom.sampling_params import SamplingParams


@dataclass(frozen=True)
class Grid:
    contexts: tuple[int, ...] = (128, 512, 2048, 4096, 6144)
    decode_rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    prefills: tuple[int, ...] = (32, 256, 1024)
    lone_prefills: tuple[int, ...] = (16, 48, 96, 160, 256, 384, 640, 1024, 1536, 2048)  # each alone in a step
    # (cached tokens, new tokens): a prompt whose leading tokens the request before it left in the prefix cache
    cached_prefills: tuple[tuple[int, int], ...] = ((512, 32), (512, 160), (1024, 64), (2048, 32), (2048, 256),
                                                    (4096, 96))  # fmt: skip
    prefix_join: int = 64  # new tokens of the join that reuses a decoding request's prompt (0: none)
    served_kind: str = "mixed"  # the trace served over HTTP for the served overhead, at served_rate req/s
    served_rate: float = 1.0
    decode_steps: int = 4
    max_prompt_tokens: int = 16384  # D x C at most, per point: bounds the profile's time

    def points(self, max_num_seqs: int, max_model_len: int) -> Iterator[tuple[int, int]]:
        for context in self.contexts:
            for rows in self.decode_rows:
                fits = rows <= max_num_seqs and context + self.decode_steps + 2 < max_model_len
                if fits and rows * context <= self.max_prompt_tokens:
                    yield context, rows


QUICK = Grid(
    contexts=(64, 256), decode_rows=(1, 4, 16), prefills=(32, 200), lone_prefills=(16, 100, 400),
    cached_prefills=((128, 16),), prefix_join=16, decode_steps=3, max_prompt_tokens=4096, served_kind="chat",
    served_rate=4.0,
)  # fmt: skip


SERVED_REQUESTS = 24  # of the trace served with a step log for the served overhead
SERVED_TRACE_SEED = 7  # not the seeds the fidelity runs use (benchmarks/simulate_fidelity.py: 1)


class StepTimer:
    """Steps the engine, keeping each step's shape (seen through the engine's step observer) and its seconds."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.steps: list[dict[str, Any]] = []
        self._seen: SchedulerOutput | None = None
        engine.observe_steps(self._observe)

    def _observe(self, output: SchedulerOutput) -> None:
        self._seen = output

    def step(self, keep: bool = True) -> set[str]:
        """One engine step; returns the requests that received a token in it."""
        self._seen = None
        started = time.perf_counter()
        outputs = self.engine.step()
        seconds = time.perf_counter() - started
        if keep and self._seen is not None:
            copied = len(self._seen.swap_out) + len(self._seen.swap_in)
            self.steps.append({"items": self._seen.step_items(), "copied_blocks": copied, "seconds": seconds})
        return {o.request_id for o in outputs}


def measure_point(timer: StepTimer, grid: Grid, context: int, rows: int, rng: random.Random, keep: bool) -> None:
    engine = timer.engine
    vocab = engine.model_config.vocab_size
    # Greedy, as `bench serve` asks: sampling at a temperature costs more per row.
    joins = len(grid.prefills) + (1 if grid.prefix_join else 0)
    long_params = SamplingParams(max_tokens=grid.decode_steps + joins + 2, ignore_eos=True, temperature=0.0)
    prompts = [[rng.randrange(10, vocab) for _ in range(context)] for _ in range(rows)]
    ids = {engine.add_request(prompt, long_params).request_id for prompt in prompts}
    decoding: set[str] = set()
    while decoding != ids:  # the prefill chunks, until every request has its first token
        decoding |= timer.step(keep) & ids
    for _ in range(grid.decode_steps):
        timer.step(keep)
    for prefill in grid.prefills:
        engine.add_request(
            [rng.randrange(10, vocab) for _ in range(prefill)], SamplingParams(max_tokens=1, temperature=0.0)
        )
        timer.step(keep)
    if grid.prefix_join:  # the first request's prompt is cached: only the new tokens are computed
        hit = prompts[0] + [rng.randrange(10, vocab) for _ in range(grid.prefix_join)]
        engine.add_request(hit, SamplingParams(max_tokens=1, temperature=0.0))
        timer.step(keep)
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        timer.step(keep)


def measure_lone_prefills(timer: StepTimer, grid: Grid, rng: random.Random, keep: bool) -> None:
    engine = timer.engine
    for prefill in grid.lone_prefills:
        prompt = [rng.randrange(10, engine.model_config.vocab_size) for _ in range(prefill)]
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_unfinished_requests():
            timer.step(keep)


def measure_cached_prefills(timer: StepTimer, grid: Grid, rng: random.Random, keep: bool) -> None:
    engine = timer.engine
    vocab = engine.model_config.vocab_size
    for cached, new in grid.cached_prefills:
        if cached + new + 1 >= engine.max_model_len:
            continue
        prefix = [rng.randrange(10, vocab) for _ in range(cached)]
        suffix = [rng.randrange(10, vocab) for _ in range(new)]
        for prompt in (prefix, prefix + suffix):  # the first leaves the prefix in the cache for the second
            engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
            while engine.has_unfinished_requests():
                timer.step(keep)


def profile_engine(
    config: EngineConfig,
    grid: Grid = Grid(),
    seed: int = 0,
    front_requests: int = 12,
    served_requests: int = SERVED_REQUESTS,
) -> Profile:
    """The engine's steps over the grid, the fitted model, and what serving adds over HTTP: the front's latency
    (from front_requests requests; 0: not measured) and the served steps' overhead (from a trace of served_requests
    requests; 0: none).

    Its steps are read as they are launched (no asynchronous output processing): a call that read the step before
    and launched the next would time one step's device work under the next one's shape."""
    scheduler = dataclasses.replace(config.scheduler, async_output_proc=False, async_scheduling=False)
    engine = LLMEngine(dataclasses.replace(config, scheduler=scheduler))
    try:
        timer = StepTimer(engine)
        rng = random.Random(seed)
        max_num_seqs, max_model_len = config.scheduler.max_num_seqs, engine.max_model_len
        points = list(grid.points(max_num_seqs, max_model_len))
        for context, rows in points[:2]:  # warm-up: first calls build and fault in what later ones reuse
            measure_point(timer, grid, context, rows, rng, keep=False)
        for context, rows in points:
            measure_point(timer, grid, context, rows, rng, keep=True)
        for _ in range(2):
            measure_lone_prefills(timer, grid, rng, keep=True)
            measure_cached_prefills(timer, grid, rng, keep=True)
        kv, stats = engine.kv_cache(), engine.stats()
        measured: dict[str, int | str | bool | None] = {
            "num_kv_blocks": kv.num_blocks,
            "num_swap_blocks": stats.swap_blocks_total,
            "block_size": config.cache.block_size,
            "max_model_len": engine.max_model_len,
            "kv_bytes_per_block": kv.bytes_per_token * config.cache.block_size,
            "kv_dtype": kv.dtype,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "quantization": engine.quantization,
            "weight_bytes": engine.weight_bytes,
            "device": str(engine.device),
            "model": engine.model_name,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        }
    finally:
        engine.shutdown()
    model = FittedStepModel.fit(f"profile of {platform.node() or 'this machine'}", *shapes_of(timer.steps))
    profile = Profile(model, machine_description(), measured, timer.steps)
    if front_requests or served_requests:
        served = make_trace(grid.served_kind, served_requests, SERVED_TRACE_SEED)
        profile.front_latency_s, served_steps = measure_served(config.model.model, front_requests, served, grid)
        if served_steps:
            profile.served_overhead = ServedOverhead.fit(model, served_steps)
    return profile


def measure_served(
    model: str | None, front_requests: int, trace: list[TraceRequest], grid: Grid
) -> tuple[float, list[dict[str, Any]]]:
    """What serving over HTTP adds to the engine's steps, on a server with default flags and `--step-log`:

    - the served steps: `trace` sent at grid.served_rate req/s as `bench serve` sends it (Poisson arrivals, seed
      0), each step the server ran for it logged with its turn's wall time (ServedOverhead.fit sets them against
      the engine-alone model);
    - the front's latency: what a request spends outside the steps (the chat template, tokenization, the hand-off
      to the engine loop, streaming the token back): the median over requests sent one at a time of the client's
      TTFT less the server's own time from scheduling the request to its first token (its /metrics prefill time),
      so that the front does not absorb the step model's error on these prompts."""
    warm_up = chat_requests(random.Random(1), 4)  # other prompts than those measured
    one_at_a_time = chat_requests(random.Random(0), front_requests)
    offsets = burst_aligned(trace, arrival_offsets(len(trace), grid.served_rate, seed=0))
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "steps.jsonl"
        with LocalServer(*(["--model", model] if model else []), "--step-log", str(log)) as server:
            fronts, (began, ended) = asyncio.run(_served_records(server.url, warm_up, trace, offsets, one_at_a_time))
        served = [step for step in read_step_log(log) if began <= step["at"] <= ended]
    return max(0.0, statistics.median(fronts)) if fronts else 0.0, served


async def _served_records(
    url: str,
    warm_up: list[TraceRequest],
    trace: list[TraceRequest],
    offsets: list[float],
    one_at_a_time: list[TraceRequest],
) -> tuple[list[float], tuple[float, float]]:
    """Over one client, as `bench serve` sends: a warm-up, the trace at its offsets, then the front's requests one
    at a time (2 tokens each). Each front request's client TTFT less the server's prefill time for it, and when
    the trace began and ended (Unix time, as the step log says when each step ended)."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def together(requests: list[TraceRequest], max_tokens: int) -> list[RequestRecord]:
            for request in requests:
                request.max_tokens = max_tokens
            return list(await asyncio.gather(*(send_one(client, None, r, 0.0) for r in requests)))

        await together(warm_up, 2)
        began = time.time()
        if trace:
            records, _ = await run_load(url, trace, offsets)
            if failed := [r.error for r in records if r.error]:
                raise RuntimeError(f"{len(failed)} requests of the served trace failed: {failed[0]}")
        ended = time.time()
        await asyncio.sleep(0.5)  # the last requests' metrics are counted as their outputs are delivered
        seen = await _prefill_seconds(client, -1)
        fronts = []
        for request in one_at_a_time:
            (record,) = await together([request], 2)
            counted = await _prefill_seconds(client, seen[0])
            fronts.append((record.ttft or 0.0) - (counted[1] - seen[1]))
            seen = counted
    return fronts, (began, ended)


async def _prefill_seconds(client: httpx.AsyncClient, counted_before: float) -> tuple[float, float]:
    """The server's count and sum of request prefill times (/metrics), once the count has passed counted_before: a
    request's metrics are observed as its last output is delivered, which may come after the client's last chunk."""
    for _ in range(100):
        samples = parse((await client.get("/metrics")).text)
        count = find(samples, "request_prefill_time_seconds_count") or 0.0
        if count > counted_before:
            return count, find(samples, "request_prefill_time_seconds_sum") or 0.0
        await asyncio.sleep(0.02)
    raise RuntimeError("the server's /metrics did not count the request's prefill time within 2 s")


def machine_description() -> dict[str, str]:
    info = machine_info()
    return {"cpu": str(info["cpu"]), "cores": str(info["cores"]), "torch": str(info["torch"]), "flags": cpu_flags()}
