"""tool_choice "auto": the model's reply is read for calls in its family's format (hermes, llama3_json).

The parsers alone on written replies; then a served tiny Qwen3 with a Hermes-style chat template, its reply
forced by a guided choice (a random model would not call a tool by itself), through the official client and
LangChain's ``bind_tools``; and a Llama-3-JSON server the same way.
"""

from __future__ import annotations

import json
import shutil

import openai
import pytest
import torch
from server_process import ServerProcess

from tokenloom.server.tool_parsers import HermesParser, Llama3JsonParser, MistralParser, PythonicParser

# ---- the parsers ---------------------------------------------------------------------------------------------

HERMES_REPLY = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_hermes_reads_text_then_calls():
    parsed = HermesParser().parse(HERMES_REPLY)
    assert parsed.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert len({c.id for c in parsed.calls}) == 2


def test_hermes_streams_no_text_that_may_begin_a_call():
    parser = HermesParser()
    assert parser.streamable_end("Hello <tool") == len("Hello ")  # perhaps the start of <tool_call>
    assert parser.streamable_end("Hello <b>") == len("Hello <b>")
    assert parser.streamable_end(HERMES_REPLY) == HERMES_REPLY.index("<tool_call>")


def test_llama3_json_reads_one_or_more_calls():
    reply = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
    )
    parsed = Llama3JsonParser().parse(reply)
    assert parsed.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]


@pytest.mark.parametrize("parser, call_begins", [(Llama3JsonParser, ' {"name"'), (PythonicParser, " [get_")])
def test_a_parser_whose_calls_fill_the_reply_holds_what_may_be_a_call(parser, call_begins):
    held = parser()
    assert held.streamable_end("") == 0 and held.streamable_end(call_begins) == 0
    assert held.streamable_end("<|python") == 0
    assert held.streamable_end("Sunny today") == len("Sunny today")


MISTRAL_ARRAY = (
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
)
MISTRAL_NAMED = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'


@pytest.mark.parametrize("reply", [MISTRAL_ARRAY, MISTRAL_NAMED])
def test_mistral_reads_both_of_its_formats_with_ids_its_templates_accept(reply):
    parsed = MistralParser().parse(reply)
    assert parsed.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in parsed.calls)  # Mistral's templates refuse other ids
    assert MistralParser().parse("Sure. " + reply).content == "Sure."


@pytest.mark.parametrize(
    "parser, reply",
    [
        (HermesParser, "Just text, no call."),
        (HermesParser, 'Cut short: <tool_call>\n{"name": "get_weather", "argu'),  # max_tokens ended it inside the call
        (HermesParser, "<tool_call>\nnot json\n</tool_call>"),
        (HermesParser, '<tool_call>{"arguments": {}}</tool_call>'),  # no name
        (MistralParser, "No call here."),
        (MistralParser, '[TOOL_CALLS] [{"name": "get_weather", "argu'),  # cut short
        (MistralParser, "[TOOL_CALLS] []"),
        (MistralParser, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {}}] and then some'),
        (MistralParser, "[TOOL_CALLS]get_weather[ARGS]{not json"),
        (MistralParser, '[TOOL_CALLS][ARGS]{"city": "Paris"}'),  # no name
        (Llama3JsonParser, "The weather is fine."),
        (Llama3JsonParser, '{"name": "get_weather", "parameters": {"ci'),
        (Llama3JsonParser, '{"not": "a call"}'),
        (PythonicParser, "The weather is fine."),
        (PythonicParser, "[get_weather(city="),  # cut short
        (PythonicParser, '[get_weather("Paris")]'),  # a positional argument
        (PythonicParser, "[get_weather(city=__import__('os').getcwd())]"),  # not a literal: read, never run
        (PythonicParser, "[1, 2]"),
        (PythonicParser, "[]"),
        (PythonicParser, "[" * 500 + "]" * 500),  # deeper than Python's parser goes
    ],
)
def test_a_reply_whose_calls_do_not_parse_is_given_as_text(parser, reply):
    parsed = parser().parse(reply)
    assert parsed.calls == [] and parsed.content == reply


def test_mistral_streams_no_text_that_may_begin_a_call():
    parser = MistralParser()
    assert parser.streamable_end("Hello [TOOL") == len("Hello ")
    assert parser.streamable_end("Hello [1]") == len("Hello [1]")
    assert parser.streamable_end("Hi " + MISTRAL_NAMED) == len("Hi ")


def test_pythonic_reads_a_list_of_calls_as_python_never_running_it():
    reply = '[get_weather(city="Paris", days=3, units={"temp": "C"}), get_time()]'
    for text in (reply, f"<|python_start|>{reply}<|python_end|>"):
        parsed = PythonicParser().parse(text)
        assert parsed.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.calls] == [
            ("get_weather", {"city": "Paris", "days": 3, "units": {"temp": "C"}}),
            ("get_time", {}),
        ]


