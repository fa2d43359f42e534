"""LoRA adapters through the HTTP API, as vLLM serves them: named by --lora-modules, listed by /v1/models, chosen by
a request's model, loaded and unloaded at run time; each request's tokens are transformers' with its adapter merged."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest
from lora_files import greedy_reference, merged_oracle, write_adapter
from server_process import HeldRequest, ServerProcess, poll_until

from tokenloom.cli import main

TOKENS = 8


@pytest.fixture(scope="module")
def adapter_dirs(tiny_chat_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("served-adapters")
    return {
        "sql": write_adapter(root / "sql", tiny_chat_model, seed=11),
        "chat": write_adapter(root / "chat", tiny_chat_model, seed=12, targets=("q_proj", "v_proj"), rank=4),
        "late": write_adapter(root / "late", tiny_chat_model, seed=13, targets=("down_proj",)),
        "too-big": write_adapter(root / "too-big", tiny_chat_model, seed=14, rank=16),
    }


OPERATOR, TENANT = "operator-key", "tenant-key"


@pytest.fixture(scope="module")
def server(tiny_chat_model, adapter_dirs, tmp_path_factory):
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    tenants.write_text(f'[[tenant]]\nname = "team"\nkeys = ["{TENANT}"]\n')
    chat = json.dumps({"name": "chat", "path": str(adapter_dirs["chat"]), "base_model_name": "tiny"})
    args = ("--model", str(tiny_chat_model), "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2",
            "--max-lora-rank", "8", "--lora-modules", f"sql={adapter_dirs['sql']}", chat, "--api-key", OPERATOR,
            "--tenants", str(tenants))  # fmt: skip
    with ServerProcess(*args, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as proc:
        yield proc


def client_of(server, key: str = OPERATOR) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key)


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(1, 500) for _ in range(rng.randint(4, 30))] for _ in range(n)]


def completion_ids(client: openai.OpenAI, model: str, prompt: list[int]) -> tuple[list[int], str]:
    response = client.completions.create(
        model=model, prompt=prompt, max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True,
                                                                                  "return_token_ids": True},
    )  # fmt: skip
    return response.choices[0].token_ids, response.model  # type: ignore[attr-defined]


def test_models_lists_each_adapter_with_its_base_as_parent(server, tiny_chat_model, adapter_dirs):
    client = client_of(server)
    cards = {card.id: card for card in client.models.list()}
    assert {"tiny", "sql", "chat"} <= set(cards)
    assert cards["sql"].parent == "tiny" and cards["sql"].root == str(adapter_dirs["sql"])  # type: ignore[attr-defined]
    assert cards["chat"].parent == "tiny" and cards["tiny"].parent is None  # type: ignore[attr-defined]


def test_each_request_runs_under_the_adapter_it_names_concurrently(server, tiny_chat_model, adapter_dirs):
    """The base model and both adapters, requested together from threads: each gets its own oracle's tokens."""
    from concurrent.futures import ThreadPoolExecutor

    client = client_of(server)
    tenant = client_of(server, TENANT)  # a tenant's requests name adapters as the operator's do
    jobs = [(model, p) for p in prompts(3) for model in ("tiny", "sql", "chat")]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: completion_ids(tenant if job[1] == jobs[0][1] else client, *job), jobs))
    oracles = {name: merged_oracle(tiny_chat_model, adapter_dirs.get(name)) for name in ("tiny", "sql", "chat")}
    for (model, prompt), (ids, named) in zip(jobs, results, strict=True):
        assert named == model
        assert ids == greedy_reference(oracles[model], prompt, TOKENS)
    assert results[0][0] != results[1][0], "the adapter changed the tokens"


def test_chat_streams_under_an_adapter_and_an_unknown_model_is_404(server):
    client = client_of(server)
    stream = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    chunks = list(stream)
    assert chunks and all(chunk.model == "chat" for chunk in chunks)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)


