"""The engine on a CUDA device: greedy tokens against transformers in float32, and offline speed.

    python benchmarks/gpu_check.py --device cuda [--out gpu.md] [--quick] [--tensor-parallel 2] [--skip-speed]
        [--models smollm2,llama8b] [--backends torch,triton] [--budget-s 560]

Needs only torch, transformers, safetensors, numpy, rich and Triton (what the H200 image has; not pyzmq, which only
--tensor-parallel needs), with ``src`` on PYTHONPATH; no weights: the correctness cases use tiny random checkpoints
of two architectures (every attention backend, eager and compiled; an int8 and an fp8 KV cache too), and the speed
runs random models of SmolLM2-135M's and Llama-3.1-8B's shapes in bf16 (speed does not depend on the values of the
weights) on mixed-64 and nano-vllm's workload (256 requests, input and output lengths uniform in 100-1,024), plus
continuous against static batching and the GPU's busy share under torch.profiler (SmolLM2's shape), batch-1 decode
of the 8B shape against the HBM roofline (weight bytes over the measured copy bandwidth), the host's time per step
(host_overhead.py), and the 8B shape with 8-bit caches; bf16 top-1 agreement with float32 transformers on the tiny
checkpoints, teacher-forced. No speed run starts after --budget-s seconds (a skipped one is listed as such), so the
report comes back whole within the device tool's 600-second limit. Every row is written to --out as it is measured;
a configuration that raises becomes a FAILED row (its traceback on stderr) and the run goes on.
CI never runs it; on CPU tensors it runs as a smoke test with ``TRITON_INTERPRET=1 --device cpu --quick``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import math
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline_throughput import mixed_workload

from tokenloom import LLM, SamplingParams

TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.25,
    eos_token_id=511, bos_token_id=0,
)  # fmt: skip
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, eos_token_id=2, bos_token_id=1,
)  # fmt: skip
LLAMA_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
    tie_word_embeddings=False, eos_token_id=128001, bos_token_id=128000,
)  # fmt: skip
MODELS = {"smollm2": SMOLLM2_135M, "llama8b": LLAMA_8B}
ENGINE_CASES = {
    "roomy": dict(max_num_seqs=16, max_num_batched_tokens=1024),
    "chunked + preempted": dict(max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=12, block_size=8),
    "swap": dict(max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=12, block_size=8,
                 preemption_mode="swap", num_swap_blocks=64),
    # Each step launched before the one before is read, its tokens taken on the device: stream order is what keeps
    # it right, so it is checked where there are streams.
    "chunked + preempted, async scheduling": dict(max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=12,
                                                  block_size=8, async_scheduling=True),
}  # fmt: skip


OUT: Path | None = None
DEADLINE = math.inf  # --budget-s from the start: no speed run starts after it
FAILURES: list[str] = []  # what raised (guarded): the run is not all equal
T = TypeVar("T")


def emit(lines: list[str], line: str) -> None:
    """Print a result row and rewrite the report, so a run stopped at its time limit still leaves what it measured."""
    lines.append(line)
    print(line, flush=True)
    if OUT is not None:
        OUT.write_text("\n".join(lines) + "\n")


def guarded(lines: list[str], what: str, measure: Callable[[], T]) -> T | None:
    """measure(), or None where it raised: its error becomes a row of the report (and its traceback goes to
    stderr) and the run goes on, so one broken configuration on a lent GPU costs its own row, not the rest."""
    try:
        return measure()
    except Exception as error:
        traceback.print_exc()
        FAILURES.append(what)
        emit(lines, f"| {what} | FAILED: {type(error).__name__}: {' '.join(str(error).split())[:300]} |")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def save_random_checkpoint(arch: str, config: dict, directory: Path, dtype: torch.dtype) -> Path:
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[arch]
    extra = {"head_dim": 32, "tie_word_embeddings": True} if arch == "qwen3" else {}
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(cls(**config, **extra), dtype=dtype)
    model.save_pretrained(directory)
    return directory


def oracle_tokens(path: Path, prompts: list[list[int]], new_tokens: int, device: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").to(device)
    # No EOS at all, as ignore_eos: min_new_tokens would instead mask EOS's logit, changing the argmax.
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def check_tensor_parallel(root: Path, device: str, size: int, lines: list[str]) -> bool:
    """Greedy tokens of `size` ranks against transformers'; NCCL when each rank has a GPU, else gloo on one."""
    from tokenloom.model.parallel_runner import backend_for

    rng = random.Random(1)
    prompts = [[rng.randrange(511) for _ in range(rng.randint(3, 60))] for _ in range(10)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    all_ok = True
    backend = backend_for(device, size)
    header = f"| architecture | engine case | ranks ({backend}) | tokens equal transformers' |"
    lines += ["", header, "|---|---|---|---|"]
    for arch in ("llama", "qwen3"):
        path = root / arch
        if not path.exists():
            save_random_checkpoint(arch, TINY, path, torch.float32)
        expected = oracle_tokens(path, prompts, 12, device)
        for case, knobs in ENGINE_CASES.items():
            if knobs.get("async_scheduling"):
                continue  # one rank only
            llm = LLM(str(path), device=device, dtype="float32", tensor_parallel_size=size, **knobs)
            try:
                outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
            finally:
                llm.shutdown()
            same = sum(o.outputs[0].token_ids == e for o, e in zip(outputs, expected, strict=True))
            all_ok &= same == len(prompts)
            emit(lines, f"| {arch} | {case} | {size} | {same}/{len(prompts)} |")
    return all_ok


def check_correctness(root: Path, device: str, backends: list[str], lines: list[str]) -> bool:
    rng = random.Random(0)
    prompts = [[rng.randrange(511) for _ in range(rng.randint(3, 60))] for _ in range(10)]
    all_ok = True
    lines += ["| architecture | engine case | attention | step | tokens equal transformers' |", "|---|---|---|---|---|"]
    for arch in ("llama", "qwen3"):
        path = save_random_checkpoint(arch, TINY, root / arch, torch.float32)
        expected = oracle_tokens(path, prompts, 12, device)
        for case, knobs in ENGINE_CASES.items():
            for backend in backends:
                # The plain path compiled is no one's default on a GPU (Triton is): eager, as the reference, will do.
                for eager in (True, False) if backend != "torch" else (True,):
                    step = "eager" if eager else ("compiled + decode graphs" if backend == "triton" else "compiled")
                    row = f"{arch} | {case} | {backend} | {step}"
                    engine = dict(knobs, enforce_eager=eager, attention_backend=backend)
                    all_ok &= tokens_row(lines, row, path, device, prompts, expected, engine)
        if arch == "llama" and "triton" in backends:
            all_ok &= penalties_row(lines, path, device, prompts)
            all_ok &= token_bias_row(lines, path, device, prompts, expected)
    return all_ok


PENALTIES = [{"repetition_penalty": 1.3}, {"presence_penalty": 0.8, "frequency_penalty": 0.4}, {}]


def penalties_row(lines, path: Path, device: str, prompts) -> bool:
    """Penalized requests scheduled ahead, their last token counted on the device, against the same engine reading
    each step before the next: the same greedy tokens (no transformers oracle has OpenAI's penalties)."""
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **PENALTIES[i % 3]) for i in range(len(prompts))
    ]
    row = "llama | penalties, async scheduling against sync | triton | the default step"
    knobs = {"attention_backend": "triton"}
    expected = guarded(lines, row + " (sync)", functools.partial(greedy_tokens, path, device, prompts, knobs, params))
    if expected is None:
        return False
    return tokens_row(lines, row, path, device, prompts, expected, dict(knobs, async_scheduling=True), params)


