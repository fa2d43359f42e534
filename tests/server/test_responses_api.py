"""OpenAI's Responses API (`POST /v1/responses`) through the official client: the same reply as the chat completion
it amounts to, OpenAI's output items and typed stream events, function calls both ways, and clear refusals of what
a stateless server cannot do."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from server_process import ServerProcess

from tokenloom.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenloom.server.chat import PreparedChat
from tokenloom.server.protocol import StreamOptions
from tokenloom.server.response_store import ResponseStore
from tokenloom.server.responses_api_protocol import MessageItem, ResponsesRequest
from tokenloom.server.responses_shape import ResponsesShape
from tokenloom.server.streaming import UsageCount, usage_of
from tokenloom.server.tool_parsers import tool_parser


class Booking(BaseModel):
    nights: int = Field(ge=1, le=9)
    breakfast: bool


class Answer(BaseModel):
    verdict: Literal["yes", "no"]


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    with ServerProcess(str(tiny_chat_model), "--served-model-name", "tiny", "--max-model-len", "512") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def chat_reply(client: openai.OpenAI, messages: list[dict], max_tokens: int):
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0)


def test_a_response_is_the_chat_reply_to_its_instructions_and_input(client):
    response = client.responses.create(
        model="tiny", instructions="Answer briefly.", input="What is the capital of France?", max_output_tokens=12,
        temperature=0,
    )  # fmt: skip
    chat = chat_reply(client, [{"role": "system", "content": "Answer briefly."},
                               {"role": "user", "content": "What is the capital of France?"}], 12)  # fmt: skip
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "tiny"
    assert response.output_text == chat.choices[0].message.content and response.output_text
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [part.type for part in item.content] == ["output_text"]
    # The tiny random model never ends on its own: cut at max_output_tokens, as OpenAI words it.
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert item.status == "incomplete"
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens == usage.input_tokens + 12
    assert (response.instructions, response.max_output_tokens, response.temperature) == ("Answer briefly.", 12, 0)


def test_a_finished_structured_response_parses_into_the_clients_model(client):
    parsed = client.responses.parse(model="tiny", input="Is water wet?", text_format=Answer, max_output_tokens=40)
    assert parsed.status == "completed" and parsed.incomplete_details is None
    assert isinstance(parsed.output_parsed, Answer)
    assert parsed.output[0].status == "completed"


def test_the_stream_is_openais_typed_events_numbered_in_order(client):
    whole = client.responses.create(model="tiny", input="Say something.", max_output_tokens=10, temperature=0)
    events = list(client.responses.create(
        model="tiny", input="Say something.", max_output_tokens=10, temperature=0, stream=True
    ))  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and deltas
    assert kinds[4 + len(deltas) :] == ["response.output_text.done", "response.content_part.done",
                                        "response.output_item.done", "response.incomplete"]  # fmt: skip
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text == events[-1].response.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.id == events[0].response.id and final.usage.output_tokens == 10
    assert final.usage.input_tokens == whole.usage.input_tokens
    # The same prompt a second time: its full blocks came from the prefix cache, and usage says so.
    assert final.usage.input_tokens_details.cached_tokens >= 16
    assert {e.item_id for e in deltas} == {final.output[0].id}


def test_the_clients_stream_helper_assembles_a_completed_response(client):
    with client.responses.stream(model="tiny", input="Is water wet?", text_format=Answer, max_output_tokens=40) as s:
        texts = [event.delta for event in s if event.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert final.status == "completed" and "".join(texts) == final.output_text
    assert isinstance(final.output_parsed, Answer)


def test_a_named_function_is_called_and_streamed_as_argument_deltas(client):
    tool = {"type": "function", "name": "book_room", "parameters": Booking.model_json_schema()}
    choice = {"type": "function", "name": "book_room"}
    whole = client.responses.create(model="tiny", input="Book me a room.", tools=[tool], tool_choice=choice,
                                    max_output_tokens=60, temperature=0)  # fmt: skip
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "book_room" and call.call_id.startswith("call_")
    Booking.model_validate_json(call.arguments)
    assert whole.status == "completed"
    events = list(client.responses.create(model="tiny", input="Book me a room.", tools=[tool], tool_choice=choice,
                                          max_output_tokens=60, temperature=0, stream=True))  # fmt: skip
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == call.arguments
    assert events[-1].type == "response.completed" and events[-1].response.output[0].arguments == call.arguments


def test_earlier_calls_and_their_outputs_are_the_chat_conversation_they_stand_for(client):
    items = [
        {"role": "user", "content": "Book me a room."},
        {"type": "function_call", "call_id": "call_1", "name": "book_room", "arguments": '{"nights": 2}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "booked"},
        {"role": "user", "content": [{"type": "input_text", "text": "Thanks. "},
                                     {"type": "input_text", "text": "And?"}]},
    ]  # fmt: skip
    response = client.responses.create(model="tiny", input=items, max_output_tokens=8, temperature=0)
    messages = [
        {"role": "user", "content": "Book me a room."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "book_room", "arguments": '{"nights": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "booked"},
        {"role": "user", "content": "Thanks. And?"},
    ]  # fmt: skip
    chat = chat_reply(client, messages, 8)
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content


LOGPROBS = "message.output_text.logprobs"


def test_output_logprobs_are_chats_for_the_same_tokens_whole_and_streamed(client):
    ask = dict(model="tiny", input="Say something.", max_output_tokens=8, temperature=0)
    whole = client.responses.create(**ask, include=[LOGPROBS], top_logprobs=2)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say something."}],
                                          max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    logprobs = whole.output[0].content[0].logprobs
    expected = chat.choices[0].logprobs.content
    assert [(lp.token, lp.bytes) for lp in logprobs] == [(lp.token, lp.bytes) for lp in expected] and len(logprobs) == 8
    assert [lp.logprob for lp in logprobs] == pytest.approx([lp.logprob for lp in expected], abs=1e-4)
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob >= lp.logprob for lp in logprobs)
    events = list(client.responses.create(**ask, include=[LOGPROBS], top_logprobs=2, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert len(done.logprobs) == 8 and events[-1].response.output[0].content[0].logprobs == logprobs
    plain = client.responses.create(**ask)
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == whole.output_text


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, 404, "previous_response_id"),
        ({"input": "hi", "reasoning": {"effort": "low", "summary": "auto"}}, 400, "reasoning"),
        ({"input": "hi", "include": ["file_search_call.results"]}, 400, "include"),
        ({"input": "hi", "include": [LOGPROBS], "tools": [{"type": "function", "name": "f"}]}, 400, "include"),
        ({"input": "hi", "frequency": 1}, 400, "frequency"),
        ({"input": []}, 400, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, 400, "text.format"),
        ({"input": "hi", "model": "other"}, 404, "model"),
        ({"input": "x " * 600}, 400, "messages"),
    ],
)
def test_what_a_model_server_cannot_do_is_refused_by_name(server, body, status, param):
    reply = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] is not None and error["param"].startswith(param), error


def test_a_previous_response_continues_its_conversation_and_is_read_back(server, client):
    """The earlier turn's input and output come first, its instructions do not (OpenAI's rule); a kept response
    reads back whole until deleted, streamed or not."""
    ask = dict(model="tiny", max_output_tokens=6, temperature=0)
    first = client.responses.create(**ask, instructions="Be brief.", input="My name is Ada.")
    second = client.responses.create(**ask, previous_response_id=first.id, input="What is my name?")
    chat = chat_reply(client, [{"role": "user", "content": "My name is Ada."},
                               {"role": "assistant", "content": first.output_text},
                               {"role": "user", "content": "What is my name?"}], 6)  # fmt: skip
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    assert (first.store, second.previous_response_id) == (True, first.id)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    # its input, listed as OpenAI lists it: the whole conversation it was given, newest first, a page at a time
    listed = client.responses.input_items.list(second.id)
    assert [(i.type, i.role, i.content[0].text) for i in listed.data] == [
        ("message", "user", "What is my name?"), ("message", "assistant", first.output_text),
        ("message", "user", "My name is Ada."),
    ] and not listed.has_more  # fmt: skip
    page = client.responses.input_items.list(second.id, limit=2, order="asc")
    assert [i.content[0].text for i in page.data] == ["My name is Ada.", first.output_text] and page.has_more
    rest = client.responses.input_items.list(second.id, limit=2, order="asc", after=page.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["What is my name?"] and not rest.has_more
    streamed = list(client.responses.create(**ask, previous_response_id=second.id, input="And?", stream=True))
    kept = client.responses.retrieve(streamed[-1].response.id)
    assert kept.output_text == streamed[-1].response.output_text and kept.previous_response_id == second.id
    client.responses.delete(first.id)
    # /metrics labels a kept response's reads by their route, not by each id
    handler = 'http_requests_total{handler="/v1/responses/{response_id}",method="GET"}'
    assert server.metric(handler) == 2 and 'handler="none"' not in httpx.get(f"{server.url}/metrics").text
    for gone in (lambda: client.responses.retrieve(first.id),
                 lambda: client.responses.create(**ask, previous_response_id=first.id, input="Hi")):  # fmt: skip
        with pytest.raises(openai.NotFoundError, match="no response with id"):
            gone()
    unkept = client.responses.create(**ask, input="Hi", store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_truncation_auto_drops_the_fewest_earliest_items_that_make_it_fit(server, client):
    """OpenAI's truncation "auto": the conversation (over the 512-token context) less its earliest items, as few as
    fit with max_output_tokens; the default refuses it as too long."""
    turns = [{"role": ("user", "assistant")[i % 2], "content": f"Turn {i}: " + "word " * 90} for i in range(9)]
    too_long = httpx.post(f"{server.url}/v1/responses", json={"input": turns, "max_output_tokens": 8}, timeout=30)
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    response = client.responses.create(model="tiny", input=turns, max_output_tokens=8, truncation="auto",
                                       temperature=0)  # fmt: skip
    lengths = [
        httpx.post(f"{server.url}/tokenize", json={"messages": turns[drop:]}, timeout=30).json()["count"]
        for drop in range(len(turns))
    ]
    fewest = next(drop for drop, length in enumerate(lengths) if length + 8 <= 512)
    assert 0 < fewest < len(turns) - 1 and response.usage.input_tokens == lengths[fewest]
    assert response.truncation == "auto" and response.status == "incomplete"


def test_a_truncated_conversation_never_begins_with_a_calls_output():
    items = [
        {"role": "user", "content": "Book it."},
        {"type": "function_call", "call_id": "c1", "name": "book", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "booked"},
        {"role": "user", "content": "Thanks."},
    ]
    request = ResponsesRequest(input=items, instructions="Be brief.")
    assert [m.role for m in request.messages()] == ["system", "user", "assistant", "tool", "user"]
    assert [m.role for m in request.messages(drop=1)] == ["system", "assistant", "tool", "user"]
    assert [m.role for m in request.messages(drop=2)] == ["system", "user"]  # its call dropped, the output goes too


def test_the_store_keeps_the_latest_within_its_bytes_and_each_tenants_own():
    item = MessageItem(role="user", content="x" * 100)
    one = ResponseStore(max_bytes=10_000)
    one.put("r0", "a", [item], {"id": "r0"})
    size = one.get("r0", "a").size
    store = ResponseStore(max_bytes=4 * size + size // 2)  # room for four
    for i in range(6):
        assert store.put(f"r{i}", "a", [item], {"id": f"r{i}"})
        assert store.bytes <= store.max_bytes
    kept = [f"r{i}" for i in range(6) if store.get(f"r{i}", "a") is not None]
    assert kept == ["r2", "r3", "r4", "r5"] and store.bytes == 4 * store.get("r5", "a").size
    assert store.get("r5", "b") is None and not store.delete("r5", "b")  # another tenant's id is not found
    store.get("r2", "a")  # used: the least recently used is now r3
    store.put("r6", "a", [item], {"id": "r6"})
    assert store.get("r3", "a") is None and store.get("r2", "a") is not None
    assert not store.put("big", "a", [MessageItem(role="user", content="x" * 5 * size)], {})  # alone over budget
    assert store.delete("r2", "a") and store.get("r2", "a") is None and store.bytes == 3 * store.get("r6", "a").size


# ---- the shape, on outputs made by hand: what a tool-call parser reads out of a free reply ---------------------


def outputs(texts: list[str], finish_reason: str = "stop"):
    metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=None, first_token_time=None, finished_time=None,
                             num_cached_tokens=4)  # fmt: skip

    async def stream():
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            reason = finish_reason if last else None
            completion = CompletionOutput(index=0, text=text, token_ids=[7], finish_reason=reason)
            yield RequestOutput("r", None, [1, 2, 3], [completion], last, metrics)

    return stream()


def hermes_shape(keep=None) -> ResponsesShape:
    request = ResponsesRequest(input="hi", tools=[{"type": "function", "name": "lookup"}])
    prepared = PreparedChat(tokenizer=None, prompt_ids=[1], forced=None, parser=tool_parser("hermes"), structured=None)
    return ResponsesShape(request, prepared, keep)


CALL = '<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>'


def test_a_parsed_call_follows_the_text_streamed_before_it():
    async def events():
        frames = hermes_shape().sse_frames([outputs(["Let me ", "look.", CALL])], False, "resp_1", 0, "m",
                                           UsageCount(prompt_tokens=3), StreamOptions())  # fmt: skip
        return [json.loads(frame.split("data: ", 1)[1]) async for frame in frames]

    sent = asyncio.run(events())
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    text = "".join(e["delta"] for e in sent if e["type"] == "response.output_text.delta")
    assert text == "Let me look." and CALL not in text  # the call's markup never went out as text
    final = sent[-1]["response"]
    assert sent[-1]["type"] == "response.completed"
    message, call = final["output"]
    assert message["content"][0]["text"] == "Let me look."
    assert (call["type"], call["name"], json.loads(call["arguments"])) == ("function_call", "lookup", {"q": "x"})
    added = [e["item"]["id"] for e in sent if e["type"] == "response.output_item.added"]
    done = [e["item"]["id"] for e in sent if e["type"] == "response.output_item.done"]
    assert added == done == [message["id"], call["id"]]
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 4 and final["usage"]["output_tokens"] == 3


def test_a_reply_that_only_calls_has_no_message_item():
    shape = hermes_shape()

    async def finals():
        whole = [output async for output in outputs([CALL])]
        return shape.response("resp_1", 0, "m", whole, False, usage_of(3, 1))

    response = asyncio.run(finals())
    (call,) = response.output
    assert call.type == "function_call" and call.status == "completed" and response.status == "completed"


def test_a_response_says_whether_it_was_kept():
    """`store` is true only where the store took it: one larger than the whole store is not kept, and says so."""

    async def stored(keep) -> bool:
        whole = [output async for output in outputs(["Hi."])]
        return hermes_shape(keep).response("resp_1", 0, "m", whole, False, usage_of(3, 1)).store

    assert asyncio.run(stored(lambda response: True)) is True
    assert asyncio.run(stored(lambda response: False)) is False
    assert asyncio.run(stored(None)) is False
