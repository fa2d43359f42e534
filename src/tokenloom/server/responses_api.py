"""``POST /v1/responses``: OpenAI's Responses API over the chat path (responses_api_protocol.py reads the request as
the chat completion it amounts to; responses_shape.py words its output), and the routes of kept responses: read
back, their input items listed, deleted, a background one cancelled (responses_background.py)."""

from __future__ import annotations

import functools
import time
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from tokenloom.server.chat import PreparedChat, prepared_chat
from tokenloom.server.errors import APIError
from tokenloom.server.protocol import ChatCompletionRequest
from tokenloom.server.response_store import ResponseStore, StoredResponse
from tokenloom.server.responses_api_protocol import (
    ConversationItem,
    ResponseObject,
    ResponsesRequest,
    input_item_body,
    output_as_input,
)
from tokenloom.server.responses_background import UNFINISHED
from tokenloom.server.responses_shape import ResponsesShape
from tokenloom.server.serving import check_model, generate_in_background, serve_generation
from tokenloom.server.state import ERROR_RESPONSES, ServerState, server_state

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
    queued = shape.queued(response_id, created, state.served_name(chat.model))
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
    outputs = sum(1 for item in entry.body["output"] if item["type"] != "reasoning")  # a thought is not kept on
    given = entry.conversation[: len(entry.conversation) - outputs]
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
