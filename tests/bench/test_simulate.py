"""`tokenloom simulate` (issue 27): the engine's own scheduler in simulated time, its step models, and the
simulated planner. The simulator and the real engine must make the same scheduling decisions step by step."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tokenloom import EngineConfig, LLMEngine, SamplingParams
from tokenloom.advisor.capacity import Target, fewest_replicas, layout_at, parse_prices
from tokenloom.advisor.plan import accelerator, parameter_count
from tokenloom.advisor.weights import weights_as_served
from tokenloom.bench.cost_model import (
    FEATURES,
    Device,
    FittedStepModel,
    Profile,
    RooflineStepModel,
    ServedOverhead,
    ServedStepModel,
    StepShape,
)
from tokenloom.bench.loadgen import arrival_offsets, burst_aligned
from tokenloom.bench.scorecard import SCORECARD_KEYS, SLO
from tokenloom.bench.simulator import SimulatedEngine, SimulatedRequest, arrivals, decision, simulate
from tokenloom.bench.trace import TraceRequest, make_trace, write_trace
from tokenloom.cli import main
from tokenloom.model.config import ModelConfig
from tokenloom.model.loader import resolve_checkpoint_dir


class ConstantStep:
    name = "constant"

    def __init__(self, seconds: float) -> None:
        self.step = seconds

    def seconds(self, shape: StepShape) -> float:
        return self.step


def trace_request(i: int, max_tokens: int, cancel: int | None = None) -> TraceRequest:
    return TraceRequest(f"r{i}", "chat", [], max_tokens, cancel_after_tokens=cancel)


def requests(lengths: list[tuple[int, int]], arrivals_at: list[float] | None = None) -> list[SimulatedRequest]:
    """(prompt tokens, output tokens) each, distinct prompts."""
    at = arrivals_at or [0.0] * len(lengths)
    return [
        SimulatedRequest(trace_request(i, out), [100 + 7 * i + j for j in range(prompt)], out, at[i])
        for i, (prompt, out) in enumerate(lengths)
    ]


def engine_of(**flags) -> SimulatedEngine:
    config = EngineConfig.from_kwargs(**flags)
    return SimulatedEngine(config, num_kv_blocks=flags.get("num_kv_blocks", 64), max_model_len=512)


def test_a_lone_request_takes_one_step_per_token_after_its_prefill():
    """Hand-checked: a 5-token prompt prefills in the first step, which samples token 1; each later step one more."""
    (request,) = requests([(5, 3)], [0.5])
    result = simulate(engine_of(), ConstantStep(0.01), [request])
    (record,) = result.records
    assert result.steps == 3
    assert record.ttft == pytest.approx(0.01) and record.e2e == pytest.approx(0.03)
    assert record.token_gaps == pytest.approx([0.01, 0.01]) and record.output_tokens == 3
    assert result.duration == pytest.approx(0.53)  # from the run's start: the request arrived at 0.5


def test_requests_queue_for_the_batch_and_the_budget():
    """max_num_seqs 1: the second request waits for the first to finish, so its TTFT counts the wait."""
    result = simulate(engine_of(max_num_seqs=1), ConstantStep(0.01), requests([(4, 2), (4, 2)]))
    first, second = result.records
    assert first.e2e == pytest.approx(0.02)
    assert second.ttft == pytest.approx(0.03)  # two steps for the first, then its own prefill
    assert result.server["queue_time_p95_s"] == pytest.approx(0.02 * 0.95, abs=1e-9)


def test_a_cancelled_request_is_aborted_where_its_client_gave_up_and_a_too_long_prompt_is_refused():
    cancelled = SimulatedRequest(trace_request(0, 50, cancel=3), list(range(10, 20)), 50, 0.0)
    too_long = SimulatedRequest(trace_request(1, 5), list(range(600)), 5, 0.0)
    result = simulate(engine_of(), ConstantStep(0.01), [cancelled, too_long])
    assert result.records[0].cancelled and result.records[0].output_tokens == 3
    assert result.records[1].status == 400 and "context length" in result.records[1].error
    assert result.card(math.inf, SLO())["error_rate"] == 0.5


def test_the_arrivals_are_bench_serves():
    trace = make_trace("agent", 20, seed=3)  # bursts arrive together
    assert arrivals(trace, 2.0, 1.0, 7) == burst_aligned(trace, arrival_offsets(20, 2.0, 1.0, 7))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_simulator_and_the_engine_schedule_the_same_steps(tiny_llama, mode):
    """The same requests (all queued at once), the same flags and a KV pool too small for all of them: step by step
    the same requests run the same numbers of tokens, and the same ones are preempted."""
    flags = dict(model=str(tiny_llama), dtype="float32", num_kv_blocks=12, block_size=4, max_num_batched_tokens=32,
                 max_num_seqs=4, preemption_mode=mode, num_swap_blocks=64)  # fmt: skip
    lengths = [(9, 12), (21, 6), (5, 15), (14, 9), (30, 4), (7, 10)]
    engine = LLMEngine(EngineConfig.from_kwargs(**flags))
    seen: list = []
    engine.observe_steps(lambda output: seen.append(decision(output)))
    for i, (prompt, out) in enumerate(lengths):
        ids = [100 + 7 * i + j for j in range(prompt)]
        engine.add_request(ids, SamplingParams(max_tokens=out, ignore_eos=True, temperature=0), request_id=f"r{i}")
    while engine.has_unfinished_requests():
        engine.step()
    real_preemptions = engine.stats().num_preemptions_recompute + engine.stats().num_preemptions_swap
    engine.shutdown()
    simulated_engine = SimulatedEngine(
        EngineConfig.from_kwargs(**flags), num_kv_blocks=12, max_model_len=engine.max_model_len,
        num_swap_blocks=64 if mode == "swap" else 0,
    )  # fmt: skip
    result = simulate(simulated_engine, ConstantStep(0.01), requests(lengths), keep_decisions=True)
    assert real_preemptions > 0, "the pool was meant to force preemptions"
    assert result.decisions == seen
    assert result.server["preemptions"] == real_preemptions


def test_the_fit_recovers_a_known_line_and_never_goes_negative():
    shapes = [StepShape.of_items(([(0, n, 1, True)] if n else []) + [(c, 1, 1, False)] * d)
              for n in (0, 30, 200, 900) for d in (0, 3, 9) for c in (50, 700) if n or d]  # fmt: skip
    truth = {"steps": 0.02, "tokens": 4e-4, "decode_keys": 2e-6, "prefill_sequences": 0.005}
    seconds = [sum(truth.get(f, 0.0) * v for f, v in zip(FEATURES, s.features(), strict=True)) for s in shapes]
    model = FittedStepModel.fit("synthetic", shapes, seconds)
    assert all(c >= 0 for c in model.coefficients.values())
    for name, value in truth.items():
        assert model.coefficients[name] == pytest.approx(value, rel=1e-6)
    assert model.fit_error["p90"] < 1e-6


def test_the_fit_sets_aside_a_stretch_of_steps_a_neighbour_slowed():
    """A fifth of the steps, one stretch of the grid, measured at 1.5x (as a VM's neighbour made a profile here):
    the fit keeps the undisturbed line and counts the slowed steps as outlying."""
    shapes = [StepShape.of_items(([(0, n, 1, True)] if n else []) + [(c, 1, 1, False)] * d)
              for n in (0, 30, 200, 900) for d in (0, 3, 9, 17) for c in (50, 700, 2000) if n or d]  # fmt: skip
    truth = {"steps": 0.02, "tokens": 4e-4, "decode_keys": 2e-6, "chunk_pairs": 3e-7}
    seconds = [sum(truth.get(f, 0.0) * v for f, v in zip(FEATURES, s.features(), strict=True)) for s in shapes]
    noise = np.random.default_rng(0).normal(1.0, 0.02, len(seconds))
    slowed = range(len(shapes) // 2, len(shapes) // 2 + len(shapes) // 5)
    measured = [t * e * (1.5 if i in slowed else 1.0) for i, (t, e) in enumerate(zip(seconds, noise, strict=True))]
    model = FittedStepModel.fit("slowed", shapes, measured)
    for name in ("steps", "tokens", "decode_keys"):
        assert model.coefficients[name] == pytest.approx(truth[name], rel=0.05), name
    assert model.fit_error["outlying_steps"] == len(slowed)
    predicted = [model.seconds(shape) for shape in shapes]
    assert max(abs(p / t - 1) for p, t in zip(predicted, seconds, strict=True)) < 0.06


def served_steps(per_step: float, engine: FittedStepModel, prefill: bool = True) -> list[dict]:
    """Decode steps of 1-24 rows and a prefill chunk, each served as the engine's time + per_step."""
    items = [[[300 * r, 1, 1, False]] * rows for rows in (1, 2, 4, 8, 16, 24) for r in (1, 3)]
    items += [[[0, 500, 1, True]]] if prefill else []
    seconds = [engine.seconds(StepShape.of_items([tuple(x) for x in i])) + per_step for i in items]
    return [{"items": i, "copied_blocks": 0, "seconds": s} for i, s in zip(items, seconds, strict=True)]


def test_the_served_overhead_is_a_constant_a_step_never_negative():
    engine = FittedStepModel("m", {"steps": 0.01, "sampled_rows": 0.001, "decode_keys": 1e-6, "tokens": 2e-4})
    fitted = ServedOverhead.fit(engine, served_steps(0.003, engine))
    assert fitted.per_step_s == pytest.approx(0.003)
    assert ServedOverhead.fit(engine, served_steps(-0.002, engine)).per_step_s == 0  # faster than alone: none
    noisy = served_steps(0.003, engine)
    noisy[0]["seconds"] += 0.004  # a short step 4 ms slow weighs more than a long one 4 ms fast
    noisy[-1]["seconds"] -= 0.004
    assert ServedOverhead.fit(engine, noisy).per_step_s > 0.003
    served = ServedStepModel(ConstantStep(0.02), fitted)
    assert served.seconds(StepShape.of_items([(300, 1, 1, False)] * 4)) == pytest.approx(0.023)


def test_a_profile_without_a_served_overhead_simulates_the_engine_alone(tmp_path):
    model = FittedStepModel("m", {"steps": 0.01})
    path = tmp_path / "old.json"
    Profile(model, {}, {}).write(path)
    data = json.loads(path.read_text())
    del data["served_overhead"]  # written before it was measured
    path.write_text(json.dumps(data))
    old = Profile.read(path)
    assert old.served_step_model() is old.step_model
    truth = FittedStepModel("truth", {"steps": 0.01, "sequences": 1e-3, "decode_keys": 1e-6})
    steps = [{"items": [[c, 1, 1, False]] * d, "copied_blocks": 0,
              "seconds": truth.seconds(StepShape.of_items([(c, 1, 1, False)] * d))}
             for d in (1, 2, 4, 8, 16) for c in (10, 100, 400, 900, 2000)]  # fmt: skip
    # Decode steps only: the engine's steps below, which a refit learns from, are decode steps.
    measured = ServedOverhead.fit(model, served_steps(0.002, truth, prefill=False))
    Profile(model, {}, {}, steps, served_overhead=measured).write(path)
    again = Profile.read(path)
    assert again.served_overhead == measured
    shape = StepShape.of_items([(10, 1, 1, False)] * 2)
    assert again.served_step_model().seconds(shape) == pytest.approx(0.01 + measured.per_step_s)
    # A refit fits the engine's steps again, and the served overhead against the refitted model: the engine is now
    # the truth, so what is left is the served steps' own constant.
    refitted = again.refitted()
    assert refitted.step_model.seconds(shape) == pytest.approx(truth.seconds(shape), rel=1e-6)
    assert refitted.served_overhead.per_step_s == pytest.approx(0.002, rel=1e-3)
    assert refitted.served_overhead.steps == measured.steps


def test_a_profile_at_the_speed_of_served_steps_scales_every_step_by_one_factor():
    engine = FittedStepModel("m", {"steps": 0.01, "sampled_rows": 0.001, "decode_keys": 1e-6, "tokens": 2e-4})
    profile = Profile(engine, {}, {}, front_latency_s=0.005, served_overhead=ServedOverhead(0.002))
    slower = served_steps(0.002, engine)
    for step in slower:  # the same steps on a machine 1.25x slower, served overhead included
        step["seconds"] *= 1.25
    scaled, factor = profile.at_speed_of(slower)
    assert factor == pytest.approx(1.25)
    for shape in (StepShape.of_items([(300, 1, 1, False)] * 4), StepShape.of_items([(0, 512, 1, True)])):
        assert scaled.served_step_model().seconds(shape) == pytest.approx(
            1.25 * profile.served_step_model().seconds(shape)
        )
    assert scaled.front_latency_s == profile.front_latency_s
    assert profile.at_speed_of(served_steps(0.002, engine))[1] == pytest.approx(1.0)


def test_the_roofline_is_bound_by_bandwidth_when_decoding_and_by_flops_when_prefilling():
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
                               "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                               "num_key_value_heads": 8, "max_position_embeddings": 8192})  # fmt: skip
    slow, fast = (Device("x", 1e15, bw, 1e11) for bw in (2e12, 4e12))
    decode = StepShape.of_items([(1000, 1, 1, False)])
    prefill = StepShape.of_items([(0, 8192, 1, True)])
    efficiency = RooflineStepModel("r", cfg, slow).efficiency
    overhead = efficiency.host_s_per_step + 32 * efficiency.launch_s_per_layer  # the same for every step
    weights_bytes = 2 * (32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336) + 32000 * 4096)
    slow_decode = RooflineStepModel("r", cfg, slow).seconds(decode) - overhead
    assert slow_decode == pytest.approx(weights_bytes / (2e12 * 0.8), rel=0.01)  # the weights, once, at 80%
    assert RooflineStepModel("r", cfg, slow).seconds(StepShape.of_items([])) > overhead  # weights read anyway
    fast_decode = RooflineStepModel("r", cfg, fast).seconds(decode) - overhead
    assert fast_decode == pytest.approx(slow_decode / 2, rel=0.01)
    # A long prefill is compute-bound: the same on both bandwidths, and halved by twice the FLOP/s.
    assert RooflineStepModel("r", cfg, slow).seconds(prefill) == pytest.approx(
        RooflineStepModel("r", cfg, fast).seconds(prefill)
    )
    doubled = Device("x", 2e15, 2e12, 1e11)
    assert RooflineStepModel("r", cfg, doubled).seconds(prefill) - overhead == pytest.approx(
        (RooflineStepModel("r", cfg, slow).seconds(prefill) - overhead) / 2, rel=0.01
    )


