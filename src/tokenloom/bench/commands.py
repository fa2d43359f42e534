"""`tokenloom bench trace | serve | compare`: make a trace, replay it against a server, tabulate runs."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx

from tokenloom.bench import server_metrics
from tokenloom.bench.loadgen import arrival_offsets, burst_aligned, run_load
from tokenloom.bench.scorecard import SCORECARD_KEYS, SLO, scorecard
from tokenloom.bench.trace import KINDS, make_trace, read_trace, write_trace

COLUMNS = [
    ("label", "run", "{}"),
    ("offered_req_s", "offered req/s", "{:.2f}"),
    ("completed_req_s", "done req/s", "{:.2f}"),
    ("output_tok_s", "out tok/s", "{:.1f}"),
    ("ttft_p50_s", "TTFT p50", "{:.2f}"),
    ("ttft_p95_s", "TTFT p95", "{:.2f}"),
    ("itl_p95_s", "ITL p95", "{:.3f}"),
    ("e2e_p95_s", "E2E p95", "{:.2f}"),
    ("queue_time_p95_s", "queue p95", "{:.2f}"),
    ("error_rate", "errors", "{:.1%}"),
    ("preemptions", "preempt", "{:.0f}"),
    ("memory_high_water_bytes", "mem MiB", "{}"),
    ("goodput_req_s", "goodput", "{:.2f}"),
    ("cost_per_1k_accepted", "$/1k ok", "{:.3f}"),
]


def add_bench_commands(commands) -> None:
    bench = commands.add_parser("bench", help="traces, load generation and scorecards").add_subparsers(
        dest="bench_command", required=True
    )
    trace = bench.add_parser("trace", help="write a deterministic trace (JSONL) and print its sha256")
    trace.add_argument("--kind", choices=KINDS, required=True)
    trace.add_argument("--num-requests", type=int, default=100)
    trace.add_argument("--seed", type=int, default=0)
    trace.add_argument("-o", "--output", required=True)

    serve = bench.add_parser("serve", help="replay a trace against an OpenAI-compatible server")
    serve.add_argument("--base-url", required=True)
    serve.add_argument("--model", default=None)
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--trace", default=None, help="a trace file; else one is made from --kind")
    serve.add_argument("--kind", choices=KINDS, default="chat")
    serve.add_argument("--num-requests", type=int, default=None)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--request-rate", default="inf", help="requests per second, or inf")
    serve.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson; below 1: burstier")
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument("--duration-limit", type=float, default=600.0, help="seconds; unfinished requests are errors")
    serve.add_argument("--slo", default=None, help="e.g. ttft=2,itl=0.2,e2e=30 (seconds)")
    serve.add_argument("--cost-per-hour", type=float, default=None, help="USD per hour of the serving machine")
    serve.add_argument("--label", default=None)
    serve.add_argument("-o", "--output", required=True)

    compare = bench.add_parser("compare", help="print the scorecard table of saved runs")
    compare.add_argument("runs", nargs="+")
    compare.add_argument("--markdown", action="store_true")


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "trace":
        sha = write_trace(make_trace(args.kind, args.num_requests, args.seed), args.output)
        print(f"{args.output}: {args.num_requests} {args.kind} requests, sha256 {sha}")
        return 0
    if args.bench_command == "serve":
        run = bench_serve(args)
        Path(args.output).write_text(json.dumps(run, indent=2))
        print(render_table([run], markdown=False))
        return 0
    runs = [json.loads(Path(p).read_text()) for p in args.runs]
    print(render_table(runs, markdown=args.markdown))
    return 0


def bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    from rich.progress import Progress

    if args.trace:
        requests, sha = read_trace(args.trace)
        if args.num_requests:
            requests = requests[: args.num_requests]
    else:
        requests = make_trace(args.kind, args.num_requests or 100, args.seed)
        sha = "generated:" + write_trace_sha(requests)
    rate = math.inf if str(args.request_rate) == "inf" else float(args.request_rate)
    offsets = burst_aligned(requests, arrival_offsets(len(requests), rate, args.burstiness, args.seed))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sync = httpx.Client()
    before = server_metrics.scrape(sync, args.base_url, headers)
    samples: list[dict] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_metrics, args=(args.base_url, headers, samples, stop), daemon=True)
    sampler.start()
    started = datetime.datetime.now(datetime.UTC).isoformat()
    with Progress(transient=True) as progress:
        task = progress.add_task("requests", total=len(requests))
        records, duration = asyncio.run(
            run_load(
                args.base_url,
                requests,
                offsets,
                args.model,
                args.api_key,
                args.max_concurrency,
                args.duration_limit,
                on_done=lambda _: progress.advance(task),
            )
        )
    stop.set()
    sampler.join(timeout=5)
    after = server_metrics.scrape(sync, args.base_url, headers)
    offered = len(requests) / offsets[-1] if offsets and offsets[-1] > 0 else float("inf")
    card = scorecard(
        records,
        duration,
        offered if math.isinf(rate) else rate,
        SLO.parse(args.slo),
        server_metrics.server_figures(before, after, samples),
        args.cost_per_hour,
    )
    return {
        "label": args.label or Path(args.output).stem,
        "scorecard": card,
        "records": [vars(r) for r in records],
        "provenance": _provenance(args, sha, sync, headers, started),
    }


def write_trace_sha(requests) -> str:
    import hashlib
    from dataclasses import asdict

    data = "".join(json.dumps(asdict(r), sort_keys=True) + "\n" for r in requests).encode()
    return hashlib.sha256(data).hexdigest()


def _sample_metrics(base_url: str, headers: dict, samples: list[dict], stop: threading.Event) -> None:
    with httpx.Client() as client:
        while not stop.wait(1.0):
            sample = server_metrics.scrape(client, base_url, headers)
            if sample is not None:
                samples.append({"process_resident_memory_bytes": sample.get("process_resident_memory_bytes")})


def _provenance(args, sha: str, client: httpx.Client, headers: dict, started: str) -> dict[str, Any]:
    import tokenloom

    try:
        version = client.get(f"{args.base_url}/version", headers=headers, timeout=5)
        server_version = version.json() if version.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        server_version = None
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    ).stdout.strip()
    return {
        "command": " ".join(sys.argv),
        "trace_sha256": sha,
        "server_version": server_version,
        "tokenloom_version": tokenloom.__version__,
        "git_commit": commit or "unknown",
        "machine": _machine(),
        "started": started,
        "finished": datetime.datetime.now(datetime.UTC).isoformat(),
    }


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": memory, "torch": torch_version}


def render_table(runs: list[dict[str, Any]], markdown: bool) -> str:
    """One row per run, the seeds' scorecard columns."""
    header = [title for _, title, _ in COLUMNS]
    rows = []
    for run in runs:
        card = {**run["scorecard"], "label": run.get("label", "")}
        row = []
        for key, _, fmt in COLUMNS:
            value = card.get(key)
            if value is None:
                row.append("-")
            elif key == "memory_high_water_bytes":
                row.append(f"{value / 2**20:.0f}")
            else:
                row.append(fmt.format(value))
        rows.append(row)
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


assert {key for key, _, _ in COLUMNS[1:]} == set(SCORECARD_KEYS)
