"""What a stream holds while its reader does not read: a request of N tokens left unread to its end.

    .venv/bin/python benchmarks/slow_reader.py [--tokens 1000,2000,4000]

A server's stream is read only as fast as its client takes the bytes (uvicorn stops the handler at the socket's
high-water mark), while the engine goes on producing outputs. This runs the async front over a tiny random model with
the real tokenizer, leaves one request's stream unread until the request has finished, and prints the memory the
stream then holds (tracemalloc, from before the request) and the outputs the reader gets when it reads at last.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import tempfile
import tracemalloc
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(__file__))

from host_overhead import tiny_model_with_the_real_tokenizer

from tokenloom import SamplingParams
from tokenloom.bench.provenance import git_commit
from tokenloom.config import EngineConfig
from tokenloom.engine.async_engine import AsyncEngine
from tokenloom.engine.llm_engine import LLMEngine


async def held_while_unread(front: AsyncEngine, num_tokens: int) -> tuple[int, int, int]:
    """(bytes the stream holds once its request has finished unread, outputs then read, tokens in the last)."""
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    generated = front.stats().generated_tokens
    stream = await front.submit([10, 11, 12, 13], params, f"unread-{num_tokens}")
    while front.stats().generated_tokens < generated + num_tokens or front.stats().num_running:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)  # the last output on its way to the loop
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    outputs = [output async for output in stream]
    return held, len(outputs), len(outputs[-1].outputs[0].token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1000,2000,4000")
    args = parser.parse_args()
    print(f"commit {git_commit()}")
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model_with_the_real_tokenizer(Path(tmp))
        config = EngineConfig.from_kwargs(model=str(model), dtype="float32", max_model_len=4096)
        front = AsyncEngine(LLMEngine(config))
        front.start()
        try:
            for num_tokens in (int(n) for n in args.tokens.split(",")):
                held, num_outputs, num_read = asyncio.run(held_while_unread(front, num_tokens))
                print(f"{num_tokens:6d} tokens unread: {held / 1e6:6.1f} MB held by the stream; "
                      f"then {num_outputs} outputs read, the last with {num_read} tokens")  # fmt: skip
        finally:
            front.shutdown()


if __name__ == "__main__":
    main()
