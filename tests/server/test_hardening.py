"""One request's bad input never hurts another: each probe against a real `tokenloom serve` process.

Every bad request must get its 4xx in OpenAI's error shape while requests running beside it finish normally, and
caps, limits and disconnects must hold on every path (defaults, chunked bodies, hang-ups).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import ClassVar

import httpx
import pytest
from server_process import HeldRequest, ServerProcess, StalledBodies, poll_until, response_until_closed

from tokenloom.server.errors import APIError
from tokenloom.server.tenants import Tenant, TenantLimiter

TENANTS = """
[[tenant]]
name = "capped"
keys = ["sk-capped"]
max_tokens = 5

[[tenant]]
name = "single"
keys = ["sk-single"]
max_concurrent_requests = 1

[[tenant]]
name = "pair"
keys = ["sk-pair"]
max_concurrent_requests = 2

[[tenant]]
name = "open"
keys = ["sk-open"]
"""
CAPPED = {"Authorization": "Bearer sk-capped"}
SINGLE = {"Authorization": "Bearer sk-single"}
OPEN = {"Authorization": "Bearer sk-open"}
PAIR = {"Authorization": "Bearer sk-pair"}
OPERATOR = {"Authorization": "Bearer sk-operator"}
HEADER_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    tenants.write_text(TENANTS)
    proc = ServerProcess(
        "--model",
        str(tiny_chat_model),
        "--served-model-name",
        "tiny",
        "--tenants",
        str(tenants),
        "--max-model-len",
        "1024",
        "--max-body-bytes",
        "200000",
        "--header-timeout",
        str(HEADER_TIMEOUT_S),
        "--api-key",
        "sk-operator",
    )
    yield proc
    proc.stop()


def post(server, path: str, body, headers=OPEN, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=kwargs.pop("timeout", 60), **kwargs)


def send_json(client: httpx.Client, path: str, body) -> httpx.Response:
    """As a client in another language would send it: lone surrogates escaped as \\ud800, which httpx refuses."""
    return client.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None, param: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error


def wait_idle(server, headers=OPEN) -> None:
    server.wait_idle(headers)


class Bystanders:
    """Greedy requests, streaming and not, that run while a bad one is sent; their answers must be untouched."""

    BODY: ClassVar[dict] = {
        "model": "tiny",
        "prompt": "A bystander's story:",
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
    }

    def __init__(self, server) -> None:
        self.server = server
        self.expected = post(server, "/v1/completions", self.BODY).json()["choices"][0]["text"]
        self.texts: list[str] = []
        self.streaming = threading.Event()  # set once the streamed bystander has its first token
        self.threads = [threading.Thread(target=self._plain), threading.Thread(target=self._streamed)]

    def __enter__(self) -> Bystanders:
        for thread in self.threads:
            thread.start()
        # In flight for sure: a gauge read every 50 ms can miss requests this short, a streamed token cannot.
        assert self.streaming.wait(timeout=60), "the streamed bystander never got a token"
        return self

    def __exit__(self, *exc) -> None:
        for thread in self.threads:
            thread.join(timeout=120)
        assert self.texts == [self.expected, self.expected]

    def _plain(self) -> None:
        response = post(self.server, "/v1/completions", self.BODY)
        assert response.status_code == 200
        self.texts.append(response.json()["choices"][0]["text"])

    def _streamed(self) -> None:
        text = ""
        with httpx.stream(
            "POST", f"{self.server.url}/v1/completions", json={**self.BODY, "stream": True}, headers=OPEN, timeout=60
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
                    self.streaming.set()
        self.texts.append(text)


# ---- 1. a seed the generator cannot take fails that request alone ------------------------------------------


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_out_of_range_seed_is_a_400_and_bystanders_finish(server, seed):
    with Bystanders(server):
        response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "seed": seed})
        assert_openai_error(response, 400, "invalid_value", "seed")
        chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": seed})
        assert_openai_error(chat, 400, "invalid_value", "seed")
    wait_idle(server)


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63)])
def test_seeds_at_the_ends_of_the_range_work(server, seed):
    body = {"prompt": "hi", "max_tokens": 4, "seed": seed, "temperature": 1.0, "ignore_eos": True}
    first, second = (post(server, "/v1/completions", body) for _ in range(2))
    assert first.status_code == second.status_code == 200
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]


# ---- 2. a non-streaming client that hangs up is noticed --------------------------------------------------------


def test_non_streaming_hang_up_frees_the_request_and_its_tenant_slot(server):
    before = server.metric("tokenloom:generation_tokens_total", OPEN)
    # "single" may have one request in flight: the hung-up one must give its slot back.
    for path, body in (
        ("/v1/completions", {"prompt": "Go on and on", "max_tokens": 900, "ignore_eos": True}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Go"}], "max_tokens": 900, "ignore_eos": True},
        ),
    ):
        with pytest.raises(httpx.TimeoutException):
            post(server, path, body, SINGLE, timeout=1.0)
        wait_idle(server)
        assert post(server, "/v1/completions", {"prompt": "next", "max_tokens": 2}, SINGLE).status_code == 200
    assert server.metric("tokenloom:generation_tokens_total", OPEN) - before < 2 * 900  # both stopped early


# ---- 3. the tenant's max_tokens cap holds when max_tokens is left out -------------------------------------------


def test_tenant_cap_bounds_a_missing_or_null_max_tokens(server):
    chat = {"messages": [{"role": "user", "content": "Talk"}], "ignore_eos": True}
    for body, path in (
        (chat, "/v1/chat/completions"),
        ({**chat, "max_tokens": None}, "/v1/chat/completions"),
        ({"prompt": "Talk", "max_tokens": None, "ignore_eos": True}, "/v1/completions"),
    ):
        response = post(server, path, body, CAPPED)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 5
        assert response.json()["choices"][0]["finish_reason"] == "length"


def test_max_completion_tokens_is_honoured_and_capped(server):
    chat = {"messages": [{"role": "user", "content": "Talk"}], "ignore_eos": True}
    honoured = post(server, "/v1/chat/completions", {**chat, "max_completion_tokens": 3, "max_tokens": 50}, CAPPED)
    assert honoured.status_code == 200 and honoured.json()["usage"]["completion_tokens"] == 3
    assert_openai_error(
        post(server, "/v1/chat/completions", {**chat, "max_completion_tokens": 6}, CAPPED),
        400,
        "max_tokens_over_cap",
    )
    assert_openai_error(
        post(server, "/v1/chat/completions", {**chat, "max_completion_tokens": 0}, CAPPED),
        400,
        "invalid_value",
        "max_completion_tokens",
    )


# ---- 4. the body limit holds for chunked bodies; big prompts do not stall the event loop -------------------------


def test_chunked_body_over_the_limit_gets_413(server):
    payload = json.dumps({"prompt": "x" * 300_000}).encode()

    def chunks():
        for i in range(0, len(payload), 16_384):
            yield payload[i : i + 16_384]

    response = httpx.post(
        f"{server.url}/v1/completions",
        content=chunks(),
        headers={**OPEN, "Content-Type": "application/json"},
        timeout=60,
    )
    assert_openai_error(response, 413, "body_too_large")
    assert "content-length" not in {k.lower() for k in response.request.headers}  # it really was chunked


def test_health_answers_while_big_prompts_are_tokenized(server):
    prompt = "lorem ipsum dolor sit amet " * 7000  # ~190 kB: just under the body limit, many tokens to encode
    results: list[int] = []

    def send() -> None:
        results.append(post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).status_code)

    senders = [threading.Thread(target=send) for _ in range(4)]
    for thread in senders:
        thread.start()
    health = [httpx.get(f"{server.url}/health", timeout=30).status_code for _ in range(10)]
    for thread in senders:
        thread.join(timeout=120)
    assert health == [200] * 10
    assert results == [400] * 4  # over the context: a clear 400, each of them
    wait_idle(server)


# ---- 5. a request may lower its priority, never raise it above its tenant's ------------------------------------


PRIORITY_TENANTS = """
[[tenant]]
name = "high"
keys = ["sk-high"]
priority = 0

