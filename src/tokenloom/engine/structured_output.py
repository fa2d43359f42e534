"""Structured output: grammars compiled by xgrammar and applied as a token bitmask, per request, batched.

The front compiles a request's grammar when the request arrives, so a bad schema or regex is the client's error
(a ValueError, a 400) before anything is queued; the compiler's cache makes the core's compile of the same
grammar a lookup. The core keeps one matcher per structured request: before a step it fills one bitmask row for
each such request that samples in the step (bit t allows token t), the runner sets every other token's logit to
-inf, and after the step the matcher advances by the sampled token. A matcher that reaches the end of its grammar
(it accepted a stop token, or nothing can follow) finishes its request.

JSON is generated compact (no free whitespace between tokens): a model may otherwise emit whitespace until it
runs out of tokens, as vLLM's ``disable_any_whitespace`` exists to prevent.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tokenloom.model.loader import Tokenizer
from tokenloom.model.sampler import GrammarMask
from tokenloom.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar


ANY_JSON_OBJECT = '{"type": "object", "additionalProperties": true}'


class InvalidGrammar(ValueError):
    """A structured-output spec that does not compile: the caller's error."""


class GrammarCompiler:
    """Compiles structured-output specs for one tokenizer; thread-safe, cached, xgrammar loaded on first use."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer, self._vocab_size, self._stop_token_ids = tokenizer, vocab_size, list(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def compile(self, spec: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The spec's grammar; ValueError, naming what is wrong, if it does not compile."""
        compiler = self._xgrammar_compiler()
        try:
            if spec.json is not None:
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                return compiler.compile_json_schema(schema, any_whitespace=False)
            if spec.json_object:
                return compiler.compile_json_schema(ANY_JSON_OBJECT, any_whitespace=False)
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                return compiler.compile_regex("|".join(_regex_literal(c) for c in spec.choice))
            assert spec.grammar is not None
            return compiler.compile_grammar(spec.grammar)
        except RuntimeError as error:  # xgrammar reports a bad schema, regex or grammar this way
            kind = "JSON schema" if spec.json is not None else "regex" if spec.regex is not None else "grammar"
            raise InvalidGrammar(f"invalid {kind} for structured output: {_first_line(error)}") from None

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                if self._tokenizer is None:
                    raise InvalidGrammar("structured output needs the model's tokenizer, and this checkpoint has none")
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
            return self._compiler


class StructuredOutputManager:
    """The core's matchers: one per live structured request, advanced by the tokens it samples."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._matchers: dict[str, Any] = {}  # request id -> xgrammar.GrammarMatcher

    def add(self, request_id: str, spec: StructuredOutputsParams) -> None:
        import xgrammar

        self._matchers[request_id] = xgrammar.GrammarMatcher(self.compiler.compile(spec))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def grammar_mask(self, request_ids: Sequence[str]) -> tuple[GrammarMask | None, dict[str, Exception]]:
        """The allowed next tokens of each of these requests that decodes under a grammar (None if none does), and
        the requests whose matcher raised while filling its row (to be failed alone)."""
        constrained = [rid for rid in request_ids if rid in self._matchers] if self._matchers else []
        if not constrained:
            return None, {}
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(len(constrained), self.compiler.vocab_size)
        filled: list[str] = []
        failed: dict[str, Exception] = {}
        for request_id in constrained:
            try:
                self._matchers[request_id].fill_next_token_bitmask(bitmask, len(filled))
                filled.append(request_id)
            except Exception as error:
                failed[request_id] = error
        return (GrammarMask(filled, bitmask[: len(filled)]) if filled else None), failed

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advances the request's matcher by its new token; True once its grammar is done (nothing may follow)."""
        matcher = self._matchers[request_id]
        if not matcher.accept_token(token_id):
            raise RuntimeError(f"token {token_id} is outside the request's grammar")
        return bool(matcher.is_terminated())


def _regex_literal(text: str) -> str:
    """The regex that matches exactly this text."""
    return "".join("\\" + c if c in r"\^$.|?*+()[]{}/" else c for c in text)


def _first_line(error: Exception) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    return text.split("] ", 1)[-1] if text.startswith("[") else text
