"""What the host spends per decode step, with the model's forward replaced by a stub.

    .venv/bin/python benchmarks/host_overhead.py [--running 64,256,1024] [--steps 30] [--prompt-len 32]
                                                [--final-only | --delta]
                                                [--attention-backend torch] [--async-output-proc] [--penalties]
                                                [--async-scheduling] [--core-loop] [--no-freeze]

On a GPU a small model's forward takes 1-3 ms a step; whatever the host spends around it (scheduling, building the
step's inputs, sampling, turning tokens into text and outputs) is time the device may sit idle. This runs the real
engine (scheduler, KV cache manager, runner's input preparation, sampler, output processor, detokenizer with the
SmolLM2 tokenizer) on a tiny random model whose forward is a stub returning zeros, with every request decoding,
and prints microseconds per step in all and by phase. The logits the sampler reads are a real [rows, 49152]
float32 tensor (greedy argmax over it on this CPU is part of "sample": on a GPU it runs on the device).

`--prompt-len` sets each request's context (a decode step's host work grows with it where the host copies what a
request holds; 32 by default, as the first figures), `--final-only` asks for outputs as `LLM.generate` does (none
between steps), `--delta` as the server does (each step's tokens and text; the default is CUMULATIVE, all so far),
`--attention-backend triton` builds the inputs a GPU step gets (set TRITON_INTERPRET=1 on a CPU),
`--penalties` gives every request presence, frequency and repetition penalties (whose counts the sampler reads),
`--async-output-proc` reads each step's tokens after the next one is launched, and `--async-scheduling` schedules
each step before the one before is read. "device idle" is the host time from reading a step's tokens to the next
step's inputs being ready (DeviceIdle): what a device whose step takes long would wait between two steps.
`--core-loop` times what the engine core's own process (`--core-process`, engine/core_process.py) does a step:
the core's step and its pickled report; what the API process does with that report (unpickling it, the output
processor) is timed apart as "API process, beside", since it runs there while the core goes on.

The timed steps run with the start-up heap frozen, as `tokenloom serve` and the engine core process run theirs
(utils.heap_frozen); `--no-freeze` runs them without, to show what a full collection costs. The line of each
size also counts the collections of Python's oldest generation during the timed steps and their longest pause.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import gzip
import os
import pickle
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from tokenloom import SamplingParams
from tokenloom.bench.provenance import git_commit, machine_info
from tokenloom.config import EngineConfig
from tokenloom.engine import core_process
from tokenloom.engine.core_messages import CoreReport
from tokenloom.engine.core_outputs import EngineCoreOutput
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.utils import cdiv, heap_frozen

VOCAB = 49152
BESIDE = "API process, beside"  # --core-loop: the API process's work a step, which does not hold up the core's loop


def tiny_model_with_the_real_tokenizer(directory: Path) -> Path:
    """The tokenizer is SmolLM2-135M-Instruct's as the engine converts it from the embedded GGUF, kept in
    benchmarks/data: a GPU machine runs this without the embedded model (its GGUF is too large to carry there)."""
    import transformers
    from transformers import AutoModelForCausalLM

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=2,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    data = Path(__file__).parent / "data"
    with gzip.open(data / "smollm2-tokenizer.json.gz") as packed, open(directory / "tokenizer.json", "wb") as out:
        shutil.copyfileobj(packed, out)
    shutil.copy(data / "smollm2-tokenizer_config.json", directory / "tokenizer_config.json")
    return directory


class FullCollections:
    """The pauses of Python's collections of its oldest generation (2) inside the block."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._started = 0.0

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self._observe)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._observe)

    def _observe(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._started)


