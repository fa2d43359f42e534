"""Fault injection in the engine: a request whose sampling or detokenization raises is failed alone.

The others' outputs equal a run without it, no KV block or swap slot leaks, and the async front delivers the
failure to that request's stream only.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from tokenloom import SamplingParams
from tokenloom.config import EngineConfig
from tokenloom.engine.async_engine import AsyncEngine, ErrorReason, RequestError
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.model.sampler import Sampler

VOCAB = 512
# A pool small enough that these requests preempt each other (and swap, in swap mode).
UNDER_PRESSURE = dict(max_num_seqs=6, max_num_batched_tokens=32, num_kv_blocks=14, block_size=8)


class PoisonedSampler:
    """The engine's sampler, except that any batch holding the poisoned request's settings raises once that request
    has sampled `after_tokens` tokens (each batch that holds it samples one)."""

    def __init__(self, sampler: Sampler, poisoned: SamplingParams, after_tokens: int) -> None:
        self.sampler, self.poisoned, self.after_tokens = sampler, poisoned, after_tokens
        self.sampled = 0  # by the poisoned request

    def sample(self, logits, batch):
        if any(params is self.poisoned for params in batch.params):
            if self.sampled >= self.after_tokens:
                raise RuntimeError("injected sampling fault")
            self.sampled += 1
        return self.sampler.sample(logits, batch)


class FailingDetokenizer:
    def __init__(self, after_tokens: int) -> None:
        self.after_tokens, self.count, self.text = after_tokens, 0, ""

    def add(self, token_id: int) -> str:
        self.count += 1
        if self.count > self.after_tokens:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return ""


def workload(seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    items = []
    for i in range(6):
        prompt = [rng.randrange(VOCAB - 1) for _ in range(rng.randint(5, 40))]
        seeded = i % 2 == 1  # half sample with their own seed: their draws must not shift either
        params = SamplingParams(
            temperature=0.8 if seeded else 0.0, seed=100 + i if seeded else None, max_tokens=14, ignore_eos=True
        )
        items.append((prompt, params))
    return items


def run(engine: LLMEngine, items, extra=()) -> dict[str, list[int] | str]:
    """Runs everything to the end; returns each request's tokens, or "error: ..." for a failed one."""
    for i, (prompt, params) in enumerate(items):
        engine.add_request(prompt, params, request_id=f"r{i}")
    for request_id, prompt, params, inject in extra:
        engine.add_request(prompt, params, request_id=request_id)
        inject(engine, request_id)
    results: dict[str, list[int] | str] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = (
                    f"error: {output.error}" if output.error else list(output.outputs[0].token_ids)
                )
    return results


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("fault", ["sampling", "detokenizer", "both"])
def test_a_failing_request_is_failed_alone(tiny_llama, preemption_mode, fault):
    config = EngineConfig.from_kwargs(
        model=str(tiny_llama), preemption_mode=preemption_mode, num_swap_blocks=64, **UNDER_PRESSURE
    )
    items = workload()
    clean = run(LLMEngine(config), items)

    engine = LLMEngine(config)
    poisoned = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    engine.core.runner.sampler = PoisonedSampler(engine.core.runner.sampler, poisoned, after_tokens=3)
    extra = []
    if fault in ("sampling", "both"):
        extra.append(("bad-sampling", [7, 8, 9] * 5, poisoned, lambda e, rid: None))
    if fault in ("detokenizer", "both"):

        def break_detokenizer(engine: LLMEngine, request_id: str) -> None:
            engine.processor._states[request_id].detokenizer = FailingDetokenizer(after_tokens=5)

        extra.append(("bad-detok", [11, 12, 13] * 6, SamplingParams(max_tokens=14, ignore_eos=True), break_detokenizer))
    results = run(engine, items, extra)

    for request_id, *_ in extra:
        assert str(results.pop(request_id)).startswith("error: "), request_id
    assert results == clean
    stats = engine.stats()
    assert stats.kv_blocks_in_use == 0 and stats.swap_blocks_in_use == 0 and stats.num_swapped == 0
    assert stats.num_preemptions > 0  # the faults happened under pressure, with preemptions going on
    engine.core.scheduler.check_invariants()
    assert len(engine.core.runner._generators) == 0  # no per-request generator outlives its request


def test_the_async_front_fails_only_that_stream(tiny_llama):
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama), max_num_seqs=8))
    poisoned = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.core.runner.sampler = PoisonedSampler(engine.core.runner.sampler, poisoned, after_tokens=2)
    front = AsyncEngine(engine)
    front.start()
    good = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    async def consume(prompt: list[int], params: SamplingParams, request_id: str):
        last = None
        try:
            async for output in await front.submit(prompt, params, request_id):
                last = output
        except RequestError as error:
            return error
        return last.outputs[0].token_ids

    async def main():
        return await asyncio.gather(
            consume([1, 2, 3], good, "a"), consume([4, 5, 6], poisoned, "bad"), consume([7, 8, 9], good, "b")
        )

    try:
        a, bad, b = asyncio.run(main())
    finally:
        front.shutdown()
    assert isinstance(bad, RequestError) and bad.reason is ErrorReason.REQUEST_FAILED and "injected" in bad.message
    assert len(a) == len(b) == 10
    assert engine.stats().kv_blocks_in_use == 0
