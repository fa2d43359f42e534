"""Beam search as vLLM runs it, over the engine's ordinary requests.

Each step, every live beam is a request for one token whose top 2W logprobs (W: the beam width) are its candidate
continuations; of all the live beams' candidates the W with the highest cumulative logprob live on, and a candidate
that is an end-of-sequence token is a complete beam instead. After max_tokens steps the best W of the complete and
the live beams, by cumulative logprob over length ** length_penalty, are the answer. A step's requests share their
beams' past through the prefix cache, so a step computes each beam's last, partial block again, not its whole context.

Logprobs are those of the raw model distribution (the sampler's), so temperature and the other sampling options do
not change which beams win; vLLM takes them and ignores them too.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenloom.outputs import CompletionOutput, Logprob, RequestOutput
from tokenloom.sampling_params import RequestOutputKind, SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams: W beams (and W answers), each at most max_tokens long."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # an answer that ended at EOS keeps the EOS token (and its text)

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError("beam_width must be >= 1")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")


@dataclass
class BeamSearchSequence:
    """A beam: the prompt's tokens and its own, their summed logprob, and (when asked for) each generated token's
    logprobs. `text` is filled in for the answers only."""

    tokens: list[int]
    cum_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" for a beam that ended at EOS; "length" once the steps ran out
    stop_reason: int | None = None  # the EOS token that ended it
    text: str | None = None


@dataclass
class BeamSearchOutput:
    """vLLM's: one prompt's answers, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearch:
    """One prompt's search: `step_prompts()` are the requests of the next step, `advance()` takes their logprobs."""

    def __init__(
        self, prompt_ids: list[int], params: BeamSearchParams, eos_token_ids: set[int], top_logprobs: int | None = None
    ) -> None:
        """top_logprobs: each answer keeps its tokens' logprobs with this many alternatives (None: none kept, so a
        long search holds only its tokens)."""
        assert top_logprobs is None or top_logprobs >= 0
        self.params, self.prompt_len = params, len(prompt_ids)
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.top_logprobs = top_logprobs
        # A step's request: one token (greedy: it is not used), with the candidates' logprobs.
        self.step_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                          logprobs=max(2 * params.beam_width, top_logprobs or 0),
                                          output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
        self.live = [BeamSearchSequence(list(prompt_ids))]
        self.complete: list[BeamSearchSequence] = []  # the best W ended beams (a worse one can never be an answer)
        self.steps = 0

    def check_logprobs(self, max_logprobs: int) -> None:
        """ValueError unless a step's logprobs (its 2 x beam_width candidates, or more if the answers keep more) are
        within what a request may ask for (--max-logprobs)."""
        asked = self.step_params.logprobs
        assert asked is not None
        if asked > max_logprobs:
            raise ValueError(f"beam_width={self.params.beam_width} reads {asked} logprobs a step; --max-logprobs "
                             f"allows {max_logprobs}, so at most {max_logprobs // 2} beams")  # fmt: skip

    @property
    def done(self) -> bool:
        return self.steps >= self.params.max_tokens

    def step_prompts(self) -> list[list[int]]:
        assert not self.done
        return [beam.tokens for beam in self.live]

    def advance(self, step_logprobs: list[dict[int, Logprob]]) -> None:
        """step_logprobs: per live beam (in step_prompts' order), its next token's top logprobs."""
        assert len(step_logprobs) == len(self.live) and not self.done
        candidates: list[tuple[float, int, int]] = []  # (cumulative logprob, beam, token)
        for b, (beam, entry) in enumerate(zip(self.live, step_logprobs, strict=True)):
            for token, logprob in entry.items():
                cum = beam.cum_logprob + logprob.logprob
                if token in self.eos_token_ids:
                    self._add_complete(self._extended(beam, token, cum, entry, ended=True))
                else:
                    candidates.append((cum, b, token))
        # Ties go to the earlier beam and candidate, so a search is deterministic.
        best = heapq.nlargest(self.params.beam_width, candidates, key=lambda c: c[0])
        self.live = [self._extended(self.live[b], token, cum, step_logprobs[b]) for cum, b, token in best]
        self.steps += 1
        if self.steps == self.params.max_tokens:
            for beam in self.live:
                beam.finish_reason = "length"

    def answers(self) -> list[BeamSearchSequence]:
        """The best W of the complete and the live beams, best first."""
        return heapq.nlargest(self.params.beam_width, self.complete + self.live, key=self.score)

    def completion_outputs(self, decode: Callable[[list[int]], str]) -> list[CompletionOutput]:
        """The answers as a request's choices: the generated tokens (EOS left out unless include_stop_str_in_output)
        and their text."""
        outputs = []
        for index, beam in enumerate(self.answers()):
            tokens = beam.tokens[self.prompt_len :]
            if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                tokens = tokens[:-1]
            logprobs = beam.logprobs[: len(tokens)] if self.top_logprobs is not None else None
            outputs.append(CompletionOutput(index, decode(tokens), tokens, beam.finish_reason, beam.stop_reason,
                                            logprobs, beam.cum_logprob))  # fmt: skip
        return outputs

    def score(self, beam: BeamSearchSequence) -> float:
        """vLLM's: the cumulative logprob over the beam's length (prompt included, its EOS not) ** length_penalty."""
        length = len(beam.tokens) - (beam.finish_reason == "stop")
        return beam.cum_logprob / (length**self.params.length_penalty)

    def _extended(
        self, beam: BeamSearchSequence, token: int, cum: float, entry: dict[int, Logprob], ended: bool = False
    ) -> BeamSearchSequence:
        logprobs = beam.logprobs
        if self.top_logprobs is not None:
            logprobs = [*logprobs, _kept(entry, token, self.top_logprobs)]
        if ended:
            return BeamSearchSequence([*beam.tokens, token], cum, logprobs, "stop", token)
        return BeamSearchSequence([*beam.tokens, token], cum, logprobs)

    def _add_complete(self, beam: BeamSearchSequence) -> None:
        self.complete = heapq.nlargest(self.params.beam_width, [*self.complete, beam], key=self.score)


def _kept(entry: dict[int, Logprob], token: int, top: int) -> dict[int, Logprob]:
    """A step's logprobs as an answer keeps them: the chosen token's and the `top` best."""
    kept = dict(heapq.nlargest(top, entry.items(), key=lambda item: item[1].logprob))
    kept[token] = entry[token]
    return kept


def step_candidates(output: RequestOutput) -> dict[int, Logprob]:
    """A step's candidates for its beam: its one token's logprobs (the request's error, if it failed)."""
    logprobs = output.outputs[0].logprobs
    if output.error is not None or not logprobs:
        raise RuntimeError(f"a beam search step failed: {output.error or 'no logprobs'}")
    return logprobs[0]
