"""The scheduler alone, driven by a fake model (no torch): budgets, caps, chunking, preemption, static batches.

The fake model keeps a fake paged KV cache (the token id stands in for its KV) and a fake host swap pool, makes
each step's swap copies as the runner does, and reads every request's context back through its block table.
So a wrong block table, a bad prefix-cache hit or a wrong swap copy changes the output, as it would on a GPU.
"""

from __future__ import annotations

import random
from collections import deque

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tokenloom.config import SchedulerConfig
from tokenloom.core.kv_cache_manager import KVCacheManager
from tokenloom.core.preemption import LinearCostFit, PreemptionCosts, Preemptor, SwapSpace
from tokenloom.core.request import Request, RequestStatus
from tokenloom.core.scheduler import Scheduler
from tokenloom.core.scheduler_output import SchedulerOutput
from tokenloom.sampling_params import SamplingParams

VOCAB = 1000
EOS = 999


def fake_next_token(tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole sequence, never on the batch."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + len(tokens)) % (VOCAB - 1)


def make_scheduler(
    num_blocks=64,
    block_size=4,
    max_num_seqs=4,
    budget=16,
    static=False,
    chunked=True,
    long_prefill=0,
    partial=0,
    policy="fcfs",
    preemption="recompute",
    swap_slots=0,
    costs=None,
    prefix_caching=True,
):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=long_prefill,
        max_num_partial_prefills=partial,
        scheduling_policy=policy,
        preemption_mode=preemption,
        batching="static" if static else "continuous",
    )
    scheduler = Scheduler(
        config,
        kv,
        max_model_len=512,
        eos_token_ids={EOS},
        preemptor=Preemptor(preemption, kv, SwapSpace(swap_slots), costs),
    )
    scheduler.fake_kv = FakePagedKV(num_blocks, swap_slots, block_size)
    return scheduler


