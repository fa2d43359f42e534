"""Small helpers every layer uses."""

import re

# A native or Python source location in an error's text (xgrammar's "/project/cpp/x.cc:100: ", torch's
# "... at /pytorch/aten/src/y.cpp:12"): where the library was built, which a client has no use for.
_SOURCE_LOCATION = re.compile(r"(?:\bat )?(?:[\w.+-]*/)+[\w.+-]+\.(?:cc|cpp|cxx|c|h|hpp|cu|py):\d+:?\s*")


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of b hold a."""
    return -(-a // b)


def without_source_locations(text: str) -> str:
    """The text with the source paths and line numbers of the code that raised taken out."""
    return _SOURCE_LOCATION.sub("", text).strip()
