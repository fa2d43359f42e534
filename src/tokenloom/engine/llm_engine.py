"""The engine: one step = schedule, run the model, sample, update, detect stops. Synchronous and single-threaded.

Requests come in as text or token ids; finished requests come out as RequestOutputs.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from tokenloom.config import EngineConfig
from tokenloom.core.kv_cache_manager import KVCacheManager
from tokenloom.core.policy import make_policy
from tokenloom.core.preemption import LinearCostFit, PreemptionCosts, SwapSpace
from tokenloom.core.request import Request, RequestStatus
from tokenloom.core.scheduler import Scheduler
from tokenloom.engine.detokenizer import IncrementalDetokenizer
from tokenloom.model.config import ModelConfig
from tokenloom.model.loader import LoadedModel, load_model
from tokenloom.model.platform import dtype_name, resolve_dtype
from tokenloom.model.runner import ModelRunner
from tokenloom.model.sampler import SampledToken
from tokenloom.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenloom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3


@dataclass
class _RequestState:
    """What the engine keeps beside a scheduler request: its prompt text, its text so far, its logprobs."""

    prompt: str | None
    logprobs: list[dict[int, Logprob]] | None
    detokenizer: IncrementalDetokenizer
    stop_text: str | None = None  # the text up to a stop string, once one is found


@dataclass
class PreparedRequest:
    """A request tokenized and validated, ready to be queued by the engine thread."""

    request: Request
    state: _RequestState


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        started = time.monotonic()
        self.loaded = loaded or load_model(config.model, config.max_model_len, self.dtype, self.device)
        self.max_model_len = self._max_model_len_from(self.loaded.config)
        self.model_config: ModelConfig = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.num_kv_blocks = self._num_kv_blocks()
        self.num_swap_blocks = self._num_swap_blocks()
        self.runner = ModelRunner(
            self.loaded.model,
            self.num_kv_blocks,
            config.block_size,
            self.device,
            self.dtype,
            config.seed,
            self.num_swap_blocks,
            compile_step=config.compiles_step(self.device.type),
        )
        if self.runner.compiled is not None:
            self.runner.warm_up()
        self.preemption_costs = PreemptionCosts()
        self._step_costs = LinearCostFit()
        self._copy_costs = LinearCostFit()
        self._swap_copy_seconds = 0.0
        self._measures_costs = config.preemption_mode == "auto" and self.num_swap_blocks > 0  # only auto uses them
        if self._measures_costs:
            self._measure_block_copies()
            self._swap_copy_seconds = 0.0  # time spent swapping requests, not measuring
        self.kv_cache = KVCacheManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv_cache,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=set(self.model_config.eos_token_ids),
            enable_chunked_prefill=config.enable_chunked_prefill,
            static_batching=config.batching == "static",
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_num_partial_prefills=config.max_num_partial_prefills,
            policy=make_policy(config.scheduling_policy),
            preemption_mode=config.preemption_mode,
            swap_space=SwapSpace(self.num_swap_blocks),
            preemption_costs=self.preemption_costs,
        )
        self._states: dict[str, _RequestState] = {}
        self._ids = itertools.count()
        logger.info(
            "loaded %s in %.1fs on %s in %s (dtype=%s, %s): %d KV blocks of %d tokens (%d swap blocks), "
            "max_model_len %d",
            self.loaded.name,
            time.monotonic() - started,
            self.device,
            dtype_name(self.dtype),
            config.dtype,
            "eager" if self.runner.compiled is None else "compiled",
            self.num_kv_blocks,
            config.block_size,
            self.num_swap_blocks,
            self.max_model_len,
        )

    # ---- sizing -------------------------------------------------------------------------------------------

    def _max_model_len_from(self, model_config: ModelConfig) -> int:
        limit = model_config.max_position_embeddings
        if model_config.sliding_window:
            limit = min(limit, model_config.sliding_window)  # beyond the window we would attend too far
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ValueError(f"max_model_len={wanted} exceeds the model's context length {limit}")
        return wanted

    def kv_bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.config.block_size * self.model_config.kv_bytes_per_token(element)

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = self.kv_bytes_per_block()
        memory = self.config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
        blocks_for_memory = memory // per_block
        if blocks_for_memory < 1:
            raise ValueError(f"kv_cache_memory={memory} bytes holds no block of {per_block} bytes")
        if self.config.kv_cache_memory is not None:
            return blocks_for_memory
        # By default, no more than max_num_seqs full-length requests could ever use.
        blocks_for_batch = self.config.max_num_seqs * -(-self.max_model_len // self.config.block_size)
        return min(blocks_for_memory, blocks_for_batch)

    def _num_swap_blocks(self) -> int:
        if self.config.preemption_mode == "recompute":
            return 0
        if self.config.num_swap_blocks is not None:
            return self.config.num_swap_blocks
        return int(self.config.swap_space * 1024**3) // self.kv_bytes_per_block()

    # ---- requests -----------------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        tenant: str = "default",
    ) -> Request:
        """Queues a prompt (text or token ids); raises ValueError if it can never be served."""
        prepared = self.prepare_request(prompt, params, request_id, arrival_time, priority, tenant)
        self.add_prepared(prepared)
        return prepared.request

    def prepare_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        tenant: str = "default",
    ) -> PreparedRequest:
        """Tokenizes and validates a request without touching the scheduler, so any thread may call it."""
        params = params or SamplingParams()
        prompt_text, token_ids = self.tokenize(prompt)
        request = Request(
            request_id=request_id if request_id is not None else str(next(self._ids)),
            prompt_token_ids=token_ids,
            sampling_params=params,
            priority=priority,
            tenant=tenant,
        )
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.scheduler.check_admissible(request)  # reads only the configuration
        logprobs = [] if params.logprobs is not None else None
        return PreparedRequest(request, _RequestState(prompt_text, logprobs, IncrementalDetokenizer(self.tokenizer)))

    def add_prepared(self, prepared: PreparedRequest) -> None:
        """Queues a prepared request; on the thread that steps the engine."""
        self.scheduler.add_request(prepared.request)
        self._states[prepared.request.request_id] = prepared.state

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort_request(request_id)
        return None if request is None else self._finish(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer; pass prompt token ids")
            return prompt, list(self.tokenizer.encode(prompt))
        token_ids = [int(t) for t in prompt]
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return None, token_ids

    # ---- the step -----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one scheduler step; returns an output for every request that received a token in it."""
        output = self.scheduler.schedule()
        self._make_swap_copies(output.swap_out, output.swap_in)
        if output.is_empty:
            return []
        started = time.perf_counter()
        result = self.runner.execute(output.scheduled)
        if self._measures_costs:
            self._step_costs.add(output.num_batched_tokens, time.perf_counter() - started)
            self.preemption_costs.seconds_per_token = self._step_costs.slope() or 0.0
        outputs = [self.fail_request(self.scheduler.requests[rid], error) for rid, error in result.failed.items()]
        sampled = result.sampled
        self._record_logprobs(sampled)
        advanced = self.scheduler.update_from_output(output, {rid: s.token_id for rid, s in sampled.items()})
        for request in advanced:
            try:
                outputs.append(self._advance_output(request))
            except Exception as error:  # detokenizing or matching stops for this request alone
                outputs.append(self.fail_request(request, error))
        return outputs

    def _advance_output(self, request: Request) -> RequestOutput:
        state = self._states[request.request_id]
        state.detokenizer.add(request.output_token_ids[-1])
        if not request.finished and request.sampling_params.stop:
            self._check_stop_strings(request, state)
        return self._finish(request) if request.finished else self._output(request, state)

    def fail_request(self, request: Request, error: BaseException) -> RequestOutput:
        """Finishes one request with finish_reason "error" and frees its blocks and slots; the others go on."""
        logger.error("request %s failed: %r", request.request_id, error, exc_info=error)
        if request.finished:  # it finished in this step, before its output could be built; its blocks are free
            request.status = RequestStatus.FINISHED_ERROR
        else:
            self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR)
        self.runner.release(request.request_id)
        self._states.pop(request.request_id, None)
        completion = CompletionOutput(
            index=0, text="", token_ids=list(request.output_token_ids), finish_reason=request.status.value
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=None,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=True,
            metrics=self._metrics_of(request),
            num_preemptions=request.num_preemptions,
            error=f"{type(error).__name__}: {error}",
        )

    def _make_swap_copies(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Makes the step's swap copies (all out, then all in), timing each to keep the cost of a copy current."""
        for pairs, copy in ((swap_out, self.runner.swap_out), (swap_in, self.runner.swap_in)):
            if not pairs:
                continue
            started = time.perf_counter()
            copy(pairs)
            seconds = time.perf_counter() - started
            self._copy_costs.add(len(pairs), seconds)
            self._swap_copy_seconds += seconds
        if self._measures_costs and (swap_out or swap_in):
            costs = self.preemption_costs
            costs.seconds_per_block_copy = self._copy_costs.slope() or 0.0
            costs.seconds_per_copy = self._copy_costs.intercept() or 0.0

    def _measure_block_copies(self) -> None:
        """Times copies of a few sizes between free blocks and slots (no request holds any yet), for auto mode."""
        for n in (1, 4, 1, 4):
            n = min(n, self.num_kv_blocks, self.num_swap_blocks)
            pairs = [(i, i) for i in range(n)]
            self._make_swap_copies(pairs, pairs)

    def _record_logprobs(self, sampled: dict[str, SampledToken]) -> None:
        for request_id, token in sampled.items():
            state = self._states[request_id]
            if state.logprobs is None or token.logprob is None:
                continue
            entry = {tid: Logprob(lp, rank=rank + 1) for rank, (tid, lp) in enumerate(token.top_logprobs or [])}
            if token.token_id not in entry:
                entry[token.token_id] = Logprob(token.logprob)
            state.logprobs.append(entry)

    def _check_stop_strings(self, request: Request, state: _RequestState) -> None:
        text = state.detokenizer.text
        stops = request.sampling_params.stop
        # Only the tail can hold a new match: the last token's text plus the longest stop string.
        tail_start = max(0, len(text) - 2 * max(len(stop) for stop in stops) - 16)
        hits = [(text.find(stop, tail_start), stop) for stop in stops if stop in text[tail_start:]]
        if hits:
            index, stop = min(hits)
            state.stop_text = text[:index]
            request.stop_reason = stop
            self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)

    def _finish(self, request: Request) -> RequestOutput:
        self.runner.release(request.request_id)
        state = self._states.pop(request.request_id)
        return self._output(request, state)

    def _output(self, request: Request, state: _RequestState) -> RequestOutput:
        finished = request.finished
        if state.stop_text is not None:
            text = state.stop_text
        elif finished:
            text = self.decode(request.output_token_ids)
        else:
            text = state.detokenizer.text
            # While a stop string may still complete, hold back the characters it could start with.
            held = max((len(stop) - 1 for stop in request.sampling_params.stop), default=0)
            text = text[: len(text) - held] if held else text
        cumulative = None
        if state.logprobs is not None:
            cumulative = sum(e[t].logprob for e, t in zip(state.logprobs, request.output_token_ids, strict=False))
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
            logprobs=state.logprobs,
            cumulative_logprob=cumulative,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=state.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=self._metrics_of(request),
            num_preemptions=request.num_preemptions,
        )

    @staticmethod
    def _metrics_of(request: Request) -> RequestMetrics:
        return RequestMetrics(
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            finished_time=request.finished_time,
            num_preemptions=request.num_preemptions,
            num_cached_tokens=request.num_cached_tokens,
        )

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ---- observability ------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        s = self.scheduler.stats
        return {
            "num_steps": s.num_steps,
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "computed_tokens": s.computed_tokens,
            "num_preemptions": s.num_preemptions,
            "num_preemptions_recompute": s.preemptions["recompute"],
            "num_preemptions_swap": s.preemptions["swap"],
            "swapped_out_blocks": s.swapped_out_blocks,
            "swapped_in_blocks": s.swapped_in_blocks,
            "swap_in_cached_blocks": s.swap_in_cached_blocks,
            "swap_copy_seconds": self._swap_copy_seconds,
            "swap_blocks_total": self.scheduler.swap_space.num_slots,
            "swap_blocks_in_use": self.scheduler.swap_space.num_used_slots,
            "prefix_cache_queries": self.kv_cache.prefix_cache_queries,
            "prefix_cache_hits": self.kv_cache.prefix_cache_hits,
            "kv_blocks_total": self.kv_cache.num_blocks,
            "kv_blocks_in_use": self.kv_cache.num_used_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting) - self.scheduler.swap_space.num_swapped_requests,
            "num_swapped": self.scheduler.swap_space.num_swapped_requests,
        }
