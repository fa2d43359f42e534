"""vLLM's serve flags that shape what clients see, taken as vLLM takes them: --config (a YAML file of flags),
--enable-request-id-headers (with X-Request-Id and the body's request_id naming the response),
--override-generation-config, --disable-fastapi-docs, --return-tokens-as-token-ids, --enable-force-include-usage,
--disable-uvicorn-access-log and --response-role."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest
from server_process import ServerProcess

from tokenloom.cli import build_parser, config_from_args, engine_config_from_args, expand_config_file, main
from tokenloom.server_config import ServerConfig


def test_a_config_file_gives_the_flags_and_the_command_line_wins(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: some-model\nmax-num-seqs: 3\nmax_num_batched_tokens: 512\nserved-model-name: [a, b]\n"
        "enable-log-requests: true\nenable-prefix-caching: false\nport: 9000\ndisable-uvicorn-access-log: true\n"
    )
    argv = expand_config_file(["serve", "--config", str(config), "--max-num-seqs", "5", "--port", "9001"])
    args = build_parser().parse_args(argv)
    server, engine = config_from_args(ServerConfig, args), engine_config_from_args(args)
    assert args.model == "some-model" and server.served_model_name == ("a", "b")
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens) == (5, 512)
    assert not engine.cache.enable_prefix_caching and server.enable_log_requests and server.disable_uvicorn_access_log
    assert server.port == 9001
    # The model named on the command line, as `vllm serve MODEL --config FILE` names it, wins over the file's.
    args = build_parser().parse_args(expand_config_file(["serve", "other-model", "--config", str(config)]))
    assert args.model_tag == "other-model" and args.model is None


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("max-num-seq: 3\n", "max-num-seq"),  # a key no flag has
        ("- just\n- a list\n", "a mapping"),
        ("port: [1, 2]\n", "port"),
    ],
)
def test_a_bad_config_file_is_a_clear_error(tmp_path, capsys, text, words):
    config = tmp_path / "serve.yaml"
    config.write_text(text)
    assert main(["serve", "m", "--config", str(config)]) == 2
    error = capsys.readouterr().err
    assert "--config" in error and words in error
    assert main(["serve", "m", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err


FLAGS = (
    "--enable-request-id-headers", "--override-generation-config", '{"temperature": 0, "top_k": 5}',
    "--disable-fastapi-docs", "--return-tokens-as-token-ids", "--enable-force-include-usage",
    "--disable-uvicorn-access-log", "--response-role", "helper", "--runner", "pooling", "--convert", "embed",
)  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    with ServerProcess(str(tiny_chat_model), "--served-model-name", "tiny", *FLAGS) as proc:
        yield proc


def completion(server, body: dict, headers: dict | None = None) -> httpx.Response:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4, **body}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)


def test_a_requests_id_names_its_response_and_comes_back_in_a_header(server):
    named = completion(server, {}, {"X-Request-Id": "trace-7"})
    assert named.headers["X-Request-Id"] == "trace-7" and named.json()["id"] == "cmpl-trace-7"
    unnamed = completion(server, {})
    assert unnamed.json()["id"] == f"cmpl-{unnamed.headers['X-Request-Id']}"
    mine = completion(server, {"request_id": "mine"})
    assert mine.json()["id"] == "cmpl-mine" and mine.headers["X-Request-Id"] == "mine"
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "request_id": "c1"}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).json()["id"] == "chatcmpl-c1"
    # Clients that reuse an id do not share a request: each is served in full.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        same = list(pool.map(lambda _: completion(server, {"n": 2}, {"X-Request-Id": "dup"}), range(4)))
    assert all(r.status_code == 200 and len(r.json()["choices"]) == 2 for r in same)
    assert httpx.get(f"{server.url}/health", timeout=10).headers["X-Request-Id"]


def test_the_overridden_generation_config_is_the_default_a_request_may_change(server):
    left_out = [c["text"] for c in completion(server, {"n": 3}).json()["choices"]]
    assert len(set(left_out)) == 1  # temperature 0 by default: the three choices agree
    sampled = [c["text"] for c in completion(server, {"n": 3, "temperature": 1.0, "max_tokens": 8}).json()["choices"]]
    assert len(set(sampled)) > 1


def test_docs_are_not_served(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{server.url}{path}", timeout=10).status_code == 404


def test_logprobs_name_token_ids_and_every_stream_ends_with_its_usage(server):
    logprobs = completion(server, {"logprobs": 1}).json()["choices"][0]["logprobs"]
    assert all(token.startswith("token_id:") for token in logprobs["tokens"])
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 3 and events[-1]["choices"] == []


def test_an_override_of_what_is_not_a_sampling_default_is_refused(tiny_chat_model, capsys):
    assert main(["serve", str(tiny_chat_model), "--override-generation-config", '{"temprature": 0}']) == 2
    assert "temprature" in capsys.readouterr().err


def test_vllms_flags_for_what_is_not_done_are_refused_by_name_from_a_config_file_too(tmp_path, capsys):
    assert main(["serve", "m", "--limit-mm-per-prompt", '{"image": 1}']) == 2
    assert "--limit-mm-per-prompt (vLLM's) is not supported: only text is served" in capsys.readouterr().err
    config = tmp_path / "serve.yaml"
    config.write_text("kv-transfer-config: {kv_connector: x}\n")
    assert main(["serve", "m", "--config", str(config)]) == 2
    assert "--kv-transfer-config (vLLM's) is not supported" in capsys.readouterr().err


def test_a_chat_reply_names_the_response_role_or_the_continued_messages(server):
    chat = f"{server.url}/v1/chat/completions"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    assert httpx.post(chat, json=body, timeout=60).json()["choices"][0]["message"]["role"] == "helper"
    with httpx.stream("POST", chat, json={**body, "stream": True}, timeout=60) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    roles = [chunk["choices"][0]["delta"].get("role") for chunk in chunks if chunk["choices"]]
    assert roles[0] == "helper" and set(roles[1:]) == {None}  # the role comes with the first chunk alone
    continued = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "Hello, I"}],
                 "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
    assert httpx.post(chat, json=continued, timeout=60).json()["choices"][0]["message"]["role"] == "assistant"


def test_vllms_runner_choices_serve_both_generation_and_embeddings(server, capsys):
    """--runner pooling --convert embed (as vLLM serves an embedding model) are taken: the server embeds, and still
    generates; a choice tokenloom cannot honour is argparse's error."""
    embedded = httpx.post(f"{server.url}/v1/embeddings", json={"input": "Hi"}, timeout=60).json()
    assert len(embedded["data"][0]["embedding"]) == 64
    assert completion(server, {}).status_code == 200
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--convert", "classify"])
    assert "invalid choice" in capsys.readouterr().err