class FakePagedKV:
    """Token ids in place of KV vectors: a device cache of num_blocks blocks and a host pool of swap slots."""

    def __init__(self, num_blocks: int, num_swap_slots: int, block_size: int) -> None:
        self.block_size = block_size
        self.device: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.host: list[list[int | None]] = [[None] * block_size for _ in range(num_swap_slots)]

    def swap(self, output: SchedulerOutput) -> None:
        for block, slot in output.swap_out:
            self.host[slot] = list(self.device[block])
        for slot, block in output.swap_in:
            self.device[block] = list(self.host[slot])

    def write(self, block_ids: list[int], start: int, token_ids: list[int]) -> None:
        for position, token in enumerate(token_ids, start):
            self.device[block_ids[position // self.block_size]][position % self.block_size] = token

    def read(self, block_ids: list[int], length: int) -> list[int | None]:
        return [self.device[block_ids[p // self.block_size]][p % self.block_size] for p in range(length)]


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule()
    kv = scheduler.fake_kv
    kv.swap(output)
    for item in output.scheduled:
        kv.write(item.block_ids, item.start, item.token_ids)
    sampled = {}
    for item in output.scheduled:
        request = item.request
        # The fake model must only ever see tokens that are scheduled in order: computed + this chunk.
        assert item.start == request.num_computed_tokens
        assert item.token_ids == request.all_token_ids[item.start : item.start + item.num_tokens]
        assert len(item.block_ids) * scheduler.kv.block_size >= item.start + item.num_tokens
        context = kv.read(item.block_ids, item.start + item.num_tokens)
        assert context == request.all_token_ids[: len(context)], f"{request.request_id}'s KV is corrupt"
        if item.sample:
            sampled[request.request_id] = [fake_next_token(context)]
    assert output.num_batched_tokens == sum(item.num_tokens for item in output.scheduled)
    assert output.num_prefill_tokens == sum(item.num_tokens for item in output.scheduled if item.is_prefill)
    scheduler.update_from_output(output, sampled)
    scheduler.check_invariants()
    return output


def run_to_completion(scheduler: Scheduler, requests: list[Request], max_steps=10_000) -> list[SchedulerOutput]:
    for request in requests:
        scheduler.add_request(request)
    outputs = []
    while scheduler.has_unfinished_requests():
        outputs.append(run_step(scheduler))
        assert len(outputs) < max_steps, "the scheduler stopped making progress"
    return outputs


def solo_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    out = []
    while len(out) < max_tokens:
        out.append(fake_next_token(tokens))
        tokens.append(out[-1])
    return out


def make_request(i: int, prompt_len: int, max_tokens: int) -> Request:
    rng = random.Random(i)
    prompt = [rng.randrange(VOCAB - 1) for _ in range(prompt_len)]
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_a_slice_of_a_requests_tokens_spans_prompt_and_output():
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=8))
    request.output_token_ids += [4, 5, 6]
    every = request.all_token_ids
    for start in range(len(every)):
        for end in range(start, len(every) + 1):
            assert request.token_ids_slice(start, end) == every[start:end], (start, end)


def test_budget_and_sequence_cap_are_respected_and_everyone_finishes():
    scheduler = make_scheduler(max_num_seqs=3, budget=10)
    requests = [make_request(i, 5 + 3 * i, 4 + i) for i in range(8)]
    outputs = run_to_completion(scheduler, requests)
    for output in outputs:
        assert output.num_batched_tokens <= 10
        assert len(output.scheduled) <= 3
    for request in requests:
        assert request.output_token_ids == solo_output(request.prompt_token_ids, request.sampling_params.max_tokens)


def test_long_prompt_is_chunked_and_shares_steps_with_decodes():
    scheduler = make_scheduler(budget=8)
    short = make_request(0, 3, 20)
    scheduler.add_request(short)
    run_step(scheduler)  # short is prefilled and decoding
    long = make_request(1, 30, 2)
    scheduler.add_request(long)
    mixed_steps = 0
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        output = run_step(scheduler)
        kinds = {item.request.request_id: item for item in output.scheduled}
        if "r1" in kinds:
            chunks.append(kinds["r1"].num_tokens)
            if "r0" in kinds and kinds["r0"].num_tokens == 1:
                mixed_steps += 1
    assert len(chunks) >= 4 and max(chunks) <= 7  # one token of each step's budget went to the decode
    assert mixed_steps == len(chunks)
    assert sum(chunks) == 30


def test_preemption_under_a_tiny_pool_and_preempted_requests_complete():
    scheduler = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=4, budget=32)
    requests = [make_request(i, 6, 10) for i in range(4)]
    outputs = run_to_completion(scheduler, requests)
    assert scheduler.stats.num_preemptions > 0
    assert any(output.preempted for output in outputs)
    assert any(r.num_preemptions > 0 for r in requests)
    for request in requests:
        assert request.output_token_ids == solo_output(request.prompt_token_ids, 10)
    assert scheduler.kv.num_used_blocks == 0


def run_until_preemption(scheduler: Scheduler, requests: list[Request]) -> SchedulerOutput:
    for request in requests:
        scheduler.add_request(request)
    for _ in range(100):
        output = run_step(scheduler)
        if output.preempted:
            return output
    raise AssertionError("no preemption happened")


def test_victim_is_the_most_recently_admitted():
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, budget=64)
    preempted = run_until_preemption(scheduler, [make_request(i, 7, 16) for i in range(3)]).preempted
    assert preempted[0].request_id == "r2"
    assert scheduler.waiting[0].request_id == "r2"


def computed_once(requests: list[Request]) -> int:
    """Tokens a run computes when nothing is recomputed: every prompt token and every output token but the last."""
    return sum(r.num_prompt_tokens + r.sampling_params.max_tokens - 1 for r in requests)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_swap_preemption_resumes_without_recomputing(preemption, prefix_caching):
    scheduler = make_scheduler(
        num_blocks=10,
        block_size=4,
        max_num_seqs=4,
        budget=32,
        preemption=preemption,
        swap_slots=16,
        prefix_caching=prefix_caching,
    )
    requests = [make_request(i, 6, 10) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    resume_at: dict[str, int] = {}  # a preempted request's computed tokens when it was preempted
    resumed_from: list[tuple[int, int]] = []  # (computed at preemption, where its next chunk started)
    while scheduler.has_unfinished_requests():
        output = run_step(scheduler)
        for item in output.scheduled:
            if item.request.request_id in resume_at:
                resumed_from.append((resume_at.pop(item.request.request_id), item.start))
        resume_at.update({r.request_id: r.num_computed_tokens for r in output.preempted})
    for request in requests:
        assert request.output_token_ids == solo_output(request.prompt_token_ids, 10)
    stats = scheduler.stats
    assert stats.num_preemptions > 0 and resumed_from
    if preemption == "swap":
        assert stats.preemptions == {"recompute": 0, "swap": stats.num_preemptions}
        assert all(at > 0 and start == at for at, start in resumed_from), "a swapped-in request started over"
        assert stats.computed_tokens == computed_once(requests)
        # Blocks still in the prefix cache at swap-in are taken from there instead of being copied back.
        assert stats.swapped_in_blocks + stats.swap_in_cached_blocks == stats.swapped_out_blocks > 0
        assert (stats.swap_in_cached_blocks > 0) == prefix_caching
    else:
        assert stats.preemptions["swap"] == 0 and all(at == 0 for at, _ in resumed_from)
        assert stats.computed_tokens > computed_once(requests)
    assert scheduler.swap_space.num_used_slots == 0 and scheduler.kv.num_used_blocks == 0


def test_swap_falls_back_to_recompute_when_the_pool_is_full():
    scheduler = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=4, budget=32, preemption="swap", swap_slots=2)
    requests = [make_request(i, 6, 10) for i in range(4)]
    run_to_completion(scheduler, requests)
    for request in requests:
        assert request.output_token_ids == solo_output(request.prompt_token_ids, 10)
    assert scheduler.stats.preemptions["recompute"] > 0, "victims of 3+ blocks cannot fit in 2 slots"
    assert scheduler.swap_space.num_used_slots == 0


@pytest.mark.parametrize(("victim_prompt", "expected_mode"), [(2, "recompute"), (28, "swap")])
def test_auto_recomputes_short_contexts_and_swaps_long_ones(victim_prompt, expected_mode):
    # Swapping costs 2 x (2 + blocks) and recomputing 1 per token: 2 tokens are cheaper to recompute (2 < 6),
    # 28 tokens in 7 blocks cheaper to swap (18 < 28). The two prompts fill all 8 blocks; the victim is the
    # request admitted last, preempted when the next token needs a 9th block.
    costs = PreemptionCosts(seconds_per_token=1.0, seconds_per_copy=2.0, seconds_per_block_copy=1.0)
    scheduler = make_scheduler(
        num_blocks=8, block_size=4, max_num_seqs=2, budget=64, preemption="auto", swap_slots=16, costs=costs
    )
    first = make_request(0, 30 - victim_prompt, 2 + victim_prompt)
    victim = make_request(1, victim_prompt, 32 - victim_prompt)
    output = run_until_preemption(scheduler, [first, victim])
    assert output.preempted == [victim]
    assert scheduler.stats.preemptions[expected_mode] == 1
    assert victim.status == (RequestStatus.SWAPPED if expected_mode == "swap" else RequestStatus.WAITING)


def test_abort_frees_a_swapped_out_request():
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, budget=64, preemption="swap", swap_slots=8)
    requests = [make_request(i, 7, 16) for i in range(3)]
    output = run_until_preemption(scheduler, requests)
    victim = output.preempted[0]
    assert victim.status == RequestStatus.SWAPPED and scheduler.swap_space.num_used_slots == len(output.swap_out) > 0
    assert scheduler.abort_request(victim.request_id) is victim
    scheduler.check_invariants()
    assert scheduler.swap_space.num_used_slots == 0 and victim.status == RequestStatus.FINISHED_ABORTED
    run_to_completion(scheduler, [])
    assert scheduler.kv.num_used_blocks == 0


