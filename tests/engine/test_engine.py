"""The whole engine on a tiny model: outputs do not depend on batch composition, chunking or preemption."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tokenloom import LLM, SamplingParams
from tokenloom.config import EngineConfig
from tokenloom.engine.async_engine import AsyncEngine
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.model.loader import load_model

VOCAB = 512


def prompts(n: int, seed: int = 0, low: int = 3, high: int = 60) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(VOCAB - 1) for _ in range(rng.randint(low, high))]} for _ in range(n)]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def solo_reference(tiny_llama):
    """Each prompt run alone, one at a time, with a generous configuration."""
    llm = LLM(str(tiny_llama), max_num_seqs=1, max_num_batched_tokens=1024)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return token_ids(llm.generate(prompts(10), greedy, use_tqdm=False))


UNDER_PRESSURE = dict(max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=12, block_size=8)  # preempts


@pytest.mark.parametrize(
    "config",
    [
        dict(max_num_seqs=16, max_num_batched_tokens=1024),
        dict(max_num_seqs=4, max_num_batched_tokens=20),  # chunked prompts, mixed steps
        UNDER_PRESSURE,
        dict(max_num_seqs=3, max_num_batched_tokens=64, batching="static"),
        dict(max_num_seqs=8, max_num_batched_tokens=128, enable_chunked_prefill=False, enable_prefix_caching=False),
        dict(max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=7, max_num_partial_prefills=1),
        dict(max_num_seqs=3, max_num_batched_tokens=32, num_kv_blocks=12, block_size=8, scheduling_policy="fair"),
        dict(UNDER_PRESSURE, preemption_mode="swap", num_swap_blocks=64),
        dict(UNDER_PRESSURE, preemption_mode="auto", num_swap_blocks=4, scheduling_policy="priority"),
        # Asynchronous output processing (each step's outputs read while the next one runs): the same tokens.
        dict(max_num_seqs=4, max_num_batched_tokens=20, async_output_proc=True),
        dict(UNDER_PRESSURE, async_output_proc=True),
        dict(UNDER_PRESSURE, preemption_mode="swap", num_swap_blocks=64, async_output_proc=True),
        # Asynchronous scheduling (each step scheduled before the one before is read, placeholders for its tokens).
        dict(max_num_seqs=16, max_num_batched_tokens=1024, async_scheduling=True),
        dict(max_num_seqs=4, max_num_batched_tokens=20, async_scheduling=True),
        dict(UNDER_PRESSURE, async_scheduling=True),
        dict(UNDER_PRESSURE, preemption_mode="swap", num_swap_blocks=64, async_scheduling=True),
        dict(
            UNDER_PRESSURE,
            preemption_mode="auto",
            num_swap_blocks=4,
            scheduling_policy="priority",
            async_scheduling=True,
        ),
        dict(max_num_seqs=3, max_num_batched_tokens=64, batching="static", async_scheduling=True),
    ],
)
def test_greedy_outputs_match_solo_runs(tiny_llama, solo_reference, config):
    llm = LLM(str(tiny_llama), **config)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert token_ids(llm.generate(prompts(10), greedy, use_tqdm=False)) == solo_reference
    stats = llm.stats()
    assert stats.kv_blocks_in_use == 0 and stats.generated_tokens == 120
    if "num_kv_blocks" in config:
        assert stats.num_preemptions > 0
    if config.get("preemption_mode") == "swap":
        assert stats.num_preemptions_swap == stats.num_preemptions, "a 64-block pool never falls back"
        restored = stats.swapped_in_blocks + stats.swap_in_cached_blocks  # copied back or found cached
        assert restored == stats.swapped_out_blocks > 0
    assert stats.swap_blocks_in_use == 0 and stats.num_swapped == 0


def test_priority_policy_keeps_outputs_and_serves_urgent_first(tiny_llama, solo_reference):
    llm = LLM(str(tiny_llama), max_num_seqs=2, max_num_batched_tokens=32, scheduling_policy="priority")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    priorities = [5, 5, 5, 5, 5, 5, 5, 5, 5, 0]
    outputs = llm.generate(prompts(10), greedy, use_tqdm=False, priority=priorities)
    assert token_ids(outputs) == solo_reference
    finish_order = sorted(range(10), key=lambda i: outputs[i].metrics.finished_time)
    assert finish_order.index(9) <= 2, "the urgent request, last to arrive, finished among the first"


def test_preempted_requests_report_it(tiny_llama):
    llm = LLM(str(tiny_llama), **UNDER_PRESSURE)
    outputs = llm.generate(prompts(10), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outputs) == llm.stats().num_preemptions > 0
    for output in outputs:
        m = output.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_shared_prefixes_hit_the_prefix_cache(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=4)
    shared = list(range(10, 42))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": [*shared, 1]}, params, use_tqdm=False)
    second = llm.generate({"prompt_token_ids": [*shared, 2]}, params, use_tqdm=False)
    assert second[0].metrics.num_cached_tokens == 32 and first[0].metrics.num_cached_tokens == 0
    stats = llm.stats()
    assert stats.prefix_cache_hits == 32 and stats.prefix_cache_queries == 66
    cold = LLM(str(tiny_llama), block_size=4, enable_prefix_caching=False)
    assert token_ids(cold.generate({"prompt_token_ids": [*shared, 2]}, params, use_tqdm=False)) == token_ids(second)


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_llama):
    llm = LLM(str(tiny_llama), max_num_seqs=8)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate(prompts(1, seed=3), seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)
    batch = prompts(1, seed=3) + prompts(5, seed=4)
    together = llm.generate(batch, [seeded] + [others] * 5, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == together
    reseeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=8, max_tokens=16, ignore_eos=True)
    assert llm.generate(prompts(1, seed=3), reseeded, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_logprobs_are_returned_for_each_token(tiny_llama):
    llm = LLM(str(tiny_llama))
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True)
    completion = llm.generate(prompts(1), params, use_tqdm=False)[0].outputs[0]
    assert len(completion.logprobs) == 5
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert len(entry) == 3
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for e, t in zip(completion.logprobs, completion.token_ids, strict=True))
    )


def test_eos_stops_unless_ignored(tiny_llama):
    llm = LLM(str(tiny_llama))
    first = llm.generate(prompts(1), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    eos_like = first[0].outputs[0].token_ids[1]
    # Declare the second generated token a stop token: generation ends there with reason "stop".
    params = SamplingParams(temperature=0, max_tokens=3, stop_token_ids=[eos_like])
    out = llm.generate(prompts(1), params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == first[0].outputs[0].token_ids[:2]
    assert out.finish_reason == "stop" and out.stop_reason == eos_like
    assert first[0].outputs[0].finish_reason == "length"


def test_generation_stops_at_the_context_length(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=40)
    out = llm.generate({"prompt_token_ids": [5] * 35}, SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="context length"):
        llm.generate({"prompt_token_ids": [5] * 40}, use_tqdm=False)


def test_config_errors_are_clear(tiny_llama):
    with pytest.raises(TypeError, match=r"unknown engine option.*max_num_seq'"):
        LLM(str(tiny_llama), max_num_seq=4)
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):
        LLM(str(tiny_llama), max_num_seqs=0)
    with pytest.raises(ValueError, match="batching"):
        LLM(str(tiny_llama), batching="dynamic")
    with pytest.raises(ValueError, match="preemption_mode must be one of"):
        LLM(str(tiny_llama), preemption_mode="drop")
    with pytest.raises(ValueError, match="swap_space must be >= 0"):
        LLM(str(tiny_llama), swap_space=-1)
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        LLM(str(tiny_llama), max_model_len=100_000)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_bad_token_ids_and_missing_tokenizer(tiny_llama):
    llm = LLM(str(tiny_llama))
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate({"prompt_token_ids": [VOCAB + 5]}, use_tqdm=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello", use_tqdm=False)
    assert llm.stats().kv_blocks_in_use == 0 and not llm.engine.has_unfinished_requests()


def test_plain_pytorch_attention_path_gives_the_same_outputs(tiny_llama, solo_reference):
    """The compiled CPU decode kernel is optional; without it (other devices, no compiler) nothing changes."""
    llm = LLM(str(tiny_llama), max_num_seqs=4, max_num_batched_tokens=20)
    llm.engine.core.runner.inputs.attention_backend = "torch"
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert token_ids(llm.generate(prompts(10), greedy, use_tqdm=False)) == solo_reference


def test_swap_copies_blocks_to_the_host_pool_and_back(tiny_llama):
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            model=str(tiny_llama), num_kv_blocks=8, block_size=4, preemption_mode="swap", num_swap_blocks=5
        )
    )
    runner = engine.core.runner
    assert len(runner.swap_caches) == len(runner.kv_caches)
    assert all(
        host.device.type == "cpu" and host.data_ptr() != dev.data_ptr()
        for (host, _), (dev, _) in zip(runner.swap_caches, runner.kv_caches, strict=True)
    )
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    runner.swap_out([(1, 4), (6, 0)])
    for k, v in runner.kv_caches:
        k.zero_()
        v.zero_()
    runner.swap_in([(4, 2), (0, 7)])
    for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True):
        for now, then in ((k, k0), (v, v0)):
            blocks, blocks_then = now.view(8, 4, -1), then.view(8, 4, -1)
            assert torch.equal(blocks[2], blocks_then[1]) and torch.equal(blocks[7], blocks_then[6])
            assert not blocks[[0, 1, 3, 4, 5, 6]].any(), "a copy touched another block"


def test_recompute_mode_allocates_no_swap_pool(tiny_llama):
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama), num_kv_blocks=8, swap_space=4.0))
    assert engine.core.num_swap_blocks == 0 and engine.core.runner.swap_caches == []
    sized = LLMEngine(
        EngineConfig.from_kwargs(model=str(tiny_llama), num_kv_blocks=8, preemption_mode="auto", swap_space=0.001)
    )
    assert sized.core.num_swap_blocks == int(0.001 * 1024**3) // sized.core.kv_bytes_per_block() > 0
    costs = sized.core.preemption_costs
    assert costs.seconds_per_block_copy > 0, "the engine measures block copies at start"


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama):
    return load_model(str(tiny_llama), None, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def solo_outputs(tiny_loaded):
    """Greedy output of a prompt run alone, 16 tokens, memoised: a shorter run's output is a prefix of it."""
    engine = LLMEngine(EngineConfig.from_kwargs(max_num_seqs=1), loaded=tiny_loaded)
    cache: dict[tuple[int, ...], list[int]] = {}

    def solo(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in cache:
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        cache[tuple(prompt)] = output.outputs[0].token_ids
        return cache[tuple(prompt)]

    return solo


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap", "auto"])
@settings(max_examples=25, deadline=None)
@given(
    workload=st.lists(st.tuples(st.integers(3, 40), st.integers(2, 16), st.integers(0, 10)), min_size=3, max_size=7),
    aborts=st.dictionaries(st.integers(0, 6), st.integers(0, 20), max_size=2),
    num_swap_blocks=st.sampled_from([2, 64]),
    policy=st.sampled_from(["fcfs", "priority", "fair"]),
    seed=st.integers(0, 1000),
    overlap=st.sampled_from(["none", "async_output_proc", "async_scheduling"]),
)
def test_random_arrivals_and_aborts_under_kv_pressure_keep_greedy_outputs(
    tiny_loaded, solo_outputs, preemption_mode, workload, aborts, num_swap_blocks, policy, seed, overlap
):
    """Real tensors this time: a wrong swap copy or block table changes the tokens. With asynchronous output
    processing an abort lands while the request's next step is in flight; with asynchronous scheduling, also while
    a step holding its placeholder is, and preemptions meet requests whose last token is one."""
    config = EngineConfig.from_kwargs(
        **({} if overlap == "none" else {overlap: True}),
        max_num_seqs=4,
        max_num_batched_tokens=32,
        num_kv_blocks=10,
        block_size=8,
        scheduling_policy=policy,
        preemption_mode=preemption_mode,
        num_swap_blocks=num_swap_blocks,
    )
    engine = LLMEngine(config, loaded=tiny_loaded)
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB - 1) for _ in range(length)] for length, _, _ in workload]
    finished = {}
    step = 0
    while step <= 10 or engine.has_unfinished_requests():
        for i, (_, max_tokens, arrival) in enumerate(workload):
            if arrival == step:
                params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                engine.add_request(prompts[i], params, request_id=str(i), priority=i % 3, tenant=f"t{i % 2}")
        for i, when in aborts.items():
            if when == step and engine.abort_request(str(i)) is not None:
                engine.core.scheduler.check_invariants()
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        step += 1
        assert step < 2000
    for i, (_, max_tokens, _) in enumerate(workload):
        expected = solo_outputs(prompts[i])[:max_tokens]
        if str(i) in finished:
            assert finished[str(i)].outputs[0].token_ids == expected
        else:
            assert i in aborts
    stats = engine.stats()
    assert stats.kv_blocks_in_use == 0 and stats.swap_blocks_in_use == 0
    if preemption_mode == "recompute":
        assert stats.num_preemptions_swap == 0
    event(f"preempted by swap: {stats.num_preemptions_swap > 0}")
    event(f"preempted by recompute: {stats.num_preemptions_recompute > 0}")


