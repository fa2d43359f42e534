"""Who shares cached prefix blocks on a served engine: a request's cache_salt (vLLM's) and a tenant's
isolate_prefix_cache decide it, and the usage's cached_tokens show it."""

from __future__ import annotations

import httpx
from server_process import ServerProcess

TENANTS = """
[[tenant]]
name = "alice"
keys = ["sk-alice"]
isolate_prefix_cache = true

[[tenant]]
name = "bob"
keys = ["sk-bob"]

[[tenant]]
name = "carol"
keys = ["sk-carol"]
"""
PROMPT = "The quick brown fox jumps over the lazy dog. " * 8  # a few full blocks


def test_salts_and_isolated_tenants_share_no_blocks_with_others(tmp_path, tiny_chat_model):
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    proc = ServerProcess("--model", str(tiny_chat_model), "--tenants", str(path), "--enable-prompt-tokens-details")
    try:

        def cached(who: str, endpoint: str = "completions", **extra) -> int:
            chat = endpoint == "chat/completions"
            body = {"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT}
            reply = httpx.post(f"{proc.url}/v1/{endpoint}", json={**body, "max_tokens": 2, **extra},
                               headers={"Authorization": f"Bearer sk-{who}"}, timeout=60)  # fmt: skip
            assert reply.status_code == 200, reply.text
            return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached("alice") == 0
        assert cached("bob") == 0  # alice's blocks are hers alone
        assert cached("alice") > 0 and cached("bob") > 0 and cached("carol") > 0  # bob and carol share theirs
        assert cached("carol", cache_salt="s3cret") == 0
        assert cached("carol", cache_salt="s3cret") > 0 and cached("bob", cache_salt="s3cret") > 0
        assert cached("alice", cache_salt="s3cret") == 0  # an isolated tenant's salt is hers, whatever she sends
        assert cached("bob", "chat/completions", cache_salt="chat") == 0
        assert cached("bob", "chat/completions", cache_salt="chat") > 0
        response = {"input": PROMPT, "max_output_tokens": 2, "cache_salt": "r"}
        as_bob = {"headers": {"Authorization": "Bearer sk-bob"}, "timeout": 60}
        responses = [httpx.post(f"{proc.url}/v1/responses", json=response, **as_bob).json() for _ in "ab"]
        assert [r["usage"]["input_tokens_details"]["cached_tokens"] > 0 for r in responses] == [False, True]
        refused = httpx.post(f"{proc.url}/v1/completions", json={"prompt": PROMPT, "cache_salt": ""}, **as_bob)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_salt"
    finally:
        proc.stop()