def test_static_batching_admits_no_one_while_a_batch_runs():
    scheduler = make_scheduler(max_num_seqs=2, budget=64, static=True)
    requests = [make_request(0, 4, 3), make_request(1, 4, 12), make_request(2, 4, 3), make_request(3, 4, 3)]
    for request in requests:
        scheduler.add_request(request)
    first_batch_done_step = None
    step = 0
    while scheduler.has_unfinished_requests():
        output = run_step(scheduler)
        step += 1
        ids = {item.request.request_id for item in output.scheduled}
        if requests[1].finished and first_batch_done_step is None:
            first_batch_done_step = step
        if first_batch_done_step is None:
            assert ids <= {"r0", "r1"}, "a request joined a static batch that was still running"
    assert requests[2].first_scheduled_time >= requests[1].finished_time
    for request in requests:
        assert request.output_token_ids == solo_output(request.prompt_token_ids, request.sampling_params.max_tokens)


def test_continuous_batching_fills_a_finished_slot_at_once():
    scheduler = make_scheduler(max_num_seqs=2, budget=64)
    requests = [make_request(0, 4, 2), make_request(1, 4, 12), make_request(2, 4, 3)]
    for request in requests:
        scheduler.add_request(request)
    while not requests[0].finished:
        run_step(scheduler)
    output = run_step(scheduler)
    assert "r2" in {item.request.request_id for item in output.scheduled}
    assert not requests[1].finished


