"""Two tokenloom replicas on a local Ray Serve started by the test: every request answered through Ray's proxy,
both replicas used, and the prefix-aware router keeping more prefix-cache hits than Ray's default router on a
trace of shared prefixes. The router's choice and the metrics merge are also checked without Ray."""

from __future__ import annotations

import json
import logging
import random
import socket

import httpx
import openai
import pytest
from server_process import StalledBodies, poll_until, response_until_closed, status_of

from tokenloom.config import EngineConfig
from tokenloom.replicas.ray_serve import APP_NAME, build_ray_app, merge_expositions, start_ray
from tokenloom.replicas.routing import (
    PREFIX_CHARS,
    prefix_key,
    rendezvous_order,
    replica_keeping,
    replica_named_in_path,
)
from tokenloom.server_config import ServerConfig

WORDS = ["river", "stone", "maple", "copper", "lantern", "meadow", "harbor", "velvet", "orbit", "willow", "amber"]


def document(seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(120))  # ~800 characters: well past the routing key


def trace(num_documents: int = 12, questions: int = 3) -> list[str]:
    """Each document asked several questions, the documents interleaved as agents' turns are."""
    return [f"{document(d)}\nQuestion {q}: what is word {q}?" for q in range(questions) for d in range(num_documents)]


def test_the_key_is_the_prompts_leading_text_and_picks_a_stable_replica():
    body = lambda **fields: {"body": json.dumps(fields).encode()}  # noqa: E731
    long = "x" * 1000
    assert prefix_key(body(prompt=long + "a")) == prefix_key(body(prompt=long + "b")) == "x" * PREFIX_CHARS
    assert prefix_key(body(prompt=["first", "second"])) == "first"
    chat = prefix_key(body(messages=[{"role": "system", "content": long}, {"role": "user", "content": "hi"}]))
    assert chat is not None and chat.startswith("system:xxx") and len(chat) == PREFIX_CHARS
    # A Responses API request's instructions are its system message: the same conversation, the same key.
    assert prefix_key(body(instructions=long, input="hi")) == chat
    assert prefix_key(body(input=[{"role": "system", "content": long}, {"role": "user", "content": "hi"}])) == chat
    # A salt (vLLM's cache_salt) shares blocks only with its own: it leads the key.
    assert prefix_key(body(prompt=long, cache_salt="t1")) == "t1\0" + "x" * PREFIX_CHARS
    assert prefix_key(body(prompt=long, cache_salt="t1")) != prefix_key(body(prompt=long, cache_salt="t2"))
    # A request that continues a kept response goes to the replica named in its id, whatever its key.
    continuing = json.loads(body(previous_response_id="resp_b2_0f3a", input="hi")["body"])
    assert replica_keeping(continuing, ["a1", "b2"]) == "b2" and replica_keeping(continuing, ["a1"]) is None
    assert replica_keeping({"previous_response_id": 7}, ["a1"]) is None and replica_keeping({}, ["a1"]) is None
    # So does one whose path names a kept response: read, listed, cancelled or deleted.
    for path in (
        "/v1/responses/resp_b2_0f3a",
        "/v1/responses/resp_b2_0f3a/input_items",
        "/v1/responses/resp_b2_0f3a/cancel",
    ):
        assert replica_named_in_path({"path": path}, ["a1", "b2"]) == "b2"
    assert replica_named_in_path({"path": "/v1/responses/resp_0f3a"}, ["a1", "b2"]) is None  # a single server's id
    assert replica_named_in_path({"path": "/v1/models"}, ["a1"]) is None and replica_named_in_path({}, ["a1"]) is None
    assert prefix_key({"body": b""}) is None and prefix_key({"body": b"[1]"}) is None
    # Embedding inputs (texts or token lists) and rerank or score bodies carry no prompt: routed by load alone.
    assert prefix_key(body(input=["one text", "another"])) is None and prefix_key(body(input=[[1, 2, 3]])) is None
    assert prefix_key(body(query="q", documents=["d"])) is None and prefix_key(body(text_1="a", text_2="b")) is None
    replicas = ["a1", "b2", "c3"]
    first = rendezvous_order("some prefix", replicas)[0]
    assert all(rendezvous_order("some prefix", replicas)[0] == first for _ in range(3))
    # Removing another replica never moves a key: the property that keeps caches warm while scaling.
    other = next(r for r in replicas if r != first)
    assert rendezvous_order("some prefix", [r for r in replicas if r != other])[0] == first
    spread = {rendezvous_order(f"prefix {i}", replicas)[0] for i in range(30)}
    assert spread == set(replicas)


