"""Property-based fuzz of the HTTP API: hypothesis builds request bodies, a real server answers them.

Whatever arrives: never a 5xx, always an OpenAI-shaped error body for a 4xx, /health answers throughout, and once
the clients are gone (some hang up early) nothing is left running and no KV block is held. Bounded: a fixed number
of derandomized examples against a model whose context is short, so it runs in about a minute on 2 cores.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_process import ServerProcess

MAX_MODEL_LEN = 96

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)
# Mostly well-typed, with a fair share of every other JSON value for each field.
small_ints = st.integers(min_value=-3, max_value=MAX_MODEL_LEN + 8)
unit_floats = st.floats(min_value=-0.5, max_value=2.5)
FIELDS = {
    "model": st.sampled_from(["tiny", "other"]),
    "max_tokens": small_ints,
    "max_completion_tokens": small_ints,
    "temperature": unit_floats,
    "top_p": unit_floats,
    "top_k": small_ints,
    "min_p": unit_floats,
    "seed": st.integers(min_value=-(2**65), max_value=2**65),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3)),
    "stop_token_ids": st.lists(st.integers(min_value=-2, max_value=60000), max_size=3),
    "presence_penalty": unit_floats,
    "repetition_penalty": unit_floats,
    "ignore_eos": st.booleans(),
    "min_tokens": small_ints,
    "logit_bias": st.dictionaries(
        st.one_of(st.integers(min_value=-2, max_value=60000).map(str), st.text(max_size=4)),
        st.floats(min_value=-120, max_value=120),
        max_size=3,
    ),
    "priority": st.integers(min_value=-(2**33), max_value=2**33),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.integers(min_value=0, max_value=3),
    "logprobs": st.one_of(st.integers(min_value=-1, max_value=22), st.booleans()),
    "top_logprobs": st.integers(min_value=-1, max_value=22),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "xml"])}),
    "echo": st.booleans(),
    "allowed_token_ids": st.lists(st.integers(min_value=-2, max_value=60000), max_size=3),
    "bad_words": st.lists(st.text(max_size=4), max_size=3),
    "prompt_logprobs": st.integers(min_value=-1, max_value=22),
    "truncate_prompt_tokens": small_ints,
    "return_tokens_as_token_ids": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["enable_thinking", "tokenize", "messages", "x"]), json_values, max_size=2
    ),
    "structured_outputs": st.one_of(
        st.fixed_dictionaries({"regex": st.text(max_size=8)}),
        st.fixed_dictionaries({"choice": st.lists(st.text(max_size=4), max_size=3)}),
        st.fixed_dictionaries({"json": json_values}),
        st.fixed_dictionaries({"grammar": st.text(max_size=12)}),
    ),
    "guided_json": json_values,
    "tools": st.lists(
        st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"])})}
        ),
        max_size=2,
    ),
    "tool_choice": st.one_of(
        st.sampled_from(["none", "auto", "required"]),
        st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "h"])})}
        ),
    ),
}
texts = st.text(max_size=40)  # any code point, lone surrogates included
# /v1/responses: its own fields, and input items of every kind (and of no known kind).
RESPONSES_FIELDS = {
    "model": st.sampled_from(["tiny", "other"]),
    "instructions": texts,
    "max_output_tokens": small_ints,
    "temperature": unit_floats,
    "top_p": unit_floats,
    "stream": st.booleans(),
    "store": st.booleans(),
    "previous_response_id": st.text(max_size=6),
    "tools": st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["function", "web_search"]), "name": st.sampled_from(["f", "g"])}
        ),
        max_size=2,
    ),
    "tool_choice": st.one_of(
        st.sampled_from(["none", "auto", "required"]),
        st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(["f", "h"])}),
    ),
    "text": st.fixed_dictionaries(
        {"format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])})}
    ),
    "truncation": st.sampled_from(["auto", "disabled"]),
    "metadata": st.dictionaries(st.text(max_size=4), texts, max_size=2),
}
response_items = st.lists(
    st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "developer", "tool"]),
                               "content": st.one_of(texts, st.lists(st.fixed_dictionaries(
                                   {"type": st.sampled_from(["input_text", "input_image"]), "text": texts}),
                                   max_size=2))}),
        st.fixed_dictionaries({"type": st.just("function_call"), "call_id": texts, "name": texts, "arguments": texts}),
        st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": texts, "output": texts}),
        st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "message"])}),
    ),
    max_size=3,
)  # fmt: skip
prompts = st.one_of(
    texts,
    st.lists(st.integers(min_value=-2, max_value=50000), max_size=20),
    st.lists(texts, min_size=1, max_size=2),
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "tool", "robot"]),
            "content": st.one_of(
                texts,
                st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2),
                json_values,
            ),
        }
    ),
    max_size=3,
)


@st.composite
def request_bodies(draw) -> tuple[str, object]:
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses"]))
    if draw(st.integers(0, 19)) == 0:
        return path, draw(json_values)  # not even an object
    fields = RESPONSES_FIELDS if path == "/v1/responses" else FIELDS
    if path == "/v1/completions":
        body = {"prompt": draw(prompts)}
    elif path == "/v1/chat/completions":
        body = {"messages": draw(messages)}
    else:
        body = {"input": draw(st.one_of(texts, response_items))}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=6, unique=True)):
        body[name] = draw(st.one_of(fields[name], json_values) if draw(st.booleans()) else fields[name])
    return path, body


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    proc = ServerProcess(
        "--model", str(tiny_chat_model), "--served-model-name", "tiny", "--max-model-len", str(MAX_MODEL_LEN)
    )
    yield proc
    proc.stop()


@settings(
    max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(request=request_bodies(), hang_up=st.integers(0, 9))
def test_no_body_gets_a_5xx(server, request, hang_up):
    path, body = request
    content = json.dumps(body).encode()  # escapes lone surrogates as JSON does; Infinity and NaN as Python does
    headers = {"Content-Type": "application/json"}
    try:
        # One in ten clients gives up almost at once; the server must notice and let go of its request.
        timeout = 0.05 if hang_up == 0 else 60
        with httpx.stream("POST", f"{server.url}{path}", content=content, headers=headers, timeout=timeout) as r:
            r.read()
    except httpx.TimeoutException:
        return
    assert r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, r.text
    elif r.headers["content-type"].startswith("text/event-stream") and path == "/v1/responses":
        last = r.text.rstrip().rsplit("\n\n", 1)[-1]  # the final event: the response, or why it failed
        assert last.split("\n")[0] in ("event: response.completed", "event: response.incomplete", "event: error"), last
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]")
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_nothing_is_left_running_after_the_fuzz(server):
    # Runs after the fuzz in this module: every request has finished or was aborted when its client left.
    assert server.wait_for_metric("tokenloom:num_requests_running", lambda v: v == 0) == 0
    assert server.wait_for_metric("tokenloom:num_requests_waiting", lambda v: v == 0) == 0
    assert server.wait_for_metric("tokenloom:kv_cache_usage_perc", lambda v: v == 0) == 0
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