def token_bias_row(lines, path: Path, device: str, prompts, plain: list[list[int]]) -> bool:
    """min_tokens and logit_bias (model/token_bias.py: a few logits changed in place from pinned host arrays), steps
    scheduled ahead on the device, against the same requests on the host's CPU, whose float32 tokens equal
    transformers' (tests/engine/test_min_tokens_and_logit_bias.py). Each prompt's plain third token is made a stop
    token that min_tokens bans there, and its plain first token banned by a bias."""
    params = [
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tokens[2]], min_tokens=6,
                       logit_bias={tokens[0]: -100.0, (tokens[0] + 7) % 511: 2.5})
        for tokens in plain
    ]  # fmt: skip
    row = "llama | min_tokens + logit_bias, async scheduling, against the CPU | triton | the default step"
    expected = guarded(lines, row + " (CPU)", functools.partial(greedy_tokens, path, "cpu", prompts, {}, params))
    if expected is None:
        return False
    knobs = {"attention_backend": "triton", "async_scheduling": True}
    return tokens_row(lines, row, path, device, prompts, expected, knobs, params)


def tokens_row(lines, row: str, path: Path, device: str, prompts, expected, knobs: dict, params=None) -> bool:
    """One row: how many prompts' 12 greedy float32 tokens (or params', one a prompt) from an engine built with
    knobs equal the expected ones (or FAILED, guarded); whether all do."""
    got = guarded(lines, row, functools.partial(greedy_tokens, path, device, prompts, knobs, params))
    if got is None:
        return False
    same = sum(g == e for g, e in zip(got, expected, strict=True))
    emit(lines, f"| {row} | {same}/{len(prompts)} |")
    return same == len(prompts)


