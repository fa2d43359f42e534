"""`tokenloom plan --target-rps R --slo ... --trace T --accelerator A[,B,...]`: the cheapest layout per accelerator.

For each accelerator, each tensor-parallel size whose memory plan fits (1, 2, 4, 8), and each replica count, one
replica is simulated (bench/simulator.py) on the trace at its share of the target rate (a Poisson stream split
evenly over replicas is a Poisson stream at rate R / replicas). A layout meets the SLO when at least
`attainment` of its requests meet every target (the scorecard's goodput over the requests); the fewest replicas
that do are found by doubling and then bisection. Per accelerator the layout with the lowest cost per 1,000
accepted responses is kept (with no price, the one with the fewest devices).

Step times come from a datasheet roofline (bench/cost_model.py) for the catalogued GPUs, or from this machine's
profile for `cpu` (`tokenloom simulate profile`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from tokenloom.bench.cost_model import StepModel
from tokenloom.bench.scorecard import SLO
from tokenloom.bench.simulator import SimulatedEngine, arrivals, simulate, simulated_requests
from tokenloom.bench.trace import TraceRequest

MAX_REPLICAS = 1024
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Layout:
    accelerator: str
    tensor_parallel: int
    replicas: int
    attainment: float  # share of requests meeting the SLO, one replica at its share of the rate
    ttft_p95_s: float | None
    itl_p95_s: float | None
    goodput_req_s: float  # of the whole deployment: the target rate times the share within the SLO
    cost_per_hour: float | None
    cost_per_1k_accepted: float | None

    @property
    def devices(self) -> int:
        return self.tensor_parallel * self.replicas


# accelerator, tensor parallel size -> the simulated engine and its step model, or None where the model does not fit
Setup = Callable[[str, int], tuple[SimulatedEngine, StepModel] | None]


@dataclass
class Target:
    rps: float
    slo: SLO
    attainment: float = 0.95
    seed: int = 0
    burstiness: float = 1.0


def replica_attainment(
    engine: SimulatedEngine,
    step: StepModel,
    trace: list[TraceRequest],
    prompts: list[list[int]],
    target: Target,
    replicas: int,
) -> tuple[float, dict]:
    """One replica's share of requests meeting the SLO at rate target.rps / replicas, and its scorecard."""
    rate = target.rps / replicas
    requests = simulated_requests(trace, arrivals(trace, rate, target.burstiness, target.seed), prompts)
    result = simulate(engine, step, requests)
    card = result.card(rate, target.slo)
    met = sum(1 for r in result.records if target.slo.met_by(r))
    return met / len(result.records), card


def fewest_replicas(attained: Callable[[int], bool]) -> int | None:
    """The smallest n with attained(n), assuming more replicas never do worse: doubling, then bisection."""
    high = 1
    while not attained(high):
        high *= 2
        if high > MAX_REPLICAS:
            return None
    low = high // 2  # attained(low) is False, or low is 0
    while high - low > 1:
        middle = (low + high) // 2
        if attained(middle):
            high = middle
        else:
            low = middle
    return high


def cheapest_layout(
    accelerator: str,
    setup: Setup,
    trace: list[TraceRequest],
    prompts: list[list[int]],
    target: Target,
    price_per_device_hour: float | None,
    sizes: tuple[int, ...] = TENSOR_PARALLEL_SIZES,
) -> Layout | None:
    best: Layout | None = None
    for tp in sizes:
        made = setup(accelerator, tp)
        layout = None if made is None else layout_at(accelerator, tp, *made, trace, prompts, target,
                                                     price_per_device_hour)  # fmt: skip
        if layout is not None and (best is None or _cheaper(layout, best)):
            best = layout
    return best


def layout_at(
    accelerator: str,
    tp: int,
    engine: SimulatedEngine,
    step: StepModel,
    trace: list[TraceRequest],
    prompts: list[list[int]],
    target: Target,
    price_per_device_hour: float | None,
) -> Layout | None:
    """The fewest replicas of this tensor-parallel size that meet the target, or None within MAX_REPLICAS."""
    cards: dict[int, tuple[float, dict]] = {}

    def attained(n: int) -> bool:
        cards[n] = replica_attainment(engine, step, trace, prompts, target, n)
        return cards[n][0] >= target.attainment

    replicas = fewest_replicas(attained)
    if replicas is None:
        return None
    share, card = cards[replicas]
    goodput = target.rps * share  # in steady state; a finite trace's own rate counts its tail too
    hourly = None if price_per_device_hour is None else price_per_device_hour * tp * replicas
    per_1k = None if hourly is None or goodput <= 0 else hourly / (goodput * 3600) * 1000
    return Layout(accelerator, tp, replicas, share, card["ttft_p95_s"], card["itl_p95_s"], goodput, hourly, per_1k)


