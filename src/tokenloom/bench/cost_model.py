"""What a step costs, for the simulator (simulator.py): a fitted model of this machine, or a roofline from a datasheet.

A step is described by a few sums over its scheduled requests (`StepShape`), the ones a forward pass's cost grows
with: the tokens through the linears, the rows whose logits are computed, the query-key pairs of prefill attention,
the keys decode rows read, the sequences, and the KV blocks copied for swapping. Vidur (MLSys 2024) fits one
regressor per operator; on these machines one line over these sums, fitted to the engine's whole measured steps
(scheduling, the model, sampling and output processing together; steps far off the line, as a VM's neighbour
makes them, set aside), is what `tokenloom simulate profile` makes, and its error on held-out steps is in the profile
(`fit_error`). A server's steps cost more than the engine's alone (its event loop and streams share the cores, and
each turn of its engine loop hands the outputs over): `ServedOverhead`, fitted from the logged steps of a trace
served over HTTP, adds that.

For accelerators not at hand, `RooflineStepModel` takes a datasheet (bf16 FLOP/s, memory bandwidth) and the
model's shapes: a step takes its layers' launch cost plus the larger of its FLOPs and its bytes at the peak rates
times an efficiency, plus the host's time per step. The efficiencies and the host time are assumptions, said in
`Efficiency`; when a device has been profiled, its fitted model replaces them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tokenloom.advisor.plan import parameter_count
from tokenloom.core.scheduler_output import SchedulerOutput
from tokenloom.model.config import ModelConfig

FEATURES = (
    "steps", "tokens", "sampled_rows", "chunk_pairs", "past_pairs", "past_tokens", "prefill_sequences", "decode_keys",
    "sequences", "mixed_steps", "copied_blocks",
)  # fmt: skip
# One scheduled request of a step, as a profile keeps it (SchedulerOutput.step_items): (start, tokens, rows sampled,
# whether it is a prefill chunk)
Item = tuple[int, int, int, bool]


@dataclass(frozen=True)
class StepShape:
    tokens: int  # through every linear
    sampled_rows: int  # rows whose logits are computed (the LM head) and sampled
    chunk_pairs: int  # query-key pairs of prefill chunks among their own tokens (causal)
    past_pairs: int  # and between a chunk's tokens and the request's earlier tokens, read from the cache
    past_tokens: int  # those earlier tokens, once per chunk (what gathering them costs)
    prefill_sequences: int
    decode_keys: int  # keys decode rows read from the cache (a verification row reads its context too)
    sequences: int
    mixed_steps: int  # 1 for a step with both prefill chunks and decode rows (two attention paths), else 0
    copied_blocks: int  # KV blocks swapped out or in before the step

    @classmethod
    def of(cls, output: SchedulerOutput) -> StepShape:
        return cls.of_items(output.step_items(), len(output.swap_out) + len(output.swap_in))

    @classmethod
    def of_items(cls, items: list[Item], copied_blocks: int = 0) -> StepShape:
        chunk_pairs = past_pairs = past_tokens = prefills = decode_keys = 0
        for start, n, _, is_prefill in items:
            if is_prefill:
                chunk_pairs += n * (n + 1) // 2
                past_pairs += n * start
                past_tokens += start
                prefills += 1
            else:
                decode_keys += n * (start + n)
        tokens, sampled = sum(i[1] for i in items), sum(i[2] for i in items)
        mixed = int(0 < prefills < len(items))
        return cls(tokens, sampled, chunk_pairs, past_pairs, past_tokens, prefills, decode_keys, len(items), mixed,
                   copied_blocks)  # fmt: skip

    @property
    def prefill_pairs(self) -> int:
        return self.chunk_pairs + self.past_pairs

    def features(self) -> list[float]:
        return [1.0, *(float(getattr(self, name)) for name in FEATURES[1:])]


class StepModel(Protocol):
    @property
    def name(self) -> str: ...

    def seconds(self, shape: StepShape) -> float: ...


@dataclass
class FittedStepModel:
    """Step seconds = coefficients . the step's shape (FEATURES: 1, tokens, sampled rows, ...)."""

    name: str
    coefficients: dict[str, float]
    fit_error: dict[str, float] = field(default_factory=dict)  # relative error on held-out steps: p50, p90, mean

    def seconds(self, shape: StepShape) -> float:
        values = dict(zip(FEATURES, shape.features(), strict=True))
        return sum(self.coefficients.get(name, 0.0) * values[name] for name in FEATURES)

    @classmethod
    def fit(cls, name: str, shapes: list[StepShape], seconds: list[float], holdout_every: int = 5) -> FittedStepModel:
        """Least squares on relative error (each step weighted by 1 / its time, so short decode steps count as
        much as long prefills), with no negative coefficient (a feature whose fit goes negative is dropped and the
        rest refitted), over the steps a neighbour did not slow (_undisturbed_fit). Every `holdout_every`-th step
        is held out to measure the error, on all of them, slowed or not; then all steps are fitted."""
        if len(shapes) < 2 * len(FEATURES):
            raise ValueError(f"{len(shapes)} steps are too few to fit {len(FEATURES)} coefficients")
        x = np.array([s.features() for s in shapes])
        y = np.array(seconds)
        held = np.arange(len(y)) % holdout_every == holdout_every - 1
        trial, _ = _undisturbed_fit(x[~held], y[~held])
        error = np.abs(x[held] @ trial - y[held]) / y[held]
        coefficients, kept = _undisturbed_fit(x, y)
        model = cls(name, {f: float(c) for f, c in zip(FEATURES, coefficients, strict=True)})
        model.fit_error = {
            "p50": float(np.percentile(error, 50)),
            "p90": float(np.percentile(error, 90)),
            "mean": float(error.mean()),
            "held_out_steps": int(held.sum()),
            "outlying_steps": int((~kept).sum()),
        }
        return model


