"""Model-free draft proposals for speculative decoding, and the rule that says when verifying them pays.

Both proposers read only token ids. ``NgramProposer`` is vLLM's prompt lookup: the tokens that followed the latest
earlier occurrence of the sequence's last n tokens, n from prompt_lookup_max down to prompt_lookup_min.
``SuffixProposer`` is SuffixDecoding (Snowflake's ArcticInference, vLLM's ``suffix`` method) in a simple form: the
longest suffix of the sequence (up to the tree depth) that occurred before, in the request's own tokens or in the
outputs of recent requests, and the continuation those occurrences most often had, token by token while its
estimated probability (count over the occurrences still agreeing) stays above min_token_prob; a match of m tokens
proposes at most m * max_spec_factor. Where both indexes match, the one whose continuation scores higher (the sum
of its tokens' probabilities, as ArcticInference scores) proposes.

``SpeculationGate`` decides per request and step whether its drafts are worth their tokens (vLLM's dynamic
speculation, from measured costs): on a CPU a step's time grows with its tokens, so a draft token costs the
slope of the step's time per token, and saves, if accepted, a whole step's share per sequence.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from tokenloom.core.preemption import LinearCostFit
from tokenloom.speculative_config import SpeculativeConfig

SEPARATOR = -1  # between outputs in the global index: no key and no continuation crosses it
MAX_CANDIDATES = 16  # most recent occurrences of a key examined per proposal
GLOBAL_INDEX_TOKENS = 1 << 16  # the global index's bound; the oldest half goes when it is reached


class NgramIndex:
    """Every n-gram (n in ``lengths``) of an append-only token list, with the end positions of its occurrences."""

    def __init__(self, lengths: tuple[int, ...]) -> None:
        self.lengths = lengths
        self.tokens: list[int] = []
        self.ends: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in lengths}
        self._indexed = 0  # occurrences ending before this position are in ``ends``

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def index_up_to(self, end: int) -> None:
        """Indexes the n-grams ending at positions before ``end``."""
        tokens = self.tokens
        for position in range(self._indexed, end):
            for n in self.lengths:
                if position + 1 >= n:
                    key = tuple(tokens[position + 1 - n : position + 1])
                    if SEPARATOR not in key:
                        self.ends[n].setdefault(key, []).append(position)
        self._indexed = max(self._indexed, end)

    def occurrences(self, pattern: list[int], n: int) -> list[int]:
        """End positions of the earlier occurrences of the pattern's last n tokens, most recent last."""
        return self.ends[n].get(tuple(pattern[-n:]), [])


class Proposer(Protocol):
    def propose(self, request_id: str, prompt: list[int], output: list[int], max_tokens: int) -> list[int]:
        """Up to max_tokens draft tokens to follow the request's prompt and output so far (maybe none)."""
        ...

    def finished(self, request_id: str, output_token_ids: list[int]) -> None:
        """The request is gone: its own index goes (its output may join a global one)."""
        ...


