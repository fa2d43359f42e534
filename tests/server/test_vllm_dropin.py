"""What a vLLM user types works here too: `serve MODEL`, the API key from the environment, /tokenize and
/detokenize in vLLM's shapes, /v1/models with the server's start time."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from server_process import ServerProcess

KEY = "sk-from-the-environment"


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    os.environ["TOKENLOOM_API_KEY"] = KEY
    try:
        started = int(time.time())
        with ServerProcess(str(tiny_chat_model), "--served-model-name", "tiny") as proc:  # the model positional
            proc.started = started
            yield proc
    finally:
        del os.environ["TOKENLOOM_API_KEY"]


def post(server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=30)


def test_the_api_key_comes_from_the_environment(server):
    assert post(server, "/tokenize", {"prompt": "hi"}, key=None).status_code == 401
    assert post(server, "/tokenize", {"prompt": "hi"}, key="sk-wrong").status_code == 401
    assert post(server, "/tokenize", {"prompt": "hi"}).status_code == 200


def test_tokenize_and_detokenize_round_trip_in_vllms_shapes(server, tiny_chat_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_chat_model))
    text = "The quick brown fox jumps over the lazy dog."
    body = post(server, "/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 2048 and body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    back = post(server, "/detokenize", {"model": "tiny", "tokens": body["tokens"]}).json()
    assert back == {"prompt": text}

    messages = [{"role": "user", "content": "Hello!"}]
    chat = post(server, "/tokenize", {"messages": messages}).json()
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert chat["tokens"] == list(expected) and chat["token_strs"] is None


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400),  # both forms
        ("/tokenize", {}, 400),  # neither
        ("/tokenize", {"model": "other", "prompt": "a"}, 404),
        ("/detokenize", {"tokens": [49152]}, 400),  # past the vocabulary
        ("/detokenize", {"tokens": [-1]}, 400),
        ("/detokenize", {"tokens": "1 2"}, 400),
    ],
)
def test_bad_tokenize_requests_get_clear_errors(server, path, body, status):
    response = post(server, path, body)
    assert response.status_code == status
    assert response.json()["error"]["message"]


def test_models_says_when_the_server_started(server):
    card = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    created = card["data"][0]["created"]
    assert card["data"][0]["id"] == "tiny" and server.started - 5 <= created <= time.time()


def test_two_different_models_are_refused_at_the_cli(capsys):
    from tokenloom.cli import main

    assert main(["serve", "one-model", "--model", "another-model"]) == 2
    assert "two models given" in capsys.readouterr().err


def test_streams_carry_the_same_logprobs_as_whole_responses(server):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    args = dict(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0, logprobs=2)
    whole = client.completions.create(**args).choices[0].logprobs
    tokens, token_logprobs, offsets = [], [], []
    for chunk in client.completions.create(**args, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            token_logprobs += chunk.choices[0].logprobs.token_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
    assert len(whole.tokens) == 12
    # The second request's prompt is a prefix-cache hit, whose attention sums in another order: the same logprobs up
    # to float32 rounding, not always the same bits.
    assert (tokens, offsets) == (whole.tokens, whole.text_offset)
    assert token_logprobs == pytest.approx(whole.token_logprobs, rel=1e-5, abs=1e-5)

    messages = [{"role": "user", "content": "Tell me a story."}]
    chat_args = dict(model="tiny", messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    chat_whole = client.chat.completions.create(**chat_args).choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(**chat_args, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert len(chat_whole) == 10
    assert [(c.token, len(c.top_logprobs)) for c in streamed] == [(c.token, len(c.top_logprobs)) for c in chat_whole]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in chat_whole], rel=1e-5, abs=1e-5)


def test_metrics_carry_vllms_labels_and_the_dashboard_reads_only_real_metrics(server):
    import json
    import re
    from pathlib import Path

    client = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})  # so the histograms have samples
    httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi"}, timeout=30)  # and a rejection (no key)
    text = client.get("/metrics").text
    samples = [line for line in text.splitlines() if line.startswith("tokenloom:")]
    assert samples and all('model_name="tiny"' in line and 'engine="0"' in line for line in samples)
    assert not any("_created" in line for line in text.splitlines())
    exposed = {re.split(r"[{ ]", line)[0] for line in samples}
    for family in (
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_params_max_tokens",
        "request_inference_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
    ):
        assert f"tokenloom:{family}_count" in exposed, family  # fmt: skip
    dashboard = json.loads(Path(__file__).parents[2].joinpath("deploy/grafana/tokenloom.json").read_text())
    queried = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            queried |= set(re.findall(r"tokenloom:[a-z0-9_]+", target["expr"]))
    assert len(dashboard["panels"]) >= 12 and queried
    assert queried <= exposed, sorted(queried - exposed)


def test_the_container_and_the_manifest_start_serve_with_flags_it_takes():
    import json
    import re
    from pathlib import Path

    from tokenloom.cli import build_parser

    root = Path(__file__).parents[2]
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (.+)$", (root / "Dockerfile").read_text(), re.M).group(1))
    manifest = (root / "deploy/kubernetes/tokenloom.yaml").read_text()
    args = json.loads(re.search(r"^\s+args: (\[.+\])$", manifest, re.M).group(1))
    assert entrypoint[0] == "tokenloom"
    parsed = build_parser().parse_args([*entrypoint[1:], *args])
    assert (parsed.command, parsed.host, parsed.port, parsed.drain_timeout) == ("serve", "0.0.0.0", 8000, 30.0)
    probes = set(re.findall(r"path: (/\w+)", manifest))
    assert probes == {"/health", "/ready", "/metrics"}


def test_n_choices_share_one_prefill_and_count_usage_as_openai(server):
    """n > 1: n choices, usage counting the prompt once; the choices after the first take the prompt's full
    blocks from the prefix cache instead of computing them again (one prefill)."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    prompt = " ".join(f"word{i}" for i in range(120))  # several full KV blocks
    hits_before = server.metric("tokenloom:prefix_cache_hits_total", {"Authorization": f"Bearer {KEY}"})
    sampled = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, n=4, temperature=1.0, seed=7)
    prompt_len = sampled.usage.prompt_tokens
    assert [c.index for c in sampled.choices] == [0, 1, 2, 3]
    assert sampled.usage.completion_tokens == 4 * 6 and sampled.usage.total_tokens == prompt_len + 24
    shared = server.metric("tokenloom:prefix_cache_hits_total", {"Authorization": f"Bearer {KEY}"}) - hits_before
    assert shared >= 3 * (prompt_len // 16) * 16  # three choices took every full block of the prompt
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, n=4, temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in sampled.choices]  # seeded: reproducible
    assert len({c.text for c in sampled.choices}) > 1  # and the choices are not copies of one another

    greedy = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, n=3, temperature=0
    )
    assert len({c.message.content for c in greedy.choices}) == 1 and len(greedy.choices) == 3


