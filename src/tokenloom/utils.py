"""Small helpers every layer uses."""

import gc
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

# A native or Python source location in an error's text (xgrammar's "/project/cpp/x.cc:100: ", torch's
# "... at /pytorch/aten/src/y.cpp:12"): where the library was built, which a client has no use for.
_SOURCE_LOCATION = re.compile(r"(?:\bat )?(?:[\w.+-]*/)+[\w.+-]+\.(?:cc|cpp|cxx|c|h|hpp|cu|py):\d+:?\s*")


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of b hold a."""
    return -(-a // b)


def without_source_locations(text: str) -> str:
    """The text with the source paths and line numbers of the code that raised taken out."""
    return _SOURCE_LOCATION.sub("", text).strip()


@contextmanager
def heap_frozen(collect_first: bool) -> Iterator[None]:
    """Moves every object alive now into the collector's permanent generation (``gc.freeze``) until the block ends,
    so that a full collection inside walks only what the block made.

    A process that serves starts with hundreds of thousands of long-lived objects (torch, the tokenizer, the model's
    modules). Each full collection walked them all: a quarter of a second on these CPUs, every stream waiting for
    its next token, and at a thousand running requests a dozen of them in a hundred steps. vLLM's engine core and
    API server freeze their start-up heap too. `collect_first` collects once before (the serving processes, once at
    start); without it the freeze costs nothing, and a cycle already garbage waits for the block's end. Nothing
    happens where something else froze the heap (the caller's own ``gc.freeze``, an enclosing block), and
    ``TOKENLOOM_GC_FREEZE=0`` leaves the collector as Python sets it (to measure the difference)."""
    if os.environ.get("TOKENLOOM_GC_FREEZE", "1") == "0" or gc.get_freeze_count() > 0:
        yield
        return
    if collect_first:
        gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()  # collectable again, and freed as the process ends (native libraries check for leaks then)
