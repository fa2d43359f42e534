"""The engine core in its own process (float32 given: the spawned core does not see conftest's dtype patch):
the same tokens through both processes, and a dead core fails requests
in flight with errors (never a hang) and makes /ready say 503."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
from pathlib import Path

import httpx
import openai
import pytest
from helpers import collect
from server_process import ServerProcess

from tokenloom import LLM, SamplingParams
from tokenloom.config import EngineConfig
from tokenloom.engine.async_engine import AsyncEngine, ErrorReason, RequestError
from tokenloom.engine.core_messages import CoreReport
from tokenloom.engine.core_outputs import EngineCoreOutput, EngineStats, QueueState
from tokenloom.engine.core_process import CoreProcessEngine
from tokenloom.model.sampler import SampledToken
from tokenloom.outputs import RequestMetrics
from tokenloom.server.launch import ENGINE_DIED_EXIT_CODE

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 60)), [3] * 17]


def core_pid(parent: int) -> int:
    """The core process among the parent's children (multiprocessing's resource tracker is the other)."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return int(pid)
    raise AssertionError(f"no core process among {children}")


def test_tokens_through_the_core_process_equal_the_in_process_engine(tiny_llama, caplog):
    in_process = LLM(str(tiny_llama))
    expected = [
        o.outputs[0].token_ids
        for o in in_process.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
    ]
    with caplog.at_level("INFO", logger="tokenloom.engine.core_process"):
        front = AsyncEngine(CoreProcessEngine(EngineConfig.from_kwargs(model=str(tiny_llama), dtype="float32")))
    front.start()
    try:
        # What the weights hold, measured in the core's process, reaches the API process and its start-up line.
        assert front.engine.weight_bytes == in_process.engine.weight_bytes > 0
        assert f"weights {front.engine.weight_bytes / 2**20:.1f} MiB" in caplog.text

        async def all_at_once() -> list[list[int]]:
            return await asyncio.gather(*(collect(front, p, f"r{i}") for i, p in enumerate(PROMPTS)))

        assert asyncio.run(all_at_once()) == expected
        stats = front.stats()
        assert stats.generated_tokens == 24 and stats.kv_blocks_in_use == 0
    finally:
        front.shutdown()
    assert not front.engine.healthy


def test_the_offline_llm_with_its_core_in_a_process_gives_the_same_outputs(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    expected = LLM(str(tiny_llama), dtype="float32").generate(prompts, params, use_tqdm=False)
    with LLM(str(tiny_llama), dtype="float32", core_process=True) as llm:
        assert isinstance(llm.engine, CoreProcessEngine)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.stats().generated_tokens == 24
    for got, want in zip(outputs, expected, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].text == want.outputs[0].text and got.outputs[0].finish_reason == "length"
        got_logprobs, want_logprobs = got.outputs[0].logprobs, want.outputs[0].logprobs
        assert got_logprobs is not None and want_logprobs is not None
        for entry, wanted in zip(got_logprobs, want_logprobs, strict=True):  # the batches formed may differ
            assert {t: (e.rank, pytest.approx(e.logprob, abs=1e-4)) for t, e in entry.items()} == {
                t: (e.rank, e.logprob) for t, e in wanted.items()
            }
        assert got.metrics.first_token_time is not None and got.metrics.finished_time is not None
    assert not llm.engine.healthy  # shut down with the block


def test_a_report_travels_with_its_plain_outputs_as_columns_and_comes_back_whole():
    plain = [EngineCoreOutput(f"r{i}", [SampledToken(i), SampledToken(i + 1)], None, None, None) for i in range(6)]
    metrics = RequestMetrics(1.0, 2.0, 3.0, None)
    others = [
        EngineCoreOutput("first", [SampledToken(7)], None, None, metrics),
        EngineCoreOutput("ended", [], "length", None, metrics),
        EngineCoreOutput("logprobs", [SampledToken(3, -0.5, [(3, -0.5)])], None, None, None),
        EngineCoreOutput("failed", [], "error", None, metrics, error="RuntimeError: boom"),
    ]
    outputs = [others[0], *plain[:2], others[1], others[2], *plain[2:], others[3]]
    report = CoreReport(outputs, EngineStats.empty(8), QueueState(1, 2), [("w", 0.5)])
    request_ids, token_ids, kept, *_ = report.__reduce__()[1]
    assert request_ids == [o.request_id for o in plain] and token_ids == [[i, i + 1] for i in range(6)]
    assert [output for _, output in kept] == others  # only what says more than its tokens goes as objects
    assert pickle.loads(pickle.dumps(report, protocol=5)) == report
    assert pickle.loads(pickle.dumps(CoreReport([], EngineStats.empty(8), QueueState(0, 0)))).outputs == []


def test_a_killed_core_fails_the_requests_in_flight_and_refuses_new_ones(tiny_llama):
    front = AsyncEngine(
        CoreProcessEngine(EngineConfig.from_kwargs(model=str(tiny_llama), dtype="float32", max_num_seqs=2))
    )
    front.start()
    try:

        async def killed_mid_stream() -> None:
            params = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
            stream = await front.submit(PROMPTS[0], params, "doomed")
            first = await anext(stream)
            assert first.outputs[0].token_ids
            os.kill(core_pid(os.getpid()), signal.SIGKILL)
            with pytest.raises(RequestError) as failure:
                async with asyncio.timeout(30):
                    async for _ in stream:
                        pass
            assert failure.value.reason is ErrorReason.ENGINE_ERROR

        asyncio.run(killed_mid_stream())
        assert not front.healthy
        with pytest.raises(RequestError) as refused:
            asyncio.run(collect(front, PROMPTS[1], "late"))
        assert refused.value.reason is ErrorReason.ENGINE_UNAVAILABLE
    finally:
        front.shutdown()


def test_a_server_streams_through_the_core_process_and_is_not_ready_once_it_dies(tiny_chat_model):
    with ServerProcess("--model", str(tiny_chat_model), "--served-model-name", "tiny-chat", "--core-process") as server:
        assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        stream = client.completions.create(
            model="tiny-chat", prompt="Hello there", max_tokens=5, temperature=0, stream=True
        )
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        whole = client.completions.create(model="tiny-chat", prompt="Hello there", max_tokens=5, temperature=0)
        assert text == whole.choices[0].text and whole.usage.completion_tokens == 5
        # The memory the bench reports is the whole tree's: the core process holds the weights.
        tree = server.metric("tokenloom:process_tree_resident_memory_bytes")
        assert tree > server.metric("process_resident_memory_bytes") + 10 * 2**20
        stream = client.completions.create(
            model="tiny-chat", prompt="Hello there", max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
        )
        assert next(iter(stream)).choices[0].text is not None
        os.kill(core_pid(server.process.pid), signal.SIGKILL)
        with pytest.raises(openai.APIError, match="engine"):  # the stream in flight hears why it ends
            for _ in stream:
                pass
        # The server exits non-zero, as vLLM's does, so that its supervisor restarts it.
        assert server.process.wait(timeout=20) == ENGINE_DIED_EXIT_CODE
