"""What the engine core hands out: each request's new tokens (``EngineCoreOutput``), a step's ``StepStats``, the
``EngineStats`` snapshot and the ``QueueState`` admission reads. Plain data that the server, the output processor
and the core process's messages read without the core itself."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from tokenloom.model.sampler import SampledToken
from tokenloom.outputs import RequestMetrics


@dataclass
class EngineCoreOutput:
    """What one request got from a step (or from being finished): new tokens, and how it ended if it did."""

    request_id: str
    new_tokens: list[SampledToken]
    finish_reason: str | None  # a RequestStatus value once finished: stop, length, abort, error
    stop_reason: str | int | None
    # With a request's first output and its last; None between, where nothing but its tokens changed (the output
    # side keeps the last it was given): building and pickling them for every output of every step cost ~1 us each.
    metrics: RequestMetrics | None
    error: str | None = None  # why the request failed, when finish_reason is "error"
    # With its first token, if it asked: prompt tokens 1.. (the first has none), each with its top alternatives.
    prompt_logprobs: list[SampledToken] | None = None
    embedding: list[float] | None = None  # an embedding request's vector (pooling_params.py), with its last output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StepStats:
    """One step of the model: how many tokens of each kind it ran, and how long it took."""

    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    seconds: float


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    step: StepStats | None = None  # None when nothing was scheduled


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters (cumulative since start) and gauges (now)."""

    num_steps: int
    prompt_tokens: int
    generated_tokens: int
    computed_tokens: int  # every token that went through the model, recomputation included
    computed_tokens_by_tenant: dict[str, int]
    num_preemptions_recompute: int
    num_preemptions_swap: int
    swapped_out_blocks: int
    swapped_in_blocks: int
    swap_in_cached_blocks: int
    swap_copy_seconds: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    swap_blocks_total: int
    swap_blocks_in_use: int
    kv_blocks_total: int
    kv_blocks_in_use: int
    num_running: int
    num_waiting: int  # swapped-out requests not counted
    num_swapped: int
    spec_decode_num_drafts: int = 0  # requests' draft runs verified (speculative decoding), as vLLM counts them
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # accepted at draft position 0, 1, ...
    running_lora_adapters: tuple[str, ...] = ()  # the LoRA adapters of running requests, sorted
    waiting_lora_adapters: tuple[str, ...] = ()  # and of waiting ones

    @property
    def spec_decode_acceptance_rate(self) -> float | None:
        """Accepted draft tokens over draft tokens; None before any draft."""
        if not self.spec_decode_num_draft_tokens:
            return None
        return self.spec_decode_num_accepted_tokens / self.spec_decode_num_draft_tokens

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_recompute + self.num_preemptions_swap

    @classmethod
    def empty(cls, kv_blocks_total: int) -> EngineStats:
        """Before the first step: every counter and gauge 0."""
        values: dict[str, Any] = {f.name: 0 for f in fields(cls)}
        values.update(
            computed_tokens_by_tenant={},
            swap_copy_seconds=0.0,
            kv_blocks_total=kv_blocks_total,
            spec_decode_num_accepted_tokens_per_pos=(),
        )
        return cls(**values)


@dataclass(frozen=True)
class QueueState:
    """What admission limits compare against: requests waiting and the prompt tokens they still need."""

    num_waiting: int
    backlog_tokens: int