def test_a_request_is_admitted_while_a_step_runs_and_joins_the_next(tiny_llama):
    """Admission does not wait for the running step: a burst that arrives during a step fills the next one."""
    front = AsyncEngine(LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama))))
    front.start()

    async def submit_while_a_step_holds_the_lock() -> tuple[list, float, float]:
        front._lock.acquire()  # as a long step would
        submitted = [
            await front.submit([5, 6, 7 + i], SamplingParams(max_tokens=2), f"r{i}") for i in range(3)
        ]  # returns at once: nothing here waits for the lock
        admitted = time.monotonic()
        await asyncio.sleep(0.2)
        released = time.monotonic()
        front._lock.release()
        outputs = [[o async for o in stream] for stream in submitted]
        return outputs, admitted, released

    try:
        outputs, admitted, released = asyncio.run(submit_while_a_step_holds_the_lock())
    finally:
        front.shutdown()
    assert admitted < released
    assert all(o[-1].metrics.arrival_time < released for o in outputs)  # queue time counts the wait
    # All three ran together: one step for their prompts (and first tokens), one for their second tokens.
    assert front.stats().num_steps == 2


def test_requests_that_join_the_same_step_queue_in_arrival_order(tiny_llama):
    """A burst's requests finish validation in worker threads in any order; the FCFS queue takes them by arrival
    time (as the server stamps it when a request has been read), so first come is first served."""
    front = AsyncEngine(LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama), max_num_seqs=1)))
    front.start()
    now = time.monotonic()
    arrivals = {"r0": now, "r1": now - 2.0, "r2": now - 1.0}  # submitted r0, r1, r2; arrived r1, r2, r0

    async def submit_during_one_step() -> dict[str, float]:
        front._lock.acquire()  # as a long step would: all three join the next one
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        streams = {rid: await front.submit([5, 6, 7], params, rid, arrival_time=t) for rid, t in arrivals.items()}
        front._lock.release()
        finals = {rid: [o async for o in stream][-1] for rid, stream in streams.items()}
        return {rid: final.metrics.first_scheduled_time for rid, final in finals.items()}

    try:
        scheduled = asyncio.run(submit_during_one_step())
    finally:
        front.shutdown()
    assert sorted(scheduled, key=scheduled.__getitem__) == ["r1", "r2", "r0"]  # one seat: served one by one


