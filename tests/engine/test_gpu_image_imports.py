"""The offline engine on one rank needs only what a GPU image has.

The H200 machine that runs benchmarks/gpu_check.py has torch, transformers, safetensors and Triton, but not pyzmq,
xgrammar, gguf, FastAPI, pydantic or uvicorn, and nothing can be installed there from a registry. Those libraries
serve the HTTP front, the engine core process, tensor parallelism, structured output and GGUF loading; an engine
on one rank must import and generate without them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import tokenloom

ABSENT_ON_THE_GPU_IMAGE = ("zmq", "xgrammar", "gguf", "fastapi", "pydantic", "uvicorn", "starlette")

SCRIPT = """
import json, sys
absent = sys.argv[2].split(",")
for name in absent:
    sys.modules[name] = None  # as if not installed: `import` raises ImportError, find_spec returns None
from tokenloom import LLM, SamplingParams
greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
tokens = []
for knobs in ({}, {"async_scheduling": True}):
    llm = LLM(sys.argv[1], dtype="float32", **knobs)
    out = llm.generate([{"prompt_token_ids": [5, 9, 2, 7]}], greedy, use_tqdm=False)
    tokens.append(out[0].outputs[0].token_ids)
print(json.dumps(tokens))
"""


def test_one_rank_engine_generates_without_the_libraries_a_gpu_image_lacks(tiny_llama: Path):
    env = dict(os.environ, PYTHONPATH=str(Path(tokenloom.__file__).parents[1]))
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_llama), ",".join(ABSENT_ON_THE_GPU_IMAGE)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    plain, asynchronous = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(plain) == 6 and plain == asynchronous
