"""The capacity planner against hand-computed cases, and each diagnosis rule on a snapshot built for it."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading

import httpx
import pytest
import torch
from conftest import TINY_VOCAB
from server_process import TINY_KV_POOL_ARGS, ServerProcess

from tokenloom.advisor.diagnose import Window, diagnose
from tokenloom.advisor.plan import Accelerator, GiB, accelerator, load_model_config, make_plan, parameter_count
from tokenloom.model.config import ModelConfig
from tokenloom.model.prepack import can_prepack, takes_f32_layout

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}


def test_kv_bytes_per_token_by_hand(real_model_dir):
    llama = ModelConfig.from_hf(LLAMA3_8B)
    assert llama.kv_bytes_per_token(2) == 128 * 1024  # 32 layers x 2 x 8 heads x 128 x 2 bytes
    smol = ModelConfig.from_hf(json.loads((real_model_dir / "config.json").read_text()))
    assert smol.kv_bytes_per_token(4) == 45 * 1024  # 30 x 2 x 3 x 64 x 4 bytes
    assert parameter_count(llama) == 8_030_261_248  # Llama-3-8B's published count


def test_plan_figures_by_hand():
    cfg = ModelConfig.from_hf(LLAMA3_8B)
    device = Accelerator("test", 80 * GiB, 2e12, 0)
    plan = make_plan(
        cfg,
        "llama",
        context=8192,
        concurrency=16,
        device=device,
        weights_dtype="bf16",
        kv_dtype="fp16",
        utilization=1.0,
        max_num_batched_tokens=2048,
    )
    assert plan.weights_bytes == 8_030_261_248 * 2
    assert plan.kv_bytes_total == 16 * 8192 * 128 * 1024 == 16 * GiB
    assert plan.fits
    room = 80 * GiB - plan.weights_bytes - plan.overhead_bytes
    assert plan.max_concurrency == room // (8192 * 128 * 1024)
    assert plan.max_context == min(8192, room // (16 * 128 * 1024))
    assert plan.num_kv_blocks == room // (16 * 128 * 1024)
    # A decode step streams the weights and every context, the untied embedding table aside (a row a token).
    streamed = 8_030_261_248 * 2 - 128256 * 4096 * 2 + 16 * GiB
    assert plan.decode_tokens_per_s == pytest.approx(16 * 2e12 / streamed)
    tied = make_plan(ModelConfig.from_hf({**LLAMA3_8B, "tie_word_embeddings": True}), "tied", 8192, 16, device, "bf16",
                     "fp16", utilization=1.0)  # fmt: skip
    assert tied.decode_tokens_per_s == pytest.approx(16 * 2e12 / (tied.weights_bytes + 16 * GiB))  # the head reads it
    too_many = make_plan(cfg, "llama", 8192, 200, device, "bf16", "fp16", utilization=1.0)
    assert not too_many.fits
    fp8 = make_plan(cfg, "llama", 8192, 16, device, "bf16", "fp8", utilization=1.0)
    # 32 layers x K and V x 8 KV heads x (128 one-byte codes + a float32 scale), as the engine allocates it
    assert fp8.kv_bytes_per_token == 32 * 2 * 8 * (128 + 4) and fp8.max_concurrency > plan.max_concurrency


def test_engine_sizes_its_kv_pool_with_the_plan(tiny_llama):
    from tokenloom import LLM
    from tokenloom.advisor.plan import load_model_config

    llm = LLM(str(tiny_llama), kv_cache_memory=10 * 2**20, block_size=16)
    _, cfg = load_model_config(str(tiny_llama))
    assert llm.stats().kv_blocks_total == 10 * 2**20 // (16 * cfg.kv_bytes_per_token(4))


@pytest.mark.parametrize("kv", ["int8", "fp8_e5m2"])
def test_plan_kv_dtype_gives_the_pool_the_engine_allocates(tiny_llama, kv):
    from tokenloom import LLM
    from tokenloom.advisor.plan import load_model_config

    _, cfg = load_model_config(str(tiny_llama))
    device = Accelerator("box", 2**30, 1e11, 0)
    plan = make_plan(cfg, "tiny", 1024, 4, device, "fp32", kv, utilization=1.0)
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_dtype=kv, kv_cache_memory=10 * 2**20, block_size=16)
    layer = llm.engine.core.runner.kv_caches[0]
    assert plan.kv_bytes_per_token == cfg.num_layers * sum(t.shape[1] * t.element_size() for t in layer)
    assert llm.stats().kv_blocks_total == 10 * 2**20 // (16 * plan.kv_bytes_per_token)
    kv_info = llm.engine.kv_cache()
    assert kv_info.dtype == kv and kv_info.bytes_per_token == plan.kv_bytes_per_token


def test_replicas_for_a_target_rate_come_from_the_measured_capacity(tmp_path, real_model_dir, capsys):
    from tokenloom.advisor.plan import read_sweep, replicas_needed
    from tokenloom.cli import main

    assert replicas_needed(10, 2.5, 0.8) == 5 and replicas_needed(10, 2.5, 1.0) == 4
    assert replicas_needed(0.1, 5, 0.8) == 1
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    summary = {"capacity_req_s": 2.0, "runs": ["sweep@1", "sweep@2", "sweep@4"], "slo": "ttft=2,itl=0.2",
               "provenance": {"server_version": {"device": "cpu"}}}  # fmt: skip
    (sweep / "sweep.json").write_text(json.dumps(summary))
    model = str(real_model_dir / "config.json")
    args = ["plan", "--model", model, "--context", "2048", "--concurrency", "16"]
    assert main([*args, "--target-rps", "7", "--capacity-from", str(sweep), "--slo", "ttft=2,itl=0.2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # 7 req/s at 80% of 2 req/s per replica: 5 replicas, on the CPU it was measured on, no scaling.
    assert plan["replicas"] == 5 and plan["capacity_req_s"] == 2.0 and not plan["estimated"]
    on_h100 = ["--target-rps", "50", "--capacity-from", str(sweep), "--accelerator", "H100-80GB", "--json"]
    assert main([*args, *on_h100]) == 0
    on_gpu = json.loads(capsys.readouterr().out)
    assert on_gpu["estimated"] and on_gpu["capacity_req_s"] > 2.0 and on_gpu["tensor_parallel"] == 1
    assert on_gpu["replicas"] == replicas_needed(50, on_gpu["capacity_req_s"], 0.8)
    with pytest.raises(ValueError, match="not 'ttft=1'"):
        read_sweep(str(sweep), "ttft=1")
    (sweep / "sweep.json").write_text(json.dumps({**summary, "capacity_req_s": None}))
    assert main([*args, "--target-rps", "7", "--capacity-from", str(sweep)]) == 2
    assert "no offered rate met" in capsys.readouterr().err


def test_catalogue_and_cli(real_model_dir):
    assert accelerator("h100-80gb").memory_bytes == 80 * GiB
    with pytest.raises(ValueError, match="unknown accelerator"):
        accelerator("V100")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenloom.cli",
            "plan",
            "--model",
            str(real_model_dir / "config.json"),
            "--context",
            "8192",
            "--concurrency",
            "4",
            "--accelerator",
            "L4-24GB",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    plan = json.loads(out.stdout)
    for key in (
        "weights_bytes",
        "kv_bytes_per_token",
        "kv_bytes_total",
        "overhead_bytes",
        "fits",
        "max_concurrency",
        "max_context",
        "max_num_seqs",
        "max_num_batched_tokens",
        "num_kv_blocks",
    ):
        assert key in plan
    assert plan["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 2 and plan["fits"] is True


def window(**changes) -> Window:
    healthy = dict(
        seconds=10.0,
        waiting_before=0,
        waiting_after=0,
        running=4,
        kv_usage=0.3,
        preemptions=0,
        iteration_tokens=5000,
        prompt_tokens=2000,
        finished_requests=10,
        ttft_p95=0.4,
        queue_p95=0.05,
        e2e_p95=6.0,
        max_num_seqs=8,
    )
    return Window(**{**healthy, **changes})


@pytest.mark.parametrize(
    ("changes", "rule"),
    [
        (dict(waiting_before=2, waiting_after=5, running=8), "waiting_while_kv_has_room"),
        (dict(ttft_p95=9.0, prompt_tokens=30000), "long_prefill_ttft"),
        (dict(queue_p95=20.0, e2e_p95=30.0), "queueing_dominates_latency"),
        (dict(preemptions=12, kv_usage=0.97), "kv_pressure"),
        (dict(waiting_after=3, waiting_before=3, iteration_tokens=0, running=0), "idle_while_waiting"),
        (dict(error_rate=0.2), "errors"),
        (dict(spec_draft_tokens=1000, spec_accepted_tokens=120), "speculation_rarely_accepted"),
    ],
)
def test_each_rule_fires_on_its_symptom(changes, rule):
    findings = diagnose(window(**changes))
    assert rule in [f.rule for f in findings]
    finding = next(f for f in findings if f.rule == rule)
    assert finding.evidence and finding.action


def test_kv_pressure_suggests_swap_only_when_requests_were_recomputed():
    def kv_action(**changes) -> str:
        return next(f for f in diagnose(window(**changes)) if f.rule == "kv_pressure").action

    assert "--preemption-mode swap" in kv_action(preemptions=12, recompute_preemptions=12, kv_usage=0.97)
    assert "--preemption-mode swap" not in kv_action(preemptions=12, recompute_preemptions=0, kv_usage=0.97)


def test_kv_pressure_says_what_an_8_bit_cache_would_hold():
    def kv_action(kv_cache: dict) -> str:
        return next(f for f in diagnose(window(preemptions=3, kv_cache=kv_cache)) if f.rule == "kv_pressure").action

    bf16 = {"dtype": "bfloat16", "num_tokens": 93_000, "tokens_with_8_bit": 175_058}
    assert "--kv-cache-dtype int8 holds 175,058 tokens in the same memory instead of 93,000" in kv_action(bf16)
    already = {"dtype": "int8", "num_tokens": 175_058, "tokens_with_8_bit": 175_058}
    assert "--kv-cache-dtype" not in kv_action(already)


def test_healthy_snapshot_says_so():
    assert [f.rule for f in diagnose(window())] == ["healthy"]
    assert [f.rule for f in diagnose(window(spec_draft_tokens=1000, spec_accepted_tokens=700))] == ["healthy"]
    at_cap = next(f for f in diagnose(window(waiting_before=1, waiting_after=4, running=8)))
    assert "--max-num-seqs" in at_cap.action


def test_diagnose_names_kv_pressure_on_a_flooded_server(tiny_chat_model):
    proc = ServerProcess(
        "--model",
        str(tiny_chat_model),
        *TINY_KV_POOL_ARGS,
    )
    threads: list[threading.Thread] = []
    try:

        def flood(i: int) -> None:
            body = {"prompt": f"Flood {i}: " + "again " * 30, "max_tokens": 250, "ignore_eos": True}
            with contextlib.suppress(httpx.HTTPError):  # the server stops once the diagnosis is made
                httpx.post(f"{proc.url}/v1/completions", json=body, timeout=120)

        threads.extend(threading.Thread(target=flood, args=(i,)) for i in range(24))
        for t in threads:
            t.start()
        result = subprocess.run(
            [sys.executable, "-m", "tokenloom.cli", "diagnose", "--url", proc.url, "--interval", "1.5", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        findings = json.loads(result.stdout)
        kv = next(f for f in findings if f["rule"] == "kv_pressure")
        assert kv["evidence"]["preemptions"] > 0 or kv["evidence"]["kv_usage"] >= 0.9
        assert proc.wait_for_metric("tokenloom:num_preemptions_total", lambda n: n > 0) > 0
    finally:
        proc.stop()
        for t in threads:
            t.join()


def test_a_gguf_planned_in_float32_on_this_cpu_counts_the_blocks_it_is_served_from(capsys):
    """As the engine serves it (engine/core_setup.served_quantization): float32 on a CPU with gguf_linear, one rank;
    the blocks' bytes are those a served model holds (test_gguf_linear checks them against one)."""
    from tokenloom.cli import main
    from tokenloom.model.gguf_linear import served_weight_bytes
    from tokenloom.model.loader import default_gguf_path
    from tokenloom.model.quantization import gguf_linear_available

    if not gguf_linear_available(torch.device("cpu")):
        pytest.skip("tokenloom::gguf_linear is built for CPUs with AVX2 and FMA")
    _, cfg = load_model_config(None)
    plans = {}
    for flags in (["--weights-dtype", "fp32"], ["--weights-dtype", "fp32", "--tensor-parallel", "2"],
                  ["--weights-dtype", "bf16"]):  # fmt: skip
        assert main(["plan", "--context", "1024", "--concurrency", "8", *flags, "--json"]) == 0
        plans[" ".join(flags)] = json.loads(capsys.readouterr().out)
    served, two_ranks, bf16 = plans.values()
    assert served["weights_dtype"] == "gguf" and served["weights_bytes"] == served_weight_bytes(default_gguf_path())
    # 4-bit linears and an 8-bit head (its blocks the embedding's lookups too), a float32 scale and offset per 32
    assert served["weights_bytes"] < parameter_count(cfg) * 4 * 0.25
    # the LM head's packed copy, beside the tied embedding it reads, unless it gives its rows back
    head = cfg.vocab_size * cfg.hidden_size * (not takes_f32_layout(torch.float32, cfg.vocab_size))
    assert two_ranks["weights_dtype"] == "fp32" and two_ranks["weights_bytes"] == (parameter_count(cfg) + head) * 4
    # bf16: the head's packed copies, as many as this CPU keeps (checked against an engine's in
    # test_the_planned_weights_are_what_the_engine_holds_on_this_cpu)
    params, head = parameter_count(cfg), cfg.vocab_size * cfg.hidden_size
    assert bf16["weights_dtype"] == "bf16" and bf16["weights_bytes"] in [(params + n * head) * 2 for n in (0, 1, 2)]
    room = served["usable_bytes"] - served["weights_bytes"] - served["overhead_bytes"]
    assert served["max_concurrency"] == room // (served["kv_bytes_per_token"] * 1024) > 0  # the blocks' bytes count
    assert main(["plan", "--context", "1024", "--concurrency", "8", "--weights-dtype", "fp32"]) == 0
    assert "(the GGUF served from its blocks)" in capsys.readouterr().out


