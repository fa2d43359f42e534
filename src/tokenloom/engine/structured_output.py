"""Structured output: grammars compiled by xgrammar and applied as a token bitmask, per request, batched.

The engine client compiles a request's grammar when the request arrives, so a bad schema or regex is the client's error
(a ValueError, a 400) before anything is queued; the compiler's cache makes the core's compile of the same
grammar a lookup. The core keeps one matcher per structured request: before a step it fills one bitmask row for
each such request that samples in the step (bit t allows token t), the runner sets every other token's logit to
-inf, and after the step the matcher advances by the sampled token. A matcher that reaches the end of its grammar
(it accepted a stop token, or nothing can follow) finishes its request.

JSON is generated compact (no free whitespace between tokens): a model may otherwise emit whitespace until it
runs out of tokens, as vLLM's ``disable_any_whitespace`` exists to prevent.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenloom.config import StructuredOutputsConfig
from tokenloom.model.loader import Tokenizer
from tokenloom.model.sampler import GrammarMask
from tokenloom.sampling_params import StructuredOutputsParams
from tokenloom.utils import without_source_locations

if TYPE_CHECKING:
    import xgrammar


ANY_JSON_OBJECT = '{"type": "object", "additionalProperties": true}'


class InvalidGrammar(ValueError):
    """A structured-output spec that does not compile: the caller's error."""


class GrammarCompiler:
    """Compiles structured-output specs for one tokenizer within a budget; thread-safe, xgrammar loaded on first use.

    What a spec may cost is bounded three ways: its size (``max_grammar_bytes``), its compile time
    (``grammar_compile_timeout``, in a small pool of worker threads; xgrammar releases the GIL while it compiles),
    and the memory the compiled grammars keep (xgrammar's cache, least recently used first out, under
    ``grammar_cache_bytes``). A spec whose compile overran is remembered and refused at once when it comes again.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        budget: StructuredOutputsConfig | None = None,
    ) -> None:
        self._tokenizer, self._vocab_size, self._stop_token_ids = tokenizer, vocab_size, list(stop_token_ids)
        self.budget = budget or StructuredOutputsConfig()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._lock = threading.Lock()
        # Two workers: a runaway compile holds one until it ends, and what waits for a worker waits on its deadline.
        self._pool = ThreadPoolExecutor(max_workers=COMPILE_WORKERS, thread_name_prefix="tokenloom-grammar")
        self._overran: OrderedDict[str, None] = OrderedDict()  # digests of specs that took too long

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def cache_bytes(self) -> int:
        """What the compiled grammars kept for reuse take now."""
        return 0 if self._compiler is None else int(self._compiler.get_cache_size_bytes())

    def compile(self, spec: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The spec's grammar; InvalidGrammar (a ValueError), naming what is wrong, if it is too large, takes too
        long, does not compile, or can match no text."""
        kind, text = _source(spec)
        size = len(text.encode())
        if size > self.budget.max_grammar_bytes:
            raise InvalidGrammar(
                f"the structured-output {kind} is {size} bytes, over the limit of {self.budget.max_grammar_bytes}"
            )
        digest = hashlib.sha256(f"{kind}\0{text}".encode()).hexdigest()
        timeout = self.budget.grammar_compile_timeout
        overran = InvalidGrammar(f"the structured-output {kind} takes longer than {timeout:g}s to compile")
        with self._lock:
            if digest in self._overran:
                raise overran
        future = self._pool.submit(self._compiled, kind, text)
        try:
            return future.result(timeout=timeout)
        except FuturesTimeout:
            future.cancel()  # not started yet: it never will be
            self._remember_overrun(digest)
            raise overran from None

    def _compiled(self, kind: str, text: str) -> xgrammar.CompiledGrammar:
        compiler = self._xgrammar_compiler()
        try:
            if kind == "JSON schema":
                grammar = compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "regex":
                grammar = compiler.compile_regex(text)
            else:
                grammar = compiler.compile_grammar(text)
        except RuntimeError as error:  # xgrammar reports a bad schema, regex or grammar this way
            raise InvalidGrammar(f"invalid {kind} for structured output: {_first_line(error)}") from None
        _require_some_first_token(grammar, kind)
        return grammar

    def _remember_overrun(self, digest: str) -> None:
        with self._lock:
            self._overran[digest] = None
            while len(self._overran) > OVERRUNS_REMEMBERED:
                self._overran.popitem(last=False)

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                if self._tokenizer is None:
                    raise InvalidGrammar("structured output needs the model's tokenizer, and this checkpoint has none")
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler = xgrammar.GrammarCompiler(
                    info, max_threads=2, cache_limit_bytes=self.budget.grammar_cache_bytes
                )
            return self._compiler


COMPILE_WORKERS = 2
OVERRUNS_REMEMBERED = 1024


def _source(spec: StructuredOutputsParams) -> tuple[str, str]:
    """(what kind of spec, its text as the compiler takes it)."""
    if spec.json is not None:
        return "JSON schema", spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
    if spec.json_object:
        return "JSON schema", ANY_JSON_OBJECT
    if spec.regex is not None:
        return "regex", spec.regex
    if spec.choice is not None:
        return "regex", "|".join(_regex_literal(c) for c in spec.choice)
    assert spec.grammar is not None
    return "grammar", spec.grammar


