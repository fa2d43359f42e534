"""Helpers awake between jobs against helpers that sleep at once: mixed-64 served, quiet or beside a busy process.

    .venv/bin/python benchmarks/helper_spin.py [--rounds 2] [--busy]

One `tokenloom serve` at a time (default flags), alternating TOKENLOOM_HELPER_SPIN_US=0 (helpers sleep on their
futex right after each job) with the default (they stay awake up to 300 us while nobody waits for a CPU; see
src/tokenloom/model/csrc/work_sharing.h), each serving the mixed-64 workload of benchmarks/vs_vllm.py. With --busy a
Python loop runs beside them the whole time, as another tenant's process on a shared machine would: the spin must
stop there rather than take the cores from it (or from our own thread). Loopback only, bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

from vs_vllm import MODEL_NAME, Run, mixed_64

from tokenloom.bench.local_server import LocalServer
from tokenloom.bench.provenance import git_commit

BUSY_LOOP = "import time\nend = time.monotonic() + 3600\nwhile time.monotonic() < end:\n    pass\n"
SETTINGS = [("helpers sleep at once (TOKENLOOM_HELPER_SPIN_US=0)", "0"), ("helpers spin up to 300 us (default)", None)]


@contextlib.contextmanager
def busy_process(enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    process = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
    try:
        yield
    finally:
        process.kill()
        process.wait()


def one_run(label: str, spin_us: str | None) -> str:
    saved = os.environ.pop("TOKENLOOM_HELPER_SPIN_US", None)
    if spin_us is not None:
        os.environ["TOKENLOOM_HELPER_SPIN_US"] = spin_us
    try:
        with LocalServer("--served-model-name", MODEL_NAME, "--max-model-len", "8192") as server:
            run = Run(label)
            asyncio.run(mixed_64(server.url, run, 0))  # a fresh server each run: nothing cached
    finally:
        os.environ.pop("TOKENLOOM_HELPER_SPIN_US", None)
        if saved is not None:
            os.environ["TOKENLOOM_HELPER_SPIN_US"] = saved
    return run.row()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--busy", action="store_true", help="run a busy Python process beside the servers")
    args = parser.parse_args()
    print(f"commit {git_commit()}; busy process: {args.busy}; load average before: {os.getloadavg()[0]:.2f}")
    print("| helpers | out tok/s | TTFT p50 / p95 | ITL p50 / p95 | E2E p95 | (prefill) | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    with busy_process(args.busy):
        for _ in range(args.rounds):
            for label, spin_us in SETTINGS:
                print(one_run(label, spin_us), flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
