"""Deterministic request traces for the seeds' three request sets, written as JSONL; the file's sha256 is its version.

Prompt lengths are targets in tokens, approximated by words (English text runs ~1.3 tokens per word with
SmolLM2's tokenizer), so no tokenizer is needed to make a trace and a trace fits any model.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

KINDS = ("chat", "long", "agent", "mixed", "rag")
TOKENS_PER_WORD = 1.3

_WORD_TEXT = """
the a an of to and in on for with as by at from that this these those it its their our your his her system
model request server client memory network storage latency throughput queue batch token cache engine policy
tenant budget schedule report signal market river city village harbour mountain forest history science music
language garden kitchen journey morning evening winter summer question answer study design measure improve
explain describe compare consider review observe build run write read quickly carefully often rarely always
never usually simply clearly slowly quietly together apart small large long short bright dark early late
simple complex quiet busy careful sudden gentle steady people teacher student doctor farmer engineer writer
driver artist sailor neighbour friend stranger book letter map lamp window door table chair road bridge tower
station market field stone water fire
"""
_WORDS = _WORD_TEXT.split()


@dataclass
class TraceRequest:
    id: str
    kind: str
    messages: list[dict[str, str]]
    max_tokens: int
    tenant: str = "default"
    priority: int = 0
    prefix_group: str | None = None
    cancel_after_tokens: int | None = None
    burst: int | None = None  # requests of one burst arrive together
    extra: dict = field(default_factory=dict)


def _sentence(rng: random.Random, words: int) -> str:
    chosen = [rng.choice(_WORDS) for _ in range(max(1, words))]
    return " ".join(chosen).capitalize() + "."


def _text(rng: random.Random, tokens: int) -> str:
    words = max(1, round(tokens / TOKENS_PER_WORD))
    sentences = []
    while words > 0:
        n = min(words, rng.randint(6, 18))
        sentences.append(_sentence(rng, n))
        words -= n
    return " ".join(sentences)


def chat_requests(rng: random.Random, n: int, start: int = 0) -> list[TraceRequest]:
    system = {"role": "system", "content": "You are a helpful assistant. Answer briefly and clearly."}
    return [
        TraceRequest(
            id=f"chat-{start + i}",
            kind="chat",
            messages=[system, {"role": "user", "content": _text(rng, rng.randint(20, 200))}],
            max_tokens=rng.randint(20, 300),
        )
        for i in range(n)
    ]


def long_requests(rng: random.Random, n: int, start: int = 0) -> list[TraceRequest]:
    out = []
    for i in range(n):
        document = _text(rng, rng.randint(1000, 6000))
        question = "Summarise the document above and list its three main points."
        out.append(
            TraceRequest(
                id=f"long-{start + i}",
                kind="long",
                messages=[{"role": "user", "content": f"{document}\n\n{question}"}],
                max_tokens=rng.randint(50, 300),
            )
        )
    return out


def agent_requests(rng: random.Random, n: int, start: int = 0, num_prefixes: int = 4) -> list[TraceRequest]:
    prefixes = [
        "You are an agent with these tools and passages.\n" + _text(rng, rng.randint(500, 2000))
        for _ in range(num_prefixes)
    ]
    out: list[TraceRequest] = []
    burst = 0
    while len(out) < n:
        burst += 1
        for _ in range(min(n - len(out), rng.randint(1, 6))):
            group = rng.randrange(num_prefixes)
            cancel = rng.randint(5, 60) if rng.random() < 0.15 else None
            out.append(
                TraceRequest(
                    id=f"agent-{start + len(out)}",
                    kind="agent",
                    messages=[
                        {"role": "system", "content": prefixes[group]},
                        {"role": "user", "content": _text(rng, rng.randint(10, 120))},
                    ],
                    max_tokens=rng.randint(5, 500),
                    prefix_group=f"prefix-{group}",
                    cancel_after_tokens=cancel,
                    burst=burst,
                )
            )
    return out


def rag_requests(rng: random.Random, n: int, start: int = 0) -> list[TraceRequest]:
    """Retrieval-augmented questions whose answers quote their passages: the text speculative decoding copies."""
    system = {"role": "system", "content": "Answer from the passages. Quote the passage you use word for word."}
    out = []
    for i in range(n):
        passages = [_text(rng, rng.randint(60, 160)) for _ in range(rng.randint(2, 4))]
        chosen = rng.randrange(len(passages))
        numbered = "\n\n".join(f"Passage {j + 1}: {p}" for j, p in enumerate(passages))
        question = f"Quote passage {chosen + 1} exactly, then say in one sentence what it is about."
        out.append(
            TraceRequest(
                id=f"rag-{start + i}",
                kind="rag",
                messages=[system, {"role": "user", "content": f"{numbered}\n\n{question}"}],
                max_tokens=rng.randint(80, 200),
            )
        )
    return out


def make_trace(kind: str, num_requests: int, seed: int, mix: tuple[float, float, float] = (0.6, 0.2, 0.2)):
    """The same kind, size and seed give the same requests, byte for byte."""
    if kind not in KINDS:
        raise ValueError(f"unknown trace kind {kind!r}; choose from {', '.join(KINDS)}")
    rng = random.Random(seed)
    if kind == "chat":
        return chat_requests(rng, num_requests)
    if kind == "long":
        return long_requests(rng, num_requests)
    if kind == "agent":
        return agent_requests(rng, num_requests)
    if kind == "rag":
        return rag_requests(rng, num_requests)
    counts = [round(num_requests * share / sum(mix)) for share in mix]
    counts[0] += num_requests - sum(counts)
    requests = chat_requests(rng, counts[0]) + long_requests(rng, counts[1]) + agent_requests(rng, counts[2])
    rng.shuffle(requests)
    return requests


def capped_output(requests: list[TraceRequest], max_tokens: int | None) -> list[TraceRequest]:
    """The trace with no request asking for more than max_tokens (as vLLM's bench's fixed output lengths, a short run
    of the same prompts); None leaves it as made."""
    if max_tokens is None:
        return requests
    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {max_tokens}")
    return [replace(r, max_tokens=min(r.max_tokens, max_tokens)) for r in requests]


def trace_bytes(requests: list[TraceRequest]) -> bytes:
    """The JSONL form of a trace, byte for byte what write_trace puts in the file."""
    return "".join(json.dumps(asdict(r), sort_keys=True) + "\n" for r in requests).encode()


def trace_sha256(requests: list[TraceRequest]) -> str:
    """The trace's version: the sha256 of its file."""
    return hashlib.sha256(trace_bytes(requests)).hexdigest()


def write_trace(requests: list[TraceRequest], path: str | Path) -> str:
    """Writes JSONL and returns the file's sha256, the trace's version."""
    data = trace_bytes(requests)
    Path(path).write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def read_trace(path: str | Path) -> tuple[list[TraceRequest], str]:
    data = Path(path).read_bytes()
    requests = [TraceRequest(**json.loads(line)) for line in data.decode().splitlines() if line.strip()]
    return requests, hashlib.sha256(data).hexdigest()
