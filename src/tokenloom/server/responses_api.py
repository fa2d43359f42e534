"""``POST /v1/responses``: OpenAI's Responses API over the chat path (responses_api_protocol.py reads the request as
the chat completion it amounts to), its output items whole, or streamed as OpenAI's typed events:
``response.created``, ``response.in_progress``, then for each output item ``response.output_item.added``, its text
or arguments in deltas, its ``.done`` events, and last ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut it), each with a ``sequence_number``."""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from tokenloom.outputs import RequestOutput
from tokenloom.server.chat import PreparedChat, prepared_chat
from tokenloom.server.errors import APIError
from tokenloom.server.logprobs import (
    TokenLogprobs,
    chat_logprobs_body,
    chat_logprobs_of,
    generated_logprobs,
    logprob_namer,
)
from tokenloom.server.protocol import ChatCompletionRequest, StreamOptions
from tokenloom.server.response_models import Usage
from tokenloom.server.response_store import ResponseStore, StoredResponse
from tokenloom.server.responses_api_protocol import (
    ConversationItem,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
    input_item_body,
    output_as_input,
    response_id_prefix,
    response_settings,
)
from tokenloom.server.responses_background import UNFINISHED
from tokenloom.server.serving import check_model, generate_in_background, serve_generation
from tokenloom.server.state import ERROR_RESPONSES, ServerState, server_state
from tokenloom.server.streaming import UsageCount, text_deltas, usage_of
from tokenloom.server.tool_parsers import reply_calls

router = APIRouter()


@router.post("/v1/responses", responses={200: {"model": ResponseObject}, **ERROR_RESPONSES})
async def create_response(body: ResponsesRequest, raw: Request) -> Response:
    state = server_state(raw)
    body.refuse_unsupported()
    _check_background(state, body)
    tenant: str = raw.state.tenant.name
    earlier = _earlier_conversation(state, body, tenant)
    chat = _chat_request(body, earlier)
    check_model(chat, state)
    prepared = await prepared_chat(state, chat)
    if body.truncation == "auto" and not _fits(state, body, prepared):
        chat, prepared = await _fitted_to_context(state, body, earlier, (chat, prepared))
    store = state.response_store if body.store is not False else None
    conversation = [*earlier, *body.input_items()]
    keep = None if store is None else lambda response: _keep(store, tenant, conversation, response)
    shape = ResponsesShape(body, prepared, keep, state.replica_id)
    logprobs = body.logprobs()
    if body.background:
        return await _in_background(state, raw, (chat, prepared), shape, conversation, logprobs)
    return await serve_generation(state, raw, chat, [prepared.prompt_ids], logprobs, shape, prepared.structured)


def _check_background(state: ServerState, body: ResponsesRequest) -> None:
    if not body.background:
        return
    if body.store is False or state.response_store is None:
        why = "store is false" if body.store is False else "this server keeps no responses (--responses-store-bytes 0)"
        raise APIError(400, f"a background response is kept to be read back, but {why}", "background", "invalid_value")
    if body.stream:
        raise APIError(400, "background with stream is not supported: poll GET /v1/responses/{id}", "stream",
                       "unsupported")  # fmt: skip


async def _in_background(
    state: ServerState,
    raw: Request,
    request: tuple[ChatCompletionRequest, PreparedChat],
    shape: ResponsesShape,
    conversation: list[ConversationItem],
    logprobs: int | None,
) -> Response:
    """background: admitted now (a refusal is this request's answer), answered at once as queued; the reply is
    generated in a task of its own and read back from the store (responses_background.py)."""
    chat, prepared = request
    background, tenant = state.background, raw.state.tenant.name
    response_id, created = f"{shape.id_prefix}{uuid.uuid4().hex}", int(time.time())
    queued = shape.queued(response_id, created, state.model_name)
    background.begin(response_id, tenant, conversation, queued)
    try:
        task = await generate_in_background(
            state, raw, chat, prepared.prompt_ids, logprobs, shape, prepared.structured, (response_id, created),
            functools.partial(background.started, response_id), functools.partial(background.ended, response_id),
        )  # fmt: skip
    except BaseException:
        background.forget(response_id)
        raise
    background.run(response_id, task)
    return JSONResponse(queued.model_dump(mode="json"))


@router.get("/v1/responses/{response_id}", responses={200: {"model": ResponseObject}, **ERROR_RESPONSES})
async def retrieve_response(response_id: str, raw: Request) -> Response:
    state = server_state(raw)
    return JSONResponse(_stored(state, response_id, raw.state.tenant.name).body)


