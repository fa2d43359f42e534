"""The bench: deterministic traces, arrival processes, scorecard arithmetic, and a real run against a server."""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys

import pytest
from server_process import ServerProcess

from tokenloom.bench.loadgen import arrival_offsets, burst_aligned
from tokenloom.bench.scorecard import (
    SCORECARD_KEYS,
    SCORECARD_NOTES,
    SCORECARD_SPECULATION,
    SLO,
    RequestRecord,
    percentile,
    scorecard,
)
from tokenloom.bench.server_metrics import histogram_quantile, parse
from tokenloom.bench.trace import make_trace, read_trace, write_trace


def test_traces_are_deterministic_and_versioned_by_sha256(tmp_path):
    sha_a = write_trace(make_trace("mixed", 40, seed=3), tmp_path / "a.jsonl")
    sha_b = write_trace(make_trace("mixed", 40, seed=3), tmp_path / "b.jsonl")
    sha_c = write_trace(make_trace("mixed", 40, seed=4), tmp_path / "c.jsonl")
    assert sha_a == sha_b != sha_c
    requests, sha = read_trace(tmp_path / "a.jsonl")
    assert sha == sha_a and len(requests) == 40
    assert {r.kind for r in requests} == {"chat", "long", "agent"}


def test_trace_shapes():
    chat = make_trace("chat", 50, seed=0)
    assert all(20 <= r.max_tokens <= 300 and r.messages[0]["role"] == "system" for r in chat)
    long = make_trace("long", 10, seed=0)
    assert all(700 <= len(r.messages[0]["content"].split()) <= 4700 for r in long)  # ~1,000-6,000 tokens
    agent = make_trace("agent", 200, seed=0)
    assert len({r.prefix_group for r in agent}) == 4
    assert 0.05 < sum(r.cancel_after_tokens is not None for r in agent) / 200 < 0.3
    assert len({r.burst for r in agent}) < 200  # requests arrive in bursts
    shared = [r.messages[0]["content"] for r in agent if r.prefix_group == "prefix-0"]
    assert len(set(shared)) == 1  # the prefix is reused word for word
    assert {r.kind for r in make_trace("mixed", 10, seed=0, mix=(0, 0, 1))} == {"agent"}
    with pytest.raises(ValueError, match="unknown trace kind"):
        make_trace("video", 1, 0)


def test_a_trace_made_with_max_tokens_caps_each_request_and_keeps_its_prompts(tmp_path, capsys):
    from tokenloom.cli import main

    full = make_trace("chat", 20, seed=0)
    assert main(["bench", "trace", "--kind", "chat", "--num-requests", "20", "--max-tokens", "64",
                 "-o", str(tmp_path / "t.jsonl")]) == 0  # fmt: skip
    capped, _ = read_trace(tmp_path / "t.jsonl")
    assert [r.max_tokens for r in capped] == [min(r.max_tokens, 64) for r in full]
    assert any(r.max_tokens > 64 for r in full) and [r.messages for r in capped] == [r.messages for r in full]
    assert main(["bench", "trace", "--kind", "chat", "--max-tokens", "0", "-o", str(tmp_path / "u.jsonl")]) != 0
    assert "--max-tokens must be at least 1" in capsys.readouterr().err


SERVE = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "-o", "run.json"]  # parsed only: nothing is sent


@pytest.mark.parametrize("command", [SERVE, ["simulate", "-o", "run.json"]])
def test_serve_and_simulate_cap_a_trace_with_max_tokens_and_say_so_in_its_version(tmp_path, command):
    from tokenloom.bench.commands import trace_from_args
    from tokenloom.cli import build_parser

    def replayed(*flags: str):
        return trace_from_args(build_parser().parse_args([*command, "--num-requests", "20", *flags]))

    full, full_sha = replayed("--kind", "chat")
    capped, capped_sha = replayed("--kind", "chat", "--max-tokens", "64")
    assert [r.max_tokens for r in capped] == [min(r.max_tokens, 64) for r in full]
    assert any(r.max_tokens > 64 for r in full) and [r.messages for r in capped] == [r.messages for r in full]
    assert capped_sha == full_sha + "+max_tokens=64"
    write_trace(full, tmp_path / "t.jsonl")
    from_file, file_sha = replayed("--trace", str(tmp_path / "t.jsonl"), "--max-tokens", "64")
    assert from_file == capped and file_sha.endswith("+max_tokens=64") and not file_sha.startswith("generated:")


