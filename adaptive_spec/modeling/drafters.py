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
    # For the cost model (0 = not reported): positions the draft loop evaluated, and the most
    # context tokens a row fed before drafting (its cache's catch-up).
    positions: int = 0
    catchup_tokens: int = 0


class DraftSampler(Protocol):
    def __call__(
        self, position: int, logits: torch.Tensor, drafted: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(position j, draft logits [rows, vocab], drafted so far [rows, j]) ->
        (tokens [rows], processed probs [rows, vocab], keep [rows] bool: the token is a draft,
        more [rows] bool: draft another position after it). A row stops at its first keep False
        or more False; position j + 1 is never fed for a row whose `more` is False."""
        ...


@runtime_checkable
class Drafter(Protocol):
    """What the engine calls. `DrafterBase` gives the attributes and the no-op methods defaults.

    max_positions: the longest context (prompt + emitted + drafts) the drafter can take, or None.
    The engine caps each row's k by it; a row whose context outgrows it simply stops drafting.
    attention_window: a sliding-window drafter's window, or None (the engine refuses requests
    that could not fit it).
    """

    vocab_size: int | None  # logits width, or None for a model-free drafter
    max_positions: int | None
    attention_window: int | None

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


class DrafterBase:
    """Defaults for a drafter: no position limit, no window, nothing to track per row."""

    vocab_size: int | None = None
    max_positions: int | None = None
    attention_window: int | None = None

    def add_requests(self, contexts: Sequence[Sequence[int]]) -> None:
        pass

    def keep_rows(self, rows: Sequence[int]) -> None:
        pass

    def accept(self, num_accepted: torch.Tensor) -> None:
        pass


class ModelDrafter(DrafterBase):
    """A small causal LM sharing the target's tokenizer, with its own ragged KV cache.

    Only rows that draft at a position are fed there (the others get padding), so a row is never
    fed past its own k. A row whose context no longer fits `max_positions` is *detached*: it keeps
    a placeholder row and is never fed again; the engine's caps keep its k at 0.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model.eval()
        self.kv = RaggedKV(model)
        self.vocab_size = logits_width(model)
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.attention_window = self.kv.attention_window
        self._num_cached: list[int] = []  # tokens of each row's context held in the cache; -1 = detached
        self._pending: tuple[torch.Tensor, list[int], list[int]] | None = None  # (lengths before, fed context, fed drafts)

    def add_requests(self, contexts: Sequence[Sequence[int]]) -> None:
        old_rows = self.kv.num_rows
        # A prompt the draft cannot hold gets a one-token placeholder row and is detached.
        fits = [self._fits(len(context)) for context in contexts]
        prefixes = [list(context) if ok else list(context[:1]) for context, ok in zip(contexts, fits)]
        groups = same_length_groups(prefixes)
        for group in groups:  # equal lengths prefill together, unpadded
            rows = RaggedKV(self.model)
            rows.forward([prefixes[i] for i in group], logits_to_keep=1)
            self.kv.append_rows(rows)
        appended = [i for group in groups for i in group]
        if appended != sorted(appended):  # put the new rows back in the order they were given
            position = {index: old_rows + n for n, index in enumerate(appended)}
            self.kv.select_rows(list(range(old_rows)) + [position[i] for i in range(len(contexts))])
        self._num_cached += [len(context) if ok else -1 for context, ok in zip(contexts, fits)]

    def keep_rows(self, rows: Sequence[int]) -> None:
        self.kv.select_rows(rows)
        self._num_cached = [self._num_cached[row] for row in rows]
        self._pending = None

    def propose(self, contexts: Sequence[Sequence[int]], num_tokens: Sequence[int], sample: DraftSampler) -> Draft:
        rows, batch_k = len(contexts), max(num_tokens)
        wanted = torch.as_tensor(list(num_tokens))
        # 1. Catch up on tokens the draft has not seen (one after each step, more after k = 0 steps).
        for row, context in enumerate(contexts):
            if self._num_cached[row] >= 0 and not self._fits(len(context) + max(int(wanted[row]) - 1, 0)):
                self._num_cached[row] = -1  # outgrew the draft's positions: never fed again
        uncached = [list(context[cached:]) if cached >= 0 else [] for context, cached in zip(contexts, self._num_cached)]
        before = self.kv.lengths
        logits = self.kv.forward(uncached, logits_to_keep=1)[:, -1]
        # 2. Draft up to batch_k positions; a row is fed only while it still drafts, and the loop
        # ends when no row does (a stop rule may end rows early).
        tokens = torch.zeros(rows, batch_k, dtype=torch.long)
        probs = None
        alive = wanted > 0  # rows drafting at this position
        num_drafted = torch.zeros(rows, dtype=torch.long)
        fed_drafts = torch.zeros(rows, dtype=torch.long)  # drafts fed back into the cache
        positions = 0
        for position in range(batch_k):
            if position:
                if not alive.any():
                    break
                logits = self.kv.forward(tokens[:, position - 1 : position], logits_to_keep=1,
                                         real=alive[:, None])[:, -1]
                fed_drafts += alive.long()
            token, prob, keep, more = sample(position, logits, tokens[:, :position])
            positions += 1
            if probs is None:
                probs = prob.new_zeros(rows, batch_k, prob.shape[-1])
            tokens[:, position], probs[:, position] = token.to(tokens.device), prob
            kept = alive & keep.cpu()
            num_drafted += kept.long()
            alive = kept & more.cpu() & (wanted > position + 1)
        self._pending = (before, [len(u) for u in uncached], fed_drafts.tolist())
        return Draft(tokens, probs, num_drafted, positions, max((len(u) for u in uncached), default=0))

    def accept(self, num_accepted: torch.Tensor) -> None:
        before, fed_context, fed_drafts = self._pending
        kept = [context + min(int(accepted), drafts)
                for context, accepted, drafts in zip(fed_context, num_accepted.tolist(), fed_drafts)]
        self.kv.truncate(before + torch.as_tensor(kept))
        self._num_cached = [cached + fed if cached >= 0 else -1
                            for cached, fed in zip(self._num_cached, kept)]
        self._pending = None

    def _fits(self, length: int) -> bool:
        return self.max_positions is None or length <= self.max_positions


