"""`tokenloom simulate` and `tokenloom simulate profile`: the command line of simulator.py and profile.py.

    tokenloom simulate profile -o PROFILE.json [--quick] [engine flags]
    tokenloom simulate --trace T --request-rate R --seed S --profile PROFILE.json -o RUN.json [engine flags]
    tokenloom simulate --trace T --request-rate R --accelerator H100-80GB [--tensor-parallel-size 2] -o RUN.json

RUN.json has the `scorecard` (and the records) of `bench serve`'s output, so `tokenloom bench compare` reads both.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import time
from pathlib import Path
from typing import Any

from tokenloom.advisor.plan import ELEMENT_BYTES, KV_8_BIT, accelerator, load_model_config, make_plan, parameter_count
from tokenloom.bench.commands import add_replayed_trace_flags, render_table, trace_from_args
from tokenloom.bench.cost_model import (
    DATASHEETS,
    Device,
    Profile,
    RooflineStepModel,
    StepModel,
    datasheet,
)
from tokenloom.bench.profile import QUICK, SERVED_REQUESTS, Grid, profile_engine
from tokenloom.bench.scorecard import SLO
from tokenloom.bench.simulator import (
    SimulatedEngine,
    arrivals,
    offered_rate,
    prompt_tokens,
    simulate,
    simulated_requests,
)
from tokenloom.config import EngineConfig
from tokenloom.engine.kv_sizing import swap_blocks_for
from tokenloom.model.config import ModelConfig
from tokenloom.model.gguf_linear import served_weight_bytes
from tokenloom.model.loader import gguf_file_of
from tokenloom.version import git_commit


def add_simulate_command(commands) -> argparse.ArgumentParser:
    """The simulate command without its engine flags, which the CLI adds (as it does for serve). The engine's
    --seed (0 by default, as `bench serve`'s) seeds the arrivals: a simulated engine samples nothing."""
    simulate_parser = commands.add_parser(
        "simulate", help="the engine's scheduler on a trace in simulated time, with a measured or datasheet step cost"
    )
    simulate_parser.add_argument(
        "what", nargs="?", choices=("run", "profile"), default="run",
        help="run (default): simulate a trace; profile: measure this machine's steps and fit the step model",
    )  # fmt: skip
    simulate_parser.add_argument("-o", "--output", required=True, help="RUN.json, or PROFILE.json for profile")
    simulate_parser.add_argument("--request-rate", default="inf", help="requests per second, or inf")
    simulate_parser.add_argument("--profile", default=None, help="a `tokenloom simulate profile` output")
    simulate_parser.add_argument(
        "--accelerator", default=None, help=f"a datasheet roofline instead of a profile: {', '.join(DATASHEETS)}"
    )
    simulate_parser.add_argument(
        "--output-lengths", default=None,
        help="a `bench serve` RUN.json whose requests' output lengths stand in for max_tokens (the model's own ends)",
    )  # fmt: skip
    simulate_parser.add_argument("--quick", action="store_true", help="profile: a small grid (for tests)")
    simulate_parser.add_argument(
        "--from-steps", default=None, help="profile: refit the steps another profile measured, measuring nothing"
    )
    simulate_parser.add_argument(
        "--front-requests", type=int, default=12, help="profile: requests sent over HTTP to time the front (0: none)"
    )
    simulate_parser.add_argument(
        "--served-requests", type=int, default=SERVED_REQUESTS,
        help="profile: requests of a trace served with --step-log, whose steps fit the served overhead (0: none)",
    )  # fmt: skip
    trace = simulate_parser.add_argument_group("the trace, as `bench serve` takes it")
    add_replayed_trace_flags(trace)
    trace.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson; below 1: burstier")
    trace.add_argument("--slo", default=None, help="e.g. ttft=2,itl=0.2,e2e=30 (seconds)")
    trace.add_argument("--cost-per-hour", type=float, default=None, help="USD per hour of the serving machine")
    trace.add_argument("--label", default=None)
    return simulate_parser


def run_simulate(args: argparse.Namespace, config: EngineConfig) -> int:
    if args.what == "profile":
        started = time.monotonic()
        if args.from_steps:
            profile = Profile.read(args.from_steps).refitted()
        else:
            grid = QUICK if args.quick else Grid()
            profile = profile_engine(
                config, grid, front_requests=args.front_requests, served_requests=args.served_requests
            )
        profile.write(args.output)
        error = profile.step_model.fit_error
        print(
            f"{args.output}: {len(profile.steps)} steps measured in {time.monotonic() - started:.0f}s; step model "
            f"error on {error['held_out_steps']} held-out steps: p50 {error['p50']:.1%}, p90 {error['p90']:.1%}; "
            f"{error.get('outlying_steps', 0)} outlying steps set aside"
        )
        return 0
    run = simulate_run(args, config)
    Path(args.output).write_text(json.dumps(run, indent=2))
    print(render_table([run], markdown=False))
    return 0


def simulate_run(args: argparse.Namespace, config: EngineConfig) -> dict[str, Any]:
    if config.speculative.speculative_config:
        raise ValueError("simulate does not model speculative decoding: leave out --speculative-config")
    requests, sha = trace_from_args(args)
    rate = math.inf if str(args.request_rate) == "inf" else float(args.request_rate)
    name, model = load_model_config(config.model.model)
    engine, step_model = simulated_setup(args, config, model)
    started = datetime.datetime.now(datetime.UTC).isoformat()
    lengths = measured_output_lengths(args.output_lengths) if args.output_lengths else None
    tokenize = trace_tokenizer(config.model.model, args.tokenizer)
    prompts = [tokenize(r) for r in requests]
    simulated = simulated_requests(requests, arrivals(requests, rate, args.burstiness, args.seed), prompts, lengths)
    result = simulate(engine, step_model, simulated, set(model.eos_token_ids))
    card = result.card(offered_rate(rate, simulated, result.duration), SLO.parse(args.slo), args.cost_per_hour)
    return {
        "label": args.label or Path(args.output).stem,
        "scorecard": card,
        "records": [vars(r) for r in result.records],
        "provenance": {
            "simulated": True,
            "step_model": step_model.name,
            "model": name,
            "trace_sha256": sha,
            "request_rate": args.request_rate,
            "burstiness": args.burstiness,
            "seed": args.seed,
            "num_requests": len(requests),
            "steps": result.steps,
            "num_kv_blocks": engine.num_kv_blocks,
            "engine_flags": config.to_dict(),
            "started": started,
            "git_commit": git_commit(),
        },
    }


def simulated_setup(
    args: argparse.Namespace, config: EngineConfig, model: ModelConfig
) -> tuple[SimulatedEngine, StepModel]:
    if (args.profile is None) == (args.accelerator is None):
        raise ValueError("give one of --profile (a `tokenloom simulate profile` output) or --accelerator NAME")
    if args.accelerator is not None:
        return roofline_setup(args.accelerator, model, config, config.parallel.tensor_parallel_size)
    return profile_setup(Profile.read(args.profile), config, model)


def profile_setup(profile: Profile, config: EngineConfig, model: ModelConfig) -> tuple[SimulatedEngine, StepModel]:
    """This machine's engine as the profile measured it (the flags may shrink its KV pool or context)."""
    measured = profile.engine
    element = ELEMENT_BYTES[str(measured["dtype"])]
    measured_len = int(measured["max_model_len"] or 0)
    engine = SimulatedEngine(
        config,
        num_kv_blocks=config.cache.num_kv_blocks or int(measured["num_kv_blocks"] or 0),
        max_model_len=min(config.model.max_model_len or measured_len, measured_len),
        num_swap_blocks=swap_blocks_for(config, int(measured["kv_bytes_per_block"] or 1)),
        kv_bytes_per_block=int(measured["kv_bytes_per_block"] or 0),
        weights_bytes=profiled_weight_bytes(measured, config, model, element),
        front_latency_s=profile.front_latency_s,
    )
    return engine, profile.served_step_model()


def profiled_weight_bytes(measured: dict[str, Any], config: EngineConfig, model: ModelConfig, element: int) -> int:
    """What the profiled engine's weights held, as it measured them; in a profile from before it recorded them, a
    GGUF's blocks where it served them, else its parameters at its dtype."""
    if measured.get("weight_bytes") is not None:
        return int(measured["weight_bytes"])
    gguf = gguf_file_of(config.model.model)
    if measured.get("quantization") == "gguf" and gguf is not None:
        return served_weight_bytes(gguf)
    return parameter_count(model) * element


def roofline_setup(
    name: str, model: ModelConfig, config: EngineConfig, tensor_parallel: int
) -> tuple[SimulatedEngine, RooflineStepModel]:
    """A datasheet device's engine: its KV pool as `tokenloom plan` sizes it, bf16 weights, and its roofline."""
    device = accelerator(name)
    sheet = datasheet(device.name)
    kv_dtype = config.cache.kv_cache_dtype if config.cache.kv_cache_dtype in KV_8_BIT else "bf16"
    max_model_len = min(config.model.max_model_len or model.max_position_embeddings, model.max_position_embeddings)
    plan = make_plan(
        model, device.name, max_model_len, config.scheduler.max_num_seqs, device, "bf16", kv_dtype, tensor_parallel,
        config.cache.gpu_memory_utilization, config.scheduler.max_num_batched_tokens, config.cache.block_size,
    )  # fmt: skip
    if plan.num_kv_blocks < 1:
        raise ValueError(f"{model.architecture} does not fit on {tensor_parallel} x {device.name}")
    per_block = plan.kv_bytes_per_token * config.cache.block_size
    engine = SimulatedEngine(
        config,
        num_kv_blocks=config.cache.num_kv_blocks or plan.num_kv_blocks,
        max_model_len=max_model_len,
        num_swap_blocks=swap_blocks_for(config, per_block),
        kv_bytes_per_block=per_block,
        weights_bytes=plan.weights_bytes,
    )
    step = RooflineStepModel(
        f"roofline of {tensor_parallel} x {device.name} (datasheet)",
        model,
        Device(device.name, sheet.bf16_flops, device.bandwidth_bytes_s, sheet.link_bytes_s),
        tensor_parallel,
        kv_element_bytes=1 if kv_dtype in KV_8_BIT else 2,
        block_size=config.cache.block_size,
    )
    return engine, step


def measured_output_lengths(path: str) -> dict[str, int]:
    """Each completed request's output length in a `bench serve` run (cancelled and failed ones left out)."""
    run = json.loads(Path(path).read_text())
    return {r["id"]: r["output_tokens"] for r in run["records"] if r["status"] == 200 and not r["cancelled"]}


def trace_tokenizer(model: str | None, tokenizer_model: str | None = None):
    """A trace request's prompt tokens with the tokenizer of `tokenizer_model`, else of `model` (a checkpoint or a
    GGUF); the embedded model's for None or a config.json (shapes only: it has no tokenizer beside it)."""
    from tokenloom.model.loader import load_tokenizer

    if tokenizer_model is None and model is not None and model.endswith(".json"):
        model = None
    tokenizer = load_tokenizer(tokenizer_model or model)
    if tokenizer is None:
        raise ValueError("the model has no tokenizer: a trace's messages cannot be turned into prompt tokens")
    return prompt_tokens(tokenizer)