def test_prefix_cache_hits_skip_computation():
    scheduler = make_scheduler(budget=64)
    shared = list(range(1, 13))  # three full blocks of 4
    first = Request("a", [*shared, 50], SamplingParams(max_tokens=2, ignore_eos=True))
    run_to_completion(scheduler, [first])
    second = Request("b", [*shared, 60, 61], SamplingParams(max_tokens=2, ignore_eos=True))
    scheduler.add_request(second)
    output = run_step(scheduler)
    assert output.scheduled[0].start == 12 and second.num_cached_tokens == 12
    assert scheduler.kv.prefix_cache_hits == 12
    run_to_completion(scheduler, [])
    assert second.output_token_ids == solo_output(second.prompt_token_ids, 2)


def test_prefix_blocks_are_shared_only_under_the_same_cache_salt():
    scheduler = make_scheduler(budget=64)
    shared = list(range(1, 13))  # three full blocks of 4
    cached = {}
    for name, salt in (("a", "one"), ("b", "two"), ("c", None), ("d", "one"), ("e", None)):
        request = Request(name, [*shared, 50], SamplingParams(max_tokens=2, ignore_eos=True), cache_salt=salt)
        run_to_completion(scheduler, [request])
        cached[name] = request.num_cached_tokens
        assert request.output_token_ids == solo_output(request.prompt_token_ids, 2)
    assert cached == {"a": 0, "b": 0, "c": 0, "d": 12, "e": 12}


def test_unchunked_prefill_waits_for_a_step_with_room():
    scheduler = make_scheduler(budget=16, chunked=False)
    requests = [make_request(i, 10, 3) for i in range(3)]
    outputs = run_to_completion(scheduler, requests)
    for output in outputs:
        for item in output.scheduled:
            assert item.start != 0 or item.num_tokens == 10, "a prompt was split with chunking off"
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        scheduler.add_request(make_request(9, 17, 3))


