"""`tokenloom bench trace | serve | compare`: make a trace, replay it against a server, tabulate runs."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import sys
import threading
from pathlib import Path
from typing import Any

import httpx

from tokenloom.bench import server_metrics
from tokenloom.bench.loadgen import adapter_choice, arrival_offsets, burst_aligned, run_load
from tokenloom.bench.provenance import git_commit, machine_info
from tokenloom.bench.scorecard import SCORECARD_KEYS, SLO, percentile, scorecard
from tokenloom.bench.server_metrics import API_PROCESS_ONLY
from tokenloom.bench.trace import KINDS, capped_output, make_trace, read_trace, trace_sha256, write_trace

COLUMNS = [
    ("label", "run", "{}"),
    ("offered_req_s", "offered req/s", "{:.2f}"),
    ("completed_req_s", "done req/s", "{:.2f}"),
    ("output_tok_s", "out tok/s", "{:.1f}"),
    ("ttft_p50_s", "TTFT p50", "{:.2f}"),
    ("ttft_p95_s", "TTFT p95", "{:.2f}"),
    ("itl_p50_s", "ITL p50", "{:.3f}"),
    ("itl_p95_s", "ITL p95", "{:.3f}"),
    ("e2e_p95_s", "E2E p95", "{:.2f}"),
    ("queue_time_p95_s", "queue p95", "{:.2f}"),
    ("error_rate", "errors", "{:.1%}"),
    ("preemptions", "preempt", "{:.0f}"),
    ("memory_high_water_bytes", "mem MiB", "{}"),
    ("prefix_cache_hit_rate", "prefix hit", "{:.1%}"),
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
    trace.add_argument("--mix", default="0.6,0.2,0.2", help="chat,long,agent shares of a mixed trace")
    add_max_tokens_flag(trace)
    trace.add_argument("-o", "--output", required=True)

    serve = bench.add_parser("serve", help="replay a trace against an OpenAI-compatible server")
    _load_flags(serve)
    serve.add_argument("--base-url", required=True)
    serve.add_argument("--request-rate", default="inf", help="requests per second, or inf")
    serve.add_argument("-o", "--output", required=True)

    sweep = bench.add_parser("sweep", help="ramp the offered rate until queue time or errors break the limits")
    _load_flags(sweep)
    sweep.add_argument("--base-url", required=True)
    sweep.add_argument("--request-rates", default="0.25,0.5,1,2,4")
    sweep.add_argument("--max-queue-p95", type=float, default=5.0, help="seconds of p95 queue time allowed")
    sweep.add_argument("--max-error-rate", type=float, default=0.01)
    sweep.add_argument(
        "--min-completed-fraction",
        type=float,
        default=0.8,
        help="completed req/s over offered req/s a rate must reach: below it the server is not keeping up",
    )
    sweep.add_argument("-o", "--output", required=True, help="a directory for runs and plots")

    matrix = bench.add_parser("matrix", help="one tokenloom server per configuration, the same trace against each")
    _load_flags(matrix)
    matrix.add_argument("--request-rate", "--rate", default="inf")
    matrix.add_argument("--configs", required=True, help='e.g. "baseline: ; budget: --max-num-batched-tokens 512"')
    matrix.add_argument("--model-path", default=None, help="the --model of every server (default: embedded)")
    matrix.add_argument("--server-args", default="", help="flags given to every server")
    matrix.add_argument("-o", "--output", required=True, help="a directory for the runs")

    compare = bench.add_parser("compare", help="print the scorecard table of saved runs")
    compare.add_argument("runs", nargs="+")
    compare.add_argument("--markdown", action="store_true")


def add_max_tokens_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--max-tokens", type=int, default=None, help="cap every request's max_tokens at this")


def add_replayed_trace_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The flags trace_from_args reads (with --seed): a trace file, or the kind, size and mix of one to make."""
    parser.add_argument("--trace", default=None, help="a trace file; else one is made from --kind")
    parser.add_argument("--kind", choices=KINDS, default="chat")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--mix", default="0.6,0.2,0.2", help="chat,long,agent shares when --kind mixed")
    add_max_tokens_flag(parser)


