"""k = 0 without the draft model's upkeep, inside a real vLLM engine (SmolLM2-135M drafting for itself).

The draft is the target's own weights, so a draft whose KV cache is right agrees with greedy decoding
almost always; one that attends over positions it never computed does not. That makes acceptance
after a phase at k = 0 a sharp check that the catch-up rebuilt the draft's cache, and skipping the
catch-up (the negative control) shows the check can fail.
"""

from __future__ import annotations

from collections import Counter

import pytest

from vllm_cases import PROMPTS, SMALL_MODEL, TEST_THREADS, p_value, require_vllm, sampling

require_vllm()

from vllm import SamplingParams  # noqa: E402

from adaptive_spec.control.policy import KEEP_LAST, PolicyBase  # noqa: E402
from adaptive_spec.integrations.vllm import lazy_draft  # noqa: E402
from adaptive_spec.integrations.vllm.controller import SpecController  # noqa: E402
from adaptive_spec.integrations.vllm.engine import EngineSpec  # noqa: E402
from adaptive_spec.integrations.vllm.scheduler import scheduler_of  # noqa: E402
from adaptive_spec.integrations.vllm.upkeep_bench import OffThenOn  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.real_models]

SELF_DRAFT = EngineSpec(SMALL_MODEL, drafter=SMALL_MODEL, max_k=3, threads=TEST_THREADS)
PROMPTS_USED = (PROMPTS["code"], PROMPTS["list"], PROMPTS["repeat"])
MAX_TOKENS, OFF_STEPS = 48, 16


def off_then_on() -> OffThenOn:
    """k = 0 for the first OFF_STEPS choices, then k = 3."""
    return OffThenOn(OFF_STEPS, 3)


# The sampled-law test: one prompt sampled SAMPLES times, seeds apart between the two engines.
SAMPLES, SAMPLED_TOKENS, ALPHA = 400, 6, 0.001
PLAIN_SEEDS, SPEC_SEEDS = tuple(range(SAMPLES)), tuple(range(SAMPLES, 2 * SAMPLES))


@pytest.fixture(scope="module")
def reference(engines):
    # Both plain-vLLM runs this module compares with, made before the speculative engine starts.
    engines.reference(SMALL_MODEL, (PROMPTS["repeat"],) * SAMPLES, SAMPLED_TOKENS, 1.0, PLAIN_SEEDS)
    return engines.reference(SMALL_MODEL, PROMPTS_USED, MAX_TOKENS)


