"""An n > 1 request's choices of one prompt: one prefill, n decodes (serving.py admits them)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from tokenloom.engine.async_engine import ErrorReason, RequestError
from tokenloom.engine.request_stream import RequestStream
from tokenloom.outputs import RequestOutput


class ForkedChoices:
    """One prompt's n choices, sharing the prompt's KV blocks: one prefill, n decodes.

    The first choice is admitted at once; the others when it has its first token, by which time the prompt's full
    blocks are in the prefix cache, so they take those blocks by reference (the block pool's ref counts) and compute
    only the prompt's last, partial block again. Without prefix caching each choice computes its prompt.
    """

    def __init__(
        self,
        first: AsyncIterator[RequestOutput],
        admit_rest: Callable[[], Awaitable[list[RequestStream]]],
        n: int,
    ) -> None:
        self._first, self._admit_rest = first, admit_rest
        self._rest: list[RequestStream] = []
        self._failure: BaseException | None = None
        self._admitted = asyncio.Event()
        self.streams: list[AsyncIterator[RequestOutput]] = [self._leader(), *(self._follower(j) for j in range(n - 1))]

    async def _leader(self) -> AsyncIterator[RequestOutput]:
        try:
            async for output in self._first:
                if not self._admitted.is_set():
                    try:
                        self._rest = await self._admit_rest()
                    except Exception as error:
                        self._failure = error
                        raise
                    finally:
                        self._admitted.set()
                yield output
        finally:
            if not self._admitted.is_set():  # ended before its first token: the others cannot start
                self._failure = RequestError(ErrorReason.REQUEST_FAILED, "the request's first choice did not start")
                self._admitted.set()

    async def _follower(self, j: int) -> AsyncIterator[RequestOutput]:
        await self._admitted.wait()
        if self._failure is not None:
            raise self._failure
        async for output in self._rest[j]:
            yield output