def test_compiled_step_gives_the_eager_greedy_tokens(tiny_llama, solo_reference):
    """The torch.compile'd step (chunked prompts, preemption, mixed steps) against the eager solo runs."""
    from torch._dynamo.utils import counters

    graphs_before = counters["stats"]["unique_graphs"]
    llm = LLM(str(tiny_llama), enforce_eager=False, **UNDER_PRESSURE)
    assert llm.engine.core.runner.compiled is not None
    assert counters["stats"]["unique_graphs"] >= graphs_before + 2  # warmed up: one token, and more than one
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert token_ids(llm.generate(prompts(10), greedy, use_tqdm=False)) == solo_reference
    assert counters["stats"]["unique_graphs"] == graphs_before + 2  # no batch size compiled again


def test_the_step_compiles_by_default_on_cuda_only():
    assert EngineConfig().compiles_step("cuda") and not EngineConfig().compiles_step("cpu")
    assert EngineConfig.from_kwargs(enforce_eager=False).compiles_step("cpu")
    assert not EngineConfig.from_kwargs(enforce_eager=True).compiles_step("cuda")


def test_enforce_eager_flag_reads_as_vllms():
    import argparse

    from tokenloom.cli import add_engine_flags, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config_from_args(parser.parse_args([])).model.enforce_eager is None
    assert engine_config_from_args(parser.parse_args(["--enforce-eager"])).model.enforce_eager is True
    assert engine_config_from_args(parser.parse_args(["--no-enforce-eager"])).model.enforce_eager is False


