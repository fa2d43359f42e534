"""The stream side of a generating endpoint: how its outputs are worded (ResponseShape), the chunks of every choice
merged as they come, Server-Sent Events that commit to 200 only with a first output, usage, and waiting on work
that a client's disconnect cancels."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from tokenloom.engine.async_engine import ErrorReason, RequestError
from tokenloom.outputs import JoinedDeltas, RequestOutput
from tokenloom.server.errors import APIError
from tokenloom.server.guard import Receive, until_disconnected
from tokenloom.server.protocol import StreamOptions
from tokenloom.server.response_models import (
    ChatStreamChoice,
    ChunkObject,
    CompletionStreamChoice,
    PromptTokensDetails,
    StreamChunk,
    Usage,
)

T = TypeVar("T")
StreamChoice = CompletionStreamChoice | ChatStreamChoice


class ResponseShape(Protocol):
    """How an endpoint words its outputs: the whole response, and a stream as Server-Sent Events."""

    id_prefix: str  # the response id's, with its separator ("chatcmpl-", "resp_")

    def response(
        self, request_id: str, created: int, model: str, finals: list[RequestOutput], logprobs: bool, usage: Usage
    ) -> BaseModel: ...

    def sse_frames(
        self, streams: list[AsyncIterator[RequestOutput]], logprobs: bool, request_id: str, created: int, model: str,
        counting: UsageCount, options: StreamOptions,
    ) -> AsyncGenerator[str]: ...  # fmt: skip

    def error_frame(self, error: APIError) -> str:
        """The event that tells a client why its stream was cut after it began."""
        ...

    end_frame: str | None  # sent after the last event, if the API has one ("data: [DONE]")


class ChoiceShape(Protocol):
    """A shape whose stream is OpenAI's chunks of choices (completions and chat completions)."""

    chunk_object: ChunkObject
    token_ids: bool
    prompt_ids_in_choice: bool

    def chunks(
        self, stream: AsyncIterator[RequestOutput], logprobs: bool
    ) -> AsyncIterator[tuple[StreamChoice, RequestOutput]]: ...


class ChoiceChunks:
    """The stream of completions and chat completions: `data: {chunk}` events, errors as the error body, [DONE]."""

    end_frame: str | None = "data: [DONE]\n\n"
    token_ids: bool = False  # vLLM's return_token_ids: each chunk carries its tokens' ids, the first the prompt's
    prompt_ids_in_choice: bool = True  # where the prompt's ids go: each choice's first chunk, or the stream's first

    def sse_frames(
        self: ChoiceShape, streams: list[AsyncIterator[RequestOutput]], logprobs: bool, request_id: str, created: int,
        model: str, counting: UsageCount, options: StreamOptions,
    ) -> AsyncGenerator[str]:  # fmt: skip
        return envelopes(self, streams, logprobs, request_id, created, model, counting, options)

    def error_frame(self, error: APIError) -> str:
        return f"data: {json.dumps(error.body())}\n\n"


async def envelopes(
    shape: ChoiceShape,
    streams: list[AsyncIterator[RequestOutput]],
    logprobs: bool,
    request_id: str,
    created: int,
    model: str,
    counting: UsageCount,
    options: StreamOptions,
) -> AsyncGenerator[str]:
    """Each chunk of every choice as it comes (with the usage so far, under continuous_usage_stats); then, if asked,
    the usage of all of them: as Server-Sent Events, ``data: {chunk}``."""
    generated: dict[int, int] = {}  # each choice's tokens so far
    last: dict[int, RequestOutput] = {}  # each choice's last output (one output may yield several chunks)
    async for index, choice, output, ids in _merged(shape, streams, logprobs):
        first = index not in last
        if last.get(index) is not output:
            last[index] = output
            generated[index] = generated.get(index, 0) + len(output.outputs[0].token_ids)
        usage = counting.of(sum(generated.values()), last) if options.continuous_usage_stats else None
        update: dict[str, Any] = {"index": index} if choice.index != index else {}
        prompt_ids: dict[str, Any] = {}
        if ids is not None:
            update["token_ids"] = ids
            if first and shape.prompt_ids_in_choice:
                update["prompt_token_ids"] = output.prompt_token_ids
            elif first and len(last) == 1:  # the stream's first chunk
                prompt_ids["prompt_token_ids"] = output.prompt_token_ids
        if update:
            choice = choice.model_copy(update=update)
        envelope = _envelope(request_id, shape.chunk_object, created, model, [choice], usage, **prompt_ids)
        yield f"data: {envelope.sent()}\n\n"
    if options.include_usage and last:
        usage = counting.of(sum(generated.values()), last)
        yield f"data: {_envelope(request_id, shape.chunk_object, created, model, [], usage).sent()}\n\n"


