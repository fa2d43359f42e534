"""The engine core's side of speculative decoding: drafts proposed for the next step, acceptance learned from this one.

The proposers and the gate that decides where drafts pay are core/spec_decode.py's (token ids only); the scheduler
gives a request's drafts their share of the budget and their slots, the runner verifies them. This is what ties
them to a request's settings: no drafts while it prefills or under penalties, none past max_tokens or the context
length, and only those its grammar allows.
"""

from __future__ import annotations

from tokenloom.core.request import Request
from tokenloom.core.scheduler_output import SchedulerOutput
from tokenloom.core.spec_decode import Proposer, SpeculationGate, make_proposer
from tokenloom.engine.structured_output import StructuredOutputManager
from tokenloom.speculative_config import SpeculativeConfig


class Speculator:
    def __init__(
        self, config: SpeculativeConfig | None, structured: StructuredOutputManager, max_model_len: int
    ) -> None:
        self.proposer: Proposer | None = None if config is None else make_proposer(config)
        self.gate = SpeculationGate(config is None or config.dynamic)
        self.structured = structured
        self.max_model_len = max_model_len

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.gate.observe_step(num_tokens, seconds)

    def observe_verifications(self, output: SchedulerOutput, tokens: dict[str, list[int]]) -> None:
        """Each verified request's acceptance this step (its kept tokens are the accepted drafts and one more)."""
        if self.proposer is None:
            return
        for item in output.scheduled:
            request_id = item.request.request_id
            if item.draft_token_ids and request_id in tokens:
                self.gate.observe_verification(request_id, len(item.draft_token_ids), len(tokens[request_id]) - 1)

    def propose(self, running: list[Request], num_step_tokens: int) -> None:
        """Draft tokens for each running request whose next step is a decode, where speculating may pay."""
        if self.proposer is None:
            return
        for request in running:
            limit = self._draft_limit(request)
            if limit > 0 and self.gate.allows(request.request_id, num_step_tokens):
                prompt, output = request.prompt_token_ids, request.output_token_ids
                drafts = self.proposer.propose(request.request_id, prompt, output, limit)
                try:
                    request.spec_token_ids = self.structured.valid_drafts(request.request_id, drafts)
                except Exception:  # the matcher's own failure fails the request at its next mask, not here
                    request.spec_token_ids = []

    def release(self, request: Request) -> None:
        """A request is gone: its acceptance is forgotten, and a suffix proposer keeps its output for later ones."""
        self.gate.forget(request.request_id)
        if self.proposer is not None:
            self.proposer.finished(request.request_id, request.output_token_ids)

    def _draft_limit(self, request: Request) -> int:
        """How many drafts a request may verify next step: none while it prefills, or under penalties (a later
        row's logits would depend on the unverified drafts before it); never past max_tokens or max_model_len."""
        params = request.sampling_params
        if request.num_tokens - request.num_computed_tokens != 1 or params.uses_penalties:
            return 0
        return min(params.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1
