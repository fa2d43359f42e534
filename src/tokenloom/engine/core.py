"""The engine core: schedules, runs the model and samples. It knows token ids, never text.

Its face is small (vLLM V1's EngineCore): ``add_request``, ``abort``, ``finish``, ``fail``, ``step`` returning
``EngineCoreOutputs`` (each request's new tokens, finished requests, a typed ``StepStats``), and ``stats`` returning
a typed ``EngineStats`` snapshot. Detokenization, stop strings and ``RequestOutput`` are the output processor's
(output_processor.py). Everything else here (the scheduler, the KV cache, the runner, the swap pool and the
measured costs auto preemption compares) is private to the core.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from tokenloom.config import EngineConfig
from tokenloom.core.kv_cache_manager import KVCacheManager
from tokenloom.core.policy import FairPolicy
from tokenloom.core.preemption import PreemptionCosts, Preemptor, SwapSpace
from tokenloom.core.request import Request, RequestLimits, RequestStatus
from tokenloom.core.scheduler import Scheduler
from tokenloom.core.scheduler_output import SchedulerOutput
from tokenloom.engine.core_outputs import EngineCoreOutput, EngineCoreOutputs, EngineStats, QueueState, StepStats
from tokenloom.engine.core_setup import make_runner, served_quantization
from tokenloom.engine.kv_sizing import (
    configured_kv_blocks,
    kv_block_bytes,
    kv_blocks_that_fit,
    lora_reserve_bytes,
    max_model_len_for,
    sizes_kv_from_device_memory,
    swap_blocks_for,
)
from tokenloom.engine.speculation import Speculator
from tokenloom.engine.structured_output import GrammarCompiler, StructuredOutputManager
from tokenloom.model.config import ModelConfig
from tokenloom.model.loader import LoadedModel
from tokenloom.model.runner import LaunchedStep
from tokenloom.model.sampler import SampledToken
from tokenloom.outputs import RequestMetrics

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A step launched on the device and not yet read."""

    output: SchedulerOutput
    launched: LaunchedStep
    started: float  # perf_counter at its launch
    provisional: bool  # the scheduler took it as done at its launch (scheduling ahead): its tokens are settled


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype, device: torch.device) -> None:
        self.config = config
        self.model_config: ModelConfig = loaded.config
        self.dtype = dtype
        self.max_model_len = max_model_len_for(config, loaded.config)
        sized_by_device = sizes_kv_from_device_memory(config, device)
        per_block = self.kv_bytes_per_block()
        self.num_kv_blocks = 1 if sized_by_device else configured_kv_blocks(config, per_block, self.max_model_len)
        self.num_swap_blocks = swap_blocks_for(config, per_block)
        self.quantization = served_quantization(config, loaded.model.gguf_file, dtype, device)
        self.runner = make_runner(
            config, loaded, device, dtype, self.num_kv_blocks, self.num_swap_blocks, self.max_model_len,
            self.quantization,
        )  # fmt: skip
        if sized_by_device:
            self.num_kv_blocks = self._kv_blocks_from_device_memory(device)
            self.runner.allocate_kv_cache(self.num_kv_blocks)
        if self.runner.compiled is not None:
            self.runner.warm_up()
        if self._uses_decode_graphs(device):
            graphs = self.runner.enable_decode_graphs(config.scheduler.max_num_seqs, self.max_model_len)
            logger.info(
                "captured %d CUDA graphs for decode steps of up to %d rows in %.1fs; their pool: %.1f MiB",
                len(graphs.sizes), graphs.sizes[-1], graphs.capture_seconds, graphs.pool_bytes / 2**20,
            )  # fmt: skip
        self.kv_cache = KVCacheManager(self.num_kv_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.preemptor = Preemptor(config.scheduler.preemption_mode, self.kv_cache, SwapSpace(self.num_swap_blocks))
        self._swap_copy_seconds = 0.0
        if self.preemptor.measures_costs:
            self._measure_block_copies()
            self._swap_copy_seconds = 0.0  # time spent swapping requests, not measuring
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv_cache,
            max_model_len=self.max_model_len,
            eos_token_ids=set(self.model_config.eos_token_ids),
            preemptor=self.preemptor,
            max_loras=config.lora.max_loras if config.lora.enable_lora else 0,
        )
        eos = self.model_config.eos_token_ids
        grammars = GrammarCompiler(loaded.tokenizer, self.model_config.vocab_size, eos, config.structured_outputs)
        self.structured = StructuredOutputManager(grammars)
        self._failed_on_arrival: dict[str, Exception] = {}
        self.speculator = Speculator(config.speculative.speculative_config, self.structured, self.max_model_len)
        # Prompt logprobs by prompt token index, gathered chunk by chunk until the request's first token.
        self._prompt_logprobs: dict[str, dict[int, SampledToken]] = {}
        # Shown every non-empty step's schedule: `tokenloom simulate profile` measures steps by their shape.
        self.step_observer: Callable[[SchedulerOutput], None] | None = None
        self.overlaps_outputs = config.scheduler.overlaps_output_processing(device.type)
        self.schedules_ahead = config.scheduler.async_scheduling
        self._in_flight: _InFlight | None = None  # the step launched by the last call, when outputs overlap
        self._reported: set[str] = set()  # live requests whose metrics went out with an output
        self._reading_output: set[str] = set()  # live requests whose bad words read their output (no step ahead)

    @property
    def healthy(self) -> bool:
        return self.runner.healthy

    def shutdown(self) -> None:
        self.runner.shutdown()

    # ---- sizing -------------------------------------------------------------------------------------------

    @property
    def preemption_costs(self) -> PreemptionCosts:
        """What auto preemption believes recompute and swap cost, as measured so far."""
        return self.preemptor.costs

    def kv_bytes_per_block(self) -> int:
        return kv_block_bytes(self.config, self.model_config, self.dtype)

    def _uses_decode_graphs(self, device: torch.device) -> bool:
        """CUDA graphs for decode steps: on CUDA, with the Triton backend, unless --enforce-eager."""
        return (
            device.type == "cuda"
            and self.runner.attention_backend == "triton"
            and self.config.model.enforce_eager is not True
            and self.config.parallel.tensor_parallel_size == 1
            and not self.config.lora.enable_lora
        )

    def _kv_blocks_from_device_memory(self, device: torch.device) -> int:
        """Profiles a step at the token budget (and, where decode graphs will be captured, their memory pool: they
        are captured once here over a one-block cache and dropped), sets aside what LoRA adapters may take, then gives
        the KV cache the rest."""
        peak = self.runner.profile_peak_activation_bytes(self.config.scheduler.max_num_batched_tokens)
        peak += lora_reserve_bytes(self.config, self.model_config, self.dtype)
        if self._uses_decode_graphs(device):
            peak += self.runner.enable_decode_graphs(self.config.scheduler.max_num_seqs, self.max_model_len).pool_bytes
            self.runner.graphs = None
            torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        per_block = self.kv_bytes_per_block()
        blocks = kv_blocks_that_fit(total, total - free, peak, self.config.cache.gpu_memory_utilization, per_block)
        if blocks < 1:
            raise ValueError(
                f"no KV block fits in {self.config.cache.gpu_memory_utilization:.0%} of the device's "
                f"{total / 2**30:.1f} GiB with {(total - free) / 2**30:.1f} GiB in use and {peak / 2**30:.2f} GiB of "
                "activations: raise --gpu-memory-utilization or lower --max-num-batched-tokens"
            )
        logger.info(
            "KV cache: %d blocks, %d tokens (%.2f GiB) in %.0f%% of %.1f GiB (in use before it: %.2f GiB, profiled "
            "activations at %d tokens and LoRA adapters: %.2f GiB)",
            blocks, blocks * self.config.cache.block_size, blocks * per_block / 2**30,
            100 * self.config.cache.gpu_memory_utilization, total / 2**30, (total - free) / 2**30,
            self.config.scheduler.max_num_batched_tokens, peak / 2**30,
        )  # fmt: skip
        return blocks

    # ---- requests -----------------------------------------------------------------------------------------

    def request_limits(self) -> RequestLimits:
        """What decides whether a request can ever be served: plain values, any thread (or process) may check."""
        return self.scheduler.request_limits()

    def add_request(self, request: Request) -> None:
        """Queues a request. One whose grammar does not compile here fails in the next step, alone (the client
        compiles every grammar before a request gets here, so this is the last resort, not the check)."""
        self.scheduler.add_request(request)
        if request.lora_request is not None:
            try:  # loaded here, on the core's side, once; an adapter that does not load fails its request alone
                self.runner.retain_adapter(request.request_id, request.lora_request)
            except ValueError as error:
                self._failed_on_arrival[request.request_id] = error
        if request.sampling_params.bad_words_read_the_output:
            self._reading_output.add(request.request_id)
        spec = request.sampling_params.structured_outputs
        if spec is not None:
            try:
                self.structured.add(request.request_id, spec)
            except Exception as error:
                self._failed_on_arrival[request.request_id] = error

    def abort(self, request_id: str) -> EngineCoreOutput | None:
        """Ends a request that is still here (None if it is not) and frees what it holds."""
        request = self.scheduler.abort_request(request_id)
        return None if request is None else self._ended(request)

    def finish(self, request_id: str, status: RequestStatus, stop_reason: str | None = None) -> EngineCoreOutput:
        """Ends a request for a reason found outside the core (a stop string in its text)."""
        request = self.scheduler.requests[request_id]
        request.stop_reason = stop_reason
        self.scheduler.finish_request(request, status)
        return self._ended(request)

    def fail(self, request_id: str, error: BaseException) -> EngineCoreOutput:
        """Ends one live request with finish_reason "error" and frees its blocks and slots; the others go on."""
        logger.error("request %s failed: %r", request_id, error, exc_info=error)
        request = self.scheduler.requests[request_id]
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR)
        output = self._ended(request)
        output.error = f"{type(error).__name__}: {error}"
        return output

    def has_unfinished_requests(self) -> bool:
        """True while a request is here, or a launched step is still to be read."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def request_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    def queue_state(self, count_backlog: bool) -> QueueState:
        """Requests waiting, and (a walk over the queue, so only when asked) the prompt tokens they still need."""
        waiting = self.scheduler.waiting
        backlog = sum(r.num_tokens - r.num_computed_tokens for r in waiting) if count_backlog else 0
        return QueueState(len(waiting), backlog)

    def never_scheduled_waiting(self) -> list[tuple[str, float]]:
        """(request id, arrival time) of each waiting request that was never scheduled."""
        return [(r.request_id, r.arrival_time) for r in self.scheduler.waiting if r.first_scheduled_time is None]

    def never_scheduled_since(self, arrived_before: float) -> list[str]:
        """Waiting requests that arrived before the given monotonic time and were never scheduled."""
        return [rid for rid, arrival in self.never_scheduled_waiting() if arrival < arrived_before]

    def set_tenant_weights(self, weights: dict[str, float]) -> None:
        """The fair policy's share per tenant; other policies have none to set."""
        policy = self.scheduler.policy
        if isinstance(policy, FairPolicy):
            policy.weights.update(weights)

    # ---- the step -----------------------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """Runs one scheduler step; returns an output for every request that received a token or failed in it.

        With asynchronous output processing (``overlaps_outputs``) a step is read one call later: each call
        first reads the step launched by the call before (waiting for the device), then schedules and launches the
        next, and returns the outputs of the one it read, so the caller turns them into text while the device runs.
        With asynchronous scheduling (``schedules_ahead``) the next step is scheduled and launched before the one
        in flight is read, its tokens taken as placeholders (scheduler.advance_provisionally, then settle).
        """
        outputs = [
            self.fail(rid, error) for rid, error in self._failed_on_arrival.items() if rid in self.scheduler.requests
        ]
        self._failed_on_arrival.clear()
        stats = None
        ahead = self._may_schedule_ahead()
        if self._in_flight is not None and not (ahead and self._in_flight.provisional):
            finished, stats = self._finish(self._take_in_flight())
            outputs += finished
        output = self.scheduler.schedule()
        self._make_swap_copies(output.swap_out, output.swap_in)
        launched = None if output.is_empty else self._launch(output, outputs, provisional=ahead)
        if self._in_flight is not None:  # scheduled ahead of it: read it now, while the step just launched runs
            finished, stats = self._finish(self._take_in_flight())
            outputs += finished
        if launched is not None and self.overlaps_outputs:
            self._in_flight = launched
        elif launched is not None:
            finished, stats = self._finish(launched)
            outputs += finished
        return EngineCoreOutputs(outputs, stats)

    def _may_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled before the one in flight is read: asked for, and no live request
        needs its tokens on the host first (a grammar's mask, bad words of several tokens). Penalties count a
        placeholder's token on the device."""
        return self.schedules_ahead and not self.structured and not self._reading_output

    def _take_in_flight(self) -> _InFlight:
        in_flight, self._in_flight = self._in_flight, None
        assert in_flight is not None
        return in_flight

    def _launch(self, output: SchedulerOutput, outputs: list[EngineCoreOutput], provisional: bool) -> _InFlight:
        """Queues the scheduled step on the device; the requests whose grammar fails here join `outputs`.
        provisional: the scheduler takes the step as done at once (placeholders for its tokens), so the next step
        can be scheduled before this one is read."""
        if self.step_observer is not None:
            self.step_observer(output)
        started = time.perf_counter()
        grammar, grammar_failed = self.structured.grammar_mask(
            [(s.request.request_id, s.draft_token_ids) for s in output.scheduled if s.sample]
        )
        # A request whose grammar failed is finished before the step; the step still computes its tokens, unused.
        outputs += [self.fail(request_id, error) for request_id, error in grammar_failed.items()]
        launched = self.runner.launch(output.scheduled, grammar)
        if provisional:
            self.scheduler.advance_provisionally(output)
        return _InFlight(output, launched, started, provisional)

    def _finish(self, step: _InFlight) -> tuple[list[EngineCoreOutput], StepStats]:
        """Reads a launched step's tokens (waiting for the device) and advances its requests; a request ended while
        the step ran (aborted, or stopped by its text) is passed over."""
        output = step.output
        result = step.launched.wait()
        seconds = time.perf_counter() - step.started
        self.preemptor.observe_step(output.num_batched_tokens, seconds)
        self.speculator.observe_step(output.num_batched_tokens, seconds)
        live = self.scheduler.requests
        outputs = [self.fail(rid, error) for rid, error in result.failed.items() if rid in live]
        for request_id, entries in result.prompt_logprobs.items():
            if request_id in live:  # a recomputed chunk overwrites; a failed request keeps none
                self._prompt_logprobs.setdefault(request_id, {}).update(entries)
        sampled = result.sampled
        tokens = {rid: [t.token_id for t in new] for rid, new in sampled.items() if rid in live}
        update = self.scheduler.settle if step.provisional else self.scheduler.update_from_output
        advanced = update(output, tokens)
        self.speculator.observe_verifications(output, tokens)
        outputs += [self._advanced(request, sampled[request.request_id][:kept]) for request, kept in advanced]
        if result.embeddings:  # an embedding request ends in the step that pooled its prompt
            for core_output in outputs:
                core_output.embedding = result.embeddings.get(core_output.request_id)
        self.speculator.propose(self.scheduler.running, output.num_batched_tokens)
        return outputs, StepStats(output.num_prefill_tokens, output.num_decode_tokens, len(output.preempted), seconds)

    def _advanced(self, request: Request, new_tokens: list[SampledToken]) -> EngineCoreOutput:
        """The output of a request that got tokens: its grammar advanced (and finished, if done), its prompt
        logprobs attached with its first token, and what it held released if it finished."""
        if request.request_id in self.structured and not request.finished:
            try:
                new_tokens = self._advance_grammar(request, new_tokens)
            except Exception as error:
                return self.fail(request.request_id, error)
        output = self._output_of(request, new_tokens)
        if request.request_id in self._prompt_logprobs:
            output.prompt_logprobs = self._gathered_prompt_logprobs(request)
        if request.finished:
            self._release(request)
        return output

    def _advance_grammar(self, request: Request, new_tokens: list[SampledToken]) -> list[SampledToken]:
        """Advances the request's matcher token by token; where its grammar ends (nothing may follow), the request
        finishes and the tokens after that one (an accepted run's tail) are dropped."""
        for kept, token in enumerate(new_tokens, 1):
            if self.structured.accept(request.request_id, token.token_id):
                dropped = len(new_tokens) - kept
                if dropped:
                    self.scheduler.drop_last_tokens(request, dropped)
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
                return new_tokens[:kept]
        return new_tokens

    def _ended(self, request: Request) -> EngineCoreOutput:
        self._release(request)
        return self._output_of(request, [])

    def _release(self, request: Request) -> None:
        """Drops what the runner, the grammar matcher, the prompt logprobs and the proposer keep of a finished
        request (a suffix proposer keeps its output for the requests that follow)."""
        request_id = request.request_id
        self.runner.release(request_id)
        self.structured.remove(request_id)
        self._reading_output.discard(request_id)
        self._reported.discard(request_id)
        self._prompt_logprobs.pop(request_id, None)
        self.speculator.release(request)

    def _gathered_prompt_logprobs(self, request: Request) -> list[SampledToken]:
        entries = self._prompt_logprobs.pop(request.request_id)
        assert len(entries) == request.num_prompt_tokens - 1, "every prompt token after the first has its logprob"
        return [entries[i] for i in range(1, request.num_prompt_tokens)]

    def _output_of(self, request: Request, new_tokens: list[SampledToken]) -> EngineCoreOutput:
        """The request's output; its metrics only with its first output and its last (EngineCoreOutput.metrics)."""
        request_id, finished = request.request_id, request.finished
        metrics = None
        if finished or request_id not in self._reported:
            metrics = self._metrics_of(request)
            if not finished:  # a finished request's entry went with the rest of it (_release)
                self._reported.add(request_id)
        return EngineCoreOutput(
            request_id, new_tokens, request.status.value if finished else None, request.stop_reason, metrics
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

    def _make_swap_copies(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Makes the step's swap copies (all out, then all in), timing each to keep the cost of a copy current."""
        for pairs, copy in ((swap_out, self.runner.swap_out), (swap_in, self.runner.swap_in)):
            if not pairs:
                continue
            started = time.perf_counter()
            copy(pairs)
            seconds = time.perf_counter() - started
            self.preemptor.observe_copies(len(pairs), seconds)
            self._swap_copy_seconds += seconds

    def _measure_block_copies(self) -> None:
        """Times copies of a few sizes between free blocks and slots (no request holds any yet), for auto mode."""
        for n in (1, 4, 1, 4):
            n = min(n, self.num_kv_blocks, self.num_swap_blocks)
            pairs = [(i, i) for i in range(n)]
            self._make_swap_copies(pairs, pairs)

    # ---- observability ------------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        s = self.scheduler.stats
        swap = self.scheduler.swap_space
        return EngineStats(
            num_steps=s.num_steps,
            prompt_tokens=s.prompt_tokens,
            generated_tokens=s.generated_tokens,
            computed_tokens=s.computed_tokens,
            computed_tokens_by_tenant=dict(s.computed_tokens_by_tenant),
            num_preemptions_recompute=s.preemptions["recompute"],
            num_preemptions_swap=s.preemptions["swap"],
            swapped_out_blocks=s.swapped_out_blocks,
            swapped_in_blocks=s.swapped_in_blocks,
            swap_in_cached_blocks=s.swap_in_cached_blocks,
            swap_copy_seconds=self._swap_copy_seconds,
            prefix_cache_queries=self.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.prefix_cache_hits,
            swap_blocks_total=swap.num_slots,
            swap_blocks_in_use=swap.num_used_slots,
            kv_blocks_total=self.kv_cache.num_blocks,
            kv_blocks_in_use=self.kv_cache.num_used_blocks,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) - swap.num_swapped_requests,
            num_swapped=swap.num_swapped_requests,
            spec_decode_num_drafts=s.spec.num_drafts,
            spec_decode_num_draft_tokens=s.spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=s.spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(s.spec.accepted_per_position),
            running_lora_adapters=_adapter_names(self.scheduler.running) if self.scheduler.max_loras else (),
            waiting_lora_adapters=_adapter_names(self.scheduler.waiting) if self.scheduler.max_loras else (),
        )


def _adapter_names(requests: Iterable[Request]) -> tuple[str, ...]:
    return tuple(sorted({r.lora_name for r in requests if r.lora_name is not None}))
