"""What a full /v1/responses store takes in memory against what it counts (--responses-store-bytes).

    .venv/bin/python benchmarks/response_store_memory.py

Fills a ResponseStore past its budget under tracemalloc, with long entries (2,000 + 1,000 + 500 characters of
conversation, 1,500 of output) and with tiny ones ("hi" in, one character out), and prints the bytes it counted
against the bytes Python allocated for it: the budget bounds the store's memory when traced / counted stays under 1.
No server, no model: the store alone.
"""

from __future__ import annotations

import random
import string
import tracemalloc
from typing import Literal

from tokenloom.server.response_store import ResponseStore
from tokenloom.server.responses_api_protocol import (
    InputTokensDetails,
    MessageItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponseUsage,
    output_as_input,
)

RNG = random.Random(0)


def text(length: int) -> str:
    return "".join(RNG.choice(string.ascii_letters + "     ") for _ in range(length))


def response(i: int, output_chars: int) -> ResponseObject:
    message = OutputMessage(id=f"msg_{i:032x}", status="completed", content=[OutputText(text=text(output_chars))])
    usage = ResponseUsage(input_tokens=9, input_tokens_details=InputTokensDetails(), output_tokens=1, total_tokens=10)
    return ResponseObject(id=f"resp_{i:032x}", created_at=0, status="completed", model="m", output=[message],
                          usage=usage)  # fmt: skip


Turns = tuple[tuple[Literal["user", "assistant"], int], ...]  # each message's role and length


def fill(name: str, budget: int, turns: Turns, output_chars: int, count: int) -> None:
    tracemalloc.start()
    store = ResponseStore(budget)
    before = tracemalloc.get_traced_memory()[0]
    for i in range(count):
        conversation = [MessageItem(role=role, content=text(n)) for role, n in turns]
        kept = response(i, output_chars)
        store.put(kept.id, "tenant", [*conversation, *output_as_input(kept.output)], kept.model_dump(mode="json"))
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    print(f"| {name} ({len(store):,} kept) | {budget / 2**20:.0f} MiB | {store.bytes / 2**20:.1f} MiB | "
          f"{traced / 2**20:.1f} MiB | {traced / store.bytes:.2f}x |")  # fmt: skip


def main() -> None:
    print("| entries | budget | counted | traced | traced / counted |")
    print("|---|---:|---:|---:|---:|")
    fill("long", 32 << 20, (("user", 2000), ("assistant", 1000), ("user", 500)), 1500, 12_000)
    fill("tiny", 8 << 20, (("user", 2),), 1, 12_000)


if __name__ == "__main__":
    main()
