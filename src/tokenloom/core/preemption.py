"""Where a preempted request's KV goes: nowhere (recompute it later) or to host memory (swap it back later).

Recompute throws the request's KV blocks away and runs its tokens through the model again when it resumes;
the cost grows with the tokens to recompute. Swap copies the blocks to a host-memory pool and back; the cost
grows with the blocks to copy, twice. ``auto`` compares the two for the victim at hand, with per-token and
per-block costs the engine measures as it runs. This module is bookkeeping only: the runner holds the tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tokenloom.core.kv_cache_manager import KVCacheManager
from tokenloom.core.request import Request, RequestStatus
from tokenloom.utils import cdiv


class SwapSpace:
    """The slots of the host-memory pool, each holding one KV block of a swapped-out request."""

    def __init__(self, num_slots: int) -> None:
        assert num_slots >= 0
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._held: dict[str, list[int]] = {}

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def num_swapped_requests(self) -> int:
        return len(self._held)

    def can_hold(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def take(self, request_id: str, num_blocks: int) -> list[int]:
        """Reserves num_blocks slots for a request's blocks, in block order."""
        assert request_id not in self._held, f"request {request_id} is already swapped out"
        assert self.can_hold(num_blocks), f"asked for {num_blocks} swap slots, {len(self._free)} free"
        slots = [self._free.popleft() for _ in range(num_blocks)]
        self._held[request_id] = slots
        return slots

    def release(self, request_id: str) -> list[int]:
        """Frees a request's slots (it was swapped back in, or aborted) and returns them, in block order."""
        slots = self._held.pop(request_id, [])
        self._free.extend(slots)
        return slots

    def check_invariants(self, swapped_request_ids: set[str]) -> None:
        assert set(self._held) == swapped_request_ids, "swap slots held by a request that is not swapped out"
        held = [slot for slots in self._held.values() for slot in slots]
        assert len(held) == len(set(held)), "a swap slot is held twice"
        assert not set(held) & set(self._free), "a swap slot is both held and free"
        assert len(held) + len(self._free) == self.num_slots, "a swap slot leaked"


@dataclass
class PreemptionCosts:
    """What preempting costs, in seconds, so that ``auto`` can pick the cheaper way for each victim.

    Recompute costs the marginal time of each token again. Swap costs two copies (out now, in later), each a
    fixed overhead (one copy per layer, whatever the number of blocks) plus a time per block. So short contexts
    are cheaper to recompute and long ones to swap; the engine keeps all three rates up to date as it measures.
    """

    seconds_per_token: float = 1e-3
    seconds_per_copy: float = 1e-4
    seconds_per_block_copy: float = 1e-5

    def recompute(self, num_tokens: int) -> float:
        return num_tokens * self.seconds_per_token

    def swap(self, num_blocks: int) -> float:
        return 2 * (self.seconds_per_copy + num_blocks * self.seconds_per_block_copy)

    def prefers_swap(self, num_tokens_to_recompute: int, num_blocks_to_copy: int) -> bool:
        return self.swap(num_blocks_to_copy) < self.recompute(num_tokens_to_recompute)


class LinearCostFit:
    """A least-squares line through (work, seconds) samples, recent samples weighing the most.

    Fitted to steps (tokens, seconds), its slope is the marginal cost of a token: what recomputing a preempted
    request adds to the steps that carry it (the per-step overhead is paid anyway). Fitted to block copies
    (blocks, seconds), its intercept is the fixed cost of a copy and its slope the cost of each block.
    """

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, work: int, seconds: float) -> None:
        d = self.decay
        self._n = d * self._n + 1
        self._x = d * self._x + work
        self._y = d * self._y + seconds
        self._xx = d * self._xx + work * work
        self._xy = d * self._xy + work * seconds

    def slope(self) -> float | None:
        if self._x == 0:
            return None
        variance = self._n * self._xx - self._x * self._x
        if variance > 1e-9 * self._n * self._xx:
            slope = (self._n * self._xy - self._x * self._y) / variance
            if slope > 0:
                return slope
        return self._y / self._x  # samples too alike (or too noisy) to separate the overhead: all of it per unit

    def intercept(self) -> float | None:
        slope = self.slope()
        if slope is None:
            return None
        return max(0.0, (self._y - slope * self._x) / self._n)