class Phases:
    """Wall time per phase, summed over the timed steps."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.timing = False

    def wrap(self, owner: object, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.timing:
                    self.seconds[phase] += time.perf_counter() - started

        setattr(owner, name, timed)


class DeviceIdle:
    """Host time from reading a step's tokens to the next step's inputs being ready (none where the next step was
    launched before this one was read): with a forward that took long, what the device would wait between the two.
    Without overlap all of a step's host work is in it; with asynchronous output processing the outputs' part runs
    while a step is on the device; with asynchronous scheduling everything does."""

    def __init__(self, engine: LLMEngine) -> None:
        self.timing = False
        self._launches = 0  # steps whose inputs were prepared so far
        self._prepared: dict[int, float] = {}  # launch number -> when its inputs were ready (timed steps only)
        self._read: dict[int, float] = {}  # launch number -> when its tokens were read (timed steps only)
        runner = engine.core.runner
        prepare = runner.prepare_inputs

        def prepared(*args, **kwargs):
            inputs = prepare(*args, **kwargs)
            self._launches += 1
            if self.timing:
                self._prepared[self._launches] = time.perf_counter()
            return inputs

        runner.prepare_inputs = prepared
        from tokenloom.model import runner as runner_module

        # A checkout from before launched steps reads its tokens at the end of execute, right after preparing them.
        if hasattr(runner_module, "LaunchedStep"):
            owner, name = runner_module.LaunchedStep, "wait"
        else:
            owner, name = runner, "execute"
        read = getattr(owner, name)
        launch_of: dict[int, int] = {}  # id of a launched step -> its launch number

        def reading(*args, **kwargs):
            result = read(*args, **kwargs)
            if self.timing:
                self._read[launch_of.get(id(args[0]), self._launches)] = time.perf_counter()
            return result

        setattr(owner, name, reading)
        if hasattr(runner, "launch"):
            launch = runner.launch

            def launching(*args, **kwargs):
                step = launch(*args, **kwargs)
                launch_of[id(step)] = self._launches
                return step

            runner.launch = launching
        self._restore = (owner, name, read)

    @property
    def seconds(self) -> float:
        return sum(max(0.0, self._prepared[n + 1] - at) for n, at in self._read.items() if n + 1 in self._prepared)

    def close(self) -> None:
        setattr(*self._restore)


def _output_kind(name: str) -> object:
    from tokenloom import RequestOutputKind

    return RequestOutputKind[name]


def core_step_and_report(engine: LLMEngine) -> list[EngineCoreOutput]:
    """A turn of the core process's loop: the core's step, and its report pickled as `send` pickles it; then what
    the API process does with that report (timed apart: it runs there, beside the core's next turn)."""
    outputs = engine.core.step().outputs
    if hasattr(core_process, "core_report"):
        payload = pickled(core_process.core_report(engine.core, outputs, set()))
    else:  # a checkout from before core_report
        payload = pickled(CoreReport(outputs, engine.core.stats(), engine.core.queue_state(False)))
    api_side(engine, payload)
    return outputs


def api_side(engine: LLMEngine, payload: bytes) -> None:
    """The report unpickled and its outputs turned into RequestOutputs, as CoreProcessEngine.step does."""
    for output in pickle.loads(payload).outputs:
        engine.processor.process(output, engine)


def pickled(report: object) -> bytes:
    return pickle.dumps(report, protocol=5)


def stub_forward(engine: LLMEngine) -> None:
    """The forward returns zeros of the hidden size; the LM head returns a fixed random logits tensor."""
    runner = engine.core.runner
    hidden_size = runner.model.config.hidden_size
    logits = torch.randn(4096, VOCAB)
    runner._forward = lambda inputs: torch.zeros(inputs.input_ids.shape[0], hidden_size)
    runner.model.compute_logits = lambda hidden: logits[: hidden.shape[0]]


def measure(
    model: Path,
    running: int,
    steps: int,
    freeze: bool = True,
    prompt_len: int = 32,
    final_only: bool = False,
    delta: bool = False,
    attention_backend: str = "torch",
    async_output_proc: bool = False,
    async_scheduling: bool = False,
    profile_to: Path | None = None,
    core_loop: bool = False,
    penalties: bool = False,
) -> dict[str, float]:
    budget = max(2048, running * 40)
    # Requests that start first decode while the last prompts prefill: none may finish before the timed steps end.
    max_tokens = steps + 8 + cdiv(running * prompt_len, budget)
    # Asked only where wanted, as above.
    overlap = {"async_output_proc": True} if async_output_proc else {}
    overlap.update({"async_scheduling": True} if async_scheduling else {})
    config = EngineConfig.from_kwargs(
        **overlap,
        model=str(model), dtype="float32", max_num_seqs=running, max_num_batched_tokens=budget,
        num_kv_blocks=running * (cdiv(prompt_len + max_tokens, 16) + 1), block_size=16,
        attention_backend=attention_backend,
    )  # fmt: skip
    engine = LLMEngine(config)
    stub_forward(engine)
    phases = Phases()
    core, runner = engine.core, engine.core.runner
    phases.wrap(core.scheduler, "schedule", "schedule")
    phases.wrap(runner, "prepare_inputs", "prepare inputs")
    phases.wrap(runner, "_forward", "forward (stub)")
    # The sampler's entry point (a checkout from before launched steps called the sampler itself).
    phases.wrap(*((runner.sampler, "sample") if hasattr(runner.sampler, "sample") else (runner, "sampler")), "sample")
    phases.wrap(core.scheduler, "update_from_output", "update scheduler")
    for name in ("advance_provisionally", "settle"):  # what updates the scheduler when it schedules ahead
        if hasattr(core.scheduler, name):
            phases.wrap(core.scheduler, name, "update scheduler")
    phases.wrap(runner, "_sampling_batch", "sampling batch")
    if core_loop:
        if hasattr(core_process, "core_report"):  # a checkout from before it builds the report in place
            phases.wrap(core_process, "core_report", "report")
        phases.wrap(sys.modules[__name__], "pickled", "pickle")
        phases.wrap(sys.modules[__name__], "api_side", BESIDE)
    else:
        phases.wrap(engine.processor, "process", "outputs (detokenize, stops)")
    step = (lambda: core_step_and_report(engine)) if core_loop else engine.step
    idle = DeviceIdle(engine)
    # Only asked for where wanted, so that the script also measures a checkout from before output kinds.
    asked = "FINAL_ONLY" if final_only else "DELTA" if delta else None
    extra = {"output_kind": _output_kind(asked)} if asked else {}
    if penalties:  # as a chat client may send them: every request counts its tokens for its next one
        extra.update(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)
    for i in range(running):
        engine.add_request([(7 * i + j) % 1000 + 10 for j in range(prompt_len)], params, request_id=f"r{i}")
    while engine.core.stats().num_waiting or any(  # until every prompt is prefilled and every request decodes
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.core.scheduler.running
    ):
        engine.step()
    for _ in range(3):  # a few decode steps to warm up
        engine.step()
    with heap_frozen(collect_first=True) if freeze else contextlib.nullcontext(), FullCollections() as collections:
        profiler = cProfile.Profile() if profile_to else None
        phases.timing = idle.timing = True
        started = time.perf_counter()
        with profiler or contextlib.nullcontext():
            for _ in range(steps):
                outputs = step()
                assert len(outputs) == (0 if final_only and not core_loop else running), (len(outputs), running)
        total = time.perf_counter() - started
        phases.timing = idle.timing = False
    if profiler is not None:
        profiler.dump_stats(profile_to)
    idle.close()
    per_step = {phase: 1e6 * seconds / steps for phase, seconds in phases.seconds.items()}
    beside = per_step.pop(BESIDE, None)  # the API process's share runs beside the core's loop: not in its time
    per_step["all"] = 1e6 * total / steps - (beside or 0.0)
    per_step["other"] = per_step["all"] - sum(v for k, v in per_step.items() if k != "all")
    if beside is not None:
        per_step[BESIDE] = beside
    per_step["device idle"] = 1e6 * idle.seconds / steps
    per_step["full collections"] = len(collections.pauses)
    per_step["longest (ms)"] = 1e3 * max(collections.pauses, default=0.0)
    return per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", default="64,256,1024")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompt-len", type=int, default=32, help="each request's prompt: its context when timed")
    parser.add_argument("--attention-backend", default="torch", help="triton: the inputs a GPU step is given")
    parser.add_argument("--async-output-proc", action="store_true", help="read each step while the next one runs")
    parser.add_argument("--async-scheduling", action="store_true", help="schedule each step before the last is read")
    parser.add_argument("--final-only", action="store_true", help="outputs as LLM.generate takes them: the last")
    parser.add_argument("--delta", action="store_true", help="outputs as the server takes them: each step's tokens")
    parser.add_argument("--core-loop", action="store_true", help="only what the core process does a step")
    parser.add_argument("--penalties", action="store_true", help="presence, frequency and repetition penalties")
    parser.add_argument("--no-freeze", action="store_true", help="leave the start-up heap to the collector")
    parser.add_argument("--profile", type=Path, help="write cProfile's stats of the timed steps to PROFILE.<running>")
    args = parser.parse_args()
    print(f"commit {git_commit()}, {machine_info().get('cpu', '')}, load {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model_with_the_real_tokenizer(Path(tmp))
        for running in (int(n) for n in args.running.split(",")):
            freeze = not args.no_freeze
            figures = measure(
                model, running, args.steps, freeze, args.prompt_len, args.final_only, args.delta,
                args.attention_backend, args.async_output_proc, args.async_scheduling,
                args.profile.with_suffix(f".{running}") if args.profile else None, args.core_loop, args.penalties,
            )  # fmt: skip
            parts = ", ".join(f"{k} {v:,.0f}" for k, v in figures.items() if k != "all")
            print(f"{running:5d} running: {figures['all']:9,.0f} us/step ({figures['all'] / running:6.1f} per request)"
                  f"  [{parts}]")  # fmt: skip


if __name__ == "__main__":
    main()
