"""`tokenloom simulate`: the engine's own scheduler, KV cache, policies and preemption, in simulated time.

A bench trace arrives as `bench serve` sends it (the same gaps for the same rate, burstiness and seed; bursts
together); each prompt is the chat template's tokens for its messages, as the server makes them. Each step the real
`Scheduler` forms the batch; instead of running the model, a step model (cost_model.py) says how long the step took,
the clock moves on by that, and every request that would have sampled a token gets a stand-in one. A request
reaches the scheduler the front's latency after it arrives (measured by the profile: HTTP, the chat template,
tokenization, the hand-off, streaming back), so it also delays its first token. A request's
output length is the one it had when it was served for real where that is known (a `bench serve` run's records),
else its trace's max_tokens; a request the trace cancels after k tokens is aborted there, as the client would.

The records are those `bench serve` keeps (TTFT, gaps, E2E), so the scorecard is the same function's.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenloom.bench.cost_model import StepModel, StepShape
from tokenloom.bench.loadgen import arrival_offsets, burst_aligned
from tokenloom.bench.scorecard import SLO, RequestRecord, percentile, scorecard
from tokenloom.bench.trace import TraceRequest
from tokenloom.config import EngineConfig
from tokenloom.core.kv_cache_manager import KVCacheManager
from tokenloom.core.preemption import Preemptor, SwapSpace
from tokenloom.core.request import Request
from tokenloom.core.scheduler import Scheduler
from tokenloom.core.scheduler_output import SchedulerOutput
from tokenloom.sampling_params import SamplingParams

STAND_IN_TOKEN = 1000  # what every simulated step "samples"; ignore_eos, so only lengths end requests
SIMULATED_MEMORY = "simulated: weights and KV blocks in use"


@dataclass(frozen=True)
class SimulatedEngine:
    """What the scheduler needs to know of an engine it does not run."""

    config: EngineConfig
    num_kv_blocks: int
    max_model_len: int
    num_swap_blocks: int = 0
    kv_bytes_per_block: int = 0
    weights_bytes: int = 0
    front_latency_s: float = 0.0  # from a request's arrival to the scheduler's queue, and its tokens to the client


@dataclass
class SimulatedRequest:
    trace: TraceRequest
    prompt_token_ids: list[int]
    output_tokens: int
    arrival: float
    token_times: list[float] = field(default_factory=list)
    first_scheduled: float | None = None
    error: str | None = None
    cancelled: bool = False

    def record(self) -> RequestRecord:
        if self.error is not None:
            return RequestRecord(self.trace.id, self.arrival, status=400, error=self.error)
        times = self.token_times
        return RequestRecord(
            id=self.trace.id,
            start=self.arrival,
            status=200,
            ttft=times[0] - self.arrival if times else None,
            e2e=(times[-1] if times else self.arrival) - self.arrival,
            output_tokens=len(times),
            token_gaps=[b - a for a, b in itertools.pairwise(times)],
            cancelled=self.cancelled,
        )


@dataclass
class SimulationResult:
    records: list[RequestRecord]
    duration: float
    server: dict[str, Any]
    steps: int
    decisions: list[tuple[list[tuple[str, int]], list[str]]]  # per step: (request, tokens) scheduled, preempted

    def card(self, offered_req_s: float, slo: SLO, cost_per_hour: float | None = None) -> dict[str, Any]:
        return scorecard(self.records, self.duration, offered_req_s, slo, self.server, cost_per_hour)


def arrivals(requests: list[TraceRequest], rate: float, burstiness: float, seed: int) -> list[float]:
    """The offsets `bench serve` sends the requests at, for the same trace, rate, burstiness and seed."""
    return burst_aligned(requests, arrival_offsets(len(requests), rate, burstiness, seed))


def simulate(
    engine: SimulatedEngine,
    step_model: StepModel,
    requests: list[SimulatedRequest],
    eos_token_ids: set[int] | None = None,
    keep_decisions: bool = False,
) -> SimulationResult:
    clock = Clock()
    kv = KVCacheManager(engine.num_kv_blocks, engine.config.cache.block_size, engine.config.cache.enable_prefix_caching)
    preemptor = Preemptor(engine.config.scheduler.preemption_mode, kv, SwapSpace(engine.num_swap_blocks))
    scheduler = Scheduler(
        engine.config.scheduler, kv, max_model_len=engine.max_model_len, eos_token_ids=eos_token_ids or set(),
        preemptor=preemptor, clock=clock,
    )  # fmt: skip
    pending = [(r.arrival + engine.front_latency_s, i, r) for i, r in enumerate(requests)]
    heapq.heapify(pending)
    live: dict[str, SimulatedRequest] = {}
    decisions: list[tuple[list[tuple[str, int]], list[str]]] = []
    high_water = steps = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0][0] <= clock.now:
            _, _, arriving = heapq.heappop(pending)
            _arrive(scheduler, arriving, live)
        if not scheduler.has_unfinished_requests():
            if pending:
                clock.now = pending[0][0]
            continue
        output = scheduler.schedule()
        if output.is_empty:  # nothing can run until something arrives (or nothing ever will)
            assert pending, "the scheduler has requests but schedules none, and none will arrive"
            clock.now = max(clock.now, pending[0][0])
            continue
        steps += 1
        seconds = step_model.seconds(StepShape.of(output))
        preemptor.observe_step(output.num_batched_tokens, seconds)
        clock.now += seconds
        high_water = max(high_water, kv.num_used_blocks)
        if keep_decisions:
            decisions.append(decision(output))
        _advance(scheduler, output, live, clock.now)
    duration = max((t for r in requests for t in r.token_times[-1:]), default=0.0)
    queue = [r.first_scheduled - r.arrival for r in requests if r.first_scheduled is not None]
    server = {
        "queue_time_p95_s": percentile(queue, 95),
        "preemptions": float(scheduler.stats.num_preemptions),
        "memory_high_water_bytes": float(engine.weights_bytes + high_water * engine.kv_bytes_per_block),
        "memory_scope": SIMULATED_MEMORY,
        "prefix_cache_hit_rate": kv.prefix_cache_hits / kv.prefix_cache_queries if kv.prefix_cache_queries else None,
        "spec_decode_acceptance_rate": None,
        "spec_decode_mean_acceptance_length": None,
    }
    return SimulationResult([r.record() for r in requests], duration, server, steps, decisions)


def decision(output: SchedulerOutput) -> tuple[list[tuple[str, int]], list[str]]:
    """A step's scheduling decision: which requests ran how many tokens, and which were preempted."""
    return [(s.request.request_id, s.num_tokens) for s in output.scheduled], [r.request_id for r in output.preempted]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _arrive(scheduler: Scheduler, arriving: SimulatedRequest, live: dict[str, SimulatedRequest]) -> None:
    params = SamplingParams(max_tokens=max(1, arriving.output_tokens), ignore_eos=True, temperature=0.0)
    request = Request(arriving.trace.id, arriving.prompt_token_ids, params, arrival_time=arriving.arrival,
                      priority=arriving.trace.priority, tenant=arriving.trace.tenant)  # fmt: skip
    try:
        scheduler.add_request(request)
    except ValueError as error:  # what the server answers with 400
        arriving.error = str(error)
        return
    live[request.request_id] = arriving


