"""What a request's response holds of the server's memory, against what --max-inflight-response-bytes charges it;
and what tokenizing large prompts holds, within the server's text budget.

    .venv/bin/python benchmarks/response_memory.py [--part charges|flood|prompts|embeddings|all] [--source CHECKOUT]

A tiny random Llama with SmolLM2's tokenizer (the tests' tiny chat model: fast steps, real text), ignore_eos.

charges: one request of each kind at a time, served in this process (httpx over ASGI) under tracemalloc: its traced
    peak against the charge the server took for it (read from the budget while it ran). The budget bounds what
    requests hold when peak / charge stays under 1 for every kind.
flood: a real server (uvicorn), and CLIENTS requests at once, each a ~200-byte chat body asking for n = 8, 1,500
    tokens and top_logprobs 20; the server's resident memory at its peak, with the default budget made small
    (512 MiB) and with it out of the way (1 TiB): what one client could take before, and what it can now.
prompts: a real server, CLIENTS completions at once (three rounds), each a 1 MB prompt of numbers (one token a digit:
    ~960,000 tokens, refused after tokenizing as over the context); the server's resident memory at its peak. With
    --source, the server runs that checkout's code (PYTHONPATH), to compare with a commit before the text budget.
embeddings: a random one-layer Llama 4,096 wide (Llama-3.1-8B's hidden size; vocabulary 512, token-id inputs). The
    charges of /v1/embeddings requests of 1, 32 and 128 inputs, as above; then a flood of CLIENTS x 4 requests of 128
    inputs each, all of them run in one step, the server's peak resident memory under a budget of 256 MiB. With
    --source, the flood also runs against that checkout's server (before embeddings were charged).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import shutil
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import httpx
import torch
import transformers

from tokenloom.bench.local_server import LocalServer
from tokenloom.bench.provenance import cpu_flags
from tokenloom.cli import build_parser, config_from_args, engine_config_from_args
from tokenloom.model.loader import resolve_checkpoint_dir
from tokenloom.server.launch import build_server
from tokenloom.server_config import ServerConfig

CHAT = [{"role": "user", "content": "hi"}]
PROMPT = " ".join(f"w{i}" for i in range(1000))  # ~4,000 tokens
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "completions, n=128, 1 token": ("/v1/completions", {"prompt": "hi", "n": 128, "max_tokens": 1}),
    "completions, n=128, 200 tokens": ("/v1/completions", {"prompt": "hi", "n": 128, "max_tokens": 200}),
    "completions, n=8, 300 tokens, logprobs 20": (
        "/v1/completions", {"prompt": "hi", "n": 8, "max_tokens": 300, "logprobs": 20}),
    "completions, n=8, 300 tokens, logprobs 0": (
        "/v1/completions", {"prompt": "hi", "n": 8, "max_tokens": 300, "logprobs": 0}),
    "completions, echo, logprobs 20 (~4k-token prompt)": (
        "/v1/completions", {"prompt": PROMPT, "echo": True, "max_tokens": 1, "logprobs": 20}),
    "completions, prompt_logprobs 20 (~4k-token prompt)": (
        "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 20}),
    "completions streamed, n=8, 300 tokens, logprobs 20": (
        "/v1/completions", {"prompt": "hi", "n": 8, "max_tokens": 300, "logprobs": 20, "stream": True}),
    "chat, n=8, 300 tokens, top_logprobs 20": (
        "/v1/chat/completions", {"messages": CHAT, "n": 8, "max_tokens": 300, "logprobs": True, "top_logprobs": 20}),
    "chat, n=8, 300 tokens, top_logprobs 0": (
        "/v1/chat/completions", {"messages": CHAT, "n": 8, "max_tokens": 300, "logprobs": True}),
    "chat streamed, n=8, 300 tokens, top_logprobs 20": ("/v1/chat/completions", {
        "messages": CHAT, "n": 8, "max_tokens": 300, "logprobs": True, "top_logprobs": 20, "stream": True}),
    "responses, 2,000 tokens, top_logprobs 20, store false": ("/v1/responses", {
        "input": "hi", "max_output_tokens": 2000, "include": ["message.output_text.logprobs"], "top_logprobs": 20,
        "store": False}),
}  # fmt: skip


def tiny_chat_model(directory: Path) -> Path:
    """The tests' tiny chat model: a random 2-layer Llama with the embedded SmolLM2's tokenizer and template."""
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    real = resolve_checkpoint_dir(None)[1]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (real / name).exists():
            shutil.copy(real / name, directory / name)
    return directory


EMBEDDING_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    f"embeddings, {inputs} inputs, {encoding}": (
        "/v1/embeddings", {"input": [[i % 500 + 1, 2, 3] for i in range(inputs)], "encoding_format": encoding})
    for inputs in (1, 32, 128) for encoding in ("float", "base64")
}  # fmt: skip


def wide_model(directory: Path) -> Path:
    """A random one-layer Llama as wide as Llama-3.1-8B (4,096), with a vocabulary of 512: its embeddings are large."""
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=4096, intermediate_size=64, num_hidden_layers=1, num_attention_heads=32,
        num_key_value_heads=2, max_position_embeddings=8192,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory


async def charges(model: Path, cases: dict[str, tuple[str, dict[str, Any]]]) -> None:
    args = build_parser().parse_args(["serve", str(model), "--max-num-seqs", "256", "--max-model-len", "8192"])
    args.model = args.model_tag
    app, engine = build_server(config_from_args(ServerConfig, args), engine_config_from_args(args))
    budget = app.state.tokenloom.response_budget
    engine.start()
    print("\n| request | traced peak | charged | peak / charge |\n|---|---:|---:|---:|")
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            first_path, first_body = next(iter(cases.values()))  # what the first request alone builds is not its own
            await client.post(first_path, json={"model": model.name, **first_body}, timeout=3000)
            for name, (path, body) in cases.items():
                extra = {} if path in ("/v1/responses", "/v1/embeddings") else {"ignore_eos": True}
                gc.collect()
                tracemalloc.start()
                before = tracemalloc.get_traced_memory()[0]
                request = asyncio.create_task(
                    client.post(path, json={"model": model.name, **extra, **body}, timeout=3000)
                )
                charged = 0
                while not request.done():
                    charged = max(charged, budget.held)
                    await asyncio.sleep(0.01)
                response = await request
                assert response.status_code == 200, response.text[:300]
                del response
                peak = tracemalloc.get_traced_memory()[1] - before
                tracemalloc.stop()
                print(
                    f"| {name} | {peak / 2**20:.1f} MiB | {charged / 2**20:.1f} MiB | {peak / charged:.2f} |",
                    flush=True,
                )
    finally:
        engine.shutdown()


def rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no VmRSS")


def peak_rss_while_asking(pid: int, ask: Callable[[], None], clients: int, rounds: int) -> tuple[int, float]:
    """Rounds of `clients` threads each calling ask() once; the server's peak resident memory (MiB), the wall time."""
    peak, start = rss_mib(pid), time.monotonic()
    for _ in range(rounds):
        threads = [threading.Thread(target=ask) for _ in range(clients)]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            peak = max(peak, rss_mib(pid))
            time.sleep(0.05)
    return peak, time.monotonic() - start