OUTLYING_BEYOND = 3.0  # robust standard deviations (1.4826 x the median absolute deviation) of log(measured / fit)


def _undisturbed_fit(x: np.ndarray, y: np.ndarray, rounds: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """_nonnegative_fit over the steps whose time is within OUTLYING_BEYOND robust deviations of the fit, refitted
    until the kept steps stay the same; the coefficients and which steps were kept. A VM's neighbours slow whole
    stretches of a profile (a minute of steps at 1.5x in one profile here, decode steps of one row among them): fitted
    with the rest, those few shapes pull every coefficient their way."""
    kept = np.ones(len(y), dtype=bool)
    coefficients = _nonnegative_fit(x, y)
    for _ in range(rounds):
        ratio = np.log(y / np.maximum(x @ coefficients, 1e-12))
        centre = np.median(ratio[kept])
        spread = 1.4826 * np.median(np.abs(ratio[kept] - centre))
        within = np.abs(ratio - centre) <= OUTLYING_BEYOND * spread
        if spread == 0 or (within == kept).all() or within.sum() < 2 * x.shape[1]:
            break
        kept = within
        coefficients = _nonnegative_fit(x[kept], y[kept])
    return coefficients, kept


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    weights = 1.0 / y
    active = list(range(x.shape[1]))
    while True:
        solution, *_ = np.linalg.lstsq(x[:, active] * weights[:, None], y * weights, rcond=None)
        if (solution >= 0).all():
            out = np.zeros(x.shape[1])
            out[active] = solution
            return out
        del active[int(np.argmin(solution))]


@dataclass(frozen=True)
class Datasheet:
    """What a roofline needs of a device beyond its memory (advisor/plan.py's catalogue has that and its bandwidth)."""

    bf16_flops: float  # dense, per second, as the vendor's datasheet gives it
    link_bytes_s: float  # one direction, between the devices of a tensor-parallel group (NVLink, or PCIe)


@dataclass(frozen=True)
class Device:
    name: str
    bf16_flops: float
    bandwidth_bytes_s: float
    link_bytes_s: float


@dataclass(frozen=True)
class Efficiency:
    """What share of the peaks a good engine reaches, and its fixed costs: assumptions until a device is profiled.
    The defaults follow published measurements of vLLM-class engines (about half the peak FLOP/s on large GEMMs,
    70-85% of the bandwidth on decode) and CUDA-graph decode steps."""

    flops: float = 0.55
    bandwidth: float = 0.8
    launch_s_per_layer: float = 20e-6  # kernel launches of a layer, not hidden by a graph
    host_s_per_step: float = 1.5e-3  # scheduling, input preparation, sampling and output processing
    allreduce_latency_s: float = 10e-6
    host_link_bytes_s: float = 25e9  # swap copies over PCIe


# Keyed as advisor/plan.py's catalogue names them; the seeds' list.
DATASHEETS = {
    "a100-80gb": Datasheet(312e12, 300e9),
    "h100-80gb": Datasheet(989e12, 450e9),
    "h200-141gb": Datasheet(989e12, 450e9),
    "b200-192gb": Datasheet(2250e12, 900e9),
    "rtx5090-32gb": Datasheet(209.5e12, 32e9),  # no NVLink: PCIe 5.0 x16
}


@dataclass
class RooflineStepModel:
    name: str
    model: ModelConfig
    device: Device
    tensor_parallel: int = 1
    element_bytes: int = 2
    kv_element_bytes: int = 2
    block_size: int = 16
    efficiency: Efficiency = field(default_factory=Efficiency)

    def seconds(self, shape: StepShape) -> float:
        m, tp, eff = self.model, self.tensor_parallel, self.efficiency
        layer_params = _layer_parameters(m)
        head_params = m.vocab_size * m.hidden_size
        attention_flops = 4 * m.num_layers * m.num_heads * m.head_dim * (shape.prefill_pairs + shape.decode_keys)
        flops = 2 * layer_params * shape.tokens + 2 * head_params * shape.sampled_rows + attention_flops
        kv_per_token = m.kv_bytes_per_token(self.kv_element_bytes)
        # Weights once, the keys decode rows read, the new tokens' KV written (a prefill chunk's reads of its past
        # are left out: a chunk is compute-bound)
        bytes_moved = (layer_params + head_params) * self.element_bytes + kv_per_token * (
            shape.decode_keys + shape.tokens
        )
        compute = flops / tp / (self.device.bf16_flops * eff.flops)
        memory = bytes_moved / tp / (self.device.bandwidth_bytes_s * eff.bandwidth)
        allreduce = 0.0
        if tp > 1:  # two all-reduces per layer of the step's hidden states
            volume = 2 * m.num_layers * shape.tokens * m.hidden_size * self.element_bytes * 2 * (tp - 1) / tp
            allreduce = volume / self.device.link_bytes_s + 2 * m.num_layers * eff.allreduce_latency_s
        copies = shape.copied_blocks * self.block_size * kv_per_token / eff.host_link_bytes_s
        launches = m.num_layers * eff.launch_s_per_layer
        return eff.host_s_per_step + launches + max(compute, memory) + allreduce + copies


def _layer_parameters(m: ModelConfig) -> int:
    """The decoder layers' parameters: the model's count (advisor/plan.py) less its embeddings and final norm."""
    return parameter_count(m) - m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2) - m.hidden_size


