"""A served trace's engine steps against a profile's step model (issue 27): where the simulation's time goes wrong.

    .venv/bin/python benchmarks/served_steps.py --profile PROFILE.json [--kind long] [--num-requests 12]
        [--request-rate 0.1] [--out DIR] [--steps-log DIR/long-0.1-real-steps.jsonl]

Serves a bench trace with `tokenloom serve --step-log` (default flags otherwise) under `tokenloom bench serve`, with
simulate_fidelity.py's `serve`, every turn of the server's engine loop logged: the step's scheduled requests and the
turn's wall time (the step, and the admissions and deliveries around it). Then each served step's time is set
against what the profile's step model says for the same step shape, by kind of step (lone prefill chunks, mixed,
decode-only by rows and context), and the spread of steps of the same shape in the run is printed beside it: a
simulation cannot be closer to the server than the server is to itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from simulate_fidelity import CLI, run, serve

from tokenloom.bench.cost_model import Profile, StepShape
from tokenloom.engine.step_log import read_step_log


def kind_of(shape: StepShape) -> str:
    if shape.prefill_sequences == shape.sequences:
        return "prefill chunks alone"
    if shape.prefill_sequences:
        return "prefill chunks with decodes"
    context = shape.decode_keys // shape.sequences
    rows = "1 row" if shape.sequences == 1 else f"{shape.sequences} rows" if shape.sequences < 4 else "4+ rows"
    return f"decode, {rows}, context {'< 2k' if context < 2048 else '>= 2k'}"


def compare(profile: Profile, steps: list[dict[str, Any]]) -> None:
    """By kind of step: the served seconds, the engine-alone model's, and the model with the profile's served
    overhead (the simulator's)."""
    served_model = profile.served_step_model()
    by_kind: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    by_shape: dict[tuple, list[float]] = defaultdict(list)
    for step in steps:
        items = [tuple(i) for i in step["items"]]
        shape = StepShape.of_items(items)
        modelled = (profile.step_model.seconds(shape), served_model.seconds(shape))
        by_kind[kind_of(shape)].append((step["seconds"], *modelled))
        # The same shape, to a block of context: what the server itself varies by
        by_shape[tuple((start // 256, n, prefill) for start, n, _, prefill in items)].append(step["seconds"])
    print(
        "| steps | count | served s | engine model / served | served model / served | median step: served / "
        "engine / served model ms |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    rows = [*sorted(by_kind.items()), ("all", [p for pairs in by_kind.values() for p in pairs])]
    for kind, times in rows:
        served, engine, modelled = (sum(t[i] for t in times) for i in range(3))
        medians = " / ".join(f"{1e3 * statistics.median(t[i] for t in times):.1f}" for i in range(3))
        print(f"| {kind} | {len(times)} | {served:.2f} | {engine / served:.2f} | {modelled / served:.2f} | {medians} |")
    repeated = [sorted(times) for times in by_shape.values() if len(times) >= 10]
    spreads = sorted(t[len(t) * 9 // 10] / t[len(t) // 10] for t in repeated)
    if spreads:
        print(
            f"\nsteps of one shape (context to 256 tokens), {len(repeated)} shapes seen 10+ times: 90th / 10th "
            f"percentile of their times, median {statistics.median(spreads):.2f}x, widest {spreads[-1]:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", required=True)
    parser.add_argument("--kind", default="long")
    parser.add_argument("--num-requests", type=int, default=12)
    parser.add_argument("--request-rate", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=1, help="of the trace's requests and its arrivals")
    parser.add_argument("--out", type=Path, default=Path("/tmp/served_steps"))
    parser.add_argument("--steps-log", type=Path, default=None, help="compare a served run's logged steps again")
    args = parser.parse_args()
    if args.steps_log is not None:
        compare(Profile.read(args.profile), read_step_log(args.steps_log))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    trace = args.out / f"{args.kind}.jsonl"
    run([*CLI, "bench", "trace", "--kind", args.kind, "--num-requests", str(args.num_requests),
         "--seed", str(args.seed), "-o", str(trace)])  # fmt: skip
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    real = args.out / f"{args.kind}-{args.request_rate:g}-real.json"
    steps = read_step_log(serve(trace, args.request_rate, args.seed, real))
    print(f"{args.kind} trace, {args.num_requests} requests at {args.request_rate:g} req/s; profile {args.profile}")
    compare(Profile.read(args.profile), steps)


if __name__ == "__main__":
    main()
