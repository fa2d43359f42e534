"""Turns the logits of the sampled rows into tokens, vectorised over the batch.

Order of operations, as in vLLM: allowed tokens, logit biases and min_tokens' banned stop tokens (token_bias.py),
then penalties, then greedy rows take the argmax; the other rows are divided by their temperature, filtered by
top-k, top-p and min-p, and drawn. A request with a seed draws from its own generator, so it gets the same text
whatever else shares the batch. Logprobs are those of the raw model distribution, or as the engine's logprobs_mode
says (vLLM's --logprobs-mode): the raw logits, or the logits (or logprobs) the token was chosen from, after biases
and penalties and, for a sampled row, its temperature and top-k, top-p and min-p (a filtered token's is -inf).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tokenloom.model.penalties import TokenCounts, apply_penalties
from tokenloom.model.reductions import row_argmax
from tokenloom.model.token_bias import apply_token_biases
from tokenloom.sampling_params import LogprobsMode, SamplingParams


@dataclass
class SamplingBatch:
    """The sampling settings of each sampled row, gathered into tensors once per step."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]  # None: the engine-wide generator
    token_counts: list[TokenCounts | None]  # a row's seen tokens where its request has penalties (penalties.py)
    # Each row's input token (its request's last) on the device, where a step scheduled ahead holds placeholders.
    last_tokens: torch.Tensor | None = None
    # The index in its request's output of the token each row samples (min_tokens bans stop tokens below it);
    # None: every row samples its request's first output token.
    output_index: list[int] | None = None
    # A row's request's output tokens and then its drafts, which its bad words read (token_bias.py): asked only for
    # the rows whose bad words have several tokens, so a step builds none of these lists for the others.
    history_of: Callable[[int], Sequence[int]] | None = None

    def output_indexes(self) -> list[int]:
        return self.output_index if self.output_index is not None else [0] * len(self.params)

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)

    @property
    def max_logprobs(self) -> int | None:
        wanted = [p.logprobs for p in self.params if p.logprobs is not None]
        return max(wanted) if wanted else None


@dataclass
class GrammarMask:
    """The tokens each structured request may sample next: bit t of a row's 32-bit words allows token t.

    Row i is for request request_ids[i] at its verification row offsets[i] (0: its next token; j: the token after
    its j-th draft); a request without drafts has one row, offset 0."""

    request_ids: list[str]
    bitmask: torch.Tensor  # [len(request_ids), ceil(vocab / 32)] int32
    offsets: list[int] = field(default_factory=list)  # empty: every row at offset 0

    def row_offsets(self) -> list[int]:
        return self.offsets or [0] * len(self.request_ids)