@dataclass
class ServedOverhead:
    """What a step costs a server beyond the engine's own step of the same shape: per_step_s. Fitted from the steps
    of a trace served with `--step-log` (profile.py's measure_served), each the wall time of the engine loop's turn
    that ran it, against the engine-alone model for its shape: the server's event loop and streams share the cores
    with the step, and the turn hands each row's output to its stream, which a profile of the engine alone does not
    see. `steps` keeps what it was fitted from (the log's records).

    One constant a step: over eight served runs of four traces (RESULTS.md, issue 27) it fitted the served steps as
    well as any line with a share of the engine's time or a cost per row did, and a share fitted on one short trace
    came out at 7-13%, which then stretched long prefill chunks that serving does not slow."""

    per_step_s: float = 0.0
    steps: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def fit(cls, engine: StepModel, steps: list[dict[str, Any]]) -> ServedOverhead:
        """Least squares of (served - engine) seconds on a constant, each step weighted by 1 / its served time (as
        FittedStepModel.fit), not below 0."""
        shapes, seconds = shapes_of(steps)
        served = np.array(seconds)
        model = np.array([engine.seconds(shape) for shape in shapes])
        weights = served**-2.0
        constant = float(np.sum((served - model) * weights) / np.sum(weights)) if len(steps) else 0.0
        return cls(max(0.0, constant), steps)

    @classmethod
    def read(cls, data: dict[str, Any]) -> ServedOverhead:
        """As a profile wrote it; one from before the step log (fitted over stream counts) keeps its constant."""
        return cls(data.get("per_step_s", 0.0), data.get("steps", []))


