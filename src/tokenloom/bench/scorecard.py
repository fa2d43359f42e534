"""Per-request records and the scorecard row the seeds lay out, with goodput and cost per accepted response."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SCORECARD_KEYS = (
    "offered_req_s",
    "completed_req_s",
    "output_tok_s",
    "ttft_p50_s",
    "ttft_p95_s",
    "itl_p50_s",
    "itl_p95_s",
    "e2e_p95_s",
    "queue_time_p95_s",
    "error_rate",
    "preemptions",
    "memory_high_water_bytes",
    "prefix_cache_hit_rate",
    "goodput_req_s",
    "cost_per_1k_accepted",
)
SCORECARD_NOTES = ("memory_scope",)  # what a figure covers, beside the figures
# Figures only some runs have (None otherwise): speculative decoding's, from the server's counters.
SCORECARD_SPECULATION = ("spec_decode_acceptance_rate", "spec_decode_mean_acceptance_length")


@dataclass
class RequestRecord:
    id: str
    start: float  # seconds since the run began
    status: int = 0  # HTTP status; 0 if the connection failed
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    token_gaps: list[float] = field(default_factory=list)  # inter-token latencies
    cancelled: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class SLO:
    ttft: float | None = None
    itl: float | None = None
    e2e: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> SLO:
        """'ttft=2,itl=0.2,e2e=30' in seconds."""
        slo = cls()
        for part in filter(None, (text or "").split(",")):
            name, _, value = part.partition("=")
            if name.strip() not in ("ttft", "itl", "e2e"):
                raise ValueError(f"unknown SLO {name!r}; use ttft, itl, e2e")
            setattr(slo, name.strip(), float(value))
        return slo

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok or record.cancelled:
            return False
        if self.ttft is not None and (record.ttft is None or record.ttft > self.ttft):
            return False
        gap_p95 = percentile(record.token_gaps, 95) if record.token_gaps else None
        if self.itl is not None and gap_p95 is not None and gap_p95 > self.itl:
            return False
        return not (self.e2e is not None and (record.e2e is None or record.e2e > self.e2e))


def scorecard(
    records: list[RequestRecord],
    duration: float,
    offered_req_s: float,
    slo: SLO,
    server: dict[str, float | str | None] | None = None,
    cost_per_hour: float | None = None,
) -> dict[str, float | str | None]:
    """One row: throughput, latency percentiles, errors, goodput and cost. Cancelled requests are not errors."""
    server = server or {}
    done = [r for r in records if r.ok and not r.cancelled]
    errors = [r for r in records if not r.ok]
    accepted = [r for r in records if slo.met_by(r)]
    gaps = [g for r in records if r.ok for g in r.token_gaps]
    cost = None
    if cost_per_hour is not None and accepted:
        cost = cost_per_hour * duration / 3600 / len(accepted) * 1000
    return {
        "offered_req_s": offered_req_s,
        "completed_req_s": len(done) / duration if duration > 0 else 0.0,
        "output_tok_s": sum(r.output_tokens for r in records if r.ok) / duration if duration > 0 else 0.0,
        "ttft_p50_s": percentile([r.ttft for r in done if r.ttft is not None], 50),
        "ttft_p95_s": percentile([r.ttft for r in done if r.ttft is not None], 95),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p95_s": percentile(gaps, 95),
        "e2e_p95_s": percentile([r.e2e for r in done if r.e2e is not None], 95),
        "queue_time_p95_s": server.get("queue_time_p95_s"),
        "error_rate": len(errors) / len(records) if records else 0.0,
        "preemptions": server.get("preemptions"),
        "memory_high_water_bytes": server.get("memory_high_water_bytes"),
        "memory_scope": server.get("memory_scope"),  # what that memory covers (server_metrics)
        "prefix_cache_hit_rate": server.get("prefix_cache_hit_rate"),
        "goodput_req_s": len(accepted) / duration if duration > 0 else 0.0,
        "cost_per_1k_accepted": cost,
        **{key: server.get(key) for key in SCORECARD_SPECULATION},
    }
