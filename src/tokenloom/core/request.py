"""A request as the scheduler sees it: its tokens, how many are computed, and its lifecycle."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokenloom.lora import LoRARequest
from tokenloom.sampling_params import SamplingParams
from tokenloom.utils import cdiv

# A sampled token not yet read from the device: the scheduler, scheduling a step ahead of the one that samples it,
# appends this in its place, and the runner takes the token from that step's device tensor (scheduler.py).
PLACEHOLDER_TOKEN = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV in the host swap pool; waits in the queue to be swapped back in
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # something raised while serving this request alone; the others went on

    @property
    def finished(self) -> bool:
        return self in _FINISHED


# A tuple, not a set: `in` finds a member by identity, where a set would call Enum.__hash__, a Python function (this
# is asked several times per request and step).
_FINISHED = (
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
)


@dataclass(eq=False)
class Request:
    """One generation request.

    The single idea of the scheduler lives here: ``num_computed_tokens`` counts the tokens whose KV is in the
    cache; the scheduler gives the request work to close the gap to ``num_tokens``. A prompt chunk and a decode
    token are the same kind of work.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first under the priority policy
    tenant: str = "default"
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache when first scheduled
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    stop_reason: int | str | None = None
    # Draft tokens proposed for the next step (speculative decoding); the scheduler takes them when it schedules it.
    spec_token_ids: list[int] = field(default_factory=list)
    lora_request: LoRARequest | None = None  # the adapter the request runs under; None: the base model
    cache_salt: str | None = None  # vLLM's: cached prefix blocks are shared only among requests of the same salt

    @property
    def lora_name(self) -> str | None:
        return None if self.lora_request is None else self.lora_request.lora_name

    @property
    def generates(self) -> bool:
        """False for an embedding request: the one token it samples is dropped, never a generated token."""
        return self.sampling_params.pooling is None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this request can ever hold: its prompt plus every token it may generate."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    @property
    def finished(self) -> bool:
        return self.status in _FINISHED

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, copying only those (a decode step's slice is one token, whatever
        the context's length)."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]


@dataclass(frozen=True)
class RequestLimits:
    """What decides whether a request can ever be served; plain values, so any thread or process can check."""

    max_model_len: int
    enable_chunked_prefill: bool
    max_num_batched_tokens: int
    num_kv_blocks: int
    block_size: int

    def check(self, request: Request) -> None:
        """Raises ValueError, saying why, if the request can never be served."""
        n = request.num_prompt_tokens
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens, but the model's context length is {self.max_model_len} "
                "and at least one token must be generated"
            )
        if not self.enable_chunked_prefill and n > self.max_num_batched_tokens:
            raise ValueError(
                f"the prompt has {n} tokens, more than max_num_batched_tokens={self.max_num_batched_tokens}; "
                "enable chunked prefill or raise the budget"
            )
        longest = min(request.max_total_tokens, self.max_model_len)
        if cdiv(longest, self.block_size) > self.num_kv_blocks:
            raise ValueError(
                f"the request may grow to {longest} tokens, more than the whole KV cache holds "
                f"({self.num_kv_blocks} blocks of {self.block_size})"
            )
