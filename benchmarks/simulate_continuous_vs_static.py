"""The seeds' claim per accelerator: continuous against static batching, throughput on the mixed trace (issue 27).

    .venv/bin/python benchmarks/simulate_continuous_vs_static.py --profile PROFILE.json [--measure-cpu]

One mixed trace (64 requests, all at once, max_num_seqs 16: more requests than seats, as in issue 2's offline
comparison), simulated with `--batching continuous` and `--batching static` on each datasheet GPU for a Llama-3-8B
shape (what the seeds' users serve; random weights are never needed, only the shapes), and on this CPU from its
profile for SmolLM2-135M, the model it was profiled with. With --measure-cpu the same two runs are also served for
real here (`tokenloom serve --batching ...` and `bench serve`), beside the CPU's simulated ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tokenloom.bench.cost_model import DATASHEETS
from tokenloom.bench.local_server import LocalServer

LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}  # fmt: skip
FLAGS = ["--max-num-seqs", "16"]
CLI = [sys.executable, "-m", "tokenloom.cli"]


def output_tok_s(path: Path) -> float:
    return float(json.loads(path.read_text())["scorecard"]["output_tok_s"])


def simulated(trace: Path, out: Path, batching: str, where: list[str]) -> float:
    command = [*CLI, "simulate", "--trace", str(trace), "--request-rate", "inf", *FLAGS, "--batching", batching]
    subprocess.run([*command, *where, "-o", str(out)], check=True, stdout=subprocess.DEVNULL)
    return output_tok_s(out)


def measured(trace: Path, out: Path, batching: str) -> float:
    with LocalServer(*FLAGS, "--batching", batching) as server:
        subprocess.run([*CLI, "bench", "serve", "--base-url", server.url, "--trace", str(trace), "--request-rate",
                        "inf", "-o", str(out)], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    return output_tok_s(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", required=True, help="this machine's `tokenloom simulate profile`")
    parser.add_argument("--out", default="/tmp/continuous_vs_static")
    parser.add_argument("--measure-cpu", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "mixed.jsonl"
    subprocess.run([*CLI, "bench", "trace", "--kind", "mixed", "--num-requests", "64", "--seed", "0", "-o",
                    str(trace)], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    shapes = out / "llama-3-8b" / "config.json"
    shapes.parent.mkdir(exist_ok=True)
    shapes.write_text(json.dumps(LLAMA_3_8B))
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print("| where | model | continuous out tok/s | static out tok/s | continuous / static |")
    print("|---|---|---:|---:|---:|")
    for name in DATASHEETS:
        where = ["--accelerator", name, "--model", str(shapes)]
        cont, stat = (simulated(trace, out / f"{name}-{b}.json", b, where) for b in ("continuous", "static"))
        print(f"| {name} (simulated, datasheet) | Llama-3-8B shape | {cont:.0f} | {stat:.0f} | {cont / stat:.2f}x |")
    where = ["--profile", args.profile]
    if args.measure_cpu:  # first, so the simulation can take the model's own output lengths from it
        cont, stat = (measured(trace, out / f"cpu-real-{b}.json", b) for b in ("continuous", "static"))
        print(f"| this CPU (measured) | SmolLM2-135M | {cont:.1f} | {stat:.1f} | {cont / stat:.2f}x |", flush=True)
        where += ["--output-lengths", str(out / "cpu-real-continuous.json")]
    cont, stat = (simulated(trace, out / f"cpu-{b}.json", b, where) for b in ("continuous", "static"))
    print(f"| this CPU (simulated, profile) | SmolLM2-135M | {cont:.1f} | {stat:.1f} | {cont / stat:.2f}x |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