def test_merged_metrics_keep_every_replicas_samples_under_one_family():
    from prometheus_client.parser import text_string_to_metric_families

    text = (
        "# HELP tokenloom:prefix_cache_hits_total Hits.\n# TYPE tokenloom:prefix_cache_hits_total counter\n"
        'tokenloom:prefix_cache_hits_total{{model_name="m",replica="{r}"}} {v}\n'
        "# HELP process_cpu_seconds_total CPU.\n# TYPE process_cpu_seconds_total counter\n"
        "process_cpu_seconds_total {v}\n"
    )
    merged = merge_expositions({"r1": text.format(r="r1", v=3), "r2": text.format(r="r2", v=5)})
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    hits = {s.labels["replica"]: s.value for s in families["tokenloom:prefix_cache_hits"].samples}
    cpu = {s.labels["replica"]: s.value for s in families["process_cpu_seconds"].samples}
    assert hits == {"r1": 3.0, "r2": 5.0} and cpu == {"r1": 3.0, "r2": 5.0}
    assert merged.count("# TYPE tokenloom:prefix_cache_hits_total counter") == 1


def test_serve_run_arguments_are_serves_flags_and_zero_replicas_autoscale():
    from tokenloom.ray import configs_from_serve_args
    from tokenloom.replicas.ray_serve import replica_options

    args = {"model": "/m", "num_replicas": "0", "max_replicas": "3", "dtype": "float32", "max_num_seqs": "8",
            "enable_prefix_caching": "false", "request_router": "power_of_two"}  # fmt: skip
    server, engine = configs_from_serve_args(args)
    assert server.ray and server.num_replicas == 0 and engine.model.model == "/m" and engine.scheduler.max_num_seqs == 8
    assert not engine.cache.enable_prefix_caching
    options = replica_options(server, engine)
    scaling = options["autoscaling_config"]
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (1, 3, 8)
    assert "num_replicas" not in options and options["max_ongoing_requests"] == 32
    assert options["request_router_config"].request_router_class.endswith("PowerOfTwoChoicesRequestRouter")
    fixed = replica_options(*configs_from_serve_args({"num_replicas": "2", "num_threads": "3"}))
    assert fixed["num_replicas"] == 2 and fixed["ray_actor_options"] == {"num_cpus": 3}
    assert fixed["request_router_config"].request_router_class.endswith("PrefixAwareRouter")
    with pytest.raises(ValueError, match="serve` flags"):
        configs_from_serve_args({"no_such_flag": "1"})