@pytest.mark.parametrize("burstiness", [1.0, 0.5])
def test_arrival_gaps_have_the_right_mean(burstiness):
    offsets = arrival_offsets(20_000, rate=4.0, burstiness=burstiness, seed=1)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)
    # A gamma with shape k has coefficient of variation 1/sqrt(k): burstier arrivals vary more.
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(burstiness**-0.5, rel=0.08)
    assert arrival_offsets(3, rate=float("inf")) == [0.0, 0.0, 0.0]


def test_bursts_arrive_together():
    requests = make_trace("agent", 30, seed=0)
    aligned = burst_aligned(requests, [float(i) for i in range(30)])
    by_burst = {}
    for request, offset in zip(requests, aligned, strict=True):
        by_burst.setdefault(request.burst, set()).add(offset)
    assert all(len(offsets) == 1 for offsets in by_burst.values())


def test_percentile_and_goodput_arithmetic():
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([1, 2, 3, 4], 95) == pytest.approx(3.85)
    assert percentile([], 50) is None
    records = [
        RequestRecord("a", 0, 200, ttft=0.5, e2e=2.0, output_tokens=10, token_gaps=[0.1] * 9),
        RequestRecord("b", 0, 200, ttft=3.0, e2e=4.0, output_tokens=20, token_gaps=[0.1] * 19),  # TTFT misses
        RequestRecord("c", 0, 429, error="busy"),
        RequestRecord("d", 0, 200, ttft=0.2, e2e=0.5, output_tokens=5, cancelled=True),
    ]
    card = scorecard(records, duration=10.0, offered_req_s=0.4, slo=SLO.parse("ttft=1,e2e=5"), cost_per_hour=3.6)
    assert set(card) == {*SCORECARD_KEYS, *SCORECARD_NOTES, *SCORECARD_SPECULATION}
    assert card["completed_req_s"] == pytest.approx(0.2)  # a and b; d was cancelled
    assert card["output_tok_s"] == pytest.approx(3.5)
    assert card["error_rate"] == pytest.approx(0.25)
    assert card["goodput_req_s"] == pytest.approx(0.1)  # only a meets every SLO
    assert card["cost_per_1k_accepted"] == pytest.approx(3.6 * 10 / 3600 / 1 * 1000)


def test_histogram_quantile_from_bucket_deltas():
    name = "tokenloom:request_queue_time_seconds_bucket"
    before = parse(f'{name}{{le="0.1"}} 5\n{name}{{le="1.0"}} 5\n{name}{{le="+Inf"}} 5\n')
    after = parse(f'{name}{{le="0.1"}} 55\n{name}{{le="1.0"}} 105\n{name}{{le="+Inf"}} 105\n')
    # 100 new observations: 50 in (0, 0.1], 50 in (0.1, 1.0]; the 95th lies 90% into the second bucket.
    assert histogram_quantile(before, after, "request_queue_time_seconds", 0.95) == pytest.approx(0.91)


def test_histogram_quantile_sums_the_buckets_of_every_replica():
    name = "tokenloom:request_queue_time_seconds_bucket"
    # Two replicas behind Ray Serve, 50 observations each: all of one's in (0, 0.1], all of the other's in (0.1, 1].
    after = parse(
        f'{name}{{le="0.1",replica="a"}} 50\n{name}{{le="1.0",replica="a"}} 50\n{name}{{le="+Inf",replica="a"}} 50\n'
        f'{name}{{le="0.1",replica="b"}} 0\n{name}{{le="1.0",replica="b"}} 50\n{name}{{le="+Inf",replica="b"}} 50\n'
    )
    assert histogram_quantile({}, after, "request_queue_time_seconds", 0.95) == pytest.approx(0.91)