def test_kv_cache_on_an_accelerator_takes_what_gpu_memory_utilization_leaves(tiny_llama, monkeypatch):
    """The arithmetic, and the engine's use of it with the device's readings stood in (no GPU here)."""
    from tokenloom.engine.kv_sizing import kv_blocks_that_fit, sizes_kv_from_device_memory

    gib = 2**30
    # 80 GiB, 90% of it allowed, 17 GiB in use (weights and the rest), a 3 GiB activation peak: 52 GiB of KV.
    assert kv_blocks_that_fit(80 * gib, 17 * gib, 3 * gib, 0.9, gib) == 52
    assert kv_blocks_that_fit(80 * gib, 75 * gib, 3 * gib, 0.9, gib) == 0  # nothing left
    llm = LLM(str(tiny_llama), max_num_seqs=4)
    core = llm.engine.core
    monkeypatch.setattr(core.runner, "profile_peak_activation_bytes", lambda tokens: 3 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (63 * gib, 80 * gib))
    per_block = core.kv_bytes_per_block()
    assert (
        core._kv_blocks_from_device_memory(torch.device("cpu"))
        == (int(80 * gib * 0.9) - 17 * gib - 3 * gib) // per_block
    )
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1 * gib, 80 * gib))
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        core._kv_blocks_from_device_memory(torch.device("cpu"))
    # On a CPU the cache is sized by bytes, as before: the device's memory is never asked.
    assert not sizes_kv_from_device_memory(core.config, torch.device("cpu"))
    assert sizes_kv_from_device_memory(core.config, torch.device("cuda"))


