"""Capacity planning: weights + KV cache at a concurrency and context + runtime overhead + safety margin.

KV bytes per token come from `ModelConfig.kv_bytes_per_token`, the same method the engine sizes its pool with.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import get_args

from tokenloom.advisor.weights import CPU, ELEMENT_BYTES, auto_dtype, weights_as_served, weights_read_per_step
from tokenloom.config import KVCacheDType
from tokenloom.model.config import ModelConfig
from tokenloom.model.gguf_linear import served_weight_bytes
from tokenloom.model.loader import count_parameters, gguf_file_of, resolve_checkpoint_dir
from tokenloom.model.quantization import gguf_linear_available

GiB = 1024**3

# The engine's 8-bit KV formats (--kv-cache-dtype): a byte per value and a float32 scale per token and KV head.
KV_8_BIT = tuple(name for name in get_args(KVCacheDType) if name != "auto")
KV_DTYPES = sorted({*ELEMENT_BYTES, *KV_8_BIT})


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str) -> int:
    """What the engine allocates per token for this KV dtype: the same ModelConfig method, scales included."""
    if kv_dtype in KV_8_BIT:
        return cfg.kv_bytes_per_token(1, kv_dtype)
    return cfg.kv_bytes_per_token(ELEMENT_BYTES[kv_dtype])


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_bytes: int
    bandwidth_bytes_s: float
    runtime_overhead_bytes: int  # CUDA context, allocator slack, framework: not available to the model


GPU_RUNTIME = 1 * GiB
CATALOGUE = {
    a.name.lower(): a
    for a in (
        Accelerator("A100-40GB", 40 * GiB, 1555e9, GPU_RUNTIME),
        Accelerator("A100-80GB", 80 * GiB, 2039e9, GPU_RUNTIME),
        Accelerator("H100-80GB", 80 * GiB, 3350e9, GPU_RUNTIME),
        Accelerator("H200-141GB", 141 * 10**9, 4800e9, GPU_RUNTIME),
        Accelerator("B200-192GB", 192 * 10**9, 8000e9, GPU_RUNTIME),
        Accelerator("RTX4090-24GB", 24 * GiB, 1008e9, GPU_RUNTIME),
        Accelerator("RTX5090-32GB", 32 * GiB, 1792e9, GPU_RUNTIME),
        Accelerator("L4-24GB", 24 * GiB, 300e9, GPU_RUNTIME),
        Accelerator("L40S-48GB", 48 * GiB, 864e9, GPU_RUNTIME),
    )
}


def this_cpu(bandwidth_bytes_s: float = 20e9) -> Accelerator:
    """This machine, from its available memory; the bandwidth is a nominal dual-channel figure."""
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    return Accelerator("cpu", available, bandwidth_bytes_s, 512 * 1024**2)


def accelerator(name: str) -> Accelerator:
    if name.lower() == "cpu":
        return this_cpu()
    found = CATALOGUE.get(name.lower())
    if found is None:
        known = ", ".join([*(a.name for a in CATALOGUE.values()), "cpu"])
        raise ValueError(f"unknown accelerator {name!r}; known: {known} (or give --memory GiB)")
    return found


def parameter_count(cfg: ModelConfig) -> int:
    """The model's parameters, as its family's model file builds it (model/registry.py), on the meta device."""
    return count_parameters(cfg)


def overhead_bytes(cfg: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, element_bytes: int) -> int:
    """Activations of the largest step (hidden states, q/k/v, the MLP's widest layer) and the sampled logits."""
    per_token = (
        4 * cfg.hidden_size + 2 * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + 3 * cfg.intermediate_size
    ) * element_bytes
    logits = max_num_seqs * cfg.vocab_size * 4 * 2  # float32 logits and their softmax
    return max_num_batched_tokens * per_token + logits


@dataclass
class Plan:
    model: str
    accelerator: str
    memory_bytes: int
    usable_bytes: int
    weights_bytes: int
    kv_bytes_per_token: int
    kv_bytes_total: int
    overhead_bytes: int
    safety_margin_bytes: int
    fits: bool
    max_concurrency: int
    max_context: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    decode_tokens_per_s: float  # bandwidth-bound estimate at the target concurrency and context
    kv_dtype: str = "fp32"
    weights_dtype: str = "fp32"  # or "gguf": a GGUF served from its blocks (gguf_linear.served_weight_bytes)


def make_plan(
    cfg: ModelConfig,
    model_name: str,
    context: int,
    concurrency: int,
    device: Accelerator,
    weights_dtype: str = "fp32",
    kv_dtype: str = "fp32",
    tensor_parallel: int = 1,
    utilization: float = 0.9,
    max_num_batched_tokens: int | None = None,
    block_size: int = 16,
    served_weight_bytes: int | None = None,
) -> Plan:
    """The plan at this context and concurrency; `served_weight_bytes`, where given, are what the weights take as
    served (a GGUF's blocks: weights_dtype is then the activations' and the dequantized tensors')."""
    if kv_dtype not in KV_DTYPES or weights_dtype not in ELEMENT_BYTES:
        raise ValueError(
            f"weight dtypes are one of {', '.join(ELEMENT_BYTES)}; KV dtypes one of {', '.join(KV_DTYPES)}"
        )
    if not 0 < utilization <= 1 or tensor_parallel < 1 or context < 1 or concurrency < 1:
        raise ValueError("utilization in (0, 1], tensor_parallel, context and concurrency >= 1")
    budget = max_num_batched_tokens or 2048  # the engine's default step budget
    memory = device.memory_bytes * tensor_parallel
    margin = int(memory * (1 - utilization))
    usable = memory - margin - device.runtime_overhead_bytes * tensor_parallel
    weights = served_weight_bytes or weights_as_served(cfg, weights_dtype, device)
    per_token = kv_bytes_per_token(cfg, kv_dtype)
    overhead = overhead_bytes(cfg, budget, min(concurrency, 256), ELEMENT_BYTES[weights_dtype]) * tensor_parallel
    kv_room = max(0, usable - weights - overhead)
    kv_total = per_token * context * concurrency
    model_limit = cfg.max_position_embeddings
    max_concurrency = kv_room // (per_token * context)
    max_context = min(model_limit, kv_room // (per_token * concurrency))
    read = weights_read_per_step(cfg, weights, weights_dtype, device, served_weight_bytes is not None)
    step_bytes = read + concurrency * context * per_token  # one decode step reads the weights and every context
    return Plan(
        model=model_name,
        accelerator=device.name,
        memory_bytes=memory,
        usable_bytes=usable,
        weights_bytes=weights,
        kv_bytes_per_token=per_token,
        kv_bytes_total=kv_total,
        overhead_bytes=overhead,
        safety_margin_bytes=margin,
        fits=weights + overhead + kv_total <= usable and context <= model_limit,
        max_concurrency=int(max_concurrency),
        max_context=int(max_context),
        max_num_seqs=int(max(1, min(concurrency, max_concurrency, 256))),
        max_num_batched_tokens=budget,
        num_kv_blocks=int(kv_room // (per_token * block_size)),
        decode_tokens_per_s=concurrency * device.bandwidth_bytes_s * tensor_parallel / step_bytes,
        kv_dtype=kv_dtype,
        weights_dtype="gguf" if served_weight_bytes else weights_dtype,
    )


def render(plan: Plan) -> str:
    def gib(n: int) -> str:
        return f"{n / GiB:.2f} GiB"

    verdict = "fits" if plan.fits else "does NOT fit"
    served = " (the GGUF served from its blocks)" if plan.weights_dtype == "gguf" else ""
    return "\n".join(
        [
            f"{plan.model} on {plan.accelerator}: {verdict}",
            f"  memory {gib(plan.memory_bytes)}, usable {gib(plan.usable_bytes)} "
            f"after a {gib(plan.safety_margin_bytes)} safety margin and the runtime",
            f"  weights {gib(plan.weights_bytes)}{served}; KV {plan.kv_bytes_per_token / 1024:.1f} KiB per token, "
            f"{gib(plan.kv_bytes_total)} at the target; activations and logits {gib(plan.overhead_bytes)}",
            f"  largest concurrency at this context: {plan.max_concurrency}; longest context at this concurrency: "
            f"{plan.max_context}",
            f"  start with: --max-num-seqs {plan.max_num_seqs} --max-num-batched-tokens {plan.max_num_batched_tokens} "
            f"--num-kv-blocks {plan.num_kv_blocks}"
            + (f" --kv-cache-dtype {plan.kv_dtype}" if plan.kv_dtype in KV_8_BIT else ""),
            f"  decode-bound estimate: {plan.decode_tokens_per_s:.0f} tokens/s in all at the target",
        ]
    )


def load_model_config(model: str | None) -> tuple[str, ModelConfig]:
    """A checkpoint directory, a GGUF file, a config.json, or None for the embedded default."""
    if model is not None and Path(model).name.endswith(".json"):
        return Path(model).parent.name or model, ModelConfig.from_hf(json.loads(Path(model).read_text()))
    name, path = resolve_checkpoint_dir(model)
    return name, ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


def add_plan_command(commands) -> None:
    plan = commands.add_parser(
        "plan", help="will this model fit, at this concurrency and context, and with which flags"
    )
    plan.add_argument("--model", default=None, help="a checkpoint dir, a GGUF, a config.json (default: embedded)")
    plan.add_argument("--context", type=int, default=4096)
    plan.add_argument("--concurrency", type=int, default=64)
    plan.add_argument(
        "--kv-dtype", default=None, choices=KV_DTYPES,
        help="default: the model's dtype; int8, fp8, fp8_e4m3, fp8_e5m2: the engine's --kv-cache-dtype (scales too)",
    )  # fmt: skip
    plan.add_argument(
        "--weights-dtype",
        default=None,
        choices=sorted(ELEMENT_BYTES),
        help="default: the engine's dtype auto (bf16 on accelerators and on CPUs with native bf16, else fp32); "
        "a GGUF in fp32 on this CPU counts the blocks it is served from",
    )
    plan.add_argument("--accelerator", default="cpu", help=f"{', '.join(a.name for a in CATALOGUE.values())}, cpu")
    plan.add_argument("--memory", type=float, default=None, help="GiB of a device not in the catalogue")
    plan.add_argument("--tensor-parallel", type=int, default=1)
    plan.add_argument("--utilization", type=float, default=0.9)
    plan.add_argument("--max-num-batched-tokens", type=int, default=None)
    plan.add_argument("--all", action="store_true", help="a table over the whole catalogue")
    plan.add_argument("--json", action="store_true")
    plan.add_argument("--target-rps", type=float, default=None, help="requests/s the deployment must serve")
    plan.add_argument(
        "--capacity-from", default=None, help="a `tokenloom bench sweep` output (its sweep.json, or the directory)"
    )
    plan.add_argument("--slo", default=None, help="the SLO the capacity must have been measured under (as the sweep's)")
    plan.add_argument("--headroom", type=float, default=0.8, help="the share of measured capacity to plan for")
    simulated = plan.add_argument_group(
        "simulated plans (--target-rps with --trace): the cheapest layout per accelerator, --accelerator A,B,..."
    )
    simulated.add_argument("--trace", default=None, help="a `tokenloom bench trace` file the deployment must serve")
    simulated.add_argument(
        "--cost-per-hour", default=None, help="USD per device-hour: one figure, or A=2.5,B=3.4 per accelerator"
    )
    simulated.add_argument("--profile", default=None, help="this machine's `tokenloom simulate profile`, for cpu")
    simulated.add_argument("--slo-attainment", type=float, default=0.95, help="the share of requests within the SLO")
    simulated.add_argument("--seed", type=int, default=0, help="the arrivals' seed, as bench serve's")
    simulated.add_argument(
        "--tokenizer", default=None,
        help="counts the trace's prompt tokens (default: the model's; for a config.json, the embedded model's)",
    )  # fmt: skip


def run_plan(args) -> int:
    name, cfg = load_model_config(args.model)
    if args.target_rps is not None:
        return _plan_replicas(args, name, cfg)
    devices = [*list(CATALOGUE.values()), this_cpu()] if args.all else [_device(args)]
    plans = []
    for device in devices:
        weights_dtype, kv_dtype, served = as_the_engine_runs(
            args.model, args.weights_dtype, args.kv_dtype, device, args.tensor_parallel
        )
        plan = make_plan(
            cfg, name, args.context, args.concurrency, device, weights_dtype, kv_dtype, args.tensor_parallel,
            args.utilization, args.max_num_batched_tokens, served_weight_bytes=served,
        )  # fmt: skip
        plans.append(plan)
    if args.json:
        print(json.dumps([asdict(p) for p in plans] if args.all else asdict(plans[0]), indent=2))
    elif args.all:
        print(
            f"| accelerator | fits | weights GiB | KV GiB | max concurrency @ {args.context} | "
            f"max context @ {args.concurrency} | decode tok/s |"
        )
        print("|---|---|---:|---:|---:|---:|---:|")
        for p in plans:
            print(
                f"| {p.accelerator} | {'yes' if p.fits else 'no'} | {p.weights_bytes / GiB:.1f} | "
                f"{p.kv_bytes_total / GiB:.1f} | {p.max_concurrency} | {p.max_context} | {p.decode_tokens_per_s:.0f} |"
            )
    else:
        print(render(plans[0]))
    return 0


def as_the_engine_runs(
    model: str | None, asked: str | None, kv_asked: str | None, device: Accelerator, tensor_parallel: int
) -> tuple[str, str, int | None]:
    """The weights' dtype, the KV cache's, and the weights' bytes where they are not parameters x dtype, as the engine
    runs them on `device`: the weights `asked`, else its dtype auto (bf16 on accelerators and on a CPU that
    multiplies bf16 natively, float32 on other CPUs); the cache `kv_asked`, else the model's dtype (8-bit weights
    keep it: only --kv-cache-dtype makes it 8-bit); the bytes where a GGUF is served from its blocks
    (engine/core_setup.served_quantization: float32 on a CPU, one rank), else None."""
    auto = auto_dtype(device)
    dtype = asked or auto
    kv_dtype = kv_asked or (dtype if ELEMENT_BYTES[dtype] > 1 else auto)
    gguf = gguf_file_of(model) if device.name == "cpu" else None
    if gguf is None or ELEMENT_BYTES[dtype] != 4 or tensor_parallel != 1 or not gguf_linear_available(CPU):
        return dtype, kv_dtype, None
    return dtype, kv_dtype, served_weight_bytes(gguf)


def _device(args) -> Accelerator:
    if args.memory is not None:
        return Accelerator(f"custom-{args.memory:g}GiB", int(args.memory * GiB), 1000e9, GPU_RUNTIME)
    return accelerator(args.accelerator)


@dataclass(frozen=True)
class ReplicaPlan:
    target_rps: float
    capacity_req_s: float  # one replica's, measured (or scaled from the measurement, for another accelerator)
    measured_on: str
    accelerator: str
    tensor_parallel: int
    replicas: int
    estimated: bool  # scaled by decode bandwidth from another machine's measurement


def replicas_needed(target_rps: float, capacity_req_s: float, headroom: float) -> int:
    """Replicas that serve target_rps with each at no more than `headroom` of its measured capacity."""
    if capacity_req_s <= 0 or not 0 < headroom <= 1:
        raise ValueError("capacity must be positive and headroom in (0, 1]")
    return max(1, math.ceil(target_rps / (capacity_req_s * headroom)))


def read_sweep(path: str, slo: str | None) -> dict:
    """A sweep's summary; ValueError if it found no capacity, or was measured under another SLO than asked."""
    file = Path(path) / "sweep.json" if Path(path).is_dir() else Path(path)
    summary = json.loads(file.read_text())
    if summary.get("capacity_req_s") is None:
        raise ValueError(f"{file}: no offered rate met the sweep's limits, so there is no capacity to plan from")
    if slo is not None and summary.get("slo") != slo:
        raise ValueError(f"{file} was measured under SLO {summary.get('slo')!r}, not {slo!r}: sweep again with it")
    return summary


def _plan_replicas(args, name: str, cfg: ModelConfig) -> int:
    """How many replicas, of which accelerator, at which TP: the measured per-replica capacity, scaled by decode
    bandwidth when the accelerator differs from the one measured, at the smallest TP whose plan fits."""
    if args.capacity_from is None:
        raise ValueError("--target-rps needs --capacity-from: a `tokenloom bench sweep` of one replica")
    summary = read_sweep(args.capacity_from, args.slo)
    measured = float(summary["capacity_req_s"])
    provenance = summary.get("provenance") or {}
    measured_on = str((provenance.get("server_version") or {}).get("device") or "cpu")
    device = _device(args)

    def plan_at(tp: int, on: Accelerator) -> Plan:
        weights_dtype, kv_dtype, served = as_the_engine_runs(args.model, args.weights_dtype, args.kv_dtype, on, tp)
        return make_plan(
            cfg, name, args.context, args.concurrency, on, weights_dtype, kv_dtype, tp,
            args.utilization, args.max_num_batched_tokens, served_weight_bytes=served,
        )  # fmt: skip

    tp = next((t for t in (1, 2, 4, 8) if plan_at(t, device).fits), None)
    if tp is None:
        raise ValueError(f"{name} does not fit on 8 x {device.name} at context {args.context}")
    estimated = device.name != "cpu" or tp != 1
    capacity = measured
    if estimated:  # decode-bound: capacity follows the decode rate the plan estimates
        capacity = measured * plan_at(tp, device).decode_tokens_per_s / plan_at(1, this_cpu()).decode_tokens_per_s
    result = ReplicaPlan(
        args.target_rps, capacity, measured_on, device.name, tp, replicas_needed(args.target_rps, capacity,
        args.headroom), estimated,
    )  # fmt: skip
    if args.json:
        print(json.dumps(asdict(result), indent=2))
        return 0
    how = "estimated from the measurement by decode bandwidth" if estimated else "measured"
    print(
        f"{result.replicas} replica(s) of {name} on {result.accelerator} at tensor parallel {result.tensor_parallel}: "
        f"{args.target_rps:g} req/s at {args.headroom:.0%} of {capacity:.2f} req/s per replica ({how}; sweep "
        f"{summary.get('runs', [''])[-1]} on {measured_on}, SLO {summary.get('slo') or 'none'})"
    )
    return 0