[[tenant]]
name = "low"
keys = ["sk-low"]
priority = 10
"""


def test_request_priority_cannot_jump_above_its_tenant(tiny_chat_model, tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(PRIORITY_TENANTS)
    proc = ServerProcess(
        "--model", str(tiny_chat_model), "--tenants", str(tenants), "--scheduling-policy", "priority",
        "--max-num-seqs", "1",
    )  # fmt: skip
    high, low = {"Authorization": "Bearer sk-high"}, {"Authorization": "Bearer sk-low"}
    finished: list[str] = []

    def send(name: str, headers: dict[str, str], body: dict) -> None:
        response = post(proc, "/v1/completions", {"ignore_eos": True, **body}, headers, timeout=120)
        assert response.status_code == 200
        finished.append(name)

    try:
        blocker = threading.Thread(target=send, args=("blocker", high, {"prompt": "block", "max_tokens": 600}))
        blocker.start()
        assert proc.wait_for_metric("tokenloom:num_requests_running", lambda v: v == 1, headers=high) == 1
        sneaky = threading.Thread(
            target=send, args=("low", low, {"prompt": "me first", "max_tokens": 64, "priority": -1000})
        )
        sneaky.start()
        assert proc.wait_for_metric("tokenloom:num_requests_waiting", lambda v: v == 1, headers=high) == 1
        honest = threading.Thread(target=send, args=("high", high, {"prompt": "my turn", "max_tokens": 4}))
        honest.start()
        for thread in (blocker, sneaky, honest):
            thread.join(timeout=120)
        # Had -1000 counted, "low" would have displaced the blocker, or at least gone before "high". The blocker
        # and "high" finish a few steps apart, so the order their client threads return in is left open.
        assert sorted(finished) == ["blocker", "high", "low"]
        assert finished[-1] == "low"
    finally:
        proc.stop()


# ---- 6, 8, 9. client errors are 400/404/405 in OpenAI's shape, and the connection stays usable ------------------


BAD_COMPLETIONS = [
    ({"prompt": "\ud800"}, "prompt"),
    ({"prompt": ["ok", "\udfff"]}, "prompt"),
    ({"prompt": "hi", "stop": "\ud800"}, "stop"),
    ({"prompt": "hi", "response_format": "json"}, "response_format"),
    ({"prompt": "hi", "response_format": ["text"]}, "response_format"),
    ({"prompt": "hi", "max_tokens": "10"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": [[False]]}, "prompt"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "logprobs": "yes"}, "logprobs"),
    ({"prompt": "hi", "temperature": 1e9}, "temperature"),
    ({"prompt": "hi", "seed": 1.5}, "seed"),
    ({"prompt": "hi", "priority": 2**40}, "priority"),
]
BAD_MESSAGES = [
    [{"role": "user", "content": "\ud800"}],
    [{"role": "\ud800", "content": "hi"}],
    [{"role": "wizard", "content": "hi"}],
    [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    [{"role": "user", "content": [{"type": "text", "text": None}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
]


def test_bad_fields_get_openai_400s_on_a_live_connection(server):
    with httpx.Client(base_url=server.url, headers=OPEN, timeout=60) as client:
        for body, param in BAD_COMPLETIONS:
            assert_openai_error(send_json(client, "/v1/completions", {"model": "tiny", **body}), 400, param=param)
        for messages in BAD_MESSAGES:
            assert_openai_error(
                send_json(client, "/v1/chat/completions", {"messages": messages}), 400, param="messages"
            )
        # Python's json writes Infinity for float("inf"); a client can send it.
        infinite = b'{"prompt": "hi", "temperature": Infinity, "repetition_penalty": Infinity}'
        response = client.post("/v1/completions", content=infinite, headers={"Content-Type": "application/json"})
        assert_openai_error(response, 400, "invalid_value")
        # Still the same keep-alive connection, still serving.
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_unknown_model_is_404(server):
    response = post(server, "/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert_openai_error(response, 404, "model_not_found", "model")
    assert response.json()["error"]["type"] == "not_found_error"


def test_unparseable_bodies_and_unknown_routes_are_openai_errors(server):
    json_headers = {**OPEN, "Content-Type": "application/json"}
    url = f"{server.url}/v1/completions"
    assert_openai_error(httpx.post(url, content=b'{"prompt": "\xff\xfe"}', headers=json_headers), 400)
    deep = b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    assert_openai_error(httpx.post(url, content=deep, headers=json_headers), 400)
    assert_openai_error(httpx.post(url, content=b"{not json", headers=json_headers), 400, "invalid_json")
    assert_openai_error(httpx.post(url, content=b"[1, 2]", headers=json_headers), 400)
    assert_openai_error(httpx.delete(url, headers=OPEN), 405, "method_not_allowed")
    assert_openai_error(httpx.get(f"{server.url}/v1/nothing-here", headers=OPEN), 404, "not_found")
    assert_openai_error(httpx.get(f"{server.url}/v1/models"), 401, "invalid_api_key")


# ---- 7. a streaming request that times out in the queue gets its 503 before any 200 ------------------------------


def test_streaming_queue_timeout_is_a_503_not_a_200(tiny_chat_model):
    proc = ServerProcess("--model", str(tiny_chat_model), "--max-num-seqs", "1", "--queue-timeout", "0.2")
    url = f"{proc.url}/v1/completions"
    try:
        blocker = HeldRequest(url, {"prompt": "long", "max_tokens": 600, "ignore_eos": True})
        assert proc.wait_for_metric("tokenloom:num_requests_running", lambda v: v == 1) == 1
        for path, payload in (
            ("/v1/completions", {"prompt": "short", "max_tokens": 2, "stream": True}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
        ):
            with httpx.stream("POST", f"{proc.url}{path}", json=payload, timeout=60) as response:
                response.read()
            assert_openai_error(response, 503, "queue_timeout")
        blocker.release()
        assert proc.wait_for_metric("tokenloom:kv_cache_usage_perc", lambda v: v == 0) == 0
    finally:
        proc.stop()


# ---- 10. Retry-After, drain timeout, OpenAPI, idle and slow connections -----------------------------------------


def test_drain_timeout_ends_streams_with_an_error_event(tiny_chat_model):
    """Each API's own: the error body and [DONE] for completions, an `error` event, numbered on, for responses."""
    proc = ServerProcess("--model", str(tiny_chat_model), "--drain-timeout", "1")
    try:
        body = {"prompt": "Never done", "max_tokens": 1800, "ignore_eos": True, "stream": True}
        asked = {"input": "Never done", "max_output_tokens": 1800, "stream": True}
        with (
            httpx.stream("POST", f"{proc.url}/v1/completions", json=body, timeout=120) as response,
            httpx.stream("POST", f"{proc.url}/v1/responses", json=asked, timeout=120) as responses,
        ):
            lines, events = response.iter_lines(), responses.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert next(line for line in events if line.startswith("data:"))
            proc.process.send_signal(15)
            rest = [line for line in lines if line.startswith("data:")]
            event_rest = [json.loads(line[5:]) for line in events if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][5:])["error"]
        assert error["code"] == "server_shutdown" and error["type"] == "server_error"
        last = event_rest[-1]
        assert last["type"] == "error" and last["code"] == "server_shutdown"
        assert last["sequence_number"] == event_rest[-2]["sequence_number"] + 1
        assert proc.process.wait(timeout=60) == 0
    finally:
        proc.stop()