@pytest.mark.parametrize("in_process", [True, False])
def test_a_final_only_request_gets_one_output_equal_to_the_cumulative_last(tiny_chat_model, in_process):
    """RequestOutputKind.FINAL_ONLY (what LLM.generate asks): no output for the steps between, and the one at the
    end carries the same tokens, text, stop and logprobs as the last cumulative output of the same request."""
    from tokenloom import RequestOutputKind
    from tokenloom.engine.core_process import CoreProcessEngine

    config = EngineConfig.from_kwargs(model=str(tiny_chat_model), dtype="float32")
    engine = LLMEngine(config) if in_process else CoreProcessEngine(config)
    prompt = list(range(40, 60))

    def run(stop: list[str]) -> dict[str, list]:
        outputs: dict[str, list] = {}
        for kind in RequestOutputKind:
            params = SamplingParams(
                temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, stop=stop, output_kind=kind
            )
            engine.add_request(prompt, params, request_id=f"{kind.name}-{len(stop)}")
        while engine.has_unfinished_requests():
            for output in engine.step():
                outputs.setdefault(output.request_id.split("-")[0], []).append(output)
        return outputs

    try:
        unstopped = run([])
        text = unstopped["CUMULATIVE"][-1].outputs[0].text
        stopped = run([text[3:5]])  # a stop string the text completes: found in text the final-only caller never sees
    finally:
        engine.shutdown()
    for outputs in (unstopped, stopped):
        cumulative, final = outputs["CUMULATIVE"], outputs["FINAL_ONLY"]
        assert len(cumulative) > 1 and len(final) == 1 and final[0].finished
        expected, got = cumulative[-1].outputs[0], final[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            expected.token_ids, expected.text, expected.finish_reason, expected.stop_reason
        )  # fmt: skip
        # The two requests share each step in different rows, whose float32 sums may round apart (~1e-6).
        assert [{t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in got.logprobs] == [
            {t: (pytest.approx(lp.logprob, abs=1e-5), lp.rank) for t, lp in e.items()} for e in expected.logprobs
        ]
        assert got.cumulative_logprob == pytest.approx(expected.cumulative_logprob, abs=1e-4)
    assert stopped["FINAL_ONLY"][0].outputs[0].stop_reason == text[3:5], "the stop string ended it"
    assert len(stopped["FINAL_ONLY"][0].outputs[0].text) < len(text)
    for outputs in (unstopped, stopped):  # DELTA: each output what the step added, joined the cumulative last
        cumulative, deltas = outputs["CUMULATIVE"], outputs["DELTA"]
        assert len(deltas) == len(cumulative) and deltas[-1].finished
        shown = 0
        for delta, whole in zip(deltas, cumulative, strict=True):
            got = delta.outputs[0]
            assert got.token_ids and whole.outputs[0].token_ids[-len(got.token_ids) :] == got.token_ids
            assert whole.outputs[0].text[shown:] == got.text and len(got.logprobs) == len(got.token_ids)
            shown += len(got.text)
        last = cumulative[-1].outputs[0]
        assert [t for d in deltas for t in d.outputs[0].token_ids] == last.token_ids
        assert "".join(d.outputs[0].text for d in deltas) == last.text
        assert deltas[-1].outputs[0].cumulative_logprob == pytest.approx(last.cumulative_logprob, abs=1e-4)
        assert (deltas[-1].outputs[0].finish_reason, deltas[-1].outputs[0].stop_reason) == (
            last.finish_reason, last.stop_reason
        )  # fmt: skip


def test_generate_takes_final_outputs_without_changing_the_callers_params(tiny_llama):
    from tokenloom import RequestOutputKind

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = LLM(str(tiny_llama)).generate(prompts(3), params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6, 6, 6] and all(o.finished for o in outputs)
    assert params.output_kind is RequestOutputKind.CUMULATIVE


def test_async_output_processing_reads_each_step_at_the_next_call(tiny_chat_model):
    """With asynchronous output processing a call returns the outputs of the step launched by the call before
    (the first returns none, and the engine stays busy until the last launched step is read); the text, stops and
    logprobs are the synchronous engine's, and a request stopped by its text has computed one more token, unseen."""
    prompt = list(range(40, 60))

    def run(async_output_proc: bool, stop: list[str]) -> tuple[list[int], list, LLMEngine]:
        config = EngineConfig.from_kwargs(model=str(tiny_chat_model), async_output_proc=async_output_proc)
        engine = LLMEngine(config)
        assert engine.core.overlaps_outputs is async_output_proc
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1, stop=stop)
        engine.add_request(prompt, params, request_id="r")
        counts, outputs = [], []
        while engine.has_unfinished_requests():
            step_outputs = engine.step()
            counts.append(len(step_outputs))
            outputs += step_outputs
        return counts, outputs, engine

    counts, outputs, _ = run(True, [])
    assert counts == [0] + [1] * 10, "each call reads the step before; the last reads the last step, launching none"
    sync_counts, sync_outputs, _ = run(False, [])
    assert sync_counts == [1] * 10
    assert [(o.outputs[0].text, o.outputs[0].logprobs) for o in outputs] == [
        (o.outputs[0].text, o.outputs[0].logprobs) for o in sync_outputs
    ]
    stop = [outputs[-1].outputs[0].text[3:5]]
    _, stopped, engine = run(True, stop)
    _, sync_stopped, sync_engine = run(False, stop)
    last, sync_last = stopped[-1].outputs[0], sync_stopped[-1].outputs[0]
    assert (last.text, last.token_ids, last.stop_reason) == (sync_last.text, sync_last.token_ids, sync_last.stop_reason)
    assert last.finish_reason == "stop" and len(last.token_ids) < 10
    assert engine.stats().computed_tokens == sync_engine.stats().computed_tokens + 1
    assert engine.stats().kv_blocks_in_use == 0 and not engine.has_unfinished_requests()


