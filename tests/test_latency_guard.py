"""Goodput's latency guard (`tpot_target`, `latency_factor`; `--slo-tpot`): in a step of more than one
request no row's expected seconds per token may pass the cap, before drafting, inside the step and
for probes. Deterministic (synthetic step costs, outcomes fed by hand): no test can fail by chance.
Each test has its negative control: the same batch without the guard does what the guard forbids.
"""

from __future__ import annotations

import pytest

from adaptive_spec.control import (KEEP_LAST, AcceptanceHistory, GoodputConfig, GoodputPolicy, RequestOutcome,
                                   RequestView, StaticPolicy, StepRecord, adopt_stop_rule, make_policy,
                                   with_tpot_target)
from adaptive_spec.control.price_sweep import with_sweep
from adaptive_spec.control.step_cost import StepCostBase


class LinearCost(StepCostBase):
    """A step of 1 s plus 0.25 s per draft position, whatever the batch (seconds)."""

    def step_seconds_table(self, batch, context, k_max):
        return [1.0 + 0.25 * k for k in range(k_max + 1)]

    def draft_seconds(self, batch, context, k):
        return 0.4 * k


def _policy(**config) -> GoodputPolicy:
    policy = GoodputPolicy(LinearCost(), GoodputConfig(hysteresis=0.0, price_probe_horizon=0, forecast_correction=False, **config))
    adopt_stop_rule(policy)
    policy.prior.successes = [0.95 * t for t in policy.prior.trials]  # a drafter known to be good
    return policy


def _views(max_ks) -> list[RequestView]:
    return [RequestView(f"r{i}", 100, 50, k, AcceptanceHistory()) for i, k in enumerate(max_ks)]


def _teach(policy, views, poor: set[int], steps: int = 20) -> None:
    """`steps` steps in which every row drafts 2 and the rows in `poor` have every draft rejected."""
    for _ in range(steps):
        policy.choose(views)
        outcomes = tuple(RequestOutcome(v.request_id, 2, 0 if i in poor else 2, 1 if i in poor else 3)
                         for i, v in enumerate(views))
        policy.observe(StepRecord(batch_size=len(views), batch_k=2, context_lengths=(100,) * len(views),
                                  outcomes=outcomes, draft_seconds=0.8, verify_seconds=1.2, total_seconds=2.0))


def test_the_guard_keeps_a_slow_row_from_paying_for_its_neighbours_drafts():
    """Two rows whose drafts are accepted beside two whose drafts are rejected (code beside chat):
    goodput alone drafts the longest K, since the good rows' tokens pay for the step, though the poor
    rows (1.09-1.11 tokens a step at their estimators' means) then take 1.15 s and more a token against
    1 s at K = 0. Each target allows the longest K within it and no longer: 1.4 s allows K = 2 (1.5 s
    over 1.11 tokens), 1.2 s K = 1 (1.25 s over 1.09), 1.1 s no draft at all. Negative control: the
    same taught batch without a target drafts past K = 2."""
    chosen = {}
    for target in (None, 1.4, 1.2, 1.1):
        policy = _policy(tpot_target=target)
        views = _views([8] * 4)
        _teach(policy, views, poor={2, 3})
        ks = policy.choose(views)
        chosen[target] = policy._batch_k, max(ks)
        assert policy.last_goodput[2] > policy.last_goodput[1] > policy.last_goodput[0]  # drafting pays
    assert chosen[None][0] > 2
    # the K chosen; the in-step rule may then end each row's draft anywhere up to its cap (8)
    assert (chosen[1.4], chosen[1.2], chosen[1.1]) == ((2, 8), (1, 8), (0, 0))


def test_rows_that_all_pay_still_draft_under_the_guard():
    """Four rows whose drafts are accepted: each row's seconds per token fall as K grows (1.5 s over ~2
    tokens at K = 1), so a 1.2 s target forbids nothing and goodput drafts as it would without it."""
    runs = []
    for target in (None, 1.2):
        policy = _policy(tpot_target=target)
        views = _views([8] * 4)
        _teach(policy, views, poor=set())
        runs.append((policy.choose(views), policy._batch_k))
    assert runs[0] == runs[1] and runs[0][1] >= 1


def test_inside_the_step_the_guard_ends_drafts_a_non_drafting_row_would_pay_for():
    """Three good rows beside one that cannot draft (max_k 0: one token a step). With a 1.3 s target a
    step may run one draft position (1.25 s) but not two (1.5 s): the in-step rule keeps the first
    draft and stops (KEEP_LAST), and `choose` picks K = 1. Negative control: without the target the
    same confident drafts go on (True) from a longer K."""
    answers = {}
    for target in (None, 1.3):
        policy = _policy(tpot_target=target)
        views = _views([8, 8, 8, 0])
        _teach(policy, views[:3], poor=set())
        ks = policy.choose(views)
        assert ks[3] == 0 and min(ks[:3]) >= 1
        answers[target] = (policy._batch_k, policy.keep_drafting(0, [0.97, 0.97, 0.97, None]))
    assert answers[None][0] > 1 and answers[None][1][:3] == [True] * 3
    assert answers[1.3] == (1, [KEEP_LAST, KEEP_LAST, KEEP_LAST, False])