class _PerRequestIndexes:
    """Each live request's index over its own tokens, brought up to date with its tokens at each proposal."""

    def __init__(self, lengths: tuple[int, ...]) -> None:
        self.lengths = lengths
        self._indexes: dict[str, NgramIndex] = {}

    def updated(self, request_id: str, prompt: list[int], output: list[int]) -> NgramIndex:
        """The request's index, its tokens (prompt then output) brought up to date."""
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = NgramIndex(self.lengths)
            index.extend(prompt)
        num_output = len(index.tokens) - len(prompt)
        assert 0 <= num_output <= len(output), "a request's tokens only grow"
        index.extend(output[num_output:])
        # Occurrences end before the last token, so the sequence's own suffix is never its own match.
        index.index_up_to(len(index.tokens) - 1)
        return index

    def drop(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        low, high = config.num_lookup
        self.lengths = tuple(range(high, low - 1, -1))
        self.num_speculative_tokens = config.num_tokens
        self._requests = _PerRequestIndexes(self.lengths)

    def propose(self, request_id: str, prompt: list[int], output: list[int], max_tokens: int) -> list[int]:
        index = self._requests.updated(request_id, prompt, output)
        token_ids = index.tokens
        limit = min(max_tokens, self.num_speculative_tokens)
        for n in self.lengths:
            ends = index.occurrences(token_ids, n) if len(token_ids) > n else []
            if ends:
                start = ends[-1] + 1
                return token_ids[start : start + limit]
        return []

    def finished(self, request_id: str, output_token_ids: list[int]) -> None:
        self._requests.drop(request_id)


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.num_speculative_tokens = config.num_tokens
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.max_cached_requests = config.suffix_decoding_max_cached_requests
        # Keys of a few lengths find candidates; each candidate's match is then measured token by token.
        self.lengths = tuple(n for n in (16, 8, 4, 2, 1) if n <= self.max_depth)
        self._requests = _PerRequestIndexes(self.lengths)
        self._outputs: deque[list[int]] = deque()
        self._global = NgramIndex(self.lengths)

    def propose(self, request_id: str, prompt: list[int], output: list[int], max_tokens: int) -> list[int]:
        local = self._requests.updated(request_id, prompt, output)
        token_ids = local.tokens
        limit = min(max_tokens, self.num_speculative_tokens)
        best: tuple[float, list[int]] = (0.0, [])
        for index in (local, self._global):
            score, tokens = self._continuation(index, token_ids, limit)
            if score > best[0]:
                best = (score, tokens)
        return best[1]

    def finished(self, request_id: str, output_token_ids: list[int]) -> None:
        self._requests.drop(request_id)
        if self.max_cached_requests == 0 or not output_token_ids:
            return
        self._outputs.append(list(output_token_ids))
        self._global.extend([*output_token_ids, SEPARATOR])
        self._global.index_up_to(len(self._global.tokens))
        if len(self._outputs) > self.max_cached_requests or len(self._global.tokens) > GLOBAL_INDEX_TOKENS:
            self._rebuild_global()

    def _rebuild_global(self) -> None:
        """Drops the oldest half of the cached outputs (at least down to max_cached_requests) and reindexes."""
        keep = min(self.max_cached_requests, len(self._outputs) // 2)
        while len(self._outputs) > keep:
            self._outputs.popleft()
        self._global = NgramIndex(self.lengths)
        for output in self._outputs:
            self._global.extend([*output, SEPARATOR])
        self._global.index_up_to(len(self._global.tokens))

    def _continuation(self, index: NgramIndex, pattern: list[int], limit: int) -> tuple[float, list[int]]:
        """The most frequent continuation of the longest suffix of ``pattern`` found in the index, and its score."""
        for n in self.lengths:
            if len(pattern) <= n:
                continue
            ends = index.occurrences(pattern, n)[-MAX_CANDIDATES:]
            if not ends:
                continue
            match = max(self._match_length(index.tokens, end, pattern, n) for end in ends)
            return self._walk(index.tokens, ends, min(limit, int(match * self.max_spec_factor)))
        return 0.0, []

    def _match_length(self, tokens: list[int], end: int, pattern: list[int], known: int) -> int:
        """How many tokens before and at ``end`` equal the pattern's tail, up to the tree depth (``known`` do)."""
        length = known
        while length < self.max_depth and end - length >= 0 and length < len(pattern):
            if tokens[end - length] != pattern[-1 - length]:
                break
            length += 1
        return length

    def _walk(self, tokens: list[int], ends: list[int], limit: int) -> tuple[float, list[int]]:
        """Follows the occurrences' continuations while the most common next token stays likely enough."""
        proposal: list[int] = []
        score, probability = 0.0, 1.0
        alive = ends
        while len(proposal) < limit and alive:
            depth = len(proposal) + 1
            counts: dict[int, int] = {}
            for end in alive:
                at = end + depth
                if at < len(tokens) and tokens[at] != SEPARATOR:
                    counts[tokens[at]] = counts.get(tokens[at], 0) + 1
            if not counts:
                break
            token, count = max(counts.items(), key=lambda item: item[1])
            probability *= count / len(alive)
            if probability < self.min_token_prob:
                break
            proposal.append(token)
            score += probability
            alive = [end for end in alive if end + depth < len(tokens) and tokens[end + depth] == token]
        return score, proposal


def make_proposer(config: SpeculativeConfig) -> Proposer:
    return NgramProposer(config) if config.method == "ngram" else SuffixProposer(config)


class SpeculationGate:
    """Whether a request's drafts are worth verifying this step.

    A step of N tokens takes about a + b * N seconds (fitted to the steps run so far). A draft token costs b; if
    accepted (the request's recent rate, alpha) it saves a decode step's share per sequence, (a + b * N) / N. So a
    request speculates while alpha > b * N / (a + b * N): nearly always when one request runs, and at high load
    (b * N near the whole step) only with drafts that are nearly always right.
    """

    PRIOR_ACCEPTANCE = 0.5  # a request's rate before it has verified any draft
    DECAY = 0.7  # weight of the previous rate at each verification
    RETRY_DRIFT = 0.05  # how far a held-back request's rate moves towards the prior per step

    def __init__(self, dynamic: bool) -> None:
        self.dynamic = dynamic
        self.steps = LinearCostFit()
        self._acceptance: dict[str, float] = {}

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.steps.add(num_tokens, seconds)

    def observe_verification(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        previous = self._acceptance.get(request_id, self.PRIOR_ACCEPTANCE)
        self._acceptance[request_id] = self.DECAY * previous + (1 - self.DECAY) * num_accepted / num_drafts

    def acceptance(self, request_id: str) -> float:
        return self._acceptance.get(request_id, self.PRIOR_ACCEPTANCE)

    def token_cost_share(self, num_tokens: int) -> float:
        """b * N / (a + b * N): the share of a step of num_tokens tokens that grows with its tokens."""
        slope, intercept = self.steps.slope(), self.steps.intercept()
        if slope is None or intercept is None:
            return 0.0  # nothing measured yet: speculate, and the steps that follow are measured
        return slope * num_tokens / (intercept + slope * num_tokens)

    def allows(self, request_id: str, num_tokens: int) -> bool:
        if not self.dynamic:
            return True
        rate = self.acceptance(request_id)
        if rate > self.token_cost_share(num_tokens):
            return True
        # A request held back drifts towards the prior, so it tries again once in a while: its text may change.
        self._acceptance[request_id] = rate + self.RETRY_DRIFT * (self.PRIOR_ACCEPTANCE - rate)
        return False

    def forget(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)
