"""The engine core's face: token ids in, EngineCoreOutputs (new tokens, finish reasons, StepStats) out."""

from __future__ import annotations

import pytest
import torch

from tokenloom.config import EngineConfig
from tokenloom.core.request import Request, RequestStatus
from tokenloom.engine.core import EngineCore
from tokenloom.model.loader import load_model
from tokenloom.sampling_params import SamplingParams


@pytest.fixture
def core(tiny_llama) -> EngineCore:
    loaded = load_model(str(tiny_llama), None, torch.float32, torch.device("cpu"))
    config = EngineConfig.from_kwargs(model=str(tiny_llama), num_kv_blocks=32, block_size=8, max_num_batched_tokens=64)
    return EngineCore(config, loaded, torch.float32, torch.device("cpu"))


def request(request_id: str, length: int, max_tokens: int = 3) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, list(range(1, length + 1)), params)


def test_a_step_reports_new_tokens_and_its_token_counts(core):
    core.add_request(request("a", 5))
    core.add_request(request("b", 9))
    first = core.step()
    assert first.step is not None
    assert (first.step.num_prefill_tokens, first.step.num_decode_tokens) == (14, 0)
    assert {o.request_id: len(o.new_tokens) for o in first.outputs} == {"a": 1, "b": 1}
    assert not any(o.finished for o in first.outputs)
    second = core.step()
    assert second.step is not None and (second.step.num_prefill_tokens, second.step.num_decode_tokens) == (0, 2)
    third = core.step()
    assert {o.request_id: o.finish_reason for o in third.outputs} == {"a": "length", "b": "length"}
    assert all(o.metrics is not None and o.metrics.finished_time is not None for o in third.outputs)
    assert core.step().step is None and not core.has_unfinished_requests()
    stats = core.stats()
    assert stats.generated_tokens == 6 and stats.prompt_tokens == 14 and stats.kv_blocks_in_use == 0


def test_metrics_go_with_a_requests_first_output_and_its_last(core):
    core.add_request(request("a", 5, max_tokens=4))
    core.add_request(request("b", 5, max_tokens=40))
    steps = [core.step().outputs for _ in range(4)]
    with_metrics = [[o.request_id for o in outputs if o.metrics is not None] for outputs in steps]
    assert with_metrics == [["a", "b"], [], [], ["a"]]  # first tokens; nothing new; a finished at its 4th token
    first = steps[0][0].metrics
    assert first is not None and first.first_token_time is not None and first.finished_time is None
    aborted = core.abort("b")
    assert aborted is not None and aborted.metrics is not None and aborted.metrics.finished_time is not None
    assert not core._reported, "an ended request leaves nothing behind"


def test_abort_finish_and_fail_end_a_request_and_free_its_blocks(core):
    for name in ("aborted", "stopped", "failed"):
        core.add_request(request(name, 20, max_tokens=50))
    core.step()
    assert core.stats().kv_blocks_in_use > 0
    aborted = core.abort("aborted")
    assert aborted is not None and aborted.finish_reason == "abort"
    assert core.abort("aborted") is None  # already gone
    stopped = core.finish("stopped", RequestStatus.FINISHED_STOPPED, "\n\n")
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", "\n\n")
    failed = core.fail("failed", RuntimeError("boom"))
    assert failed.finish_reason == "error" and failed.error == "RuntimeError: boom"
    assert not core.has_unfinished_requests() and core.stats().kv_blocks_in_use == 0


def test_queue_views_for_admission_and_timeouts(core):
    core.add_request(request("early", 40))
    late = request("late", 30)
    late.arrival_time += 100.0
    core.add_request(late)
    state = core.queue_state(count_backlog=True)
    assert (state.num_waiting, state.backlog_tokens) == (2, 70)
    assert core.queue_state(count_backlog=False).backlog_tokens == 0  # no walk over the queue unless asked
    assert core.never_scheduled_since(late.arrival_time) == ["early"]
    core.step()  # the budget of 64 takes "early" whole and the start of "late"
    assert core.never_scheduled_since(late.arrival_time + 1) == []
    assert sorted(core.request_ids()) == ["early", "late"]
