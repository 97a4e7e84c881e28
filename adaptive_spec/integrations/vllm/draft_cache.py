"""Which positions of each request the draft model's KV cache holds, so a step at k = 0 can skip it.

vLLM's draft-model proposer runs the draft over every step's new tokens, even when the step drafts
nothing, to keep the draft's KV cache in step with the target's. That upkeep makes k = 0 inside a
speculative engine cost a draft forward per step (measured on the 2-core CPU: 867 ms a step against
0.56-0.66 s for vLLM without speculation). The lazy alternative, as this project's own HF drafter
does: skip the draft at k = 0, remember from where each request fell behind, and before the next step
that drafts, run the draft once over the missed tokens (a prefill-like catch-up).

This module is the bookkeeping alone (no vLLM): `lazy_draft.py` feeds it from vLLM's proposer.
A request is known by its id and by the KV blocks that hold its covered positions: a request that
vLLM preempted and re-admitted gets new blocks, so a block mismatch means nothing is covered.
A request never seen is taken as not covered at all, even past a prefix-cache hit: the cached
blocks' draft entries may have been written by nobody while the draft was skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Row:
    """One request in a step, as the proposer sees it."""

    request_id: str
    start: int  # the first position the target processes in this step (its tokens before it are cached)
    blocks: tuple[int, ...]  # the request's KV block ids, in order


@dataclass(frozen=True)
class _Coverage:
    upto: int  # positions [0, upto) hold draft KV
    blocks: tuple[int, ...]  # the block ids those positions live in
    synced: bool  # the last step ran the draft: it also covers that step's tokens, so all before the next start


@dataclass
class CatchUpStats:
    """What the lazy scheme did, for tests and reports."""

    skipped_steps: int = 0  # steps that ran no draft at all
    skipped_rows: int = 0  # request-steps left out of a step that drafted for other rows
    catch_ups: int = 0  # request-steps that caught up
    caught_up_tokens: int = 0


class DraftCacheTracker:
    def __init__(self, block_size: int):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.stats = CatchUpStats()
        self._coverage: dict[str, _Coverage] = {}

    def skipped(self, rows: Sequence[Row], whole_step: bool = True) -> None:
        """The draft did not run over these rows (`whole_step`: nor over any row of the step): they
        keep only what they held before it."""
        if whole_step:
            self.stats.skipped_steps += 1
        else:
            self.stats.skipped_rows += len(rows)
        for row in rows:
            covered = self.catch_up_from(row)
            self._coverage[row.request_id] = _Coverage(covered, self._blocks_for(row, covered), synced=False)

    def catch_up_from(self, row: Row) -> int:
        """The first position whose draft KV is missing before `row`'s step (`row.start`: none missing)."""
        coverage = self._coverage.get(row.request_id)
        if coverage is None or row.blocks[:len(coverage.blocks)] != coverage.blocks:
            return 0
        return row.start if coverage.synced else min(coverage.upto, row.start)

    def caught_up(self, row: Row, first: int) -> None:
        """The draft was run over positions [first, row.start) of this request."""
        self.stats.catch_ups += 1
        self.stats.caught_up_tokens += row.start - first

    def drafted(self, rows: Sequence[Row]) -> None:
        """A step ran the draft over its requests' new tokens (after any catch-up)."""
        for row in rows:
            self._coverage[row.request_id] = _Coverage(row.start, self._blocks_for(row, row.start), synced=True)

    def forget(self, live_request_ids) -> None:
        live = set(live_request_ids)
        for request_id in [r for r in self._coverage if r not in live]:
            del self._coverage[request_id]

    def _blocks_for(self, row: Row, positions: int) -> tuple[int, ...]:
        return tuple(row.blocks[:-(-positions // self.block_size)])