def check_bf16_agreement(root: Path, device: str, backends: list[str], lines: list[str]) -> bool:
    """Teacher-forced top-1 of the engine in bf16 against transformers' float32 logits: each sequence as a first
    chunk, eight single-token decodes and a last chunk reading the bf16 paged cache. The weights are the tiny random
    checkpoints (the real model does not travel to the device machine: its GGUF is over the carry limit), whose bf16
    agreement is lower than the real model's (~96% on the plain path); the check is that every backend agrees with
    float32 within a point of the plain PyTorch path."""
    import itertools

    from transformers import AutoModelForCausalLM

    from tokenloom.config import EngineConfig
    from tokenloom.core.request import Request
    from tokenloom.core.scheduler_output import ScheduledRequest
    from tokenloom.engine.llm_engine import LLMEngine
    from tokenloom.utils import cdiv

    rng = random.Random(2)
    sequences = [[rng.randrange(511) for _ in range(rng.randint(40, 120))] for _ in range(8)]
    all_ok = True
    lines += ["", "| architecture | attention | bf16 top-1 agreement with float32 transformers |", "|---|---|---|"]
    plain: dict[str, float] = {}
    for arch in ("llama", "qwen3"):
        path = root / arch
        oracle = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").to(device)
        for backend in backends:
            if backend == "triton" and not device.startswith("cuda"):
                # Triton's interpreter (CPU tensors) gets tl.dot of bf16 tiles wrong outright (a 16 x 16 product off
                # by ~1e10 with Triton 3.6 and 3.9), so a CPU smoke run can check bf16 only on the plain path.
                emit(lines, f"| {arch} | {backend} | skipped: the interpreter's bf16 dot is wrong |")
                continue
            config = EngineConfig.from_kwargs(model=str(path), device=device, dtype="bfloat16", num_kv_blocks=64,
                                              block_size=16, enforce_eager=True, attention_backend=backend)  # fmt: skip
            runner = LLMEngine(config).core.runner
            agree = total = 0
            for ids in sequences:
                with torch.inference_mode():
                    reference = oracle(torch.tensor([ids], device=device)).logits[0].argmax(-1)
                request = Request("x", ids, SamplingParams())
                middle = len(ids) // 2
                bounds = [0, *range(middle, middle + 9), len(ids)]
                rows = []
                for start, end in itertools.pairwise(bounds):
                    item = ScheduledRequest(request, start, ids[start:end], list(range(cdiv(end, 16))), sample=True)
                    inputs = runner.prepare_inputs([item])
                    with torch.inference_mode():
                        hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
                        rows.append(runner.model.compute_logits(hidden).float().argmax(-1))
                agree += int((torch.cat(rows) == reference).sum())
                total += len(ids)
            share = agree / total
            if backend == "torch":
                plain[arch] = share
            all_ok &= share >= plain.get(arch, share) - 0.01  # backends after torch, within a point of it
            emit(lines, f"| {arch} | {backend} | {agree}/{total} ({100 * share:.1f}%) |")
    return all_ok


