"""What the API process and the engine core process say to each other: one frozen dataclass per message kind.

    API -> core   AddRequest | AbortRequest | FinishRequest | FailRequest | SetTenantWeights | WatchQueue | Shutdown
    core -> API   CoreReady | CoreReport | CoreFailed

They travel pickled over ZeroMQ (core_process.py); a receiver dispatches on the type (``match``), never on a
string or a tuple position.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenloom.core.request import Request, RequestLimits
from tokenloom.engine.core_outputs import EngineCoreOutput, EngineStats, QueueState
from tokenloom.model.sampler import SampledToken

QueueWalk = Literal["backlog", "never_scheduled"]  # walks over the core's queue that cost a step only once asked


@dataclass(frozen=True)
class AddRequest:
    request: Request


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class FinishRequest:
    """The API side found a stop string: the core ends the request as stopped."""

    request_id: str
    stop: str


@dataclass(frozen=True)
class FailRequest:
    """The API side could not turn the request's tokens into output: the core ends it as failed."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class SetTenantWeights:
    """The fair policy's share per tenant (tenant weights, not model weights)."""

    weights: dict[str, float]


@dataclass(frozen=True)
class WatchQueue:
    """From now on, report this walk over the queue with every step."""

    walk: QueueWalk


@dataclass(frozen=True)
class Shutdown:
    pass


CoreRequest = AddRequest | AbortRequest | FinishRequest | FailRequest | SetTenantWeights | WatchQueue | Shutdown


@dataclass(frozen=True)
class CoreInfo:
    """What the core tells the API process once it is ready."""

    max_model_len: int
    request_limits: RequestLimits
    compiled: bool
    quantization: str | None  # core_setup.served_quantization's choice
    weight_bytes: int  # what the served weights hold (model/footprint.py), this rank's


@dataclass(frozen=True)
class CoreReady:
    info: CoreInfo


@dataclass
class CoreReport:
    """One message from the core: what a step (or the requests ended since the last one) produced, and gauges."""

    outputs: list[EngineCoreOutput]
    stats: EngineStats
    queue: QueueState
    never_scheduled: list[tuple[str, float]] = field(default_factory=list)  # (request id, arrival time)

    def __reduce__(self) -> tuple[Callable[..., CoreReport], tuple[Any, ...]]:
        """Pickled with its plain outputs (new token ids and nothing else: most of a step's) as two columns, request
        ids and token ids, rebuilt on the receiving side: pickling each as objects cost the core ~5 us an output, a
        share of a decode step that a GPU would wait through (benchmarks/host_overhead.py --core-loop)."""
        request_ids, token_ids, others = [], [], []
        for position, output in enumerate(self.outputs):
            if _is_plain(output):
                request_ids.append(output.request_id)
                token_ids.append([token.token_id for token in output.new_tokens])
            else:
                others.append((position, output))
        return _report_from_columns, (request_ids, token_ids, others, self.stats, self.queue, self.never_scheduled)


def _is_plain(output: EngineCoreOutput) -> bool:
    """An output that says only which tokens its request got."""
    return (
        output.metrics is None
        and output.finish_reason is None
        and output.stop_reason is None
        and output.error is None
        and output.prompt_logprobs is None
        and output.embedding is None
        and all(token.logprob is None and token.top_logprobs is None for token in output.new_tokens)
    )


def _report_from_columns(
    request_ids: list[str],
    token_ids: list[list[int]],
    others: list[tuple[int, EngineCoreOutput]],
    stats: EngineStats,
    queue: QueueState,
    never_scheduled: list[tuple[str, float]],
) -> CoreReport:
    plain = iter(
        EngineCoreOutput(request_id, [SampledToken(token) for token in tokens], None, None, None)
        for request_id, tokens in zip(request_ids, token_ids, strict=True)
    )
    outputs: list[EngineCoreOutput] = []
    for position, output in others:  # each other output back at its place among the plain ones
        outputs.extend(itertools.islice(plain, position - len(outputs)))
        outputs.append(output)
    outputs.extend(plain)
    return CoreReport(outputs, stats, queue, never_scheduled)


@dataclass(frozen=True)
class CoreFailed:
    """The core raised and is exiting: its traceback."""

    traceback: str


CoreReply = CoreReady | CoreReport | CoreFailed
