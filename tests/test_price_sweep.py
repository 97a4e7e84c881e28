"""The start-up sweep of draft lengths (`control.price_sweep.PriceSweep`, `--calibrate SECONDS`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaptive_spec.control.cost_model import CostModel
from adaptive_spec.control.goodput import GoodputPolicy
from adaptive_spec.control.online_cost import cost_model_for
from adaptive_spec.control.policy import KEEP_LAST, AcceptanceHistory, RequestView, StaticPolicy, StepRecord, draft_stop_rule
from adaptive_spec.control.price_sweep import PriceSweep
from adaptive_spec.simulation import load_traces, simulate

ROOT = Path(__file__).resolve().parents[1]
VLLM = json.loads((ROOT / "profiles/cpu-2core-vllm-qwen-coder-fp32.json").read_text())
TRACES = [str(ROOT / "traces/qwen-coder-code-t0.csv"), str(ROOT / "traces/qwen-coder-chat-t0.csv")]


class Recording(GoodputPolicy):
    def __init__(self):
        super().__init__(CostModel.default())
        self.records, self.chosen = [], 0

    def choose(self, requests):
        self.chosen += 1
        return super().choose(requests)

    def observe(self, record):
        self.records.append(record)
        super().observe(record)


def views(*caps):
    return [RequestView(f"r{i}", 100, 50, cap, AcceptanceHistory()) for i, cap in enumerate(caps)]


def record(lag=0, k=1):
    return StepRecord(1, k, (100,), (), 0.0, 0.0, 0.5, lag=lag)


def test_the_sweep_holds_each_length_then_hands_over_at_a_sweeps_end():
    """Lengths 0..max_k, `hold` steps each, capped per row; whole sweeps until the seconds are spent."""
    now = [0.0]
    policy = Recording()
    sweep = PriceSweep(policy, seconds=1.0, max_k=2, hold=2, clock=lambda: now[0])
    chosen = []
    for step in range(12):
        chosen.append(sweep.choose(views(2, 1)))
        now[0] += 0.15  # one sweep (6 steps) takes 0.9 s: a second one runs, then the policy
    assert chosen[:12] == [[0, 0], [0, 0], [1, 1], [1, 1], [2, 1], [2, 1]] * 2
    assert sweep.sweeping and policy.chosen == 0 and sweep.sweep_steps == 12
    sweep.choose(views(2, 1))
    assert not sweep.sweeping and policy.chosen == 1 and sweep.sweep_seconds == pytest.approx(1.8)
    assert sweep.name == policy.name and sweep.cost_model is policy.cost_model  # reads through


def test_the_sweep_keeps_every_draft_and_then_the_policys_rule_decides():
    policy = GoodputPolicy(CostModel.default())
    sweep = PriceSweep(policy, seconds=1e-9, max_k=1, hold=1)
    rule = draft_stop_rule(sweep)
    assert rule is not None
    sweep.choose(views(4))
    assert rule(0, [0.01, None]) == [True, False]  # a draft the policy's rule would drop is kept
    sweep.host_stops_drafts = True
    assert policy.host_stops_drafts  # what the host says reaches the policy
    sweep.choose(views(4))
    sweep.choose(views(4))
    assert not sweep.sweeping
    sweep.choose(views(4))  # the policy's own step, whose rule now answers
    assert rule(0, [0.01]) in ([False], [KEEP_LAST])  # goodput ends a draft that unlikely; the sweep kept it


def test_records_of_swept_drafts_reach_the_policy_matched_to_no_choice_of_its_own():
    """Under vLLM's lag the first record after the sweep verifies drafts the sweep chose: lag -1, so
    the policy pairs it with no choice; the next pairs with the policy's own (lag 1). Lag 0 hosts alike."""
    policy = Recording()
    sweep = PriceSweep(policy, seconds=1e-9, max_k=1, hold=1)
    sweep.choose(views(4))
    sweep.choose(views(4))  # the sweep's two steps
    sweep.observe(record(lag=1))  # verifies the first swept choice
    sweep.choose(views(4))  # the policy's first
    sweep.observe(record(lag=1))  # verifies the second swept choice
    sweep.choose(views(4))
    sweep.observe(record(lag=1))  # verifies the policy's first
    assert [r.lag for r in policy.records] == [-1, -1, 1]
    sweep.observe(record(lag=0))  # verifies the policy's latest choice
    assert policy.records[-1].lag == 0


def test_a_policy_that_reads_no_costs_or_a_bad_budget_is_a_clear_error():
    with pytest.raises(ValueError, match="reads no step costs"):
        PriceSweep(StaticPolicy(2), seconds=5)
    with pytest.raises(ValueError, match="seconds > 0"):
        PriceSweep(GoodputPolicy(CostModel.default()), seconds=0)


def test_a_sweep_times_every_length_the_policy_would_not_draft():
    """The simulated vLLM host at batch 1, the shared cost model started from no profile, one request
    (26-34 steps): after the sweep no length of 0..5 is untimed; without it some are (the negative
    control: K = 2-4 were, measured). Deterministic (fixed traces, no sampling): no false failures."""
    traces = load_traces(TRACES)
    untimed = {}
    for swept in (True, False):
        policy = GoodputPolicy(cost_model_for(None, "shared", whole_step=True))
        run = PriceSweep(policy, seconds=1e-9, max_k=5) if swept else policy
        report = simulate(traces, VLLM, run, batch_size=1, num_requests=1, host="vllm", clock_profile=VLLM)
        assert 18 < report["steps"] < 200
        untimed[swept] = policy.cost_model.untimed_misfit(1, 5)
        if swept:
            assert run.sweep_steps == 18 and not run.sweeping  # one whole sweep of 0..5, 3 steps each
    assert not any(untimed[True])
    assert any(untimed[False])


def test_a_sweep_stops_at_eight_unless_told_and_at_the_hosts_cap():
    """goodput may draft 12; the sweep times 0..8 (longer lengths share their neighbours' shape), or
    fewer where the first batch's cap is lower."""
    sweep = PriceSweep(GoodputPolicy(CostModel.default()), seconds=1.0, clock=lambda: 0.0)
    assert sweep.max_k == 8
    sweep.choose(views(5, 3))
    assert sweep.max_k == 5 and len(sweep.schedule) == 18