def test_a_list_of_prompts_and_n_stream_every_choice(server):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    prompts = ["The sky is", "Once upon a time"]
    whole = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, n=2, temperature=0)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert whole.choices[0].text == whole.choices[1].text != whole.choices[2].text == whole.choices[3].text
    single = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=5, temperature=0)
    assert whole.choices[2].text == single.choices[0].text
    texts: dict[int, str] = {}
    usage = None
    stream = client.completions.create(
        model="tiny", prompt=prompts, max_tokens=5, n=2, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
        usage = chunk.usage or usage
    assert [texts[i] for i in range(4)] == [c.text for c in whole.choices]
    assert usage.prompt_tokens == whole.usage.prompt_tokens and usage.completion_tokens == 20


def test_return_token_ids_gives_the_prompts_and_the_outputs_ids_whole_and_streamed(server):
    """vLLM's return_token_ids, as RL frameworks read it: the ids beside the text, a stream's chunks each with the ids
    of the tokens since the last (the prompt's with a choice's first chunk; a chat's once, beside the choices)."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    prompts = [[9, 8, 7, 6], [5, 4, 3]]
    ask = dict(model="tiny", prompt=prompts, max_tokens=6, n=2, temperature=0, extra_body={"return_token_ids": True})
    whole = client.completions.create(**ask)
    for choice in whole.choices:
        assert choice.prompt_token_ids == prompts[choice.index // 2] and len(choice.token_ids) == 6
    streamed_ids: dict[int, list[int]] = {}
    for chunk in client.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            if choice.index not in streamed_ids:
                assert choice.prompt_token_ids == prompts[choice.index // 2]
            else:
                assert getattr(choice, "prompt_token_ids", None) is None
            streamed_ids.setdefault(choice.index, []).extend(choice.token_ids)
    assert [streamed_ids[i] for i in range(4)] == [c.token_ids for c in whole.choices]
    plain = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=2)
    assert plain.choices[0].token_ids is None  # only when asked

    messages = [{"role": "user", "content": "Hello!"}]
    chat_ask = dict(model="tiny", messages=messages, max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    chat = client.chat.completions.create(**chat_ask)
    assert chat.prompt_token_ids == post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    assert len(chat.choices[0].token_ids) == chat.usage.completion_tokens
    chunks = list(client.chat.completions.create(**chat_ask, stream=True))
    assert chunks[0].prompt_token_ids == chat.prompt_token_ids
    assert all(getattr(chunk, "prompt_token_ids", None) is None for chunk in chunks[1:])
    assert [i for chunk in chunks for c in chunk.choices for i in c.token_ids] == chat.choices[0].token_ids


def test_chat_template_and_generation_config_flags(tiny_chat_model, tmp_path, monkeypatch):
    import json
    import shutil

    from transformers import AutoTokenizer

    monkeypatch.delenv("TOKENLOOM_API_KEY", raising=False)  # this server takes no key (the module's server does)

    model = tmp_path / "with-defaults"
    shutil.copytree(tiny_chat_model, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_p": 0.9, "do_sample": False}))
    template = tmp_path / "template.jinja"
    template.write_text(
        "{% if not (enable_thinking | default(true)) %}/no_think {% endif %}"
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    with ServerProcess(str(model), "--served-model-name", "tiny", "--chat-template", str(template)) as proc:
        messages = [{"role": "user", "content": "Hello there"}]
        tokens = httpx.post(f"{proc.url}/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
        tokenizer = AutoTokenizer.from_pretrained(str(model))
        assert tokens == tokenizer.encode("[user] Hello there\n[assistant]", add_special_tokens=False)
        check_template_options(proc.url, tokenizer, messages)

        def texts(**extra) -> list[str]:
            body = {"prompt": "Once upon a time", "max_tokens": 8, "n": 3, **extra}
            response = httpx.post(f"{proc.url}/v1/completions", json=body, timeout=60)
            return [choice["text"] for choice in response.json()["choices"]]

        left_out = texts()  # the checkpoint's temperature 0: greedy, so the three choices agree
        assert len(set(left_out)) == 1 and left_out == texts(temperature=0)
        assert len(set(texts(temperature=1.0, seed=3))) > 1  # what a request sets wins over the default


def check_template_options(url: str, tokenizer, messages: list[dict]) -> None:
    """vLLM's chat_template_kwargs (the template's variables), add_generation_prompt and continue_final_message, in
    /tokenize and in chat completions alike; a template argument of the server's own is not the client's to set."""

    def rendered(path: str = "/tokenize", **options) -> httpx.Response:
        body = {"model": "tiny", "messages": options.pop("messages", messages), "max_tokens": 1, **options}
        if path == "/tokenize":
            body.pop("max_tokens")
        return httpx.post(f"{url}{path}", json=body, timeout=30)

    def encoded(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    no_think = rendered(chat_template_kwargs={"enable_thinking": False}).json()["tokens"]
    assert no_think == encoded("/no_think [user] Hello there\n[assistant]")
    chat = rendered("/v1/chat/completions", chat_template_kwargs={"enable_thinking": False}).json()
    assert chat["usage"]["prompt_tokens"] == len(no_think)
    assert rendered(add_generation_prompt=False).json()["tokens"] == encoded("[user] Hello there\n")
    opened = [*messages, {"role": "assistant", "content": "Once upon"}]
    continued = rendered(messages=opened, add_generation_prompt=False, continue_final_message=True).json()["tokens"]
    assert continued == encoded("[user] Hello there\n[assistant] Once upon")
    for path in ("/tokenize", "/v1/chat/completions"):
        both = rendered(path, messages=opened, continue_final_message=True)
        assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
        own = rendered(path, chat_template_kwargs={"chat_template": "{{ 7 * 7 }}"})
        assert own.status_code == 400 and own.json()["error"]["param"] == "chat_template_kwargs"
        assert "chat_template" in own.json()["error"]["message"]


def test_vllms_serve_flags_parse_as_vllm_takes_them(tmp_path):
    from tokenloom.cli import build_parser, config_from_args, engine_config_from_args
    from tokenloom.server_config import ServerConfig

    argv = [
        "serve", "some-model", "--api-key", "k1", "k2", "--served-model-name", "a", "b", "--uvicorn-log-level",
        "warning", "--enable-log-requests", "--max-log-len", "20", "--root-path", "/llm", "--allowed-origins",
        "https://app.example", "--ssl-keyfile", "key.pem", "--ssl-certfile", "cert.pem", "--dtype", "half",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--stream-interval", "4",
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert args.model_tag == "some-model"
    server = config_from_args(ServerConfig, args)
    assert server.api_key == ("k1", "k2") and server.served_model_name == ("a", "b")
    assert (server.uvicorn_log_level, server.enable_log_requests, server.max_log_len) == ("warning", True, 20)
    assert (server.root_path, server.allowed_origins) == ("/llm", ("https://app.example",))
    assert (server.ssl_keyfile, server.ssl_certfile, server.tool_call_parser) == ("key.pem", "cert.pem", "hermes")
    assert server.stream_interval == 4 and server.enable_prompt_tokens_details
    import torch

    from tokenloom.model.platform import resolve_dtype

    assert resolve_dtype(engine_config_from_args(args).model.dtype, torch.device("cpu")) is torch.float16
    assert resolve_dtype("float", torch.device("cpu")) is torch.float32
    with pytest.raises(ValueError, match="tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="stream_interval"):
        ServerConfig(stream_interval=0)


def test_the_core_runs_in_its_own_process_on_an_accelerator_unless_told(tmp_path):
    """--core-process unset: on for a device other than the CPU (the event loop would hold the engine's GIL), off on
    the CPU and with --step-log, --ray or tensor parallelism; --core-process and --no-core-process decide outright."""
    import torch

    from tokenloom.cli import build_parser, config_from_args, engine_config_from_args
    from tokenloom.server_config import ServerConfig

    def core_apart(*flags: str, device: str = "cuda") -> bool:
        args = build_parser().parse_args(["serve", "m", "--device", device, *flags])
        engine = engine_config_from_args(args)
        device_type = torch.device(engine.model.device).type
        return config_from_args(ServerConfig, args).runs_core_process(device_type, engine.parallel.tensor_parallel_size)

    assert config_from_args(ServerConfig, build_parser().parse_args(["serve", "m"])).core_process is None
    assert [core_apart(device=device) for device in ("cpu", "cuda", "cuda:1", "mps")] == [False, True, True, True]
    assert core_apart("--core-process", device="cpu") is True
    assert core_apart("--no-core-process") is False
    assert core_apart("--step-log", str(tmp_path / "steps.jsonl")) is False
    assert core_apart("--tensor-parallel-size", "2") is False


@pytest.fixture(scope="module")
def flagged_server(tiny_chat_model):
    args = (
        "--served-model-name", "first", "second", "--api-key", "k1", "k2", "--allowed-origins", "https://app.example",
        "--enable-log-requests", "--max-log-len", "3", "--uvicorn-log-level", "warning", "--stream-interval", "3",
        "--enable-prompt-tokens-details",
    )  # fmt: skip
    proc = ServerProcess(str(tiny_chat_model), *args, log_level="info")
    yield proc
    proc.stop()


def test_every_served_name_and_every_key_is_accepted(flagged_server):
    url = flagged_server.url
    names = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k2"}, timeout=10).json()["data"]
    assert [m["id"] for m in names] == ["first", "second"]
    for key, model in (("k1", "first"), ("k2", "second")):
        reply = httpx.post(
            f"{url}/v1/completions", json={"model": model, "prompt": "Hello there", "max_tokens": 2},
            headers={"Authorization": f"Bearer {key}"}, timeout=30,
        )  # fmt: skip
        assert reply.status_code == 200 and reply.json()["model"] == "first", reply.text


def test_usage_says_the_prompt_tokens_the_prefix_cache_served_when_asked(flagged_server, server):
    """vLLM's --enable-prompt-tokens-details: a prompt sent again is served from the cache, and usage says how much
    (each prompt once, with n choices and streamed too); without the flag usage has no details."""
    prompt = "The same long prompt, word after word, " * 4
    body = {"model": "first", "prompt": prompt, "max_tokens": 2, "temperature": 0}

    def usage(url: str, key: str, **extra) -> dict:
        reply = httpx.post(f"{url}/v1/completions", json={**body, **extra}, headers={"Authorization": f"Bearer {key}"},
                           timeout=30)  # fmt: skip
        if not extra.get("stream"):
            return reply.json()["usage"]
        chunks = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
        return chunks[-1]["usage"]

    first = usage(flagged_server.url, "k1")
    again = usage(flagged_server.url, "k1")
    assert first["prompt_tokens_details"]["cached_tokens"] == 0 and first["prompt_tokens"] > 32
    cached = again["prompt_tokens_details"]["cached_tokens"]
    # every full 16-token block of the prompt but one that holds its last token (which is computed again)
    assert cached >= 32 and cached == (first["prompt_tokens"] - 1) // 16 * 16
    streamed = usage(flagged_server.url, "k1", n=3, stream=True, stream_options={"include_usage": True})
    assert streamed["prompt_tokens_details"] == {"cached_tokens": cached} and streamed["completion_tokens"] == 6
    plain = usage(server.url, KEY, model="tiny")
    assert plain.get("prompt_tokens_details") is None


def test_cors_answers_the_allowed_origin_only(flagged_server):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    allowed = httpx.options(f"{flagged_server.url}/v1/completions", headers=preflight, timeout=10)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(
        f"{flagged_server.url}/v1/completions", headers={**preflight, "Origin": "https://evil.example"}, timeout=10
    )
    assert "access-control-allow-origin" not in other.headers


def streamed_chat(url: str, key: str, body: dict) -> tuple[list[int], str, list, int]:
    """Each content chunk's token count (from the usage streamed with it), the text, the logprobs and the usage."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    options = {"include_usage": True, "continuous_usage_stats": True}
    counts, text, logprobs, seen = [], "", [], 0
    for chunk in client.chat.completions.create(**body, stream=True, stream_options=options):
        if chunk.choices and chunk.choices[0].delta.content is not None:
            counts.append(chunk.usage.completion_tokens - seen)
            text += chunk.choices[0].delta.content
            logprobs += chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else []
        seen = chunk.usage.completion_tokens if chunk.usage else seen
    return counts, text, logprobs, seen


@pytest.mark.parametrize("asked", [None, 5, 1])
def test_a_stream_interval_sends_chunks_of_n_after_the_first(flagged_server, asked):
    """--stream-interval 3 (vLLM's flag): after the first chunk each chunk carries at least three tokens (the last
    fewer); a request's own stream_interval raises it, never lowers it; the text and logprobs are the whole
    response's. The first chunk is sent at the first output without waiting for the interval (OutputQueue's own test
    wakes the reader there exactly), but a reader some steps behind finds the tokens since joined to it, as vLLM's
    output collector joins them: its size here is how far the reader lagged, so it is not asked."""
    import openai

    body = dict(
        model="first", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=17, temperature=0,
        logprobs=True, top_logprobs=1, extra_body={"ignore_eos": True, **({"stream_interval": asked} if asked else {})},
    )  # fmt: skip
    counts, text, logprobs, total = streamed_chat(flagged_server.url, "k1", body)
    whole = openai.OpenAI(base_url=f"{flagged_server.url}/v1", api_key="k1", max_retries=0, timeout=60)
    reply = whole.chat.completions.create(**body).choices[0]
    interval = max(3, asked or 1)
    assert total == sum(counts) == 17 and counts[0] >= 1
    assert all(count >= interval for count in counts[1:-1]) and counts[-1] >= 1, counts
    assert len(counts) <= 2 + (16 // interval), counts
    assert text == reply.message.content
    assert [entry.token for entry in logprobs] == [entry.token for entry in reply.logprobs.content]


def test_a_requests_stream_interval_is_vllms_field_and_zero_is_a_400(server):
    body = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=9, temperature=0)
    asked = {**body, "extra_body": {"ignore_eos": True, "stream_interval": 4}}
    counts, _, _, total = streamed_chat(server.url, KEY, asked)
    # The first chunk: as many tokens as the reader found waiting (see the test above), so its size is not asked.
    assert total == 9 and all(count >= 4 for count in counts[1:-1]) and len(counts) <= 3, counts
    refused = post(server, "/v1/chat/completions", {**body, "stream": True, "stream_interval": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream_interval", refused.text


def test_requests_are_logged_cut_to_max_log_len_and_the_access_log_follows_its_own_level(flagged_server):
    body = {"model": "first", "prompt": [11, 12, 13, 14, 15, 16], "max_tokens": 2}
    assert (
        httpx.post(
            f"{flagged_server.url}/v1/completions", json=body, headers={"Authorization": "Bearer k1"}, timeout=30
        ).status_code
        == 200
    )
    flagged_server.terminate()
    log = flagged_server.process.stdout.read().decode()
    assert "prompt_token_ids: [11, 12, 13]" in log and "14, 15" not in log, log[-3000:]
    assert "POST /v1/completions HTTP/1.1" not in log  # uvicorn at warning: no access lines


def test_vllms_metric_families_and_time_buckets(server):
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 4, "n": 2, "ignore_eos": True}
    assert post(server, "/v1/completions", body).status_code == 200
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    for family in (
        "tokenloom:request_max_num_generation_tokens_bucket", "tokenloom:request_params_n_bucket",
        "tokenloom:request_num_preemptions_bucket", "tokenloom:prompt_tokens_cached_total",
        "tokenloom:request_time_per_output_token_seconds_bucket", "tokenloom:num_requests_waiting_by_reason",
        "tokenloom:cache_config_info", "http_requests_total", "http_request_duration_seconds_bucket",
    ):  # fmt: skip
        assert family in text, family
    assert 'reason="capacity"' in text and 'handler="/v1/completions"' in text and 'status="2xx"' in text
    assert 'tokenloom:time_to_first_token_seconds_bucket{engine="0",le="0.75"' in text  # vLLM's boundaries
    assert 'tokenloom:inter_token_latency_seconds_bucket{engine="0",le="0.075"' in text
    n_two = [
        line
        for line in text.splitlines()
        if line.startswith("tokenloom:request_params_n_bucket") and 'le="2.0"' in line
    ]
    assert n_two and float(n_two[0].rsplit(" ", 1)[1]) >= 1
    httpx.get(f"{server.url}/no/such/path/{time.time()}", timeout=10)
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    assert "/no/such/path" not in text and 'handler="none"' in text  # unknown paths share one label


def test_a_completion_cut_inside_a_character_drops_its_partial_bytes(server, tiny_chat_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_chat_model))
    text = "日本語"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids[:1]).endswith("\ufffd")  # its first token is part of a character
    body = {"model": "tiny", "prompt": "Say:", "max_tokens": 1, "guided_choice": [text]}
    reply = post(server, "/v1/completions", body).json()["choices"][0]
    assert reply["finish_reason"] == "length" and "\ufffd" not in reply["text"], reply


