"""Structured output and tool calls: grammars (xgrammar) applied as a token bitmask, per request, in a batch.

The model is a tiny random Llama with the real SmolLM2 tokenizer: whatever it would say, the grammar decides what
it may say, so every reply must parse and validate. Schemas bound their strings and numbers, so that a random
model's reply ends well inside max_tokens.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field
from server_process import ServerProcess

from tokenloom import LLM, SamplingParams
from tokenloom.config import EngineConfig
from tokenloom.core.request import Request
from tokenloom.engine.async_engine import AsyncEngine
from tokenloom.engine.core_process import CoreProcessEngine
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.sampling_params import StructuredOutputsParams

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "units": {"enum": ["metric", "imperial"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "alerts": {"type": "boolean"},
    },
    "required": ["city", "units", "days", "alerts"],
    "additionalProperties": False,
}


class Weather(BaseModel):
    city: str = Field(max_length=12)
    units: Literal["metric", "imperial"]
    days: int = Field(ge=1, le=14)
    alerts: bool


class Booking(BaseModel):
    nights: int = Field(ge=1, le=9)
    breakfast: bool


def validates(reply: str, model: type[BaseModel]) -> BaseModel:
    return model.model_validate_json(reply)


# ---- the engine ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_chat_model):
    # A small budget and few blocks: prompts are chunked and requests preempted while grammars are live.
    return LLM(str(tiny_chat_model), max_num_batched_tokens=32, num_kv_blocks=24, block_size=8, max_num_seqs=6)


def test_every_kind_of_grammar_holds_in_one_batch_and_plain_requests_are_untouched(llm):
    specs = [
        StructuredOutputsParams(json=WEATHER_SCHEMA),
        StructuredOutputsParams(json=json.dumps(WEATHER_SCHEMA)),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
        StructuredOutputsParams(choice=("yes", "no", "maybe")),
        StructuredOutputsParams(grammar='root ::= "(" [a-c]+ ")"'),
    ]
    prompts = [f"Request {i}: tell me something long enough to be chunked across steps." for i in range(8)]
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = llm.generate(prompts[6:], plain, use_tqdm=False)
    params = [SamplingParams(temperature=t, seed=i, max_tokens=120, structured_outputs=s) for i, (t, s) in
              enumerate(zip((0, 0.8, 0, 0, 1.3, 0.5), specs, strict=True))]  # fmt: skip
    outputs = llm.generate(prompts, [*params, plain, plain], use_tqdm=False)
    texts = [o.outputs[0].text for o in outputs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs[:6]), [o.outputs[0].finish_reason for o in outputs]
    validates(texts[0], Weather)
    validates(texts[1], Weather)
    assert isinstance(json.loads(texts[2]), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", texts[3])
    assert texts[4] in ("yes", "no", "maybe")
    assert re.fullmatch(r"\([a-c]+\)", texts[5])
    # Requests without a grammar in the same batch sample exactly what they sample alone.
    assert [o.outputs[0].token_ids for o in outputs[6:]] == [o.outputs[0].token_ids for o in alone]
    assert llm.engine.stats().kv_blocks_in_use == 0


def test_async_scheduling_reads_each_step_first_while_a_grammar_lives(tiny_chat_model, llm):
    """A grammar's mask for a step needs the step before's token on the host: while a request with one lives, steps
    are read before the next is scheduled, ahead again after it; every request gets a synchronous engine's tokens."""
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ruled = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex="[a-c]{3}"))
    prompts = [f"Request {i}: say something." for i in range(3)]
    params = [plain, ruled, plain]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_chat_model), async_scheduling=True))
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt, p, request_id=str(i))
    finished, ahead = {}, []
    while engine.has_unfinished_requests():
        ahead.append(engine.core._may_schedule_ahead())
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert [finished[str(i)] for i in range(3)] == expected
    assert not ahead[0] and ahead[-1], "read first while the grammar lives, ahead after it ends"


