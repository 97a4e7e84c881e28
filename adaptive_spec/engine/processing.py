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

Every tensor a step creates lives on `device` (the target's), chosen once by the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ..control.policy import PolicyError, StopRule, ask_stop_rule
from ..sampling.rejection import sample_inverse_cdf
from ..sampling.transforms import RowSettings, process_logits
from .request import Request


@dataclass(frozen=True)
class Processed:
    probs: torch.Tensor  # [rows, T, vocab] processed distributions; all zero where failed
    failed: torch.Tensor  # [rows, T] bool: no token can be sampled there
    reasons: dict[tuple[int, int], str]  # (row, column) -> why, for each failed entry


class StepSampler:
    def __init__(self, requests: Sequence[Request], ks: Sequence[int], vocab_size: int,
                 device: torch.device | str = "cpu"):
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
        batch_k = max(ks, default=0)
        draft_uniforms = torch.full((len(ks), batch_k), 0.5)
        accept_uniforms = torch.zeros(len(ks), batch_k)
        final_uniforms = torch.zeros(len(ks))
        for row, (request, k) in enumerate(zip(self.requests, ks)):
            draws = torch.rand(2 * k + 1, generator=request.generator)
            draft_uniforms[row, :k], accept_uniforms[row, :k] = draws[:k], draws[k : 2 * k]
            final_uniforms[row] = draws[-1]
        self.draft_uniforms = draft_uniforms.to(self.device)
        self.accept_uniforms = accept_uniforms.to(self.device)
        self.final_uniforms = final_uniforms.to(self.device)
        self._needs_seen = [r.params.repetition_penalty != 1 for r in self.requests]
        self._needs_mask = [r.allowed is not None or r.params.constraint is not None for r in self.requests]
        # Along this step's drafts: _states[row][j] is the constraint state at draft position j
        # (before drafts[j]), _masks[row][j] the allowed mask there; both grow lazily.
        self._states: list[list] = [[r.constraint_state] for r in self.requests]
        self._masks: list[list[torch.Tensor]] = [[] for _ in self.requests]
        self._constraint_errors: dict[tuple[int, int], str] = {}  # (row, draft position) -> message
        self.masks = [0] * len(self.requests)  # constraint masks computed per row this step, and their seconds
        self.mask_seconds = [0.0] * len(self.requests)
        self.stop_error: str | None = None  # a policy's stop rule raised while drafting

    def probs(
        self,
        logits: torch.Tensor,  # [rows, T, vocab]
        drafts: torch.Tensor,  # [rows, >= first + T - 1] draft tokens; position j's prefix adds drafts[:, :j]
        first: int,  # draft position of logits[:, 0]
        live: torch.Tensor,  # [rows] long: positions > live[i] are never used, so masks there are skipped
    ) -> Processed:
        rows, width, vocab = logits.shape
        positions = range(first, first + width)
        drafts, live = drafts.cpu(), live.cpu()
        seen = allowed = None
        if any(self._needs_seen):
            seen = torch.zeros(rows, width, vocab, dtype=torch.bool)
            for row, request in enumerate(self.requests):
                if self._needs_seen[row]:
                    for t, position in enumerate(positions):
                        seen[row, t] = request.seen
                        seen[row, t, drafts[row, :position]] = True
            seen = seen.view(rows * width, vocab).to(self.device)
        if any(self._needs_mask):
            allowed = torch.ones(rows, width, vocab, dtype=torch.bool)
            for row, request in enumerate(self.requests):
                if self._needs_mask[row]:
                    for t, position in enumerate(positions):
                        if position <= int(live[row]):
                            allowed[row, t] = self._allowed_at(row, position, drafts)
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
                reasons[row, t] = self._constraint_errors.get((row, first + t)) or (
                    "the model produced non-finite logits (NaN or +inf)" if bad_logits[row, t] else
                    "the sampling settings turn the logits into a non-finite distribution" if bad_probs[row, t] else
                    "the allowed-token set and constraint leave no token to generate")
        return Processed(probs, failed, reasons)

    def draft_sampler(self, limits: torch.Tensor, stop_rule: StopRule | None = None):
        """A `DraftSampler` for this step; `limits` [rows] is each row's k. With a `stop_rule` (the
        policy's `keep_drafting`), each drafting row's confidence (the draft's top raw probability)
        is shown to it and its answer ends rows early (a rule that looks at the draft only, so
        exactness is untouched). A rule that raises stops every row and leaves `stop_error` set."""
        limits = limits.cpu()
        drafting = limits > 0

        def sample(position: int, logits: torch.Tensor, drafted: torch.Tensor):
            nonlocal drafting
            live = torch.where(limits > position, torch.full_like(limits, position), torch.full_like(limits, -1))
            processed = self.probs(logits[:, None].to(self.device), drafted, position, live)
            probs = processed.probs[:, 0]
            keep = drafting & ~processed.failed[:, 0].cpu() & (limits > position)
            more = keep.clone()
            if stop_rule is not None and keep.any():
                confidence = torch.softmax(logits.float(), dim=-1).amax(dim=-1).tolist()
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
            mask = self.requests[row].allowed
            mask = mask.clone() if mask is not None else torch.ones(self.vocab_size, dtype=torch.bool)
            started = time.perf_counter()
            try:
                if j > 0:
                    states.append(constraint.advance(states[j - 1], int(drafts[row, j - 1]))
                                  if constraint is not None else None)
                if constraint is not None:
                    mask &= self._constraint_mask(constraint.allowed_tokens(states[j]))
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

    def _constraint_mask(self, ids) -> torch.Tensor:
        if isinstance(ids, torch.Tensor) and ids.dtype == torch.bool:
            if ids.shape != (self.vocab_size,):
                raise ValueError(f"allowed_tokens returned a mask of shape {tuple(ids.shape)}, "
                                 f"expected ({self.vocab_size},)")
            return ids.cpu()
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        ids = [int(t) for t in ids if 0 <= int(t) < self.vocab_size]
        if ids:
            mask[torch.as_tensor(ids)] = True
        return mask


_DEAD = object()  # constraint state past a forbidden draft or a failure: nothing past it is ever used


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[..., vocab] -> [...] bool: no NaN and no +inf (a model may legitimately emit -inf)."""
    return ~(torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1)
