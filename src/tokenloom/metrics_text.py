"""Prometheus text exposition, read: samples by name and labels, sums by family, and histogram quantiles between
two scrapes. Below the server, the diagnosis and the bench, which all read /metrics (tokenloom's or vLLM's names).
"""

from __future__ import annotations

import math
import re

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


def find(samples: dict[str, float], suffix: str) -> float | None:
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
                if math.isinf(bound):
                    return previous_bound
                share = (target - previous_count) / (count - previous_count) if count > previous_count else 1.0
                return previous_bound + (bound - previous_bound) * share
            previous_bound, previous_count = bound, count
    return None