def test_the_guard_never_binds_at_batch_one():
    """At batch 1 a row's seconds per token are the inverse of the step's goodput, which the policy
    maximises already: a target far below any step changes no choice nor any in-step answer."""
    runs = []
    for target in (None, 0.01):
        policy = _policy(tpot_target=target)
        views = _views([8])
        _teach(policy, views, poor=set(), steps=10)
        ks = policy.choose(views)
        runs.append((ks, [policy.keep_drafting(j, [0.6]) for j in range(3)]))
    assert runs[0] == runs[1] and runs[0][0][0] >= 1  # it drafts, and the same way


def test_an_unreachable_target_takes_the_option_whose_slowest_row_is_fastest():
    """A target below even the step at K = 0: no option is within it, so the guard takes the one whose
    slowest row is fastest. For identical rows that is the best goodput (n / goodput is each row's
    seconds per token), so the choice equals goodput's without a target; and it does draft."""
    runs = []
    for target in (None, 0.1):
        policy = _policy(tpot_target=target)
        views = _views([8] * 3)
        _teach(policy, views, poor=set())
        runs.append((policy.choose(views), policy._batch_k))
    assert runs[0] == runs[1] and runs[1][1] >= 1


def test_the_relative_guard_caps_at_a_factor_of_the_step_without_speculation():
    """`latency_factor` on the first test's batch: the cap is that factor x the 1 s step at K = 0, so
    1.1 keeps the batch at K = 0 and 1.4 allows K = 2, as the same targets in seconds did."""
    chosen = {}
    for factor in (1.1, 1.4):
        policy = _policy(latency_factor=factor)
        views = _views([8] * 4)
        _teach(policy, views, poor={2, 3})
        policy.choose(views)
        chosen[factor] = policy._batch_k
    assert chosen == {1.1: 0, 1.4: 2}


def test_probes_wait_while_a_probe_step_would_break_the_target():
    """A batch at K = 0 whose rows are due a probe: a 1-draft probe step (1.25 s) beside rows emitting
    one token would break a 1.1 s target, so no row probes; without the target they do."""
    probed = {}
    for target in (None, 1.1):
        policy = _policy(tpot_target=target)
        policy.prior.successes = [0.0 for _ in policy.prior.trials]  # a drafter known to be useless: K = 0
        views = _views([8] * 4)
        policy.choose(views)
        for state in policy._requests.values():
            state.steps_off = state.probe_interval
        policy._since_probe_step = policy._probe_step_interval
        probed[target] = policy.choose(views)
    assert max(probed[None]) >= 1 and probed[1.1] == [0, 0, 0, 0]


def test_with_tpot_target_sets_goodput_and_refuses_policies_without_a_guard():
    policy = with_tpot_target(make_policy("goodput"), 400)
    assert policy.config.tpot_target == pytest.approx(0.4)
    swept = with_sweep(with_tpot_target(make_policy("goodput"), 250), 5.0)  # the sweep wraps the guarded policy
    assert swept.policy.config.tpot_target == pytest.approx(0.25)
    assert make_policy("goodput").config.tpot_target is None  # off unless asked
    assert with_tpot_target(make_policy("goodput"), 0).config.tpot_target is None
    static = make_policy("static:2")
    assert with_tpot_target(static, 400, only_goodput=True) is static  # a bench lane beside goodput lanes
    with pytest.raises(ValueError, match="no latency guard"):
        with_tpot_target(StaticPolicy(k=2), 400)
    with pytest.raises(ValueError, match="milliseconds > 0"):
        with_tpot_target(make_policy("goodput"), -5)
    for bad in (dict(tpot_target=0.0), dict(latency_factor=0.9)):
        with pytest.raises(ValueError, match="goodput policy"):
            GoodputConfig(**bad)


def test_the_shipped_latency_preset_names_itself():
    policy = make_policy("goodput-latency")
    assert policy.name == "goodput-latency" and policy.config.latency_factor == 1.5
    assert policy.config.tpot_target is None


class UntimedLong(LinearCost):
    """LinearCost whose lengths from 3 on were never timed and may be 50% off (`untimed_misfit`)."""

    def untimed_misfit(self, batch, k_max):
        return [0.0 if k < 3 else 0.5 for k in range(k_max + 1)]


def test_a_price_probe_may_pass_the_cap_for_its_one_step():
    """A price probe times an untimed length for one step where knowing its price is worth it; held to
    the cap, a batch would never time the long lengths (in a simulated loaded vLLM run that kept the
    policy drafting where the plain policy had learned it does not pay). With a 1.2 s target (K = 1 at
    most) a probe of an untimed K >= 3 still runs. Negative control: without misfit, no probe, and K
    stays within the cap."""
    for cost, probes in ((UntimedLong(), 1), (LinearCost(), 0)):
        policy = GoodputPolicy(cost, GoodputConfig(hysteresis=0.0, forecast_correction=False, tpot_target=1.2))
        adopt_stop_rule(policy)
        policy.prior.successes = [0.95 * t for t in policy.prior.trials]
        views = _views([8] * 4)
        _teach(policy, views, poor={2, 3})
        before = policy.price_probes
        policy.choose(views)
        assert policy.price_probes - before == probes
        assert (policy._batch_k >= 3) if probes else (policy._batch_k == 1)