def _self_signed(directory) -> tuple[str, str]:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256())
    )  # fmt: skip
    key_path, cert_path = directory / "key.pem", directory / "cert.pem"
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_path), str(cert_path)


def test_ssl_flags_serve_https(tiny_chat_model, tmp_path):
    import subprocess
    import sys

    from server_process import poll_until

    from tokenloom.bench.local_server import free_port

    key, cert = _self_signed(tmp_path)
    port = free_port()
    command = [sys.executable, "-m", "tokenloom.cli", "serve", str(tiny_chat_model), "--port", str(port),
               "--ssl-keyfile", key, "--ssl-certfile", cert, "--log-level", "warning"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def health() -> int:
        try:
            return httpx.get(f"https://127.0.0.1:{port}/health", verify=False, timeout=2).status_code
        except httpx.HTTPError:
            return 0

    try:
        assert poll_until(health, lambda status: status == 200, timeout=120) == 200
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on that port
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).raise_for_status()
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_vllms_flags_that_change_nothing_are_taken_and_those_for_what_is_not_done_are_refused_by_name(capsys):
    from tokenloom.cli import build_parser, config_from_args, main
    from tokenloom.server_config import ServerConfig

    argv = ["serve", "some-model", "--trust-remote-code", "--disable-log-requests", "--disable-log-stats",
            "--task", "embed"]  # fmt: skip
    assert config_from_args(ServerConfig, build_parser().parse_args(argv)).disable_log_stats
    for argv, flag, words in (
        (["serve", "m", "--api-server-count", "2"], "--api-server-count", "--core-process"),
        (["serve", "m", "--pipeline-parallel-size", "2"], "--pipeline-parallel-size", "tensor"),
        (["serve", "m", "--data-parallel-size=2"], "--data-parallel-size", "--ray --num-replicas"),
        (["serve", "m", "--pooler-config", '{"pooling_type": "MEAN"}'], "--pooler-config", "last token"),
    ):
        assert main(argv) == 2
        error = capsys.readouterr().err
        assert f"{flag} (vLLM's) is not supported" in error and words in error


