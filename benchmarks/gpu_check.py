"""The engine on a CUDA device: greedy tokens against transformers in float32, and offline speed, eager vs compiled.

    python benchmarks/gpu_check.py --device cuda [--out gpu.md] [--quick] [--tensor-parallel 2] [--skip-speed]

Needs only torch, transformers, safetensors, numpy and rich (what a GPU image has), with ``src`` on PYTHONPATH;
no weights: the correctness cases use tiny random checkpoints of two architectures, and the speed runs a random
model of SmolLM2-135M's shape (speed does not depend on the values of the weights). CI never runs it.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

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
ENGINE_CASES = {
    "roomy": dict(max_num_seqs=16, max_num_batched_tokens=1024),
    "chunked + preempted": dict(max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=12, block_size=8),
    "swap": dict(max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=12, block_size=8,
                 preemption_mode="swap", num_swap_blocks=64),
}  # fmt: skip


OUT: Path | None = None


def emit(lines: list[str], line: str) -> None:
    """Print a result row and rewrite the report, so a run stopped at its time limit still leaves what it measured."""
    lines.append(line)
    print(line, flush=True)
    if OUT is not None:
        OUT.write_text("\n".join(lines) + "\n")


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
            llm = LLM(str(path), device=device, dtype="float32", tensor_parallel_size=size, **knobs)
            try:
                outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
            finally:
                llm.shutdown()
            same = sum(o.outputs[0].token_ids == e for o, e in zip(outputs, expected, strict=True))
            all_ok &= same == len(prompts)
            emit(lines, f"| {arch} | {case} | {size} | {same}/{len(prompts)} |")
    return all_ok


def check_correctness(root: Path, device: str, lines: list[str]) -> bool:
    rng = random.Random(0)
    prompts = [[rng.randrange(511) for _ in range(rng.randint(3, 60))] for _ in range(10)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    all_ok = True
    lines += ["| architecture | engine case | step | tokens equal transformers' |", "|---|---|---|---|"]
    for arch in ("llama", "qwen3"):
        path = save_random_checkpoint(arch, TINY, root / arch, torch.float32)
        expected = oracle_tokens(path, prompts, 12, device)
        for case, knobs in ENGINE_CASES.items():
            for eager in (True, False):
                llm = LLM(str(path), device=device, dtype="float32", enforce_eager=eager, **knobs)
                outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
                got = [o.outputs[0].token_ids for o in outputs]
                same = sum(g == e for g, e in zip(got, expected, strict=True))
                all_ok &= same == len(prompts)
                step = "eager" if eager else "compiled"
                emit(lines, f"| {arch} | {case} | {step} | {same}/{len(prompts)} |")
    return all_ok


def measure_speed(root: Path, device: str, quick: bool, lines: list[str]) -> None:
    config = dict(SMOLLM2_135M, num_hidden_layers=4) if quick else SMOLLM2_135M
    path = save_random_checkpoint("llama", config, root / "smollm2-shape", torch.bfloat16)
    lines += [
        "",
        "| workload | engine | step | start-up s | seconds | output tok/s | prompt tok |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for num_requests, seqs, budget in ((64, 64, 2048), (256, 256, 8192)):
        if quick and num_requests > 64:
            continue
        work = mixed_workload(num_requests, 0, config["vocab_size"])
        if quick:
            work.prompts, work.max_tokens = work.prompts[:8], [8] * 8
        for eager in (True, False):
            started = time.perf_counter()
            llm = LLM(str(path), device=device, dtype="bfloat16", enforce_eager=eager,
                      max_num_seqs=seqs, max_num_batched_tokens=budget)  # fmt: skip
            warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            llm.generate([{"prompt_token_ids": [7] * 40}] * 2, warm, use_tqdm=False)
            startup = time.perf_counter() - started
            params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in work.max_tokens]
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            started = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in work.prompts], params, use_tqdm=False)
            seconds = time.perf_counter() - started
            step = "eager" if eager else "compiled"
            emit(
                lines,
                f"| mixed-{num_requests} | max_num_seqs {seqs}, budget {budget} | {step} | {startup:.1f} | "
                f"{seconds:.2f} | {work.output_tokens / seconds:.0f} | {work.prompt_tokens} |",
            )
            del llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true", help="a smoke run: a 4-layer model, 8 short requests")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="also check this many ranks' tokens")
    parser.add_argument("--skip-speed", action="store_true", help="correctness only")
    args = parser.parse_args()
    global OUT
    OUT = args.out
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU"
    lines = [f"device: {name}; torch {torch.__version__}", ""]
    with tempfile.TemporaryDirectory() as tmp:
        ok = check_correctness(Path(tmp), args.device, lines)
        if args.tensor_parallel > 1:
            ok &= check_tensor_parallel(Path(tmp), args.device, args.tensor_parallel, lines)
        if not args.skip_speed:
            measure_speed(Path(tmp), args.device, args.quick, lines)
    emit(lines, f"\ncorrectness: {'all equal' if ok else 'MISMATCH'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
