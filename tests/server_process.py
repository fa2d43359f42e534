"""Test helpers over LocalServer: read /metrics samples, and poll them with a deadline."""

from __future__ import annotations

import time

import httpx

from tokenloom.bench.local_server import LocalServer

POLL_INTERVAL_S = 0.05  # between reads of /metrics while waiting, always under a deadline

# 24 blocks of 16 hold 384 tokens: two requests that grow to ~295 tokens each cannot run together.
TINY_KV_POOL_ARGS = ("--max-num-seqs", "4", "--num-kv-blocks", "24", "--block-size", "16", "--max-model-len", "300")


class ServerProcess(LocalServer):
    """A test server: float32 unless the test gives --dtype, since the tests' oracles are float32."""

    def __init__(self, *args: str, **kwargs) -> None:
        super().__init__(*args, *(() if "--dtype" in args else ("--dtype", "float32")), **kwargs)

    def metric(self, name: str, headers: dict[str, str] | None = None) -> float:
        """The value of a sample of /metrics, summed over the labels not given: `name` or `name{label="value",...}`."""
        text = httpx.get(f"{self.url}/metrics", headers=headers, timeout=10).text
        base, _, wanted = name.partition("{")
        pairs = [p for p in wanted.rstrip("}").split(",") if p]
        total, found = 0.0, False
        for line in text.splitlines():
            if not (line.startswith(base + " ") or line.startswith(base + "{")):
                continue
            labels = line[len(base) :].rsplit(" ", 1)[0]
            if all(pair in labels for pair in pairs):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        assert found, f"no metric {name}"
        return total

    def wait_for_metric(self, name: str, predicate, timeout: float = 30.0, headers=None) -> float:
        return poll_until(lambda: self.metric(name, headers), predicate, timeout)


def poll_until(read, predicate, timeout: float = 30.0):
    """Reads until predicate(value) holds or the deadline passes; returns the last value read."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if predicate(value) or time.monotonic() > deadline:
            return value
        time.sleep(POLL_INTERVAL_S)
