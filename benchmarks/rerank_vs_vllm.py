"""/rerank with a causal LM served as a reranker, against vLLM on the same CPU, in the same sitting: the same
queries and documents, their scores compared.

    .venv/bin/python benchmarks/rerank_vs_vllm.py [--only tokenloom|vllm] [--vllm-venv ~/venv-vllm] [--rounds 2]

Both servers serve the embedded SmolLM2-135M-Instruct with vLLM's command line for an LLM turned reranker:
--hf-overrides '{"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["no", "yes"],
"method": "from_2_way_softmax"}', each (query, document) pair one prompt (the two texts joined) scored by
sigmoid(logit("yes") - logit("no")) at its last token. vLLM in bfloat16 where the CPU has AVX-512 BF16 (float32
otherwise), both cores on the model; tokenloom with its default flags.

Workload: 32 queries of 24-64 words, each with 16 documents of 40-200 words (seed 0; random words from a fixed list,
under a Qwen3-Reranker-like instruction), sent as 32 /rerank requests, 4 in flight at once: 512 pairs, ~70k tokens.
Each round's queries start with the round's number, so no round finds another's in a prefix cache (the 16 pairs of
a query share its prefix within a round, which a prefix cache may use). Reported per server: pairs a second, each
round's; then the two servers' scores of the same pairs (the last round's): the largest difference, and how often the
two put the same document first; and each server's against float32 (tokenloom's LLM.score in float32, the oracle's
dtype), with the spread of the float32 scores within a query.

vLLM is installed as vs_vllm.py installs it (../shared/PEERS.md). A benchmark, not a test: CI never runs it.
Loopback only; bounded in requests and time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

import httpx
from vs_vllm import MODEL_NAME, vllm_server, wait_for_quiet_machine

from tokenloom.bench.local_server import LocalServer
from tokenloom.model.platform import cpu_has_native_bf16

NUM_QUERIES, DOCUMENTS_PER_QUERY, IN_FLIGHT = 32, 16, 4
OVERRIDES = {"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["no", "yes"],
             "method": "from_2_way_softmax"}  # fmt: skip
INSTRUCTION = "Judge whether the Document meets the requirements of the Query. Answer only yes or no.\n"
WORDS = ("river", "city", "paris", "train", "music", "garden", "winter", "market", "engine", "library", "ocean",
         "mountain", "coffee", "history", "science", "football", "bridge", "window", "doctor", "school", "theory",
         "bread", "summer", "storm", "island", "forest", "metal", "planet", "museum", "travel", "language", "camera",
         "ticket", "wheel", "castle", "harbor", "farmer", "pilot", "recipe", "tower", "desert", "violin", "cloud",
         "silver")  # fmt: skip


def workload(seed: int = 0) -> list[tuple[str, list[str]]]:
    rng = random.Random(seed)

    def words(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    return [
        (f"<Query>: {words(24, 64)}\n", [f"<Document>: {words(40, 200)}\nAnswer:" for _ in range(DOCUMENTS_PER_QUERY)])
        for _ in range(NUM_QUERIES)
    ]


async def rerank_all(url: str, queries: list[tuple[str, list[str]]], round_: int) -> tuple[float, list[list[float]]]:
    """Seconds for the whole workload, and each query's documents' scores in their given order."""
    scores: list[list[float]] = [[] for _ in queries]
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(client: httpx.AsyncClient, index: int) -> None:
        query, documents = queries[index]
        async with gate:
            body = {"model": MODEL_NAME, "query": f"{INSTRUCTION}Round {round_}. {query}", "documents": documents}
            reply = await client.post("/rerank", json=body)
            reply.raise_for_status()
            results = sorted(reply.json()["results"], key=lambda r: r["index"])
            scores[index] = [r["relevance_score"] for r in results]

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        started = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(len(queries))))
        seconds = time.perf_counter() - started
    return seconds, scores


def measure(name: str, url: str, queries: list[tuple[str, list[str]]], round_: int) -> tuple[float, list[list[float]]]:
    wait_for_quiet_machine()
    seconds, scores = asyncio.run(rerank_all(url, queries, round_))
    pairs = sum(len(documents) for _, documents in queries)
    print(f"{name}: {seconds:.1f} s, {pairs / seconds:.1f} pairs/s", flush=True)
    return seconds, scores


def compare(first: list[list[float]], second: list[list[float]]) -> str:
    differences = [abs(a - b) for x, y in zip(first, second, strict=True) for a, b in zip(x, y, strict=True)]
    same_top = sum(x.index(max(x)) == y.index(max(y)) for x, y in zip(first, second, strict=True))
    return (f"largest score difference {max(differences):.4f}, mean {sum(differences) / len(differences):.4f}; "
            f"same document first for {same_top} of {len(first)} queries")  # fmt: skip


def float32_scores(queries: list[tuple[str, list[str]]]) -> list[list[float]]:
    """Each pair's score from tokenloom's offline LLM in float32 (transformers' within 1e-5: tests/engine)."""
    from tokenloom import LLM

    with LLM(dtype="float32", hf_overrides=OVERRIDES, max_model_len=8192) as llm:
        return [[o.outputs.score for o in llm.score(query, documents, use_tqdm=False)] for query, documents in queries]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["tokenloom", "vllm"], default=None)
    parser.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("VLLM_VENV", "~/venv-vllm")).expanduser())
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    queries = workload()
    print(f"{NUM_QUERIES} queries x {DOCUMENTS_PER_QUERY} documents; load average {os.getloadavg()[0]:.2f}")
    dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    overrides = ["--hf-overrides", json.dumps(OVERRIDES)]
    with contextlib.ExitStack() as stack:
        servers: dict[str, str] = {}
        if args.only != "tokenloom":
            servers[f"vLLM {dtype}"] = stack.enter_context(vllm_server(args.vllm_venv, dtype, overrides))
        if args.only != "vllm":
            flags = ("--served-model-name", MODEL_NAME, "--max-model-len", "8192", *overrides)
            servers["tokenloom"] = stack.enter_context(LocalServer(*flags)).url
        for url in servers.values():
            asyncio.run(rerank_all(url, workload(seed=99)[:4], round_=0))
        seconds: dict[str, list[float]] = {name: [] for name in servers}
        scores: dict[str, list[list[float]]] = {}  # the last round's, the same pairs on each server
        for round_ in range(1, args.rounds + 1):
            order = list(servers) if round_ % 2 else list(reversed(servers))
            for name in order:
                took, scores[name] = measure(name, servers[name], queries, round_)
                seconds[name].append(took)
    pairs = NUM_QUERIES * DOCUMENTS_PER_QUERY
    for name, runs in seconds.items():
        print(f"{name}: rounds {', '.join(f'{pairs / s:.1f}' for s in runs)} pairs/s; best {min(runs):.1f} s")
    if len(scores) == 2:
        print(compare(*scores.values()))
    last_round = [(f"{INSTRUCTION}Round {args.rounds}. {query}", documents) for query, documents in queries]
    reference = float32_scores(last_round)
    spread = [max(x) - min(x) for x in reference]
    print(f"float32 scores: spread within a query {min(spread):.4f}-{max(spread):.4f}")
    for name, got in scores.items():
        print(f"{name} against float32: {compare(got, reference)}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