def _load_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="the model id sent in requests")
    parser.add_argument(
        "--lora-modules", nargs="+", default=None, metavar="NAME",
        help="LoRA adapters the server serves: each request names one, drawn at random from its id and --seed",
    )  # fmt: skip
    parser.add_argument("--api-key", default=None)
    add_replayed_trace_flags(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson; below 1: burstier")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--duration-limit", type=float, default=600.0, help="seconds; unfinished requests are errors")
    parser.add_argument("--slo", default=None, help="e.g. ttft=2,itl=0.2,e2e=30 (seconds)")
    parser.add_argument("--cost-per-hour", type=float, default=None, help="USD per hour of the serving machine")
    parser.add_argument("--label", default=None)


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "trace":
        requests = capped_output(make_trace(args.kind, args.num_requests, args.seed, _mix(args.mix)), args.max_tokens)
        sha = write_trace(requests, args.output)
        print(f"{args.output}: {args.num_requests} {args.kind} requests, sha256 {sha}")
        return 0
    if args.bench_command == "serve":
        run = bench_serve(args)
        Path(args.output).write_text(json.dumps(run, indent=2))
        print(render_table([run], markdown=False))
        return 0
    if args.bench_command == "sweep":
        bench_sweep(args)
        return 0
    if args.bench_command == "matrix":
        bench_matrix(args)
        return 0
    runs = [json.loads(Path(p).read_text()) for p in args.runs]
    print(render_table(runs, markdown=args.markdown))
    return 0


def trace_from_args(args: argparse.Namespace):
    """The requests a run replays and the trace's version for its provenance: a file's sha256, or the generated
    trace's; with --max-tokens, the cap named after it (the prompts are the version's, the lengths are capped)."""
    if args.trace:
        requests, sha = read_trace(args.trace)
        requests = requests[: args.num_requests] if args.num_requests else requests
    else:
        requests = make_trace(args.kind, args.num_requests or 100, args.seed, _mix(args.mix))
        sha = "generated:" + trace_sha256(requests)
    if args.max_tokens is None:
        return requests, sha
    return capped_output(requests, args.max_tokens), f"{sha}+max_tokens={args.max_tokens}"


def _mix(text: str) -> tuple[float, float, float]:
    shares = tuple(float(x) for x in text.split(","))
    if len(shares) != 3 or min(shares) < 0 or sum(shares) <= 0:
        raise ValueError("--mix takes three non-negative shares: chat,long,agent")
    return shares


def bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    requests, sha = trace_from_args(args)
    rate = math.inf if str(args.request_rate) == "inf" else float(args.request_rate)
    return bench_run(args, args.base_url, requests, sha, rate, args.label or Path(args.output).stem)


def bench_run(args, base_url: str, requests, sha: str, rate: float, label: str) -> dict[str, Any]:
    """Replays requests at the given rate against base_url; the run's scorecard, records and provenance."""
    from rich.progress import Progress

    offsets = burst_aligned(requests, arrival_offsets(len(requests), rate, args.burstiness, args.seed))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sync = httpx.Client()
    before = server_metrics.scrape(sync, base_url, headers)
    samples: list[dict] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_metrics, args=(base_url, headers, samples, stop), daemon=True)
    sampler.start()
    started = datetime.datetime.now(datetime.UTC).isoformat()
    with Progress(transient=True) as progress:
        task = progress.add_task(f"{label} @ {rate:g} req/s", total=len(requests))
        records, duration = asyncio.run(
            run_load(
                base_url,
                requests,
                offsets,
                adapter_choice(args.lora_modules, args.seed) if args.lora_modules else args.model,
                args.api_key,
                args.max_concurrency,
                args.duration_limit,
                on_done=lambda _: progress.advance(task),
            )
        )
    stop.set()
    sampler.join(timeout=5)
    after = server_metrics.scrape(sync, base_url, headers)
    offered = rate if not math.isinf(rate) else (len(requests) / duration if duration > 0 else math.inf)
    card = scorecard(
        records,
        duration,
        offered,
        SLO.parse(args.slo),
        server_metrics.server_figures(before, after, samples),
        args.cost_per_hour,
    )
    return {
        "label": label,
        "scorecard": card,
        "records": [vars(r) for r in records],
        "provenance": _provenance(args, base_url, sha, sync, headers, started),
    }