def check_8bit_cache(root: Path, device: str, backends: list[str], lines: list[str]) -> bool:
    """--kv-cache-dtype int8 and fp8_e4m3 (issue 24) on every backend: the Triton cache write leaves the bytes of
    the plain path's (on CUDA: the interpreter's fp8 conversion is wrong, so a CPU run checks int8 only), and greedy
    tokens under chunking and preemption equal the plain path's eager tokens with the same cache format."""
    from tokenloom.model import kv_quant, triton_attention

    all_ok = True
    lines += ["", "| 8-bit KV cache | check | result |", "|---|---|---|"]
    formats = ["int8", "fp8_e4m3"] if device.startswith("cuda") else ["int8"]
    if "triton" in backends:
        for name in formats:
            fmt = kv_quant.FORMATS[name]
            gen = torch.Generator(device=device).manual_seed(3)
            k, v = (torch.randn(300, 8 * 128, device=device, generator=gen, dtype=torch.bfloat16) for _ in "kv")
            slots = torch.randperm(64 * 16, device=device, generator=gen)[:300]
            caches = [torch.zeros(64 * 16, fmt.row_bytes(8, 128), dtype=torch.uint8, device=device) for _ in "kvKV"]
            triton_attention.write_kv_codes(caches[0], caches[1], k, v, slots, fmt.kind, fmt.max_code, 128, 16)
            kv_quant.write(caches[2], k, slots, fmt, 128, 16)
            kv_quant.write(caches[3], v, slots, fmt, 128, 16)
            equal = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
            all_ok &= equal
            emit(lines, f"| {name} | Triton write = PyTorch write, bytes | {'equal' if equal else 'DIFFERENT'} |")
    rng = random.Random(5)
    prompts = [[rng.randrange(511) for _ in range(rng.randint(3, 60))] for _ in range(10)]
    path = root / "llama"
    for name in formats:
        expected: list[list[int]] | None = None
        for backend in ["torch", *(b for b in backends if b != "torch")]:
            for eager in (True, False) if backend != "torch" else (True,):
                row = f"{name} | llama, chunked + preempted, {backend} {'eager' if eager else 'compiled'} = torch eager"
                engine = dict(ENGINE_CASES["chunked + preempted"], enforce_eager=eager, attention_backend=backend,
                              kv_cache_dtype=name)  # fmt: skip
                if expected is None:  # the plain path's tokens are the reference the other rows are checked against
                    expected = guarded(lines, row, functools.partial(greedy_tokens, path, device, prompts, engine))
                    all_ok &= expected is not None
                    if expected is not None:
                        emit(lines, f"| {name} | llama, chunked + preempted, torch eager | the reference |")
                else:
                    all_ok &= tokens_row(lines, row, path, device, prompts, expected, engine)
    return all_ok


def greedy_tokens(path: Path, device: str, prompts: list[list[int]], knobs: dict, params=None) -> list[list[int]]:
    llm = LLM(str(path), device=device, dtype="float32", **knobs)
    params = params or SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]  # fmt: skip


def nano_vllm_workload(num_requests: int, seed: int, vocab: int):
    """nano-vllm's benchmark: input and output lengths uniform in 100-1,024 tokens."""
    from offline_throughput import Workload

    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(100, 1024))] for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(100, 1024) for _ in range(num_requests)])


SPEED_HEADER = """| model shape | workload | attention | step | start-up s | seconds | output tok/s | prompt tok |
|---|---|---|---|---:|---:|---:|---:|"""


