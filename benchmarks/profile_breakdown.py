"""Where the time of a continuous-batching run goes: GEMMs, attention, sampler, scheduler, Python.

    .venv/bin/python benchmarks/profile_breakdown.py [--num-requests 64] [--max-num-seqs 64] [--dtype auto]
        [--quantization int8] [--kv-cache-dtype int8]

Runs the first requests of the mixed-64 workload under cProfile and sums the time of the functions that make
up each part of a step. cProfile adds some overhead to every Python call, so the "Python and the rest" line is
an upper bound.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

from offline_throughput import mixed_workload

from tokenloom import LLM, SamplingParams

# part of the step -> (function name, file fragment, use cumulative time?). All paths are listed: the C++
# operators and packed linears (bf16 on CPU: ours, or oneDNN's with AMX; float32 on AVX2 CPUs: ours) and plain
# PyTorch (float32 linears elsewhere, other devices). Our gate/up linear applies SiLU in its epilogue, so with it
# SiLU counts among the GEMMs.
PARTS = {
    "GEMMs (q/k/v/o, MLP, LM head)": [
        ("<built-in method torch._C._nn.linear>", "~", False),
        ("<built-in method torch._ops.mkldnn._linear_pointwise>", "~", False),
        ("<built-in method torch._ops.tokenloom.bf16_linear>", "~", False),
        ("<built-in method torch._ops.tokenloom.f32_linear>", "~", False),
        ("<built-in method torch._ops.tokenloom.bf16_linear_silu_and_mul>", "~", False),
        ("<built-in method torch._ops.tokenloom.bf16_amx_linear>", "~", False),
        ("<built-in method torch._ops.tokenloom.int8_linear>", "~", False),
        ("<built-in method torch._ops.tokenloom.int8_amx_linear>", "~", False),
        ("<built-in method torch._ops.onednn.qlinear_pointwise>", "~", False),
        ("<built-in method torch._ops.tokenloom.scale_rows>", "~", False),
    ],
    "int8 activations: rotate and quantize": [
        ("<built-in method torch._ops.tokenloom.quantize_rows_int8>", "~", False)
    ],
    "decode attention": [
        ("paged_decode_attention", "cpu_kernel.py", True),
        ("_decode_attention", "attention.py", True),
    ],
    "prefill attention": [
        ("_prefill_attention", "attention.py", True),
        ("<built-in method torch._ops.tokenloom.prefill_attention>", "~", False),
    ],
    "KV gather for chunked prefill": [("gather", "attention.py", True)],
    "KV cache writes": [("write_kv", "attention.py", True)],
    "norms, rotary, SiLU, residuals": [
        ("<built-in method torch.rms_norm>", "~", False),
        ("apply_rotary", "rotary.py", True),
        ("<built-in method torch._C._nn.silu>", "~", False),
        ("<built-in method torch._ops.tokenloom.rms_norm>", "~", False),
        ("<built-in method torch._ops.tokenloom.fused_add_rms_norm>", "~", False),
        ("<built-in method torch._ops.tokenloom.rotary_embedding_and_cache>", "~", False),  # and the cache write
        ("<built-in method torch._ops.tokenloom.silu_and_mul>", "~", False),
    ],
    "sampler": [("__call__", "sampler.py", True)],
    "runner input preparation": [("prepare_inputs", "runner.py", True)],
    "scheduler": [("schedule", "scheduler.py", True), ("update_from_output", "scheduler.py", True)],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None, help="int8: 8-bit weights (--quantization of serve)")
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    llm = LLM(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
    work = mixed_workload(64, 0, llm.engine.model_config.vocab_size)
    n = args.num_requests
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in work.max_tokens[:n]]
    prompts = [{"prompt_token_ids": p} for p in work.prompts[:n]]
    llm.generate([{"prompt_token_ids": [7] * 40}], SamplingParams(max_tokens=4), use_tqdm=False)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.runcall(llm.generate, prompts, params, use_tqdm=False)
    total = time.perf_counter() - start
    stats = pstats.Stats(profiler).stats
    rows = []
    for part, functions in PARTS.items():
        seconds = 0.0
        for name, file_fragment, cumulative in functions:
            for (file, _, func), (_, _, tottime, cumtime, _) in stats.items():
                if func == name and file_fragment in file:
                    seconds += cumtime if cumulative else tottime
        rows.append((part, seconds))
    rows.append(("Python and the rest", total - sum(s for _, s in rows)))
    steps = llm.stats().num_steps
    print(
        f"{n} requests, max_num_seqs={args.max_num_seqs}, budget {args.max_num_batched_tokens}, "
        f"{llm.engine.dtype}, quantization {args.quantization}, KV {args.kv_cache_dtype}: {total:.1f} s under cProfile,"
        f" {steps} steps, load average {os.getloadavg()[0]:.2f}"
    )
    print(f"| {'part of the step':<32} | {'seconds':>8} | {'share':>6} |")
    print(f"|{'-' * 34}|{'-' * 9}:|{'-' * 7}:|")
    for part, seconds in rows:
        print(f"| {part:<32} | {seconds:>8.1f} | {seconds / total:>6.0%} |")


if __name__ == "__main__":
    main()