@pytest.mark.parametrize("disabled", [False, True])
def test_the_periodic_throughput_line_is_logged_unless_disable_log_stats(
    tiny_chat_model, monkeypatch, caplog, disabled
):
    import asyncio
    import logging

    from tokenloom.cli import build_parser, config_from_args, engine_config_from_args
    from tokenloom.server import launch
    from tokenloom.server_config import ServerConfig

    monkeypatch.setattr(launch, "LOG_STATS_EVERY_S", 0.0)  # every step's, so no test waits ten seconds for one
    monkeypatch.delenv("TOKENLOOM_API_KEY", raising=False)  # this module's server sets one while it lives
    flags = ["--disable-log-stats"] if disabled else []
    args = build_parser().parse_args(["serve", str(tiny_chat_model), *flags])
    args.model = args.model_tag
    app, engine = launch.build_server(config_from_args(ServerConfig, args), engine_config_from_args(args))
    engine.start()
    try:
        with caplog.at_level(logging.INFO, logger="tokenloom.stats"):

            async def one_request() -> int:
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                    body = {"prompt": "hi", "max_tokens": 3}
                    return (await client.post("/v1/completions", json=body, timeout=60)).status_code

            assert asyncio.run(one_request()) == 200
            app.state.tokenloom.metrics.on_step([])
    finally:
        engine.shutdown()
    logged = [r.getMessage() for r in caplog.records if "Avg prompt throughput" in r.getMessage()]
    assert (logged == []) is disabled
