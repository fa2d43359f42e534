"""The async front's queue limits and drain refuse a client's request once: the engine requests that go on with
one already admitted (an n > 1 request's later choices, a beam search's later steps) pass them."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tokenloom import SamplingParams
from tokenloom.config import EngineConfig
from tokenloom.engine.async_engine import AsyncEngine, ErrorReason, RequestError
from tokenloom.engine.llm_engine import LLMEngine

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture
def front(tiny_llama):
    front = AsyncEngine(LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama))), max_num_queued_requests=1)
    front.start()
    yield front
    front.shutdown()


async def tokens(stream) -> list[int]:
    outputs = [output async for output in stream]
    return outputs[-1].outputs[0].token_ids


def test_a_continuing_request_passes_a_full_queue_and_a_drain(front):
    async def main():
        with front._lock:  # nothing leaves the queue until the test lets go
            first = await front.submit([1, 2, 3], PARAMS, "first")
            with pytest.raises(RequestError) as refused:
                await front.submit([4, 5, 6], PARAMS, "another")
            assert refused.value.reason is ErrorReason.QUEUE_FULL
            later_choice = await front.submit([1, 2, 3], PARAMS, "first-choice-1", continues=True)
            front.begin_drain(timeout=60)
            with pytest.raises(RequestError) as draining:
                await front.submit([4, 5, 6], PARAMS, "after-drain")
            assert draining.value.reason is ErrorReason.SERVER_DRAINING
            later_step = await front.submit([1, 2, 3, 7], PARAMS, "first-step-1", continues=True)
        return await asyncio.gather(tokens(first), tokens(later_choice), tokens(later_step))

    first, later_choice, later_step = asyncio.run(main())
    assert first == later_choice and len(first) == len(later_step) == 4
    assert front.stats().kv_blocks_in_use == 0


def test_requests_taken_into_the_engine_count_as_waiting_until_the_step_counts_them(tiny_llama):
    """The loop takes a submitted request into the engine, then steps, then counts the queue: a request submitted
    while the step runs must see the one taken in (it once saw the count from before, and passed a full queue)."""
    front = AsyncEngine(LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama))), max_num_queued_requests=1)
    in_step, go_on = threading.Event(), threading.Event()
    step = front.engine.step

    def held_step():
        in_step.set()
        go_on.wait(timeout=60)
        return step()

    front.engine.step = held_step  # type: ignore[method-assign]
    front.start()

    async def main():
        first = await front.submit([1, 2, 3], PARAMS, "first")
        assert await asyncio.to_thread(in_step.wait, 60)  # taken in, the step under way, the queue not yet counted
        with pytest.raises(RequestError) as refused:
            await front.submit([4, 5, 6], PARAMS, "second")
        assert refused.value.reason is ErrorReason.QUEUE_FULL
        go_on.set()
        return await tokens(first)

    try:
        assert len(asyncio.run(main())) == 4
    finally:
        go_on.set()
        front.shutdown()
