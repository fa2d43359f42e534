"""What structured output costs: one batch of chat requests with a JSON schema, then the same requests without it.

    .venv/bin/python benchmarks/structured_output.py [--num-requests 32] [--repeats 2]

The embedded SmolLM2-135M-Instruct (dtype auto) answers N chat requests at once, each asking for a person as JSON.
The constrained run decodes under a JSON schema (the grammar finishes each request); the free run then asks each
request for exactly as many tokens as its constrained answer had (``ignore_eos``), so both runs do the same
forward work and differ only by the grammar: compiling it, filling the bitmask of every structured row each step,
masking the logits and advancing the matchers. Runs alternate, ``--repeats`` times each; medians are reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

from offline_throughput import machine

from tokenloom import LLM, SamplingParams
from tokenloom.bench.provenance import git_commit
from tokenloom.sampling_params import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
TOPICS = ["a baker", "a pilot", "a chess player", "a gardener", "a violinist", "a nurse", "a sailor", "a teacher"]


def chat_prompts(llm: LLM, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        ask = f"Describe {TOPICS[i % len(TOPICS)]} (person {i}) as JSON with name, age, city and hobbies."
        prompts.append(llm.apply_chat_template([{"role": "user", "content": ask}]))
    return prompts


def timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list[int], int]:
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    valid = sum(o.outputs[0].finish_reason == "stop" and _is_json(o.outputs[0].text) for o in outputs)
    return seconds, lengths, valid


def _is_json(text: str) -> bool:
    import json

    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    load_before = os.getloadavg()
    llm = LLM(None, max_num_seqs=args.num_requests)
    prompts = chat_prompts(llm, args.num_requests)
    schema = StructuredOutputsParams(json=PERSON)
    constrained = [SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=schema)] * len(prompts)
    timed(llm, prompts[:2], constrained[:2])  # warm: the tokenizer's grammar tables, the first compile
    runs: dict[str, list[float]] = {"schema": [], "free": []}
    lengths: list[int] = []
    valid = 0
    for _ in range(args.repeats):
        seconds, lengths, valid = timed(llm, prompts, constrained)
        runs["schema"].append(seconds)
        free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        runs["free"].append(timed(llm, prompts, free)[0])
    load_after = os.getloadavg()
    tokens = sum(lengths)
    median = {name: statistics.median(times) for name, times in runs.items()}
    print(f"commit {git_commit()}; {machine()}; dtype {llm.engine.dtype}")
    print(f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print(f"{len(prompts)} requests, {tokens} output tokens; {valid}/{len(prompts)} schema answers valid JSON")
    print("| run | seconds (median) | output tok/s | runs |")
    print("|---|---:|---:|---|")
    for name, label in (("free", "no grammar, same lengths"), ("schema", "JSON schema (xgrammar bitmask)")):
        times = ", ".join(f"{t:.2f}" for t in runs[name])
        print(f"| {label} | {median[name]:.2f} | {tokens / median[name]:.0f} | {times} |")
    print(f"structured output costs {median['schema'] / median['free'] - 1:+.1%} of the batch's time")


if __name__ == "__main__":
    main()