def test_adapters_load_and_unload_at_run_time(server, tiny_chat_model, adapter_dirs):
    client = client_of(server)

    def post(path: str, body: dict, key: str = OPERATOR) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)

    refused = post("load_lora_adapter", {"lora_name": "late", "lora_path": str(adapter_dirs["late"])}, key=TENANT)
    assert refused.status_code == 403 and "operator" in refused.json()["error"]["message"]

    loaded = post("load_lora_adapter", {"lora_name": "late", "lora_path": str(adapter_dirs["late"])})
    assert loaded.status_code == 200 and "late" in loaded.text
    assert "late" in {card.id for card in client.models.list()}
    prompt = prompts(1)[0]
    assert completion_ids(client, "late", prompt)[0] == greedy_reference(
        merged_oracle(tiny_chat_model, adapter_dirs["late"]), prompt, TOKENS
    )
    again = post("load_lora_adapter", {"lora_name": "late", "lora_path": str(adapter_dirs["late"])})
    assert again.status_code == 400 and "already served" in again.json()["error"]["message"]
    too_big = post("load_lora_adapter", {"lora_name": "big", "lora_path": str(adapter_dirs["too-big"])})
    assert too_big.status_code == 400 and "max_lora_rank=8" in too_big.json()["error"]["message"]
    missing = post("load_lora_adapter", {"lora_name": "nowhere", "lora_path": "/nonexistent"})
    assert missing.status_code == 400 and "cannot read" in missing.json()["error"]["message"]
    assert post("unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        completion_ids(client, "late", prompt)
    assert post("unload_lora_adapter", {"lora_name": "sql"}, key=TENANT).status_code == 403
    assert post("unload_lora_adapter", {"lora_name": "late"}).status_code == 404


def test_runtime_loading_is_off_unless_vllms_switch_is_set(tiny_chat_model, adapter_dirs):
    with ServerProcess("--model", str(tiny_chat_model), "--enable-lora", "--max-lora-rank", "8") as proc:
        body = {"lora_name": "late", "lora_path": str(adapter_dirs["late"])}
        response = httpx.post(f"{proc.url}/v1/load_lora_adapter", json=body, timeout=30)
        assert response.status_code == 404 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "a"], "give name=path"),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], "JSON needs a name and a path"),
        (["--enable-lora", "--lora-modules", "a=/nonexistent"], "cannot read the LoRA adapter's config"),
    ],
)
def test_bad_lora_modules_stop_the_server_at_start_with_the_reason(tiny_chat_model, capsys, flags, words):
    assert main(["serve", str(tiny_chat_model), *flags]) == 2
    assert words in capsys.readouterr().err


def test_metrics_name_the_adapters_of_running_requests(server):
    """vLLM's lora_requests_info: one sample, its labels the adapters now."""
    headers = {"Authorization": f"Bearer {OPERATOR}"}

    def samples() -> list[str]:
        text = httpx.get(f"{server.url}/metrics", headers=headers, timeout=10).text
        return [line for line in text.splitlines() if line.startswith("tokenloom:lora_requests_info{")]

    body = {"model": "sql", "prompt": "hello", "max_tokens": 2000, "ignore_eos": True}
    held = HeldRequest(f"{server.url}/v1/completions", body, headers)
    try:
        running = poll_until(samples, lambda found: any('running_lora_adapters="sql"' in s for s in found))
        assert len(running) == 1 and 'running_lora_adapters="sql"' in running[0] and 'max_lora="2"' in running[0]
    finally:
        held.release()
    idle = poll_until(samples, lambda found: any('running_lora_adapters=""' in s for s in found))
    assert len(idle) == 1 and 'running_lora_adapters=""' in idle[0]


def test_behind_ray_each_replica_refuses_a_runtime_load(tiny_chat_model, adapter_dirs, monkeypatch):
    """A Ray Serve replica is a whole server: a load it took alone would leave the other replicas without it."""
    import asyncio

    from tokenloom.config import EngineConfig
    from tokenloom.server import launch
    from tokenloom.server_config import ServerConfig

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    monkeypatch.delenv("TOKENLOOM_API_KEY", raising=False)
    engine_config = EngineConfig.from_kwargs(model=str(tiny_chat_model), enable_lora=True, max_lora_rank=8)
    app, _ = launch.build_server(ServerConfig(), engine_config, replica_id="replica-0")

    async def load() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            body = {"lora_name": "late", "lora_path": str(adapter_dirs["late"])}
            return await client.post("/v1/load_lora_adapter", json=body, timeout=30)

    response = asyncio.run(load())
    assert response.status_code == 400 and "--ray" in response.json()["error"]["message"]


def test_bench_serve_names_the_adapters_in_its_requests(server, tmp_path):
    """`tokenloom bench serve --lora-modules`: each request names one of them (as `vllm bench serve` does); a name the
    server does not serve fails every request, so the names are what is sent."""
    from tokenloom.bench.loadgen import adapter_choice
    from tokenloom.bench.trace import make_trace

    requests = make_trace("chat", 40, seed=0)
    choose = adapter_choice(["sql", "chat"], seed=3)
    assert [choose(r) for r in requests] == [adapter_choice(["sql", "chat"], seed=3)(r) for r in requests]
    assert {choose(r) for r in requests} == {"sql", "chat"}

    def bench(*names: str) -> dict:
        out = tmp_path / f"{'-'.join(names)}.json"
        argv = ["bench", "serve", "--base-url", server.url, "--api-key", OPERATOR, "--kind", "chat", "--num-requests",
                "4", "--max-tokens", "4", "--lora-modules", *names, "-o", str(out)]  # fmt: skip
        assert main(argv) == 0
        return json.loads(out.read_text())["scorecard"]

    assert bench("sql", "chat")["error_rate"] == 0
    assert bench("no-such-adapter")["error_rate"] == 1
