"""What turning a step's tokens into outputs costs the host, by how long the replies already are (issue 23, item 5).

    .venv/bin/python benchmarks/output_processing.py [--requests 256] [--lengths 0,1000,4000,16000] [--stop]

The output side of the engine (engine/output_processor.py: the detokenizer with SmolLM2's tokenizer, stop strings,
the RequestOutputs) for `--requests` running requests whose replies already hold L tokens, each getting one more
token a step: microseconds per step, the best of `--steps` steps, for each output kind. CUMULATIVE outputs carry
the whole reply every step; DELTA outputs what the step added, which is what the server asks for (printed first:
the kind `ChatCompletionRequest.sampling_params` gives at this commit). `--stop` gives each request a stop string,
so the text is searched and held back as it grows. On a GPU a step of a small model takes a few milliseconds: a
host cost that grows with the replies' length is a step the device waits for.
"""

from __future__ import annotations

import argparse
import gzip
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from transformers import PreTrainedTokenizerFast

from tokenloom.bench.provenance import git_commit, machine_info
from tokenloom.engine.core_outputs import EngineCoreOutput
from tokenloom.engine.output_processor import OutputProcessor
from tokenloom.model.sampler import SampledToken
from tokenloom.outputs import RequestMetrics
from tokenloom.sampling_params import RequestOutputKind, SamplingParams
from tokenloom.server.protocol import ChatCompletionRequest


class Ending:
    """The engine's side of a stop or a failure: nothing to end here (the replies run on)."""

    def stopped(self, output: EngineCoreOutput, stop: str) -> EngineCoreOutput:
        return output

    def failed(self, output: EngineCoreOutput, error: Exception) -> EngineCoreOutput:
        raise error


def smollm2_tokenizer() -> PreTrainedTokenizerFast:
    data, directory = Path(__file__).parent / "data", Path(tempfile.mkdtemp())
    with gzip.open(data / "smollm2-tokenizer.json.gz") as packed, open(directory / "tokenizer.json", "wb") as out:
        shutil.copyfileobj(packed, out)
    shutil.copy(data / "smollm2-tokenizer_config.json", directory / "tokenizer_config.json")
    return PreTrainedTokenizerFast.from_pretrained(directory)


def the_servers_kind() -> RequestOutputKind:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    return body.sampling_params(16, None).output_kind


def microseconds_per_step(
    tokenizer: PreTrainedTokenizerFast, kind: RequestOutputKind, requests: int, length: int, stop: bool, steps: int
) -> float:
    rng = random.Random(0)

    def tokens(count: int) -> list[SampledToken]:
        return [SampledToken(rng.randrange(200, 20000)) for _ in range(count)]

    processor, ending = OutputProcessor(tokenizer), Ending()
    params = SamplingParams(max_tokens=10**7, output_kind=kind, stop=["\n\nUser:"] if stop else [])
    metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.0, first_token_time=0.0, finished_time=None)
    for r in range(requests):
        processor.add(str(r), processor.new_state(None, [1, 2, 3], params))
        processor.process(EngineCoreOutput(str(r), tokens(1), None, None, metrics), ending)
        for _ in range(length // 500):  # the reply so far, 500 tokens an output
            processor.process(EngineCoreOutput(str(r), tokens(500), None, None, None), ending)
    best = float("inf")
    for _ in range(steps):
        outputs = [EngineCoreOutput(str(r), tokens(1), None, None, None) for r in range(requests)]
        started = time.perf_counter()
        for output in outputs:
            processor.process(output, ending)
        best = min(best, time.perf_counter() - started)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--lengths", default="0,1000,4000,16000", help="tokens each reply holds before the timed steps")
    parser.add_argument("--stop", action="store_true", help="each request has a stop string")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(f"commit {git_commit()}, {machine_info().get('cpu', '')}, load {os.getloadavg()[0]:.2f}")
    tokenizer, servers = smollm2_tokenizer(), the_servers_kind()
    kinds = [servers, *(kind for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA) if kind != servers)]
    for kind in kinds:
        for length in (int(v) for v in args.lengths.split(",")):
            us = microseconds_per_step(tokenizer, kind, args.requests, length, args.stop, args.steps)
            label = f"{kind.name}{' (the server asks for it)' if kind == servers else ''}"
            each = us / args.requests
            print(f"{label:40s} replies of {length:6d} tokens: {us:8,.0f} us a step ({each:6.2f} a request)")


if __name__ == "__main__":
    main()