def run(engines, policy):
    llm = engines.get(SELF_DRAFT)
    scheduler = scheduler_of(llm)
    scheduler.use_controller(SpecController(policy))
    before = _tracker_stats(llm)
    outputs = llm.generate(list(PROMPTS_USED), SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    after = _tracker_stats(llm)
    drafting = [outcome for record in policy.records for outcome in record.outcomes if outcome.k > 0]
    accepted = sum(o.accepted for o in drafting) / max(sum(o.k for o in drafting), 1)
    skipped, caught_up = after[0] - before[0], after[1] - before[1]
    return [list(o.outputs[0].token_ids) for o in outputs], accepted, skipped, caught_up, scheduler


def use_counting_controller(llm, policy) -> list[int]:
    """Run `policy` in the engine's scheduler; the returned list fills, step by step, with the
    catch-up tokens the scheduler tells the controller of."""
    controller = SpecController(policy)
    told = []
    finish_step = controller.finish_step

    def counting(verified, *args, catch_up_tokens=0, **kwargs):
        told.append(catch_up_tokens)
        return finish_step(verified, *args, catch_up_tokens=catch_up_tokens, **kwargs)

    controller.finish_step = counting
    scheduler_of(llm).use_controller(controller)
    return told


def _tracker_stats(llm) -> tuple[int, int]:
    drafter = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.drafter
    tracker = lazy_draft.tracker_of(drafter)
    return (tracker.stats.skipped_steps, tracker.stats.caught_up_tokens) if tracker else (0, 0)


def test_steps_at_k0_skip_the_draft_and_the_catch_up_restores_its_cache(engines, reference):
    tokens, acceptance, skipped, caught_up, scheduler = run(engines, off_then_on())
    assert scheduler.lazy_draft
    assert tokens == reference
    assert skipped >= OFF_STEPS - 1, "the steps at k = 0 still ran the draft"
    # each request missed its prompt and every token of the phase at k = 0
    assert caught_up >= len(PROMPTS_USED) * (OFF_STEPS - 1)
    assert acceptance >= 0.9, f"the draft's cache was not rebuilt: acceptance {acceptance:.2f}"


def test_without_the_catch_up_acceptance_collapses(engines, reference, monkeypatch):
    """Negative control: the same run with the catch-up replaced by nothing."""
    monkeypatch.setattr(lazy_draft, "catch_up", lambda *args, **kwargs: None)
    tokens, acceptance, skipped, _, _ = run(engines, off_then_on())
    assert tokens == reference  # drafts are only proposals: outputs stay exact either way
    assert skipped >= OFF_STEPS - 1
    assert acceptance < 0.6, f"acceptance {acceptance:.2f} without a catch-up: the check above cannot fail"


def test_the_step_that_catches_up_is_not_taken_as_a_step_cost(engines, reference):
    """Drafts proposed at the end of a step are verified in the next: the step before the first that
    verified drafts is the one that caught up."""
    policy = off_then_on()
    run(engines, policy)
    first = next(i for i, record in enumerate(policy.records) if record.batch_k > 0)
    assert policy.records[first - 1].total_seconds == 0, "the catch-up's time was charged as a step cost"
    assert any(record.total_seconds > 0 for record in policy.records[:first - 1])
    assert any(record.total_seconds > 0 for record in policy.records[first:])


def test_vllms_own_upkeep_runs_where_lazy_drafting_is_switched_off(engines, reference, monkeypatch):
    monkeypatch.setenv(lazy_draft.LAZY_ENV, "0")
    tokens, acceptance, skipped, caught_up, _ = run(engines, off_then_on())
    assert tokens == reference
    assert skipped == caught_up == 0
    assert acceptance >= 0.9


def test_lazy_drafting_acts_only_under_this_projects_scheduler():
    assert lazy_draft.enabled_for("adaptive_spec.integrations.vllm.AdaptiveScheduler")
    assert not lazy_draft.enabled_for(None)
    assert not lazy_draft.enabled_for("vllm.v1.core.sched.scheduler.Scheduler")
    assert lazy_draft.install() and lazy_draft.install()  # idempotent



def test_the_policy_is_shown_what_each_lazy_draft_missed(engines, reference):
    """`draft_behind` as the scheduler counts it: at the first choice that drafts, each request's
    draft has missed its whole prompt and every token of the phase at k = 0; after a step that
    drafted, nothing beyond the step's own drafts. The catch-up the controller is told of is the
    worker's own count of caught-up tokens."""

    class Watching(OffThenOn):
        def __init__(self):
            super().__init__(OFF_STEPS, 3)
            self.behind = []

        def choose(self, views):
            self.behind.append([view.draft_behind for view in views])
            return super().choose(views)

    policy = Watching()
    llm = engines.get(SELF_DRAFT)
    told = use_counting_controller(llm, policy)
    before = _tracker_stats(llm)[1]
    llm.generate(list(PROMPTS_USED), SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    caught_up = _tracker_stats(llm)[1] - before
    resume = policy.behind[OFF_STEPS]  # the first choice of k = 3 (a request may have finished by then)
    assert resume and all(behind >= OFF_STEPS - 1 for behind in resume), resume
    assert all(behind <= 3 for step in policy.behind[OFF_STEPS + 2:] for behind in step)
    assert sum(told) == caught_up > 0


def test_the_profiler_measures_the_catch_up_per_missed_token(engines):
    """One resume at batch 2 after 8 steps at k = 0: the catch-up covers both prompts and the
    skipped tokens, and its time per token is positive and below a whole step's."""
    from adaptive_spec.integrations.vllm.profile import measure_catch_up

    llm = engines.get(SELF_DRAFT)
    measured = measure_catch_up(llm, cells=((2, 64),), off_steps=8, rounds=1)
    assert measured is not None, "no resume step was seen"
    (cell,) = measured["cells"]
    assert cell["tokens"] >= 2 * (64 + 7)
    assert 0 < measured["seconds_per_token"] * cell["tokens"] < cell["resume_seconds"]


class TakingTurns(OffThenOn):
    """Rows take turns: row i drafts 3 in blocks of 4 steps, alternating with the row beside it, so
    most steps draft for some rows and skip the others (the first, prompts included)."""

    def __init__(self):
        super().__init__(0, 3)

    def choose(self, views):
        super().choose(views)
        return [3 if (self.calls // 4 + index) % 2 == 0 else 0 for index in range(len(views))]


def test_a_step_drafts_only_for_its_rows_at_k_above_0_and_the_others_catch_up_later(engines, reference):
    """The draft runs for the rows given k > 0 alone: the other rows of such steps are skipped, and
    catch up when their turn comes, so drafted rows keep the acceptance of a draft whose cache is
    right; outputs equal vLLM's without speculation; the scheduler's count of caught-up tokens is
    the worker's."""
    policy = TakingTurns()
    llm = engines.get(SELF_DRAFT)
    drafter = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.drafter
    told = use_counting_controller(llm, policy)
    tracker = lazy_draft.tracker_of(drafter)
    before = (tracker.stats.skipped_rows, tracker.stats.caught_up_tokens) if tracker else (0, 0)
    outputs = llm.generate(list(PROMPTS_USED), SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    tracker = lazy_draft.tracker_of(drafter)
    skipped_rows, caught_up = tracker.stats.skipped_rows - before[0], tracker.stats.caught_up_tokens - before[1]
    assert [list(o.outputs[0].token_ids) for o in outputs] == reference
    ragged = [record for record in policy.records if 0 in {o.k for o in record.outcomes} and record.batch_k == 3]
    assert ragged, "no step verified drafts for some rows and none for others"
    assert skipped_rows >= 2 * len(ragged) // 3, f"{skipped_rows} rows skipped in {len(ragged)} ragged steps"
    drafting = [outcome for record in policy.records for outcome in record.outcomes if outcome.k > 0]
    acceptance = sum(o.accepted for o in drafting) / sum(o.k for o in drafting)
    assert acceptance >= 0.9, f"a skipped row's draft cache was not rebuilt: acceptance {acceptance:.2f}"
    # The first step prefills every prompt and drafts for rows 0 and 2: the scheduler counts their
    # prompts (less the token a decoding row brings) as theirs to run over; the worker drafts over
    # them as the step's own tokens, not as a catch-up.
    prompts = [len(o.prompt_token_ids) for o in outputs]
    assert told[0] == prompts[0] - 1 + prompts[2] - 1
    assert sum(told[1:]) == caught_up > 0


def test_rows_skipped_beside_drafting_rows_need_their_catch_up(engines, monkeypatch):
    """Negative control for the test above: without the catch-up, the rows that were skipped attend
    over draft positions nobody wrote, and acceptance collapses. Prompts no other test here uses:
    a prefix-cache hit on an earlier run's prompt would find that run's draft entries still right."""
    monkeypatch.setattr(lazy_draft, "catch_up", lambda *args, **kwargs: None)
    policy = TakingTurns()
    llm = engines.get(SELF_DRAFT)
    scheduler_of(llm).use_controller(SpecController(policy))
    prompts = [PROMPTS["prose"], "List the planets of the solar system in order, one per line:\n",
               "class Stack:\n    def __init__(self):\n"]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    drafting = [outcome for record in policy.records for outcome in record.outcomes if outcome.k > 0]
    acceptance = sum(o.accepted for o in drafting) / sum(o.k for o in drafting)
    assert acceptance < 0.6, f"acceptance {acceptance:.2f} without a catch-up: the check above cannot fail"


def sampled_window(engines, policy) -> Counter:
    llm = engines.get(SELF_DRAFT)
    scheduler_of(llm).use_controller(SpecController(policy))
    outputs = llm.generate([PROMPTS["repeat"]] * SAMPLES, sampling(SAMPLES, SAMPLED_TOKENS, 1.0, SPEC_SEEDS),
                           use_tqdm=False)
    return window([list(o.outputs[0].token_ids) for o in outputs])


def window(token_lists) -> Counter:
    return Counter(tuple(tokens[1:5]) for tokens in token_lists)  # tokens 2-5: the positions drafts cover


def plain_window(engines) -> Counter:
    return window(engines.reference(SMALL_MODEL, (PROMPTS["repeat"],) * SAMPLES, SAMPLED_TOKENS, 1.0, PLAIN_SEEDS))


def test_sampled_outputs_with_rows_drafted_apart_follow_plain_vllms_law(engines, reference):
    """Temperature 1.0, top-p 0.95, rows taking turns (so the draft probabilities the rejection
    sampler reads come from a cut batch, scattered back to their rows): the joint law of tokens 2-5
    is plain vLLM's by a chi-square test of homogeneity at alpha = 0.001, the probability of a false
    failure when both laws are equal. The negative control is the next test."""
    policy = TakingTurns()
    counts = sampled_window(engines, policy)
    ragged = [record for record in policy.records if 0 in {o.k for o in record.outcomes} and record.batch_k == 3]
    assert ragged and sum(o.k for record in ragged for o in record.outcomes) > SAMPLES, "rows were not drafted apart"
    assert p_value(plain_window(engines), counts) > ALPHA


def test_with_the_temperature_of_verified_positions_doubled_the_sampled_law_test_rejects(engines, reference,
                                                                                        monkeypatch):
    """Negative control: a sampler wrong only where drafts are verified must fail the test above."""
    from vllm.v1.sample import rejection_sampler

    from adaptive_spec.integrations.vllm import cpu_sampling

    def doubled_temperature(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        expanded = cpu_sampling.expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from, replace_to)
        return expanded * 2 if replace_to == 1 else expanded  # the temperature call replaces 0 by 1

    monkeypatch.setattr(rejection_sampler, "expand_batch_to_tokens", doubled_temperature)
    assert p_value(plain_window(engines), sampled_window(engines, TakingTurns())) <= ALPHA, \
        "the test cannot tell a wrong sampler from a right one"


class EndsAt(PolicyBase):
    """k = 3 for every request; inside the step, the request in row i of the batch keeps ends[i]
    drafts (KEEP_LAST there; 0: its first is dropped). Records the positions it was asked about."""

    name = "ends-at"

    def __init__(self, ends):
        self.ends, self.records, self.asked, self.batches = ends, [], [], []

    def choose(self, views):
        self.asked.append([])
        self.batches.append(len(views))
        return [3] * len(views)

    def keep_drafting(self, position, confidences):
        self.asked[-1].append((position, [c for c in confidences if c is not None]))
        return [False if c is None or end == 0 else True if position + 1 < end else KEEP_LAST
                for c, end in zip(confidences, self.ends)]

    def observe(self, record):
        self.records.append(record)


def run_ends_at(engines, ends):
    policy = EndsAt(ends)
    tokens, acceptance, *_ = run(engines, policy)
    verified = Counter(outcome.k for record in policy.records for outcome in record.outcomes)
    positions = [len(step) for step in policy.asked if step]
    return tokens, acceptance, verified, positions, policy


def test_the_draft_loop_ends_where_the_policy_stops_every_row(engines, reference, monkeypatch):
    """With the rule asked at every batch size (ADAPTIVE_SPEC_VLLM_STOP_DRAFTS=all): every row told
    to keep one draft and stop at position 0: the loop runs no further draft forward (the rule is
    asked about position 0 only), each request verifies one draft, outputs
    equal vLLM's without speculation, and the drafts kept are the draft's own (acceptance of a
    self-draft stays high). Rows told to stop at 0, 1 and 3 drafts verify exactly those, and the
    loop runs its three positions for the row that drafts on."""
    from adaptive_spec.integrations.vllm.scheduler import STOP_ENV

    monkeypatch.setenv(STOP_ENV, "all")
    tokens, acceptance, verified, positions, policy = run_ends_at(engines, (1, 1, 1))
    assert max(policy.batches) > 1  # the rule ran in steps of several rows
    assert tokens == reference
    assert positions and set(positions) == {1}, positions
    assert set(verified) == {0, 1} and verified[1] > 0, verified
    assert acceptance >= 0.9
    assert all(0 < c <= 1 for step in policy.asked for _, shown in step for c in shown)
    tokens, _, verified, positions, _ = run_ends_at(engines, (0, 1, 3))
    assert tokens == reference
    assert max(positions) == 3
    assert {1, 3} <= set(verified) <= {0, 1, 2, 3}, verified  # 2: the request's budget cut its 3


def test_by_default_the_rule_runs_only_in_steps_of_one_decoding_request(engines, reference):
    """The default (ADAPTIVE_SPEC_VLLM_STOP_DRAFTS unset = 1): steps of the three requests draft
    each row's k = 3 without asking the rule; one request alone is asked about its drafts and keeps
    one draft a step, as the rule says."""
    tokens, _, verified, _, policy = run_ends_at(engines, (1, 1, 1))
    assert tokens == reference
    assert all(not step for step in policy.asked) and min(policy.batches) > 1, policy.batches
    assert verified[3] > 0, verified
    alone = EndsAt((1,))
    llm = engines.get(SELF_DRAFT)
    scheduler_of(llm).use_controller(SpecController(alone))
    output = llm.generate([PROMPTS_USED[0]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert list(output[0].outputs[0].token_ids) == reference[0]
    assert set(alone.batches) == {1} and any(alone.asked), alone.asked
    assert {outcome.k for record in alone.records for outcome in record.outcomes} <= {0, 1}


def test_with_stopping_switched_off_every_row_drafts_its_k(engines, reference, monkeypatch):
    """Negative control: the same policy with ADAPTIVE_SPEC_VLLM_STOP_DRAFTS=0 is never asked, and
    every request verifies the 3 drafts it was given."""
    from adaptive_spec.integrations.vllm.scheduler import STOP_ENV

    monkeypatch.setenv(STOP_ENV, "0")
    tokens, _, verified, positions, _ = run_ends_at(engines, (1, 1, 1))
    assert tokens == reference
    assert positions == [] and verified[3] > 0, (positions, verified)


def test_the_stop_setting_reads_a_batch_size_or_all_and_refuses_anything_else():
    from adaptive_spec.integrations.vllm.scheduler import STOP_ENV, stop_max_batch

    assert stop_max_batch(None) == stop_max_batch(" ") == 1
    assert stop_max_batch("0") == 0 and stop_max_batch("4") == 4 and stop_max_batch("ALL") is None
    for bad in ("-1", "yes", "2.5"):
        with pytest.raises(ValueError, match=STOP_ENV):
            stop_max_batch(bad)