def test_fewest_replicas_searches_by_doubling_then_bisection():
    asked: list[int] = []

    def attained(n: int) -> bool:
        asked.append(n)
        return n >= 11

    assert fewest_replicas(attained) == 11
    assert asked[:5] == [1, 2, 4, 8, 16]
    assert fewest_replicas(lambda n: False) is None


def test_plan_hand_checked_one_request_per_step():
    """Each request is one 0.1 s step (a 1-token answer) and a replica runs one at a time: 10 req/s at most. At 15
    req/s one replica falls behind without end; two (7.5 req/s each, 75% busy) keep every TTFT near a step."""
    trace = [trace_request(i, 1) for i in range(200)]
    prompts = [[100 + i, 5, 6] for i in range(200)]
    engine = engine_of(max_num_seqs=1)
    target = Target(15.0, SLO(ttft=1.0), attainment=0.95)
    layout = layout_at("x", 1, engine, ConstantStep(0.1), trace, prompts, target, price_per_device_hour=3.6)
    assert layout is not None and layout.replicas == 2
    # Cost per 1k accepted: 2 devices x $3.6/h over (goodput x 3600) responses an hour, x 1000.
    assert layout.cost_per_1k_accepted == pytest.approx(7.2 / (layout.goodput_req_s * 3600) * 1000)
    assert layout.goodput_req_s == pytest.approx(15.0, rel=0.1)