def mask_disallowed(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Sets to -inf, in place, the logits of the given rows whose bit in the row's mask is clear.

    xgrammar's kernel (CPU, CUDA or Triton) reads the packed bits; unpacking them into a boolean mask in torch cost
    ~5 ms for 32 rows of a 49k vocabulary here, 20x more. Rows not named keep every token (all bits set).
    """
    import xgrammar

    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgrammar.apply_token_bitmask_inplace(logits, full.to(logits.device), indices=rows)


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class SampledOnDevice:
    """A step's sampled tokens (and the logprobs asked for) while they are still on the device: their copy to the
    host is under way, and ``tokens()`` waits for it. Between the two the host may prepare and launch the next
    step, so the device never waits for the host's reading of this one."""

    def __init__(
        self,
        tokens: torch.Tensor,
        logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,  # the chosen, the top values, their ids
        params: list[SamplingParams],
    ) -> None:
        self.params = params
        self.device_tokens = tokens  # what a step scheduled ahead of this one reads its placeholders from
        self._host = [_copy_to_host(tensor) for tensor in (tokens, *(logprobs or ()))]
        self._ready = _recorded_event(tokens.device)

    def per_request(self) -> list[list[SampledToken]]:
        """Each row's token as its request's list of new tokens (one; verifying drafts gives several)."""
        return [[token] for token in self.tokens()]

    def tokens(self) -> list[SampledToken]:
        if self._ready is not None:
            self._ready.synchronize()
        token_list = self._host[0].tolist()
        if len(self._host) == 1:
            return [SampledToken(t) for t in token_list]
        chosen, top_values, top_ids = (tensor.tolist() for tensor in self._host[1:])
        results = []
        for row, params in enumerate(self.params):
            if params.logprobs is None:
                results.append(SampledToken(token_list[row]))
                continue
            n = params.logprobs
            pairs = list(zip(top_ids[row][:n], top_values[row][:n], strict=True))
            results.append(SampledToken(token_list[row], chosen[row], pairs))
        return results


def _copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor on the host: itself on a CPU; from a CUDA device, a pinned copy made in stream order, without
    waiting (read it only after the event that follows it); from another accelerator, a copy made now."""
    if tensor.device.type == "cpu":
        return tensor
    if tensor.device.type != "cuda":  # no event to wait on there
        return tensor.cpu()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def _recorded_event(device: torch.device) -> torch.cuda.Event | None:
    """An event after the work queued so far on the device's current stream (None on a CPU: nothing to wait for)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class SeededGenerators:
    """The generator of each live request with a seed, by request id: seeded at its first sampled step, drawn from
    at every one after (so its draws do not depend on what shares its batch), dropped when the request ends."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._by_request: dict[str, torch.Generator] = {}

    def of(self, request_id: str, seed: int | None) -> torch.Generator | None:
        """The request's generator; None for a request without a seed (it draws from the engine's)."""
        if seed is None:
            return None
        generator = self._by_request.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self._by_request[request_id] = generator
        return generator

    def drop(self, request_id: str) -> None:
        self._by_request.pop(request_id, None)

    def __len__(self) -> int:  # live generators: none outlives its request (tests/engine/test_fault_isolation.py)
        return len(self._by_request)


class Sampler:
    def __init__(self, device: torch.device, seed: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.eos_token_ids = eos_token_ids  # what min_tokens bans besides a request's stop_token_ids
        # What a token's logprobs are (the module's docstring); the engine's logprobs_mode, set on rank 0's sampler.
        self.logprobs_mode: LogprobsMode = "raw_logprobs"

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> list[SampledToken]:
        return self.sample(logits, batch).tokens()

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampledOnDevice:
        """Samples each row on the logits' device; the tokens come to the host when ``tokens()`` is read."""
        logits = logits.float()
        raw = self._raw(logits, batch)
        restores = [
            apply_token_biases(logits, batch.params, batch.output_indexes(), self.eos_token_ids, batch.history_of)
        ]
        if any(p.uses_penalties for p in batch.params):
            restores.append(apply_penalties(logits, batch.params, batch.token_counts, batch.last_tokens))
        try:
            tokens = row_argmax(logits)
            drawn_from = None
            if not batch.all_greedy:
                drawn_from = _tempered_and_filtered(logits, batch.params)
                tokens = self._sample_random(drawn_from, batch, tokens)
            shown = raw if raw is not None else self._processed(logits, drawn_from, batch)
            return self._on_device(tokens, shown, batch)
        except BaseException:
            # The runner samples row by row after a failure: from the model's logits.
            for restore in reversed(restores):
                restore()
            raise

    def prompt_values(self, logits: torch.Tensor) -> torch.Tensor:
        """What a prompt token's logprobs show: its logprobs or, under a logits mode, its logits (nothing processes
        a prompt's logits, so raw and processed are the same)."""
        logits = logits.float()
        return logits if self.logprobs_mode.endswith("logits") else torch.log_softmax(logits, dim=-1)

    def _raw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor | None:
        """The logprobs (or logits) the batch asks for, where they are the model's own: before anything changes
        the logits."""
        if batch.max_logprobs is None or not self.logprobs_mode.startswith("raw"):
            return None
        return torch.log_softmax(logits, dim=-1) if self.logprobs_mode == "raw_logprobs" else logits.clone()

    def _processed(
        self, logits: torch.Tensor, drawn_from: torch.Tensor | None, batch: SamplingBatch
    ) -> torch.Tensor | None:
        """The logprobs (or logits) the batch asks for, of what each row's token was chosen from: a greedy row's
        logits (after biases and penalties), a sampled row's tempered and filtered ones (drawn_from)."""
        if batch.max_logprobs is None or not self.logprobs_mode.startswith("processed"):
            return None
        processed = logits
        if drawn_from is not None:
            greedy = torch.tensor([p.greedy for p in batch.params], device=logits.device)
            processed = torch.where(greedy.unsqueeze(1), logits, drawn_from)
        return torch.log_softmax(processed, dim=-1) if self.logprobs_mode == "processed_logprobs" else processed

    def _sample_random(self, drawn_from: torch.Tensor, batch: SamplingBatch, greedy_tokens: torch.Tensor):
        greedy = torch.tensor([p.greedy for p in batch.params], device=drawn_from.device)
        probs = torch.softmax(drawn_from, dim=-1)
        # Exponential race (Gumbel-max in another form): argmax(p / E) with E ~ Exp(1) draws from p.
        sampled = row_argmax(probs / self._exponential_noise(probs, batch.generators))
        return torch.where(greedy, greedy_tokens, sampled)

    def _exponential_noise(self, like: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """Exp(1) noise per row: rows with a seed of their own draw from it, the others in one launch from the
        engine's generator (a launch per row cost a GPU step hundreds of launches at large batches)."""
        noise = torch.empty_like(like)
        unseeded = [row for row, generator in enumerate(generators) if generator is None]
        if len(unseeded) == len(generators):
            noise.exponential_(generator=self.generator)
        elif unseeded:
            rows = torch.tensor(unseeded, device=like.device)
            noise[rows] = torch.empty_like(like[rows]).exponential_(generator=self.generator)
        for row, generator in enumerate(generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        return noise

    @torch.no_grad()
    def verify(self, logits: torch.Tensor, batch: SamplingBatch, drafts: list[list[int]]) -> list[list[SampledToken]]:
        """Verifies each request's draft tokens against the model and returns the tokens it keeps: the accepted
        drafts and one more (the correction at the first rejection, or a bonus token after the last draft).

        ``logits`` has len(drafts[i]) + 1 rows per request, in order: row j predicts the token after draft j - 1.
        Greedy rows accept a draft that is the argmax, so their tokens are those of plain decoding. Other rows use
        rejection sampling (Leviathan et al., 2023) with a draft distribution that is one point (the proposers are
        deterministic): draft d is accepted with probability p(d), and a rejected one is replaced by a draw from p
        without d, renormalised; so every kept token is distributed as p, the distribution plain sampling draws
        from (temperature, top-k, top-p and min-p applied), after each row's logit bias and min_tokens as in
        plain sampling. Penalties are not applied here: requests that use them get no drafts.
        """
        counts = [len(d) + 1 for d in drafts]
        assert sum(counts) == logits.shape[0], "one row per draft token and one more per request"
        assert not any(p.uses_penalties for p in batch.params), "penalties depend on the tokens before each row"
        rows = _expand_batch(batch, counts)
        logits = logits.float()
        raw = self._raw(logits, rows)
        restore = apply_token_biases(logits, rows.params, rows.output_indexes(), self.eos_token_ids, rows.history_of)
        try:
            return self._verified(logits, rows, drafts, raw)
        except BaseException:
            restore()
            raise

    def _verified(
        self, logits: torch.Tensor, rows: SamplingBatch, drafts: list[list[int]], shown: torch.Tensor | None
    ) -> list[list[SampledToken]]:
        row_drafts = [token for d in drafts for token in (*d, -1)]  # -1: the row after the last draft
        draft_ids = torch.tensor(row_drafts, device=logits.device)
        tokens = row_argmax(logits)
        accepted = tokens == draft_ids
        drawn_from = None
        if not rows.all_greedy:
            drawn_from = _tempered_and_filtered(logits, rows.params)
            tokens, accepted = self._rejection_sample(drawn_from, rows, draft_ids, tokens, accepted)
        if shown is None:
            shown = self._processed(logits, drawn_from, rows)
        token_list, accepted_list = tokens.tolist(), accepted.tolist()
        kept_rows: list[list[int]] = []
        first = 0
        for d in drafts:
            run = 0
            while run < len(d) and accepted_list[first + run]:
                run += 1
            kept_rows.append(list(range(first, first + run + 1)))
            first += len(d) + 1
        kept_tokens = [[*d[: len(r) - 1], token_list[r[-1]]] for d, r in zip(drafts, kept_rows, strict=True)]
        flat_rows = [row for r in kept_rows for row in r]
        flat_tokens = [t for ts in kept_tokens for t in ts]
        results = self._on_device(
            torch.tensor(flat_tokens, device=logits.device),
            None if shown is None else shown[torch.tensor(flat_rows, device=logits.device)],
            _select_rows(rows, flat_rows),
        ).tokens()
        grouped, at = [], 0
        for r in kept_rows:
            grouped.append(results[at : at + len(r)])
            at += len(r)
        return grouped

    def _rejection_sample(
        self,
        drawn_from: torch.Tensor,
        rows: SamplingBatch,
        draft_ids: torch.Tensor,
        greedy_tokens: torch.Tensor,
        greedy_accepted: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's token if its draft is rejected (or its bonus token), and whether its draft is accepted."""
        params = rows.params
        greedy = torch.tensor([p.greedy for p in params], device=drawn_from.device)
        probs = torch.softmax(drawn_from, dim=-1)
        has_draft = draft_ids >= 0
        index = draft_ids.clamp(min=0).unsqueeze(1)
        draft_prob = probs.gather(1, index).squeeze(1) * has_draft
        uniform = self._uniform(len(params), rows.generators, drawn_from.device)
        accepted = uniform < draft_prob
        # p without the draft token: argmax(p / E) draws from p renormalised, whatever the scale.
        residual = probs.scatter(1, index, torch.zeros_like(draft_prob).unsqueeze(1))
        residual = torch.where(has_draft.unsqueeze(1), residual, probs)  # a bonus row draws from p itself
        sampled = row_argmax(residual / self._exponential_noise(residual, rows.generators))
        return torch.where(greedy, greedy_tokens, sampled), torch.where(greedy, greedy_accepted, accepted)

    def _uniform(self, num_rows: int, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
        values = torch.rand(num_rows, generator=self.generator, device=device)
        for row, generator in enumerate(generators):
            if generator is not None:
                values[row] = torch.rand((), generator=generator, device=device)
        return values

    @staticmethod
    def _on_device(tokens: torch.Tensor, shown: torch.Tensor | None, batch: SamplingBatch) -> SampledOnDevice:
        """The tokens and the logprobs (or logits: logprobs_mode) the batch asks for, gathered on the device and sent
        to the host."""
        if shown is None or batch.max_logprobs is None:
            return SampledOnDevice(tokens, None, batch.params)
        chosen = shown.gather(1, tokens.unsqueeze(1)).squeeze(1)
        top = shown.topk(max(batch.max_logprobs, 1), dim=-1)
        return SampledOnDevice(tokens, (chosen, top.values, top.indices), batch.params)


def _tempered_and_filtered(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """What a sampled row's token is drawn from: its logits over its temperature, filtered (a greedy row's, which
    its argmax decides, filtered at temperature 1)."""
    temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=logits.device)
    return filter_top_k_top_p_min_p(logits / temperature.unsqueeze(1), params)


def filter_top_k_top_p_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Sets to -inf every logit outside a row's top-k, its top-p nucleus, or below min_p times its best prob."""
    vocab = logits.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if all(k == vocab for k in top_k) and all(p == 1.0 for p in top_p) and all(m == 0.0 for m in min_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    remove = ranks >= logits.new_tensor(top_k, dtype=torch.long).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token goes if the mass before it already does.
    mass_before = probs.cumsum(dim=-1) - probs
    remove = mass_before >= logits.new_tensor(top_p).unsqueeze(1)
    remove |= probs < probs[:, :1] * logits.new_tensor(min_p).unsqueeze(1)
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def _select_rows(batch: SamplingBatch, rows: list[int], steps: list[int] | None = None) -> SamplingBatch:
    """The batch's settings of these rows (drafts' verification, where no row has penalties or placeholders); steps:
    how many tokens past its row's each one samples (a draft's position after its request's last token)."""
    index = batch.output_indexes()
    history_of = batch.history_of

    def selected_history(row: int) -> Sequence[int]:
        assert history_of is not None
        return history_of(rows[row])

    return SamplingBatch(
        [batch.params[row] for row in rows],
        [batch.generators[row] for row in rows],
        [batch.token_counts[row] for row in rows],
        output_index=[index[row] + step for row, step in zip(rows, steps or [0] * len(rows), strict=True)],
        history_of=None if history_of is None else selected_history,
    )


def _expand_batch(batch: SamplingBatch, counts: list[int]) -> SamplingBatch:
    """One entry per logits row: each request's settings repeated over its rows, each row a token further on."""
    rows = [row for row, count in enumerate(counts) for _ in range(count)]
    steps = [step for count in counts for step in range(count)]
    return _select_rows(batch, rows, steps)
