"""A request admitted through the async front never runs on without a reader.

Each test holds the front's engine lock, so no step runs until the request's abort is queued: the request is
aborted before it computes a token, whatever the machine's speed. Its final output says "abort", no KV block is
held afterwards and the front keeps no stream for it.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

from tokenloom import SamplingParams
from tokenloom.config import EngineConfig
from tokenloom.engine.async_engine import AsyncEngine
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.outputs import RequestOutput

LONG = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)  # a request that would run for 100 steps


async def until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.fixture
def front(tiny_llama):
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama), max_num_seqs=4))
    finals: dict[str, RequestOutput] = {}

    def keep_finals(outputs: list[RequestOutput]) -> None:
        finals.update((output.request_id, output) for output in outputs if output.finished)

    front = AsyncEngine(engine, on_step=keep_finals)
    front.finals = finals  # type: ignore[attr-defined]
    front.start()
    yield front
    front.shutdown()


async def aborted_unread(front: AsyncEngine, request_id: str) -> None:
    """Once the test lets go of the engine lock: the request ended by its abort, with no token, and left nothing."""
    await until(lambda: request_id in front.finals)
    final = front.finals[request_id]
    assert final.outputs[0].finish_reason == "abort"
    assert final.outputs[0].token_ids == []
    await until(lambda: not front.engine.has_unfinished_requests())
    assert front.stats().kv_blocks_in_use == 0
    assert front._streams == {}


def test_a_stream_closed_before_it_is_read_aborts_its_request(front):
    async def main():
        with front._lock:  # no step runs until the stream is closed
            stream = await front.submit([1, 2, 3], LONG, "closed")
            await stream.aclose()
        await aborted_unread(front, "closed")

    asyncio.run(main())


def test_a_stream_dropped_before_it_is_read_aborts_its_request(front):
    async def main():
        with front._lock:
            stream = await front.submit([1, 2, 3], LONG, "dropped")
            del stream
            gc.collect()
        await aborted_unread(front, "dropped")

    asyncio.run(main())


def test_a_submit_cancelled_while_its_request_is_added_aborts_it_once_in(front, monkeypatch):
    """A hang-up while the request is validated and queued on a worker thread: the thread still adds it."""
    entered, release = threading.Event(), threading.Event()
    prepare = front.engine.prepare_request

    def slow_prepare(*args, **kwargs):
        entered.set()
        release.wait(timeout=30)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(front.engine, "prepare_request", slow_prepare)

    async def main():
        with front._lock:
            submitting = asyncio.create_task(front.submit([1, 2, 3], LONG, "hung-up"))
            await until(entered.is_set)
            submitting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await submitting
            release.set()
            await until(lambda: not front._aborts.empty())  # the add ended on its thread, and its abort is queued
        await aborted_unread(front, "hung-up")

    asyncio.run(main())


def test_a_stream_read_to_its_end_is_let_go(front):
    async def main():
        stream = await front.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), "read")
        outputs = [output async for output in stream]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4
        await stream.aclose()  # after the end: nothing to abort
        assert front._streams == {}
        assert front._aborts.empty()

    asyncio.run(main())


def test_a_reader_cancelled_while_it_waits_aborts_its_request(front):
    """A hang-up while the response waits for the next output: the request ends then, not when (or if) the stream
    is collected, which a traceback holding it can put off (the test keeps it referenced)."""

    async def main():
        with front._lock:
            stream = await front.submit([1, 2, 3], LONG, "waiting")
            reader = asyncio.create_task(anext(stream))
            await until(lambda: front._streams["waiting"]._ready._waiters)  # the reader waits for an output
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
            assert not front._aborts.empty()
        await aborted_unread(front, "waiting")
        return stream

    assert asyncio.run(main()) is not None
