"""How much text the server tokenizes at once.

Tokenizing takes far more memory than the text: the fast tokenizer's encoding holds each token's string, offsets and
masks, and the ids come back as a Python list. A 1 MB prompt of numbers (one token a digit: ~960,000 tokens) took
~260 MB, and the worker threads (min(32, CPUs + 4) of them) tokenized that many bodies at once: six 1 MB completions
took a 2-core server from 0.6 to 2.6 GB, a 32-thread pool would take ~8 GB (benchmarks/RESULTS.md). So tokenizing
and chat templating go through this budget of characters: a request whose text does not fit waits for others to
finish (it is not refused), and the budget holds at least one request of the largest body the server accepts.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from tokenloom.server.guard import ByteBudget

T = TypeVar("T")


class TextBudget:
    """The characters being tokenized at once, against a limit; a request larger than the limit runs alone."""

    def __init__(self, limit: int) -> None:
        assert limit > 0
        self.chars = ByteBudget(limit)
        self._freed = asyncio.Event()

    @classmethod
    def for_bodies_up_to(cls, max_body_bytes: int) -> TextBudget:
        """A budget where a body of the largest size the guard lets in always fits, two at once."""
        return cls(2 * max_body_bytes)

    async def run(self, size: int, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """work(*args, **kwargs) in a worker thread once `size` characters fit; they are held until the thread
        ends, even if the request is cancelled before (a thread cannot be stopped)."""
        size = min(size, self.chars.limit)
        while not self.chars.take(size):
            self._freed.clear()
            await self._freed.wait()
        future = asyncio.get_running_loop().run_in_executor(None, functools.partial(work, *args, **kwargs))
        future.add_done_callback(lambda _: self._give_back(size))
        return await asyncio.shield(future)

    def _give_back(self, size: int) -> None:
        self.chars.give_back(size)
        self._freed.set()