@dataclass
class ServedStepModel:
    """A step model of the engine alone, plus what serving adds to each step (ServedOverhead)."""

    engine: StepModel
    overhead: ServedOverhead

    @property
    def name(self) -> str:
        return f"{self.engine.name}, served"

    def seconds(self, shape: StepShape) -> float:
        return self.engine.seconds(shape) + self.overhead.per_step_s


@dataclass
class Profile:
    """`tokenloom simulate profile`'s output: the fitted model and the engine it was measured on."""

    step_model: FittedStepModel
    machine: dict[str, str]
    engine: dict[str, int | str | bool | None]  # num_kv_blocks, block_size, max_model_len, the flags
    # Every measured step: its scheduled requests (Item), blocks copied and seconds, so a model can be refitted.
    steps: list[dict[str, Any]] = field(default_factory=list)
    front_latency_s: float = 0.0  # a request's time outside the steps, over HTTP (profile.measure_served)
    served_overhead: ServedOverhead = field(default_factory=ServedOverhead)  # zero where not measured

    def refitted(self) -> Profile:
        """The same measurements with the step model fitted again (after the features change), and the served
        overhead against it where its served steps were kept; the front's latency is kept as it was measured."""
        shapes, seconds = self.shapes()
        model = FittedStepModel.fit(self.step_model.name, shapes, seconds)
        served = self.served_overhead
        overhead = ServedOverhead.fit(model, served.steps) if served.steps else served
        return dataclasses.replace(self, step_model=model, served_overhead=overhead)

    def at_speed_of(self, served_steps: list[dict[str, Any]]) -> tuple[Profile, float]:
        """The profile with every step cost scaled by one factor, the served steps' total seconds over what the
        served step model says for them; and that factor. What the machine's speed at another time (a VM's
        neighbours come and go) does to a simulation, apart from what the model's form does; the front's latency
        stays as measured."""
        shapes, seconds = shapes_of(served_steps)
        model = self.served_step_model()
        factor = sum(seconds) / sum(model.seconds(shape) for shape in shapes)
        coefficients = {name: value * factor for name, value in self.step_model.coefficients.items()}
        overhead = dataclasses.replace(self.served_overhead, per_step_s=self.served_overhead.per_step_s * factor)
        scaled = dataclasses.replace(self.step_model, coefficients=coefficients)
        return dataclasses.replace(self, step_model=scaled, served_overhead=overhead), factor

    def served_step_model(self) -> StepModel:
        """What a served step costs: the fitted engine step plus the served overhead, where one was measured."""
        if not self.served_overhead.per_step_s:
            return self.step_model
        return ServedStepModel(self.step_model, self.served_overhead)

    def shapes(self) -> tuple[list[StepShape], list[float]]:
        return shapes_of(self.steps)

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def read(cls, path: str | Path) -> Profile:
        data = json.loads(Path(path).read_text())
        return cls(
            FittedStepModel(**data["step_model"]), data["machine"], data["engine"], data.get("steps", []),
            data.get("front_latency_s", 0.0), ServedOverhead.read(data.get("served_overhead", {})),
        )  # fmt: skip


def shapes_of(steps: list[dict[str, Any]]) -> tuple[list[StepShape], list[float]]:
    """Measured steps (a profile's `steps`) -> their shapes and seconds, as FittedStepModel.fit takes them."""
    shapes = [StepShape.of_items([tuple(i) for i in s["items"]], s["copied_blocks"]) for s in steps]
    return shapes, [s["seconds"] for s in steps]


def datasheet(name: str) -> Datasheet:
    found = DATASHEETS.get(name.lower())
    if found is None:
        raise ValueError(f"no datasheet for {name!r}; known: {', '.join(DATASHEETS)} (or give --profile)")
    return found