def check_draft(draft: Draft, ks: Sequence[int], vocab_size: int,
                device: torch.device) -> tuple[Draft | None, str | None]:
    """Validate a drafter's output before the target sees it: (usable draft or None, problem or None).

    A draft that is not shaped like one is dropped whole. Row by row, a count outside
    0..columns, a drafted id outside the vocabulary, or draft probabilities that are not finite,
    negative, or zero at the drafted token (the accept test divides by it) make that row a row
    without drafts. Counts above the row's k are cut to k. Filler ids are replaced by 0.
    """
    rows = len(ks)
    if not isinstance(draft, Draft):
        return None, f"propose must return a Draft, got {type(draft).__name__}"
    tokens, counts, probs = draft.tokens, draft.num_drafted, draft.probs
    if not (isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and tokens.shape[0] == rows
            and not tokens.is_floating_point()):
        return None, f"tokens must be an integer tensor [rows={rows}, K], got {_describe(tokens)}"
    if not (isinstance(counts, torch.Tensor) and counts.shape == (rows,) and not counts.is_floating_point()):
        return None, f"num_drafted must be an integer tensor [rows={rows}], got {_describe(counts)}"
    columns = tokens.shape[1]
    if probs is not None and not (isinstance(probs, torch.Tensor) and probs.shape == (rows, columns, vocab_size)):
        return None, f"probs must be None or [rows, K={columns}, vocab={vocab_size}], got {_describe(probs)}"
    tokens, counts = tokens.long().to(device), counts.long().to(device)
    drafted = torch.arange(columns, device=device)[None, :] < counts[:, None]  # [rows, K]
    in_vocab = (tokens >= 0) & (tokens < vocab_size)
    bad = (counts < 0) | (counts > columns) | (drafted & ~in_vocab).any(dim=1)
    if probs is not None:
        probs = probs.to(device)
        at_token = probs.gather(-1, torch.where(in_vocab, tokens, 0)[..., None]).squeeze(-1)
        broken = ~torch.isfinite(probs).all(dim=-1) | (probs < 0).any(dim=-1) | ~(at_token > 0)
        bad |= (drafted & broken).any(dim=1)
    limits = torch.as_tensor(list(ks), device=device)
    counts = torch.where(bad, 0, torch.minimum(counts, limits))
    checked = Draft(torch.where(in_vocab, tokens, 0), probs, counts, int(draft.positions), int(draft.catchup_tokens))
    if not bad.any():
        return checked, None
    rows_bad = bad.nonzero().flatten().tolist()
    return checked, f"rows {rows_bad[:5]}: drafted ids outside 0..{vocab_size - 1}, counts outside 0..{columns}, " \
                    "or unusable draft probabilities"


def trim_draft(draft: Draft) -> Draft:
    """Drop the columns past the longest row's count (rows that stopped early leave them empty)."""
    width = int(draft.num_drafted.max()) if draft.num_drafted.numel() else 0
    if width == draft.tokens.shape[1]:
        return draft
    probs = draft.probs[:, :width] if draft.probs is not None else None
    return Draft(draft.tokens[:, :width], probs, draft.num_drafted, draft.positions, draft.catchup_tokens)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def logits_width(model: torch.nn.Module) -> int:
    """Rows of the output head: the width of the logits the model produces."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "out_features", None):  # also int8-quantised heads
        return int(head.out_features)
    if head is not None and isinstance(getattr(head, "weight", None), torch.Tensor):
        return int(head.weight.shape[0])
    return int(model.config.vocab_size)


class NgramDrafter(DrafterBase):
    """Prompt lookup: propose what followed the most recent earlier occurrence of the context's
    longest matching suffix n-gram (max_ngram down to min_ngram). Model-free and stateless.

    Its proposal is deterministic given the context, i.e. a one-hot draft distribution, so the
    accept test is exact under any sampling settings (probs=None tells `verify` so).
    """

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

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