def flood(model: Path, budget: str, clients: int) -> None:
    flags = ("--max-num-seqs", "256", "--max-model-len", "8192", "--max-inflight-response-bytes", budget)
    with LocalServer(str(model), *flags) as server:
        base = rss_mib(server.process.pid)
        body = {"model": model.name, "messages": CHAT, "n": 8, "max_tokens": 1500, "logprobs": True,
                "top_logprobs": 20, "ignore_eos": True}  # fmt: skip
        statuses: list[int] = []

        def ask() -> None:
            statuses.append(httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=3000).status_code)

        peak, wall = peak_rss_while_asking(server.process.pid, ask, clients, rounds=1)
        size = len(httpx.Request("POST", "/", json=body).content)
        print(f"| {budget} | {clients} x {size} B | {counted(statuses)} | {base:,} MiB | {peak:,} MiB | "
              f"+{peak - base:,} MiB | {wall:.0f} s |", flush=True)  # fmt: skip


def embeddings_flood(model: Path, budget: str, clients: int, source: str | None) -> None:
    env = None if source is None else {"PYTHONPATH": str(Path(source) / "src")}
    # Room for every input of every request in one step, so that all their vectors are held at once.
    flags = ("--max-num-seqs", "4096", "--max-num-batched-tokens", "16384", "--max-inflight-response-bytes", budget)
    with LocalServer(str(model), *flags, env=env) as server:
        base = rss_mib(server.process.pid)
        statuses: list[int] = []
        body = {"model": model.name, "input": [[i % 500 + 1, 2, 3] for i in range(128)], "encoding_format": "float"}

        def ask() -> None:
            statuses.append(httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=3000).status_code)

        peak, wall = peak_rss_while_asking(server.process.pid, ask, clients * 4, rounds=1)
        print(f"| {source or 'this checkout'} | {budget} | {clients * 4} x 128 inputs | {counted(statuses)} | "
              f"{base:,} MiB | {peak:,} MiB | +{peak - base:,} MiB | {wall:.0f} s |", flush=True)  # fmt: skip


