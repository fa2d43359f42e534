"""Prometheus metrics with vLLM's names under the ``tokenloom:`` prefix, fed by the engine thread after each step."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from tokenloom.engine.client import EngineClient
from tokenloom.engine.core_outputs import EngineStats
from tokenloom.outputs import RequestOutput

logger = logging.getLogger("tokenloom.stats")

# vLLM's boundaries, so that its dashboards' quantiles read the same from either server.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)  # fmt: skip
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_PARAM_N_BUCKETS = (1, 2, 5, 10, 20)
_PREEMPTION_BUCKETS = (0, 1, 2, 5, 10, 20, 50)
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_REQUEST_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
ENGINE_INDEX = "0"  # vLLM labels each engine (data-parallel rank); one engine here

# No *_created samples: vLLM's exposition has none, and dashboards built for it do not expect them.
disable_created_metrics()


class _Families:
    """Makes metric families in one registry, each under the ``tokenloom:`` prefix with the labels every family
    carries (bound to their values, unless a family has labels of its own to fill in)."""

    def __init__(self, registry: CollectorRegistry, common: dict[str, str]) -> None:
        self.registry, self.common, self.names = registry, common, tuple(common)

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(f"tokenloom:{name}", doc, self.names, registry=self.registry).labels(**self.common)

    def gauge_family(self, name: str, doc: str, labels: tuple[str, ...]) -> Gauge:
        return Gauge(f"tokenloom:{name}", doc, (*labels, *self.names), registry=self.registry)

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        family = Counter(f"tokenloom:{name}", doc, (*labels, *self.names), registry=self.registry)
        return family if labels else family.labels(**self.common)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> Histogram:
        family = Histogram(f"tokenloom:{name}", doc, self.names, buckets=buckets, registry=self.registry)
        return family.labels(**self.common)


class ServerMetrics:
    """Every family carries vLLM's model_name and engine labels, so vLLM's dashboards read it after the prefix."""

    def __init__(
        self, engine: EngineClient, model_name: str, log_interval: float = 10.0, labels: dict[str, str] | None = None
    ) -> None:
        """labels: more labels on every tokenloom family (a replica's id behind Ray Serve)."""
        self.engine = engine
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes and friends
        self._common = {"model_name": model_name, "engine": ENGINE_INDEX, **(labels or {})}
        families = _Families(self.registry, self._common)
        self._define_engine_metrics(families)
        self._define_request_metrics(families)
        self._define_cache_info(families)
        self._define_http_metrics()
        self._last_token_time: dict[str, float] = {}
        self._generated: dict[str, int] = {}  # tokens each running request has had so far
        self._last_stats = engine.stats()
        self._lock = threading.Lock()
        self._log_every = log_interval
        self._last_log = (time.monotonic(), self._last_stats)

    def _define_engine_metrics(self, f: _Families) -> None:
        """What the engine's stats say after each step: the batch, the KV cache, tokens, speculation."""
        common = self._common
        self.tree_memory = f.gauge(
            "process_tree_resident_memory_bytes", "Resident memory of the server and its child processes (the core)."
        )
        self.running = f.gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = f.gauge("num_requests_waiting", "Requests waiting to be scheduled (swapped ones not counted).")
        self.kv_usage = f.gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        preemptions = f.counter("num_preemptions", "Preemptions since start, by mode (recompute, swap).", ("mode",))
        self.preemptions = {mode: preemptions.labels(mode=mode, **common) for mode in ("recompute", "swap")}
        self.swapped = f.gauge("num_requests_swapped", "Preempted requests whose KV is in the host swap pool.")
        self.swap_usage = f.gauge("swap_space_usage_perc", "Fraction of host swap pool blocks in use (0-1).")
        self.prompt_tokens = f.counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = f.counter("generation_tokens", "Generated tokens.")
        self.prefix_queries = f.counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = f.counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.prompt_tokens_cached = f.counter(
            "prompt_tokens_cached", "Prompt tokens of admitted requests served from the prefix cache."
        )
        # As vLLM: a histogram named like a counter, one observation per step (its sum: every token computed).
        self.iteration_tokens = f.histogram(
            "iteration_tokens_total", "Tokens computed per engine step.", buckets=_STEP_TOKEN_BUCKETS
        )
        self.spec_drafts = f.counter("spec_decode_num_drafts", "Draft runs verified (speculative decoding).")
        self.spec_draft_tokens = f.counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted = f.counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = f.counter(
            "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft.", ("position",)
        )
        waiting_by_reason = f.gauge_family(
            "num_requests_waiting_by_reason",
            "Requests waiting, by why: 'capacity' (KV blocks or the batch's limits); 'deferred' (waiting on something "
            "else, such as a grammar; none here: grammars compile before a request is queued).",
            ("reason",),
        )
        self.waiting_capacity = waiting_by_reason.labels(reason="capacity", **common)
        waiting_by_reason.labels(reason="deferred", **common).set(0)
        lora = self.engine.config.lora
        self.max_loras = lora.max_loras if lora.enable_lora else 0
        self.lora_info = f.gauge_family(
            "lora_requests_info",
            "The LoRA adapters of running and waiting requests (comma-separated labels), as vLLM's; the value is when "
            "they were read (Unix time). Only where LoRA is enabled.",
            ("running_lora_adapters", "waiting_lora_adapters", "max_lora"),
        )

    def _define_request_metrics(self, f: _Families) -> None:
        """Per request, as each finishes or is refused: its latencies, its tokens and its parameters."""
        self.success = f.counter("request_success", "Finished requests.", ("finished_reason",))
        self.rejected = f.counter("requests_rejected", "Requests refused at admission.", ("reason", "tenant"))
        self.response_bytes = f.gauge(
            "inflight_response_bytes", "Of --max-inflight-response-bytes, the bytes charged to requests in flight."
        )
        self.ttft = f.histogram("time_to_first_token_seconds", "Time from arrival to the first token.", _TTFT_BUCKETS)
        self.itl = f.histogram("inter_token_latency_seconds", "Time between two tokens of a request.", _ITL_BUCKETS)
        self.tpot = f.histogram(
            "request_time_per_output_token_seconds",
            "A finished request's decode time per output token after the first.",
            _ITL_BUCKETS,
        )
        self.e2e = f.histogram("e2e_request_latency_seconds", "Time from arrival to the last token.")
        self.queue_time = f.histogram("request_queue_time_seconds", "Time from arrival to first scheduling.")
        self.prefill_time = f.histogram("request_prefill_time_seconds", "Time from first scheduling to first token.")
        self.decode_time = f.histogram("request_decode_time_seconds", "Time from the first token to the last.")
        self.inference_time = f.histogram(
            "request_inference_time_seconds", "Time from first scheduling to the last token (prefill and decode)."
        )
        self.request_prompt_tokens = f.histogram(
            "request_prompt_tokens", "Prompt tokens of each finished request.", _REQUEST_TOKEN_BUCKETS
        )
        self.request_generation_tokens = f.histogram(
            "request_generation_tokens", "Generated tokens of each finished request.", _REQUEST_TOKEN_BUCKETS
        )
        self.request_max_tokens = f.histogram(
            "request_params_max_tokens", "The max_tokens each admitted request runs with.", _REQUEST_TOKEN_BUCKETS
        )
        self.request_max_generation = f.histogram(
            "request_max_num_generation_tokens",
            "The most tokens an admitted request may generate (its max_tokens).",
            _REQUEST_TOKEN_BUCKETS,
        )
        self.request_n = f.histogram(
            "request_params_n", "The n (choices per prompt) of each admitted request.", _PARAM_N_BUCKETS
        )
        self.request_preemptions = f.histogram(
            "request_num_preemptions", "Times each finished request was preempted.", _PREEMPTION_BUCKETS
        )

    def _define_cache_info(self, f: _Families) -> None:
        """The KV cache's configuration as vLLM's info gauge, and the tokens it holds."""
        cache, kv = self.engine.config.cache, self.engine.kv_cache()
        cache_info = f.gauge_family(
            "cache_config_info",
            "The KV cache's configuration, as labels (value 1).",
            ("block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype", "swap_space"),
        )
        cache_info.labels(
            block_size=str(cache.block_size),
            num_gpu_blocks=str(kv.num_blocks),
            enable_prefix_caching=str(cache.enable_prefix_caching),
            cache_dtype=kv.dtype,
            swap_space=str(cache.swap_space),
            **self._common,
        ).set(1)
        f.gauge("kv_cache_capacity_tokens", "Tokens the KV cache holds (blocks x block size), in its dtype.").set(
            kv.num_tokens
        )

    def _define_http_metrics(self) -> None:
        """The HTTP layer's own families, unprefixed as the instrumentator vLLM uses names them."""
        self.http_requests = Counter(
            "http_requests", "HTTP requests answered, by handler, method and status class.",
            ("handler", "method", "status"), registry=self.registry,
        )  # fmt: skip
        self.http_duration = Histogram(
            "http_request_duration_seconds", "Time to answer an HTTP request (to its last byte).",
            ("handler", "method"), buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip

    def on_step(self, outputs: list[RequestOutput]) -> None:
        """Called by the engine thread after every step (also idle ones)."""
        with self._lock:
            stats, last = self.engine.stats(), self._last_stats
            self.running.set(stats.num_running)
            self.waiting.set(stats.num_waiting)
            self.waiting_capacity.set(stats.num_waiting)
            self.kv_usage.set(stats.kv_blocks_in_use / stats.kv_blocks_total)
            self.swapped.set(stats.num_swapped)
            self.swap_usage.set(stats.swap_blocks_in_use / max(stats.swap_blocks_total, 1))
            self.preemptions["recompute"].inc(stats.num_preemptions_recompute - last.num_preemptions_recompute)
            self.preemptions["swap"].inc(stats.num_preemptions_swap - last.num_preemptions_swap)
            self.prompt_tokens.inc(stats.prompt_tokens - last.prompt_tokens)
            self.generation_tokens.inc(stats.generated_tokens - last.generated_tokens)
            self.prefix_queries.inc(stats.prefix_cache_queries - last.prefix_cache_queries)
            self.prefix_hits.inc(stats.prefix_cache_hits - last.prefix_cache_hits)
            self.prompt_tokens_cached.inc(stats.prefix_cache_hits - last.prefix_cache_hits)
            self._count_speculation(stats, last)
            if self.max_loras:
                self._show_adapters(stats)
            step_tokens = stats.computed_tokens - last.computed_tokens
            if step_tokens > 0:
                self.iteration_tokens.observe(step_tokens)
            self._last_stats = stats
            now = time.monotonic()
            for output in outputs:
                self._observe(output, now)
            if now - self._last_log[0] >= self._log_every:
                self._log_throughput(now, stats)

    def _show_adapters(self, stats: EngineStats) -> None:
        """One sample, its labels the adapters now: the old sample goes, so the family never grows."""
        self.lora_info.clear()
        self.lora_info.labels(
            running_lora_adapters=",".join(stats.running_lora_adapters),
            waiting_lora_adapters=",".join(stats.waiting_lora_adapters),
            max_lora=str(self.max_loras),
            **self._common,
        ).set(time.time())

    def _count_speculation(self, stats: EngineStats, last: EngineStats) -> None:
        self.spec_drafts.inc(stats.spec_decode_num_drafts - last.spec_decode_num_drafts)
        self.spec_draft_tokens.inc(stats.spec_decode_num_draft_tokens - last.spec_decode_num_draft_tokens)
        self.spec_accepted.inc(stats.spec_decode_num_accepted_tokens - last.spec_decode_num_accepted_tokens)
        before = last.spec_decode_num_accepted_tokens_per_pos
        for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            previous = before[position] if position < len(before) else 0
            if count > previous:
                self.spec_accepted_per_pos.labels(position=str(position), **self._common).inc(count - previous)

    def _log_throughput(self, now: float, stats: EngineStats) -> None:
        """The periodic line an operator reads, as vLLM prints it; quiet while nothing happens."""
        since, before = self._last_log
        self._last_log = (now, stats)
        if stats.num_steps == before.num_steps:
            return
        elapsed = now - since
        queries = stats.prefix_cache_queries - before.prefix_cache_queries
        hits = stats.prefix_cache_hits - before.prefix_cache_hits
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Swapped: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, "
            "Preemptions: %d%s",
            (stats.prompt_tokens - before.prompt_tokens) / elapsed,
            (stats.generated_tokens - before.generated_tokens) / elapsed,
            stats.num_running,
            stats.num_swapped,
            stats.num_waiting,
            100 * stats.kv_blocks_in_use / stats.kv_blocks_total,
            100 * hits / queries if queries else 0.0,
            stats.num_preemptions,
            _speculation_line(stats, before),
        )

    def _observe(self, output: RequestOutput, now: float) -> None:
        last = self._last_token_time.get(output.request_id)
        if last is not None:
            self.itl.observe(now - last)
        self._last_token_time[output.request_id] = now
        # The server's outputs are DELTA: each carries the tokens its step added.
        generated = self._generated.get(output.request_id, 0) + len(output.outputs[0].token_ids)
        if not output.finished:
            self._generated[output.request_id] = generated
            return
        self._last_token_time.pop(output.request_id, None)
        self._generated.pop(output.request_id, None)
        m = output.metrics
        self.success.labels(finished_reason=output.outputs[0].finish_reason, **self._common).inc()
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(generated)
        self.request_preemptions.observe(m.num_preemptions)
        if m.first_token_time is None or m.first_scheduled_time is None or m.finished_time is None:
            return
        self.ttft.observe(m.first_token_time - m.arrival_time)
        self.e2e.observe(m.finished_time - m.arrival_time)
        self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        self.decode_time.observe(m.finished_time - m.first_token_time)
        if generated > 1:
            self.tpot.observe((m.finished_time - m.first_token_time) / (generated - 1))
        self.inference_time.observe(m.finished_time - m.first_scheduled_time)

    def admitted_request(self, max_tokens: int, n: int) -> None:
        self.request_max_tokens.observe(max_tokens)
        self.request_max_generation.observe(max_tokens)
        self.request_n.observe(n)

    def http_request(self, handler: str, method: str, status: int, seconds: float) -> None:
        self.http_requests.labels(handler=handler, method=method, status=f"{status // 100}xx").inc()
        self.http_duration.labels(handler=handler, method=method).observe(seconds)

    def rejected_request(self, reason: str, tenant: str) -> None:
        self.rejected.labels(reason=reason, tenant=tenant, **self._common).inc()

    def render(self) -> bytes:
        self.tree_memory.set(process_tree_rss(os.getpid()))
        return generate_latest(self.registry)


def _speculation_line(stats: EngineStats, before: EngineStats) -> str:
    """The log line's tail under speculative decoding, as vLLM's: acceptance rate and mean accepted length."""
    drafts = stats.spec_decode_num_drafts - before.spec_decode_num_drafts
    if not drafts:
        return ""
    tokens = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    rate, length = 100 * accepted / tokens, 1 + accepted / drafts
    return f", SpecDecoding: acceptance rate {rate:.1f}%, mean acceptance length {length:.2f}"


def escape_label_value(value: str) -> str:
    """A Prometheus label value as the text exposition writes it."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def process_tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants, from /proc (0 where /proc is not there)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            total += int(Path(f"/proc/{current}/statm").read_text().split()[1]) * page
            pending += [int(c) for c in Path(f"/proc/{current}/task/{current}/children").read_text().split()]
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or no /proc
    return total
