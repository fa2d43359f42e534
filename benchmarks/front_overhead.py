"""What the HTTP server's async front costs: the same chat workload offline (LLM.chat) and through the server.

    .venv/bin/python benchmarks/front_overhead.py [--num-requests 24] [--max-num-seqs 16]

The server runs its step loop in a thread beside the event loop. If it delivers nearly the engine's offline
throughput, and /health stays fast under load, a separate engine process could win back at most the gap.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import httpx

from tokenloom import LLM, SamplingParams
from tokenloom.bench.local_server import LocalServer
from tokenloom.bench.trace import make_trace, write_trace


def offline(requests, max_num_seqs: int) -> tuple[float, int]:
    llm = LLM(max_num_seqs=max_num_seqs)
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens) for r in requests]
    llm.chat([[{"role": "user", "content": "warm up"}]], SamplingParams(max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.chat([r.messages for r in requests], params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


def served(trace: Path, max_num_seqs: int, num: int) -> tuple[float, int, list[float]]:
    with LocalServer("--max-num-seqs", str(max_num_seqs)) as server, tempfile.TemporaryDirectory() as tmp:
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "warm up", "max_tokens": 2}, timeout=60)
        pings: list[float] = []
        stop = threading.Event()

        def ping() -> None:
            while not stop.wait(0.2):
                start = time.perf_counter()
                httpx.get(f"{server.url}/health", timeout=30)
                pings.append(time.perf_counter() - start)

        pinger = threading.Thread(target=ping, daemon=True)
        pinger.start()
        out = Path(tmp) / "run.json"
        command = [
            sys.executable,
            "-m",
            "tokenloom.cli",
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--trace",
            str(trace),
            "--request-rate",
            "inf",
            "-o",
            str(out),
        ]
        subprocess.run(command, check=True, capture_output=True)
        stop.set()
        pinger.join()
        run = json.loads(out.read_text())
        records = run["records"]
        duration = max(r["start"] + (r["e2e"] or 0) for r in records)
        return duration, sum(r["output_tokens"] for r in records), pings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    args = parser.parse_args()
    requests = make_trace("chat", args.num_requests, seed=0)
    for r in requests:  # the server's chat endpoint sends no system prompt of its own; keep both identical
        r.messages = [m for m in r.messages if m["role"] != "system"] or r.messages
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "chat.jsonl"
        write_trace(requests, trace)
        load = os.getloadavg()[0]
        offline_s, offline_tokens = offline(requests, args.max_num_seqs)
        served_s, served_tokens, pings = served(trace, args.max_num_seqs, args.num_requests)
    offline_rate, served_rate = offline_tokens / offline_s, served_tokens / served_s
    pings.sort()
    print(f"load average before: {load:.2f}")
    print(f"offline LLM.chat : {offline_tokens} tokens in {offline_s:.1f} s = {offline_rate:.1f} tok/s")
    print(
        f"served over HTTP : {served_tokens} tokens in {served_s:.1f} s = {served_rate:.1f} tok/s "
        f"({served_rate / offline_rate:.0%} of offline)"
    )
    print(
        f"/health under load: median {statistics.median(pings) * 1e3:.1f} ms, "
        f"p95 {pings[int(0.95 * (len(pings) - 1))] * 1e3:.1f} ms over {len(pings)} pings"
    )


if __name__ == "__main__":
    main()