def _require_some_first_token(grammar: xgrammar.CompiledGrammar, kind: str) -> None:
    """A grammar that allows no first token (``root ::= root``) can never be met: the caller's error, found here
    rather than in the engine's step."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(grammar)
    bitmask = xgrammar.allocate_token_bitmask(1, grammar.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    if not bool(bitmask.any()):
        raise InvalidGrammar(f"the structured-output {kind} matches no text: no token can begin it")


class StructuredOutputManager:
    """The core's matchers: one per live structured request, advanced by the tokens it samples. A request whose
    grammar starts after its thought (``starts_after``) samples freely, its tokens not fed to its matcher, until its
    output ends with those ids."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._matchers: dict[str, Any] = {}  # request id -> xgrammar.GrammarMatcher
        self._thinking: dict[str, _UntilEnd] = {}  # request id -> the end of thought it waits for

    def add(self, request_id: str, spec: StructuredOutputsParams) -> None:
        import xgrammar

        self._matchers[request_id] = xgrammar.GrammarMatcher(self.compiler.compile(spec))
        if spec.starts_after is not None:
            self._thinking[request_id] = _UntilEnd(spec.starts_after)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._thinking.pop(request_id, None)

    def grammar_mask(self, sampled: Sequence[tuple[str, list[int]]]) -> tuple[GrammarMask | None, dict[str, Exception]]:
        """The allowed next tokens of each (request, its drafts) that decodes under a grammar (None if none does),
        and the requests whose matcher raised while filling its rows (to be failed alone).

        A request verifying drafts gets a row for each position: its state now, then after each draft in turn
        (accepted for the purpose and rolled back after). A draft the grammar refuses ends its rows: the row before
        it forbids it, so it is rejected and no later row is read.
        """
        constrained = [(rid, drafts) for rid, drafts in sampled if self._constrained(rid)] if self._matchers else []
        if not constrained:
            return None, {}
        import xgrammar

        num_rows = sum(1 + len(drafts) for _, drafts in constrained)
        bitmask = xgrammar.allocate_token_bitmask(num_rows, self.compiler.vocab_size)
        request_ids: list[str] = []
        offsets: list[int] = []
        failed: dict[str, Exception] = {}
        for request_id, drafts in constrained:
            try:
                rows = self._fill_rows(self._matchers[request_id], drafts, bitmask, len(request_ids))
            except Exception as error:
                failed[request_id] = error
                continue
            request_ids += [request_id] * rows
            offsets += range(rows)
        if not request_ids:
            return None, failed
        return GrammarMask(request_ids, bitmask[: len(request_ids)], offsets), failed

    @staticmethod
    def _fill_rows(matcher: Any, drafts: list[int], bitmask: Any, first_row: int) -> int:
        """Fills the request's rows from first_row; returns how many (1 + the drafts the grammar allows, less one
        where the grammar ends at a draft)."""
        matcher.fill_next_token_bitmask(bitmask, first_row)
        rows = 1
        with _tentatively(matcher, drafts) as accepted:
            for _ in accepted:
                if matcher.is_terminated():  # the grammar ends at this draft: the row after it is never read
                    break
                matcher.fill_next_token_bitmask(bitmask, first_row + rows)
                rows += 1
        return rows

    def _constrained(self, request_id: str) -> bool:
        return request_id in self._matchers and request_id not in self._thinking

    def valid_drafts(self, request_id: str, drafts: list[int]) -> list[int]:
        """The longest prefix of the drafts the request's grammar allows (all of them without a grammar; while it
        thinks, those up to the end of its thought, after which the grammar would have to judge them)."""
        matcher = self._matchers.get(request_id)
        if matcher is None or not drafts:
            return drafts
        if request_id in self._thinking:
            return drafts[: self._thinking[request_id].tokens_to_end(drafts)]
        with _tentatively(matcher, drafts) as accepted:
            return drafts[: sum(1 for _ in accepted)]

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advances the request's matcher by its new token; True once its grammar is done (nothing may follow). A
        thinking request's token only moves it towards the end of its thought."""
        thinking = self._thinking.get(request_id)
        if thinking is not None:
            if thinking.ended_by(token_id):
                del self._thinking[request_id]
            return False
        matcher = self._matchers[request_id]
        if not matcher.accept_token(token_id):
            raise RuntimeError(f"token {token_id} is outside the request's grammar")
        return bool(matcher.is_terminated())


@dataclass
class _UntilEnd:
    """The last tokens of a thinking request's output, watched for the end of its thought."""

    end: tuple[int, ...]
    tail: list[int] = field(default_factory=list)

    def ended_by(self, token_id: int) -> bool:
        self.tail = [*self.tail[1 - len(self.end) :], token_id] if len(self.end) > 1 else [token_id]
        return tuple(self.tail) == self.end

    def tokens_to_end(self, drafts: list[int]) -> int:
        """How many of the drafts come before the grammar would start (all of them if it would not)."""
        watch = _UntilEnd(self.end, list(self.tail))
        return next((i + 1 for i, token in enumerate(drafts) if watch.ended_by(token)), len(drafts))


@contextmanager
def _tentatively(matcher: Any, drafts: list[int]) -> Iterator[Iterator[int]]:
    """The drafts the matcher accepts, one by one as the caller reads them, up to the first it refuses or the end of
    its grammar; however the caller stops, the matcher is rolled back to where it was."""
    accepted = 0

    def walk() -> Iterator[int]:
        nonlocal accepted
        for draft in drafts:
            if matcher.is_terminated() or not matcher.accept_token(draft):
                return
            accepted += 1
            yield draft

    try:
        yield walk()
    finally:
        if accepted:
            matcher.rollback(accepted)


def _regex_literal(text: str) -> str:
    """The regex that matches exactly this text."""
    return "".join("\\" + c if c in r"\^$.|?*+()[]{}/" else c for c in text)


def _first_line(error: Exception) -> str:
    """The error's first line, without the native library's time stamp and source path (internals a client has
    no use for)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    text = text.split("] ", 1)[-1] if text.startswith("[") else text
    return without_source_locations(text) or type(error).__name__
