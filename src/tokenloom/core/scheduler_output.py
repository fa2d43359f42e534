"""What a step's schedule says (the requests' shares, preemptions, block copies) and the counts the scheduler
keeps: plain data the engine core, the runner and the stats read."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenloom.core.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: tokens [start, start + len(token_ids)) and where their KV goes.

    Fixed once made: its counts are worked out once here, since every part of the step asks for them."""

    request: Request
    start: int
    token_ids: list[int]
    block_ids: list[int]
    sample: bool  # the chunk reaches the request's last token, so this step yields its next token
    # Proposed tokens after the request's last one, verified in this step: token_ids ends with them, and the step
    # yields 1 to len(draft_token_ids) + 1 tokens.
    draft_token_ids: list[int] = field(default_factory=list)
    # block_ids' epoch (KVCacheManager.block_table): under one epoch a request's later block_ids extend its earlier
    # ones. None: not known, read them whole.
    block_epoch: int | None = None
    # How many of block_ids are the request's when scheduled: the scheduler hands over the KV manager's own list,
    # which later steps may extend (never change), so a reader reads no further. None: all of them.
    num_blocks: int | None = None
    num_tokens: int = field(init=False)
    # The chunk computes prompt (or recomputed) tokens: more than the last token and its drafts, or not up to the
    # last token.
    is_prefill: bool = field(init=False)
    # Where in the request's output the token sampled from its last token's row goes: the position after that token,
    # less the prompt (placeholders and recomputed outputs count as the positions they hold). Read by min_tokens.
    sampled_output_index: int = field(init=False)

    def __post_init__(self) -> None:
        if self.num_blocks is None:
            self.num_blocks = len(self.block_ids)
        self.num_tokens = len(self.token_ids)
        self.is_prefill = not self.sample or self.num_tokens > 1 + len(self.draft_token_ids)
        self.sampled_output_index = (
            self.start + self.num_tokens - len(self.draft_token_ids) - len(self.request.prompt_token_ids)
        )


@dataclass
class SchedulerOutput:
    """A step's schedule. Requests join it through ``add``, which keeps its token counts."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot), copied first
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block), copied second
    num_batched_tokens: int = 0
    num_prefill_tokens: int = 0  # of prefill chunks (is_prefill); the rest are decode tokens and their drafts
    num_prefill_chunks: int = 0

    def add(self, item: ScheduledRequest) -> None:
        self.scheduled.append(item)
        self.num_batched_tokens += item.num_tokens
        if item.is_prefill:
            self.num_prefill_tokens += item.num_tokens
            self.num_prefill_chunks += 1

    def step_items(self) -> list[tuple[int, int, int, bool]]:
        """Each scheduled request as (start, tokens, rows sampled, whether a prefill chunk): the sums a step's cost
        grows with are made from these (bench/cost_model.py's StepShape); a profile and a step log keep them."""
        return [
            (s.start, s.num_tokens, (1 + len(s.draft_token_ids)) if s.sample else 0, s.is_prefill)
            for s in self.scheduled
        ]

    @property
    def num_decode_tokens(self) -> int:
        return self.num_batched_tokens - self.num_prefill_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SpecDecodeStats:
    """Speculative decoding's counters, as vLLM names them: drafts verified, their tokens, the tokens accepted, and
    the tokens accepted at each draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.extend([0] * (num_draft_tokens - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


@dataclass
class SchedulerStats:
    num_steps: int = 0
    preemptions: dict[str, int] = field(default_factory=lambda: {"recompute": 0, "swap": 0})
    prompt_tokens: int = 0  # prompt tokens of admitted requests, counted once each
    generated_tokens: int = 0
    computed_tokens: int = 0  # every token that went through the model, recomputation included
    computed_tokens_by_tenant: dict[str, int] = field(default_factory=dict)
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    swap_in_cached_blocks: int = 0  # blocks of swapped-in requests found in the prefix cache, so not copied back
    spec: SpecDecodeStats = field(default_factory=lambda: SpecDecodeStats())

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions.values())
