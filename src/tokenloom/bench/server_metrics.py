"""Reads a server's Prometheus /metrics (tokenloom's or vLLM's names) for what a client cannot see."""

from __future__ import annotations

import re

import httpx

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")
PREFIXES = ("tokenloom:", "vllm:")


def parse(text: str) -> dict[str, float]:
    """'name{labels}' -> value, for every sample line."""
    samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


def scrape(client: httpx.Client, base_url: str, headers: dict[str, str]) -> dict[str, float] | None:
    try:
        response = client.get(f"{base_url}/metrics", headers=headers, timeout=5)
    except httpx.HTTPError:
        return None
    return parse(response.text) if response.status_code == 200 else None


def _find(samples: dict[str, float], suffix: str) -> float | None:
    for prefix in PREFIXES:
        total = [v for k, v in samples.items() if k == prefix + suffix or k.startswith(prefix + suffix + "{")]
        if total:
            return sum(total)
    return None


def histogram_quantile(before: dict[str, float], after: dict[str, float], name: str, q: float) -> float | None:
    """The q-quantile (0-1) of observations made between two scrapes, from cumulative bucket counts."""
    for prefix in PREFIXES:
        key = f"{prefix}{name}_bucket"
        by_bound: dict[float, float] = {}  # summed over the other labels: every replica behind Ray Serve
        for sample, value in after.items():
            if sample.startswith(key + "{"):
                match = re.search(r'le="([^"]+)"', sample)
                if match is not None:
                    bound = float(match.group(1))
                    by_bound[bound] = by_bound.get(bound, 0.0) + value - before.get(sample, 0.0)
        if not by_bound:
            continue
        buckets = sorted(by_bound.items())
        total = buckets[-1][1]
        if total <= 0:
            return None
        target, previous_bound, previous_count = q * total, 0.0, 0.0
        for bound, count in buckets:
            if count >= target:
                if math_isinf(bound):
                    return previous_bound
                share = (target - previous_count) / (count - previous_count) if count > previous_count else 1.0
                return previous_bound + (bound - previous_bound) * share
            previous_bound, previous_count = bound, count
    return None


def math_isinf(x: float) -> bool:
    return x == float("inf")


PROCESS_TREE = "process tree"  # the server and every process it started
API_PROCESS_ONLY = "api process only"  # the process that answers /metrics; a foreign server's engine not counted


def server_figures(before: dict | None, after: dict | None, samples: list[dict]) -> dict[str, float | str | None]:
    if not before or not after:
        return {
            "queue_time_p95_s": None, "preemptions": None, "memory_high_water_bytes": None, "memory_scope": None,
            "prefix_cache_hit_rate": None, **_speculation({}, {}),
        }  # fmt: skip
    preempt_before, preempt_after = _find(before, "num_preemptions_total"), _find(after, "num_preemptions_total")
    return {
        "queue_time_p95_s": histogram_quantile(before, after, "request_queue_time_seconds", 0.95),
        "preemptions": None if preempt_after is None else preempt_after - (preempt_before or 0.0),
        "memory_high_water_bytes": _memory_high_water([before, *samples, after]),
        "memory_scope": _memory_scope(after),
        "prefix_cache_hit_rate": _prefix_cache_hit_rate(before, after),
        **_speculation(before, after),
    }


def _speculation(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Speculative decoding over the run (vLLM's counters): accepted draft tokens over drafted ones, and the
    tokens a verified draft run yields on average (its accepted drafts and one more); None where none ran."""

    def delta(name: str) -> float:
        return (_find(after, name) or 0.0) - (_find(before, name) or 0.0)

    drafts, tokens = delta("spec_decode_num_drafts_total"), delta("spec_decode_num_draft_tokens_total")
    accepted = delta("spec_decode_num_accepted_tokens_total")
    return {
        "spec_decode_acceptance_rate": accepted / tokens if tokens > 0 else None,
        "spec_decode_mean_acceptance_length": 1 + accepted / drafts if drafts > 0 else None,
    }


def _memory_scope(scrape: dict[str, float]) -> str | None:
    if _find(scrape, "process_tree_resident_memory_bytes") is not None:
        return PROCESS_TREE
    return API_PROCESS_ONLY if scrape.get("process_resident_memory_bytes") is not None else None


def _memory_high_water(scrapes: list[dict[str, float]]) -> float | None:
    """The largest resident memory seen: of the whole process tree where the server reports it (tokenloom, its core
    process included), else of the process that answers /metrics (for vLLM: the API server alone)."""
    readings = [_find(s, "process_tree_resident_memory_bytes") for s in scrapes]
    if all(r is None for r in readings):
        readings = [s.get("process_resident_memory_bytes") for s in scrapes]
    memory = [r for r in readings if r is not None]
    return max(memory) if memory else None


def _prefix_cache_hit_rate(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The share of prompt tokens looked up in the prefix cache during the run that were found there."""
    queries = (_find(after, "prefix_cache_queries_total") or 0.0) - (_find(before, "prefix_cache_queries_total") or 0.0)
    hits = (_find(after, "prefix_cache_hits_total") or 0.0) - (_find(before, "prefix_cache_hits_total") or 0.0)
    return hits / queries if queries > 0 else None
