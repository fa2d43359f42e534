"""What the API process and the engine core process say to each other: one frozen dataclass per message kind.

    API -> core   AddRequest | AbortRequest | FinishRequest | FailRequest | SetTenantWeights | WatchQueue | Shutdown
    core -> API   CoreReady | CoreReport | CoreFailed

They travel pickled over ZeroMQ (core_process.py); a receiver dispatches on the type (``match``), never on a
string or a tuple position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tokenloom.core.request import Request, RequestLimits
from tokenloom.engine.core_outputs import EngineCoreOutput, EngineStats, QueueState

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


@dataclass(frozen=True)
class CoreFailed:
    """The core raised and is exiting: its traceback."""

    traceback: str


CoreReply = CoreReady | CoreReport | CoreFailed
