"""A request's outputs on their way from the engine thread to its reader: the queue that joins what the reader has
not read yet (OutputQueue), and the stream the reader takes them from (RequestStream), which aborts the request if
the reader lets go of it early."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable

from tokenloom.outputs import JoinedDeltas, RequestOutput


class OutputQueue:
    """A request's outputs on their way to its reader, on the reader's event loop. An output that finds the one
    before it still unread takes its place (a cumulative one holds all the other did) or is joined to it (DELTA),
    as vLLM's RequestOutputCollector does: a reader that falls behind (a client that reads slowly) holds one output
    however long its request runs, not one per step, and catches up in one read. DELTA outputs are joined as they
    come at the cost of each one's length (JoinedDeltas), and made one output when read.

    The reader is woken for its first output, its last, an error, and otherwise once ``wake_every`` new tokens are
    unread (vLLM's stream interval: a streamed response in fewer, larger chunks, each of which costs the server's
    event loop a chunk's serialization and a socket write); ``wake_every`` None wakes it only for the first output,
    the last and an error (a reader that wants the whole response, and the first token: an n > 1 request's other
    choices are admitted when its first has one)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delta: bool, wake_every: int | None = 1) -> None:
        assert wake_every is None or wake_every >= 1, wake_every
        self.loop = loop
        self._delta = delta
        self._wake_every = wake_every
        self._items: deque[RequestOutput | Exception] = deque()
        self._unread: JoinedDeltas | None = None  # DELTA outputs that came while the first item was unread, joined
        self._unread_tokens = 0  # new tokens in the unread output (a DELTA one's own; a cumulative one: one a step)
        self._read_any = False
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | Exception) -> None:
        """On the loop's thread (call_soon_threadsafe)."""
        last = self._items[-1] if self._items else None
        if isinstance(last, Exception):
            return  # the reader ends at an error (an abort's own output may follow it): nothing after it is read
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput):
            if self._delta:
                if self._unread is None:
                    self._unread = JoinedDeltas()
                    self._unread.add(last)
                self._unread.add(item)
            self._items[-1] = item
        else:
            self._items.append(item)
        assert len(self._items) <= 2, "an unread output, then at most an error after it"
        if isinstance(item, RequestOutput):
            self._unread_tokens += len(item.outputs[0].token_ids) if self._delta else 1
        if self._readable():
            self._ready.set()

    def _readable(self) -> bool:
        if not self._items:
            return False
        last = self._items[-1]
        if isinstance(last, Exception) or last.finished or not self._read_any:
            return True
        return self._wake_every is not None and self._unread_tokens >= self._wake_every

    async def get(self) -> RequestOutput | Exception:
        while not self._readable():
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, RequestOutput):
            self._read_any, self._unread_tokens = True, 0
            if self._unread is not None:  # the outputs that item stands for
                item, self._unread = self._unread.output(), None
        return item


class RequestStream(AsyncIterator[RequestOutput]):
    """A request's outputs as its reader takes them (``AsyncEngine.submit``); the last has finished=True.

    Closed (``aclose``) or dropped before its last output, or its reader cancelled while it waits for one, it aborts
    its request, whether it was read or not: the request's blocks are freed within a step. (An async generator's
    ``finally`` would run only once it had started, so a stream admitted but never read, say when a request's second
    prompt is refused, would run to its end.)
    """

    def __init__(self, request_id: str, stream: OutputQueue, let_go: Callable[[str, bool], None]) -> None:
        """``let_go(request_id, abort)`` is called once: after the last output, or with abort=True before it."""
        self.request_id = request_id
        self._stream, self._let_go = stream, let_go
        self._ended = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._ended:
            raise StopAsyncIteration
        try:
            item = await self._stream.get()
        except BaseException:  # the reader was cancelled while it waited (a hang-up): nothing reads on
            self._end(abort=True)
            raise
        if isinstance(item, Exception):
            self._end(abort=False)  # the engine already let go of it
            raise item
        if item.finished:
            self._end(abort=False)
        return item

    async def aclose(self) -> None:
        self._end(abort=True)

    def __del__(self) -> None:
        self._end(abort=True)

    def _end(self, abort: bool) -> None:
        if not self._ended:
            self._ended = True
            self._let_go(self.request_id, abort)