def test_plan_hand_checked_a_model_too_big_for_one_card_needs_two(tmp_path, capsys):
    """A 39B-parameter model (79 GB in bf16) cannot fit an 80 GB card (72 GB usable at 90%, less the runtime), and
    fits two: plan picks tensor parallel 2 on both accelerators."""
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 8192,
              "intermediate_size": 22016, "num_hidden_layers": 56, "num_attention_heads": 64,
              "num_key_value_heads": 8, "max_position_embeddings": 4096}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    trace = make_trace("chat", 30, seed=0)
    write_trace(trace, tmp_path / "chat.jsonl")
    code = main(["plan", "--model", str(tmp_path / "config.json"), "--target-rps", "2", "--slo", "ttft=2,itl=0.2",
                 "--trace", str(tmp_path / "chat.jsonl"), "--accelerator", "A100-80GB,H100-80GB",
                 "--cost-per-hour", "A100-80GB=2,H100-80GB=4"])  # fmt: skip
    assert code == 0
    rows = {line.split("|")[1].strip(): line.split("|") for line in capsys.readouterr().out.splitlines()[3:]}
    assert rows["A100-80GB"][2].strip() == "2" and rows["H100-80GB"][2].strip() == "2"


def test_prices_are_one_figure_or_one_per_accelerator():
    assert parse_prices("2.5", ["A", "B"]) == {"A": 2.5, "B": 2.5}
    assert parse_prices("a=1,B=3", ["A", "B"]) == {"A": 1.0, "B": 3.0}
    assert parse_prices(None, ["A"]) == {"A": None}
    with pytest.raises(ValueError, match="not one of"):
        parse_prices("C=1", ["A"])


