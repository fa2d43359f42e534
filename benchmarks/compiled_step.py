"""The compiled step against the eager one: forward time at a decode step and a prefill step, and start-up cost.

    .venv/bin/python benchmarks/compiled_step.py [--dtype auto] [--repeats 12]

One engine with the compiled step (``enforce_eager=False``) takes the mixed-64 requests until a decode step of 64
sequences (each ~285 prompt tokens in) and a full 2,048-token prefill step have been seen; then the same two
steps' inputs run through the compiled and the eager forward alternately, so both see the same machine state.
Start-up: the compile warm-up in a fresh process with an empty inductor cache (cold), then again (warm).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

import torch
from offline_throughput import mixed_workload

from tokenloom import SamplingParams
from tokenloom.config import EngineConfig
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.model.gguf_convert import cache_root
from tokenloom.model.runner import ModelRunner


def capture_steps(engine: LLMEngine) -> dict[str, list]:
    """Runs mixed-64 until one full decode step and one full prefill step have been scheduled; returns both."""
    work = mixed_workload(64, 0, engine.model_config.vocab_size)
    for prompt, max_tokens in zip(work.prompts, work.max_tokens, strict=True):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    captured: dict[str, list] = {}
    execute = ModelRunner.execute

    def capturing(runner: ModelRunner, scheduled):
        if sum(s.num_tokens for s in scheduled) >= engine.config.scheduler.max_num_batched_tokens - 64:
            captured.setdefault("prefill", scheduled)
        elif len(scheduled) == 64 and all(s.num_tokens == 1 for s in scheduled):
            captured.setdefault("decode", scheduled)
        return execute(runner, scheduled)

    ModelRunner.execute = capturing
    try:
        while len(captured) < 2:
            engine.step()
    finally:
        ModelRunner.execute = execute
    return captured


def time_forwards(engine: LLMEngine, steps: dict[str, list], repeats: int) -> dict[str, dict[str, float]]:
    runner = engine.core.runner
    compiled = runner.compiled
    times: dict[str, dict[str, list[float]]] = {"eager": {}, "compiled": {}}
    with torch.inference_mode():
        for _ in range(repeats):
            for name, forward in (("eager", None), ("compiled", compiled)):
                runner.compiled = forward
                for kind, scheduled in steps.items():
                    inputs = runner.prepare_inputs(scheduled)
                    started = time.perf_counter()
                    runner._forward(inputs)
                    times[name].setdefault(kind, []).append(time.perf_counter() - started)
    runner.compiled = compiled
    return {name: {kind: statistics.median(v) for kind, v in kinds.items()} for name, kinds in times.items()}


def start_up_seconds(dtype: str, cache: Path) -> float:
    """Seconds to build an engine with the compiled step (warm-up included) in a fresh process.

    `cache` is a tokenloom cache whose converted weights and built operators are the real cache's (links), and
    whose compile artifacts are its own.
    """
    for part in ("gguf", "kernels"):
        if not (cache / part).exists():
            (cache / part).symlink_to(cache_root() / part)
    code = (
        "import time; from tokenloom.config import EngineConfig; from tokenloom.engine.llm_engine import LLMEngine;"
        f"t = time.monotonic(); LLMEngine(EngineConfig.from_kwargs(dtype={dtype!r}, enforce_eager=False));"
        "print(time.monotonic() - t)"
    )
    env = dict(os.environ, TOKENLOOM_CACHE=str(cache))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    engine = LLMEngine(EngineConfig.from_kwargs(dtype=args.dtype, enforce_eager=False))
    medians = time_forwards(engine, capture_steps(engine), args.repeats)
    print("| step | eager forward ms | compiled forward ms | compiled / eager |")
    print("|---|---:|---:|---:|")
    for kind in ("decode", "prefill"):
        eager, compiled = medians["eager"][kind] * 1e3, medians["compiled"][kind] * 1e3
        label = "decode, 64 sequences" if kind == "decode" else "prefill, 2,048 tokens"
        print(f"| {label} | {eager:.1f} | {compiled:.1f} | {compiled / eager:.2f} |")
    del engine
    with tempfile.TemporaryDirectory() as cache:
        cold = start_up_seconds(args.dtype, Path(cache))
        warm = start_up_seconds(args.dtype, Path(cache))
    print(f"engine start, compiled step (weights converted, operators built): cold {cold:.1f} s, warm {warm:.1f} s")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
