"""How close `tokenloom simulate` comes to the real server, on this machine (issue 27).

    .venv/bin/python benchmarks/simulate_fidelity.py [--profile PROFILE.json] [--out DIR] [--only chat,agent]

Profiles the engine first (`tokenloom simulate profile`) unless a profile is given. Then for each trace and rate
below: a fresh `tokenloom serve` (default flags, so no prefix cache carries over from the run before) is measured
with `tokenloom bench serve`, and the same trace, rate and seed are simulated from the profile, with the real run's
output lengths standing in for the model's own ends (`--output-lengths`). Prints each figure's simulated/real ratio,
the worst of the four the issue names (output tok/s, TTFT p50 and p95, E2E p95), and per request the median
relative error of its TTFT and E2E (robust where a percentile falls between two modes of the distribution). The
last column is the worst of the four when the same run is simulated from the engine's steps alone, without the
profile's served overhead (cost_model.ServedOverhead): what that correction changes. The one after it simulates the
run again from the profile scaled to the run's own speed (the served seconds of its logged steps over what the
profile says for them: `Profile.at_speed_of`), printed with that scale: what is left of the error when this VM's
speed during the run, rather than at the time of the profile, sets the step times. `--repeat` serves each run
twice and adds the worst of the four between the two real runs: how close the server comes to itself.

`--seeds 1,2,3` serves and simulates each trace kind and rate once per seed (the trace's requests and the arrivals
both drawn from it) and compares the runs pooled: every request of the seeds' runs in one set of percentiles, output
tok/s over their summed durations. One run's percentiles on this VM do not repeat within 10% (`--repeat`); pooled
over seeds, both sides' figures rest on three times the requests, and each seed's own worst of four is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tokenloom.bench.cost_model import Profile
from tokenloom.bench.local_server import LocalServer
from tokenloom.bench.scorecard import SLO, RequestRecord
from tokenloom.bench.scorecard import scorecard as scorecard_of
from tokenloom.engine.step_log import read_step_log

# (trace kind, requests, the two rates): below and near this machine's capacity for each.
LOADS = [("chat", 40, (1.0, 2.0)), ("agent", 30, (0.5, 1.0)), ("long", 12, (0.1, 0.2)), ("mixed", 40, (0.5, 1.0))]
FIGURES = ("output_tok_s", "ttft_p50_s", "ttft_p95_s", "e2e_p95_s", "itl_p50_s")
CLI = [sys.executable, "-m", "tokenloom.cli"]


def run(command: list[str]) -> None:
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default=None)
    parser.add_argument("--out", default="/tmp/simulate_fidelity")
    parser.add_argument("--only", default=None, help="comma-separated trace kinds")
    parser.add_argument("--seeds", default="1", help="comma-separated seeds; more than one pools their runs")
    parser.add_argument("--reuse", action="store_true", help="keep real runs already in --out; simulate again")
    parser.add_argument(
        "--repeat", action="store_true",
        help="serve each run a second time and print the worst of the four between the two real runs",
    )  # fmt: skip
    args = parser.parse_args()
    if args.repeat and "," in args.seeds:
        parser.error("--repeat compares one seed's run with itself: give one seed")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = args.profile or str(out / "profile.json")
    if args.profile is None:
        run([*CLI, "simulate", "profile", "-o", profile])
    if args.reuse and args.profile is not None:  # refit: the step model's features may have changed since
        profile = str(out / "profile-refit.json")
        run([*CLI, "simulate", "profile", "--from-steps", args.profile, "-o", profile])
    engine_alone = str(out / "profile-engine-alone.json")
    without_overhead(profile, engine_alone)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    if "," in args.seeds:
        print(f"pooled over seeds {args.seeds}")
        last = " worst of four, each seed | at each run's speed: worst of four |"
    else:
        last = " worst, engine alone | at the run's speed: worst of four |"
        last += " real again vs real |" if args.repeat else ""
    print("| trace | req/s | out tok/s real / sim | TTFT p50 | TTFT p95 | E2E p95 | ITL p50 | worst of four | "
          f"per request: TTFT, E2E |{last}")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * last.count("|"))
    seeds = [int(seed) for seed in args.seeds.split(",")]
    for kind, count, rates in LOADS:
        if args.only and kind not in args.only.split(","):
            continue
        for seed in seeds:
            trace = out / f"{kind}-s{seed}.jsonl"
            run([*CLI, "bench", "trace", "--kind", kind, "--num-requests", str(count), "--seed", str(seed),
                 "-o", str(trace)])  # fmt: skip
        for rate in rates:
            runs = [measure(out, kind, rate, seed, profile, engine_alone, args.reuse, args.repeat) for seed in seeds]
            if len(runs) == 1:
                one = runs[0]
                repeated = f" {worst_of_four(scorecard(one.real), scorecard(one.again))} |" if one.again else ""
                engine_alone_worst = worst_of_four(scorecard(one.real), scorecard(one.engine_alone))
                at_speed = f"{one.speed:.2f}x: {worst_of_four(scorecard(one.real), scorecard(one.at_run_speed))}"
                print(row(kind, rate, one.real, one.simulated) + f" {engine_alone_worst} | {at_speed} |{repeated}",
                      flush=True)  # fmt: skip
                continue
            real, simulated, at_speeds = (
                pooled({seed: getattr(one, path) for seed, one in zip(seeds, runs, strict=True)}, rate)
                for path in ("real", "simulated", "at_run_speed")
            )
            each = ", ".join(worst_of_four(scorecard(one.real), scorecard(one.simulated)) for one in runs)
            speeds = ", ".join(f"{one.speed:.2f}x" for one in runs)
            at_speed_worst = worst_of_four(real["scorecard"], at_speeds["scorecard"])
            print(row_of(kind, rate, real, simulated) + f" {each} | {speeds}: {at_speed_worst} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


@dataclass
class Measured:
    """One trace, rate and seed: the real run, its simulations, and (with --repeat) a second real run."""

    real: Path
    simulated: Path
    engine_alone: Path  # simulated from the engine's steps alone, without the served overhead
    at_run_speed: Path  # simulated from the profile scaled to the speed the real run's own steps show
    speed: float  # that scale: the run's served step seconds over the profile's served model of the same steps
    again: Path | None


def measure(
    out: Path, kind: str, rate: float, seed: int, profile: str, engine_alone: str, reuse: bool, repeat: bool
) -> Measured:
    """Serves one trace at one rate and seed (unless reused) and simulates it three ways: from the profile, from
    the engine's steps alone, and from the profile at the real run's own speed (what is left of the error when
    this VM's speed at the time of the run, not the profile's, sets the step times)."""
    name = f"{kind}-{rate:g}-s{seed}"
    trace, real = out / f"{kind}-s{seed}.jsonl", out / f"{name}-real.json"
    if not (reuse and real.exists()):
        serve(trace, rate, seed, real)
    scaled, speed = Profile.read(profile).at_speed_of(read_step_log(steps_log_of(real)))
    scaled.write(out / f"{name}-profile-at-run-speed.json")
    runs = Measured(real, out / f"{name}-sim.json", out / f"{name}-sim-engine-alone.json",
                    out / f"{name}-sim-at-run-speed.json", speed, None)  # fmt: skip
    used_by = {
        runs.simulated: profile,
        runs.engine_alone: engine_alone,
        runs.at_run_speed: str(out / f"{name}-profile-at-run-speed.json"),
    }
    for written, used in used_by.items():
        run([*CLI, "simulate", "--trace", str(trace), "--request-rate", str(rate), "--seed", str(seed),
             "--profile", used, "--output-lengths", str(real), "-o", str(written)])  # fmt: skip
    if repeat:  # the same trace, rate and seed served again: how far the server is from itself
        runs.again = out / f"{name}-real-again.json"
        serve(trace, rate, seed, runs.again)
    return runs


def pooled(paths: dict[int, Path], rate: float) -> dict:
    """Several seeds' runs as one: their requests' percentiles together (ids prefixed with the seed), output tok/s
    over the sum of their durations (each run's duration is its output tokens over its output tok/s)."""
    records: list[RequestRecord] = []
    duration = 0.0
    for seed, path in paths.items():
        run_ = json.loads(path.read_text())
        run_records = [RequestRecord(**r) for r in run_["records"]]
        tokens = sum(r.output_tokens for r in run_records if r.ok)
        assert tokens and run_["scorecard"]["output_tok_s"], f"{path} produced no tokens"
        duration += tokens / run_["scorecard"]["output_tok_s"]
        records += [replace(r, id=f"{seed}:{r.id}") for r in run_records]
    return {"scorecard": scorecard_of(records, duration, rate, SLO()), "records": [vars(r) for r in records]}


def steps_log_of(real: Path) -> Path:
    return real.with_name(real.name.replace(".json", "-steps.jsonl"))


def serve(trace: Path, rate: float, seed: int, out: Path) -> Path:
    """Default flags, each step logged beside the run (served_steps.py --steps-log reads it against a profile);
    returns the step log's path."""
    log = steps_log_of(out)
    with LocalServer("--step-log", str(log)) as server:
        run([*CLI, "bench", "serve", "--base-url", server.url, "--trace", str(trace), "--request-rate", str(rate),
             "--seed", str(seed), "-o", str(out)])  # fmt: skip
    return log


def per_request_error(real: list[dict], simulated: list[dict], figure: str) -> str:
    """The median over requests of |simulated / real - 1| for one request's figure (TTFT or E2E)."""
    by_id = {r["id"]: r for r in simulated}
    errors = sorted(abs(by_id[r["id"]][figure] / r[figure] - 1) for r in real if r[figure] and by_id[r["id"]][figure])
    return f"{errors[len(errors) // 2]:.0%}" if errors else "-"


def without_overhead(profile: str, written: str) -> None:
    """The profile with its served overhead taken out: the engine's steps alone (the front's latency, measured
    from the server's own prefill times, stays)."""
    data = json.loads(Path(profile).read_text())
    data["served_overhead"] = {}
    Path(written).write_text(json.dumps(data))


def scorecard(path: Path) -> dict:
    return json.loads(path.read_text())["scorecard"]


def worst_of_four(real: dict, simulated: dict) -> str:
    """The largest relative error of output tok/s, TTFT p50 and p95, E2E p95 between two scorecards."""
    errors = [abs(simulated[f] / real[f] - 1) for f in FIGURES if f != "itl_p50_s" and real[f] and simulated[f]]
    return f"{max(errors):.0%}" if errors else "-"


def row(kind: str, rate: float, real_path: Path, simulated_path: Path) -> str:
    return row_of(kind, rate, json.loads(real_path.read_text()), json.loads(simulated_path.read_text()))


def row_of(kind: str, rate: float, real_run: dict, simulated_run: dict) -> str:
    real, simulated = real_run["scorecard"], simulated_run["scorecard"]
    cells = []
    for name in FIGURES:
        a, b = real[name], simulated[name]
        unit = "" if name == "output_tok_s" else " s"
        cells.append(f"{a:.3g} / {b:.3g}{unit} ({b / a:.2f}x)" if a and b else f"{a} / {b}")
    worst = worst_of_four(real, simulated)
    each = ", ".join(per_request_error(real_run["records"], simulated_run["records"], f) for f in ("ttft", "e2e"))
    return f"| {kind} | {rate:g} | " + " | ".join(cells) + f" | {worst} | {each} |"


if __name__ == "__main__":
    main()