def test_profile_then_simulate_from_the_command_line(tiny_chat_model, tmp_path):
    profile = tmp_path / "profile.json"
    model = ["--model", str(tiny_chat_model), "--dtype", "float32"]
    served = ["--front-requests", "2", "--served-requests", "6"]
    assert main(["simulate", "profile", "--quick", *served, *model, "-o", str(profile)]) == 0
    saved = Profile.read(profile)
    assert len(saved.steps) > 20 and saved.step_model.fit_error["held_out_steps"] > 0
    assert saved.engine["max_model_len"] == 2048 and saved.front_latency_s >= 0
    config = ModelConfig.from_hf(json.loads((tiny_chat_model / "config.json").read_text()))
    assert saved.engine["weight_bytes"] == weights_as_served(config, "fp32", accelerator("cpu"))  # float32, as served
    items = [[tuple(i) for i in step["items"]] for step in saved.steps]
    assert [(128, 16, 1, True)] in items  # a prompt whose first 128 tokens the request before it left cached
    joins = [step for step in items if (256, 16, 1, True) in step]  # a decoding request's prompt, and 16 more
    assert joins and all(len(step) > 1 for step in joins)
    overhead = saved.served_overhead
    served_items = [[tuple(i) for i in step["items"]] for step in overhead.steps]
    # The served trace's six prompts each prefilled in one chunk, and decoded; none of the front's requests.
    assert sum(1 for step in served_items for i in step if i[3]) == 6
    assert any(not i[3] for step in served_items for i in step)
    assert all(step["seconds"] > 0 for step in overhead.steps)
    assert overhead.per_step_s >= 0
    trace = tmp_path / "chat.jsonl"
    requests = make_trace("chat", 20, seed=2)
    write_trace(requests, trace)
    run = tmp_path / "run.json"
    args = ["simulate", "--trace", str(trace), "--request-rate", "4", *model]
    assert main([*args, "--profile", str(profile), "-o", str(run)]) == 0
    out = json.loads(run.read_text())
    assert set(SCORECARD_KEYS) <= set(out["scorecard"]) and out["provenance"]["simulated"]
    assert [r["status"] for r in out["records"]] == [200] * 20
    assert [r["output_tokens"] for r in out["records"]] == [r.max_tokens for r in requests]  # no lengths given
    on_gpu = tmp_path / "gpu.json"
    assert main([*args, "--accelerator", "H100-80GB", "-o", str(on_gpu)]) == 0
    gpu = json.loads(on_gpu.read_text())
    # A datasheet H100 is modelled from its figures, not from this machine's profile: the same scorecard every time,
    # not the profile's. (Which is faster is no property of a tiny model, whose steps are a launch cost on an H100
    # and under a millisecond on a CPU: on a Zen 3 with our float32 linear the two came within 1% of each other.)
    assert gpu["scorecard"] != out["scorecard"] and gpu["provenance"]["simulated"]
    again = tmp_path / "gpu-again.json"
    assert main([*args, "--accelerator", "H100-80GB", "-o", str(again)]) == 0
    assert json.loads(again.read_text())["scorecard"] == gpu["scorecard"]
    assert main([*args, "-o", str(run)]) == 2  # neither a profile nor an accelerator
    speculating = ["--speculative-config", '{"method": "suffix"}', "--profile", str(profile)]
    assert main([*args, *speculating, "-o", str(run)]) == 2  # not modelled: refused, not ignored