def test_8_bit_weights_are_planned_with_the_cache_in_the_models_dtype(real_model_dir, capsys):
    """int8 or fp8 weights leave the KV cache in the model's dtype (only --kv-cache-dtype makes it 8-bit), as the
    engine keeps it; --kv-dtype still says what the cache is."""
    from tokenloom.cli import main
    from tokenloom.model.platform import cpu_has_native_bf16

    base = ["plan", "--model", str(real_model_dir / "config.json"), "--context", "1024", "--concurrency", "4", "--json"]
    cpu_auto = "bf16" if cpu_has_native_bf16() else "fp32"
    for flags, weights, kv in ((["--weights-dtype", "int8"], "int8", cpu_auto), ([], cpu_auto, cpu_auto),
                               (["--weights-dtype", "int8", "--kv-dtype", "int8"], "int8", "int8"),
                               (["--accelerator", "H100-80GB", "--weights-dtype", "fp8"], "fp8", "bf16")):  # fmt: skip
        assert main([*base, *flags]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert (plan["weights_dtype"], plan["kv_dtype"]) == (weights, kv), flags


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # a tied LM head, and one of its own
def test_the_planned_weights_are_what_the_engine_holds_on_this_cpu(tiny_checkpoints, arch, capsys):
    """`plan --weights-dtype` counts the forms the engine serves (the LM head's packed copies, none in float32 where
    the packed head gives its rows back; with int8, the codes, scales and code sums, the embedding in the model's
    dtype and the head's int8 copy), not parameters x dtype: the engine's own measure of what its weights hold
    (model/footprint.py) is the reference."""
    from tokenloom import LLM
    from tokenloom.cli import main
    from tokenloom.model.quantization import int8_available

    checkpoint = tiny_checkpoints[arch]
    base = ["plan", "--model", str(checkpoint / "config.json"), "--context", "256", "--concurrency", "2", "--json"]
    served = {"fp32": dict(quantization="none", dtype="float32")}
    if can_prepack(torch.device("cpu"), torch.bfloat16):  # else bf16 is held as loaded: parameters x 2
        served["bf16"] = dict(quantization="none", dtype="bfloat16")
    if int8_available():
        served["int8"] = dict(quantization="int8", dtype="float32")
    for weights_dtype, flags in served.items():
        held = LLM(str(checkpoint), **flags).engine.weight_bytes
        assert main([*base, "--weights-dtype", weights_dtype]) == 0
        planned = json.loads(capsys.readouterr().out)["weights_bytes"]
        parameters = parameter_count(load_model_config(str(checkpoint / "config.json"))[1])
        if weights_dtype != "fp32":
            assert planned > parameters * {"int8": 1, "bf16": 2}[weights_dtype]  # more than parameters x dtype
        elif takes_f32_layout(torch.float32, TINY_VOCAB):
            assert planned == parameters * 4  # the packed head is the only copy of its weight
        assert planned == held, weights_dtype