@pytest.fixture(scope="module")
def ray_port():
    import ray
    from ray import serve

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20, logging_level=logging.WARNING)
    try:
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(model, port: int, router: str, body_timeout: float = 3.0, inflight: int = 250_000) -> str:
    from ray import serve

    server = ServerConfig(
        port=port, ray=True, num_replicas=2, request_router=router, served_model_name="tiny", log_level="warning",
        max_body_bytes=100_000, max_inflight_body_bytes=inflight, body_timeout=body_timeout,
    )  # fmt: skip
    engine = EngineConfig.from_kwargs(model=str(model), dtype="float32", max_num_seqs=8, block_size=16)
    start_ray(server)
    serve.run(build_ray_app(server, engine), name=APP_NAME, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    ready = poll_until(lambda: _status(f"{url}/ready"), lambda status: status == 200, timeout=120)
    assert ready == 200
    return url


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0


def replica_counters(url: str) -> dict[str, dict[str, float]]:
    """Per replica: prompt tokens, prefix-cache queries and hits, from the ingress's merged /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {"tokenloom:prompt_tokens", "tokenloom:prefix_cache_queries", "tokenloom:prefix_cache_hits"}
    counters: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        if family.name in wanted:
            for sample in family.samples:
                counters.setdefault(sample.labels["replica"], {})[family.name.split(":")[1]] = sample.value
    return counters


def run_trace(url: str) -> dict[str, dict[str, float]]:
    """Sends the trace; returns the replicas' counters once they count every prompt token the replies reported
    (replicas push their metrics once a second; the replicas of an earlier deployment drop out within 5 s)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    prompt_tokens = 0
    for prompt in trace():
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
        assert reply.choices[0].finish_reason in ("length", "stop")
        prompt_tokens += reply.usage.prompt_tokens

    def counted(counters: dict[str, dict[str, float]]) -> float:
        return sum(c.get("prompt_tokens", 0) for c in counters.values())

    counters = poll_until(lambda: replica_counters(url), lambda c: counted(c) == prompt_tokens, timeout=30)
    assert counted(counters) == prompt_tokens, counters
    return counters


def hit_rate(counters: dict[str, dict[str, float]]) -> float:
    queries = sum(c.get("prefix_cache_queries", 0) for c in counters.values())
    return sum(c.get("prefix_cache_hits", 0) for c in counters.values()) / queries


def test_prefix_aware_routing_keeps_more_cache_hits_than_rays_default(tiny_chat_model, ray_port):
    url = deploy(tiny_chat_model, ray_port, "prefix")
    prefix = run_trace(url)
    stream = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60).completions.create(
        model="tiny", prompt="Hello", max_tokens=3, stream=True
    )
    assert sum(1 for chunk in stream if chunk.choices) >= 1  # streams pass through the proxy and the ingress
    # A conversation kept turn by turn (/v1/responses): each turn reaches the replica that keeps the one before.
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    previous, replicas = None, set(prefix)
    for turn in range(6):
        kept = client.responses.create(model="tiny", input=f"Turn {turn}.", previous_response_id=previous,
                                       max_output_tokens=2)  # fmt: skip
        assert any(kept.id.startswith(f"resp_{replica}_") for replica in replicas), kept.id
        previous = kept.id
    # Kept responses of many conversations (on both replicas) read back, and are deleted, wherever they are kept.
    ids = [client.responses.create(model="tiny", input=f"Topic {n}: {document(n)}", max_output_tokens=2).id
           for n in range(12)]  # fmt: skip
    assert all(any(i.startswith(f"resp_{replica}_") for i in ids) for replica in replicas), ids
    for response_id in ids:
        assert client.responses.retrieve(response_id).id == response_id
        assert client.responses.input_items.list(response_id).data
        client.responses.delete(response_id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response_id)
    background = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, background=True)
    polled = poll_until(
        lambda: client.responses.retrieve(background.id).status, lambda s: s in ("completed", "incomplete")
    )
    assert polled in ("completed", "incomplete")
    bad = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 0}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"  # the replica's own errors
    url = deploy(tiny_chat_model, ray_port, "power_of_two")
    default = run_trace(url)
    assert len(prefix) == 2 and all(c["prompt_tokens"] > 0 for c in prefix.values()), prefix  # both replicas used
    assert len(default) == 2
    rates = hit_rate(prefix), hit_rate(default)
    print(f"prefix-cache hit rate: prefix-aware {rates[0]:.1%}, power of two choices {rates[1]:.1%}")
    assert rates[0] > rates[1]


def replica_pids() -> list[int]:
    """The engine replicas' worker processes, by the title Ray gives them (ray::ServeReplica:...:EngineReplica)."""
    from pathlib import Path

    pids = []
    for entry in Path("/proc").iterdir():
        try:
            title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if title.startswith("ray::ServeReplica") and "EngineReplica" in title:
            pids.append(int(entry.name))
    return pids