def test_a_profile_of_a_gguf_served_from_its_blocks_holds_their_bytes_in_the_simulated_memory():
    """The scorecard's memory high-water mark counts the weights as the profiled engine held them."""
    from tokenloom.bench.simulate_command import profile_setup
    from tokenloom.model.gguf_linear import served_weight_bytes
    from tokenloom.model.loader import default_gguf_path

    config = EngineConfig.from_kwargs(model=None)
    model = ModelConfig.from_hf(json.loads((resolve_checkpoint_dir(None)[1] / "config.json").read_text()))
    measured = {"num_kv_blocks": 64, "max_model_len": 2048, "kv_bytes_per_block": 1 << 16, "dtype": "float32"}
    step = FittedStepModel("m", {"steps": 0.01})
    blocks, _ = profile_setup(Profile(step, {}, {**measured, "quantization": "gguf"}), config, model)
    plain, _ = profile_setup(Profile(step, {}, {**measured, "quantization": None}), config, model)
    assert blocks.weights_bytes == served_weight_bytes(default_gguf_path()) < plain.weights_bytes / 2
    assert plain.weights_bytes == 4 * parameter_count(model)
    # A profile that recorded what its engine's weights held (engine.weight_bytes) is taken at its word.
    recorded, _ = profile_setup(Profile(step, {}, {**measured, "quantization": None, "weight_bytes": 12345}), config,
                                model)  # fmt: skip
    assert recorded.weights_bytes == 12345