def test_openapi_documents_400_not_422_and_metrics_as_text(server):
    schema = httpx.get(f"{server.url}/openapi.json", headers=OPEN).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses and {"400", "401", "404", "413", "429", "503"} <= set(responses)
    assert list(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False


def test_idle_and_slowloris_connections_are_closed(server):
    host, port = "127.0.0.1", server.port
    with socket.create_connection((host, port)) as idle:
        assert _closed_within(idle, HEADER_TIMEOUT_S + 5)
    with socket.create_connection((host, port)) as slow:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        closed = False
        deadline = time.monotonic() + HEADER_TIMEOUT_S + 5
        while not closed and time.monotonic() < deadline:
            try:
                slow.sendall(b"X-a: b\r\n")
            except OSError:
                closed = True
                break
            closed = _closed_within(slow, 0.3)
        assert closed
    # A well-behaved client on a fresh connection is served.
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def _raw_exchange(port: int, request: bytes, timeout: float = 10.0) -> bytes:
    """Sends the bytes as they are and reads until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        return response_until_closed(sock)


def _status_and_error(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"]


COMPLETION = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 2}).encode()


def test_a_request_with_both_content_length_and_transfer_encoding_is_refused(server):
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(COMPLETION), COMPLETION)
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-open\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n%s"
    ) % (len(COMPLETION), chunked)
    status, error = _status_and_error(_raw_exchange(server.port, request))
    assert status == 400 and error["code"] == "ambiguous_framing", error
    # Each framing alone is served.
    framings = ((b"Content-Length: %d" % len(COMPLETION), COMPLETION), (b"Transfer-Encoding: chunked", chunked))
    for framing, body in framings:
        alone = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-open\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\n%s\r\n\r\n%s"
        ) % (framing, body)
        assert _raw_exchange(server.port, alone).startswith(b"HTTP/1.1 200"), framing


# A whole body of 90 KB, not JSON: read whole it is a 400, refused for the budget a 429.
WHOLE_90KB = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
              b"Content-Length: 90000\r\n\r\n" + b"x" * 90_000)  # fmt: skip


def test_bodies_in_flight_are_bounded_and_a_stalled_body_times_out(tiny_chat_model):
    """Two connections each send 90 KB of a 100 KB body and stall (180 KB held of 250): a third whose body would take
    the bytes in flight past 250 KB gets 429 at once and its connection closed, while a small request is served
    beside them; at the body timeout the stalled ones get 408 and their bytes come back, so a body of that size is
    read again. Before the budget, a thousand such connections held ~0.8 MB of server memory each."""
    limits = ("--max-body-bytes", "100000", "--max-inflight-body-bytes", "250000", "--body-timeout", "2")
    with ServerProcess(str(tiny_chat_model), "--served-model-name", "tiny", *limits) as proc:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                b"Content-Length: 100000\r\n\r\n")  # fmt: skip
        stalled = StalledBodies(proc.port, head + b"x" * 90_000, count=2)

        # A whole 90 KB body is read (400: not JSON) until the server holds both stalled ones, then refused at once.
        def probe() -> tuple[int, dict]:
            stalled.replace_answered()  # a stalled part the probe overtook was refused: sent again
            return _status_and_error(_raw_exchange(proc.port, WHOLE_90KB))

        status, error = poll_until(probe, lambda reply: reply[0] == 429, timeout=10)
        assert status == 429 and error["code"] == "server_busy", error
        small = httpx.post(f"{proc.url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        assert small.status_code == 200
        for response in stalled.responses():
            status, error = _status_and_error(response)
            assert status == 408 and error["code"] == "body_timeout", error
        status, error = _status_and_error(_raw_exchange(proc.port, head + b"x" * 100_000))
        assert status == 400 and error["code"] == "invalid_json", error  # read whole: not JSON
        replaced = stalled.replaced_statuses
        assert proc.metric('tokenloom:requests_rejected_total{reason="server_busy"}') == 1 + replaced.count(429)
        assert proc.metric('tokenloom:requests_rejected_total{reason="body_timeout"}') == 2 + replaced.count(408)


@pytest.mark.parametrize(
    "headers",
    [
        [(b"X-Big", b"a" * 100_000)],  # 100 KB in one header, sent whole
        [(b"X-Many-%d" % i, b"v") for i in range(1000)],  # 1,000 small headers, 11 KB
        [(b"X-Huge", b"b" * 1_000_000)],  # 1 MB: the client is still sending when the server decides
    ],
    ids=["100KB", "1000-headers", "1MB"],
)
def test_oversize_headers_get_431_with_an_error_body(server, headers):
    lines = b"".join(b"%s: %s\r\n" % pair for pair in headers)
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-open\r\n" + lines + b"\r\n"
    status, error = _status_and_error(_raw_exchange(server.port, request))
    assert status == 431 and error["code"] == "request_header_fields_too_large", error
    assert httpx.get(f"{server.url}/v1/models", headers=OPEN, timeout=10).status_code == 200


def test_a_concurrency_cap_counts_sequences_not_requests(server):
    """A cap of 2: n=128 (or 3 prompts) can never fit, a 400 at once; n=2 fits."""
    plain = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    over = post(server, "/v1/completions", {**plain, "n": 128}, PAIR)
    assert_openai_error(over, 400, "concurrency_over_cap", "n")
    assert_openai_error(post(server, "/v1/completions", {**plain, "prompt": ["a", "b", "c"]}, PAIR), 400)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 3}
    assert_openai_error(post(server, "/v1/chat/completions", chat, PAIR), 400, "concurrency_over_cap")
    assert len(post(server, "/v1/completions", {**plain, "n": 2}, PAIR).json()["choices"]) == 2
    assert post(server, "/v1/completions", {**plain, "n": 2}, PAIR).status_code == 200  # both slots came back


def test_the_limiter_holds_a_slot_per_sequence_until_released():
    pair = Tenant(name="pair", keys=("k",), max_concurrent_requests=2)
    limiter = TenantLimiter()
    limiter.acquire(pair, tokens=10, sequences=2)
    with pytest.raises(APIError) as refused:
        limiter.acquire(pair, tokens=10, sequences=1)
    assert refused.value.status == 429 and refused.value.code == "concurrency_limit"
    limiter.release(pair, sequences=2)
    limiter.acquire(pair, tokens=10, sequences=1)
    limiter.acquire(pair, tokens=10, sequences=1)
    with pytest.raises(APIError):
        limiter.acquire(pair, tokens=10, sequences=1)


def test_a_tenant_reads_only_its_own_labels_in_metrics_and_the_operator_reads_all(server):
    over_cap = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 50}, CAPPED)
    assert_openai_error(over_cap, 400, "max_tokens_over_cap")
    assert 'tenant="capped"' in httpx.get(f"{server.url}/metrics", headers=OPERATOR, timeout=10).text
    assert 'tenant="capped"' in httpx.get(f"{server.url}/metrics", headers=CAPPED, timeout=10).text
    seen_by_other = httpx.get(f"{server.url}/metrics", headers=OPEN, timeout=10).text
    assert "capped" not in seen_by_other and "tokenloom:generation_tokens_total" in seen_by_other


def test_internal_source_paths_stay_out_of_error_bodies(server):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "guided_regex": "(unclosed"}
    refused = post(server, "/v1/completions", body)
    assert_openai_error(refused, 400, "invalid_value")
    message = refused.json()["error"]["message"]
    assert "invalid regex" in message and ".cc:" not in message and "/cpp/" not in message, message


def test_the_access_log_leaves_query_strings_out(tiny_chat_model):
    proc = ServerProcess("--model", str(tiny_chat_model), log_level="info")
    try:
        assert httpx.get(f"{proc.url}/v1/models?api_key=sk-secret-in-a-url", timeout=10).status_code == 200
        assert proc.terminate() == 0
        log = proc.process.stdout.read().decode()
    finally:
        proc.stop()
    assert "GET /v1/models HTTP/1.1" in log and "sk-secret-in-a-url" not in log, log[-2000:]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_fields_are_refused_and_openais_ignorable_ones_accepted(server, path):
    base = {"model": "tiny", "max_tokens": 2}
    base |= {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    unknown = post(server, path, {**base, "temprature": 0.5})
    assert_openai_error(unknown, 400, "unknown_field", "temprature")
    assert "Unrecognized request argument supplied: temprature" in unknown.json()["error"]["message"]
    ignorable = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}
    assert post(server, path, {**base, **ignorable}).status_code == 200
    functions = post(server, path, {**base, "functions": [{"name": "f", "parameters": {}}]})
    assert_openai_error(functions, 400, "unsupported", "functions")


def test_stop_checks_name_the_real_limit(server):
    out_of_vocab = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop_token_ids": [10**6]})
    assert_openai_error(out_of_vocab, 400, "invalid_value", "stop_token_ids")
    many = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": ["x"] * 1000})
    assert_openai_error(many, 400, "invalid_value", "stop")
    assert "64" in many.json()["error"]["message"] and "valid string" not in many.json()["error"]["message"]
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": ["x"] * 64}).status_code == 200


@pytest.mark.parametrize(
    "bias",
    [{"1000000": 1}, {"abc": 1}, {"-3": 1}, {"5": 100.5}, {"5": -101}, {str(t): 1 for t in range(301)}],
    ids=["out of the vocabulary", "not a token id", "negative", "over 100", "under -100", "301 tokens"],
)
def test_a_bad_logit_bias_is_a_400_naming_it(server, bias):
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": bias})
    assert_openai_error(response, 400, "invalid_value", "logit_bias")


@pytest.mark.parametrize("allowed", [[10**6], []], ids=["out of the vocabulary", "empty"])
def test_bad_allowed_token_ids_are_a_400_naming_them(server, allowed):
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "allowed_token_ids": allowed})
    assert_openai_error(response, 400, "invalid_value", "allowed_token_ids")


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_of_tokens_a_grammar_rules_out_are_shown_as_vllm_shows_them(server, stream):
    """A grammar that allows only the end of the text leaves every alternative at -inf, which JSON cannot carry (it
    was a 500): shown as -9999.0, vLLM's floor."""
    body = {"prompt": "00000000", "max_tokens": 3, "logprobs": 2, "structured_outputs": {"regex": ""}, "stream": stream}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    logprobs = [c["choices"][0]["logprobs"] for c in chunks] if stream else [response.json()["choices"][0]["logprobs"]]
    values = [v for lp in logprobs if lp for top in lp["top_logprobs"] for v in top.values()]
    assert values and min(values) == -9999.0


def test_the_choices_of_an_n_stream_are_read_no_further_ahead_of_a_client_that_waits_than_a_few_chunks():
    """With n > 1 every choice's chunks pass through one queue to the client; while the client reads nothing, each
    choice's stream is read at most a chunk or two ahead (the rest stays in the engine's stream, which keeps only its
    latest output), never one per step."""
    import asyncio

    from tokenloom.server.response_models import CompletionStreamChoice
    from tokenloom.server.streaming import _merged

    pulled = [0, 0]

    class Shape:
        token_ids = False  # no ids asked for: the chunks as the shape makes them

        async def chunks(self, stream, logprobs):
            async for item in stream:
                yield CompletionStreamChoice(index=0, text=str(item), logprobs=None, finish_reason=None), item

    async def steps(index: int):
        for step in range(1000):
            pulled[index] += 1
            yield step

    async def main() -> list[int]:
        merged = _merged(Shape(), [steps(0), steps(1)], False)
        first = await anext(merged)
        await asyncio.sleep(0.2)  # the client reads nothing for a while
        seen_while_waiting = list(pulled)
        rest = [item async for item in merged]
        assert len(rest) + 1 == 2000 and first[0] in (0, 1)
        return seen_while_waiting

    waiting = asyncio.run(main())
    # The chunk read, the queue's two places, one chunk held by each choice waiting to put it: 5 at most.
    assert sum(waiting) <= 5, waiting
