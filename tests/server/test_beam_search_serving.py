"""`use_beam_search` through the HTTP server with the official client: the n choices are the offline search's n
beams; what beam search would ignore is refused; a client that hangs up mid-search leaves nothing behind."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from server_process import ServerProcess

from tokenloom import LLM, BeamSearchParams
from tokenloom.beam_search import BeamSearch
from tokenloom.server.beam_choices import BeamSearchChoices

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    with ServerProcess(str(tiny_chat_model), "--served-model-name", "tiny") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_the_choices_are_the_offline_searchs_beams_best_first(server, client, tiny_chat_model):
    with LLM(str(tiny_chat_model), dtype="float32") as llm:
        [offline] = llm.beam_search(PROMPT, BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
        prompt_len = len(llm.tokenizer.encode(PROMPT))
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, n=3, max_tokens=6, logprobs=1,
        extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.token_ids for c in reply.choices] == [beam.tokens[prompt_len:] for beam in offline.sequences]
    for choice, beam in zip(reply.choices, offline.sequences, strict=True):
        assert choice.finish_reason == "length" and beam.text == PROMPT + choice.text
        assert sum(choice.logprobs.token_logprobs) == pytest.approx(beam.cum_logprob, abs=1e-4)
    assert reply.usage.completion_tokens == 18
    server.wait_idle()


def test_chat_with_beam_search_and_a_length_penalty(client):
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], n=2, max_tokens=8,
        extra_body={"use_beam_search": True, "length_penalty": 0.5},
    )  # fmt: skip
    assert len(reply.choices) == 2 and len({c.message.content for c in reply.choices}) == 2  # two distinct beams
    assert all(c.finish_reason in ("stop", "length") for c in reply.choices)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"stream": True}, "stream"),
        ({"stop": ["."]}, "stop"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logit_bias": {"12": 5}}, "logit_bias"),
        ({"response_format": {"type": "json_object"}}, "use_beam_search"),
        ({"n": 11}, "n"),  # each step reads 2n logprobs of a beam, at most 20
    ],
)
def test_what_beam_search_would_ignore_is_refused(server, extra, field):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "n": 2, "use_beam_search": True, **extra}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    server.wait_idle()  # a refusal after admission gives back what it took


def test_a_client_that_hangs_up_mid_search_leaves_nothing_running(server, client):
    before = server.metric("tokenloom:generation_tokens_total")
    body = {"model": "tiny", "prompt": PROMPT, "n": 4, "max_tokens": 400, "use_beam_search": True, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.5)
    server.wait_idle()
    # Each step's request of a beam makes one token: the whole search would have made 4 x 400. (That no step
    # follows the hang-up is shown without timing below, on the search itself.)
    assert server.metric("tokenloom:generation_tokens_total") < before + 4 * 400
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_cancelled_reader_ends_the_search_and_aborts_its_step_before_it_returns():
    """A reader cancelled (as a hang-up cancels it) returns only once the search has ended: every request of the
    step in flight closed (which aborts it in the engine), and no step submitted after."""

    async def scenario() -> tuple[list[str], list[str]]:
        opened: list[str] = []
        closed: list[str] = []
        in_flight = asyncio.Event()

        async def never_finishing(rid: str):
            opened.append(rid)
            try:
                in_flight.set()
                await asyncio.Event().wait()
                yield
            finally:
                closed.append(rid)

        async def submit(tokens: list[int], params, rid: str, first: bool):
            return never_finishing(rid)

        search = BeamSearch([1, 2, 3], BeamSearchParams(beam_width=2, max_tokens=5), {9})
        choices = BeamSearchChoices(search, submit, "r", str)
        reader = asyncio.create_task(anext(choices.streams[0]))
        await asyncio.wait_for(in_flight.wait(), timeout=10)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        return list(opened), list(closed)  # as they stood when the reader returned

    opened, closed = asyncio.run(scenario())
    assert opened == ["r-s0-b0"] and closed == opened
