"""The bookkeeping behind lazy draft upkeep in vLLM (`integrations/vllm/draft_cache.py`; no vLLM needed)."""

from __future__ import annotations

import pytest

from adaptive_spec.integrations.vllm.draft_cache import DraftCacheTracker, Row

BLOCK = 16


def row(start: int, request: str = "a", first_block: int = 7) -> Row:
    return Row(request, start, tuple(range(first_block, first_block + start // BLOCK + 1)))


def test_a_request_never_seen_is_covered_nowhere_even_past_a_cached_prefix():
    tracker = DraftCacheTracker(BLOCK)
    assert tracker.catch_up_from(row(0)) == 0
    assert tracker.catch_up_from(row(40)) == 0


def test_a_drafting_step_covers_everything_before_the_next_start():
    tracker = DraftCacheTracker(BLOCK)
    tracker.drafted([row(0)])  # the prefill step ran the draft over the prompt
    assert tracker.catch_up_from(row(33)) == 33  # nothing missing


def test_skipped_steps_keep_what_was_covered_when_the_first_was_skipped():
    tracker = DraftCacheTracker(BLOCK)
    tracker.drafted([row(30)])
    tracker.skipped([row(31)])  # covered [0, 31): the step at 30 ran the draft over its tokens
    tracker.skipped([row(32)])
    tracker.skipped([row(40)])
    assert tracker.catch_up_from(row(45)) == 31
    tracker.caught_up(row(45), 31)
    tracker.drafted([row(45)])
    assert tracker.catch_up_from(row(50)) == 50
    assert tracker.stats.skipped_steps == 3 and tracker.stats.catch_ups == 1 and tracker.stats.caught_up_tokens == 14


def test_a_request_skipped_from_its_prefill_catches_up_from_zero():
    tracker = DraftCacheTracker(BLOCK)
    tracker.skipped([row(0)])
    tracker.skipped([row(20)])
    assert tracker.catch_up_from(row(21)) == 0


def test_new_blocks_mean_nothing_is_covered():
    """A request vLLM preempted and re-admitted holds other KV blocks: its old coverage is void."""
    tracker = DraftCacheTracker(BLOCK)
    tracker.drafted([row(40)])
    assert tracker.catch_up_from(row(41, first_block=100)) == 0
    tracker.skipped([row(41)])
    assert tracker.catch_up_from(row(50, first_block=100)) == 0
    assert tracker.catch_up_from(row(10)) == 0  # back at an earlier position: re-admitted, nothing is trusted


def test_requests_are_tracked_apart_and_forgotten_when_they_leave():
    tracker = DraftCacheTracker(BLOCK)
    tracker.drafted([row(20, "a"), row(5, "b", first_block=50)])
    tracker.skipped([row(21, "a"), row(6, "b", first_block=50)])
    assert tracker.catch_up_from(row(30, "a")) == 21
    assert tracker.catch_up_from(row(9, "b", first_block=50)) == 6
    tracker.forget(["b"])
    assert tracker.catch_up_from(row(30, "a")) == 0
    assert tracker.catch_up_from(row(9, "b", first_block=50)) == 6


def test_a_bad_block_size_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        DraftCacheTracker(0)