def _advance(scheduler: Scheduler, output: SchedulerOutput, live: dict[str, SimulatedRequest], now: float) -> None:
    sampled = {s.request.request_id: [STAND_IN_TOKEN] for s in output.scheduled if s.sample}
    for item in output.scheduled:
        tracked = live.get(item.request.request_id)
        if tracked is not None and tracked.first_scheduled is None:
            tracked.first_scheduled = item.request.first_scheduled_time
    for request, kept in scheduler.update_from_output(output, sampled):
        tracked = live[request.request_id]
        tracked.token_times.extend(_arrival_times(tracked.token_times, kept, now))
        cancel = tracked.trace.cancel_after_tokens
        if cancel is not None and len(tracked.token_times) >= cancel and not request.finished:
            scheduler.abort_request(request.request_id)  # the client closed its stream
            tracked.cancelled = True
        if request.finished or tracked.cancelled:
            del live[request.request_id]


def _arrival_times(earlier: list[float], kept: int, now: float) -> list[float]:
    """k tokens of one step, timed as the load generator times a chunk that carries k: each of the k gaps a k-th of
    the wait since the last token (a request's first tokens all at `now`)."""
    if not earlier:
        return [now] * kept
    last = earlier[-1]
    return [last + (now - last) * (j + 1) / kept for j in range(kept)]


def prompt_tokens(tokenizer: Any) -> Callable[[TraceRequest], list[int]]:
    """A trace request's prompt as the server tokenizes it: the chat template with the generation prompt."""

    def tokens(request: TraceRequest) -> list[int]:
        ids = tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)

    return tokens


def simulated_requests(
    trace: list[TraceRequest],
    offsets: list[float],
    prompts: list[list[int]],
    output_lengths: dict[str, int] | None = None,
) -> list[SimulatedRequest]:
    """Each trace request with its prompt tokens, arrival and output length (measured where given, else max_tokens;
    a cancelled request's measured length is where it was cancelled, so its trace's max_tokens is kept)."""
    lengths = output_lengths or {}
    return [
        SimulatedRequest(r, prompt, min(r.max_tokens, lengths.get(r.id, r.max_tokens)), offset)
        for r, prompt, offset in zip(trace, prompts, offsets, strict=True)
    ]


def offered_rate(rate: float, requests: list[SimulatedRequest], duration: float) -> float:
    """As `bench serve` reports it: the rate asked, or for all-at-once the requests over the run's time."""
    return rate if not math.isinf(rate) else (len(requests) / duration if duration > 0 else math.inf)