def test_stop_conditions():
    scheduler = make_scheduler()
    eos_at = solo_output([5, 6, 7], 5)
    stop_token = eos_at[2]
    request = Request("s", [5, 6, 7], SamplingParams(max_tokens=5, stop_token_ids=[stop_token]))
    run_to_completion(scheduler, [request])
    assert request.output_token_ids == eos_at[:3] and request.status.value == "stop"
    assert request.stop_reason == stop_token
    limited = Request("l", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    run_to_completion(scheduler, [limited])
    assert len(limited.output_token_ids) == 4 and limited.status.value == "length"


def test_requests_that_can_never_fit_are_rejected():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="KV cache"):
        scheduler.add_request(make_request(0, 10, 20))
    with pytest.raises(ValueError, match="empty"):
        scheduler.add_request(Request("e", [], SamplingParams()))


def test_abort_frees_blocks_in_any_state():
    scheduler = make_scheduler(max_num_seqs=1, budget=64)
    running, waiting = make_request(0, 9, 50), make_request(1, 9, 50)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    run_step(scheduler)
    assert scheduler.abort_request("r1") is waiting
    assert scheduler.abort_request("r0") is running
    scheduler.check_invariants()
    assert scheduler.kv.num_used_blocks == 0 and not scheduler.has_unfinished_requests()


def run_workload(
    scheduler: Scheduler, requests: list[Request], arrivals: list[int], aborts: dict[int, int], max_steps=10_000
) -> list[SchedulerOutput]:
    """Adds request i at step arrivals[i] and aborts it at step aborts[i] (if still unfinished); runs until done."""
    pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
    outputs: list[SchedulerOutput] = []
    step = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            scheduler.add_request(requests[pending.pop(0)])
        for i, when in aborts.items():
            if when == step and i < len(requests) and requests[i].request_id in scheduler.requests:
                scheduler.abort_request(requests[i].request_id)
                scheduler.check_invariants()
        outputs.append(run_step(scheduler))
        step += 1
        assert step < max_steps, "the scheduler stopped making progress"
    return outputs


def check_workload(scheduler: Scheduler, lengths, priorities, arrivals, aborts) -> None:
    """Every request not aborted finishes with its solo output; an aborted one stops on a prefix of it; no leaks."""
    requests = [make_request(i, p, m) for i, (p, m) in enumerate(lengths)]
    for request, priority in zip(requests, priorities, strict=False):
        request.priority = priority
        request.tenant = f"t{priority}"
    outputs = run_workload(scheduler, requests, arrivals, aborts)
    assert all(o.num_batched_tokens <= scheduler.max_num_batched_tokens for o in outputs)
    for request in requests:
        expected = solo_output(request.prompt_token_ids, request.sampling_params.max_tokens)
        if request.status == RequestStatus.FINISHED_ABORTED:
            assert expected[: request.num_output_tokens] == request.output_token_ids
        else:
            assert request.output_token_ids == expected
    if scheduler.preemptor.mode == "recompute":
        assert scheduler.stats.preemptions["swap"] == 0
    assert scheduler.kv.num_used_blocks == 0 and scheduler.swap_space.num_used_slots == 0
    event(f"preempted by swap: {scheduler.stats.preemptions['swap'] > 0}")
    event(f"preempted by recompute: {scheduler.stats.preemptions['recompute'] > 0}")


arrivals_and_aborts = dict(
    priorities=st.lists(st.integers(0, 2), min_size=10, max_size=10),
    arrivals=st.lists(st.integers(0, 12), min_size=10, max_size=10),
    aborts=st.dictionaries(st.integers(0, 9), st.integers(0, 40), max_size=3),
)


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 16)), min_size=1, max_size=10),
    num_blocks=st.integers(14, 40),
    budget=st.integers(1, 48),
    max_num_seqs=st.integers(1, 6),
    static=st.booleans(),
    long_prefill=st.sampled_from([0, 1, 5]),
    partial=st.sampled_from([0, 1, 2]),
    policy=st.sampled_from(["fcfs", "priority", "fair"]),
    preemption=st.sampled_from(["recompute", "swap", "auto"]),
    **arrivals_and_aborts,
)
def test_random_workloads_finish_with_solo_outputs(
    lengths, num_blocks, budget, max_num_seqs, static, long_prefill, partial, policy, preemption, **workload
):
    scheduler = make_scheduler(
        num_blocks,
        4,
        max_num_seqs,
        budget,
        static=static,
        long_prefill=long_prefill,
        partial=partial,
        policy=policy,
        preemption=preemption,
        swap_slots=16,
    )
    check_workload(scheduler, lengths, **workload)


