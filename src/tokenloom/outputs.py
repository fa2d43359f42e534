"""What a finished request gives back: its text, tokens, reason for stopping, and its timings."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error", or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: the chosen one and the top alternatives
    cumulative_logprob: float | None = None


@dataclass
class RequestMetrics:
    """Wall-clock moments (time.monotonic) of a request's life, and what it cost the scheduler."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0
    num_cached_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # why the request failed, when its finish_reason is "error"
    # Per prompt token (None for the first, which nothing predicts) when asked for: the token and the top ones.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    embedding: list[float] | None = None  # an embedding request's vector (LLM.embed), with its last output


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` gives for each prompt, as vLLM's: ``output.outputs.embedding``."""

    request_id: str
    prompt_token_ids: list[int]
    finished: bool
    outputs: EmbeddingOutput

    @classmethod
    def of(cls, output: RequestOutput) -> EmbeddingRequestOutput:
        if output.embedding is None:
            raise RuntimeError(f"embedding request {output.request_id} failed: {output.error}")
        return cls(output.request_id, output.prompt_token_ids, output.finished, EmbeddingOutput(output.embedding))


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """What ``LLM.score`` gives for each pair, as vLLM's with an embedding model: ``output.outputs.score``, the cosine
    similarity of the two texts' embeddings; the request id and tokens are the pair's, joined."""

    request_id: str
    prompt_token_ids: list[int]
    finished: bool
    outputs: ScoringOutput


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """What ``LLM.classify`` gives for each prompt, as vLLM's: ``output.outputs.probs``, the classifier's."""

    request_id: str
    prompt_token_ids: list[int]
    finished: bool
    outputs: ClassificationOutput


class JoinedDeltas:
    """A request's DELTA outputs joined into the one output that holds them all (the cumulative one), each added at
    the cost of its own length: text, token ids and logprobs joined, the rest the last's."""

    def __init__(self) -> None:
        self._texts: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[dict[int, Logprob]] | None = []  # None once an output came without them
        self._prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self._last: RequestOutput | None = None

    def add(self, output: RequestOutput) -> None:
        completion = output.outputs[0]
        self._texts.append(completion.text)
        self._token_ids.extend(completion.token_ids)
        if completion.logprobs is None:
            self._logprobs = None
        elif self._logprobs is not None:
            self._logprobs.extend(completion.logprobs)
        self._prompt_logprobs = self._prompt_logprobs or output.prompt_logprobs
        self._last = output

    def output(self) -> RequestOutput:
        last = self._last
        assert last is not None, "at least one output was added"
        logprobs = None if self._logprobs is None else self._logprobs[:]  # copies: more outputs may be added
        joined = replace(last.outputs[0], text="".join(self._texts), token_ids=self._token_ids[:], logprobs=logprobs)
        return replace(last, outputs=[joined], prompt_logprobs=self._prompt_logprobs)
