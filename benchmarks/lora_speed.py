"""What serving LoRA adapters costs, in one process and one sitting: the embedded model with LoRA off, then on.

    .venv/bin/python benchmarks/lora_speed.py [--rounds 2] [--rank 16]

Engines, built once and measured in turn, alternating their order each round (this machine's speed drifts):
  base                LoRA off (the default)
  lora, no adapter    --enable-lora --max-loras 4, every request on the base model
  lora, 1 adapter     the same engine, every request under one adapter
  lora, 4 adapters    the same engine, requests spread over four adapters (all four in every step)
Adapters: PEFT files of random A and B at --rank on all seven projections of every layer, written to a temporary
directory (nothing is downloaded). Workloads: mixed-64 (offline_throughput.py's 64 requests at once, greedy,
ignore_eos: output tok/s) and batch-1 decode (one 32-token prompt, 256 tokens: tok/s after the first). Medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

import torch
from offline_throughput import mixed_workload
from safetensors.torch import save_file

from tokenloom import LLM, LoRARequest, SamplingParams
from tokenloom.bench.provenance import cpu_flags
from tokenloom.model.config import ModelConfig
from tokenloom.model.lora import FUSED_TARGETS, projection_shapes


def write_adapter(directory: Path, config: ModelConfig, rank: int, seed: int) -> Path:
    generator = torch.Generator().manual_seed(seed)
    shapes, tensors = projection_shapes(config), {}
    for layer in range(config.num_layers):
        for target, members in FUSED_TARGETS.items():
            block = target.split(".")[0]
            for projection in members:
                out_features, in_features = shapes[projection]
                prefix = f"base_model.model.model.layers.{layer}.{block}.{projection}"
                tensors[f"{prefix}.lora_A.weight"] = 0.02 * torch.randn(rank, in_features, generator=generator)
                tensors[f"{prefix}.lora_B.weight"] = 0.02 * torch.randn(out_features, rank, generator=generator)
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    targets = [p for members in FUSED_TARGETS.values() for p in members]
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    (directory / "adapter_config.json").write_text(json.dumps(settings))
    return directory


def mixed_64(llm: LLM, salt: int, adapters: list[LoRARequest | None]) -> float:
    work = mixed_workload(64, 0, 49152)
    prompts = [{"prompt_token_ids": [100 + (p[0] + salt * 7919) % 49000, *p[1:]]} for p in work.prompts]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in work.max_tokens]
    lora = [adapters[i % len(adapters)] for i in range(len(prompts))]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def batch_1(llm: LLM, salt: int, adapter: LoRARequest | None) -> float:
    prompt = {"prompt_token_ids": [100 + (i * 31 + salt) % 40000 for i in range(32)]}
    first = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False,
                 lora_request=adapter)  # fmt: skip
    prefill = time.perf_counter() - first
    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=257, ignore_eos=True), use_tqdm=False,
                 lora_request=adapter)  # fmt: skip
    return 256 / (time.perf_counter() - start - prefill)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}; CPU flags: {cpu_flags()}")
    base = LLM(max_num_seqs=64, kv_cache_memory=2**30)
    lora = LLM(max_num_seqs=64, kv_cache_memory=2**30, enable_lora=True, max_loras=4, max_lora_rank=args.rank)
    config = lora.engine.model_config
    root = Path(tempfile.mkdtemp(prefix="lora-speed-"))
    adapters = [
        LoRARequest(f"a{i}", i + 1, str(write_adapter(root / f"a{i}", config, args.rank, seed=i))) for i in range(4)
    ]
    runs = {
        "base (LoRA off)": (base, [None]),
        "lora, no adapter": (lora, [None]),
        "lora, 1 adapter": (lora, adapters[:1]),
        "lora, 4 adapters": (lora, adapters),
    }
    results: dict[str, dict[str, list[float]]] = {name: {"mixed": [], "batch1": []} for name in runs}
    for round_ in range(args.rounds):
        order = list(runs) if round_ % 2 == 0 else list(runs)[::-1]
        for name in order:
            llm, chosen = runs[name]
            results[name]["mixed"].append(mixed_64(llm, round_ + 1, chosen))
            results[name]["batch1"].append(batch_1(llm, round_ + 1, chosen[0]))
            print(f"round {round_ + 1} {name}: mixed-64 {results[name]['mixed'][-1]:.0f} tok/s, "
                  f"batch-1 decode {results[name]['batch1'][-1]:.1f} tok/s", flush=True)  # fmt: skip
    first = {k: statistics.median(v) for k, v in results["base (LoRA off)"].items()}
    print(f"\n| engine, rank {args.rank} (medians of {args.rounds}) | mixed-64 out tok/s | vs base | "
          "batch-1 decode tok/s | vs base |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    for name, figures in results.items():
        mixed, single = statistics.median(figures["mixed"]), statistics.median(figures["batch1"])
        print(f"| {name} | {mixed:.0f} | {mixed / first['mixed']:.2f}x | {single:.1f} | "
              f"{single / first['batch1']:.2f}x |")  # fmt: skip
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
