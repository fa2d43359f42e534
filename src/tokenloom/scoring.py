"""Scoring pairs of texts with an embedding model, as vLLM scores with one (``LLM.score``, ``/score``, ``/rerank``):
each text embedded once, and a pair's score the cosine similarity of its two vectors. No torch here."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def score_pairs(num_first: int, num_second: int) -> list[tuple[int, int]]:
    """The pairs scored, as indices into the first texts followed by the second: one first text against every
    second (1:1, 1:N), or the i-th first against the i-th second (N:N), as vLLM pairs them."""
    if num_first < 1 or num_second < 1:
        raise ValueError("score needs at least one text on each side")
    if num_first not in (1, num_second):
        raise ValueError(f"text_1 must hold one text or as many as text_2 ({num_second}): 1:1, 1:N or N:N")
    return [(0 if num_first == 1 else i, num_first + i) for i in range(num_second)]


def cosine(first: Sequence[float], second: Sequence[float]) -> float:
    """The cosine similarity of two vectors, in float64 (0 where either is all zeros)."""
    a, b = np.asarray(first, dtype=np.float64), np.asarray(second, dtype=np.float64)
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b) / norms if norms else 0.0
