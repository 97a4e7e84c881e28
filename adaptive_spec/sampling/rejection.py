"""Speculative rejection sampling (Leviathan et al. 2211.17192, Chen et al. 2302.01318).

Vocabulary, fixed here for the whole project:
- *accepted*: a drafted token x kept with probability min(1, target(x) / draft(x));
- *recovered*: the token sampled at the first rejected position from the residual
  norm(max(0, target - draft));
- *bonus*: the token sampled from the target after every draft was accepted.
Each request emits its accepted drafts plus exactly one recovered-or-bonus token per step, and the
emitted sequence is distributed exactly as sampling the target alone.

Pure functions over padded tensors; every random number comes in as an argument (the engine draws
them from per-request generators), so these functions are deterministic and model-free. A
deterministic drafter (prompt lookup) is a one-hot draft distribution: pass `draft_probs=None`.
Greedy is the special case where both distributions are one-hot: acceptance is argmax matching.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    num_accepted: torch.Tensor  # [batch] long: accepted drafts per request
    final_tokens: torch.Tensor  # [batch] long: the recovered or bonus token
    rejected: torch.Tensor  # [batch] bool: True where final_tokens is a recovered token


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample one token per row of `probs` [rows, vocab] with `uniforms` [rows] in [0, 1).

    The weights need not be normalised; rows of all zeros return token 0 (callers exclude them).
    """
    cdf = probs.double().cumsum(dim=-1)
    target = uniforms.double() * cdf[:, -1]
    tokens = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    # Rounding can push the search past the last token with mass; pull it back to that token.
    last_positive = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
    return torch.minimum(tokens, last_positive)


def verify(
    draft_tokens: torch.Tensor,  # [batch, K] long; entries at j >= num_drafts are ignored
    num_drafts: torch.Tensor,  # [batch] long, each <= K
    target_probs: torch.Tensor,  # [batch, K + 1, vocab] processed target distributions
    draft_probs: torch.Tensor | None,  # [batch, K, vocab] processed draft distributions; None = one-hot
    accept_uniforms: torch.Tensor,  # [batch, K] in [0, 1)
    final_uniforms: torch.Tensor,  # [batch] in [0, 1)
) -> Verdict:
    batch, max_drafts = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    if max_drafts == 0:
        tokens = sample_inverse_cdf(target_probs[:, 0], final_uniforms)
        return Verdict(torch.zeros_like(num_drafts), tokens, torch.zeros_like(num_drafts, dtype=torch.bool))

    target_at_draft = target_probs[:, :max_drafts].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [batch, K]
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)
    else:
        draft_at_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    # u < target/draft  <=>  u * draft < target: no division, and draft(x) > 0 for a sampled x.
    accepted = accept_uniforms * draft_at_draft < target_at_draft
    accepted &= torch.arange(max_drafts, device=draft_tokens.device)[None, :] < num_drafts[:, None]
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)
    rejected = num_accepted < num_drafts

    final_target = target_probs[rows, num_accepted]  # [batch, vocab]
    at_rejection = num_accepted.clamp(max=max_drafts - 1)
    if draft_probs is None:
        final_draft = torch.zeros_like(final_target).scatter_(-1, draft_tokens[rows, at_rejection][:, None], 1.0)
    else:
        final_draft = draft_probs[rows, at_rejection]
    residual = (final_target - final_draft * rejected[:, None]).clamp(min=0)
    # In exact arithmetic a rejection implies residual mass; guard the float case where it vanished.
    no_mass = residual.sum(dim=-1) <= 0
    residual = torch.where(no_mass[:, None], final_target, residual)
    return Verdict(num_accepted, sample_inverse_cdf(residual, final_uniforms), rejected)
