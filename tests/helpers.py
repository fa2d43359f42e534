"""Helpers more than one test module uses (tests/ is on the path: its conftest.py puts it there)."""

from __future__ import annotations

import os
import shutil

import pytest

from tokenloom import SamplingParams
from tokenloom.engine.async_engine import AsyncEngine
from tokenloom.model import cpu_kernel


def needs_operator() -> None:
    """Optional where no C++ compiler exists; where one does, a failing build is a failure, not a skip."""
    if shutil.which(os.environ.get("CXX", "c++")) is None or not cpu_kernel.kernel_enabled():
        pytest.skip("no C++ compiler here (or TOKENLOOM_CPU_KERNEL=0): the operator is optional")
    assert cpu_kernel.load_kernel(), "the C++ operators failed to build; see the log"


async def collect(front: AsyncEngine, prompt: list[int], request_id: str, max_tokens: int = 8) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    final = None
    async for output in await front.submit(prompt, params, request_id):
        final = output
    assert final is not None and final.finished
    return final.outputs[0].token_ids