def measure_speed(root: Path, device: str, quick: bool, models: list[str], backends: list[str], lines: list[str]):
    """Each shape's runs in the order the issue needs them, so a run stopped by --budget-s loses the least: the
    Triton step eager and graphed, asynchronous scheduling, then the plain path (SmolLM2's shape only: the 8B shape's
    gathers would take minutes), continuous against static batching and the GPU's busy share (SmolLM2's shape), the
    8B shape's batch-1 roofline, and last the 8-bit caches (issue 24)."""
    lines += ["", SPEED_HEADER]
    for name in models:
        if out_of_time(lines, f"{name} | every run", needs=120.0):  # its random checkpoint alone takes a while
            continue
        config = dict(MODELS[name], num_hidden_layers=2) if quick else MODELS[name]
        path = save_random_checkpoint("llama", config, root / f"{name}-shape", torch.bfloat16)
        workloads = [("mixed-64", mixed_workload(64, 0, config["vocab_size"]), 64, 2048)]
        workloads.append(("nano-vllm-256", nano_vllm_workload(256, 0, config["vocab_size"]), 256, 8192))
        for label, work, seqs, budget in workloads:
            if quick:
                work.prompts, work.max_tokens = [p[:64] for p in work.prompts[:4]], [4] * 4
            run = functools.partial(run_one, lines, device, path, name, label, work, seqs, budget)
            others = [b for b in backends if b != "triton" and (name == "smollm2" or quick)]
            if "triton" in backends:
                run("triton", eager=True)
                run("triton", eager=False)
                run("triton", eager=False, ahead=True)
                if name == "smollm2":  # where the host's share of a step is largest
                    if seqs == 256:  # the core's loop apart, where the most requests share a step (one run only:
                        run_core_process(run, lines, name, label)  # the 8B shape's runs come after these)
                    run("triton", eager=False, overlap=False)
            for backend in others:
                run(backend, eager=True)
                run(backend, eager=False)
        if name == "smollm2" and "triton" in backends:
            label, work, seqs, budget = workloads[0]
            run_one(lines, device, path, name, label, work, seqs, budget, "triton", eager=False, batching="static")
            guarded(lines, "GPU busy share", functools.partial(gpu_busy_share, lines, device, path, quick))
        if name == "llama8b" and not quick and not out_of_time(lines, "batch-1 roofline"):
            guarded(lines, "batch-1 roofline", functools.partial(batch_one_roofline, lines, device, path, config))
        if "triton" in backends and (name == "llama8b" or quick):
            # Issue 24: an 8-bit cache where KV bytes weigh most
            label, work, seqs, budget = workloads[-1]
            emit(lines, "\n" + SPEED_HEADER)
            for kv_dtype in ("int8", "fp8_e4m3"):
                run_one(lines, device, path, name, label, work, seqs, budget, "triton", eager=False, ahead=True,
                        kv_dtype=kv_dtype)  # fmt: skip
        shutil.rmtree(path, ignore_errors=True)


def run_core_process(run: Callable[..., None], lines: list[str], name: str, label: str) -> None:
    """The Triton step graphed, asynchronous scheduling, the engine core in a process of its own (needs pyzmq, which
    the GPU image lacks unless its wheel is carried: RESULTS.md gives the command)."""
    if importlib.util.find_spec("zmq") is None:
        emit(lines, f"| {name} | {label} | triton | core process: skipped, no pyzmq here |")
        return
    run("triton", eager=False, ahead=True, core_process=True)


def out_of_time(lines: list[str], what: str, needs: float = 45.0) -> bool:
    """Whether --budget-s leaves too little for one more measurement; says so in the report."""
    if time.monotonic() + needs < DEADLINE:
        return False
    emit(lines, f"| {what} | skipped: the time budget (--budget-s) is spent |")
    return True


def run_one(
    lines, device, path, name, label, work, seqs, budget, backend, eager, overlap=None, ahead=False, kv_dtype="auto",
    batching="continuous", core_process=False,
) -> None:  # fmt: skip
    """overlap: asynchronous output processing (None: the engine's default, on for an accelerator); ahead:
    asynchronous scheduling; kv_dtype: --kv-cache-dtype; core_process: the engine core in a process of its own."""
    if out_of_time(lines, f"{name} | {label} | {backend}"):
        return
    guarded(lines, f"{name} | {label} | {backend} | eager {eager}, async scheduling {ahead}, {kv_dtype} cache",
            lambda: timed_run(lines, device, path, name, label, work, seqs, budget, backend, eager, overlap, ahead,
                              kv_dtype, batching, core_process))  # fmt: skip


