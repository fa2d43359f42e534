"""--reasoning-parser: a reply's thought apart from its answer, whole and streamed, in chat completions (the
message's `reasoning` and `reasoning_content`) and the Responses API (a reasoning item ahead of the message)."""

from __future__ import annotations

import asyncio
import json
import random
import re

import httpx
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter
from server_process import ServerProcess
from test_responses_api import outputs

from tokenloom.server.chat import ChatShape, PreparedChat
from tokenloom.server.protocol import StreamOptions
from tokenloom.server.reasoning import ReasoningParser, ReasoningStream
from tokenloom.server.responses_api_protocol import ResponsesRequest
from tokenloom.server.responses_shape import ResponsesShape
from tokenloom.server.streaming import UsageCount, usage_of
from tokenloom.server.tool_parsers import tool_parser

TEXTS = ["<think>\nplan\n</think>\n\nAnswer.", "plan</think>Answer", "Answer only", "<think>cut short", "<th", "",
         "</think>x", "a</thi", "<think>a</think>b</think>c", "<b>bold</b>"]  # fmt: skip
EXPECTED = {
    "deepseek_r1": {"<think>\nplan\n</think>\n\nAnswer.": ("\nplan\n", "\n\nAnswer."), "plan</think>Answer":
                    ("plan", "Answer"), "Answer only": ("Answer only", ""), "<think>cut short": ("cut short", ""),
                    "</think>x": (None, "x"), "<think>a</think>b</think>c": ("a", "b</think>c")},
    "qwen3": {"<think>\nplan\n</think>\n\nAnswer.": ("\nplan\n", "\n\nAnswer."), "plan</think>Answer":
              (None, "plan</think>Answer"), "Answer only": (None, "Answer only"), "<think>cut short": ("cut short", ""),
              "<th": (None, "<th"), "<b>bold</b>": (None, "<b>bold</b>")},
}  # fmt: skip


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_a_reply_splits_into_thought_and_answer_the_same_whole_or_streamed_in_any_pieces(name):
    parser = ReasoningParser(name)
    for text, expected in EXPECTED[name].items():
        assert parser.split(text) == expected, text
    rng = random.Random(0)
    for text in TEXTS:
        thought, answer = parser.split(text)
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 4)))) if text else []
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            stream, streamed = ReasoningStream(parser), ["", ""]
            for i, piece in enumerate(pieces):
                for part, new in enumerate(stream.feed(piece, last=i == len(pieces) - 1)):
                    streamed[part] += new
            assert streamed == [thought or "", answer], (text, pieces)


def test_text_that_may_open_or_close_a_thought_is_held_back_until_the_next_token_says():
    stream = ReasoningStream(ReasoningParser("qwen3"))
    assert stream.feed("<thi", last=False) == ("", "")  # may open a thought: nothing yet
    assert stream.feed("nk>Let me see</th", last=False) == ("Let me see", "")  # may close it: held back
    assert stream.feed("ink>Yes", last=False) == ("", "Yes")
    assert stream.feed(" indeed", last=True) == ("", " indeed")


THOUGHT_THEN_ANSWER = r"<think>[a-z]{3,8}</think>[a-z]{3,8}"


