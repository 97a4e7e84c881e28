"""Jump-forward: tokens a constraint forces (the only one it allows) are taken at the committed position
without drafting them, verified by the target in the same forward as the drafts after them. Tiny
random models and a prefix constraint whose units are a choice followed by forced tokens; the law
under sampling is tested in test_exactness_statistical.py (`grammar-forcing`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from adaptive_spec import PrefixConstraint, SamplingParams, SpecEngine, StaticPolicy
from adaptive_spec.control.cost_model import CostModel, timed_step

from conftest import tiny_lm

FOLLOW = {2: 3, 3: 4, 5: 6}  # units 2 3 4 | 5 6 | 7 | 9 | 11: after a unit's first token the rest is forced
STARTS = ([2, 5, 7], [2, 7, 9], [5, 9, 11])  # the choice of units turns with the position, so greedy varies


def units(generated: tuple[int, ...]) -> list[int]:
    if generated and generated[-1] in FOLLOW:
        return [FOLLOW[generated[-1]]]
    return STARTS[len(generated) % len(STARTS)]


def forced_params(**overrides) -> SamplingParams:
    settings = {"temperature": 0, "max_new_tokens": 30, "constraint": PrefixConstraint(units), **overrides}
    return SamplingParams(**settings)


@pytest.fixture(scope="module")
def pair():
    return tiny_lm(30, vocab=16), tiny_lm(31, vocab=16)


PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5], [11]]


@dataclass
class Recording(StaticPolicy):
    """static:k that keeps every StepRecord it is shown."""

    records: list = field(default_factory=list)

    def observe(self, record):
        self.records.append(record)


def test_greedy_output_is_the_same_with_and_without_jump_forward_and_drafts(pair):
    """Constrained greedy decoding without speculation or jump-forward is the reference; jump-forward
    alone and jump-forward with k = 3 drafts (both asserted to have run) give it token for token."""
    target, draft = pair
    reference = SpecEngine(target, draft, policy="off", jump_forward=False).generate(PROMPTS, forced_params())
    assert all(r.stats.forced == 0 for r in reference)
    for policy in ("off", "static:3"):
        results = SpecEngine(target, draft, policy=policy).generate(PROMPTS, forced_params())
        assert [r.token_ids for r in results] == [r.token_ids for r in reference], policy
        assert all(r.error is None for r in results) and sum(r.stats.forced for r in results) > 0
        if policy == "static:3":
            assert max(k for r in results for k in r.stats.k_per_step) == 3  # drafts really ran beside them


def test_a_step_takes_the_whole_forced_run_and_one_sampled_token(pair):
    """Without drafts, a step emits the forced run and the token after it: fewer steps than tokens."""
    target, draft = pair
    on = SpecEngine(target, draft, policy="off").generate([[1, 2]], forced_params())[0]
    off = SpecEngine(target, draft, policy="off", jump_forward=False).generate([[1, 2]], forced_params())[0]
    assert on.token_ids == off.token_ids and len(on.token_ids) == 30
    # every forced token rides in a step; the prefill token is not a step
    assert on.stats.steps == off.stats.steps - on.stats.forced
    assert set(on.stats.k_per_step) == {0}  # forced tokens are not drafts: no slot, no acceptance


def test_forced_tokens_take_no_draft_slot_and_are_not_counted_as_accepted(pair):
    target, draft = pair
    policy = Recording(2)
    result = SpecEngine(target, draft, policy=policy).generate([[1, 2, 3]], forced_params())[0]
    records = [r for r in policy.records if r.forced_tokens]
    assert records and result.stats.forced == sum(r.forced_tokens for r in policy.records)
    assert all(r.batch_k <= 2 for r in policy.records)  # K is the drafter's, forced tokens apart
    assert result.stats.drafted == sum(result.stats.k_per_step) and max(result.stats.k_per_step) == 2
    for record in records:  # emitted = forced + accepted drafts + the sampled one
        outcome = record.outcomes[0]
        assert outcome.emitted == record.forced_tokens + outcome.accepted + 1


def test_a_cost_model_learns_only_the_draft_of_a_step_with_forced_tokens(pair):
    """Its verify forward was wider than any profiled cell: draft time is a cell's, verify is not."""
    target, draft = pair
    policy = Recording(2)
    SpecEngine(target, draft, policy=policy).generate([[1, 2, 3]], forced_params())
    forced = next(r for r in policy.records if r.forced_tokens and r.batch_k)
    plain = replace(forced, forced_tokens=0)  # negative control: the same step without forced tokens
    assert forced.verify_seconds > 0 and forced.total_seconds > 0  # the record itself tells the truth
    _, _, _, draft_s, verify_s, total_s, _, _ = timed_step(forced)
    assert draft_s > 0 and verify_s == total_s == 0
    assert timed_step(plain)[4] > 0  # negative control: an ordinary step's verify is learned
    slow_verify = {"verify_seconds": 50 * forced.verify_seconds, "total_seconds": 50 * forced.total_seconds}
    for record, moved in ((forced, False), (plain, True)):  # the per-cell model's verify factor
        model = CostModel.default()
        for _ in range(20):
            model.observe(replace(record, **slow_verify))
        assert (abs(model.corrections().target - 1.0) > 0.05) is moved