def test_a_grammar_that_only_the_core_sees_fails_its_request_alone(llm):
    """The front compiles grammars first; if one still fails in the core, that request alone ends in error."""
    core = llm.engine.core
    bad = Request("bad", [1, 2, 3], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(")))
    good = Request("good", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    core.add_request(bad)
    core.add_request(good)
    finished: dict[str, str | None] = {}
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            if output.finished:
                finished[output.request_id] = output.finish_reason
    assert finished == {"bad": "error", "good": "length"}
    assert core.stats().kv_blocks_in_use == 0 and "bad" not in core.structured


def test_a_matcher_that_raises_mid_decode_fails_its_request_alone(llm):
    class Broken:
        def fill_next_token_bitmask(self, bitmask, row):
            raise RuntimeError("matcher state lost")

    core = llm.engine.core
    spec = StructuredOutputsParams(regex="[a-z]+")
    core.add_request(Request("broken", [1, 2, 3], SamplingParams(max_tokens=8, structured_outputs=spec)))
    core.add_request(Request("fine", [1, 2, 3], SamplingParams(max_tokens=8, structured_outputs=spec)))
    core.add_request(Request("plain", [4, 5, 6], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    core.structured._matchers["broken"] = Broken()
    finished: dict[str, str | None] = {}
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            if output.finished:
                finished[output.request_id] = output.finish_reason
    assert finished["broken"] == "error" and finished["plain"] == "length" and finished["fine"] in ("stop", "length")
    assert core.stats().kv_blocks_in_use == 0 and "broken" not in core.structured


def test_a_bad_grammar_is_refused_before_it_is_queued(llm):
    for spec in (StructuredOutputsParams(regex="(unclosed"), StructuredOutputsParams(json="{not json")):
        with pytest.raises(ValueError, match="invalid"):
            llm.engine.add_request("hello", SamplingParams(structured_outputs=spec))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=("a",))
    assert not llm.engine.has_unfinished_requests()


def test_grammars_hold_the_same_through_the_core_process(tiny_chat_model, llm):
    prompts = ["Pick a code:", "And another one:"]
    params = SamplingParams(
        temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=r"[a-f]{2}-[0-9]{1,3}")
    )
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    front = AsyncEngine(CoreProcessEngine(EngineConfig.from_kwargs(model=str(tiny_chat_model), dtype="float32")))
    front.start()
    try:

        async def text(prompt: str, request_id: str) -> str:
            final = None
            async for output in await front.submit(prompt, params, request_id):
                final = output
            assert final is not None and final.outputs[0].finish_reason == "stop"
            return final.outputs[0].text

        async def both() -> list[str]:
            return await asyncio.gather(*(text(p, f"r{i}") for i, p in enumerate(prompts)))

        got = asyncio.run(both())
    finally:
        front.shutdown()
    assert got == expected and all(re.fullmatch(r"[a-f]{2}-[0-9]{1,3}", t) for t in got)


# ---- the API, through the official client -------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    with ServerProcess(str(tiny_chat_model), "--served-model-name", "tiny", "--max-model-len", "1024") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


MESSAGES = [{"role": "user", "content": "What will the weather be in Paris?"}]


def test_json_schema_reply_parses_into_the_clients_model(client):
    completion = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Weather, max_tokens=150)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Weather)
    validates(choice.message.content, Weather)


def test_vllms_structured_output_extras_on_completions(client):
    choice = client.completions.create(
        model="tiny", prompt="Pick one:", max_tokens=20, extra_body={"structured_outputs": {"choice": ["red", "blue"]}}
    )
    assert choice.choices[0].text in ("red", "blue")
    regex = client.completions.create(
        model="tiny", prompt="Code:", max_tokens=20, extra_body={"guided_regex": "[A-Z]{4}"}
    )
    assert re.fullmatch("[A-Z]{4}", regex.choices[0].text)


def test_a_named_tool_choice_returns_a_call_whose_arguments_validate(client):
    tools = [
        openai.pydantic_function_tool(Booking, name="book_room"),
        openai.pydantic_function_tool(Weather, name="forecast"),
    ]
    completion = client.chat.completions.parse(
        model="tiny",
        messages=[{"role": "user", "content": "Book me a room."}],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "book_room"}},
        max_tokens=100,
        n=2,
        temperature=1.0,
    )
    for choice in completion.choices:
        message = choice.message
        assert message.content is None and len(message.tool_calls) == 1
        call = message.tool_calls[0]
        assert call.function.name == "book_room" and call.id.startswith("call_")
        assert isinstance(call.function.parsed_arguments, Booking)
        assert choice.finish_reason == "stop"  # OpenAI's answer to a forced function


def test_required_tool_choice_calls_one_of_the_tools_each_time(client):
    tools = [
        openai.pydantic_function_tool(Booking, name="book_room"),
        openai.pydantic_function_tool(Weather, name="forecast"),
    ]
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=tools, tool_choice="required", max_tokens=300, temperature=0.7, seed=3
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        model = {"book_room": Booking, "forecast": Weather}[call.function.name]
        validates(call.function.arguments, model)
    single = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=300
    )
    assert len(single.choices[0].message.tool_calls) == 1


def test_a_streamed_named_tool_call_arrives_as_argument_deltas(client):
    tool = openai.pydantic_function_tool(Booking, name="book_room")
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Book me a room."}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "book_room"}},
        max_tokens=100,
        stream=True,
    )
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "book_room" and deltas[0].role == "assistant"
    assert all(c.index == 0 and c.id is None for c in calls[1:])
    validates("".join(c.function.arguments or "" for c in calls), Booking)