def _cheaper(a: Layout, b: Layout) -> bool:
    if a.cost_per_1k_accepted is not None and b.cost_per_1k_accepted is not None:
        return a.cost_per_1k_accepted < b.cost_per_1k_accepted
    return a.devices < b.devices


def parse_prices(text: str | None, accelerators: list[str]) -> dict[str, float | None]:
    """'2.5' (every accelerator) or 'H100-80GB=2.5,H200-141GB=3.4' -> USD per device-hour by accelerator."""
    prices: dict[str, float | None] = dict.fromkeys(accelerators)
    if not text:
        return prices
    if "=" not in text:
        return dict.fromkeys(accelerators, float(text))
    for part in text.split(","):
        name, _, value = part.partition("=")
        matches = [a for a in accelerators if a.lower() == name.strip().lower()]
        if not matches:
            raise ValueError(f"--cost-per-hour names {name!r}, not one of --accelerator {','.join(accelerators)}")
        prices[matches[0]] = float(value)
    return prices


def render_layouts(layouts: list[tuple[str, Layout | None]], target: Target) -> str:
    lines = [
        f"cheapest layout per accelerator for {target.rps:g} req/s, {target.attainment:.0%} of requests within the SLO",
        "| accelerator | tensor parallel | replicas | devices | SLO met | TTFT p95 | ITL p95 | goodput req/s | "
        "$/hour | $ per 1k accepted |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, layout in layouts:
        if layout is None:
            lines.append(f"| {name} | - | - | - | no layout of up to {MAX_REPLICAS} replicas | | | | | |")
            continue
        lines.append(
            f"| {name} | {layout.tensor_parallel} | {layout.replicas} | {layout.devices} | {layout.attainment:.0%} | "
            f"{_seconds(layout.ttft_p95_s)} | {_seconds(layout.itl_p95_s)} | {layout.goodput_req_s:.2f} | "
            f"{_money(layout.cost_per_hour)} | {_money(layout.cost_per_1k_accepted)} |"
        )
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.3f} s"


def _money(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def run_capacity_plan(args) -> int:
    """`tokenloom plan --target-rps R --trace T --accelerator A[,B]`: one table, an accelerator per row."""
    from tokenloom.advisor.plan import load_model_config
    from tokenloom.bench.cost_model import Profile
    from tokenloom.bench.simulate_command import profile_setup, roofline_setup, trace_tokenizer
    from tokenloom.bench.trace import read_trace
    from tokenloom.config import EngineConfig

    if args.target_rps is None or args.target_rps <= 0:
        raise ValueError("--trace plans need a positive --target-rps")
    config = EngineConfig.from_kwargs(model=args.model)
    _, model = load_model_config(args.model)
    trace, _ = read_trace(args.trace)
    tokenize = trace_tokenizer(args.model, args.tokenizer)
    prompts = [tokenize(r) for r in trace]
    names = [n.strip() for n in args.accelerator.split(",") if n.strip()]
    prices = parse_prices(args.cost_per_hour, names)
    profile = Profile.read(args.profile) if args.profile else None

    def setup(name: str, tp: int) -> tuple[SimulatedEngine, StepModel] | None:
        if name.lower() == "cpu":
            if profile is None:
                raise ValueError("--accelerator cpu simulates this machine: give its --profile")
            return profile_setup(profile, config, model) if tp == 1 else None
        try:
            return roofline_setup(name, model, config, tp)
        except ValueError as error:
            if "does not fit" in str(error):
                return None
            raise

    target = Target(args.target_rps, SLO.parse(args.slo), args.slo_attainment, args.seed)
    layouts = [(n, cheapest_layout(n, setup, trace, prompts, target, prices[n])) for n in names]
    print(render_layouts(layouts, target))
    return 0