# A template that shows the reasoning effort it is given, as gpt-oss's does.
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if reasoning_effort %}effort: {{ reasoning_effort }}\n{% endif %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    args = ("--served-model-name", "tiny", "--reasoning-parser", "qwen3", "--chat-template", TEMPLATE)
    with ServerProcess(str(tiny_chat_model), *args) as proc:
        yield proc


def test_chat_gives_the_thought_as_reasoning_and_the_rest_as_content_whole_and_streamed(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    # The prompt closes a thought (as Qwen3's template without thinking does), so the grammar holds from the first
    # token, and the reply has a thought only where it opens one: here the regex makes it.
    closed = "Think, then answer. <think></think>"
    ask = dict(model="tiny", messages=[{"role": "user", "content": closed}], max_tokens=40,
               temperature=0, extra_body={"structured_outputs": {"regex": THOUGHT_THEN_ANSWER}})  # fmt: skip
    message = client.chat.completions.create(**ask).choices[0].message
    assert message.reasoning == message.reasoning_content and message.reasoning and message.content
    assert re.fullmatch(THOUGHT_THEN_ANSWER, f"<think>{message.reasoning}</think>{message.content}"), message
    chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert deltas[0].role == "assistant"
    thought = "".join(getattr(d, "reasoning", None) or "" for d in deltas)  # a delta carries only what it adds
    assert thought == "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning
    assert "".join(d.content or "" for d in deltas) == message.content
    # include_reasoning false (vLLM's): the thought left out, the answer as it was.
    without = {**ask, "extra_body": {**ask["extra_body"], "include_reasoning": False}}
    hidden = client.chat.completions.create(**without)
    assert hidden.choices[0].message.reasoning is None and hidden.choices[0].message.content == message.content
    hidden_deltas = [c.choices[0].delta for c in client.chat.completions.create(**without, stream=True) if c.choices]
    assert not any(getattr(d, "reasoning", None) for d in hidden_deltas)
    assert "".join(d.content or "" for d in hidden_deltas) == message.content
    # A reply that opens no thought (qwen3: thinking off) is all content.
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                           temperature=0).choices[0].message  # fmt: skip
    assert plain.reasoning is None and plain.content


def test_a_conversation_sent_back_with_its_reasoning_items_continues(server):
    body = {"model": "tiny", "max_output_tokens": 4, "input": [
        {"role": "user", "content": "Hi"}, {"type": "reasoning", "id": "rs_1", "summary": [],
                                            "content": [{"type": "reasoning_text", "text": "greet"}]},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}]}  # fmt: skip
    reply = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    items = httpx.get(f"{server.url}/v1/responses/{reply.json()['id']}/input_items?order=asc", timeout=10).json()
    assert [item["content"][0]["text"] for item in items["data"]] == ["Hi", "Hello", "Again"]  # the thought left out


def deepseek_shape() -> ResponsesShape:
    prepared = PreparedChat(tokenizer=None, prompt_ids=[1], forced=None, parser=None, structured=None,
                            reasoning=ReasoningParser("deepseek_r1"))  # fmt: skip
    return ResponsesShape(ResponsesRequest(input="hi"), prepared)


PIECES = ["plan", "ning</thi", "nk>The ans", "wer."]


def test_a_responses_thought_is_a_reasoning_item_before_the_message_whole_and_streamed():
    async def whole():
        finals = [output async for output in outputs(["".join(PIECES)])]
        return deepseek_shape().response("resp_1", 0, "m", finals, False, usage_of(3, 4))

    async def events():
        frames = deepseek_shape().sse_frames([outputs(PIECES)], False, "resp_1", 0, "m", UsageCount(3), StreamOptions())
        return [json.loads(frame.split("data: ", 1)[1]) async for frame in frames]

    response = asyncio.run(whole())
    thought, message = response.output
    assert (thought.type, thought.content[0].text, thought.status) == ("reasoning", "planning", "completed")
    assert message.content[0].text == "The answer." and response.status == "completed"
    sent = asyncio.run(events())
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in sent:  # each event is one of OpenAI's, as its client reads them
        adapter.validate_python(event)
    kinds = [(e["type"], e.get("output_index")) for e in sent]
    assert kinds[:4] == [("response.created", None), ("response.in_progress", None),
                         ("response.output_item.added", 0), ("response.reasoning_text.delta", 0)]  # fmt: skip
    thought_done = kinds.index(("response.output_item.done", 0))
    assert kinds.index(("response.output_item.added", 1)) == thought_done + 1  # the message opens once it is done
    assert "".join(e["delta"] for e in sent if e["type"] == "response.reasoning_text.delta") == "planning"
    assert "".join(e["delta"] for e in sent if e["type"] == "response.output_text.delta") == "The answer."
    final = sent[-1]["response"]
    assert [(item["type"], item["status"]) for item in final["output"]] == [("reasoning", "completed"),
                                                                          ("message", "completed")]  # fmt: skip
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "planning"}]


def test_a_reply_cut_while_thinking_is_an_incomplete_thought_and_no_message():
    async def whole():
        finals = [output async for output in outputs(["<think>still going"], finish_reason="length")]
        return deepseek_shape().response("resp_1", 0, "m", finals, False, usage_of(3, 1))

    response = asyncio.run(whole())
    (thought,) = response.output
    assert thought.type == "reasoning" and thought.status == "incomplete" and response.status == "incomplete"


