"""Background responses (`background: true`) through the official client: answered at once as queued, generated
apart from the request, read back as the reply the same request would have had, cancelled with its engine request
aborted and its tenant's seat given back; each tenant's own; what cannot be kept refused."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_process import HeldRequest, ServerProcess, poll_until

TENANTS = """
[[tenant]]
name = "alice"
keys = ["sk-alice"]
max_concurrent_requests = 1

[[tenant]]
name = "bob"
keys = ["sk-bob"]
"""
ENDED = ("completed", "incomplete", "failed", "cancelled")
BOB = {"Authorization": "Bearer sk-bob"}


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    tenants.write_text(TENANTS)
    # One sequence at a time: a request held in the engine keeps a background one queued behind it.
    args = ("--served-model-name", "tiny", "--tenants", str(tenants), "--max-num-seqs", "1", "--max-model-len", "2048")
    with ServerProcess(str(tiny_chat_model), *args) as proc:
        yield proc


def client_of(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def until_ended(client: openai.OpenAI, response_id: str) -> list:
    """Every state read back, polling until the response has ended."""
    seen: list = []
    poll_until(lambda: seen.append(client.responses.retrieve(response_id)) or seen[-1], lambda r: r.status in ENDED)
    return seen


def test_a_background_response_is_queued_then_reads_back_as_the_reply_it_would_have_been(server):
    bob = client_of(server, "sk-bob")
    ask = dict(model="tiny", instructions="Be brief.", input="Name three colours.", max_output_tokens=24, temperature=0)
    started = bob.responses.create(**ask, background=True)
    assert started.status == "queued" and started.background and started.store and started.output == []
    seen = until_ended(bob, started.id)
    statuses = [r.status for r in seen]
    assert statuses[-1] == "incomplete" or statuses[-1] == "completed", statuses
    assert statuses == sorted(statuses, key=["queued", "in_progress", statuses[-1]].index), statuses  # in order
    ended = seen[-1]
    alone = bob.responses.create(**ask)  # the same request, answered in its own connection
    assert ended.output_text == alone.output_text and ended.output_text
    assert ended.usage.output_tokens == alone.usage.output_tokens and ended.background and not alone.background
    items = bob.responses.input_items.list(started.id)
    assert [item.content[0].text for item in items.data] == ["Name three colours."]
    follow = bob.responses.create(model="tiny", input="And one more?", previous_response_id=started.id,
                                  max_output_tokens=4, temperature=0)  # fmt: skip
    assert follow.status in ENDED


def test_a_queued_background_response_is_cancelled_its_request_aborted_and_its_seat_given_back(server):
    """alice may run one request at a time: her background response holds that seat while it waits behind bob's
    stream, so her next request is refused with 429 until she cancels it. Bob can neither read nor cancel it."""
    alice, bob = client_of(server, "sk-alice"), client_of(server, "sk-bob")
    stream = {"model": "tiny", "prompt": "hold", "max_tokens": 1900, "ignore_eos": True}
    held = HeldRequest(f"{server.url}/v1/completions", stream, BOB)
    try:
        assert poll_until(lambda: held.status, lambda status: status is not None) == 200
        started = alice.responses.create(model="tiny", input="Write a long story.", max_output_tokens=1500,
                                         background=True)  # fmt: skip
        assert server.wait_for_metric("tokenloom:num_requests_waiting", lambda n: n == 1, headers=BOB) == 1
        assert alice.responses.retrieve(started.id).status == "queued"
        with pytest.raises(openai.RateLimitError):  # her one seat is the background response's
            alice.responses.create(model="tiny", input="hi", max_output_tokens=2)
        with pytest.raises(openai.BadRequestError) as unfinished:
            alice.responses.create(model="tiny", input="more", previous_response_id=started.id)
        assert unfinished.value.body["param"] == "previous_response_id"
        for act in (bob.responses.retrieve, bob.responses.cancel):
            with pytest.raises(openai.NotFoundError):
                act(started.id)
        cancelled = alice.responses.cancel(started.id)
        assert cancelled.id == started.id and cancelled.status == "cancelled" and cancelled.output == []
        assert alice.responses.cancel(started.id).status == "cancelled"  # again: the same answer
        assert alice.responses.retrieve(started.id).status == "cancelled"
        assert server.wait_for_metric("tokenloom:num_requests_waiting", lambda n: n == 0, headers=BOB) == 0
    finally:
        held.release()
    assert alice.responses.create(model="tiny", input="hi", max_output_tokens=2).status in ENDED  # her seat is back
    assert server.wait_for_metric("tokenloom:inflight_response_bytes", lambda held: held == 0, headers=BOB) == 0


def test_a_running_background_response_is_cancelled_by_deleting_it(server):
    bob = client_of(server, "sk-bob")
    started = bob.responses.create(model="tiny", input="Count to a thousand.", max_output_tokens=1900,
                                   background=True)  # fmt: skip
    bob.responses.delete(started.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(started.id)
    assert server.wait_for_metric("tokenloom:num_requests_running", lambda n: n == 0, headers=BOB) == 0
    assert server.wait_for_metric("tokenloom:inflight_response_bytes", lambda held: held == 0, headers=BOB) == 0


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "hi", "background": True, "store": False}, 400, "background"),
        ({"input": "hi", "background": True, "stream": True}, 400, "stream"),
        ({"input": "x " * 2100, "background": True}, 400, "messages"),  # admission's refusals are its answer
    ],
)
def test_what_a_background_response_cannot_be_is_refused_at_once(server, body, status, param):
    reply = httpx.post(f"{server.url}/v1/responses", json={"model": "tiny", **body},
                       headers=BOB, timeout=30)  # fmt: skip
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"].startswith(param)


def test_only_a_background_response_still_running_can_be_cancelled(server):
    bob = client_of(server, "sk-bob")
    plain = bob.responses.create(model="tiny", input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="only a background response"):
        bob.responses.cancel(plain.id)
    done = bob.responses.create(model="tiny", input="hi", max_output_tokens=2, background=True)
    until_ended(bob, done.id)
    with pytest.raises(openai.BadRequestError, match="it has ended"):
        bob.responses.cancel(done.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.cancel("resp_nothing")


def test_a_background_response_cut_in_the_queue_reads_back_as_failed_with_the_reason(tiny_chat_model):
    args = ("--served-model-name", "tiny", "--max-num-seqs", "1", "--queue-timeout", "0.2", "--max-model-len", "2048")
    with ServerProcess(str(tiny_chat_model), *args) as proc:
        client = client_of(proc, "none")
        stream = {"model": "tiny", "prompt": "hold", "max_tokens": 1900, "ignore_eos": True}
        held = HeldRequest(f"{proc.url}/v1/completions", stream)
        try:
            assert poll_until(lambda: held.status, lambda status: status is not None) == 200
            started = client.responses.create(model="tiny", input="hi", max_output_tokens=4, background=True)
            failed = until_ended(client, started.id)[-1]
        finally:
            held.release()
        assert failed.status == "failed" and failed.error.code == "queue_timeout" and failed.output == []
        assert proc.wait_for_metric("tokenloom:inflight_response_bytes", lambda held: held == 0) == 0