def bench_sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Ramps the offered rate; stops after the first rate that breaks the queue-time or error limits."""
    requests, sha = trace_from_args(args)
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for rate in [float(r) for r in args.request_rates.split(",")]:
        run = bench_run(args, args.base_url, requests, sha, rate, f"{args.label or 'sweep'}@{rate:g}")
        run["missed"] = _missed_limits(run["scorecard"], run["records"], args)
        run["meets_slo"] = not run["missed"]
        runs.append(run)
        if run["missed"]:
            print(f"{rate:g} req/s missed the limits: {'; '.join(run['missed'])}")
        (out_dir / f"rate-{rate:g}.json").write_text(json.dumps(run, indent=2))
        if not run["meets_slo"]:
            break
    met = [r["scorecard"]["offered_req_s"] for r in runs if r["meets_slo"]]
    capacity = max(met) if met else None
    summary = {
        "capacity_req_s": capacity,  # per replica: the highest offered rate that met the limits
        "runs": [r["label"] for r in runs],
        "slo": args.slo,
        "max_queue_p95_s": args.max_queue_p95,
        "max_error_rate": args.max_error_rate,
        "min_completed_fraction": args.min_completed_fraction,
        "provenance": runs[0]["provenance"] if runs else None,
    }
    (out_dir / "sweep.json").write_text(json.dumps(summary, indent=2))
    _plot_sweep(runs, out_dir)
    print(render_table(runs, markdown=False))
    print(f"capacity: {capacity if capacity is not None else 'no rate'} req/s met the limits; plots in {out_dir}")
    return runs


def _missed_limits(card: dict, records: list[dict], args: argparse.Namespace) -> list[str]:
    """Why a rate does not hold (none: it holds). Keeping up comes first: a server that completes far fewer
    requests per second than are offered is saturated even when nothing waits in its queue (its batch admits
    everything and serves it slowly) and no request fails."""
    missed = []
    offered, completed = card["offered_req_s"], card["completed_req_s"]
    kept_up = keeping_up_rate(records)
    if offered and not math.isinf(offered) and kept_up < args.min_completed_fraction * offered:
        missed.append(f"completed {kept_up:.2f} req/s of {offered:.2f} offered (< {args.min_completed_fraction:.0%})")
    if card["error_rate"] > args.max_error_rate:
        missed.append(f"error rate {card['error_rate']:.1%} > {args.max_error_rate:.1%}")
    queue = card["queue_time_p95_s"]
    if args.max_queue_p95 is not None and queue is not None and queue > args.max_queue_p95:
        missed.append(f"queue time p95 {queue:.2f} s > {args.max_queue_p95:g} s")
    if args.slo and completed > 0 and card["goodput_req_s"] < 0.9 * completed:
        missed.append(f"goodput {card['goodput_req_s']:.2f} req/s < 90% of completed (SLO {args.slo})")
    return missed


def keeping_up_rate(records: list[dict]) -> float:
    """Completed requests per second over the run without its tail: from the first arrival to the last completion,
    less a median request's latency (what even an idle server adds after the last arrival). A short trace at a
    rate the server holds then reads close to the offered rate, one it cannot hold far below."""
    done = [r for r in records if r.get("status") == 200 and not r.get("error") and not r.get("cancelled")]
    done = [r for r in done if r.get("e2e") is not None]
    if not done:
        return 0.0
    first = min(r["start"] for r in records)
    last = max(r["start"] + r["e2e"] for r in done)
    median = percentile([r["e2e"] for r in done], 50) or 0.0
    return len(done) / max(last - first - median, 1e-9)


def _plot_sweep(runs: list[dict], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["scorecard"]["offered_req_s"] for r in runs]
    log_x = len(rates) > 1 and max(rates) / min(rates) > 20
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, name in (
        ("ttft_p50_s", "TTFT p50"),
        ("ttft_p95_s", "TTFT p95"),
        ("e2e_p95_s", "E2E p95"),
        ("queue_time_p95_s", "queue p95"),
    ):
        values = [r["scorecard"][key] for r in runs]
        if any(v is not None for v in values):
            ax.plot(rates, [v if v is not None else float("nan") for v in values], marker="o", label=name)
    _finish_plot(fig, ax, log_x, "seconds", out_dir / "latency.png")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(rates, [r["scorecard"]["completed_req_s"] for r in runs], marker="o", label="completed")
    ax.plot(rates, [r["scorecard"]["goodput_req_s"] for r in runs], marker="o", label="goodput")
    ax.plot(rates, rates, linestyle=":", color="grey", label="offered")
    _finish_plot(fig, ax, log_x, "req/s", out_dir / "throughput.png")
    plt.close("all")


def _finish_plot(fig, ax, log_x: bool, ylabel: str, path: Path) -> None:
    ax.set_xlabel("offered req/s")
    ax.set_xscale("log" if log_x else "linear")
    ax.set_ylabel(ylabel)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_configs(text: str) -> list[tuple[str, list[str]]]:
    """'baseline: ; budget: --max-num-batched-tokens 512' -> [(baseline, []), (budget, [...])]."""
    configs = []
    for part in filter(str.strip, text.split(";")):
        name, sep, flags = part.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"config {part.strip()!r} should read 'name: --flag value ...'")
        configs.append((name.strip(), flags.split()))
    return configs


def bench_matrix(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One server per configuration on a free loopback port, the same trace against each, one table."""
    from tokenloom.bench.local_server import LocalServer

    requests, sha = trace_from_args(args)
    rate = math.inf if str(args.request_rate) == "inf" else float(args.request_rate)
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for name, flags in parse_configs(args.configs):
        server_args = [*(["--model", args.model_path] if args.model_path else []), *args.server_args.split(), *flags]
        with LocalServer(*server_args) as server:
            run = bench_run(args, server.url, requests, sha, rate, name)
        run["server_args"] = server_args
        runs.append(run)
        (out_dir / f"{name}.json").write_text(json.dumps(run, indent=2))
    print(render_table(runs, markdown=False))
    print()
    print(render_table(runs, markdown=True))
    return runs