def test_a_conversation_with_earlier_tool_calls_and_results_renders(client):
    messages = [
        {"role": "user", "content": "Book me a room."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "book_room", "arguments": '{"nights": 2}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "booked"},
    ]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5)
    assert reply.choices[0].message.content is not None


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format", "invalid JSON schema"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "response_format", "invalid regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs",
         "Unrecognized request argument supplied: structured_outputs.whitespace_pattern"),
        ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty strings"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "one structured output"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice", "auto"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tool_choice", "auto"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "not among the tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ],
)  # fmt: skip
def test_what_cannot_be_decoded_gets_a_clear_400(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, extra_body=body)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param and words in error["message"], error


def test_the_server_still_serves_after_refusals(client, server):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert server.metric("tokenloom:kv_cache_usage_perc") == 0.0


# ---- the real model -----------------------------------------------------------------------------------------


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def real_server(real_model_dir):
    with ServerProcess(str(real_model_dir), "--served-model-name", "smol", "--max-model-len", "1024") as proc:
        yield proc


@pytest.mark.real_model
def test_the_real_model_answers_json_object_and_a_schema(real_server):
    client = openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="none", max_retries=0, timeout=120)
    ask = [{"role": "user", "content": "Describe a person with a name and an age, as JSON."}]
    reply = client.chat.completions.create(
        model="smol", messages=ask, response_format={"type": "json_object"}, max_tokens=100, temperature=0
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    parsed = client.chat.completions.parse(model="smol", messages=ask, response_format=Person, max_tokens=100)
    assert isinstance(parsed.choices[0].message.parsed, Person)


@pytest.mark.real_model
def test_langchains_with_structured_output_works_in_all_three_modes(real_server):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model="smol", base_url=f"{real_server.url}/v1", api_key="none", temperature=0, max_tokens=100, max_retries=0
    )
    ask = "Describe a person with a name and an age, as JSON."
    for method in ("json_schema", "function_calling"):
        person = chat.with_structured_output(Person, method=method).invoke(ask)
        assert isinstance(person, Person), method
    anything = chat.with_structured_output(None, method="json_mode").invoke(ask)
    assert isinstance(anything, dict)


@pytest.mark.real_model
def test_the_real_model_answers_through_the_responses_api_and_langchain_on_it(real_server):
    from langchain_openai import ChatOpenAI

    client = openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="none", max_retries=0, timeout=120)
    response = client.responses.create(
        model="smol", input="What is the capital of France?", max_output_tokens=40, temperature=0
    )
    assert response.status == "completed" and "Paris" in response.output_text
    ask = "Describe a person with a name and an age, as JSON."
    parsed = client.responses.parse(model="smol", input=ask, text_format=Person, max_output_tokens=100)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Person)
    chat = ChatOpenAI(model="smol", base_url=f"{real_server.url}/v1", api_key="none", temperature=0, max_tokens=40,
                      max_retries=0, use_responses_api=True)  # fmt: skip
    assert "Paris" in chat.invoke("What is the capital of France?").text
    for method in ("json_schema", "function_calling"):  # a text format; a function tool called by name
        person = chat.with_structured_output(Person, method=method).invoke(ask)
        assert isinstance(person, Person), method


def test_a_grammar_that_starts_after_a_thought_waits_for_the_whole_end_of_it(tiny_chat_model):
    """While its request thinks, a grammar gives no mask row and reads no token; the end of the thought (several
    ids here, as a tokenizer without the tag as one token has it) must come whole and in order; then the grammar
    holds from the next token. Drafts verified while thinking are cut after the end, where the grammar would judge."""
    from transformers import AutoTokenizer

    from tokenloom.engine.structured_output import GrammarCompiler, StructuredOutputManager

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_chat_model))
    manager = StructuredOutputManager(GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id]))
    end = (500, 501, 502)
    manager.add("r", StructuredOutputsParams(regex="[0-9]+", starts_after=end))
    letter = tokenizer.encode("x", add_special_tokens=False)[0]  # outside the grammar: allowed only while thinking
    assert manager.grammar_mask([("r", [])]) == (None, {})
    assert manager.valid_drafts("r", [7, 500, 501, 502, letter, 9]) == [7, 500, 501, 502]
    for token in (500, 501, 7, 500, 501):  # a broken end is not the end
        assert manager.accept("r", token) is False
    assert manager.grammar_mask([("r", [])]) == (None, {})
    manager.accept("r", 502)
    mask, failed = manager.grammar_mask([("r", [])])
    assert mask is not None and not failed and mask.request_ids == ["r"]  # the grammar holds now
    with pytest.raises(RuntimeError, match="outside the request's grammar"):
        manager.accept("r", letter)
