"""Prefix-aware routing: a request goes to the replica most likely to hold its prompt's leading KV blocks.

Each replica's prefix cache holds the blocks of the prompts it served. Requests that share a leading stretch of
prompt (an agent's system prompt and tools, a RAG document) reuse those blocks only on the replica that computed
them, so the router sends them to the same one: the leading ``PREFIX_CHARS`` characters of the prompt (about the
first four 16-token blocks) pick a replica by rendezvous hashing (the replica with the highest hash of key and
replica id), which keeps the assignment stable as replicas come and go. That replica is the first choice; the
others follow, the least loaded first (outstanding tokens, as each replica reports them), so a full replica (at
``max_ongoing_requests``) sends the request on rather than queueing it. A request with no prompt (a GET) goes to
the least loaded.

The key is text, not tokens: the router runs in Ray's proxy and handles and should not tokenize; a prompt's
leading characters determine its leading tokens for the same chat template and tokenizer.

A request's ``cache_salt`` leads its key: its blocks are shared only with requests of the same salt.

A /v1/responses request that continues a kept response (``previous_response_id``), and one whose path names a
response (reading, cancelling or deleting it), goes to the replica that keeps it, named in the response's id
(responses_api_protocol.response_id_prefix), and to no other: no other replica has it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from tokenloom.server.responses_api_protocol import response_id_prefix

PREFIX_CHARS = 256  # ~64 tokens of English text: the first four 16-token KV blocks
RESPONSES_PATH = "/v1/responses/"


def json_body(request: dict[str, Any]) -> dict[str, Any] | None:
    """A forwarded HTTP request's body, if it is a JSON object."""
    try:
        body = json.loads(request.get("body") or b"")
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def prefix_key(request: dict[str, Any]) -> str | None:
    """The leading text of a forwarded HTTP request's prompt (completions) or conversation (chat, responses); None
    if none."""
    body = json_body(request)
    return None if body is None else _key_of(body)


def replica_keeping(body: dict[str, Any], replica_ids: list[str]) -> str | None:
    """The replica that keeps the response a /v1/responses request continues, if it is one of these."""
    previous = body.get("previous_response_id")
    return _replica_named(previous, replica_ids) if isinstance(previous, str) else None


def replica_named_in_path(request: dict[str, Any], replica_ids: list[str]) -> str | None:
    """The replica that keeps the response a forwarded request's path names (reading, listing its input items,
    cancelling or deleting /v1/responses/{id}), if it is one of these."""
    path = request.get("path")
    if not isinstance(path, str) or not path.startswith(RESPONSES_PATH):
        return None
    return _replica_named(path.removeprefix(RESPONSES_PATH).split("/", 1)[0], replica_ids)


def _replica_named(response_id: str, replica_ids: list[str]) -> str | None:
    return next((rid for rid in replica_ids if response_id.startswith(response_id_prefix(rid))), None)


def _key_of(body: dict[str, Any]) -> str | None:
    """A salted request (vLLM's cache_salt) shares blocks only with its salt's: its key starts with the salt, so a
    salt's prompts keep to one replica and another salt's same prompt need not follow them there."""
    key, salt = _prompt_key(body), body.get("cache_salt")
    return key if key is None or not isinstance(salt, str) else f"{salt}\0{key}"


def _prompt_key(body: dict[str, Any]) -> str | None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
    if isinstance(prompt, str | list):
        return str(prompt)[:PREFIX_CHARS]
    messages = body.get("messages")
    if isinstance(messages, list):
        return _conversation_key(messages)
    conversation = body.get("input")  # /v1/responses: its instructions come first, as the system message
    if isinstance(conversation, str):
        conversation = [{"role": "user", "content": conversation}]
    # /v1/embeddings' inputs, a list of texts or token lists, are no conversation: routed by load, not all to one key.
    if isinstance(conversation, list) and any(isinstance(item, dict) for item in conversation):
        instructions = body.get("instructions")
        first = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
        return _conversation_key(first + conversation)
    return None


def _conversation_key(messages: list[Any]) -> str:
    parts = [f"{m.get('role')}:{m.get('content')}" for m in messages if isinstance(m, dict)]
    return "\n".join(parts)[:PREFIX_CHARS]


def rendezvous_order(key: str, replica_ids: list[str]) -> list[str]:
    """Replica ids, highest hash of (key, id) first: the same key always prefers the same replica."""
    return sorted(replica_ids, key=lambda rid: hashlib.sha256(f"{key}\0{rid}".encode()).digest(), reverse=True)


class PrefixAwareRouter(RequestRouter):
    """Ray Serve's request router, choosing as this module's docstring says."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_load = sorted(candidate_replicas, key=_outstanding_tokens)
        request = pending_request.args[0] if pending_request and pending_request.args else {}
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        body = json_body(request)
        keeping = replica_named_in_path(request, list(by_id))
        if keeping is None and body is not None:
            keeping = replica_keeping(body, list(by_id))
        if keeping is not None:  # no other replica has that response: wait for this one, not a 404 from another
            return [[by_id[keeping]]]
        key = None if body is None else _key_of(body)
        if key is None:
            return [by_load]
        preferred = by_id[rendezvous_order(key, list(by_id))[0]]
        return [[preferred], [r for r in by_load if r is not preferred]]


def _outstanding_tokens(replica: RunningReplica) -> float:
    stats = replica.routing_stats or {}
    return float(stats.get("outstanding_tokens", 0))
