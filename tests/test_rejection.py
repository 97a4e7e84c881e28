"""Forced-distribution cases of the accept / recover / bonus step (pure math, no models)."""

from __future__ import annotations

import torch

from adaptive_spec.sampling import sample_inverse_cdf, verify


def one_hot(tokens, vocab=5):
    return torch.nn.functional.one_hot(torch.as_tensor(tokens), vocab).float()


def test_all_accepted_then_bonus():
    # Target agrees with every draft; the bonus comes from the last target row.
    draft_tokens = torch.tensor([[1, 2, 3]])
    target = one_hot([[1, 2, 3, 4]])
    verdict = verify(draft_tokens, torch.tensor([3]), target, one_hot([[1, 2, 3]]), torch.rand(1, 3), torch.rand(1))
    assert verdict.num_accepted.tolist() == [3]
    assert verdict.final_tokens.tolist() == [4]
    assert verdict.rejected.tolist() == [False]


def test_first_rejected_recovers_from_residual():
    # Draft put all its mass on 1, the target none: rejection for sure; the residual is the target.
    draft_tokens = torch.tensor([[1, 2]])
    target = torch.tensor([[[0.0, 0.0, 0.5, 0.5, 0.0], [0.2] * 5, [0.2] * 5]])
    verdict = verify(draft_tokens, torch.tensor([2]), target, one_hot([[1, 2]]), torch.zeros(1, 2), torch.tensor([0.75]))
    assert verdict.num_accepted.tolist() == [0]
    assert verdict.rejected.tolist() == [True]
    assert verdict.final_tokens.tolist() == [3]  # inverse CDF of [0, 0, .5, .5, 0] at 0.75


def test_middle_rejected_and_residual_excludes_draft_mass():
    draft_tokens = torch.tensor([[2, 0, 4]])
    draft = torch.tensor([[[0, 0, 1.0, 0, 0], [0.6, 0.4, 0, 0, 0], [0, 0, 0, 0, 1.0]]])
    target = torch.tensor([[[0, 0, 1.0, 0, 0], [0.3, 0.7, 0, 0, 0], [0.2] * 5, [0.2] * 5]])
    # Position 1: accept prob = 0.3 / 0.6 = 0.5; u = 0.9 rejects. Residual = max(0, t - d) = [0, 0.3, 0...].
    verdict = verify(draft_tokens, torch.tensor([3]), target, draft, torch.tensor([[0.0, 0.9, 0.0]]), torch.tensor([0.0]))
    assert verdict.num_accepted.tolist() == [1]
    assert verdict.final_tokens.tolist() == [1]
    # The same with u = 0.4 accepts position 1, then position 2 (target 0.2 / draft 1.0) rejects at u=0.5.
    verdict = verify(draft_tokens, torch.tensor([3]), target, draft, torch.tensor([[0.0, 0.4, 0.5]]), torch.tensor([0.99]))
    assert verdict.num_accepted.tolist() == [2]
    assert verdict.final_tokens.tolist() == [3]  # residual [.2, .2, .2, .2, 0] at 0.99 -> token 3


def test_greedy_is_argmax_matching_over_a_ragged_batch():
    draft_tokens = torch.tensor([[1, 2, 3], [4, 4, 0], [0, 0, 0]])
    num_drafts = torch.tensor([3, 2, 0])  # row 2 runs at k = 0; row 1 drafts two
    target_argmax = [[1, 2, 0, 4], [4, 1, 2, 2], [3, 0, 0, 0]]
    verdict = verify(draft_tokens, num_drafts, one_hot(target_argmax), one_hot(draft_tokens.tolist()),
                     torch.rand(3, 3), torch.rand(3))
    assert verdict.num_accepted.tolist() == [2, 1, 0]
    assert verdict.final_tokens.tolist() == [0, 1, 3]  # target argmax at the first mismatch (or bonus)
    assert verdict.rejected.tolist() == [True, True, False]


def test_deterministic_drafter_is_a_one_hot_draft():
    # draft_probs=None: accept with probability target(x); a zero-probability draft is always rejected.
    target = torch.tensor([[[0.0, 0.25, 0.75], [1 / 3] * 3]])
    accepted = verify(torch.tensor([[1]]), torch.tensor([1]), target, None, torch.tensor([[0.2]]), torch.tensor([0.0]))
    rejected = verify(torch.tensor([[1]]), torch.tensor([1]), target, None, torch.tensor([[0.3]]), torch.tensor([0.0]))
    assert accepted.num_accepted.tolist() == [1]
    assert rejected.num_accepted.tolist() == [0] and rejected.final_tokens.tolist() == [2]  # residual excludes 1
    never = verify(torch.tensor([[0]]), torch.tensor([1]), target, None, torch.tensor([[0.0]]), torch.tensor([0.5]))
    assert never.num_accepted.tolist() == [0]


def test_inverse_cdf_never_returns_a_zero_probability_token():
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    tokens = sample_inverse_cdf(probs, torch.tensor([0.999999999, 0.0]))
    assert tokens.tolist() == [1, 2]
    uniforms = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    draws = sample_inverse_cdf(probs[:1].expand(20000, -1), uniforms)
    # 20,000 Bernoulli(0.7) draws: |freq - 0.7| < 0.015 fails with probability < 4e-6 (z > 4.6).
    assert abs(draws.float().mean().item() - 0.7) < 0.015
