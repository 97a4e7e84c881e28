"""Logits -> processed distribution, vectorised over rows that each carry their own settings.

Pure tensor math: no model, no request objects. The engine calls `process_logits` with the same
arguments for the draft and the target at every drafted position (each position with its own
prefix), which is what keeps speculative sampling exact under every transform.

Order: repetition penalty -> masks (allowed set, constraint) -> temperature -> top-k -> top-p ->
min-p, the order Hugging Face `generate` uses. Temperature 0 means greedy: a one-hot on the argmax
of the penalised, masked logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class RowSettings:
    """Per-row sampling knobs as tensors, all shaped [rows]."""

    temperature: torch.Tensor  # float; 0 = greedy
    top_k: torch.Tensor  # long; 0 = off
    top_p: torch.Tensor  # float; 1 = off
    min_p: torch.Tensor  # float; 0 = off
    repetition_penalty: torch.Tensor  # float; 1 = off


def process_logits(
    logits: torch.Tensor,  # [rows, vocab]
    settings: RowSettings,
    seen: torch.Tensor | None = None,  # [rows, vocab] bool: tokens in the prefix (repetition penalty)
    allowed: torch.Tensor | None = None,  # [rows, vocab] bool: tokens the masks allow
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (probs [rows, vocab] float32, empty [rows] bool).

    `empty` marks rows where the masks leave no token with finite logit; their probs are all zero
    and the caller decides what that means (an error if the row must emit, nothing otherwise).
    """
    logits = logits.float()
    greedy = settings.temperature == 0
    if seen is None and allowed is None and bool(greedy.all()):  # the common greedy case: no softmax needed
        best, index = logits.max(dim=-1, keepdim=True)
        probs = torch.zeros_like(logits).scatter_(-1, index, 1.0)
        empty = torch.isneginf(best.squeeze(-1))
        probs[empty] = 0.0
        return probs, empty
    if seen is not None:
        penalty = settings.repetition_penalty[:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, NEG_INF)
    empty = torch.isneginf(logits).all(dim=-1)

    temperature = torch.where(greedy, torch.ones_like(settings.temperature), settings.temperature)
    # Shift by the row maximum before dividing, so a tiny temperature cannot overflow to inf.
    top = logits.amax(dim=-1, keepdim=True)
    shifted = logits - torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    probs = torch.softmax(shifted / temperature[:, None], dim=-1)

    filtered = ~greedy & ((settings.top_k > 0) | (settings.top_p < 1) | (settings.min_p > 0))
    if filtered.any():
        rows = filtered.nonzero().squeeze(-1)
        probs[rows] = _filter_sorted(probs[rows], settings.top_k[rows], settings.top_p[rows], settings.min_p[rows])
    if greedy.any():
        rows = greedy.nonzero().squeeze(-1)
        probs[rows] = one_hot_argmax(logits[rows])
    probs[empty] = 0.0
    return probs, empty


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] -> float one-hot at each row's argmax (lowest id on exact ties)."""
    out = torch.zeros_like(logits, dtype=torch.float32)
    return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _filter_sorted(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Top-k, then top-p over the renormalised survivors, then min-p; one sort for all three.

    Top-k keeps every token tied with the k-th largest probability, as Hugging Face does."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=probs.shape[-1]), probs.shape[-1])
    kth = sorted_probs.gather(-1, (k - 1)[:, None])
    keep = sorted_probs >= kth
    kept = sorted_probs * keep
    kept = kept / kept.sum(dim=-1, keepdim=True)
    mass_before = kept.cumsum(dim=-1) - kept
    keep &= mass_before < top_p[:, None]  # the token that crosses top_p stays; rank 0 always stays
    keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    kept = sorted_probs * keep
    kept = kept / kept.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, kept)