async def _merged(
    shape: ChoiceShape, streams: list[AsyncIterator[RequestOutput]], logprobs: bool
) -> AsyncIterator[tuple[int, StreamChoice, RequestOutput, list[int] | None]]:
    """(choice index, chunk, output, the ids of the tokens read since the choice's last chunk if the shape returns
    them) of every choice, interleaved as they come; the first failure ends them all."""
    if len(streams) == 1:  # the common case needs no tasks
        read, stream = _tapped(shape, streams[0])
        async for choice, output in shape.chunks(stream, logprobs):
            yield 0, choice, output, _taken(read)
        return
    # Bounded: a choice whose chunk waits for the reader stops reading its stream, which then holds one output (its
    # next replaces it) however slowly the client reads; an unbounded queue here would keep one for every step.
    queue: asyncio.Queue[tuple[int, StreamChoice, RequestOutput, list[int] | None] | BaseException | None] = (
        asyncio.Queue(maxsize=len(streams))
    )

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            read, stream = _tapped(shape, stream)
            async for choice, output in shape.chunks(stream, logprobs):
                await queue.put((index, choice, output, _taken(read)))
            await queue.put(None)
        except Exception as error:  # RequestError, APIError: handed to the reader, which stops the others
            await queue.put(error)

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()  # a hang-up or a failure: the other choices' requests are aborted with their streams
        await asyncio.gather(*tasks, return_exceptions=True)


def _tapped(
    shape: ChoiceShape, stream: AsyncIterator[RequestOutput]
) -> tuple[list[int] | None, AsyncIterator[RequestOutput]]:
    """Where the shape returns token ids: a list that gathers the ids of the tokens it reads, and the stream it reads
    through; else (None, the stream itself: no hop more per chunk)."""
    if not shape.token_ids:
        return None, stream
    read: list[int] = []

    async def tapped() -> AsyncIterator[RequestOutput]:
        async for output in stream:
            read.extend(output.outputs[0].token_ids)
            yield output

    return read, tapped()


def _taken(read: list[int] | None) -> list[int] | None:
    """The ids read since the last chunk (emptied for the next), or None where none are gathered."""
    if read is None:
        return None
    ids = read.copy()
    read.clear()
    return ids


_REJECTION_STATUS = {
    ErrorReason.QUEUE_FULL: 429,
    ErrorReason.QUEUED_TOKENS_FULL: 429,
    ErrorReason.SERVER_DRAINING: 503,
    ErrorReason.ENGINE_UNAVAILABLE: 503,
    ErrorReason.QUEUE_TIMEOUT: 503,
    ErrorReason.SERVER_SHUTDOWN: 503,
    ErrorReason.ENGINE_ERROR: 500,
    ErrorReason.REQUEST_FAILED: 500,
}


def api_error_of(error: RequestError) -> APIError:
    """The engine's reason as HTTP: 429 for full queues (with Retry-After), 503 while unavailable, 500 on failure."""
    headers = {"Retry-After": str(max(1, round(error.retry_after)))} if error.retry_after is not None else None
    return APIError(_REJECTION_STATUS[error.reason], error.message, None, error.reason.value, headers)