@pytest.mark.parametrize("preemption", ["recompute", "swap", "auto"])
@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(8, 40), st.integers(4, 16)), min_size=4, max_size=10),
    num_blocks=st.integers(14, 20),
    budget=st.integers(8, 48),
    max_num_seqs=st.integers(2, 6),
    swap_slots=st.integers(0, 24),
    block_copy_cost=st.sampled_from([0.1, 1.0, 10.0]),
    **arrivals_and_aborts,
)
def test_kv_pressure_in_every_policy_and_preemption_mode(
    policy, preemption, lengths, num_blocks, budget, max_num_seqs, swap_slots, block_copy_cost, **workload
):
    """A tiny pool, so requests are preempted often: swapped out (into a pool that may fill up) or recomputed."""
    costs = PreemptionCosts(seconds_per_token=1.0, seconds_per_block_copy=block_copy_cost)
    scheduler = make_scheduler(
        num_blocks,
        4,
        max_num_seqs,
        budget,
        policy=policy,
        preemption=preemption,
        swap_slots=swap_slots,
        costs=costs,
    )
    check_workload(scheduler, lengths, **workload)


def test_stall_free_prefill_caps_long_prompts_and_keeps_decodes_moving():
    scheduler = make_scheduler(budget=32, long_prefill=8, partial=1)
    decoding = [make_request(i, 3, 40) for i in range(2)]
    for request in decoding:
        scheduler.add_request(request)
    run_step(scheduler)
    long_a, long_b = make_request(10, 40, 2), make_request(11, 40, 2)
    scheduler.add_request(long_a)
    scheduler.add_request(long_b)
    while not (long_a.finished and long_b.finished):
        output = run_step(scheduler)
        prefills = [s for s in output.scheduled if s.num_tokens > 1]
        assert len(prefills) <= 1, "max_num_partial_prefills=1 lets one prompt prefill per step"
        assert all(s.num_tokens <= 8 for s in prefills), "a prompt gets at most 8 tokens of a step"
        if not decoding[0].finished:
            assert {"r0", "r1"} <= {s.request.request_id for s in output.scheduled}, "decodes were stalled"
    assert long_a.first_token_time <= long_b.first_token_time  # first come, first prefilled


def test_higher_priority_displaces_at_the_sequence_cap():
    scheduler = make_scheduler(max_num_seqs=1, budget=64, policy="priority")
    low = make_request(0, 5, 30)
    low.priority = 5
    scheduler.add_request(low)
    run_step(scheduler)
    run_step(scheduler)
    urgent = make_request(1, 5, 3)
    urgent.priority = 0
    scheduler.add_request(urgent)
    output = run_step(scheduler)
    assert [r.request_id for r in output.preempted] == ["r0"]
    assert [s.request.request_id for s in output.scheduled] == ["r1"], "priority inversion at max_num_seqs"
    run_to_completion(scheduler, [])
    assert urgent.finished_time < low.finished_time and low.num_preemptions == 1
    assert low.output_token_ids == solo_output(low.prompt_token_ids, 30)


def test_equal_priorities_never_ping_pong():
    scheduler = make_scheduler(max_num_seqs=1, budget=64, policy="priority")
    requests = [make_request(i, 5, 10) for i in range(3)]
    outputs = run_to_completion(scheduler, requests)
    assert not any(o.preempted for o in outputs)
    assert [r.request_id for r in sorted(requests, key=lambda r: r.finished_time)] == ["r0", "r1", "r2"]