def timed_run(
    lines, device, path, name, label, work, seqs, budget, backend, eager, overlap, ahead, kv_dtype, batching,
    core_process,
) -> None:  # fmt: skip
    started = time.perf_counter()
    llm = LLM(str(path), device=device, dtype="bfloat16", enforce_eager=eager, attention_backend=backend,
              max_num_seqs=seqs, max_num_batched_tokens=budget, async_output_proc=overlap,
              async_scheduling=ahead, kv_cache_dtype=kv_dtype, batching=batching,
              core_process=core_process)  # fmt: skip
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [7] * 40}] * 2, warm, use_tqdm=False)
    startup = time.perf_counter() - started
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in work.max_tokens]
    synchronize(device)
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in work.prompts], params, use_tqdm=False)
    synchronize(device)
    seconds = time.perf_counter() - started
    step = "eager" if eager else ("compiled + decode graphs" if backend == "triton" else "compiled")
    scheduler = llm.engine.config.scheduler
    step += (
        ", async scheduling" if scheduler.async_scheduling
        else ", outputs read after the next launch" if scheduler.overlaps_output_processing(device.split(":")[0])
        else ", outputs read in step"
    )  # fmt: skip
    step += ", core process" if core_process else ""
    step += "" if kv_dtype == "auto" else f", {kv_dtype} KV cache"
    step += "" if batching == "continuous" else f", {batching} batching"
    emit(
        lines,
        f"| {name} | {label} | {backend} | {step} | {startup:.1f} | {seconds:.2f} | "
        f"{work.output_tokens / seconds:.0f} | {work.prompt_tokens} |",
    )
    del llm
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def gpu_busy_share(lines: list[str], device: str, path: Path, quick: bool) -> None:
    """How much of a decode-heavy stretch the GPU is busy: 64 requests of 128 prompt tokens and 64 new ones, Triton
    graphed, outputs read in step and with asynchronous scheduling, under torch.profiler recording CUDA activity
    alone (no host-side tracing to slow the host); busy = the union of kernel and copy intervals over the span from
    the first to the last."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if not device.startswith("cuda"):
        emit(lines, "\nGPU busy share: needs CUDA (skipped)")
        return
    prompts = [{"prompt_token_ids": [(97 * i + j) % 40000 + 100 for j in range(128)]} for i in range(64)]
    params = SamplingParams(temperature=0, max_tokens=8 if quick else 64, ignore_eos=True)
    for ahead in (False, True):
        if out_of_time(lines, f"GPU busy share, async scheduling {ahead}"):
            return
        llm = LLM(str(path), device=device, dtype="bfloat16", enforce_eager=False, max_num_seqs=64,
                  async_scheduling=ahead)  # fmt: skip
        llm.generate(prompts[:2], params, use_tqdm=False)
        synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
            synchronize(device)
        spans = sorted(
            (e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA
        )
        busy, reach = 0.0, -math.inf
        for start, end in spans:
            busy += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        total = (reach - spans[0][0]) if spans else 0.0
        share = f"{100 * busy / total:.0f}% busy over {total / 1e3:.0f} ms" if total > 0 else "no CUDA events seen"
        mode = "async scheduling" if ahead else "outputs read after the next launch"
        emit(lines, f"\nGPU busy share, SmolLM2 shape, 64 x (128 + 64) tokens, graphed, {mode}: {share}")
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def batch_one_roofline(lines: list[str], device: str, path: Path, config: dict) -> None:
    """One request decoding 256 tokens: weight bytes read per token over the copy bandwidth this device measures."""
    weights = checkpoint_bytes(path)
    bandwidth = copy_bandwidth(device)
    llm = LLM(str(path), device=device, dtype="bfloat16", enforce_eager=False, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [7] * 32}], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    synchronize(device)
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": [9] * 32}], params, use_tqdm=False)
    synchronize(device)
    per_token = (time.perf_counter() - started) / 256
    ideal = weights / bandwidth
    emit(lines, f"\nbatch-1 decode, 8B shape: {1e3 * per_token:.2f} ms/token; roofline {1e3 * ideal:.2f} ms "
                f"({weights / 2**30:.1f} GiB of weights at {bandwidth / 1e12:.2f} TB/s measured): "
                f"{100 * ideal / per_token:.0f}% of it")  # fmt: skip
    del llm


def checkpoint_bytes(path: Path) -> int:
    """The bytes of every tensor in the checkpoint, from the safetensors headers (nothing is loaded)."""
    from safetensors import safe_open

    sizes = {"BF16": 2, "F16": 2, "F32": 4}
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - a safe_open handle has keys(), it does not iterate
                tensor = f.get_slice(key)
                total += math.prod(tensor.get_shape()) * sizes[tensor.get_dtype()]
    return total


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (read plus write counted once: what decode reads)."""
    if not device.startswith("cuda"):
        return 20e9
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * 10 * src.numel() / (time.perf_counter() - started)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def host_overhead(lines: list[str]) -> None:
    """benchmarks/host_overhead.py on this machine's CPU (the forward stubbed)."""
    import subprocess

    script = Path(__file__).with_name("host_overhead.py")
    modes = (
        ["--running", "64,256", "--async-output-proc"],  # the default on a GPU
        ["--running", "64,256", "--async-scheduling"],  # the step ahead
        ["--running", "256", "--async-scheduling", "--core-loop"],  # what the core's own process does a step
    )
    for extra in modes:
        command = [sys.executable, str(script), "--prompt-len", "512", *extra]
        done = subprocess.run(command, capture_output=True, text=True)
        failure = f"\nFAILED ({done.returncode}): {done.stderr.strip()[-1500:]}" if done.returncode else ""
        emit(lines, f"\nhost overhead (forward stubbed) {' '.join(extra)}:\n" + done.stdout.strip() + failure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true", help="a smoke run: a 4-layer model, 8 short requests")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="also check this many ranks' tokens")
    parser.add_argument("--skip-speed", action="store_true", help="correctness only")
    parser.add_argument("--models", default="smollm2,llama8b", help=f"speed on these shapes: {', '.join(MODELS)}")
    parser.add_argument("--backends", default="torch,triton", help="attention backends to check and time")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=560.0,
        help="no speed run starts after this many seconds (the device tool stops a command at 600)",
    )
    args = parser.parse_args()
    global OUT, DEADLINE
    OUT = args.out
    DEADLINE = time.monotonic() + args.budget_s
    # Every engine here compiles the same model class anew; dynamo's default limit of recompilations per code
    # object (8) is reached after a few engines in one process.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 1024)
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU"
    lines = [f"device: {name}; torch {torch.__version__}", ""]
    with tempfile.TemporaryDirectory() as tmp:
        backends = args.backends.split(",")
        root, device = Path(tmp), args.device
        ok = bool(guarded(lines, "correctness", lambda: check_correctness(root, device, backends, lines)))
        ok &= bool(guarded(lines, "bf16 agreement", lambda: check_bf16_agreement(root, device, backends, lines)))
        ok &= bool(guarded(lines, "8-bit cache", lambda: check_8bit_cache(root, device, backends, lines)))
        if args.tensor_parallel > 1:
            size = args.tensor_parallel
            ok &= bool(guarded(lines, "tensor parallel", lambda: check_tensor_parallel(root, device, size, lines)))
        if not args.skip_speed:
            host_overhead(lines)  # before the speed runs, which stop themselves at the time budget
            models = args.models.split(",")
            guarded(lines, "speed", lambda: measure_speed(root, device, args.quick, models, backends, lines))
    verdict = "all equal" if ok and not FAILURES else f"MISMATCH or FAILED ({len(FAILURES)} failed: {FAILURES[:8]})"
    emit(lines, f"\ncorrectness: {verdict}")
    sys.exit(0 if ok and not FAILURES else 1)


if __name__ == "__main__":
    main()
