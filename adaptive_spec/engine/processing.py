"""Per-step glue between requests and the pure sampling math.

`StepSampler` turns a batch of requests into the tensors `process_logits` and `verify` take: each
row's settings, its repetition-penalty and mask state at every drafted position (the request's
committed prefix plus the drafts before that position), and its random numbers for the step. The
draft and the target go through the very same `probs` method, which is the exactness rule.

Random numbers: each request draws 2k + 1 uniforms per step from its own generator (k for
drafting, k for accept tests, one for the recovered/bonus token), so its stream does not depend on
which other requests share the batch.

Failures stay in their row: a constraint that raises, logits that are not finite, settings that
turn finite logits into a non-finite distribution, or masks that allow nothing mark that row and
position as *failed* (probability zero everywhere, with a reason). A draft stops there; a target
row fails only if its emitted sequence reaches that position, as plain decoding would.

Jump-forward: where a row's masks allow exactly one token at its committed position (a grammar's
fixed text: `{"`, a key, `":`), the engine takes those tokens without drafting them (`forced_run`).
Both distributions put probability 1 on such a token, so it is accepted for sure and the target
still checks it in the verify forward (a logit of -inf there fails the row as plain decoding would).
The sampler lays each row out as [forced tokens, drafts]: the drafts are sampled at the positions
after the forced ones, and a row's random stream still draws 2k + 1 uniforms for its k drafts.

Every tensor a step creates lives on `device` (the target's), chosen once by the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ..control.policy import PolicyError, StopRule, ask_stop_rule
from ..modeling.drafters import Draft
from ..sampling.rejection import sample_inverse_cdf
from ..sampling.transforms import RowSettings, process_logits
from .request import Request

# The most tokens one step takes by jump-forward for a row: bounds the verify forward's width.
MAX_FORCED = 32


@dataclass(frozen=True)
class Processed:
    probs: torch.Tensor  # [rows, T, vocab] processed distributions; all zero where failed
    failed: torch.Tensor  # [rows, T] bool: no token can be sampled there
    reasons: dict[tuple[int, int], str]  # (row, column) -> why, for each failed entry
    allowed: torch.Tensor | None = None  # [rows, T, vocab] bool: what the masks allowed (None: all)


@dataclass(frozen=True)
class ForcedRun:
    """Tokens a row's masks force from its committed state, each the only token allowed there.
    states[j] is the constraint state before tokens[j] (states[0] the committed one, states[-1] the
    one after the run); masks[j] the mask at states[j], one more than tokens where the run ended
    at a real choice. seconds: the constraint work it took, for the mask tallies."""

    tokens: tuple[int, ...]
    states: tuple
    masks: tuple[torch.Tensor, ...]
    seconds: float


def forced_run(request: Request, limit: int, vocab_size: int) -> ForcedRun | None:
    """The run of forced tokens at a request's committed position, at most `limit` long; None for a
    request without masks. It stops before a stop token (the step samples that one, so the request
    ends as usual) and where the constraint raises (the sampler meets the error again and fails the
    row there, with its message)."""
    constraint = request.params.constraint
    if limit <= 0 or (constraint is None and request.allowed is None):
        return None
    started = time.perf_counter()
    state = request.constraint_state
    tokens, states, masks = [], [state], []
    try:
        while True:
            masks.append(_row_mask(request, state, vocab_size))
            allowed = masks[-1].nonzero()
            if len(tokens) >= limit or len(allowed) != 1:
                break
            token = int(allowed[0, 0])
            if token in request.params.stop_token_ids:
                break
            state = constraint.advance(state, token) if constraint is not None else None
            tokens.append(token)
            states.append(state)
    except Exception:  # user code: the sampler computes this position again and reports it
        pass
    return ForcedRun(tuple(tokens), tuple(states), tuple(masks[: len(states)]), time.perf_counter() - started)


class StepSampler:
    def __init__(self, requests: Sequence[Request], ks: Sequence[int], vocab_size: int,
                 device: torch.device | str = "cpu", forced: Sequence[ForcedRun | None] = ()):
        self.requests = list(requests)
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        p = [r.params for r in self.requests]

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.device)

        self.settings = RowSettings(
            temperature=column([x.temperature for x in p], torch.float32),
            top_k=column([min(x.top_k, vocab_size) for x in p], torch.long),  # any k >= vocab keeps all
            top_p=column([x.top_p for x in p], torch.float32),
            min_p=column([x.min_p for x in p], torch.float32),
            repetition_penalty=column([x.repetition_penalty for x in p], torch.float32),
        )
        runs = list(forced) or [None] * len(self.requests)
        self.forced = [run.tokens if run is not None else () for run in runs]  # each row's jump-forward tokens
        self.num_forced = torch.as_tensor([len(tokens) for tokens in self.forced], dtype=torch.long)
        batch_k = max(ks, default=0)
        draft_uniforms = torch.full((len(ks), batch_k), 0.5)
        # Laid out as the target verifies a row: its forced tokens (accepted for sure: 0), then its k drafts.
        accept_uniforms = torch.zeros(len(ks), max(map(len, self.forced), default=0) + batch_k)
        final_uniforms = torch.zeros(len(ks))
        for row, (request, k) in enumerate(zip(self.requests, ks)):
            draws = torch.rand(2 * k + 1, generator=request.generator)
            m = len(self.forced[row])
            draft_uniforms[row, :k], accept_uniforms[row, m : m + k] = draws[:k], draws[k : 2 * k]
            final_uniforms[row] = draws[-1]
        self.draft_uniforms = draft_uniforms.to(self.device)
        self.accept_uniforms = accept_uniforms.to(self.device)
        self.final_uniforms = final_uniforms.to(self.device)
        self._needs_seen = [r.params.repetition_penalty != 1 for r in self.requests]
        self._needs_mask = [r.allowed is not None or r.params.constraint is not None for r in self.requests]
        # Along this step's drafts: _states[row][j] is the constraint state at draft position j
        # (before drafts[j]), _masks[row][j] the allowed mask there; both grow lazily.
        # A row's forced run fills its first positions (a draft position counts from the committed one).
        self._states: list[list] = [list(run.states) if run is not None else [r.constraint_state]
                                    for r, run in zip(self.requests, runs)]
        self._masks: list[list[torch.Tensor]] = [list(run.masks) if run is not None else [] for run in runs]
        self._constraint_errors: dict[tuple[int, int], str] = {}  # (row, draft position) -> message
        counted = [run is not None and r.params.constraint is not None for r, run in zip(self.requests, runs)]
        # constraint masks computed per row this step, and their seconds (a forced run's included)
        self.masks = [len(run.masks) if c else 0 for run, c in zip(runs, counted)]
        self.mask_seconds = [run.seconds if c else 0.0 for run, c in zip(runs, counted)]
        self.stop_error: str | None = None  # a policy's stop rule raised while drafting

    def probs(
        self,
        logits: torch.Tensor,  # [rows, T, vocab]
        drafts: torch.Tensor,  # [rows, >= first + T - 1] draft tokens; position j's prefix adds drafts[:, :j]
        first: int,  # draft position of logits[:, 0]
        live: torch.Tensor,  # [rows] long: positions > live[i] are never used, so masks there are skipped
        offsets: Sequence[int] | None = None,  # added to row i's positions (its forced tokens, while drafting)
    ) -> Processed:
        rows, width, vocab = logits.shape
        offsets = offsets or [0] * rows
        drafts, live = drafts.cpu(), live.cpu()
        seen = allowed = None
        if any(self._needs_seen):
            seen = torch.zeros(rows, width, vocab, dtype=torch.bool)
            for row, request in enumerate(self.requests):
                if self._needs_seen[row]:
                    for t in range(width):
                        seen[row, t] = request.seen
                        seen[row, t, drafts[row, : offsets[row] + first + t]] = True
            seen = seen.view(rows * width, vocab).to(self.device)
        if any(self._needs_mask):
            allowed = torch.ones(rows, width, vocab, dtype=torch.bool)
            for row, request in enumerate(self.requests):
                if self._needs_mask[row]:
                    for t in range(width):
                        if first + t <= int(live[row]):
                            allowed[row, t] = self._allowed_at(row, offsets[row] + first + t, drafts)
            allowed = allowed.view(rows * width, vocab).to(self.device)
        settings = RowSettings(*(value.repeat_interleave(width) for value in vars(self.settings).values()))
        flat, empty = process_logits(logits.reshape(rows * width, vocab), settings, seen, allowed)
        probs, empty = flat.view(rows, width, vocab), empty.view(rows, width)
        bad_logits = ~finite_rows(logits)
        bad_probs = ~torch.isfinite(probs).all(dim=-1) | ((probs.sum(dim=-1) <= 0) & ~empty)
        failed = empty | bad_logits | bad_probs
        reasons = {}
        if failed.any():
            probs = probs.masked_fill(failed[..., None], 0.0)
            for row, t in failed.nonzero().tolist():
                reasons[row, t] = self._constraint_errors.get((row, offsets[row] + first + t)) or (
                    "the model produced non-finite logits (NaN or +inf)" if bad_logits[row, t] else
                    "the sampling settings turn the logits into a non-finite distribution" if bad_probs[row, t] else
                    "the allowed-token set and constraint leave no token to generate")
        return Processed(probs, failed, reasons, allowed.view(rows, width, vocab) if allowed is not None else None)

    def draft_sampler(self, limits: torch.Tensor, stop_rule: StopRule | None = None):
        """A `DraftSampler` for this step; `limits` [rows] is each row's k. With a `stop_rule` (the
        policy's `keep_drafting`), each drafting row's confidence (the draft's top raw probability
        over the tokens its masks allow) is shown to it and its answer ends rows early (a rule that
        looks at the draft only, so exactness is untouched). A rule that raises stops every row and
        leaves `stop_error` set."""
        limits = limits.cpu()
        drafting = limits > 0

        offsets = self.num_forced.tolist()

        def sample(position: int, logits: torch.Tensor, drafted: torch.Tensor):
            nonlocal drafting
            live = torch.where(limits > position, torch.full_like(limits, position), torch.full_like(limits, -1))
            prefix = (self._forced_then(drafted.cpu(), torch.full((len(limits),), position, dtype=torch.long))
                      if any(self.forced) else drafted)
            processed = self.probs(logits[:, None].to(self.device), prefix, position, live, offsets)
            probs = processed.probs[:, 0]
            keep = drafting & ~processed.failed[:, 0].cpu() & (limits > position)
            more = keep.clone()
            if stop_rule is not None and keep.any():
                confidence = _confidence(logits, processed.allowed)
                shown = [c if row_keeps else None for c, row_keeps in zip(confidence, keep.tolist())]
                answers = torch.as_tensor(self._ask_stop_rule(stop_rule, position, shown))
                keep &= answers > 0
                more &= answers == 1
            drafting = more
            uniforms = (self.draft_uniforms[:, position] if position < self.draft_uniforms.shape[1]
                        else torch.full((len(keep),), 0.5, device=self.device))
            tokens = sample_inverse_cdf(torch.where(keep.to(self.device)[:, None], probs, 1.0), uniforms)
            return tokens, probs, keep, more

        return sample

    def verified(self, draft: Draft | None) -> Draft | None:
        """The step's draft as the target verifies it: each row's forced tokens, then its drafts
        (None: nothing forced and nothing drafted). A forced token's draft probability is one-hot."""
        if not any(self.forced):
            return draft
        rows = len(self.requests)
        counts = draft.num_drafted.cpu() if draft is not None else torch.zeros(rows, dtype=torch.long)
        tokens = self._forced_then(draft.tokens.cpu() if draft is not None else torch.zeros(rows, 0, dtype=torch.long),
                                   counts)
        probs = None  # None = one-hot on the tokens: right for forced tokens and model-free drafts alike
        if draft is not None and draft.probs is not None:
            probs = draft.probs.new_zeros(rows, tokens.shape[1], draft.probs.shape[-1])
            for row, forced in enumerate(self.forced):
                m, c = len(forced), int(counts[row])
                probs[row, torch.arange(m), torch.as_tensor(forced, dtype=torch.long)] = 1.0
                probs[row, m : m + c] = draft.probs[row, :c]
        positions, catchup = (draft.positions, draft.catchup_tokens) if draft is not None else (0, 0)
        return Draft(tokens.to(self.device), probs, (self.num_forced + counts).to(self.device), positions, catchup)

    def states_along(self, row: int, kept: int) -> list:
        """The constraint states after each of the first `kept` tokens of the row's verified draft
        (forced tokens, then drafts) that this step made: only tokens the target kept, since the
        state past a rejected draft is not the state past the token that replaced it. The engine
        moves the committed state along them, where advancing again would make a grammar build
        their masks a second time."""
        states = self._states[row][1 : kept + 1]
        return states[: next((i for i, state in enumerate(states) if state is _DEAD), len(states))]

    def _forced_then(self, drafts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """[rows, m_i + counts_i] tokens, left-aligned: row i's forced tokens, then its first counts_i drafts."""
        width = int((self.num_forced + counts).max()) if len(counts) else 0
        out = torch.zeros(len(self.forced), width, dtype=torch.long)
        for row, forced in enumerate(self.forced):
            m, c = len(forced), int(counts[row])
            out[row, :m] = torch.as_tensor(forced, dtype=torch.long)
            out[row, m : m + c] = drafts[row, :c]
        return out

    def _ask_stop_rule(self, stop_rule: StopRule, position: int, shown: list[float | None]) -> list[int]:
        if self.stop_error is not None:
            return [0] * len(shown)
        try:
            return ask_stop_rule(stop_rule, position, shown)
        except PolicyError as error:  # the policy is at fault, not the drafter: stop drafting, report
            self.stop_error = str(error)
            return [0] * len(shown)

    def _allowed_at(self, row: int, position: int, drafts: torch.Tensor) -> torch.Tensor:
        """The mask at a drafted position, following the constraint through the drafts before it.

        A draft the mask forbids is rejected for sure (the target gives it probability 0), so
        positions after it are never used: they get an all-true mask and the constraint is never
        advanced through a forbidden token. A constraint that raises leaves an all-false mask at
        that position (nothing can be drafted or emitted there) and its message as the reason.
        """
        masks, states = self._masks[row], self._states[row]
        constraint = self.requests[row].params.constraint
        while len(masks) <= position:
            j = len(masks)
            if j > 0 and (states[j - 1] is _DEAD or not masks[j - 1][int(drafts[row, j - 1])]):
                states.append(_DEAD)
                masks.append(torch.ones(self.vocab_size, dtype=torch.bool))
                continue
            started = time.perf_counter()
            try:
                if j > 0:
                    states.append(constraint.advance(states[j - 1], int(drafts[row, j - 1]))
                                  if constraint is not None else None)
                mask = _row_mask(self.requests[row], states[j], self.vocab_size)
            except Exception as error:  # user code: it fails this row at this position, nothing else
                self._constraint_errors[row, j] = f"the constraint raised {type(error).__name__}: {error}"
                del states[j:]
                states.append(_DEAD)
                mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            if constraint is not None:
                self.masks[row] += 1
                self.mask_seconds[row] += time.perf_counter() - started
            masks.append(mask)
        return masks[position]


def _confidence(logits: torch.Tensor, allowed: torch.Tensor | None) -> list[float]:
    """Each row's draft confidence: the top probability of the draft's raw logits over the tokens its
    masks allow (a token the grammar forces is a sure draft, whatever the raw logits say there)."""
    logits = logits.float()
    if allowed is not None:
        logits = logits.masked_fill(~allowed[:, 0].to(logits.device), float("-inf"))
    return torch.softmax(logits, dim=-1).amax(dim=-1).nan_to_num(0.0).tolist()


def _row_mask(request: Request, state, vocab_size: int) -> torch.Tensor:
    """What a request may emit at a constraint state: its allowed set and the constraint's tokens."""
    mask = request.allowed
    mask = mask.clone() if mask is not None else torch.ones(vocab_size, dtype=torch.bool)
    constraint = request.params.constraint
    if constraint is not None:
        mask &= _constraint_mask(constraint.allowed_tokens(state), vocab_size)
    return mask


def _constraint_mask(ids, vocab_size: int) -> torch.Tensor:
    if isinstance(ids, torch.Tensor) and ids.dtype == torch.bool:
        if ids.shape != (vocab_size,):
            raise ValueError(f"allowed_tokens returned a mask of shape {tuple(ids.shape)}, expected ({vocab_size},)")
        return ids.cpu()
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    ids = [int(t) for t in ids if 0 <= int(t) < vocab_size]
    if ids:
        mask[torch.as_tensor(ids)] = True
    return mask


_DEAD = object()  # constraint state past a forbidden draft or a failure: nothing past it is ever used


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[..., vocab] -> [...] bool: no NaN and no +inf (a model may legitimately emit -inf)."""
    return ~(torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1)