@router.delete("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
async def delete_response(response_id: str, raw: Request) -> Response:
    state, tenant = server_state(raw), raw.state.tenant.name
    store = state.response_store
    await state.background.cancel(response_id, tenant)  # a background response still running ends first
    if store is None or not store.delete(response_id, tenant):
        raise _not_found(state, response_id, "response_id")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel", responses={200: {"model": ResponseObject}, **ERROR_RESPONSES})
async def cancel_response(response_id: str, raw: Request) -> Response:
    """Ends a background response still queued or in progress (its request aborted), as OpenAI's; cancelling it again
    answers the same."""
    state, tenant = server_state(raw), raw.state.tenant.name
    cancelled = await state.background.cancel(response_id, tenant)
    if cancelled is not None:
        return JSONResponse(cancelled)
    body = _stored(state, response_id, tenant).body
    if body["status"] != "cancelled":
        why = f"it has ended ({body['status']})" if body.get("background") else "only a background response can be"
        raise APIError(400, f"response {response_id!r} cannot be cancelled: {why}", "response_id", "invalid_value")
    return JSONResponse(body)


def _chat_request(body: ResponsesRequest, earlier: list[ConversationItem], drop: int = 0) -> ChatCompletionRequest:
    try:
        return body.chat_request(earlier, drop)
    except ValidationError as error:  # a part that passed as Responses input but not as chat (a schema's name)
        raise APIError(400, f"invalid request: {error.errors()[0]['msg']}", "input", "invalid_value") from None


def _fits(state: ServerState, body: ResponsesRequest, prepared: PreparedChat) -> bool:
    return len(prepared.prompt_ids) + (body.max_output_tokens or 1) <= state.engine.max_model_len


async def _fitted_to_context(
    state: ServerState,
    body: ResponsesRequest,
    earlier: list[ConversationItem],
    whole: tuple[ChatCompletionRequest, PreparedChat],
) -> tuple[ChatCompletionRequest, PreparedChat]:
    """truncation "auto": the conversation less the fewest earliest items that makes it fit (the last item always
    stays; a binary search, a template rendering a step); the whole one if nothing does (the context check says)."""
    best, low, high = whole, 1, len(earlier) + len(body.input_items()) - 1
    while low <= high:
        drop = (low + high) // 2
        chat = _chat_request(body, earlier, drop)
        prepared = await prepared_chat(state, chat)
        if _fits(state, body, prepared):
            best, high = (chat, prepared), drop - 1
        else:
            low = drop + 1
    return best


@router.get("/v1/responses/{response_id}/input_items", responses=ERROR_RESPONSES)
async def list_input_items(
    response_id: str,
    raw: Request,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> Response:
    """OpenAI's list of a kept response's input items: the whole conversation it was given (the earlier responses'
    it continued too), each item with an id, a page at a time."""
    state = server_state(raw)
    entry = _stored(state, response_id, raw.state.tenant.name)
    given = entry.conversation[: len(entry.conversation) - len(entry.body["output"])]
    items = [input_item_body(item, f"{response_id.removeprefix('resp_')}_{i}") for i, item in enumerate(given)]
    if order == "desc":
        items.reverse()
    ids = [item["id"] for item in items]
    if after is not None:
        if after not in ids:
            raise APIError(400, f"no input item {after!r} in this response", "after", "invalid_value")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    first, last = (page[0]["id"], page[-1]["id"]) if page else (None, None)
    return JSONResponse({"object": "list", "data": page, "first_id": first, "last_id": last,
                         "has_more": len(items) > limit})  # fmt: skip


def _earlier_conversation(state: ServerState, body: ResponsesRequest, tenant: str) -> list[ConversationItem]:
    """The conversation a request continues: its previous response's, whole (input and output items)."""
    if body.previous_response_id is None:
        return []
    previous = _stored(state, body.previous_response_id, tenant, "previous_response_id")
    if previous.body["status"] in UNFINISHED:
        raise APIError(400, f"response {body.previous_response_id!r} is still {previous.body['status']}: continue it "
                       "once it has ended", "previous_response_id", "invalid_value")  # fmt: skip
    return list(previous.conversation)


def _stored(state: ServerState, response_id: str, tenant: str, param: str = "response_id") -> StoredResponse:
    """A kept response, or a background one still running."""
    entry = state.background.get(response_id, tenant)
    if entry is None and state.response_store is not None:
        entry = state.response_store.get(response_id, tenant)
    if entry is None:
        raise _not_found(state, response_id, param)
    return entry


def _not_found(state: ServerState, response_id: str, param: str) -> APIError:
    if state.response_store is None:
        why = "this server keeps no responses (--responses-store-bytes 0): send the whole conversation in `input`"
    else:
        why = "it was not kept (store false), was deleted, or made room for newer ones (--responses-store-bytes)"
    return APIError(404, f"no response with id {response_id!r}: {why}", param, "not_found")


def _keep(store: ResponseStore, tenant: str, conversation: list[ConversationItem], response: ResponseObject) -> bool:
    """Keeps a finished response with its conversation, which its output continues."""
    whole = [*conversation, *output_as_input(response.output)]
    return store.put(response.id, tenant, whole, response.model_dump(mode="json"))


class ResponsesShape:
    """How /v1/responses words a request's output: a message item for the reply's text, a function_call item for
    each call (a forced tool's, or one the parser reads out of a free reply), in the response object."""

    end_frame: str | None = None  # the last event is response.completed (or .incomplete); no [DONE]

    def __init__(
        self,
        request: ResponsesRequest,
        prepared: PreparedChat,
        keep: Callable[[ResponseObject], bool] | None = None,
        replica_id: str | None = None,
    ) -> None:
        # Under --ray the id names the replica that keeps the response: its continuations are routed there.
        self.id_prefix = response_id_prefix(replica_id)
        self.settings = {**response_settings(request), "store": keep is not None}
        self._keep = keep  # what keeps the finished response, if it is kept
        self.tool, self.parser = prepared.forced, prepared.parser
        self.namer = logprob_namer(prepared.tokenizer, token_ids_as_text=False)  # names the logprobs' tokens
        self._sequence = 0  # the stream's events are numbered from 0
        self._item_ids = uuid.uuid4().hex

    def response(
        self, request_id: str, created: int, model: str, finals: list[RequestOutput], logprobs: bool, usage: Usage
    ) -> ResponseObject:
        (final,) = finals
        completion = final.outputs[0]
        cut = completion.finish_reason == "length"
        token_logprobs = chat_logprobs_body(final, self.namer)["content"] if logprobs else []
        items = self._items(completion.text, cut, token_logprobs)
        return self._kept(self._object(request_id, created, model, items, cut, _usage(usage, final)))

    def queued(self, request_id: str, created: int, model: str) -> ResponseObject:
        """A background response as it is first answered."""
        return self._object(request_id, created, model, [], False, None, status="queued")

    def _kept(self, response: ResponseObject) -> ResponseObject:
        """The finished response, kept if it is to be; one larger than the whole store says it was not."""
        if self._keep is not None and not self._keep(response):
            response.store = False
        return response

    def _items(
        self, text: str, cut: bool, logprobs: list[dict[str, Any]], message_opened: bool = False
    ) -> list[OutputItem]:
        """The output items of a whole reply: its text (if any, if there is nothing else, or if a stream has opened
        its message) with its tokens' logprobs (asked for only without tools), then its calls."""
        content, calls = reply_calls(text, self.tool, self.parser)
        status: ItemStatus = "incomplete" if cut else "completed"
        items: list[OutputItem] = []
        if content or not calls or message_opened:
            part = OutputText(text=content or "", logprobs=logprobs)
            items.append(OutputMessage(id=self._message_id, status=status, content=[part]))
        for call in calls or []:
            items.append(self._call_item(call.function.name, call.function.arguments, len(items), status))
        return items

    @property
    def _message_id(self) -> str:
        return f"msg_{self._item_ids}"

    def _call_item(self, name: str, arguments: str, index: int, status: ItemStatus) -> OutputFunctionCall:
        """A call as an output item; its ids follow from its place, so the streamed item and the final one agree."""
        return OutputFunctionCall(id=f"fc_{self._item_ids}_{index}", call_id=f"call_{self._item_ids[:16]}_{index}",
                                  name=name, arguments=arguments, status=status)  # fmt: skip

    def _object(
        self, request_id: str, created: int, model: str, items: list[OutputItem], cut: bool,
        usage: ResponseUsage | None, status: ResponseStatus | None = None,
    ) -> ResponseObject:  # fmt: skip
        status = status or ("incomplete" if cut else "completed")
        details = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        return ResponseObject(id=request_id, created_at=created, status=status, model=model, output=items,
                              usage=usage, incomplete_details=details, **self.settings)  # fmt: skip

    # The stream.

    async def sse_frames(
        self, streams: list[AsyncIterator[RequestOutput]], logprobs: bool, request_id: str, created: int, model: str,
        counting: UsageCount, options: StreamOptions,
    ) -> AsyncGenerator[str]:  # fmt: skip
        """The reply's text (or a named tool's arguments) streams as it comes; a parser's calls, a required call's
        array and the items' final forms go out once the reply is whole."""
        (stream,) = streams
        text, shown, live = "", 0, None  # live: the item streamed as it is written, once opened
        generated = 0
        sent: list[dict[str, Any]] = []  # the logprobs of the tokens whose text went out
        unsent: list[TokenLogprobs] = []  # of those that came since the last delta
        async for delta, finish_reason, output in text_deltas(stream):
            completion = output.outputs[0]
            generated += len(completion.token_ids)
            if logprobs:
                unsent += generated_logprobs(completion.token_ids, completion.logprobs or [], self.namer)
            if self._sequence == 0:
                started = self._object(request_id, created, model, [], False, None, status="in_progress")
                yield self._event("response.created", response=started)
                yield self._event("response.in_progress", response=started)
            text += delta
            end = self._streamable_end(text)
            if end > shown:
                if live is None:
                    live = self._live_item()
                    for frame in self._opened(live):
                        yield frame
                new_logprobs = chat_logprobs_of(unsent)["content"]
                unsent.clear()
                sent += new_logprobs
                yield self._delta(live, text[shown:end], new_logprobs)
                shown = end
            if finish_reason is not None:
                cut = finish_reason == "length"
                every = sent + chat_logprobs_of(unsent)["content"]
                items = self._items(text, cut, every, message_opened=isinstance(live, OutputMessage))
                for index, item in enumerate(items):
                    opened = live is not None and index == 0
                    for frame in self._closed(item, index, opened):
                        yield frame
                usage = _usage(usage_of(counting.prompt_tokens, generated), output)
                final = self._kept(self._object(request_id, created, model, items, cut, usage))
                yield self._event(f"response.{final.status}", response=final)

    def _streamable_end(self, text: str) -> int:
        """How much of the reply so far can go out live: all of a plain reply or a named tool's arguments; of a
        free reply with tools, what cannot begin a call; nothing of a required call's array."""
        if self.tool is not None:
            return len(text) if self.tool.mode == "named" else 0
        return self.parser.streamable_end(text) if self.parser is not None else len(text)

    def _live_item(self) -> OutputItem:
        if self.tool is not None:  # a named tool's call, its arguments streamed
            assert self.tool.name is not None, "only a named tool's call streams live"
            return self._call_item(self.tool.name, "", 0, "in_progress")
        return OutputMessage(id=self._message_id, status="in_progress", content=[])

    def _opened(self, item: OutputItem, index: int = 0) -> list[str]:
        frames = [self._event("response.output_item.added", output_index=index, item=item)]
        if isinstance(item, OutputMessage):
            part = OutputText(text="")
            frames.append(self._event("response.content_part.added", item_id=item.id, output_index=index,
                                      content_index=0, part=part))  # fmt: skip
        return frames

    def _delta(self, item: OutputItem, delta: str, logprobs: list[dict[str, Any]], index: int = 0) -> str:
        if isinstance(item, OutputMessage):
            return self._event("response.output_text.delta", item_id=item.id, output_index=index, content_index=0,
                               delta=delta, logprobs=logprobs)  # fmt: skip
        return self._event("response.function_call_arguments.delta", item_id=item.id, output_index=index, delta=delta)

    def _closed(self, item: OutputItem, index: int, opened: bool) -> list[str]:
        """An item's closing events; one not streamed live is opened first, its whole text (or arguments) one
        delta."""
        frames: list[str] = []
        empty: dict[str, Any]  # the item as it was opened: nothing written yet
        if isinstance(item, OutputMessage):
            whole, logprobs, empty = item.content[0].text, item.content[0].logprobs, {"content": []}
        else:
            whole, logprobs, empty = item.arguments, [], {"arguments": ""}
        if not opened:
            frames += self._opened(item.model_copy(update={"status": "in_progress", **empty}), index)
            if whole:
                frames.append(self._delta(item, whole, logprobs, index))
        if isinstance(item, OutputMessage):
            place = {"item_id": item.id, "output_index": index, "content_index": 0}
            frames.append(self._event("response.output_text.done", **place, text=whole, logprobs=logprobs))
            frames.append(self._event("response.content_part.done", **place, part=item.content[0]))
        else:
            frames.append(self._event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                      name=item.name, arguments=item.arguments))  # fmt: skip
        frames.append(self._event("response.output_item.done", output_index=index, item=item))
        return frames

    def _event(self, kind: str, **fields: Any) -> str:
        sequence, self._sequence = self._sequence, self._sequence + 1
        body = {"type": kind, "sequence_number": sequence}
        body.update({k: v.model_dump(mode="json") if hasattr(v, "model_dump") else v for k, v in fields.items()})
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def error_frame(self, error: APIError) -> str:
        detail = error.body()["error"]
        return self._event("error", code=detail.get("code"), message=detail.get("message"), param=detail.get("param"))


def _usage(usage: Usage, final: RequestOutput) -> ResponseUsage:
    details = InputTokensDetails(cached_tokens=final.metrics.num_cached_tokens)
    return ResponseUsage(input_tokens=usage.prompt_tokens, input_tokens_details=details,
                         output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens)  # fmt: skip
