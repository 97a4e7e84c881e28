"""Per-step glue between requests and the pure sampling math.

`StepSampler` turns a batch of requests into the tensors `process_logits` and `verify` take: each
row's settings, its repetition-penalty and mask state at every drafted position (the request's
committed prefix plus the drafts before that position), and its random numbers for the step. The
draft and the target go through the very same `probs` method, which is the exactness rule.

Random numbers: each request draws 2k + 1 uniforms per step from its own generator (k for
drafting, k for accept tests, one for the recovered/bonus token), so its stream does not depend on
which other requests share the batch.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..sampling.rejection import sample_inverse_cdf
from ..sampling.transforms import RowSettings, process_logits
from .request import Request


class StepSampler:
    def __init__(self, requests: Sequence[Request], ks: Sequence[int], vocab_size: int):
        self.requests = list(requests)
        self.vocab_size = vocab_size
        p = [r.params for r in self.requests]
        self.settings = RowSettings(
            temperature=torch.tensor([x.temperature for x in p], dtype=torch.float32),
            top_k=torch.tensor([x.top_k for x in p], dtype=torch.long),
            top_p=torch.tensor([x.top_p for x in p], dtype=torch.float32),
            min_p=torch.tensor([x.min_p for x in p], dtype=torch.float32),
            repetition_penalty=torch.tensor([x.repetition_penalty for x in p], dtype=torch.float32),
        )
        max_k = max(ks, default=0)
        self.draft_uniforms = torch.full((len(ks), max_k), 0.5)
        self.accept_uniforms = torch.zeros(len(ks), max_k)
        self.final_uniforms = torch.zeros(len(ks))
        for row, (request, k) in enumerate(zip(self.requests, ks)):
            draws = torch.rand(2 * k + 1, generator=request.generator)
            self.draft_uniforms[row, :k], self.accept_uniforms[row, :k] = draws[:k], draws[k : 2 * k]
            self.final_uniforms[row] = draws[-1]
        self._needs_seen = [r.params.repetition_penalty != 1 for r in self.requests]
        self._needs_mask = [r.allowed is not None or r.params.constraint is not None for r in self.requests]
        # Along this step's drafts: _states[row][j] is the constraint state at draft position j
        # (before drafts[j]), _masks[row][j] the allowed mask there; both grow lazily.
        self._states: list[list] = [[r.constraint_state] for r in self.requests]
        self._masks: list[list[torch.Tensor]] = [[] for _ in self.requests]

    def probs(
        self,
        logits: torch.Tensor,  # [rows, T, vocab]
        drafts: torch.Tensor,  # [rows, >= first + T - 1] draft tokens; position j's prefix adds drafts[:, :j]
        first: int,  # draft position of logits[:, 0]
        live: torch.Tensor,  # [rows] long: positions > live[i] are never used, so masks there are skipped
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Processed distributions (probs [rows, T, vocab], empty [rows, T])."""
        rows, width, vocab = logits.shape
        positions = range(first, first + width)
        seen = allowed = None
        if any(self._needs_seen):
            seen = torch.zeros(rows, width, vocab, dtype=torch.bool)
            for row, request in enumerate(self.requests):
                if self._needs_seen[row]:
                    for t, position in enumerate(positions):
                        seen[row, t] = request.seen
                        seen[row, t, drafts[row, :position]] = True
            seen = seen.view(rows * width, vocab)
        if any(self._needs_mask):
            allowed = torch.ones(rows, width, vocab, dtype=torch.bool)
            for row, request in enumerate(self.requests):
                if self._needs_mask[row]:
                    for t, position in enumerate(positions):
                        if position <= int(live[row]):
                            allowed[row, t] = self._allowed_at(row, position, drafts)
            allowed = allowed.view(rows * width, vocab)
        settings = RowSettings(*(value.repeat_interleave(width) for value in vars(self.settings).values()))
        probs, empty = process_logits(logits.reshape(rows * width, vocab), settings, seen, allowed)
        return probs.view(rows, width, vocab), empty.view(rows, width)

    def draft_sampler(self, limits: torch.Tensor, min_confidence: float = 0.0):
        """A `DraftSampler` for this step; `limits` [rows] is each row's k. With `min_confidence`,
        a row stops drafting where the draft's top raw probability falls below it (a rule that looks
        at the draft only, so exactness is untouched)."""

        def sample(position: int, logits: torch.Tensor, drafted: torch.Tensor):
            live = torch.where(limits > position, torch.full_like(limits, position), torch.full_like(limits, -1))
            probs, empty = self.probs(logits[:, None], drafted, position, live)
            probs, empty = probs[:, 0], empty[:, 0]
            ok = ~empty & finite_rows(logits)
            if min_confidence > 0:
                ok &= torch.softmax(logits.float(), dim=-1).amax(dim=-1) >= min_confidence
            tokens = sample_inverse_cdf(torch.where(ok[:, None], probs, 1.0), self.draft_uniforms[:, position]
                                        if position < self.draft_uniforms.shape[1] else torch.full((len(ok),), 0.5))
            return tokens, probs, ok

        return sample

    def _allowed_at(self, row: int, position: int, drafts: torch.Tensor) -> torch.Tensor:
        """The mask at a drafted position, following the constraint through the drafts before it.

        A draft the mask forbids is rejected for sure (the target gives it probability 0), so
        positions after it are never used: they get an all-true mask and the constraint is never
        advanced through a forbidden token.
        """
        masks, states = self._masks[row], self._states[row]
        constraint = self.requests[row].params.constraint
        while len(masks) <= position:
            j = len(masks)
            if j > 0:
                token = int(drafts[row, j - 1])
                if states[j - 1] is _DEAD or not masks[j - 1][token]:
                    states.append(_DEAD)
                    masks.append(torch.ones(self.vocab_size, dtype=torch.bool))
                    continue
                states.append(constraint.advance(states[j - 1], token) if constraint is not None else None)
            mask = self.requests[row].allowed
            mask = mask.clone() if mask is not None else torch.ones(self.vocab_size, dtype=torch.bool)
            if constraint is not None:
                mask &= self._constraint_mask(constraint.allowed_tokens(states[j]))
            masks.append(mask)
        return masks[position]

    def _constraint_mask(self, ids) -> torch.Tensor:
        if isinstance(ids, torch.Tensor) and ids.dtype == torch.bool:
            return ids
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        ids = [int(t) for t in ids if 0 <= int(t) < self.vocab_size]
        if ids:
            mask[torch.as_tensor(ids)] = True
        return mask


_DEAD = object()  # constraint state after a forbidden draft: nothing past it is ever used


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[..., vocab] -> [...] bool: no NaN and no +inf (a model may legitimately emit -inf)."""
    return ~(torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1)