def running_requests(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    families = [f for f in text_string_to_metric_families(text) if f.name == "tokenloom:num_requests_running"]
    return sum(sample.value for family in families for sample in family.samples)


def test_the_ingress_bounds_the_bodies_in_flight_and_the_time_they_take(tiny_chat_model, ray_port):
    """As a single server's guard: two stalled 40 KB bodies of a 100 KB budget, a third refused at once (429), a
    small request served beside them, the stalled ones 408 at the deadline. Each part sent is smaller than one read
    of the proxy's (64 KB), so the ingress counts a stalled body whole at once; and the deadline is long enough that
    a loaded machine sees the budget held before they expire (90 KB parts and a 3 s deadline once saw only 400s under
    the full suite). A probe that reaches the ingress before a stalled part refuses that part (CI once saw it): the
    part is sent again on a new connection."""
    url = deploy(tiny_chat_model, ray_port, "prefix", body_timeout=10.0, inflight=100_000)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: 100000\r\n\r\n")  # fmt: skip
    stalled = StalledBodies(ray_port, head + b"x" * 40_000, count=2)
    # A whole 40 KB body is read (a 400 from the replica: not JSON) until the ingress holds both stalled ones, then
    # refused at once.
    whole = head.replace(b"100000", b"40000") + b"x" * 40_000

    def probe() -> int:
        stalled.replace_answered()
        return _exchanged_status(ray_port, whole)

    assert poll_until(probe, lambda status: status == 429, timeout=15) == 429
    small = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert small.status_code == 200, small.text
    assert [status_of(response) for response in stalled.responses()] == [408, 408]


def _exchanged_status(port: int, request: bytes) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        return status_of(response_until_closed(sock))


def test_requests_in_flight_on_a_replica_that_dies_hear_why(tiny_chat_model, ray_port):
    import os
    import signal
    import threading

    url = deploy(tiny_chat_model, ray_port, "prefix")
    long = {"model": "tiny", "prompt": "Go on", "max_tokens": 2000, "ignore_eos": True}
    whole: dict[str, httpx.Response] = {}
    waiting = threading.Thread(
        target=lambda: whole.setdefault("r", httpx.post(f"{url}/v1/completions", json=long, timeout=120))
    )
    with httpx.stream("POST", f"{url}/v1/completions", json={**long, "stream": True}, timeout=120) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        waiting.start()
        running = poll_until(lambda: running_requests(url), lambda n: n >= 2, timeout=30)
        assert running >= 2  # both requests are on replicas now
        pids = replica_pids()
        assert len(pids) == 2
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data: ")]
    waiting.join(timeout=120)
    assert rest[-1] == "data: [DONE]", rest[-3:]
    error = json.loads(rest[-2][len("data: ") :])["error"]
    assert error["code"] == "engine_unavailable" and error["type"] == "server_error"
    refused = whole["r"]
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable", refused.text


def test_an_app_called_in_process_sends_no_further_ahead_of_its_caller_than_a_few_messages():
    """A replica's caller that reads slowly holds the app back: the app's `send` waits once a few messages are
    unread, instead of every chunk of a long stream piling up in the replica."""
    import asyncio

    from tokenloom.replicas.ray_serve import ASGI_MESSAGES_AHEAD, call_asgi

    sent = 0

    async def app(scope, receive, send) -> None:
        nonlocal sent
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(1000):
            sent += 1
            await send({"type": "http.response.body", "body": b"x", "more_body": i < 999})

    async def main() -> tuple[int, int]:
        request = {"method": "POST", "path": "/v1/completions", "headers": [], "body": b"{}"}
        messages = call_asgi(app, request)
        await anext(messages)  # the response's start; then the caller reads nothing for a while
        await asyncio.sleep(0.2)
        waiting = sent
        bodies = [message async for message in messages]
        return waiting, len(bodies)

    waiting, read = asyncio.run(main())
    assert waiting <= ASGI_MESSAGES_AHEAD + 2 and read == 1000