class Preemptor:
    """How a victim gives back its device blocks, and how it gets them again.

    recompute drops the victim's KV; swap copies its computed blocks to the host pool (or drops them when the pool
    is full); auto does whichever costs less for that victim, by costs fitted to what the engine measures and
    reports here (``observe_step``, ``observe_copies``). The copies themselves are the runner's: this returns the
    (device block, host slot) pairs to copy.
    """

    def __init__(
        self, mode: str, kv: KVCacheManager, swap_space: SwapSpace, costs: PreemptionCosts | None = None
    ) -> None:
        self.mode = mode
        self.kv = kv
        self.swap_space = swap_space
        self.costs = costs or PreemptionCosts()
        self.measures_costs = mode == "auto" and swap_space.num_slots > 0  # only auto compares costs
        self._step_fit = LinearCostFit()
        self._copy_fit = LinearCostFit()

    def choose(self, request: Request) -> str:
        """Swap when configured to and the host pool has room (else recompute); auto: the cheaper of the two."""
        if self.mode == "recompute":
            return "recompute"
        num_blocks = self.num_computed_blocks(request)
        if num_blocks == 0 or not self.swap_space.can_hold(num_blocks):
            return "recompute"
        if self.mode == "swap":
            return "swap"
        # Blocks other running requests share stay in the cache, so recomputing them would be a cache hit.
        to_recompute = request.num_computed_tokens - self.kv.num_shared_prefix_tokens(request)
        return "swap" if self.costs.prefers_swap(to_recompute, num_blocks) else "recompute"

    def drop(self, request: Request) -> None:
        """Recompute: the KV is gone; the request starts over from its first token when it resumes."""
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Reserves host slots for the computed blocks and frees the device blocks; returns the copies to make.

        The blocks may be handed out again in the same step: the runner copies them out before the forward.
        """
        num_blocks = self.num_computed_blocks(request)
        device_blocks = self.kv.block_ids(request.request_id)[:num_blocks]
        slots = self.swap_space.take(request.request_id, num_blocks)
        self.kv.free(request)
        request.status = RequestStatus.SWAPPED
        return list(zip(device_blocks, slots, strict=True))

    def swap_in(self, request: Request, num_still_cached: int) -> list[tuple[int, int]]:
        """Frees the request's host slots into the device blocks it was just given; returns the copies to make.

        Its first num_still_cached blocks came from the prefix cache; only the others are copied back.
        """
        slots = self.swap_space.release(request.request_id)
        device_blocks = self.kv.block_ids(request.request_id)[: len(slots)]
        request.status = RequestStatus.RUNNING
        return list(zip(slots, device_blocks, strict=True))[num_still_cached:]

    def num_computed_blocks(self, request: Request) -> int:
        """The blocks holding the request's computed KV: what a swap must copy out."""
        return cdiv(request.num_computed_tokens, self.kv.block_size)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step of the model: its marginal cost per token is what recomputing costs."""
        if self.measures_costs:
            self._step_fit.add(num_tokens, seconds)
            self.costs.seconds_per_token = self._step_fit.slope() or 0.0

    def observe_copies(self, num_blocks: int, seconds: float) -> None:
        """One copy of blocks between the device and the host pool: a fixed cost and a cost per block."""
        if self.measures_costs:
            self._copy_fit.add(num_blocks, seconds)
            self.costs.seconds_per_block_copy = self._copy_fit.slope() or 0.0
            self.costs.seconds_per_copy = self._copy_fit.intercept() or 0.0
