"""A served trace's engine steps against a profile's step model (issue 27): where the simulation's time goes wrong.

    .venv/bin/python benchmarks/served_steps.py --profile PROFILE.json [--kind long] [--num-requests 12]
        [--request-rate 0.1] [--out DIR] [--steps-log DIR/long-0.1-steps.jsonl]

Serves a bench trace with `tokenloom serve` (default flags) under `tokenloom bench serve`, as simulate_fidelity.py
does, but with every `LLMEngine.step()` of the server logged: its scheduled requests and its wall time (this script
runs the server itself, with `--traced-server`, wrapping the step before the command line starts). Then each served
step's time is set against what the profile's step model says for the same step shape, by kind of step (lone
prefill chunks, mixed, decode-only by rows and context), and the spread of steps of the same shape in the run is
printed beside it: a simulation cannot be closer to the server than the server is to itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tokenloom.bench.cost_model import Profile, StepShape, items_of
from tokenloom.bench.local_server import LocalServer

CLI = [sys.executable, "-m", "tokenloom.cli"]


def traced_server(log: Path, cli_args: list[str]) -> None:
    """This process becomes the command line (`serve ...`), each engine step written to `log` as a JSON line."""
    from tokenloom.cli import main
    from tokenloom.engine.llm_engine import LLMEngine

    out = log.open("w", buffering=1)  # a line a step, written as it ends: the server exits through uvicorn
    init, step = LLMEngine.__init__, LLMEngine.step
    seen: dict[str, Any] = {}

    def observed(self: LLMEngine, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.observe_steps(lambda output: seen.__setitem__("output", output))

    def traced(self: LLMEngine) -> list:
        seen.clear()
        started = time.perf_counter()
        outputs = step(self)
        if "output" in seen:
            record = {"items": items_of(seen["output"]), "seconds": time.perf_counter() - started}
            out.write(json.dumps(record) + "\n")
        return outputs

    LLMEngine.__init__, LLMEngine.step = observed, traced  # type: ignore[method-assign]
    sys.argv = ["tokenloom", *cli_args]
    main()


def kind_of(shape: StepShape) -> str:
    if shape.prefill_sequences == shape.sequences:
        return "prefill chunks alone"
    if shape.prefill_sequences:
        return "prefill chunks with decodes"
    context = shape.decode_keys // shape.sequences
    rows = "1 row" if shape.sequences == 1 else f"{shape.sequences} rows" if shape.sequences < 4 else "4+ rows"
    return f"decode, {rows}, context {'< 2k' if context < 2048 else '>= 2k'}"


def compare(profile: Profile, steps: list[dict[str, Any]]) -> None:
    by_kind: dict[str, list[tuple[float, float]]] = defaultdict(list)
    by_shape: dict[tuple, list[float]] = defaultdict(list)
    for step in steps:
        items = [tuple(i) for i in step["items"]]
        shape = StepShape.of_items(items)
        by_kind[kind_of(shape)].append((step["seconds"], profile.step_model.seconds(shape)))
        # The same shape, to a block of context: what the server itself varies by
        by_shape[tuple((start // 256, n, prefill) for start, n, _, prefill in items)].append(step["seconds"])
    print("| steps | count | served s | model s | model / served | median step: served / model ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, pairs in sorted(by_kind.items()):
        served, model = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
        medians = (
            f"{1e3 * statistics.median(p[0] for p in pairs):.1f} / {1e3 * statistics.median(p[1] for p in pairs):.1f}"
        )
        print(f"| {kind} | {len(pairs)} | {served:.2f} | {model:.2f} | {model / served:.2f} | {medians} |")
    served, model = (sum(p[i] for pairs in by_kind.values() for p in pairs) for i in (0, 1))
    print(f"| all | {len(steps)} | {served:.2f} | {model:.2f} | {model / served:.2f} | |")
    repeated = [sorted(times) for times in by_shape.values() if len(times) >= 10]
    spreads = sorted(t[len(t) * 9 // 10] / t[len(t) // 10] for t in repeated)
    if spreads:
        print(
            f"\nsteps of one shape (context to 256 tokens), {len(repeated)} shapes seen 10+ times: 90th / 10th "
            f"percentile of their times, median {statistics.median(spreads):.2f}x, widest {spreads[-1]:.2f}x"
        )


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--traced-server":
        traced_server(Path(sys.argv[2]), sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", required=True)
    parser.add_argument("--kind", default="long")
    parser.add_argument("--num-requests", type=int, default=12)
    parser.add_argument("--request-rate", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=Path("/tmp/served_steps"))
    parser.add_argument("--steps-log", type=Path, default=None, help="compare a served run's logged steps again")
    args = parser.parse_args()
    if args.steps_log is not None:
        compare(Profile.read(args.profile), [json.loads(line) for line in args.steps_log.read_text().splitlines()])
        return
    args.out.mkdir(parents=True, exist_ok=True)
    trace, log = args.out / f"{args.kind}.jsonl", args.out / f"{args.kind}-{args.request_rate:g}-steps.jsonl"
    subprocess.run([*CLI, "bench", "trace", "--kind", args.kind, "--num-requests", str(args.num_requests), "--seed",
                    "1", "-o", str(trace)], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    with LocalServer(launcher=[sys.executable, __file__, "--traced-server", str(log)]) as server:
        print(f"load average before: {os.getloadavg()[0]:.2f}")
        subprocess.run([*CLI, "bench", "serve", "--base-url", server.url, "--trace", str(trace), "--request-rate",
                        str(args.request_rate), "-o", str(args.out / "real.json")], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    print(f"{args.kind} trace, {args.num_requests} requests at {args.request_rate:g} req/s; profile {args.profile}")
    compare(Profile.read(args.profile), steps)


if __name__ == "__main__":
    main()