def test_priority_orders_the_queue_and_fcfs_does_not():
    for policy, expected in (("priority", ["r2", "r1", "r0"]), ("fcfs", ["r0", "r1", "r2"])):
        scheduler = make_scheduler(max_num_seqs=1, budget=64, policy=policy)
        blocker = make_request(9, 3, 2)
        scheduler.add_request(blocker)
        run_step(scheduler)
        requests = [make_request(i, 3, 2) for i in range(3)]
        for request, priority in zip(requests, (3, 2, 1), strict=True):
            request.priority = priority
        run_to_completion(scheduler, requests)
        order = [r.request_id for r in sorted(requests, key=lambda r: r.first_scheduled_time)]
        assert order == expected, policy


def steps_until_scheduled(policy: str) -> int:
    """Tenant A floods long requests; tenant B's one short request arrives later. Steps until B is scheduled."""
    scheduler = make_scheduler(num_blocks=200, max_num_seqs=2, budget=64, policy=policy)
    for i in range(12):
        flood = make_request(i, 20, 30)
        flood.tenant = "A"
        scheduler.add_request(flood)
    for _ in range(5):
        run_step(scheduler)
    short = make_request(99, 5, 3)
    short.tenant = "B"
    scheduler.add_request(short)
    steps = 0
    while short.first_scheduled_time is None:
        run_step(scheduler)
        steps += 1
    run_to_completion(scheduler, [])
    return steps


def test_fair_share_bounds_the_wait_of_a_tenant_behind_a_flood():
    fair, fcfs = steps_until_scheduled("fair"), steps_until_scheduled("fcfs")
    assert fair <= 31, "B waits at most until one of A's running requests finishes"
    assert fcfs > 5 * fair, (fair, fcfs)


def test_an_idle_tenant_banks_no_credit():
    from tokenloom.core.policy import FairPolicy

    policy = FairPolicy()
    waiting: deque = deque()
    busy = make_request(0, 5, 5)
    busy.tenant = "A"
    policy.enqueue(waiting, busy)
    policy.charge(busy, 1000)
    newcomer = make_request(1, 5, 5)
    newcomer.tenant = "B"
    policy.enqueue(waiting, newcomer)
    # B was idle while A used 1,000 tokens: it starts level with A, not 1,000 tokens ahead.
    assert policy.virtual_tokens["B"] == policy.virtual_tokens["A"] == 1000


def test_fair_weights_share_tokens():
    from tokenloom.core.policy import FairPolicy

    policy = FairPolicy({"gold": 3.0, "free": 1.0})
    gold, free = make_request(0, 5, 5), make_request(1, 5, 5)
    gold.tenant, free.tenant = "gold", "free"
    policy.charge(gold, 300)
    policy.charge(free, 100)
    assert policy.virtual_tokens["gold"] == policy.virtual_tokens["free"] == 100


def test_cost_fit_separates_overhead_from_per_unit_cost():
    fit = LinearCostFit()
    assert fit.slope() is None and fit.intercept() is None
    for work in (1, 8, 64, 8, 200, 1):
        fit.add(work, 0.5 + 0.01 * work)
    assert fit.slope() == pytest.approx(0.01) and fit.intercept() == pytest.approx(0.5)
    same = LinearCostFit()
    for _ in range(3):
        same.add(10, 1.0)
    assert same.slope() == pytest.approx(0.1), "alike samples: the whole time is charged per unit"
    costs = PreemptionCosts(seconds_per_token=0.01, seconds_per_copy=0.5, seconds_per_block_copy=0.01)
    assert not costs.prefers_swap(50, 4) and costs.prefers_swap(200, 13)  # 1.08 > 0.5; 1.26 < 2.0


