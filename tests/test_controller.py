"""Controller v2: calibrated acceptance, stopping inside the step, k = 0 never absorbing, warm start.

Everything here is deterministic (fixed seeds, synthetic clocks from profiles), so no test can fail
by chance; the statistical ones say what they would have a small chance of missing with another seed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from adaptive_spec.control import KEEP_LAST, ConfidenceCalibration, CostModel, GoodputConfig, GoodputPolicy, StepRecord
from adaptive_spec.control.step_cost import StepCostBase
from adaptive_spec.control.policy import RequestOutcome, RequestView, AcceptanceHistory, adopt_stop_rule
from adaptive_spec.simulation.simulator import cost_model_from, simulate
from adaptive_spec.simulation.trace_file import RequestTrace

ROOT = Path(__file__).resolve().parents[1]
CPU_PROFILE = json.loads((ROOT / "profiles" / "cpu-2core-qwen-coder-fp32.json").read_text())


def gpu_like_profile() -> dict:
    """A synthetic accelerator: verify nearly flat in tokens, a draft token 1/10 of a target forward."""
    target, draft = [], []
    for batch in (1, 2, 4, 8, 16, 32, 64):
        for context in (128, 1024):
            target += [dict(batch=batch, context=context, query_tokens=q, median=0.010 * (1 + 0.004 * batch * q))
                       for q in range(1, 10)]
            draft += [dict(batch=batch, context=context, query_tokens=q, median=0.001 * (1 + 0.004 * batch * q))
                      for q in (1, 2)]
    return {"name": "synthetic-accelerator", "target": target, "draft": draft}


# --- calibration ------------------------------------------------------------------------------
def _sigmoid(x):
    return 1 / (1 + math.exp(-x))


def _logit(p):
    return math.log(p / (1 - p))


def test_calibration_learns_a_miscalibrated_drafter_and_beats_raw_confidence():
    """Truth: P(accept | c) = sigmoid(2 logit(c) - 1), an overconfident-at-the-middle drafter.
    After 4,000 outcomes the fit's predictions are within 0.06 of the truth across confidences,
    and its prequential Brier score beats reading the confidence as the probability. Negative
    control: outcomes independent of the confidence drive the weight to ~0 (it cannot invent a
    relation). Deterministic (seed 0); with other seeds the 0.06 band holds with margin (the
    fitted weight's standard error at 4,000 outcomes is ~0.05)."""
    rng = np.random.default_rng(0)
    fit, control = ConfidenceCalibration(), ConfidenceCalibration()
    raw_brier = 0.0
    for _ in range(4000):
        c = float(rng.uniform(0.05, 0.99))
        truth = _sigmoid(2 * _logit(c) - 1)
        accepted = bool(rng.random() < truth)
        raw_brier += (c - accepted) ** 2
        fit.update(c, 0, accepted)
        control.update(c, 0, bool(rng.random() < 0.5))
    for c in (0.1, 0.3, 0.5, 0.7, 0.9, 0.98):
        assert abs(fit.predict(c, 0) - _sigmoid(2 * _logit(c) - 1)) < 0.06, c
    assert fit.brier < raw_brier / 4000
    assert abs(control.weight) < 0.2 and abs(control.predict(0.9, 0) - 0.5) < 0.1
    table = fit.reliability()
    assert sum(row["outcomes"] for row in table) == 4000 and all(abs(row["predicted"] - row["accepted"]) < 0.1
                                                                for row in table if row["outcomes"] > 200)


def test_request_offsets_separate_an_easy_and_a_hard_request_the_shared_fit_averages():
    fit = ConfidenceCalibration()
    easy, hard = fit.new_offset(), fit.new_offset()
    for step in range(60):
        fit.update(0.8, 0, True, easy)
        fit.update(0.8, 0, False, hard)
    assert fit.predict(0.8, 0, hard) < 0.35 < 0.65 < fit.predict(0.8, 0, easy)
    assert abs(fit.predict(0.8, 0) - 0.5) < 0.15  # the shared fit saw a 50/50 mix at 0.8


def test_calibration_state_round_trips_and_refuses_garbage():
    fit = ConfidenceCalibration()
    for c, y in [(0.9, True), (0.2, False), (0.6, True)] * 50:
        fit.update(c, 1, y)
    fresh = ConfidenceCalibration()
    fresh.load_state(json.loads(json.dumps(fit.state())))
    assert fresh.predict(0.7, 1) == pytest.approx(fit.predict(0.7, 1))
    for bad in ({}, {"weight": "x", "biases": [0], "weight_information": 1, "bias_information": [1]},
                {"weight": 1.0, "biases": [0.0], "weight_information": -1.0, "bias_information": [1.0]},
                {"weight": float("nan"), "biases": [0.0], "weight_information": 1.0, "bias_information": [1.0]}):
        with pytest.raises(ValueError):
            ConfidenceCalibration().load_state(bad)


# --- stopping inside the step -----------------------------------------------------------------
class KneeCost(StepCostBase):
    """Batch-1 step costs with a CPU-like knee: 1 and 2 drafts cost more than 3 (seconds)."""

    table = [1.0, 2.4, 2.6, 1.5, 1.8, 2.1, 2.4, 2.7, 3.0]

    def step_seconds_table(self, batch, context, k_max):
        return [self.table[min(k, len(self.table) - 1)] * batch for k in range(k_max + 1)]

    def draft_seconds(self, batch, context, k):
        return 0.1 * k

    def observe(self, record):
        pass


def _views(n, max_k=8):
    return [RequestView(f"r{i}", 100, 50, max_k, AcceptanceHistory()) for i in range(n)]


def _drafting_policy(cost, **config) -> GoodputPolicy:
    policy = GoodputPolicy(cost, GoodputConfig(hysteresis=0.0, **config))
    adopt_stop_rule(policy)
    policy.prior.successes = [0.95 * t for t in policy.prior.trials]  # a drafter known to be good
    return policy


def test_stopping_looks_past_a_knee_instead_of_stopping_at_it():
    """With confident drafts, ending at 1 or 2 drafts is worse than ending at 0 (the knee), but 3
    beats them all: the rule must keep drafting at positions 0 and 1 (a greedy one-step rule,
    comparing only the next length, would stop at position 0)."""
    policy = _drafting_policy(KneeCost())
    ks = policy.choose(_views(1))
    assert ks == [8]
    survive = 0.97
    stop_now = 1 / (KneeCost.table[0] + 0.1)  # goodput if the first draft is dropped
    one_more = (1 + survive) / KneeCost.table[1]
    assert one_more < stop_now  # the greedy comparison says stop
    assert policy.keep_drafting(0, [0.97]) == [True]
    assert policy.keep_drafting(1, [0.97]) == [True]


def test_an_unconfident_row_stops_alone_and_keep_last_ends_a_confident_one():
    policy = _drafting_policy(KneeCost())
    policy.choose(_views(2))
    answers = policy.keep_drafting(0, [0.97, 0.01])
    assert answers == [True, False]
    # The second row is no longer shown; the first goes on until the rule prefers to end it.
    seen = []
    for position in range(1, 8):
        answer = policy.keep_drafting(position, [0.97, None])
        seen.append(answer[0])
        assert answer[1] is False
        if answer[0] is not True:
            break
    assert seen[-1] in (KEEP_LAST, False)


def test_a_probe_keeps_its_drafts_whatever_the_forecast():
    policy = _drafting_policy(KneeCost(), probe_interval=2, probe_k=3)
    policy.prior.successes = [0.0] * len(policy.prior.trials)  # a drafter believed useless
    view = _views(1)
    for _ in range(2):  # two steps without drafting make a probe due
        assert policy.choose(view) == [0]
        policy.observe(StepRecord(1, 0, (100,), (RequestOutcome("r0", 0, 0, 1),), 0.0, 1.0, 1.0))
    assert policy.choose(view) == [3]
    assert [policy.keep_drafting(j, [0.01])[0] for j in range(3)] == [True, True, KEEP_LAST]


def _calibration_updates(policy) -> list[float]:
    """The confidences the policy's calibration learns from, in order."""
    seen, update = [], policy.calibration.update
    policy.calibration.update = lambda confidence, *args, **kw: (seen.append(confidence), update(confidence, *args, **kw))[1]
    return seen


def test_a_host_that_chooses_before_it_reports_matches_outcomes_to_their_own_choice():
    """vLLM chooses step N+1's draft lengths before it reports what step N verified (the drafts of
    the choice at N), and says so with `StepRecord.lag = 1`: the outcome must teach the calibration
    the confidence drafted at N (0.9), not the one drafted since (0.2). Negative control: the same
    calls reported with lag 0 pair the outcome with the newer choice's confidence."""
    for lag, expected in ((1, [0.9]), (0, [0.2])):
        policy = _drafting_policy(KneeCost())
        seen = _calibration_updates(policy)
        view = _views(1)
        policy.choose(view)
        policy.keep_drafting(0, [0.9])
        # the step that drafted at 0.9 verified nothing yet (a host at lag 1 has no choice to match)
        policy.observe(StepRecord(1, 0, (100,), (RequestOutcome("r0", 0, 0, 1),), 0.0, 1.0, 1.0, lag=-1 if lag else 0))
        policy.choose(view)
        policy.keep_drafting(0, [0.2])
        policy.observe(StepRecord(1, 1, (100,), (RequestOutcome("r0", 1, 1, 2),), 0.0, 1.0, 1.0, lag=lag))
        assert seen == expected, (lag, seen)


def test_a_probe_still_unverified_is_not_probed_again_or_counted_as_failed():
    """At lag 1 a probe's outcome arrives a choice late. The choice in between must neither probe
    the row again nor back its interval off (that would read the wait as a failed probe); once the
    fully accepted probe is reported, the row drafts at once. The control is the same row at lag 0,
    whose outcome arrives before the next choice."""
    policy = _drafting_policy(KneeCost(), probe_interval=2, probe_k=3)
    policy.prior.successes = [0.0] * len(policy.prior.trials)  # a drafter believed useless
    view = _views(1)
    for _ in range(2):
        assert policy.choose(view) == [0]
        policy.observe(StepRecord(1, 0, (100,), (RequestOutcome("r0", 0, 0, 1),), 0.0, 1.0, 1.0))
    assert policy.choose(view) == [3]  # the probe, drafted at the end of this vLLM step
    state = policy._requests["r0"]
    interval = state.probe_interval
    # what the step before the probe verified (no drafts), reported after the probe was chosen
    policy.observe(StepRecord(1, 0, (100,), (RequestOutcome("r0", 0, 0, 1),), 0.0, 1.0, 1.0, lag=1))
    assert policy.choose(view) == [0] and state.probe_interval == interval  # the probe is in flight
    policy.observe(StepRecord(1, 3, (100,), (RequestOutcome("r0", 3, 3, 4),), 0.0, 1.0, 1.0, lag=1))
    assert policy.choose(view)[0] >= 3  # a fully accepted probe: drafting resumes at once
    assert state.probe_interval == interval
    # control: the same calls reported at lag 0 pair the k = 0 outcome with the probe, so the
    # overdue row probes again and backs off
    control = _drafting_policy(KneeCost(), probe_interval=2, probe_k=3)
    control.prior.successes = [0.0] * len(control.prior.trials)
    for _ in range(2):
        control.choose(view)
        control.observe(StepRecord(1, 0, (100,), (RequestOutcome("r0", 0, 0, 1),), 0.0, 1.0, 1.0))
    assert control.choose(view) == [3]
    control.observe(StepRecord(1, 0, (100,), (RequestOutcome("r0", 0, 0, 1),), 0.0, 1.0, 1.0))
    assert control.choose(view) == [3] and control._requests["r0"].probe_interval == 2 * interval


class SteepCost(KneeCost):
    """A batch's step cost rising 70% with the first draft (vLLM's CPU profile at batch 6)."""

    table = [1.0, 1.7, 2.4, 3.1, 3.8, 4.5, 5.2, 5.9, 6.6]

    def catch_up_seconds(self, tokens):  # a lazy draft's catch-up (vLLM), 10 ms a missed token
        return 0.01 * tokens


def _probe_due(policy, views, rows):
    """Make a probe due for `rows` alone (the others drafted a step ago, and that step is over)."""
    policy.choose(views)
    policy._unobserved.clear()  # its outcomes arrived (what they taught is set below)
    for index, view in enumerate(views):
        state = policy._requests[view.request_id]
        state.steps_off = state.probe_interval if index in rows else 0
    policy._since_probe_step = policy._probe_step_interval  # nor has the batch probed for a while


def test_rows_beside_a_probe_keep_drafts_that_cost_nothing_more():
    """A probe protected to one draft makes the step verify one draft anyway, so dropping another
    row's unsure draft saves nothing: it is kept. Negative control: the same drafts with no probe
    in the step are dropped, because there dropping them saves the drafting step's cost."""
    for probing, expected in ((True, KEEP_LAST), (False, False)):
        policy = _drafting_policy(SteepCost(), probe_k=1)
        views = _views(4)
        _probe_due(policy, views, {0} if probing else set())
        ks = policy.choose(views)
        assert ks == [8] * 4 and policy._step[0].probe_k == (1 if probing else 0)
        answers = policy.keep_drafting(0, [0.97, 0.3, 0.3, 0.3])
        assert answers[0] == (KEEP_LAST if probing else False)  # a probe of 1 keeps its one draft
        assert answers[1:] == [expected] * 3, (probing, answers)


def test_probes_share_their_step():
    """Four rows of a drafter believed useless, one probe due: every row probes in that step, at
    the same length (the step's cost follows its longest draft, so the others' drafts are free),
    and every row is marked as probing, the state the back-off doubles from, so they back off
    together. A row whose lazy draft is behind would pay a catch-up of its own, so it does not join."""
    policy = _drafting_policy(SteepCost(), probe_k=2)
    policy.prior.successes = [0.0] * len(policy.prior.trials)
    views = _views(4)
    _probe_due(policy, views, {2})
    assert policy.choose(views) == [2, 2, 2, 2]
    assert all(policy._requests[v.request_id].probing for v in views)
    behind = [RequestView(v.request_id, v.context_length, v.remaining_tokens, v.max_k, v.history,
                          draft_behind=40 if i == 3 else 0) for i, v in enumerate(views)]
    policy = _drafting_policy(SteepCost(), probe_k=2)
    policy.prior.successes = [0.0] * len(policy.prior.trials)
    _probe_due(policy, behind, {2})
    assert policy.choose(behind) == [2, 2, 2, 0]


# --- option stopping (stopping.py) -------------------------------------------------------------
class RaggedCost(StepCostBase):
    """Whole-batch step costs at batch 8 (K = 0..4), and optionally vLLM-like ragged pricing: one
    drafting row pays `one_row` of the drafting increment, the others the rest in equal parts."""

    table = [1.0, 1.5, 1.8, 2.1, 2.4]

    def __init__(self, one_row=None):
        self.one_row = one_row
        if one_row is not None:
            self.drafting_share = lambda batch, k, rows: min(one_row + (1 - one_row) * (rows - 1) / (batch - 1), 1.0)

    def step_seconds_table(self, batch, context, k_max):
        return [self.table[min(k, len(self.table) - 1)] for k in range(k_max + 1)]

    def observe(self, record):
        pass


def _two_good_rows(cost) -> list[int]:
    """Eight rows, rows 0 and 1 with a drafter that always agrees, the other six one that never does;
    the k each gets once their histories show it (a host that cannot stop drafts inside the step)."""
    policy = GoodputPolicy(cost, GoodputConfig(max_k=4, hysteresis=0.0, probe_interval=64, max_probe_interval=64,
                                               price_ragged_steps=True))
    views = _views(8, max_k=4)
    for _ in range(6):
        policy.choose(views)
        outcomes = tuple(RequestOutcome(v.request_id, 4, 4 if i < 2 else 0, 5 if i < 2 else 1) for i, v in enumerate(views))
        policy.observe(StepRecord(batch_size=8, batch_k=4, context_lengths=(100,) * 8, outcomes=outcomes,
                                  draft_seconds=0.0, verify_seconds=0.0, total_seconds=0.0))
    return policy.choose(views)


def test_where_a_step_follows_its_drafted_tokens_only_the_rows_that_pay_draft():
    """With `price_ragged_steps` and vLLM-like pricing (one drafting row pays 20% of the batch's
    drafting increment): the two rows whose drafter agrees draft the full 4, the six others stay at
    k = 0. Negative control: priced by its longest draft, the step's drafting would cost the whole
    increment for two rows' tokens, so nobody drafts."""
    assert _two_good_rows(RaggedCost(one_row=0.2)) == [4, 4, 0, 0, 0, 0, 0, 0]
    assert _two_good_rows(RaggedCost()) == [0] * 8


# Step seconds of the default pair's CPU profile at batch 1 (rounded), with forwards 0..j run: the
# first draft's verify is the big jump, each further draft adds a forward and a little verify.
DROP = [0.48, 0.80, 0.91, 0.97, 1.04]  # draft j dropped: j drafts verified
KEEP = [0.74, 0.85, 0.91, 0.98, 1.05]  # draft j kept, the row stops: j + 1 verified
RATE = 2.45  # tokens per second the stream earns


def _exact_value(s, j, sample):
    """W_j(s) by full recursion over every sequence of next-draft acceptances (no grid)."""
    options = [-RATE * DROP[j], s - RATE * KEEP[j]]
    if j + 1 < len(DROP):
        options.append(s + np.mean([_exact_value(s * q, j + 1, sample) for q in sample]))
    return max(options)


def _fixed_length_values(s, mean):
    """Drop, keep and stop, then every longer fixed ending, forecasting each draft at `mean`."""
    values, gain, survive = [-RATE * DROP[0], s - RATE * KEEP[0]], s, s
    for final in range(1, len(KEEP)):
        survive *= mean
        gain += survive
        values.append(gain - RATE * KEEP[final])
    return values


def test_backward_induction_matches_the_exhaustive_recursion():
    from adaptive_spec.control.stopping import GRID, continuation_values

    sample = [0.95, 0.6, 0.1]
    continuation = continuation_values(DROP, KEEP, [sample] * len(DROP), RATE)
    assert continuation[-1] is None  # no drafting past the row's limit
    for j in range(len(DROP) - 1):
        exact = [np.mean([_exact_value(s * q, j + 1, sample) for q in sample]) for s in GRID]
        # Interpolating a convex piecewise-linear function on a 1/32 grid: errors of a few 1e-3.
        assert np.max(np.abs(continuation[j] - np.array(exact))) < 0.02


def test_the_option_to_stop_later_makes_drafting_on_worth_it():
    """The next drafts will each be sure (0.95) or hopeless (0.05), half the time each. Forecast at
    their mean, 0.5, every ending loses to dropping the current draft (s = 0.6); valued with the
    option to stop once each next draft's confidence is seen, drafting on wins, by the margin the
    exhaustive recursion gives. Negative control: the same mean with no spread in the forecast
    leaves nothing to wait for, and the rule drops the draft like the fixed-length comparison."""
    from adaptive_spec.control.stopping import continuation_values, decide

    s, sample = 0.6, [0.95, 0.05]
    fixed = _fixed_length_values(s, 0.5)
    assert max(range(len(fixed)), key=fixed.__getitem__) == 0  # drop
    exact_on = s + np.mean([_exact_value(s * q, 1, sample) for q in sample])
    assert exact_on > max(fixed) + 0.1
    spread = continuation_values(DROP, KEEP, [sample] * len(DROP), RATE)
    assert decide(s, 0, DROP, KEEP, spread[0], RATE) == 2
    flat = continuation_values(DROP, KEEP, [[0.5]] * len(DROP), RATE)
    assert decide(s, 0, DROP, KEEP, flat[0], RATE) == 0


def test_goodput_uses_option_stopping_at_batch_1_once_a_step_was_timed():
    """The config switch selects the rule: with `option_stopping` the policy builds the option
    tables for a batch-1 step after its first timed step, without it (or at batch 2) it does not."""
    built = {}
    for option, batch in ((True, 1), (False, 1), (True, 2)):
        policy = _drafting_policy(KneeCost(), option_stopping=option)
        views = _views(batch)
        policy.choose(views)
        policy.keep_drafting(0, [0.97] * batch)
        outcomes = tuple(RequestOutcome(v.request_id, 1, 1, 2) for v in views)
        policy.observe(StepRecord(batch, 1, (100,) * batch, outcomes, 0.1, 2.4, 2.5))
        assert policy.rate_ema is not None
        policy.choose(views)
        answer = policy.keep_drafting(0, [0.97] * batch)
        assert all(a in (False, True, KEEP_LAST) for a in answer)
        built[option, batch] = policy._options is not None
    assert built == {(True, 1): True, (False, 1): False, (True, 2): False}


# --- k = 0 never absorbing ----------------------------------------------------------------------
class _Recorder(GoodputPolicy):
    def observe(self, record):
        self.ks.append(max(o.k for o in record.outcomes))
        super().observe(record)


def _phases(profile, batch, bad, good):
    """Every request: `bad` positions a useless but confident drafter (accept 0, confidence 0.9),
    then `good` positions of a perfect one (accept 1, confidence 0.95). Returns the policy's
    drafted k per step and the index of the first step at which every request was past `bad`."""
    n = bad + good
    accept = np.r_[np.zeros(bad), np.ones(good)]
    confidence = np.r_[np.full(bad, 0.9), np.full(good, 0.95)]
    traces = [RequestTrace("p", 100, accept, confidence, np.zeros(n, dtype=np.int64)) for _ in range(batch)]
    policy = _Recorder(cost_model_from(profile))
    policy.ks = []
    simulate(traces, profile, policy, batch_size=batch)
    return policy


@pytest.mark.parametrize("profile_name", ["cpu", "accelerator"])
@pytest.mark.parametrize("batch", [1, 4, 8, 32])
def test_drafting_resumes_after_a_useless_phase_and_a_fresh_policy_discovers_a_good_drafter(profile_name, batch):
    """Bounds: after 300 steps of a useless drafter, drafting resumes within the back-off's
    ceiling + 1 steps (the ceiling is where probing a useless drafter costs 3% of the time at
    k = 0: 70 steps on the 2-core CPU profile at batch 1, fewer elsewhere; never above
    max_probe_interval = 128), and once resumed it drafts in at least 75% of the remaining steps.
    A fresh policy drafts within probe_interval + 1 = 9 steps. All requests move in lockstep (same
    trace), so step 300 is when every request's useless phase ended."""
    profile = CPU_PROFILE if profile_name == "cpu" else gpu_like_profile()
    policy = _phases(profile, batch, bad=300, good=300)
    assert 0 in policy.ks[:300]  # the useless phase really switched drafting off
    after = policy.ks[300:]
    resumed = next(i for i, k in enumerate(after) if k > 0)
    assert resumed <= 128 + 1
    if profile_name == "cpu" and batch == 1:
        assert resumed <= 70 + 1
    assert np.mean([k > 0 for k in after[resumed:]]) >= 0.75
    fresh = _phases(profile, batch, bad=0, good=200)
    assert next(i for i, k in enumerate(fresh.ks) if k > 0) <= 9


def test_negative_control_the_old_rule_stays_off():
    """The same scenario with probes that cannot bring drafting back (probe_k 1 that is never
    protected from the stop rule is what v1 did; here: probes switched off by an interval beyond the
    run) shows the test above can fail: drafting never resumes."""
    profile = CPU_PROFILE
    n = 600
    accept = np.r_[np.zeros(300), np.ones(300)]
    confidence = np.r_[np.full(300, 0.9), np.full(300, 0.95)]
    traces = [RequestTrace("p", 100, accept, confidence, np.zeros(n, dtype=np.int64))]
    policy = _Recorder(cost_model_from(profile), GoodputConfig(probe_interval=1000, max_probe_interval=1000))
    policy.ks = []
    simulate(traces, profile, policy, batch_size=1)
    assert all(k == 0 for k in policy.ks[300:])


class _StepKinds(GoodputPolicy):
    """Records each step's kind: D (rows drafting by choice), P (probes alone), . (neither)."""

    def choose(self, requests):
        ks = super().choose(requests)
        self.kinds = getattr(self, "kinds", "") + ("D" if self._batch_k else "P" if any(ks) else ".")
        return ks


class _EveryFullProbeCounts(_StepKinds):
    """Control: steps of probes alone carry no bar to pay, so every fully accepted probe chains a
    probe on the next step, as before the batch rule."""

    def choose(self, requests):
        ks = super().choose(requests)
        for row in self._step:
            row.probe_bar = 0.0
        return ks


class _NoBatchBackOff(_StepKinds):
    """Control: steps of probes alone go whenever any row's own interval says so."""

    def _batch_may_probe(self, due, chained, lengths, costs, drafting):
        return True


def _against_off(policy_class, traces, batch):
    policy = policy_class(cost_model_from(CPU_PROFILE))
    ours = simulate(traces, CPU_PROFILE, policy, batch_size=batch)["tokens_per_s"]
    return policy.kinds, ours / simulate(traces, CPU_PROFILE, "off", batch_size=batch)["tokens_per_s"]


@pytest.mark.parametrize("batch", [4, 16])
def test_chance_successes_of_a_mediocre_drafter_do_not_chain_probe_steps(batch):
    """A drafter each of whose drafts is accepted with probability 0.5 does not pay on the CPU
    profile (a 1-draft step costs 1.7-2.2x one without). In a step of probes alone at batch 16,
    some probe is fully accepted by chance almost every time (1 - 2^-16); counting each as the
    drafter agreeing again chained probe steps without end (the control: 51 back-to-back probe
    steps, 0.84x plain decoding). Such a full probe now counts only if the step paid for itself
    or every probe was full: at most 2 back-to-back probe steps, and >= 0.95x plain decoding.
    Deterministic (the simulator's seeded uniforms)."""
    n = 300
    traces = [RequestTrace(f"r{i}", 100, np.full(n, 0.5), np.full(n, 0.5), np.zeros(n, dtype=np.int64))
              for i in range(batch)]
    kinds, ratio = _against_off(_StepKinds, traces, batch)
    assert "P" in kinds and kinds.count("PP") <= 2 and ratio >= 0.95
    control, control_ratio = _against_off(_EveryFullProbeCounts, traces, batch)
    assert control.count("PP") >= 5 and control_ratio < ratio


@pytest.mark.parametrize("batch", [4, 16])
def test_arrivals_do_not_make_a_batch_probe_every_probe_interval(batch):
    """A useless drafter and requests of staggered lengths, so one joins every few steps with its
    own fresh probe interval: without a back-off for the batch (the control) a step of probes
    alone comes every 8-16 steps forever. With it they back off as one row's probes do, to the
    interval where they cost 3% of the time at k = 0: under 5% of the steps probe, and goodput
    stays >= 0.96x plain decoding."""
    lengths = [40 + (37 * i) % 160 for i in range(4 * batch)]
    traces = [RequestTrace(f"r{i}", 100, np.zeros(n), np.full(n, 0.9), np.zeros(n, dtype=np.int64))
              for i, n in enumerate(lengths)]
    kinds, ratio = _against_off(_StepKinds, traces, batch)
    assert 0 < kinds.count("P") <= 0.05 * len(kinds) and ratio >= 0.96
    control, control_ratio = _against_off(_NoBatchBackOff, traces, batch)
    assert control.count("P") >= 1.8 * kinds.count("P") and control_ratio < ratio


INT8_PROFILE = json.loads((ROOT / "profiles" / "cpu-2core-qwen-coder-fp32-int8draft.json").read_text())


class _ForecastLog(_StepKinds):
    """Also records the forecast scale each choice used."""

    def choose(self, requests):
        self.scales = getattr(self, "scales", []) + [self.forecast_scale()]
        return super().choose(requests)


def _against_best_fixed(trace_name, batch, correction):
    """goodput (with or without the forecast correction) over the committed int8-draft trace, as a
    ratio to the best of off and static:2-4 (the best fixed k there), and the policy that ran."""
    from adaptive_spec.simulation import load_traces

    traces = load_traces([str(ROOT / "traces" / "int8-draft" / trace_name)])
    n = 2 * batch if batch > 16 else None
    best = max(simulate(traces, INT8_PROFILE, p, batch_size=batch, num_requests=n, max_k=12)["tokens_per_s"]
               for p in ("off", "static:2", "static:3", "static:4"))
    policy = _ForecastLog(cost_model_from(INT8_PROFILE), GoodputConfig(forecast_correction=correction))
    ours = simulate(traces, INT8_PROFILE, policy, batch_size=batch, num_requests=n, max_k=12)["tokens_per_s"]
    return ours / best, policy


@pytest.mark.parametrize("temperature", ["0", "0.7"])
@pytest.mark.parametrize("batch", [16, 64])
def test_at_batch_above_one_drafting_forecasts_are_corrected_by_how_they_came_out(temperature, batch):
    """Prose, default pair, batch 16 and 64 (the committed int8-draft ShareGPT traces; deterministic).
    The estimator learns only from drafts the in-step rule kept, which were picked for their
    confidence, so `choose` forecasts more than drafting then earns: without the correction (the
    control) it drafts in most steps and the in-step rule drops much of it, 0.93-0.99x the best
    fixed k. Scaling the drafting options by realised / forecast goodput of recent drafting steps
    (it really fell: below 0.9) drafts in at most 3/4 as many steps and earns more: >= 0.96x."""
    trace = f"qwen-coder-chat-t{temperature}.csv"
    ratio, policy = _against_best_fixed(trace, batch, correction=True)
    control_ratio, control = _against_best_fixed(trace, batch, correction=False)
    assert min(policy.scales) < 0.9 and not control.config.forecast_correction
    assert policy.kinds.count("D") <= 0.75 * control.kinds.count("D")
    assert ratio >= 0.96 and control_ratio < ratio


@pytest.mark.parametrize("temperature", ["0", "0.7"])
def test_the_forecast_correction_keeps_drafting_where_it_pays(temperature):
    """Positive control: on code (HumanEval traces, batch 64), where drafting pays, the correction
    leaves drafting on: >= 95% as many drafting steps as without it, and no lower a ratio to the
    best fixed k (within 0.5%)."""
    trace = f"qwen-coder-code-t{temperature}.csv"
    ratio, policy = _against_best_fixed(trace, 64, correction=True)
    control_ratio, control = _against_best_fixed(trace, 64, correction=False)
    assert policy.kinds.count("D") >= 0.95 * control.kinds.count("D")
    assert ratio >= control_ratio - 0.005 and ratio >= 0.99


# --- cost model: catch-up is its own cost ---------------------------------------------------------
def test_a_long_draft_catch_up_does_not_inflate_the_draft_cost():
    model = CostModel.from_profile(CPU_PROFILE)
    before = model.draft_seconds(1, 300, 3)
    usual = model.draft_seconds(1, 300, 3, forward_only=False)
    for _ in range(8):  # probes after long pauses: 65 tokens of catch-up, 1.5 s extra each
        model.observe(StepRecord(1, 3, (300,), (RequestOutcome("r", 3, 3, 4),), usual + 1.5, 0.9, usual + 2.5,
                                 draft_positions=3, draft_catchup_tokens=65))
    assert model.draft_seconds(1, 300, 3) == pytest.approx(before)
    assert model.draft_catchup_seconds(65) == pytest.approx(1.5, rel=0.05)
    # The same extra time without a catch-up to explain it is learned as draft cost.
    for _ in range(8):
        model.observe(StepRecord(1, 3, (300,), (RequestOutcome("r", 3, 3, 4),), usual + 1.5, 0.9, usual + 2.5,
                                 draft_positions=3, draft_catchup_tokens=1))
    assert model.draft_seconds(1, 300, 3) > before + 1.0


# --- warm start ---------------------------------------------------------------------------------
def test_goodput_state_round_trips_through_json():
    policy = GoodputPolicy(CostModel.default())
    policy.prior.update(4, 4)
    policy.calibration.update(0.9, 0, True)
    saved = json.loads(json.dumps(policy.state()))
    fresh = GoodputPolicy(CostModel.default())
    fresh.load_state(saved)
    assert fresh.prior.rates()[0] == pytest.approx(policy.prior.rates()[0])
    assert fresh.calibration.predict(0.9, 0) == pytest.approx(policy.calibration.predict(0.9, 0))
    with pytest.raises(ValueError):
        fresh.load_state({"prior": {}})


def test_a_saved_acceptance_state_warm_starts_goodput_through_the_profile(tmp_path):
    """`simulate --save-acceptance` writes what goodput learned over the committed traces; a
    cost model carrying it (as `--profile auto` loads it from beside the profile) starts goodput
    from it instead of the 0.6 prior. A malformed file warns and is ignored."""
    from adaptive_spec.cli import main
    from adaptive_spec.control import make_policy
    from adaptive_spec.profiling.profile_file import acceptance_path, load_acceptance

    profile_path = tmp_path / "machine.json"
    profile_path.write_text(json.dumps(CPU_PROFILE))
    saved = acceptance_path(profile_path)
    assert saved.name == "machine.acceptance.json"
    code = main(["simulate", "--trace", str(ROOT / "traces" / "qwen-coder-code-t0.csv"), "--profile", str(profile_path),
                 "--policy", "goodput", "--save-acceptance", str(saved)])
    assert code == 0
    state = load_acceptance(saved)
    model = cost_model_from(CPU_PROFILE)
    model.warm_start = state
    warm, cold = make_policy("goodput", cost_model=model), make_policy("goodput", cost_model=cost_model_from(CPU_PROFILE))
    assert warm.prior.rates()[0] > 0.8 > cold.prior.rates()[0]  # code: ~0.86 of first drafts accepted
    assert warm.calibration.weight == pytest.approx(state["calibration"]["weight"])
    assert warm.calibration.biases == pytest.approx(state["calibration"]["biases"])
    saved.write_text('{"format": "something else"}')
    with pytest.warns(UserWarning, match="ignoring acceptance state"):
        assert load_acceptance(saved) is None


def test_simulate_warm_start_starts_goodput_from_the_saved_state(tmp_path, capsys):
    """`simulate --warm-start` runs goodput as the engine runs it with a profile that has a saved
    state beside it: here a state learned on code makes the first request's steps draft deeper
    than a cold start does (control: `--warm-start none` is the cold run). A missing or foreign
    file named explicitly is an error; `auto` without a file beside the profile runs cold."""
    from adaptive_spec.cli import main
    from adaptive_spec.profiling.profile_file import acceptance_path

    code_trace = str(ROOT / "traces" / "qwen-coder-code-t0.csv")
    profile_path = tmp_path / "machine.json"
    profile_path.write_text(json.dumps(CPU_PROFILE))
    saved = acceptance_path(profile_path)

    def run(*extra) -> dict:
        assert main(["simulate", "--trace", code_trace, "--profile", str(profile_path), "--policy", "goodput",
                     "--num-requests", "1", *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    cold_auto = run("--warm-start", "auto")  # nothing beside the profile yet: a cold start
    assert "warm_start" not in cold_auto
    assert main(["simulate", "--trace", code_trace, "--profile", str(profile_path), "--policy", "goodput",
                 "--save-acceptance", str(saved)]) == 0
    capsys.readouterr()
    cold, warm = run("--warm-start", "none"), run("--warm-start", "auto")
    assert cold == {**cold_auto, "wall_seconds": cold["wall_seconds"]}
    assert warm["warm_start"] is True and "warm_start" not in cold
    assert warm["steps"] < cold["steps"]  # the saved state knows the drafter agrees on code
    assert run("--warm-start", str(saved))["steps"] == warm["steps"]
    base = ["simulate", "--trace", code_trace, "--profile", str(profile_path), "--warm-start"]
    assert main([*base, str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "foreign.json").write_text('{"format": "something else"}')
    with pytest.warns(UserWarning):
        assert main([*base, str(tmp_path / "foreign.json")]) == 2
    assert "not an acceptance state" in capsys.readouterr().err

def test_simulate_reports_calibration_quality():
    from adaptive_spec.simulation.trace_file import load_trace

    traces = load_trace(ROOT / "traces" / "qwen-coder-chat-t0.csv").requests()
    report = simulate(traces, CPU_PROFILE, "goodput")
    quality = report["calibration"]
    assert quality["outcomes"] > 100 and 0 < quality["brier"] < 0.25
    assert quality["brier_raw_confidence"] is not None
    assert sum(row["outcomes"] for row in quality["reliability"]) == quality["outcomes"]
    assert "calibration" not in simulate(traces, CPU_PROFILE, "static:3")


def test_constrained_requests_learn_an_acceptance_prior_apart_from_free_text():
    """Rows under a grammar (its forced tokens are accepted for sure) beside free rows whose drafts
    all fail: with groups, each group's prior learns its own rate, so a new constrained request
    starts near 1 and a new free one near 0, and the warm-start state carries both. Negative
    control: the same outcomes without groups pool into one prior in between."""
    for grouped in (True, False):
        policy = GoodputPolicy(CostModel.default(), GoodputConfig())
        views = [RequestView("c", 100, 500, 4, AcceptanceHistory(), group="constrained" if grouped else ""),
                 RequestView("f", 100, 500, 4, AcceptanceHistory())]
        outcomes = (RequestOutcome("c", 4, 4, 5), RequestOutcome("f", 4, 0, 1))
        for _ in range(40):
            policy.choose(views)
            policy.observe(StepRecord(2, 4, (100, 100), outcomes, 0.0, 1.0, 1.0))
        free = policy.prior.rates()[0]
        if grouped:
            constrained = policy.group_priors["constrained"].rates()[0]
            assert constrained > 0.9 and free < 0.1, (constrained, free)
            restored = GoodputPolicy(CostModel.default(), GoodputConfig())
            restored.load_state(json.loads(json.dumps(policy.state())))
            assert restored.group_priors["constrained"].rates()[0] > 0.9 and restored.prior.rates()[0] < 0.1
        else:
            assert not policy.group_priors and 0.3 < free < 0.7, free
