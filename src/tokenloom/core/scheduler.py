"""The continuous-batching scheduler: every step, fill a token budget from running requests, then waiting ones.

There are no prefill and decode phases. Each request has ``num_computed_tokens``; a step gives it up to the gap
between that and its token count. A long prompt is chunked over several steps by the budget alone, and shares
each of them with other requests' decode tokens. When KV blocks run out, the policy's worst running request
(under FCFS the most recently started) is preempted: its blocks go back to the pool and it returns to the
queue. How it gives its blocks back, and gets them again, is the preemptor's (preemption.py): under recompute its
tokens are computed again when there is room (its prefix blocks often still cached); under swap its blocks are
first copied to a host pool and copied back when it resumes (the step's output lists the copies, which the runner
makes before the forward: all swap-outs, then swap-ins).

When waiting requests may join is the batching gate's (batching_gate.py): every step (continuous batching), or, in
static batching (the baseline the seeds compare against), only once the previous batch has completely finished.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from tokenloom.config import SchedulerConfig
from tokenloom.core.batching_gate import make_gate
from tokenloom.core.kv_cache_manager import KVCacheManager
from tokenloom.core.policy import make_policy
from tokenloom.core.preemption import Preemptor, SwapSpace
from tokenloom.core.request import PLACEHOLDER_TOKEN, Request, RequestLimits, RequestStatus
from tokenloom.core.scheduler_output import ScheduledRequest, SchedulerOutput, SchedulerStats


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        *,
        max_model_len: int,
        eos_token_ids: set[int],
        preemptor: Preemptor | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_loras: int = 0,
    ) -> None:
        """Built from its own config; what the engine works out at start-up (the context length, the EOS tokens,
        the preemptor with its swap pool and measured costs) comes beside it. `clock` stamps the requests' times:
        the simulator (bench/simulator.py) runs this scheduler in simulated time. max_loras: the most distinct LoRA
        adapters in the running batch (0: LoRA is off)."""
        self.config = config
        self.clock = clock
        self.kv = kv_cache
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_loras = max_loras
        self.eos_token_ids = eos_token_ids
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.gate = make_gate(config.batching)
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.max_num_partial_prefills = config.max_num_partial_prefills
        self.policy = make_policy(config.scheduling_policy)
        self.preemptor = preemptor or Preemptor(config.preemption_mode, kv_cache, SwapSpace(0))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()

    # ---- requests in and out -------------------------------------------------------------------------

    @property
    def swap_space(self) -> SwapSpace:
        return self.preemptor.swap_space

    def add_request(self, request: Request) -> None:
        """Queues a request; raises ValueError if it could never be served under this configuration."""
        self.check_admissible(request)
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        self.policy.enqueue(self.waiting, request)

    def request_limits(self) -> RequestLimits:
        return RequestLimits(
            self.max_model_len, self.enable_chunked_prefill, self.max_num_batched_tokens, self.kv.num_blocks,
            self.kv.block_size,
        )  # fmt: skip

    def check_admissible(self, request: Request) -> None:
        self.request_limits().check(request)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return None
        self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        assert status.finished
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.swap_space.release(request.request_id)  # a swapped-out request's slots; nothing to copy back
        request.status = status
        request.finished_time = self.clock()
        self.policy.finished(request)
        self.kv.free(request)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step --------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.policy.order_running(self.running)
        self.policy.order_waiting(self.waiting)
        displaced = self._displace_for_better_waiting(output)
        budget = self._schedule_running(output, budget)
        # A step that had to preempt for KV starts no one; seats freed by displacement are meant to be filled.
        preempted_for_kv = len(output.preempted) > displaced
        if not preempted_for_kv and self.gate.open_for_step(len(self.running)):
            self._schedule_waiting(output, budget)
        self.gate.end_step(len(self.running), len(self.waiting), self.max_num_seqs)
        assert output.num_batched_tokens <= self.max_num_batched_tokens, "step exceeds its token budget"
        assert len(self.running) <= self.max_num_seqs, "running batch exceeds max_num_seqs"
        if not output.is_empty:
            self.stats.num_steps += 1
            self.stats.computed_tokens += output.num_batched_tokens
            by_tenant = self.stats.computed_tokens_by_tenant
            for item in output.scheduled:
                by_tenant[item.request.tenant] = by_tenant.get(item.request.tenant, 0) + item.num_tokens
        return output

    def _displace_for_better_waiting(self, output: SchedulerOutput) -> int:
        """At the sequence cap, a waiting request the policy ranks strictly higher takes the worst one's seat."""
        if not self.gate.allows_displacement:
            return 0
        while (
            self.waiting
            and self.running
            and len(self.running) >= self.max_num_seqs
            and self.policy.displaces(self.waiting[0], self.running[-1])
        ):
            self._preempt(self.running.pop(), output)
        return len(output.preempted)

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if self._ends_at_pending_token(request):
                i += 1  # scheduled ahead: the token on its way is its last, whatever it is
                continue
            remaining = request.num_tokens - request.num_computed_tokens
            drafts = request.spec_token_ids
            if drafts:
                request.spec_token_ids = []
            if remaining == 1 and drafts:  # a decode with proposals: its last token and as many drafts as fit
                drafts = drafts[: max(0, min(budget, self.max_model_len - request.num_tokens) - 1)]
                remaining += len(drafts)
            else:
                drafts = []
            num_new = self._stall_free(request, remaining, budget, output, len(drafts))
            if num_new == 0 or (
                not self.enable_chunked_prefill and request.num_computed_tokens + num_new < request.num_tokens
            ):
                i += 1  # this prompt waits: an unchunked one for room for all of it, or for a prefill slot
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim, output)
                if victim is request:
                    return budget
            output.add(self._scheduled(request, num_new, drafts))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        adapters = {r.lora_name for r in self.running if r.lora_name is not None} if self.max_loras else set()
        passed_over: list[Request] = []  # of an adapter that would be one too many in the batch: they keep their place
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            name = request.lora_name
            if name is not None and name not in adapters and len(adapters) >= self.max_loras:
                passed_over.append(self.waiting.popleft())
                continue
            if request.status == RequestStatus.SWAPPED:
                num_new = self._resume_swapped(request, output, budget)
            else:
                num_new = self._start_waiting(request, output, budget)
            if num_new is None:
                break
            budget -= num_new
            if name is not None:
                adapters.add(name)
        self.waiting.extendleft(reversed(passed_over))

    def _resume_swapped(self, request: Request, output: SchedulerOutput, budget: int) -> int | None:
        """The tokens a swapped-out request at the head of the queue computes this step; None: it cannot resume."""
        num_new = self._stall_free(request, request.num_tokens - request.num_computed_tokens, budget, output)
        num_still_cached = self.kv.allocate_for_swap_in(request, num_new) if num_new else None
        if num_still_cached is None:
            return None
        self.waiting.popleft()
        self._swap_in(request, num_still_cached, output)
        output.add(self._scheduled(request, num_new))
        return num_new

    def _start_waiting(self, request: Request, output: SchedulerOutput, budget: int) -> int | None:
        """The tokens the request at the head of the queue computes this step; None: it cannot start (and none
        behind it does)."""
        cached_blocks = self.kv.find_cached_prefix(request)
        num_cached = len(cached_blocks) * self.kv.block_size
        num_new = request.num_tokens - num_cached
        if not self.enable_chunked_prefill and num_new > budget:
            return None
        num_new = self._stall_free(request, num_new, budget, output)
        if num_new == 0:
            return None
        if not self.kv.allocate_slots(request, num_new, cached_blocks):
            self.gate.kv_exhausted()
            return None
        self.waiting.popleft()
        self._start_running(request, num_cached)
        output.add(self._scheduled(request, num_new))
        return num_new

    def _stall_free(
        self, request: Request, remaining: int, budget: int, output: SchedulerOutput, num_drafts: int = 0
    ) -> int:
        """How many of a request's remaining tokens this step gives it, under the stall-free prefill limits.

        A prompt (more than one token left to compute, not counting draft tokens) takes at most
        long_prefill_token_threshold tokens, and only max_num_partial_prefills prompts are prefilled per step, so
        decode tokens are never starved.
        """
        num_new = min(remaining, budget)
        if remaining <= 1 + num_drafts:
            return num_new
        if self.max_num_partial_prefills and output.num_prefill_chunks >= self.max_num_partial_prefills:
            return 0
        if self.long_prefill_token_threshold:
            num_new = min(num_new, self.long_prefill_token_threshold)
        return num_new

    def _start_running(self, request: Request, num_cached: int) -> None:
        self.kv.record_prefix_query(request.num_tokens, num_cached)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()
            request.num_cached_tokens = num_cached
            self.stats.prompt_tokens += request.num_prompt_tokens
        self.running.append(request)

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        """The request gives back its device blocks and returns to the queue, its KV swapped out or dropped."""
        mode = self.preemptor.choose(request)
        if mode == "swap":
            copies = self.preemptor.swap_out(request)
            output.swap_out.extend(copies)
            self.stats.swapped_out_blocks += len(copies)
        else:
            self.preemptor.drop(request)
        request.num_preemptions += 1
        request.spec_token_ids = []
        self.stats.preemptions[mode] += 1
        output.preempted.append(request)
        self.policy.requeue(self.waiting, request)

    def _swap_in(self, request: Request, num_still_cached: int, output: SchedulerOutput) -> None:
        """Resumes a swapped-out request in the blocks it was just given, its computed tokens intact.

        Its first num_still_cached blocks came from the prefix cache; only the others are copied back.
        """
        copies = self.preemptor.swap_in(request, num_still_cached)
        # Swap-outs all precede swap-ins in a step, so a slot freed here is never refilled before it is read.
        assert not {slot for _, slot in output.swap_out} & {slot for slot, _ in copies}, "swap slot reused in a step"
        output.swap_in.extend(copies)
        self.stats.swapped_in_blocks += len(copies)
        self.stats.swap_in_cached_blocks += num_still_cached
        self.running.append(request)

    def _scheduled(self, request: Request, num_new: int, drafts: list[int] | None = None) -> ScheduledRequest:
        self.policy.charge(request, num_new)
        start = request.num_computed_tokens
        drafts = drafts or []
        end = start + num_new - len(drafts)  # the request's own tokens end here; its drafts follow
        assert not drafts or end == request.num_tokens, "drafts follow the last token"
        token_ids = request.token_ids_slice(start, end)
        block_ids, block_epoch = self.kv.block_table(request.request_id)
        return ScheduledRequest(
            request=request,
            start=start,
            token_ids=token_ids + drafts if drafts else token_ids,
            block_ids=block_ids,
            sample=end == request.num_tokens,
            draft_token_ids=drafts,
            block_epoch=block_epoch,
            num_blocks=len(block_ids),
        )

    # ---- scheduling ahead: a step scheduled before the one before it is read ------------------------------

    def advance_provisionally(self, output: SchedulerOutput) -> None:
        """Takes a launched step as done before its tokens are read, so the next step can be scheduled while it
        runs: each chunk counts as computed, and each request that samples gets a placeholder token (the runner
        reads the real one from the device). ``settle`` puts in the tokens once read. No drafts here."""
        for item in output.scheduled:
            request = item.request
            assert not item.draft_token_ids, "drafts are verified only in steps read before the next is scheduled"
            request.num_computed_tokens += item.num_tokens
            if item.sample:
                request.output_token_ids.append(PLACEHOLDER_TOKEN)
            self.kv.register_computed_blocks(request)

    def settle(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[tuple[Request, int]]:
        """Puts the tokens of a step taken by ``advance_provisionally`` in place of its placeholders, and finishes
        a request that a stop condition holds at (its placeholders after that token are dropped: a step scheduled
        ahead computed them for nothing). Returns the requests that received a token, each with 1."""
        now = self.clock()
        advanced = []
        for item in output.scheduled:
            request = item.request
            if request.finished or not item.sample:
                continue  # aborted or stopped while the step ran; a chunk before the last was counted already
            index = item.start + item.num_tokens - request.num_prompt_tokens  # the output index of its token
            assert request.output_token_ids[index] == PLACEHOLDER_TOKEN, "a placeholder is settled once"
            (request.output_token_ids[index],) = sampled[request.request_id]
            self.stats.generated_tokens += request.generates
            if request.first_token_time is None:
                request.first_token_time = now
            advanced.append((request, 1))
            status = self._stop_status(request, index)
            if status is not None:
                del request.output_token_ids[index + 1 :]
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
                self.finish_request(request, status)
            elif request.status == RequestStatus.RUNNING:  # not preempted while it ran: its blocks are its own
                self.kv.register_computed_blocks(request)
        return advanced

    def _ends_at_pending_token(self, request: Request) -> bool:
        """A request whose placeholder token will end it by length, whatever the token is."""
        output = request.output_token_ids
        if not output or output[-1] != PLACEHOLDER_TOKEN:
            return False
        return len(output) >= request.sampling_params.max_tokens or request.num_tokens >= self.max_model_len

    # ---- after the step ----------------------------------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[tuple[Request, int]]:
        """Advances each scheduled request, appends its sampled tokens (one, or with drafts the accepted ones and
        one more), and finishes it if a stop condition holds at one of them (the tokens after it are dropped).

        Returns the requests that received tokens this step, each with how many it kept.
        """
        now = self.clock()
        advanced = []
        for item in output.scheduled:
            request = item.request
            if request.finished:
                continue  # aborted while the step ran
            if not item.sample:
                request.num_computed_tokens += item.num_tokens
                self.kv.register_computed_blocks(request)
                continue
            tokens = sampled[request.request_id]
            num_accepted = len(tokens) - 1
            if item.draft_token_ids:
                assert 0 <= num_accepted <= len(item.draft_token_ids), "more tokens than drafts + 1"
                assert tokens[:num_accepted] == item.draft_token_ids[:num_accepted], "accepted tokens are the drafts"
                self.stats.spec.observe(len(item.draft_token_ids), num_accepted)
            else:
                assert num_accepted == 0, "one token, without drafts"
            if request.first_token_time is None:
                request.first_token_time = now
            num_before = request.num_tokens
            status = self._append_until_stop(request, tokens)
            # The rejected drafts' KV is not computed, nor that of tokens after a stop: only the tokens before count.
            computed = request.num_computed_tokens + item.num_tokens - len(item.draft_token_ids) + num_accepted
            request.num_computed_tokens = min(computed, request.num_tokens)
            self.kv.register_computed_blocks(request)
            advanced.append((request, request.num_tokens - num_before))
            if status is not None:
                self.finish_request(request, status)
            elif item.draft_token_ids:
                self.kv.trim(request, request.num_tokens)  # blocks held only for rejected drafts go back
        return advanced

    def drop_last_tokens(self, request: Request, num_tokens: int) -> None:
        """Takes back a request's last output tokens (an accepted run's tail past its grammar's end) before it is
        finished; they were counted as generated, so the count goes back too."""
        assert 0 < num_tokens <= request.num_output_tokens
        del request.output_token_ids[-num_tokens:]
        self.stats.generated_tokens -= num_tokens

    def _append_until_stop(self, request: Request, tokens: list[int]) -> RequestStatus | None:
        """Appends tokens one by one up to the first that meets a stop condition; returns that condition, if any."""
        for token in tokens:
            request.output_token_ids.append(token)
            self.stats.generated_tokens += request.generates
            status = self._stop_status(request, request.num_output_tokens - 1)
            if status is not None:
                return status
        return None

    def _stop_status(self, request: Request, index: int) -> RequestStatus | None:
        """Whether the request ends at its output token `index` (tokens after it, if any, are placeholders)."""
        params = request.sampling_params
        token = request.output_token_ids[index]
        num_output = index + 1
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens or request.num_prompt_tokens + num_output >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def check_invariants(self) -> None:
        self.kv.check_invariants(set(self.requests))
        assert len(self.running) <= self.max_num_seqs
        assert all(r.status == RequestStatus.RUNNING for r in self.running)
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.SWAPPED) for r in self.waiting)
        assert len(self.running) + len(self.waiting) == len(self.requests)
        adapters = {r.lora_name for r in self.running if r.lora_name is not None}
        assert not adapters or len(adapters) <= self.max_loras, "more LoRA adapters running than max_loras"
        self.swap_space.check_invariants({r.request_id for r in self.waiting if r.status == RequestStatus.SWAPPED})
