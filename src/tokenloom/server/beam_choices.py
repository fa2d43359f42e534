"""A request's beam search (vLLM's ``use_beam_search``): its n choices are the n best beams of one search.

The search runs as a task of its own, started by the first of its choices to be read; each step submits one
request per live beam and waits for all of them (beam_search.py). Every choice's stream yields its whole answer once
the search ends; a hang-up cancels the task, which aborts the step's requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable

from tokenloom.beam_search import BeamSearch, step_candidates
from tokenloom.engine.request_stream import RequestStream
from tokenloom.outputs import RequestOutput

# (prompt, params, request id, whether it is the search's first step) -> the step request's stream
StepSubmit = Callable[..., Awaitable[RequestStream]]


class BeamSearchChoices:
    """One prompt's search and the streams of its n choices (`streams`), choice j the j-th best beam."""

    def __init__(
        self, search: BeamSearch, submit: StepSubmit, request_id: str, decode: Callable[[list[int]], str]
    ) -> None:
        self._search, self._submit, self._request_id, self._decode = search, submit, request_id, decode
        self._task: asyncio.Task[list[RequestOutput]] | None = None
        self.streams: list[AsyncIterator[RequestOutput]] = [self._choice(j) for j in range(search.params.beam_width)]

    async def _choice(self, j: int) -> AsyncIterator[RequestOutput]:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"beam search {self._request_id}")
        # A reader cancelled here (a hang-up) cancels the search with it, and resumes only once the search has ended:
        # its step's requests closed (aborted), no step after.
        answers = await self._task
        if j < len(answers):
            yield answers[j]

    async def _run(self) -> list[RequestOutput]:
        search = self._search
        opening: list[RequestOutput] = []
        finals: list[RequestOutput] = []
        while not search.done:
            finals = await self._step(search.steps)
            opening = opening or finals
            search.advance([step_candidates(final) for final in finals])
        # The search's times: from its first step's arrival to its last step's end.
        metrics = dataclasses.replace(opening[0].metrics, finished_time=finals[0].metrics.finished_time)
        return [RequestOutput(self._request_id, None, opening[0].prompt_token_ids, [output], True, metrics)
                for output in search.completion_outputs(self._decode)]  # fmt: skip

    async def _step(self, step: int) -> list[RequestOutput]:
        """One request per live beam, all in flight together; each one's final output."""
        streams: list[RequestStream] = []
        try:
            for b, tokens in enumerate(self._search.step_prompts()):
                rid = f"{self._request_id}-s{step}-b{b}"
                streams.append(await self._submit(tokens, self._search.step_params, rid, step == 0))
            return list(await asyncio.gather(*(_last(stream) for stream in streams)))
        finally:
            for stream in streams:  # closing a stream that has not ended aborts its request
                await stream.aclose()


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for output in stream:
        last = output
    assert last is not None and last.finished
    return last
