"""Reads a server's Prometheus /metrics (tokenloom's or vLLM's names) for what a client cannot see."""

from __future__ import annotations

import httpx

from tokenloom.metrics_text import PREFIXES, find, histogram_quantile, parse

__all__ = ["PREFIXES", "histogram_quantile", "parse", "scrape", "server_figures"]


def scrape(client: httpx.Client, base_url: str, headers: dict[str, str]) -> dict[str, float] | None:
    try:
        response = client.get(f"{base_url}/metrics", headers=headers, timeout=5)
    except httpx.HTTPError:
        return None
    return parse(response.text) if response.status_code == 200 else None


PROCESS_TREE = "process tree"  # the server and every process it started
API_PROCESS_ONLY = "api process only"  # the process that answers /metrics; a foreign server's engine not counted


def server_figures(before: dict | None, after: dict | None, samples: list[dict]) -> dict[str, float | str | None]:
    if not before or not after:
        return {
            "queue_time_p95_s": None, "preemptions": None, "memory_high_water_bytes": None, "memory_scope": None,
            "prefix_cache_hit_rate": None, **_speculation({}, {}),
        }  # fmt: skip
    preempt_before, preempt_after = find(before, "num_preemptions_total"), find(after, "num_preemptions_total")
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
        return (find(after, name) or 0.0) - (find(before, name) or 0.0)

    drafts, tokens = delta("spec_decode_num_drafts_total"), delta("spec_decode_num_draft_tokens_total")
    accepted = delta("spec_decode_num_accepted_tokens_total")
    return {
        "spec_decode_acceptance_rate": accepted / tokens if tokens > 0 else None,
        "spec_decode_mean_acceptance_length": 1 + accepted / drafts if drafts > 0 else None,
    }


def _memory_scope(scrape: dict[str, float]) -> str | None:
    if find(scrape, "process_tree_resident_memory_bytes") is not None:
        return PROCESS_TREE
    return API_PROCESS_ONLY if scrape.get("process_resident_memory_bytes") is not None else None


def _memory_high_water(scrapes: list[dict[str, float]]) -> float | None:
    """The largest resident memory seen: of the whole process tree where the server reports it (tokenloom, its core
    process included), else of the process that answers /metrics (for vLLM: the API server alone)."""
    readings = [find(s, "process_tree_resident_memory_bytes") for s in scrapes]
    if all(r is None for r in readings):
        readings = [s.get("process_resident_memory_bytes") for s in scrapes]
    memory = [r for r in readings if r is not None]
    return max(memory) if memory else None


def _prefix_cache_hit_rate(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The share of prompt tokens looked up in the prefix cache during the run that were found there."""
    queries = (find(after, "prefix_cache_queries_total") or 0.0) - (find(before, "prefix_cache_queries_total") or 0.0)
    hits = (find(after, "prefix_cache_hits_total") or 0.0) - (find(before, "prefix_cache_hits_total") or 0.0)
    return hits / queries if queries > 0 else None