def test_forced_runs_stop_at_the_budget_and_before_stop_tokens(pair):
    target, draft = pair
    only_four = PrefixConstraint(lambda generated: [4])
    budget = SpecEngine(target, draft, policy="static:2").generate(
        [[1, 2]], SamplingParams(max_new_tokens=10, constraint=only_four))[0]
    # prefill emits the first; each step leaves room for one sampled token after its forced run
    assert budget.token_ids == [4] * 10 and budget.finish_reason == "length" and budget.stats.forced == 8
    ends = PrefixConstraint(lambda generated: [[2], [3], [15]][min(len(generated), 2)])
    stop = SpecEngine(target, draft, policy="static:2").generate(
        [[1, 2]], SamplingParams(max_new_tokens=10, stop_token_ids=(15,), constraint=ends))[0]
    assert stop.token_ids == [2, 3, 15] and stop.finish_reason == "stop"
    assert stop.stats.forced == 1  # 2 came from prefill, 3 was forced, the stop token was sampled


def test_a_constraint_that_raises_inside_a_forced_run_fails_only_its_request(pair):
    target, draft = pair

    def breaks(generated):
        if len(generated) >= 3:
            raise RuntimeError("grammar engine crashed")
        return [6]

    results = SpecEngine(target, draft, policy="static:2").generate(
        [[1, 2], [3, 4]], [SamplingParams(max_new_tokens=8, constraint=PrefixConstraint(breaks)),
                           forced_params(max_new_tokens=8)])
    assert results[0].finish_reason == "error" and "grammar engine crashed" in results[0].error
    assert results[0].token_ids == [6, 6, 6]  # what it emitted before the constraint raised stands
    assert results[1].error is None and len(results[1].token_ids) == 8


def test_repetition_penalty_sees_forced_tokens_at_the_drafted_positions_after_them(pair):
    """Greedy with a repetition penalty: the penalty at a draft after forced tokens must count them."""
    target, draft = pair
    params = forced_params(repetition_penalty=3.0)
    reference = SpecEngine(target, draft, policy="off", jump_forward=False).generate(PROMPTS, params)
    results = SpecEngine(target, draft, policy="static:3").generate(PROMPTS, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    assert sum(r.stats.forced for r in results) > 0 and sum(r.stats.drafted for r in results) > 0


def test_the_ngram_drafter_follows_forced_tokens_too(pair):
    from adaptive_spec import NgramDrafter

    target, _ = pair
    reference = SpecEngine(target, None, policy="off", jump_forward=False).generate(PROMPTS, forced_params())
    results = SpecEngine(target, NgramDrafter(max_ngram=3, min_ngram=1), policy="static:3").generate(
        PROMPTS, forced_params())
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    assert sum(r.stats.forced for r in results) > 0 and sum(r.stats.drafted for r in results) > 0


def test_the_stop_rule_sees_the_drafts_confidence_over_the_tokens_the_masks_allow(pair):
    """With jump-forward off, forced positions fall inside drafts: the rule is shown a sure draft
    there (1.0), while at positions with a choice the draft's raw confidence stays below 1."""
    from adaptive_spec.control import PolicyBase

    target, draft = pair

    class Watching(PolicyBase):
        name = "watching"

        def __init__(self):
            self.shown = []

        def choose(self, requests):
            return [4] * len(requests)

        def keep_drafting(self, position, confidences):
            self.shown += [c for c in confidences if c is not None]
            return [c is not None for c in confidences]

    policy = Watching()
    SpecEngine(target, draft, policy=policy, jump_forward=False).generate([[1, 2, 3]], forced_params())
    sure = [c for c in policy.shown if c > 1 - 1e-6]
    assert sure and len(sure) < len(policy.shown)
    free = Watching()  # negative control: the same draft without the constraint is never that sure
    SpecEngine(target, draft, policy=free).generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=30))
    assert free.shown and max(free.shown) < 1 - 1e-6
