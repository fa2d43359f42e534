"""From symptoms to the constraint: the seeds' troubleshooting rules applied to a server's metrics or a bench run.

Each rule reads a window of a server's life (two /metrics snapshots, or a bench run's scorecard), and a finding
names the evidence behind it and the flag to change.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from tokenloom.metrics_text import histogram_quantile, parse

TTFT_TARGET_S = 2.0
LONG_PROMPT_TOKENS = 1000


@dataclass
class Finding:
    rule: str
    severity: str  # "info", "warning" or "critical"
    evidence: dict[str, Any]
    action: str


@dataclass
class Window:
    """What happened between two moments of a server, in the units the rules reason in."""

    seconds: float
    waiting_before: float
    waiting_after: float
    running: float
    kv_usage: float
    preemptions: float
    iteration_tokens: float
    prompt_tokens: float
    finished_requests: float
    ttft_p95: float | None
    queue_p95: float | None
    e2e_p95: float | None
    error_rate: float | None = None
    max_num_seqs: int | None = None
    recompute_preemptions: float = 0.0  # of the preemptions, those whose KV was dropped to be computed again
    kv_cache: dict[str, Any] | None = None  # /version's kv_cache: its dtype, tokens, and tokens in 8 bits
    spec_draft_tokens: float = 0.0  # speculative decoding: draft tokens verified, and of them accepted
    spec_accepted_tokens: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def _value(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def window_from_metrics(
    before: dict[str, float], after: dict[str, float], seconds: float, config=None, kv_cache=None
) -> Window:
    def delta(name: str) -> float:
        return _value(after, name) - _value(before, name)

    return Window(
        seconds=seconds,
        waiting_before=_value(before, "tokenloom:num_requests_waiting"),
        waiting_after=_value(after, "tokenloom:num_requests_waiting"),
        running=_value(after, "tokenloom:num_requests_running"),
        kv_usage=_value(after, "tokenloom:kv_cache_usage_perc"),
        preemptions=delta("tokenloom:num_preemptions_total"),
        recompute_preemptions=delta('tokenloom:num_preemptions_total{mode="recompute"}'),
        iteration_tokens=delta("tokenloom:iteration_tokens_total_sum"),
        prompt_tokens=delta("tokenloom:prompt_tokens_total"),
        finished_requests=delta("tokenloom:request_success_total"),
        ttft_p95=histogram_quantile(before, after, "time_to_first_token_seconds", 0.95),
        queue_p95=histogram_quantile(before, after, "request_queue_time_seconds", 0.95),
        e2e_p95=histogram_quantile(before, after, "e2e_request_latency_seconds", 0.95),
        max_num_seqs=(config or {}).get("max_num_seqs"),
        kv_cache=kv_cache,
        spec_draft_tokens=delta("tokenloom:spec_decode_num_draft_tokens_total"),
        spec_accepted_tokens=delta("tokenloom:spec_decode_num_accepted_tokens_total"),
    )


def window_from_run(run: dict[str, Any]) -> Window:
    card = run["scorecard"]
    records = run.get("records", [])
    server = (run.get("provenance") or {}).get("server_version") or {}
    config = server.get("engine_config") or {}
    rate = card.get("spec_decode_acceptance_rate")
    return Window(
        seconds=0.0,
        waiting_before=0.0,
        waiting_after=0.0,
        running=0.0,
        kv_usage=0.0,
        preemptions=card.get("preemptions") or 0.0,
        iteration_tokens=1.0,
        prompt_tokens=0.0,
        finished_requests=float(len(records)),
        ttft_p95=card.get("ttft_p95_s"),
        queue_p95=card.get("queue_time_p95_s"),
        e2e_p95=card.get("e2e_p95_s"),
        error_rate=card.get("error_rate"),
        max_num_seqs=config.get("max_num_seqs"),
        kv_cache=server.get("kv_cache"),
        # The run's acceptance rate, as accepted tokens per one draft token (the rules read only the rate).
        spec_draft_tokens=0.0 if rate is None else 1.0,
        spec_accepted_tokens=rate or 0.0,
    )


def diagnose(w: Window) -> list[Finding]:
    findings = [f for rule in RULES if (f := rule(w)) is not None]
    if not findings:
        evidence = {
            "running": w.running,
            "waiting": w.waiting_after,
            "kv_usage": w.kv_usage,
            "ttft_p95_s": w.ttft_p95,
            "preemptions": w.preemptions,
        }
        findings.append(Finding("healthy", "info", evidence, "no constraint found; nothing to change"))
    return findings


def waiting_while_kv_has_room(w: Window) -> Finding | None:
    if w.waiting_after <= 0 or w.waiting_after < w.waiting_before or w.kv_usage >= 0.8 or w.iteration_tokens <= 0:
        return None
    evidence = {
        "waiting_before": w.waiting_before,
        "waiting_after": w.waiting_after,
        "running": w.running,
        "max_num_seqs": w.max_num_seqs,
        "kv_usage": round(w.kv_usage, 3),
    }
    if w.max_num_seqs is not None and w.running >= w.max_num_seqs:
        action = f"running is at the sequence cap ({w.max_num_seqs}) while KV has room: raise --max-num-seqs"
    else:
        action = (
            "requests wait although KV has room: check admission limits (--max-num-queued-requests, "
            "tenant caps), CPU-side tokenisation, and the clients' own concurrency"
        )
    return Finding("waiting_while_kv_has_room", "warning", evidence, action)


def long_prefill_ttft(w: Window) -> Finding | None:
    if w.ttft_p95 is None or w.ttft_p95 <= TTFT_TARGET_S:
        return None
    per_request = w.prompt_tokens / w.finished_requests if w.finished_requests else 0.0
    if w.seconds and per_request < LONG_PROMPT_TOKENS:
        return None
    evidence: dict[str, Any] = {"ttft_p95_s": round(w.ttft_p95, 3)}
    if w.seconds:  # known from a server's metrics, not from a bench run
        evidence["prompt_tokens_per_request"] = round(per_request, 1)
    action = (
        "long prompts hold back first tokens: keep chunked prefill on, tune --max-num-batched-tokens "
        "(larger for TTFT, smaller for ITL), or send prefill-heavy traffic to its own pool"
    )
    return Finding("long_prefill_ttft", "warning", evidence, action)


def queueing_dominates_latency(w: Window) -> Finding | None:
    if w.queue_p95 is None or w.e2e_p95 is None or w.queue_p95 <= 1.0 or w.queue_p95 <= 0.5 * w.e2e_p95:
        return None
    evidence = {"queue_time_p95_s": round(w.queue_p95, 3), "e2e_p95_s": round(w.e2e_p95, 3)}
    action = (
        "most of the tail latency is waiting: throughput is being bought with p95; limit admission "
        "(--max-num-queued-requests), set --queue-timeout, or separate pools"
    )
    return Finding("queueing_dominates_latency", "warning", evidence, action)


def kv_pressure(w: Window) -> Finding | None:
    if w.preemptions <= 0 and w.kv_usage < 0.9:
        return None
    evidence: dict[str, Any] = {"preemptions": w.preemptions, "kv_usage": round(w.kv_usage, 3)}
    action = (
        "KV cache at its limit: lower --max-num-seqs or --max-model-len, give it more memory "
        "(--kv-cache-memory / --num-kv-blocks), or a smaller KV dtype"
    )
    kv = w.kv_cache or {}
    if kv.get("tokens_with_8_bit", 0) > kv.get("num_tokens", 0):
        evidence.update(kv_cache_dtype=kv.get("dtype"), kv_tokens=kv["num_tokens"])
        action += (
            f"; --kv-cache-dtype int8 holds {kv['tokens_with_8_bit']:,} tokens in the same memory instead of "
            f"{kv['num_tokens']:,}"
        )
    if w.recompute_preemptions > 0:
        action += "; --preemption-mode swap keeps a preempted request's KV in host memory instead of recomputing it"
    return Finding("kv_pressure", "critical" if w.preemptions > 0 else "warning", evidence, action)


def idle_while_waiting(w: Window) -> Finding | None:
    if w.waiting_after <= 0 or w.iteration_tokens > 0:
        return None
    evidence = {"waiting": w.waiting_after, "iteration_tokens": w.iteration_tokens, "seconds": w.seconds}
    action = (
        "the engine computed nothing while requests waited: look outside the scheduler — CPU taken by "
        "other processes, network, storage, model loading, client throttling"
    )
    return Finding("idle_while_waiting", "critical", evidence, action)


POOR_ACCEPTANCE = 0.25


def speculation_rarely_accepted(w: Window) -> Finding | None:
    """Draft tokens cost a step's time whether accepted or not; few accepted means the traffic does not repeat
    its context (n-gram lookup) or earlier outputs (suffix)."""
    if w.spec_draft_tokens <= 0:
        return None
    rate = w.spec_accepted_tokens / w.spec_draft_tokens
    if rate >= POOR_ACCEPTANCE:
        return None
    action = (
        f"only {rate:.0%} of draft tokens were accepted: lower num_speculative_tokens in --speculative-config, "
        "try the other method (suffix for repeated agent traffic, ngram for text that quotes its prompt), or "
        "serve without speculation"
    )
    return Finding("speculation_rarely_accepted", "warning", {"acceptance_rate": round(rate, 3)}, action)


def errors(w: Window) -> Finding | None:
    if w.error_rate is None or w.error_rate <= 0.01:
        return None
    return Finding(
        "errors",
        "critical",
        {"error_rate": round(w.error_rate, 4)},
        "requests failed: read the run's records for their status codes (429: limits; 400: input)",
    )


RULES = [
    waiting_while_kv_has_room,
    long_prefill_ttft,
    queueing_dominates_latency,
    kv_pressure,
    idle_while_waiting,
    speculation_rarely_accepted,
    errors,
]


def add_diagnose_command(commands) -> None:
    parser = commands.add_parser("diagnose", help="name the constraint behind bad numbers")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", help="a running tokenloom server")
    source.add_argument("--run", help="a RUN.json written by tokenloom bench serve")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between the two metric reads")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--json", action="store_true")


def run_diagnose(args) -> int:
    if args.run:
        with open(args.run) as f:
            window = window_from_run(json.load(f))
    else:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        with httpx.Client(base_url=args.url, headers=headers, timeout=10) as client:
            before = parse(client.get("/metrics").text)
            time.sleep(args.interval)  # the window the rules read; the user chose its length
            after = parse(client.get("/metrics").text)
            version = client.get("/version")
            described = version.json() if version.status_code == 200 else {}
        window = window_from_metrics(
            before, after, args.interval, described.get("engine_config"), described.get("kv_cache")
        )
    findings = diagnose(window)
    if args.json:
        print(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        for finding in findings:
            print(f"[{finding.severity}] {finding.rule}: {finding.action}")
            print("    evidence: " + ", ".join(f"{k}={v}" for k, v in finding.evidence.items()))
    return 0