def test_async_output_processing_is_on_for_accelerators_and_off_on_a_cpu_unless_asked():
    from tokenloom.config import SchedulerConfig

    assert SchedulerConfig().overlaps_output_processing("cuda")
    assert not SchedulerConfig().overlaps_output_processing("cpu")
    assert SchedulerConfig(async_output_proc=True).overlaps_output_processing("cpu")
    assert not SchedulerConfig(async_output_proc=False).overlaps_output_processing("cuda")


def test_streams_through_the_async_front_with_async_output_processing(tiny_llama, solo_reference):
    """The server's front over an engine whose outputs are read a step late: every stream gets the tokens of a solo
    run, one stream left after its third output is aborted, and no KV block is left behind."""
    config = EngineConfig.from_kwargs(model=str(tiny_llama), max_num_seqs=4, async_output_proc=True)
    front = AsyncEngine(LLMEngine(config))
    front.start()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def run() -> tuple[list[list[int]], int]:
        streams = [await front.submit(p["prompt_token_ids"], params, f"r{i}") for i, p in enumerate(prompts(10))]
        left = streams.pop()
        seen = 0
        async for _ in left:
            seen += 1
            if seen == 3:
                break
        await left.aclose()  # as a client hanging up

        async def last(stream) -> list[int]:
            final = None
            async for output in stream:
                final = output
            return final.outputs[0].token_ids

        return await asyncio.gather(*(last(s) for s in streams)), seen

    try:
        # No wait needed after: the abort is applied before the engine's next step, and a request's blocks are freed
        # in the step that finishes it, before its last output is delivered.
        tokens, seen = asyncio.run(run())
    finally:
        front.shutdown()
    assert tokens == solo_reference[:9] and seen == 3
    assert front.stats().kv_blocks_in_use == 0 and front.stats().num_running == 0


@pytest.mark.parametrize("kind", ["CUMULATIVE", "DELTA"])
def test_a_reader_that_falls_behind_holds_one_output_and_catches_up_in_one_read(tiny_llama, kind):
    """A stream read only after its request has finished (a client reading slowly) holds one output, not one per
    step: the last cumulative one, or the deltas merged; either carries every token and the text of a reader that
    kept up, and the request's blocks are freed."""
    from tokenloom import RequestOutputKind

    front = AsyncEngine(LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama), dtype="float32")))
    front.start()
    params = SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, logprobs=1, output_kind=RequestOutputKind[kind]
    )
    prompt = prompts(1)[0]["prompt_token_ids"]

    async def run() -> tuple[list, list]:
        kept_up = [output async for output in await front.submit(prompt, params, "kept-up")]
        behind = await front.submit(prompt, params, "behind")
        while front.stats().generated_tokens < 32 or front.stats().num_running:  # it runs to the end unread
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # its last output is on its way to the loop
        return kept_up, [output async for output in behind]

    try:
        kept_up, behind = asyncio.run(run())
    finally:
        front.shutdown()
    # The reader that kept up may itself have read some steps' outputs merged (the tiny model's steps are quick).
    assert 1 <= len(kept_up) <= 16 and len(behind) == 1 and behind[0].finished
    got = behind[0].outputs[0]
    if kind == "DELTA":
        expected_ids = [t for o in kept_up for t in o.outputs[0].token_ids]
        expected_text = "".join(o.outputs[0].text for o in kept_up)
    else:
        expected_ids, expected_text = kept_up[-1].outputs[0].token_ids, kept_up[-1].outputs[0].text
    assert (got.token_ids, got.text, len(got.logprobs)) == (expected_ids, expected_text, 16)
    assert len(expected_ids) == 16
    assert front.stats().kv_blocks_in_use == 0


