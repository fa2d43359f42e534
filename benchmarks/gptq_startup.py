"""Start-up time with int8 weights: GPTQ at load, then a second start from its cached codes (issue 24).

    .venv/bin/python benchmarks/gptq_startup.py [--quantization int8]

The embedded SmolLM2-135M, each start in a fresh process: the default dtype unquantized, then int8 weights with an
empty GPTQ cache (a temporary directory), then again with the codes that start left there.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

START = "from tokenloom import LLM; LLM(quantization={q!r}, max_num_seqs=8, kv_cache_memory=2**28)"


def start_seconds(quantization: str | None, cache: str) -> float:
    env = {**os.environ, "TOKENLOOM_GPTQ_CACHE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    # Only the GPTQ cache moves to the temporary directory: the compiled operators stay in $TOKENLOOM_CACHE.
    code = f"import tokenloom.model.gptq_cache as c, pathlib; c.cache_dir = lambda: pathlib.Path({cache!r}); "
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code + START.format(q=quantization)], env=env, check=True,
                   capture_output=True, timeout=1200)  # fmt: skip
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quantization", default="int8")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as cache:
        plain = start_seconds(None, cache)
        cold = start_seconds(args.quantization, cache)
        warm = start_seconds(args.quantization, cache)
    print("| start (a fresh process each) | seconds |\n|---|---:|")
    print(f"| default dtype, unquantized | {plain:.1f} |")
    print(f"| --quantization {args.quantization}, GPTQ at load | {cold:.1f} |")
    print(f"| --quantization {args.quantization}, codes from the cache | {warm:.1f} |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