@pytest.fixture(scope="module")
def bench_server(tiny_chat_model):
    proc = ServerProcess("--model", str(tiny_chat_model), "--max-model-len", "2048")
    yield proc
    proc.stop()


def test_a_real_run_fills_the_scorecard_and_cancels_server_side(bench_server, tmp_path):
    trace = tmp_path / "agent.jsonl"
    requests = make_trace("agent", 16, seed=5)
    for r in requests:  # keep the tiny model's context: short prefixes, short answers
        r.messages[0]["content"] = r.messages[0]["content"][:1500]
        r.max_tokens = min(r.max_tokens, 80)
    requests[0].cancel_after_tokens = 3
    write_trace(requests, trace)
    cancelled = sum(r.cancel_after_tokens is not None for r in requests)
    aborts_before = _aborts(bench_server)
    out = tmp_path / "run.json"
    command = [
        sys.executable,
        "-m",
        "tokenloom.cli",
        "bench",
        "serve",
        "--base-url",
        bench_server.url,
        "--trace",
        str(trace),
        "--request-rate",
        "50",
        "--burstiness",
        "0.5",
        "--slo",
        "ttft=5,e2e=60",
        "--cost-per-hour",
        "1.5",
        "--label",
        "tiny",
        "-o",
        str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    run = json.loads(out.read_text())
    card = run["scorecard"]
    assert set(card) == {*SCORECARD_KEYS, *SCORECARD_NOTES, *SCORECARD_SPECULATION}
    assert all(card[key] is not None for key in SCORECARD_KEYS), card
    assert card["error_rate"] == 0 and card["completed_req_s"] > 0
    assert len(run["records"]) == 16 and sum(r["cancelled"] for r in run["records"]) == cancelled
    provenance = run["provenance"]
    assert provenance["trace_sha256"] == read_trace(trace)[1]
    assert provenance["server_version"]["engine_config"]["max_model_len"] == 2048
    assert provenance["machine"]["cores"] >= 1
    # The server saw each cancelled stream as an abort.
    assert (
        bench_server.wait_for_metric(
            'tokenloom:request_success_total{finished_reason="abort"}', lambda v: v >= aborts_before + cancelled
        )
        >= aborts_before + cancelled
    )

    table = subprocess.run(
        [sys.executable, "-m", "tokenloom.cli", "bench", "compare", str(out), str(out), "--markdown"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert table.returncode == 0
    lines = table.stdout.strip().splitlines()
    assert lines[0].startswith("| run | offered req/s") and len(lines) == 4 and lines[2].startswith("| tiny |")


def _aborts(server: ServerProcess) -> float:
    try:
        return server.metric('tokenloom:request_success_total{finished_reason="abort"}')
    except AssertionError:
        return 0.0


def test_config_lists_parse():
    from tokenloom.bench.commands import parse_configs

    configs = parse_configs("baseline: ; budget: --max-num-batched-tokens 512; static: --batching static")
    assert configs == [
        ("baseline", []),
        ("budget", ["--max-num-batched-tokens", "512"]),
        ("static", ["--batching", "static"]),
    ]
    with pytest.raises(ValueError, match="name: --flag"):
        parse_configs("--max-num-seqs 4")


def test_sweep_ramps_until_the_limits_break_and_draws_plots(bench_server, tmp_path):
    trace = tmp_path / "chat.jsonl"
    write_trace(make_trace("chat", 6, seed=1), trace)
    out = tmp_path / "sweep"
    # A queue-time limit of zero breaks as soon as any request waits at all: the ramp must stop early.
    command = [
        sys.executable,
        "-m",
        "tokenloom.cli",
        "bench",
        "sweep",
        "--base-url",
        bench_server.url,
        "--trace",
        str(trace),
        "--request-rates",
        "2,1000,2000,4000",
        "--max-queue-p95",
        "0",
        "-o",
        str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "sweep.json").read_text())
    assert len(summary["runs"]) < 4, "the ramp should stop at the first rate that breaks the limit"
    assert (out / "latency.png").stat().st_size > 1000 and (out / "throughput.png").stat().st_size > 1000


def test_matrix_runs_one_server_per_configuration(tiny_chat_model, tmp_path):
    trace = tmp_path / "chat.jsonl"
    write_trace(make_trace("chat", 4, seed=2), trace)
    command = [
        sys.executable,
        "-m",
        "tokenloom.cli",
        "bench",
        "matrix",
        "--trace",
        str(trace),
        "--rate",
        "inf",
        "--model-path",
        str(tiny_chat_model),
        "--configs",
        "baseline: ; static: --batching static",
        "-o",
        str(tmp_path / "matrix"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "| baseline |" in result.stdout and "| static |" in result.stdout
    static = json.loads((tmp_path / "matrix" / "static.json").read_text())
    assert static["provenance"]["server_version"]["engine_config"]["batching"] == "static"
    assert static["scorecard"]["error_rate"] == 0


def _records(starts: list[float], finishes: list[float]) -> list[dict]:
    return [
        vars(RequestRecord(id=str(i), start=s, status=200, e2e=f - s))
        for i, (s, f) in enumerate(zip(starts, finishes, strict=True))
    ]


def test_a_sweep_rate_the_server_cannot_keep_up_with_misses_the_limits():
    """4 req/s offered, 1.14 completed, nothing queued on the server, no errors: saturated, not "met"."""
    import argparse

    from tokenloom.bench.commands import _missed_limits, keeping_up_rate

    args = argparse.Namespace(min_completed_fraction=0.8, max_error_rate=0.01, max_queue_p95=5.0, slo=None)
    starts = [i / 4.0 for i in range(40)]
    saturated = _records(starts, [2.0 + i / 1.14 for i in range(40)])
    card = {"offered_req_s": 4.0, "completed_req_s": 1.14, "error_rate": 0.0, "queue_time_p95_s": 0.05,
            "goodput_req_s": 1.14}  # fmt: skip
    missed = _missed_limits(card, saturated, args)
    assert len(missed) == 1 and "of 4.00 offered" in missed[0], missed
    assert keeping_up_rate(saturated) < 2.0  # far below the 4 offered
    # The same short trace served at the rate it arrives: each request 2 s, the tail no reason to miss.
    held = _records(starts, [s + 2.0 for s in starts])
    assert _missed_limits({**card, "completed_req_s": 3.3}, held, args) == []
    assert keeping_up_rate(held) == pytest.approx(4.0, rel=0.05)


def test_a_foreign_servers_memory_is_marked_as_its_api_process_only():
    from tokenloom.bench.commands import render_table
    from tokenloom.bench.server_metrics import server_figures

    vllm_like = {"process_resident_memory_bytes": 900 * 2**20}
    figures = server_figures(vllm_like, vllm_like, [])
    assert figures["memory_scope"] == "api process only"
    card = scorecard([], 1.0, 1.0, SLO(), figures)
    table = render_table([{"label": "vllm", "scorecard": card}], markdown=True)
    assert "900*" in table and "process answering /metrics only" in table
    ours = {"tokenloom:process_tree_resident_memory_bytes": 700 * 2**20, "process_resident_memory_bytes": 1.0}
    card = scorecard([], 1.0, 1.0, SLO(), server_figures(ours, ours, []))
    assert card["memory_scope"] == "process tree"
    assert "*" not in render_table([{"label": "ours", "scorecard": card}], markdown=False)