def test_a_streams_unread_deltas_are_joined_as_they_come_and_read_as_one_then_the_error():
    """DELTA outputs that find the one before unread are joined to it (each at its own length's cost); the reader
    gets one output holding them all, then an error that came after, and a later read starts afresh."""
    from tokenloom.engine.request_stream import OutputQueue
    from tokenloom.outputs import CompletionOutput, RequestMetrics, RequestOutput

    def delta(i: int) -> RequestOutput:
        metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.0, first_token_time=0.0, finished_time=None)
        return RequestOutput("r", None, [1], [CompletionOutput(0, f"<{i}>", [i], None)], False, metrics)

    async def run() -> list:
        stream = OutputQueue(asyncio.get_running_loop(), delta=True)
        for i in range(1000):
            stream.put(delta(i))
        stream.put(RuntimeError("cut"))
        stream.put(delta(1000))  # after an error: never read
        first, second = await stream.get(), await stream.get()
        stream.put(delta(1001))
        return [first, second, await stream.get()]

    joined, error, later = asyncio.run(run())
    assert joined.outputs[0].token_ids == list(range(1000))
    assert joined.outputs[0].text == "".join(f"<{i}>" for i in range(1000))
    assert isinstance(error, RuntimeError) and later.outputs[0].token_ids == [1001]


def test_a_stream_wakes_its_reader_for_the_first_output_then_every_n_new_tokens_and_at_the_end():
    """With wake_every=3 (a stream interval) the reader gets the first output at once, then nothing until three new
    tokens are in (a step's several tokens count as several), joined; the last output and an error wake it at once.
    wake_every=None (a reader that wants the whole response) is woken only by the first output (an n > 1 request's
    other choices wait for it), the last, or an error."""
    from tokenloom.engine.request_stream import OutputQueue
    from tokenloom.outputs import CompletionOutput, RequestMetrics, RequestOutput

    def delta(*ids: int, finished: bool = False) -> RequestOutput:
        metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.0, first_token_time=0.0, finished_time=None)
        text = "".join(f"<{i}>" for i in ids)
        return RequestOutput("r", None, [1], [CompletionOutput(0, text, list(ids), None)], finished, metrics)

    async def woken(stream: OutputQueue, *outputs: RequestOutput) -> RequestOutput | None:
        """Puts the outputs one by one under a waiting reader: what it read, or None if it is still waiting."""
        reader = asyncio.create_task(stream.get())
        for output in outputs:
            stream.put(output)
            for _ in range(3):
                await asyncio.sleep(0)
        if reader.done():
            return reader.result()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        return None

    async def run() -> tuple[list, list]:
        every_three = OutputQueue(asyncio.get_running_loop(), delta=True, wake_every=3)
        reads = [
            await woken(every_three, delta(0)),  # the first output: at once
            await woken(every_three, delta(1), delta(2)),  # two new tokens: still waiting, and kept
            await woken(every_three, delta(3)),  # the third: all three, joined
            await woken(every_three, delta(4, 5, 6, 7)),  # one step's four tokens
            await woken(every_three, delta(8, finished=True)),  # the last: at once
        ]
        whole = OutputQueue(asyncio.get_running_loop(), delta=True, wake_every=None)
        wholes = [
            await woken(whole, delta(0)),
            await woken(whole, delta(1), delta(2, 3, 4)),
            await woken(whole, delta(5, finished=True)),
        ]
        cut = OutputQueue(asyncio.get_running_loop(), delta=True, wake_every=None)
        cut.put(delta(0))
        await cut.get()
        cut.put(delta(1))
        wholes.append(await woken(cut, RuntimeError("cut")))
        return reads, wholes

    reads, wholes = asyncio.run(run())
    assert [None if r is None else r.outputs[0].token_ids for r in reads] == [[0], None, [1, 2, 3], [4, 5, 6, 7], [8]]
    assert reads[2].outputs[0].text == "<1><2><3>" and reads[4].finished
    assert wholes[0].outputs[0].token_ids == [0] and wholes[1] is None
    assert wholes[2].outputs[0].token_ids == [1, 2, 3, 4, 5] and wholes[2].finished
    assert wholes[3].outputs[0].token_ids == [1]  # what came before the error is read first, then the error