async def unless_disconnected(work: Awaitable[T], receive: Receive) -> T:
    """Awaits `work`, or cancels it (aborting its request) and raises a 499 as soon as the client hangs up."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise APIError(499, "client disconnected", None, "client_disconnected")
    finally:
        for pending in (task, watch):
            pending.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


async def collect_finals(streams: list[AsyncIterator[RequestOutput]], receive: Receive) -> list[RequestOutput]:
    """Each choice's whole output, its DELTA outputs joined; a hang-up aborts them at once (their KV blocks and the
    tenant slot are freed)."""

    async def last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        joined = JoinedDeltas()
        async for output in stream:
            joined.add(output)
        return joined.output()

    async def every_last() -> list[RequestOutput]:
        if len(streams) == 1:
            return [await last(streams[0])]
        try:
            async with asyncio.TaskGroup() as group:  # one failing choice cancels the others (and aborts them)
                tasks = [group.create_task(last(stream)) for stream in streams]
        except BaseExceptionGroup as group_error:
            raise group_error.exceptions[0] from None
        return [task.result() for task in tasks]

    try:
        return await unless_disconnected(every_last(), receive)
    except RequestError as error:
        raise api_error_of(error) from error


class Lease:
    """What an admitted request holds (its tenant's concurrency slot, its charge of the response budget), released
    exactly once, by whoever holds it last."""

    def __init__(self, release: Callable[[], None] | None) -> None:
        self._release = release

    def transfer(self) -> Lease:
        moved, self._release = Lease(self._release), None
        return moved

    def release(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None


def usage_of(prompt_tokens: int, completion: int) -> Usage:
    """OpenAI's count: each prompt once, every choice's completion tokens."""
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)


@dataclass(frozen=True)
class UsageCount:
    """How a response counts its usage (usage_of); with vLLM's --enable-prompt-tokens-details also the prompt tokens
    the prefix cache served, each prompt's once (its first choice's: the others share its blocks)."""

    prompt_tokens: int
    choices_per_prompt: int = 1
    details: bool = False

    def of(self, completion: int, outputs: Mapping[int, RequestOutput]) -> Usage:
        """The usage of these choices' outputs (by choice index) with `completion` tokens generated in all."""
        usage = usage_of(self.prompt_tokens, completion)
        if not self.details:
            return usage
        firsts = [o for index, o in outputs.items() if index % self.choices_per_prompt == 0]
        cached = PromptTokensDetails(cached_tokens=sum(o.metrics.num_cached_tokens for o in firsts))
        return usage.model_copy(update={"prompt_tokens_details": cached})


async def sse_response(
    shape: ResponseShape, frames: AsyncGenerator[str], lease: Lease, receive: Receive
) -> StreamingResponse:
    """Commits to 200 only once the request has its first output: a queue timeout before it is a real 503."""
    try:
        first = [await unless_disconnected(anext(frames), receive)]
    except StopAsyncIteration:
        first = []
    except (APIError, RequestError) as error:
        lease.release()
        await frames.aclose()
        if isinstance(error, RequestError):
            raise api_error_of(error) from error
        raise

    async def events() -> AsyncIterator[str]:
        try:
            for frame in first:
                yield frame
            async for frame in frames:
                yield frame
        except RequestError as error:  # failed or cut after the stream began: the client still hears why
            yield shape.error_frame(api_error_of(error))
        finally:
            lease.release()
        if shape.end_frame is not None:
            yield shape.end_frame

    return StreamingResponse(events(), media_type="text/event-stream")


async def text_deltas(stream: AsyncIterator[RequestOutput]):
    """(new text, finish reason or None, output) for each DELTA output of a request, until it finishes."""
    async for output in stream:
        completion = output.outputs[0]
        yield completion.text, completion.finish_reason, output


def _envelope(
    request_id: str, kind: ChunkObject, created: int, model: str,
    choices: list[StreamChoice], usage: Usage | None = None, **given: Any,
) -> StreamChunk:  # fmt: skip
    if usage is not None:  # unset otherwise, so that the chunk sends none
        given["usage"] = usage
    return StreamChunk(id=request_id, object=kind, created=created, model=model, choices=choices, **given)
