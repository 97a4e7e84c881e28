"""Drafters: who proposes the tokens the target verifies.

A drafter keeps one row per running request, in the engine's row order. Each step that speculates,
the engine calls `propose` with every row's full context (prompt + emitted tokens) and how many
tokens each row may draft, then `accept` with how many of them the target kept. A step without
speculation (every k = 0) calls neither, so a stateful drafter must catch up on the tokens it has
not seen when it is next asked to propose: contexts are always passed whole for that reason.

Drafters never sample on their own: a model drafter hands its logits to the `DraftSampler` the
engine gives it, which applies the request's transforms with each position's own prefix and uses
the request's own random stream. That is what keeps the draft distribution consistent with the
target's processing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from .kv import RaggedKV, same_length_groups


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [rows, K] long; entries at j >= num_drafted[i] are filler
    probs: torch.Tensor | None  # [rows, K, vocab] processed draft distributions; None = one-hot on tokens
    num_drafted: torch.Tensor  # [rows] long, each <= the k asked for


class DraftSampler(Protocol):
    def __call__(
        self, position: int, logits: torch.Tensor, drafted: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(position j, draft logits [rows, vocab], drafted so far [rows, j]) ->
        (tokens [rows], processed probs [rows, vocab], ok [rows] bool: False where drafting must stop)."""
        ...


@runtime_checkable
class Drafter(Protocol):
    vocab_size: int | None  # logits width, or None for a model-free drafter

    def add_requests(self, contexts: Sequence[Sequence[int]]) -> None:
        """Append one row per new request (its prompt), after the existing rows."""
        ...

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only these rows, in this order (requests finished or were aborted)."""
        ...

    def propose(self, contexts: Sequence[Sequence[int]], num_tokens: Sequence[int], sample: DraftSampler) -> Draft: ...

    def accept(self, num_accepted: torch.Tensor) -> None:
        """How many drafts of the last `propose` each row's target kept ([rows] long)."""
        ...


class ModelDrafter:
    """A small causal LM sharing the target's tokenizer, with its own ragged KV cache."""

    def __init__(self, model: torch.nn.Module):
        self.model = model.eval()
        self.kv = RaggedKV(model)
        self.vocab_size = logits_width(model)
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self._num_cached: list[int] = []  # tokens of each row's context held in the cache
        self._pending: tuple[int, list[int], int] | None = None  # (slot before propose, uncached counts, K)

    def add_requests(self, contexts: Sequence[Sequence[int]]) -> None:
        old_rows = self.kv.num_rows
        groups = same_length_groups(contexts)
        for group in groups:  # equal lengths prefill together, unpadded
            rows = RaggedKV(self.model)
            rows.forward([list(contexts[i]) for i in group], logits_to_keep=1)
            self.kv.append_rows(rows)
        appended = [i for group in groups for i in group]
        if appended != sorted(appended):  # put the new rows back in the order they were given
            position = {index: old_rows + n for n, index in enumerate(appended)}
            self.kv.select_rows(list(range(old_rows)) + [position[i] for i in range(len(contexts))])
        self._num_cached += [len(context) for context in contexts]

    def keep_rows(self, rows: Sequence[int]) -> None:
        self.kv.select_rows(rows)
        self._num_cached = [self._num_cached[row] for row in rows]
        self._pending = None

    def propose(self, contexts: Sequence[Sequence[int]], num_tokens: Sequence[int], sample: DraftSampler) -> Draft:
        rows, max_k = len(contexts), max(num_tokens)
        # 1. Catch up on tokens the draft has not seen (one after each step, more after k = 0 steps).
        uncached = [list(context[cached:]) for context, cached in zip(contexts, self._num_cached)]
        since = self.kv.num_slots
        logits = self.kv.forward(uncached, logits_to_keep=1)[:, -1]
        # 2. Draft max_k tokens for the whole batch; rows asking fewer ignore the rest.
        tokens = torch.zeros(rows, max_k, dtype=torch.long)
        probs = None
        alive = torch.as_tensor(list(num_tokens)) > 0
        num_drafted = torch.zeros(rows, dtype=torch.long)
        for position in range(max_k):
            if position:
                logits = self.kv.forward(tokens[:, position - 1 : position], logits_to_keep=1)[:, -1]
            token, prob, ok = sample(position, logits, tokens[:, :position])
            if probs is None:
                probs = prob.new_zeros(rows, max_k, prob.shape[-1])
            tokens[:, position], probs[:, position] = token, prob
            alive &= ok & (position < torch.as_tensor(list(num_tokens)))
            num_drafted += alive.long()
        self._pending = (since, [len(u) for u in uncached], max_k)
        return Draft(tokens, probs, num_drafted)

    def accept(self, num_accepted: torch.Tensor) -> None:
        since, uncached_counts, max_k = self._pending
        # Drafts d_1..d_{K-1} were fed back; d_K never entered the cache.
        kept_drafts = num_accepted.clamp(max=max_k - 1)
        keep = torch.as_tensor(uncached_counts) + kept_drafts
        self.kv.keep_new(since, keep)
        self._num_cached = [cached + int(k) for cached, k in zip(self._num_cached, keep)]
        self._pending = None


def logits_width(model: torch.nn.Module) -> int:
    """Rows of the output head: the width of the logits the model produces."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "out_features", None):  # also int8-quantised heads
        return int(head.out_features)
    if head is not None and isinstance(getattr(head, "weight", None), torch.Tensor):
        return int(head.weight.shape[0])
    return int(model.config.vocab_size)


class NgramDrafter:
    """Prompt lookup: propose what followed the most recent earlier occurrence of the context's
    longest matching suffix n-gram (max_ngram down to min_ngram). Model-free and stateless.

    Its proposal is deterministic given the context, i.e. a one-hot draft distribution, so the
    accept test is exact under any sampling settings (probs=None tells `verify` so).
    """

    vocab_size = None

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def add_requests(self, contexts: Sequence[Sequence[int]]) -> None:
        pass

    def keep_rows(self, rows: Sequence[int]) -> None:
        pass

    def accept(self, num_accepted: torch.Tensor) -> None:
        pass

    def propose(self, contexts: Sequence[Sequence[int]], num_tokens: Sequence[int], sample: DraftSampler) -> Draft:
        tokens = torch.zeros(len(contexts), max(num_tokens), dtype=torch.long)
        num_drafted = torch.zeros(len(contexts), dtype=torch.long)
        for row, (context, k) in enumerate(zip(contexts, num_tokens)):
            continuation = self.lookup(context, k) if k else []
            tokens[row, : len(continuation)] = torch.as_tensor(continuation, dtype=torch.long)
            num_drafted[row] = len(continuation)
        return Draft(tokens, None, num_drafted)

    def lookup(self, context: Sequence[int], k: int) -> list[int]:
        """Up to k tokens continuing the latest earlier match of the longest suffix n-gram."""
        sequence = np.asarray(context)
        for n in range(min(self.max_ngram, len(sequence) - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(sequence[:-1], n)  # each has a follower
            hits = np.flatnonzero((windows == sequence[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return sequence[start : start + k].tolist()
        return []