@pytest.mark.parametrize("overlap", ["async_output_proc", "async_scheduling"])
def test_a_request_ended_at_a_stop_token_has_the_tokens_of_a_synchronous_engine(tiny_llama, overlap):
    """Stop token ids and max_tokens end a request at the same token as without overlap, also where the next step
    was scheduled ahead of the stop (its token computed for nothing, and dropped)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = LLM(str(tiny_llama)).generate(prompts(6, seed=3), params, use_tqdm=False)
    # Each prompt's stop token: one from the middle of its own greedy output.
    stops = [
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[o.outputs[0].token_ids[5]]) for o in reference
    ]
    expected = LLM(str(tiny_llama)).generate(prompts(6, seed=3), stops, use_tqdm=False)
    llm = LLM(str(tiny_llama), **{overlap: True})
    got = llm.generate(prompts(6, seed=3), stops, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].stop_reason) for o in got] == [
        (o.outputs[0].token_ids, o.outputs[0].stop_reason) for o in expected
    ]
    assert all(o.outputs[0].finish_reason == "stop" and len(o.outputs[0].token_ids) <= 6 for o in got)
    stats = llm.stats()
    assert stats.generated_tokens == sum(len(o.outputs[0].token_ids) for o in got)
    assert stats.kv_blocks_in_use == 0 and stats.num_running == 0


def test_async_scheduling_shares_decoded_blocks_through_the_prefix_cache(tiny_llama):
    """Blocks filled by decoded tokens are cached once their tokens are read (never while one is a placeholder):
    a later prompt made of an earlier request's prompt and output hits them as without asynchronous scheduling."""
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    first = list(range(10, 23))

    def run(**config) -> tuple[list[list[int]], int]:
        llm = LLM(str(tiny_llama), block_size=4, **config)
        out = llm.generate({"prompt_token_ids": first}, params, use_tqdm=False)[0].outputs[0].token_ids
        again = llm.generate({"prompt_token_ids": first + out + [7]}, params, use_tqdm=False)[0]
        return [out, again.outputs[0].token_ids], again.metrics.num_cached_tokens

    expected, expected_hits = run()
    got, hits = run(async_scheduling=True)
    assert got == expected and hits == expected_hits == 24  # 13 + 14 - 1 computed tokens: 6 full blocks


@pytest.mark.parametrize("pressure", [{}, UNDER_PRESSURE], ids=["roomy", "preempted"])
def test_async_scheduling_counts_penalties_on_the_device_and_keeps_scheduling_ahead(tiny_llama, pressure):
    """A request with penalties counts its last token where a step scheduled ahead left it, on the device (the
    step's input): steps go on being scheduled ahead while it lives, and every request gets the tokens a synchronous
    engine gives it, through preemptions too."""
    penalties = [{}, {"repetition_penalty": 1.3}, {"presence_penalty": 0.8, "frequency_penalty": 0.4},
                 {"frequency_penalty": -0.6, "repetition_penalty": 0.8}]  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **p) for p in penalties]
    batch = prompts(8, seed=5)
    expected = token_ids(LLM(str(tiny_llama), **pressure).generate(batch, params * 2, use_tqdm=False))
    plain = token_ids(LLM(str(tiny_llama), **pressure).generate(batch, params[0], use_tqdm=False))
    assert sum(e != p for e, p in zip(expected, plain, strict=True)) >= 4, "the penalties change what is sampled"
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama), async_scheduling=True, **pressure))
    for i, (prompt, p) in enumerate(zip(batch, params * 2, strict=True)):
        engine.add_request(prompt["prompt_token_ids"], p, request_id=str(i))
    finished, ahead = {}, []
    while engine.has_unfinished_requests():
        ahead.append(engine.core._may_schedule_ahead())
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert [finished[str(i)] for i in range(8)] == expected
    assert all(ahead), "scheduled ahead while penalized requests live"
    assert len(engine.core.runner._seen) == 0, "the penalized requests' token counts went with them"
    if pressure:
        assert engine.stats().num_preemptions > 0


def test_async_scheduling_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="does not speculate"):
        EngineConfig.from_kwargs(async_scheduling=True, speculative_config={"method": "suffix"})
    with pytest.raises(ValueError, match="one rank"):
        EngineConfig.from_kwargs(async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="needs async_output_proc"):
        EngineConfig.from_kwargs(async_scheduling=True, async_output_proc=False)
    assert EngineConfig.from_kwargs(async_scheduling=True).scheduler.overlaps_output_processing("cpu")