# ---- served ------------------------------------------------------------------------------------------------

# A Hermes-style tool template, as Qwen2.5 and Qwen3 checkpoints carry (ChatML with <tools> and <tool_call>).
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages if message.role != 'system' %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
LLAMA3_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tiny_qwen3_with_tools(tmp_path_factory, real_model_dir):
    """A tiny random Qwen3 with the SmolLM2 tokenizer (ChatML too) and a Hermes tool template."""
    import transformers
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("tiny-qwen3-tools")
    config = transformers.Qwen3Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True,
        eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real_model_dir / name, directory / name)
    (directory / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return directory


@pytest.fixture(scope="module")
def hermes_server(tiny_qwen3_with_tools):
    args = ("--served-model-name", "qwen", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    with ServerProcess(str(tiny_qwen3_with_tools), *args, "--max-model-len", "1024") as proc:
        yield proc


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_the_template_shows_the_model_its_tools(hermes_server):
    import httpx

    body = {"model": "qwen", "messages": ASK, "return_token_strs": False}
    plain = httpx.post(f"{hermes_server.url}/tokenize", json=body, timeout=10).json()["count"]
    reply = client_of(hermes_server).chat.completions.create(
        model="qwen", messages=ASK, tools=[WEATHER_TOOL], max_tokens=1
    )
    assert reply.usage.prompt_tokens > plain + 50  # the tool's signature went into the prompt


def test_auto_reads_a_hermes_call_out_of_the_reply(hermes_server):
    reply = client_of(hermes_server).chat.completions.create(
        model="qwen", messages=ASK, tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=60,
        extra_body={"guided_choice": [HERMES_CALL]},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_auto_streams_the_call_once_it_is_whole_and_no_half_call_as_text(hermes_server):
    stream = client_of(hermes_server).chat.completions.create(
        model="qwen", messages=ASK, tools=[WEATHER_TOOL], max_tokens=60, stream=True,
        extra_body={"guided_choice": [HERMES_CALL]},
    )  # fmt: skip
    content, calls, finish = "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and finish == "tool_calls"
    (call,) = calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_auto_gives_plain_text_when_the_model_calls_nothing(hermes_server):
    reply = client_of(hermes_server).chat.completions.create(
        model="qwen", messages=ASK, tools=[WEATHER_TOOL], max_tokens=8, temperature=0
    )
    choice = reply.choices[0]
    assert choice.message.tool_calls in (None, []) and choice.message.content and choice.finish_reason == "length"


def test_langchains_bind_tools_with_auto_gets_the_call(hermes_server):
    from langchain_openai import ChatOpenAI

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    model = ChatOpenAI(
        base_url=f"{hermes_server.url}/v1", api_key="none", model="qwen", max_tokens=60, max_retries=0, timeout=60,
        extra_body={"guided_choice": [HERMES_CALL]},
    )  # fmt: skip
    message = model.bind_tools([get_weather], tool_choice="auto").invoke("What is the weather in Paris?")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", {"city": "Paris"})]


def test_a_named_call_cut_by_max_tokens_stays_a_call(hermes_server):
    reply = client_of(hermes_server).chat.completions.create(
        model="qwen", messages=ASK, tools=[WEATHER_TOOL], max_tokens=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")


def test_auto_without_a_parser_is_refused(tiny_chat_model):
    with (
        ServerProcess(str(tiny_chat_model), "--served-model-name", "tiny") as server,
        pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"),
    ):
        client_of(server).chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER_TOOL], max_tokens=2)


def test_auto_reads_a_llama3_json_call(tiny_chat_model):
    args = ("--served-model-name", "tiny", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")
    with ServerProcess(str(tiny_chat_model), *args) as server:
        reply = client_of(server).chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER_TOOL], max_tokens=40,
            extra_body={"guided_choice": [LLAMA3_CALL]},
        )  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("get_weather", {"city": "Paris"})
        ]


@pytest.mark.parametrize(
    ("parser", "reply"),
    [("pythonic", '[get_weather(city="Paris")]'), ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}')],
)
def test_auto_reads_a_pythonic_or_mistral_call(tiny_chat_model, parser, reply):
    args = ("--served-model-name", "tiny", "--enable-auto-tool-choice", "--tool-call-parser", parser)
    with ServerProcess(str(tiny_chat_model), *args) as server:
        ask = dict(
            model="tiny", messages=ASK, tools=[WEATHER_TOOL], max_tokens=40, extra_body={"guided_choice": [reply]}
        )
        choice = client_of(server).chat.completions.create(**ask).choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("get_weather", {"city": "Paris"})
        ]
        chunks = list(client_of(server).chat.completions.create(**ask, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""  # no call as text
        streamed = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
        assert [call.function.name for call in streamed] == ["get_weather"]
