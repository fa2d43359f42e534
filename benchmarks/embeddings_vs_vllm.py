"""/v1/embeddings against vLLM on the same CPU, in the same sitting: the same inputs, their vectors compared.

    .venv/bin/python benchmarks/embeddings_vs_vllm.py [--only tokenloom|vllm] [--vllm-venv ~/venv-vllm] [--rounds 2]

Workload: 256 prompts of token ids, lengths uniform in 32-512 (seed 0; 69k tokens in all), sent as 16 requests of 16
inputs each, 4 requests in flight at once (a retrieval index being built), `encoding_format` float. Each server is
warmed first with 32 other prompts (vLLM compiles its first shapes then), and each round's prompts have their first
token changed (vs_vllm.py's `salted`), so no round finds another's in a prefix cache. Reported per server: inputs a
second and prompt tokens a second (the whole run's wall time), each round's. vLLM serves the embedded
model as an embedding model (`--runner pooling --convert embed`: last-token pooling, normalized), in bfloat16 where
the CPU has AVX-512 BF16 (float32 otherwise), both cores on the model; tokenloom with its default flags. Then every
input's vector from one server against the other's: the cosine similarities' minimum and median (1: the same).

vLLM is installed as vs_vllm.py installs it (../shared/PEERS.md). A benchmark, not a test: CI never runs it.
Loopback only; bounded in requests and time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

import httpx
import numpy as np
from vs_vllm import MODEL_NAME, salted, vllm_server, wait_for_quiet_machine

from tokenloom.bench.local_server import LocalServer
from tokenloom.model.platform import cpu_has_native_bf16

NUM_INPUTS, PER_REQUEST, IN_FLIGHT = 256, 16, 4


def workload(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(32, 512))] for _ in range(NUM_INPUTS)]


async def embed_all(url: str, prompts: list[list[int]]) -> tuple[float, list[list[float]]]:
    """Seconds for the whole workload, and each prompt's vector in order."""
    batches = [prompts[i : i + PER_REQUEST] for i in range(0, len(prompts), PER_REQUEST)]
    vectors: list[list[list[float]]] = [[] for _ in batches]
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(client: httpx.AsyncClient, index: int) -> None:
        async with gate:
            body = {"model": MODEL_NAME, "input": batches[index], "encoding_format": "float"}
            reply = await client.post("/v1/embeddings", json=body)
            reply.raise_for_status()
            vectors[index] = [d["embedding"] for d in sorted(reply.json()["data"], key=lambda d: d["index"])]

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        started = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(len(batches))))
        seconds = time.perf_counter() - started
    return seconds, [v for batch in vectors for v in batch]


def measure(name: str, url: str, prompts: list[list[int]]) -> tuple[float, list[list[float]]]:
    wait_for_quiet_machine()
    seconds, vectors = asyncio.run(embed_all(url, prompts))
    tokens = sum(len(p) for p in prompts)
    print(f"{name}: {seconds:.1f} s, {len(prompts) / seconds:.1f} inputs/s, {tokens / seconds:.0f} prompt tok/s",
          flush=True)  # fmt: skip
    return seconds, vectors


def cosines(a: list[list[float]], b: list[list[float]]) -> np.ndarray:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    y /= np.linalg.norm(y, axis=1, keepdims=True)
    return np.sum(x * y, axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["tokenloom", "vllm"], default=None)
    parser.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("VLLM_VENV", "~/venv-vllm")).expanduser())
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    prompts = workload()
    print(f"{len(prompts)} inputs, {sum(len(p) for p in prompts)} prompt tokens; load average {os.getloadavg()[0]:.2f}")
    dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    with contextlib.ExitStack() as stack:
        servers: dict[str, str] = {}
        if args.only != "tokenloom":
            extra = ["--runner", "pooling", "--convert", "embed"]
            servers[f"vLLM {dtype}"] = stack.enter_context(vllm_server(args.vllm_venv, dtype, extra))
        if args.only != "vllm":
            local = stack.enter_context(LocalServer("--served-model-name", MODEL_NAME, "--max-model-len", "8192"))
            servers["tokenloom"] = local.url
        for url in servers.values():
            asyncio.run(embed_all(url, workload(seed=99)[:32]))
        seconds: dict[str, list[float]] = {name: [] for name in servers}
        vectors: dict[str, list[list[float]]] = {}  # the last round's, the same inputs on each server
        for round_ in range(args.rounds):
            order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
            for name in order:
                took, vectors[name] = measure(name, servers[name], [salted(p, round_ + 1) for p in prompts])
                seconds[name].append(took)
    for name, runs in seconds.items():
        best = min(runs)
        print(f"{name}: rounds {', '.join(f'{len(prompts) / s:.1f}' for s in runs)} inputs/s; best {best:.1f} s")
    if len(vectors) == 2:
        first, second = vectors.values()
        similar = cosines(first, second)
        print(f"cosine between the servers' vectors: min {similar.min():.5f}, median {statistics.median(similar):.5f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