def _sample_metrics(base_url: str, headers: dict, samples: list[dict], stop: threading.Event) -> None:
    with httpx.Client() as client:
        while not stop.wait(1.0):
            sample = server_metrics.scrape(client, base_url, headers)
            if sample is not None:
                samples.append({"process_resident_memory_bytes": sample.get("process_resident_memory_bytes")})


def _provenance(args, base_url: str, sha: str, client: httpx.Client, headers: dict, started: str) -> dict[str, Any]:
    import tokenloom

    try:
        version = client.get(f"{base_url}/version", headers=headers, timeout=5)
        server_version = version.json() if version.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        server_version = None
    return {
        "command": " ".join(sys.argv),
        "trace_sha256": sha,
        "server_version": server_version,
        "tokenloom_version": tokenloom.__version__,
        "git_commit": git_commit(),
        "machine": machine_info(),
        "started": started,
        "finished": datetime.datetime.now(datetime.UTC).isoformat(),
    }


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
                partial = card.get("memory_scope") == API_PROCESS_ONLY
                row.append(f"{value / 2**20:.0f}" + ("*" if partial else ""))
            else:
                row.append(fmt.format(value))
        rows.append(row)
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines + _footnotes(runs))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines + _footnotes(runs))


def _footnotes(runs: list[dict[str, Any]]) -> list[str]:
    if any(run["scorecard"].get("memory_scope") == API_PROCESS_ONLY for run in runs):
        return ["* mem: the resident memory of the process answering /metrics only; the server reports none for its "
                "other processes (vLLM's engine core, its workers), so its whole footprint is larger"]  # fmt: skip
    return []


assert {key for key, _, _ in COLUMNS[1:]} == set(SCORECARD_KEYS)
