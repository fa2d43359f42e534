"""What requests in flight may hold of the server's memory for their responses (--max-inflight-response-bytes).

The guard bounds what a request sends; nothing bounded what it asks the server to make. A 200-byte chat request with
"n": 128, "logprobs": true, "top_logprobs": 20 and no max_tokens asks for 128 x 8,192 tokens of 21 logprobs each:
~20 GB of Python objects by the time its response is rendered, and a few such requests from any client took the
server's memory without limit (benchmarks/RESULTS.md). So each request is charged at admission the most its response
can hold, at figures benchmarks/response_memory.py measures for every endpoint, and the charges of the requests in
flight stay under one budget: a request that would go over gets 429 (Retry-After), one over the whole budget alone
400. The charge is given back when the request ends, however it ends.

What a request is charged:
- a fixed cost (its connection, its state in the front and in the queue: what bounds the queue's memory) and one per
  sequence (prompts times n);
- each logprob its response carries, generated or of the prompt: a token's own, its alternatives, and its entry;
- the tokens of a request of several sequences (n > 1, or several prompts), whose finished outputs wait in the server
  for the others. A lone sequence's tokens are not charged: while it runs, the KV cache bounds them (each has a slot),
  and it is answered as it ends;
- each value of an embedding: its vector is held until the request's last one is done, then rendered whole (128
  inputs of a 4,096-wide model are ~45 MB by then, where their fixed costs are 2 MB).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenloom.sampling_params import SamplingParams
from tokenloom.server.errors import APIError
from tokenloom.server.guard import ByteBudget

REQUEST_BYTES = 64 << 10  # a queued request measured ~50 KiB of a real server's RSS, connection included
SEQUENCE_BYTES = 16 << 10  # a sequence's state in the core, the output side and the front: 7-15 KiB traced
HELD_TOKEN_BYTES = 256  # a token of a finished choice, held and then rendered: 130-290 B traced
LOGPROB_BYTES = 1280  # one logprob while held and rendered, the heaviest endpoint's: ~1,030 B traced (Responses API)
STREAMED_LOGPROB_BYTES = 384  # one logprob of a stream: held as it comes, each chunk's rendered alone: ~280 B traced
EMBEDDING_VALUE_BYTES = 112  # a vector's value, held as a Python float and rendered as JSON: 85 B traced (base64 50)


def response_charge(
    prompt_lengths: Sequence[int],
    params: Sequence[SamplingParams],
    n: int,
    streamed: bool = False,
    hidden_size: int = 0,
) -> int:
    """The most a request's response can hold of the server's memory, in bytes (each prompt's params have their
    max_tokens filled in). A stream's logprobs are never rendered all at once: they cost what the output side keeps.
    hidden_size: the model's, the width of an embedding that asks for no fewer dimensions."""
    sequences = len(prompt_lengths) * n
    charge = REQUEST_BYTES + sequences * SEQUENCE_BYTES
    logprob_bytes = STREAMED_LOGPROB_BYTES if streamed else LOGPROB_BYTES
    for length, q in zip(prompt_lengths, params, strict=True):
        assert q.max_tokens is not None, "charged after the defaults are filled in"
        if sequences > 1:
            charge += n * q.max_tokens * HELD_TOKEN_BYTES
        if q.logprobs is not None:  # the token's own, its alternatives, and the entry that holds them
            charge += n * q.max_tokens * (q.logprobs + 2) * logprob_bytes
        if q.prompt_logprobs is not None:
            charge += n * length * (q.prompt_logprobs + 2) * logprob_bytes
        if q.pooling is not None:
            assert hidden_size > 0, "an embedding is charged its width"
            charge += n * q.pooling.width(hidden_size) * EMBEDDING_VALUE_BYTES
    return charge


class ResponseBudget(ByteBudget):
    """The bytes charged to requests in flight, against a limit; a refusal is an API error."""

    def take_or_refuse(self, charge: int) -> None:
        """Takes a request's charge, or raises 400 (over the whole budget) or 429 (over what is left)."""
        if charge > self.limit:
            raise APIError(
                400,
                f"this request could hold up to {_mib(charge)} of server memory for its response (its choices x "
                f"max_tokens x logprobs), over the server's {_mib(self.limit)} for all responses in flight "
                "(--max-inflight-response-bytes); ask for fewer choices, tokens or logprobs",
                None,
                "response_too_large",
            )
        if not self.take(charge):
            raise APIError(
                429,
                f"requests in flight hold {_mib(self.held)} of the server's {_mib(self.limit)} for responses "
                f"(--max-inflight-response-bytes) and this one could take {_mib(charge)}; retry shortly",
                None,
                "response_budget_full",
                headers={"Retry-After": "1"},
            )


def _mib(size: int) -> str:
    return f"{size / 2**20:,.1f} MiB"
