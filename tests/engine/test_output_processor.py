"""The output side's memory of a request: a DELTA request (a stream, as the server asks) keeps none of the logprobs
it has sent, and what it sends adds up to what a CUMULATIVE request holds at its end."""

from __future__ import annotations

from tokenloom import RequestOutputKind, SamplingParams
from tokenloom.engine.core_outputs import EngineCoreOutput
from tokenloom.engine.output_processor import OutputProcessor
from tokenloom.model.sampler import SampledToken
from tokenloom.outputs import RequestMetrics

METRICS = RequestMetrics(arrival_time=0.0, first_scheduled_time=None, first_token_time=None, finished_time=None)


class NoEnding:
    def stopped(self, output, stop):
        raise AssertionError("no stop string here")

    def failed(self, output, error):
        raise error


def steps() -> list[EngineCoreOutput]:
    """Five steps of two tokens each, every token with its logprob and two alternatives; the first with the prompt's."""
    outputs = []
    for step in range(5):
        tokens = [SampledToken(10 * step + i, -0.5 * i, [(10 * step + i, -0.5 * i), (99, -3.0)]) for i in range(2)]
        last = step == 4
        prompt = [SampledToken(7, -1.0, [(7, -1.0)])] if step == 0 else None
        outputs.append(EngineCoreOutput("r", tokens, "length" if last else None, None,
                                        METRICS if step in (0, 4) else None, prompt_logprobs=prompt))  # fmt: skip
    return outputs


def run(kind: RequestOutputKind):
    processor = OutputProcessor(None)
    params = SamplingParams(max_tokens=10, logprobs=2, prompt_logprobs=1, output_kind=kind)
    state = processor.new_state(None, [5, 7], params)
    processor.add("r", state)
    results, held = [], []
    for output in steps():
        results.append(processor.process(output, NoEnding()))
        held.append(len(state.logprobs))
    return results, held, state


def test_a_delta_request_keeps_none_of_the_logprobs_it_has_sent():
    deltas, held, state = run(RequestOutputKind.DELTA)
    assert held == [0, 0, 0, 0, 0] and state.prompt_logprobs is None  # nothing kept once sent
    assert [len(o.outputs[0].logprobs) for o in deltas] == [2, 2, 2, 2, 2]
    assert deltas[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in deltas[1:])
    cumulative, held_whole, _ = run(RequestOutputKind.CUMULATIVE)
    assert held_whole == [2, 4, 6, 8, 10]  # a cumulative request's outputs carry them all: it keeps them
    assert [lp for o in deltas for lp in o.outputs[0].logprobs] == cumulative[-1].outputs[0].logprobs
    assert deltas[-1].outputs[0].cumulative_logprob == cumulative[-1].outputs[0].cumulative_logprob
    assert deltas[0].prompt_logprobs == cumulative[-1].prompt_logprobs