def run_speculative_step(scheduler: Scheduler, rng: random.Random) -> SchedulerOutput:
    """A step where each decoding request first gets 0-5 drafts, each right (the fake model's next token) with
    probability 0.6; the fake model then verifies them as the sampler does at temperature 0."""
    for request in scheduler.running:
        if request.num_tokens - request.num_computed_tokens == 1:
            tokens, drafts = list(request.all_token_ids), []
            for _ in range(rng.randint(0, 5)):
                right = fake_next_token(tokens)
                drafts.append(right if rng.random() < 0.6 else (right + 1) % (VOCAB - 1))
                tokens.append(drafts[-1])
            request.spec_token_ids = drafts
    output = scheduler.schedule()
    kv = scheduler.fake_kv
    kv.swap(output)
    sampled = {}
    for item in output.scheduled:
        request = item.request
        assert item.start == request.num_computed_tokens
        assert (
            item.token_ids
            == request.all_token_ids[item.start : item.start + item.num_tokens - len(item.draft_token_ids)]
            + item.draft_token_ids
        )
        assert len(item.block_ids) * scheduler.kv.block_size >= item.start + item.num_tokens, "slots for the drafts"
        kv.write(item.block_ids, item.start, item.token_ids)
        context = kv.read(item.block_ids, item.start + item.num_tokens - len(item.draft_token_ids))
        assert context == request.all_token_ids[: len(context)], f"{request.request_id}'s KV is corrupt"
        if item.sample:
            kept, sequence = [], list(context)
            for draft in [*item.draft_token_ids, None]:
                kept.append(fake_next_token(sequence))
                if kept[-1] != draft:
                    break
                sequence.append(draft)
            sampled[request.request_id] = kept
    scheduler.update_from_output(output, sampled)
    scheduler.check_invariants()
    for request in scheduler.running:  # the blocks of rejected drafts went back: only what its tokens need
        assert len(scheduler.kv.block_ids(request.request_id)) <= -(-request.num_tokens // scheduler.kv.block_size)
    return output


@pytest.mark.parametrize(
    "setup",
    [
        dict(),
        dict(num_blocks=14, budget=12),  # preempts; drafts cut to the budget
        dict(num_blocks=14, preemption="swap", swap_slots=32),
        dict(budget=8, long_prefill=3, partial=1),
        dict(policy="fair", budget=10),
    ],
)
def test_speculative_steps_keep_outputs_budgets_and_blocks(setup):
    rng = random.Random(0)
    scheduler = make_scheduler(**setup)
    requests = [
        Request(
            f"r{i}",
            [rng.randrange(VOCAB - 1) for _ in range(rng.randint(1, 20))],
            SamplingParams(max_tokens=12, ignore_eos=True),
        )
        for i in range(8)
    ]
    for request in requests:
        scheduler.add_request(request)
    steps = 0
    while scheduler.has_unfinished_requests():
        run_speculative_step(scheduler, rng)
        steps += 1
        assert steps < 1000
    for request in requests:
        assert request.output_token_ids == solo_output(request.prompt_token_ids, 12)
    spec = scheduler.stats.spec
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert scheduler.kv.num_used_blocks == 0
    if "num_blocks" in setup:
        assert scheduler.stats.num_preemptions > 0


def test_a_block_holding_a_placeholder_is_never_hashed_nor_cached():
    """A token scheduled ahead is a placeholder until read: the block holding it is neither registered in the
    prefix cache nor hashed (a hash would be the placeholder's), and once the token is in, it is."""
    from tokenloom.core.request import PLACEHOLDER_TOKEN

    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = Request("r", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=8))
    assert kv.allocate_slots(request, 8)
    request.output_token_ids += [7, PLACEHOLDER_TOKEN]  # the second block: 5, 6, 7 and a token on its way
    request.num_computed_tokens = 8
    kv.register_computed_blocks(request)
    twin = Request("t", [1, 2, 3, 4, 5, 6, 7, 9, 10], SamplingParams(max_tokens=8))
    assert len(kv.find_cached_prefix(twin)) == 1, "only the first block is cached"
    assert len(kv.find_cached_prefix(request)) == 1, "its own lookup stops before the placeholder"
    request.output_token_ids[-1] = 9
    kv.register_computed_blocks(request)
    assert len(kv.find_cached_prefix(twin)) == 2
    kv.check_invariants({"r"})
