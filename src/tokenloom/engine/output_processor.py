"""Turns the core's token ids into what callers read: text, stop strings, logprobs, ``RequestOutput``s.

The core (core.py) never sees text; this side never sees the scheduler. A stop string is found here, in the
detokenized text, and the engine then asks the core to finish that request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tokenloom.engine.core_outputs import EngineCoreOutput
from tokenloom.engine.detokenizer import IncrementalDetokenizer
from tokenloom.model.loader import Tokenizer
from tokenloom.model.sampler import SampledToken
from tokenloom.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenloom.sampling_params import RequestOutputKind, SamplingParams


class RequestEnding(Protocol):
    """How an engine ends a request that its output side decided to end; each returns the ended request's output."""

    def stopped(self, output: EngineCoreOutput, stop: str) -> EngineCoreOutput:
        """The request's text completed a stop string."""
        ...

    def failed(self, output: EngineCoreOutput, error: Exception) -> EngineCoreOutput:
        """Its output could not be built; it fails alone (finish_reason "error")."""
        ...


@dataclass
class RequestState:
    """What the output side keeps of a request: its prompt, its tokens and text so far, its logprobs."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None  # a DELTA request's: only those not sent yet
    output_token_ids: list[int]
    stop_text: str | None = None  # the text up to a stop string, once one is found
    # Characters of text made while the output was no longer than min_tokens: a stop string must end after them
    # (vLLM's: none is looked for until then, and one that ended before is not found later).
    stops_end_after: int = 0
    cumulative_logprob: float = 0.0  # of the tokens in logprobs, summed as they come (not over all at every step)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # once the core sends them
    metrics: RequestMetrics | None = None  # the last the core sent (with the first output and the last)
    # Of a DELTA request: the tokens and the characters of text its outputs have carried so far.
    sent_tokens: int = 0
    sent_text: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, RequestState] = {}

    def new_state(self, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams) -> RequestState:
        """A request's state, made on any thread before the request is queued."""
        logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        return RequestState(prompt, prompt_token_ids, params, detokenizer, logprobs, [])

    def add(self, request_id: str, state: RequestState) -> None:
        self._states[request_id] = state

    def absorb(self, output: EngineCoreOutput) -> str | None:
        """Takes a step's new tokens into the request's text and logprobs; returns a stop string if one completed."""
        state = self._states[output.request_id]
        if output.prompt_logprobs is not None:
            state.prompt_logprobs = [None, *(_logprob_entry(token) for token in output.prompt_logprobs)]
        # Token by token: a step may bring several (speculative decoding), and a stop string completed by one of
        # them ends the request there, its later tokens dropped, as if they had come one step at a time.
        for token in output.new_tokens:
            state.output_token_ids.append(token.token_id)
            state.detokenizer.add(token.token_id)
            if state.logprobs is not None and token.logprob is not None:
                entry = _logprob_entry(token)
                state.logprobs.append(entry)
                state.cumulative_logprob += entry[token.token_id].logprob
            if not output.finished and state.params.stop:
                if len(state.output_token_ids) <= state.params.min_tokens:
                    state.stops_end_after = len(state.detokenizer.pieces)
                    continue
                stop = self._completed_stop(state)
                if stop is not None:
                    return stop
        return None

    def process(self, output: EngineCoreOutput, ending: RequestEnding) -> RequestOutput | None:
        """The one output path, for the in-process engine and the core process alike: the step's tokens into text
        and logprobs; a completed stop string ends the request as stopped, and a failure here (detokenizing,
        matching stops, building the output) fails it alone, each through the engine's ``ending``.

        None where the caller takes only the request's final output (RequestOutputKind.FINAL_ONLY) and this is not
        it: its tokens are absorbed, no RequestOutput is built."""
        try:
            self._take_metrics(output)
            stop = None if output.error is not None else self.absorb(output)
            if stop is not None:
                output = ending.stopped(output, stop)
            kind = self._states[output.request_id].params.output_kind
            if not output.finished and kind is RequestOutputKind.FINAL_ONLY:
                return None
            return self._output(output)
        except Exception as error:
            return self.make_output(ending.failed(output, error))

    def make_output(self, output: EngineCoreOutput) -> RequestOutput:
        """The request's RequestOutput after this core output (one that did not come through ``process``: an
        abort's, a failure's); a finished request's state is dropped."""
        self._take_metrics(output)
        return self._output(output)

    def _output(self, output: EngineCoreOutput) -> RequestOutput:
        result = self._built(self._states[output.request_id], output)
        if output.finished:
            del self._states[output.request_id]
        return result

    def _take_metrics(self, output: EngineCoreOutput) -> None:
        if output.metrics is not None:
            self._states[output.request_id].metrics = output.metrics

    def metrics_of(self, request_id: str) -> RequestMetrics | None:
        """The last metrics the core sent for a request (None: none yet, or the request is not here)."""
        state = self._states.get(request_id)
        return None if state is None else state.metrics

    def _built(self, state: RequestState, output: EngineCoreOutput) -> RequestOutput:
        metrics = state.metrics
        assert metrics is not None, "a request's first output carries its metrics"
        delta = state.params.output_kind is RequestOutputKind.DELTA
        first_token = state.sent_tokens if delta else 0  # the first token (and logprob) this output carries
        token_ids = state.output_token_ids[first_token:]  # a copy either way: the state goes on growing
        pooled = state.params.pooling is not None  # an embedding request's output is its vector: its token is dropped
        if pooled:
            token_ids = []
        if output.error is not None:
            completion = CompletionOutput(0, "", token_ids, finish_reason=output.finish_reason)
            return RequestOutput(
                output.request_id, None, state.prompt_token_ids, [completion], True, metrics, error=output.error
            )
        logprobs, prompt_logprobs = state.logprobs, state.prompt_logprobs
        if delta:
            # The text shown so far only grows (held-back characters are shown later or cut at a stop string).
            text = self._text_since(state, state.sent_text, output.finished)
            state.sent_text += len(text)
            state.sent_tokens = len(state.output_token_ids)
            if logprobs is not None:  # what went out is the output's now: the state keeps only what is to come
                state.logprobs = []
            state.prompt_logprobs = None  # sent with the first output (a stream's hold every logprob no longer)
        else:
            text = self._text_since(state, 0, output.finished)
        text = "" if pooled else text
        cumulative = None if state.logprobs is None else state.cumulative_logprob
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=cumulative,
        )
        return RequestOutput(
            request_id=output.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=output.finished,
            metrics=metrics,
            prompt_logprobs=prompt_logprobs,
            embedding=output.embedding,
        )

    def _text_since(self, state: RequestState, start: int, finished: bool) -> str:
        """The request's text shown from character `start` on: at its end, the whole reply's; before, the text so
        far less what may begin a stop string. Read from the tail, so a DELTA output costs its own length."""
        if state.stop_text is not None:
            return state.stop_text[start:]
        pieces = state.detokenizer.pieces
        if finished:
            # A reply cut inside a multi-byte character ends without its partial bytes, as vLLM's, instead of in
            # U+FFFD (the incremental text never ends in one unless the model wrote one).
            text = self.decode(state.output_token_ids, state.params.skip_special_tokens)
            whole = text if pieces.between(len(pieces) - 1).endswith("\ufffd") else text.rstrip("\ufffd")
            return whole[start:]
        # While a stop string may still complete, hold back the characters it could start with (text that a stop
        # string would not cut, where it stays in the output, is shown at once).
        held = 0 if state.params.include_stop_str_in_output else max((len(s) - 1 for s in state.params.stop), default=0)
        return pieces.between(start, len(pieces) - held)

    @staticmethod
    def _completed_stop(state: RequestState) -> str | None:
        pieces = state.detokenizer.pieces
        stops = state.params.stop
        # Only the tail can hold a new match: the last token's text plus the longest stop string.
        tail_start = max(0, len(pieces) - 2 * max(len(stop) for stop in stops) - 16)
        tail = pieces.between(tail_start)
        # A match ending by stops_end_after does not count: each stop string is looked for from the first place
        # where it would end after them.
        found = [(tail.find(stop, max(0, state.stops_end_after - tail_start - len(stop) + 1)), stop) for stop in stops]
        hits = [(index, stop) for index, stop in found if index >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        end = tail_start + index + (len(stop) if state.params.include_stop_str_in_output else 0)
        state.stop_text = pieces.between(0, end)
        return stop

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))


def _logprob_entry(token: SampledToken) -> dict[int, Logprob]:
    """A token's logprob and its top alternatives (ranked from 1), keyed by token id."""
    entry = {tid: Logprob(lp, rank=rank + 1) for rank, (tid, lp) in enumerate(token.top_logprobs or [])}
    if token.token_id not in entry:
        entry[token.token_id] = Logprob(token.logprob if token.logprob is not None else float("nan"))
    return entry