def test_reasoning_effort_reaches_the_template_as_vllm_hands_it_over(server):
    def rendered(**fields) -> str:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **fields}
        ids = httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()["tokens"]
        return httpx.post(f"{server.url}/detokenize", json={"model": "tiny", "tokens": ids}, timeout=30).json()[
            "prompt"
        ]

    assert "effort" not in rendered()
    assert "effort: high" in rendered(reasoning_effort="high")
    assert "effort: low" in rendered(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"})
    # The Responses API's reasoning.effort is the same variable.
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    asked = [client.responses.create(model="tiny", input="Hi", max_output_tokens=1, **effort)
             for effort in ({}, {"reasoning": {"effort": "high"}})]  # fmt: skip
    assert asked[1].usage.input_tokens > asked[0].usage.input_tokens  # "effort: high" in its prompt
    assert asked[1].reasoning.effort == "high" and asked[0].reasoning is None  # echoed, as OpenAI's
    bad = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "reasoning_effort": "extreme",
                     "messages": [{"role": "user", "content": "Hi"}]}, timeout=30)  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"


CALL = '<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>'


def test_calls_are_read_from_the_answer_and_never_from_the_thought():
    """A thought that drafts a call in the tool's own markup stays a thought; the call the answer makes is parsed."""
    shape = ChatShape(None, parser=tool_parser("hermes"), reasoning=ReasoningParser("deepseek_r1"))
    pieces = ["I could call <tool_", 'call>{"name": "no"}</tool_call>, but', "</think>", CALL]

    async def whole():
        finals = [output async for output in outputs(["".join(pieces)])]
        return shape.response("chatcmpl-1", 0, "m", finals, False, usage_of(3, 4))

    async def streamed():
        return [choice.delta async for choice, _ in shape.chunks(outputs(pieces), logprobs=False)]

    (choice,) = asyncio.run(whole()).choices
    assert choice.message.reasoning == 'I could call <tool_call>{"name": "no"}</tool_call>, but'
    assert [call.function.name for call in choice.message.tool_calls] == ["lookup"] and choice.message.content is None
    assert choice.finish_reason == "tool_calls"
    deltas = asyncio.run(streamed())
    assert "".join(d.reasoning or "" for d in deltas) == choice.message.reasoning
    assert "".join(d.content or "" for d in deltas) == ""  # the call's markup never went out as text
    assert [c["function"]["name"] for d in deltas for c in d.tool_calls or []] == ["lookup"]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory, real_model_dir):
    """The tiny chat model with `<think>` and `</think>` one token each, as Qwen3's tokenizer has them (added
    tokens, not special: they show in the text)."""
    import shutil

    import torch
    import transformers

    directory = tmp_path_factory.mktemp("tiny-thinking")
    tokenizer = transformers.AutoTokenizer.from_pretrained(real_model_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save_pretrained(directory)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=2048, tie_word_embeddings=True, eos_token_id=2,
                                      bos_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    shutil.copy(real_model_dir / "chat_template.jinja", directory / "chat_template.jinja")
    return directory, tokenizer.convert_tokens_to_ids("</think>")


def test_a_grammar_starts_after_the_thought_when_the_reply_begins_in_one(thinking_model):
    """vLLM's structured output under a reasoning parser: the reply thinks freely, and the grammar holds from the
    token after `</think>`. A logit bias makes the tiny model close its thought at once; the grammar (a few letters)
    could never have let that token through. Where the prompt has closed the thought, the grammar holds at once."""
    path, end = thinking_model
    args = ("--served-model-name", "tiny", "--reasoning-parser", "deepseek_r1")
    with ServerProcess(str(path), *args) as proc:
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="none", max_retries=0, timeout=60)

        def reply(content: str):
            return client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": content}], max_tokens=12, temperature=0,
                logit_bias={str(end): 100},
                extra_body={"structured_outputs": {"regex": "[a-z]{3,6}"}, "return_token_ids": True},
            ).choices[0]  # fmt: skip

        thought_first = reply("Answer in a word.")
        assert thought_first.token_ids[0] == end  # sampled freely: the grammar had not started
        assert re.fullmatch("[a-z]{3,6}", thought_first.message.content) and not thought_first.message.reasoning
        assert end not in thought_first.token_ids[1:]  # then the grammar held: the bias could not bring it again
        closed = reply("Answer in a word. <think></think>")
        assert end not in closed.token_ids and re.fullmatch("[a-z]{3,6}", closed.message.content)