def big_prompts(model: Path, clients: int, source: str | None) -> None:
    rng = random.Random(0)
    text = " ".join(str(rng.randrange(10**6)) for _ in range(140_000))[:1_000_000]
    env = None if source is None else {"PYTHONPATH": str(Path(source) / "src")}
    with LocalServer(str(model), "--max-model-len", "8192", env=env) as server:
        base = rss_mib(server.process.pid)
        statuses: list[int] = []

        def ask() -> None:
            body = {"model": model.name, "prompt": text, "max_tokens": 1}
            statuses.append(httpx.post(f"{server.url}/v1/completions", json=body, timeout=600).status_code)

        peak, wall = peak_rss_while_asking(server.process.pid, ask, clients, rounds=3)
        print(f"| {source or 'this checkout'} | 3 x {clients} x 1 MB | {counted(statuses)} | {base:,} MiB | "
              f"{peak:,} MiB | +{peak - base:,} MiB | {wall:.0f} s |", flush=True)  # fmt: skip


def counted(statuses: list[int]) -> dict[int, int]:
    return {code: statuses.count(code) for code in sorted(set(statuses))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["charges", "flood", "prompts", "embeddings", "all"], default="all")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--source", help="another checkout whose server the prompts and embeddings parts run too")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}; CPU flags: {cpu_flags()}")
    with tempfile.TemporaryDirectory() as scratch:
        model = tiny_chat_model(Path(scratch) / "tiny-chat")
        if args.part in ("charges", "all"):
            asyncio.run(charges(model, CASES))
        if args.part in ("flood", "all"):
            print("\n| --max-inflight-response-bytes | requests | statuses | RSS before | RSS peak | grew | wall |")
            print("|---|---:|---|---:|---:|---:|---:|")
            for budget in (str(1 << 40), str(512 << 20)):
                flood(model, budget, args.clients)
        if args.part in ("prompts", "all"):
            print("\n| server | requests | statuses | RSS before | RSS peak | grew | wall |")
            print("|---|---:|---|---:|---:|---:|---:|")
            big_prompts(model, args.clients, args.source)
        if args.part in ("embeddings", "all"):
            wide = wide_model(Path(scratch) / "wide")
            asyncio.run(charges(wide, EMBEDDING_CASES))
            print("\n| server | budget | requests | statuses | RSS before | RSS peak | grew | wall |")
            print("|---|---|---:|---|---:|---:|---:|---:|")
            for source in [None] + ([args.source] if args.source else []):
                embeddings_flood(wide, str(256 << 20), args.clients, source)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
