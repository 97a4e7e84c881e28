"""The shared-parameter online cost model (`control.online_cost`) and the simulator's price-error probes.

Statistical tests use fixed seeds, so they are deterministic; the margins quoted are what makes a
different seed fail with negligible probability (errors of many standard errors).
"""

import json
from pathlib import Path

import numpy as np
import pytest

from adaptive_spec.control.cost_model import CostModel
from adaptive_spec.control.online_cost import PARAMETERS, SharedCostModel, cost_model_for
from adaptive_spec.control.policy import StepRecord
from adaptive_spec.simulation import load_traces, simulate
from adaptive_spec.simulation.price_error import ClockChange, parse_scaling, scaled_profile

ROOT = Path(__file__).resolve().parents[1]
HF = json.loads((ROOT / "profiles/cpu-2core-qwen-coder-fp32-int8draft.json").read_text())
VLLM = json.loads((ROOT / "profiles/cpu-2core-vllm-qwen-coder-fp32.json").read_text())


def step(truth: CostModel, b: int, c: int, k: int, noise=None, scale=(1.0, 1.0, 1.0)) -> StepRecord:
    """A timed step whose parts come from `truth` (times `scale`), with multiplicative noise."""
    d = truth.draft_seconds(b, c, k) * scale[0]
    v = truth.target_seconds(b, c, k + 1) * scale[1]
    r = truth.overhead_seconds(b, k) * scale[2]
    if noise is not None:
        d, v, r = (x * (1 + noise()) for x in (d, v, r))
    return StepRecord(b, k, (c,) * b, (), d, v, d + v + r, draft_positions=k)


def relative_prices(model, b, c, k_max=6):
    table = np.asarray(model.step_seconds_table(b, c, k_max))
    return table / table[0]


def test_prior_is_the_profile_exactly():
    cells, shared = CostModel.from_profile(HF), SharedCostModel.from_profile(HF)
    for b in (1, 3, 4, 16, 100):
        for c in (50, 128, 700, 5000):
            assert shared.step_seconds_table(b, c, 12) == pytest.approx(cells.step_seconds_table(b, c, 12), rel=1e-12)
    v_cells, v_shared = CostModel.from_profile(VLLM), SharedCostModel.from_profile(VLLM)
    assert v_shared.ragged_step_seconds(4, 300, [2, 0, 1, 0]) == pytest.approx(v_cells.ragged_step_seconds(4, 300, [2, 0, 1, 0]))
    assert cost_model_for(None, "shared").is_default and type(cost_model_for(HF)) is CostModel


def test_known_parameters_recovered_from_noisy_steps():
    truth = SharedCostModel.from_profile(HF)
    truth.theta = np.zeros(len(PARAMETERS))  # no per-length deviations: the shared parts alone
    truth.theta[:10] = [1.1, 0.9, 0.8, 1.2, 1.3, 1.4, 1.0, 1.25, 1.1, 0.9]
    truth._version += 1
    model = SharedCostModel.from_profile(HF)
    rng = np.random.default_rng(0)
    for _ in range(600):  # cells vary in batch, context and K, so every part is excited
        b, c, k = int(rng.choice([1, 2, 4])), int(rng.integers(128, 1024)), int(rng.integers(0, 7))
        model.observe(step(truth, b, c, k, noise=lambda: rng.normal(0, 0.02)))
    # 2% noise over ~600 steps: a prediction's standard error is ~0.2%; 2% is 10 of them
    for b in (1, 2, 4):
        for c in (200, 900):
            assert model.step_seconds_table(b, c, 6) == pytest.approx(truth.step_seconds_table(b, c, 6), rel=0.02)
    learned = model.parameters()
    for name in ("v_base", "v_first", "v_more", "d_base", "d_more", "r"):
        assert learned[name] == pytest.approx(truth.parameters()[name], abs=0.1), name
    assert model.outliers <= 3  # 2% noise has no 6-sigma rows, save model-uncertainty edge cases


def test_a_seen_cell_moves_unseen_cells_prices():
    """Only K = 0 and K = 3 timed on a whole-step (vLLM) profile whose draft increment is 30% too
    low: K = 1's price must move up with K = 3's; the per-cell model copies K = 3's ratio onto the
    whole K = 1 step, which dilutes it (the issue's worked example)."""
    truth = CostModel.from_profile(scaled_profile(VLLM, verify_per_token=1.3))
    shared, cells = SharedCostModel.from_profile(VLLM), CostModel.from_profile(VLLM)
    for i in range(200):
        record = step(truth, 1, 300, 3 if i % 2 else 0)
        shared.observe(record)
        cells.observe(record)
    true = relative_prices(truth, 1, 300)
    before = relative_prices(CostModel.from_profile(VLLM), 1, 300)
    error_shared = abs(relative_prices(shared, 1, 300)[1] / true[1] - 1)
    error_cells = abs(relative_prices(cells, 1, 300)[1] / true[1] - 1)
    error_prior = abs(before[1] / true[1] - 1)
    assert error_shared < 0.5 * error_prior  # moved the right way, most of the distance
    assert error_shared < error_cells  # negative control: the per-cell model's borrowed factor
    assert relative_prices(shared, 1, 300)[3] == pytest.approx(true[3], rel=0.01)  # the seen cell


def _steady(model, truth, steps, rng):
    for i in range(steps):
        model.observe(step(truth, 1, 200 + i % 300, 1 + i % 5, noise=lambda: rng.normal(0, 0.01)))


def test_an_outlier_is_not_learned_and_without_robust_weights_it_is():
    truth = CostModel.from_profile(HF)

    def run(**options):
        model = SharedCostModel.from_profile(HF, **options)
        _steady(model, truth, 200, np.random.default_rng(1))
        before = model.step_seconds_table(1, 300, 6)
        model.observe(step(truth, 1, 300, 3, scale=(5.0, 5.0, 1.0)))  # a page fault: 5x draft and verify
        after = model.step_seconds_table(1, 300, 6)
        return model, max(abs(a / b - 1) for a, b in zip(after, before))

    robust, moved = run()
    assert moved < 0.002 and robust.outliers == 1 and robust.shifts == 0
    plain, moved_plain = run(huber=1e6, reject=1e7)  # negative control: plain least squares
    assert moved_plain > 0.01 and plain.outliers == 0


def test_a_sustained_shift_is_detected_and_forgotten():
    truth = CostModel.from_profile(HF)
    slower = (1.3, 1.0, 1.0)  # the draft got 30% slower

    def run(**options):
        model = SharedCostModel.from_profile(HF, **options)
        rng = np.random.default_rng(2)
        _steady(model, truth, 300, rng)
        for i in range(60):
            model.observe(step(truth, 1, 200 + i, 1 + i % 5, noise=lambda: rng.normal(0, 0.01), scale=slower))
        expected = [truth.draft_seconds(1, 250, k) * 1.3 + truth.target_seconds(1, 250, k + 1) + truth.overhead_seconds(1, k)
                    for k in range(7)]
        return model, max(abs(p / e - 1) for p, e in zip(model.step_seconds_table(1, 250, 6), expected))

    model, error = run()
    assert model.shifts >= 1 and error < 0.02
    stuck, error_stuck = run(cusum_threshold=float("inf"))  # negative control: no shift detection
    assert stuck.shifts == 0 and error_stuck > 0.05  # the new level looks like outliers and is refused


@pytest.mark.parametrize("prior_sd", [0.3, 0.15])
def test_prior_weight_is_honoured(prior_sd):
    """No forgetting, the rest of the step only (one part, no correlation): after n steps measuring
    1.2x the profile, the scale is the weighted mean (weight * 1 + n * 1.2) / (weight + n) with
    weight = (noise / prior_sd)^2 steps."""
    model = SharedCostModel.from_profile(HF, prior_sd=prior_sd, noise=0.3, forgetting=1.0)
    weight = model.prior_weight
    assert weight == pytest.approx((0.3 / prior_sd) ** 2)
    truth = CostModel.from_profile(HF)
    for n in range(1, 4):
        model.observe(step(truth, 2, 300, 0, scale=(1.0, 1.0, 1.2)))
        assert model.parameters()["r"] == pytest.approx((weight + n * 1.2) / (weight + n), rel=1e-9)
    assert model.parameters()["v_base"] == pytest.approx(1.0, abs=1e-9)  # the verify was as profiled


def test_the_generic_shape_learns_a_machine_quickly():
    truth = CostModel.from_profile(HF)
    model = SharedCostModel.default()
    assert model.prior_sd == 1.0
    rng = np.random.default_rng(3)
    for i in range(300):
        model.observe(step(truth, 1, 200 + i, int(rng.integers(0, 7)), noise=lambda: rng.normal(0, 0.01)))
    true = relative_prices(truth, 1, 400)
    assert np.abs(relative_prices(model, 1, 400) / true - 1).max() < 0.1
    assert all(x > 0 for x in model.step_seconds_table(1, 400, 12))


def test_options_are_checked():
    with pytest.raises(ValueError):
        SharedCostModel.from_profile(HF, forgetting=0.0)
    with pytest.raises(ValueError):
        SharedCostModel.from_profile(HF, huber=5.0, reject=2.0)
    with pytest.raises(ValueError):
        cost_model_for(HF, "median")
    assert len(PARAMETERS) == 10 + 2 * 16


def test_scaled_profile_scales_draft_and_verify_increment():
    base, scaled = CostModel.from_profile(HF), CostModel.from_profile(scaled_profile(HF, draft=1.3, verify_per_token=0.8))
    for k in (1, 3):
        assert scaled.draft_seconds(1, 128, k) == pytest.approx(1.3 * base.draft_seconds(1, 128, k), rel=1e-9)
    one = base.target_seconds(2, 128, 1)
    # the grid's fit (noise-sized drops pooled) is not linear in the medians: equal to 1%
    assert scaled.target_seconds(2, 128, 1) == pytest.approx(one, rel=1e-3)
    assert scaled.target_seconds(2, 128, 3) == pytest.approx(one + 0.8 * (base.target_seconds(2, 128, 3) - one), rel=1e-2)
    whole, whole_scaled = CostModel.from_profile(VLLM), CostModel.from_profile(scaled_profile(VLLM, draft=1.3))
    one = whole.target_seconds(1, 128, 1)  # a whole-step profile: the draft is in the increment
    assert whole_scaled.target_seconds(1, 128, 4) == pytest.approx(one + 1.3 * (whole.target_seconds(1, 128, 4) - one), rel=1e-2)
    assert parse_scaling("draft=1.3, verify-token=0.8") == {"draft": 1.3, "verify_per_token": 0.8}
    with pytest.raises(ValueError):
        parse_scaling("target=2")


TRACES = [str(ROOT / "traces/int8-draft/qwen-coder-code-t0.csv"), str(ROOT / "traces/int8-draft/qwen-coder-chat-t0.csv")]


def test_simulate_with_the_shared_model_and_a_mid_run_clock_change():
    traces = load_traces(TRACES)
    plain = simulate(traces, HF, "goodput", num_requests=8)
    assert "price_error" not in plain and "cost_model" not in plain and "cost_model_events" not in plain
    change = ClockChange(150, scaled_profile(HF, draft=1.3))
    report = simulate(traces, None, "goodput", num_requests=12, clock_profile=HF, cost_model="shared",
                      clock_change=change, price_errors=True)
    assert report["cost_model"] == "shared" and report["policy_profile"] is None
    assert report["price_error"]["steps"] == report["steps"] and report["price_error"]["change_at"] == 150
    assert set(report["cost_model_events"]) == {"outliers", "shifts"}
    with pytest.raises(ValueError):
        simulate(traces, None, "goodput", num_requests=2)


def test_simulate_command_takes_the_cost_model_options(capsys):
    from adaptive_spec.cli import main

    profile = str(ROOT / "profiles/cpu-2core-qwen-coder-fp32-int8draft.json")
    argv = ["simulate", "--trace", TRACES[0], "--profile", "none", "--clock-profile", profile, "--cost-model", "shared",
            "--price-errors", "--clock-change", "40:draft=1.3", "--num-requests", "4"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["cost_model"] == "shared" and report["clock_change"]["step"] == 40 and "price_error" in report
    argv = ["simulate", "--trace", TRACES[0], "--profile", profile, "--profile-scale", "draft=1.3,verify-token=0.8",
            "--num-requests", "4"]
    assert main(argv) == 0
    assert "cost_model" not in json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["simulate", "--trace", TRACES[0], "--profile", "none", "--num-requests", "2"]) != 0  # no machine


def test_the_generic_shape_of_a_whole_step_host_times_no_draft_apart():
    assert cost_model_for(None, "shared").has_draft
    whole = cost_model_for(None, "shared", whole_step=True)
    assert not whole.has_draft and whole.step_seconds_table(1, 300, 4) == cost_model_for(None, "shared").step_seconds_table(1, 300, 4)


def test_learned_state_round_trip_and_malformed_states():
    truth = CostModel.from_profile(scaled_profile(HF, draft=1.3))
    model = SharedCostModel.from_profile(HF)
    rng = np.random.default_rng(4)
    for i in range(100):
        model.observe(step(truth, 1, 200 + i, 1 + i % 5, noise=lambda: rng.normal(0, 0.01)))
    state = json.loads(json.dumps(model.learned_state()))  # through JSON, as a file would hold it
    fresh = SharedCostModel.from_profile(HF)
    fresh.load_learned_state(state)
    assert fresh.step_seconds_table(2, 400, 8) == pytest.approx(model.step_seconds_table(2, 400, 8), rel=1e-9)
    record = step(truth, 1, 333, 3)
    model.observe(record)
    fresh.observe(record)  # and it learns on from there alike
    assert fresh.parameters() == pytest.approx(model.parameters(), rel=1e-6)
    for broken in ({}, {**state, "kind": "cells"}, {**state, "parameters": state["parameters"][:-1]},
                   {**state, "theta": state["theta"][:3]}, {**state, "information": "x"}):
        with pytest.raises(ValueError):
            SharedCostModel.from_profile(HF).load_learned_state(broken)


def test_a_learned_state_saved_in_the_profile_format_resumes_where_it_ended(tmp_path):
    """`learned_profile` -> file -> `load_cost_model`: the resumed model prices every cell as the
    saved one did, counts the steps it resumed from, and whatever `kind` asks, is the shared model."""
    from adaptive_spec.profiling.profile_file import learned_profile, load_cost_model, load_profile, save_profile

    truth = CostModel.from_profile(scaled_profile(HF, draft=1.3))
    rng = np.random.default_rng(5)
    for prior in (HF, None):  # from a profile, and from the generic shape (a file with no tables)
        model = cost_model_for(prior, "shared")
        for i in range(120):
            model.observe(step(truth, 1 + i % 2, 200 + i, i % 6, noise=lambda: rng.normal(0, 0.01)))
        path = save_profile(learned_profile(model, prior, {"device": "cpu", "threads": 2}), tmp_path / "learned.json")
        document = load_profile(path)
        assert document["learned"]["shape"] == ("profile" if prior else "generic")
        assert "120 steps" in document["name"]
        resumed = load_cost_model(path, kind="cells")
        assert isinstance(resumed, SharedCostModel) and resumed.resumed_steps == 120
        for b in (1, 2, 4):
            assert resumed.step_seconds_table(b, 500, 8) == pytest.approx(model.step_seconds_table(b, 500, 8), rel=1e-9)
        # and a fresh model of the same start does not (the saved state is what moved it)
        fresh = cost_model_for(prior, "shared")
        assert fresh.step_seconds_table(1, 500, 4) != pytest.approx(model.step_seconds_table(1, 500, 4), rel=1e-3)
        # saved again after more steps: the same start, not a chain of names
        resumed.observe(step(truth, 1, 300, 2))
        again = learned_profile(resumed, document, {"device": "cpu"})
        assert again["learned"]["shape"] == document["learned"]["shape"] and "121 steps" in again["name"]
        assert again["name"].count("learned online") == 1


def test_foreign_and_malformed_learned_states(tmp_path):
    """A learned state from another machine loads with a warning (as a profile does); a malformed
    one is a ProfileError naming the file."""
    from adaptive_spec.profiling.profile_file import (ProfileError, ProfileMismatchWarning, learned_profile,
                                                      load_cost_model, save_profile)

    model = cost_model_for(HF, "shared")
    model.observe(step(CostModel.from_profile(HF), 1, 300, 3))
    document = learned_profile(model, HF, {"device": "cpu", "device_name": "another CPU", "threads": 64})
    path = save_profile(document, tmp_path / "foreign.json")
    with pytest.warns(ProfileMismatchWarning, match="another CPU"):
        assert load_cost_model(path).resumed_steps == 1
    broken = json.loads(json.dumps(document))
    broken["learned"]["state"]["theta"] = [1.0]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    with pytest.raises(ProfileError, match="broken.json"):
        load_cost_model(tmp_path / "broken.json")
    for section in ({"shape": "profile"}, {"shape": "sideways", "state": {}}):
        (tmp_path / "bad.json").write_text(json.dumps({**document, "learned": section}))
        with pytest.raises(ProfileError, match="bad.json"):
            load_cost_model(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="shared"):
        learned_profile(CostModel.from_profile(HF), HF, {})


def test_profile_show_prints_a_learned_state_against_its_shape(tmp_path, capsys):
    from adaptive_spec.cli import main
    from adaptive_spec.profiling.profile_file import learned_profile, save_profile

    truth = CostModel.from_profile(scaled_profile(HF, draft=1.5))
    for prior in (HF, None):
        model = cost_model_for(prior, "shared")
        for i in range(40):
            model.observe(step(truth, 1, 300 + i, i % 5))
        path = save_profile(learned_profile(model, prior, {"device": "cpu"}), tmp_path / "learned.json")
        assert main(["profile", "show", str(path)]) == 0
        out = capsys.readouterr().out
        shown = json.loads(out.strip().splitlines()[-1])
        assert shown["learned_steps"] == 40 and shown["learned_parameters"]["d_base"] == pytest.approx(model.theta[5])
        assert "learned   40 steps online" in out and ("profile " in out.split("step ms")[1]) == (prior is not None)
        assert "uncertain by +-" in out


def test_price_spread_is_zero_at_k0_and_shrinks_where_steps_were_timed():
    assert CostModel.from_profile(HF).price_spread(1, 6) == [0.0] * 7  # a per-cell correction keeps none
    truth = CostModel.from_profile(HF)
    model = SharedCostModel.from_profile(HF)
    before = model.price_spread(1, 6)
    assert before[0] == 0.0 and all(s > 0 for s in before[1:])
    for i in range(50):  # K = 0 and 2 alone (a price above K = 0 needs K = 0's too)
        model.observe(step(truth, 1, 200 + i, 2 * (i % 2)))
    after = model.price_spread(1, 6)
    # the timed length is pinned down most; the shared parts narrow the others too, less so
    assert after[2] < 0.1 * before[2]
    assert all(a < b for a, b in zip(after[1:], before[1:]))
    assert after[6] / before[6] > after[2] / before[2]
    assert len(model.price_spread(1, 40)) == 41  # past the profile's lengths: the last one's spread


def test_the_cusum_slack_lets_a_small_persistent_misfit_pass_and_catches_a_shift():
    """A misfit of 0.9 standard errors on every step never alarms with the default slack (1); the
    old slack (0.5, negative control) alarms on it. A 3-standard-error shift alarms within 12 steps."""
    def alarms(z, steps, **options):
        model = SharedCostModel.from_profile(HF, **options)
        for _ in range(steps):
            model._track_shift(1, z)
        return model.shifts

    assert SharedCostModel.from_profile(HF).cusum_slack == 1.0
    assert alarms(0.9, 500) == 0
    assert alarms(0.9, 500, cusum_slack=0.5) > 0
    assert alarms(3.0, 7) == 1 and alarms(-3.0, 7) == 1


def test_the_simulated_vllm_host_teaches_the_catch_up_price_as_the_plug_in_does():
    """Started from no profile, the policy's cost model prices a lazy draft's catch-up at 0; after a
    simulated vLLM run it prices it within 10% of the clock's (what the plug-in learns from
    `finish_step(catch_up_tokens=...)`)."""
    from adaptive_spec.control.registry import make_policy

    costs = cost_model_for(None, "shared", whole_step=True)
    assert costs.catch_up_seconds(100) == 0.0
    policy = make_policy("goodput", cost_model=costs)
    simulate(load_traces(TRACES), VLLM, policy, batch_size=4, num_requests=24, host="vllm", clock_profile=VLLM)
    clock = CostModel.from_profile(VLLM).catch_up_seconds(100)
    assert clock > 0 and costs.catch_up_seconds(100) == pytest.approx(clock, rel=0.1)


RAGGED = {4: (np.array([1.0, 4.0]), np.array([0.4, 0.5]))}  # one drafting row's share of the batch's increment


def _mixed_record(truth: CostModel, b: int, c: int, verified, drafting, positions=0) -> StepRecord:
    """A whole step (vLLM) that verified `verified` and drafts `drafting`, timed at `truth`'s price."""
    from adaptive_spec.control.policy import RequestOutcome
    from adaptive_spec.control.step_timing import mixed_step_seconds
    seconds = mixed_step_seconds(truth, b, c, verified, drafting)
    outcomes = tuple(RequestOutcome(f"r{i}", k, 0, 1) for i, k in enumerate(verified))
    return StepRecord(b, max(verified), (c,) * b, outcomes, 0.0, 0.0, seconds,
                      draft_positions=positions or max(drafting), lag=1, drafting=tuple(drafting))


def test_the_shared_model_prices_a_lag_mismatched_ragged_step_as_the_hosts_do():
    """The features of a step that verified one set of lengths and drafts another (vLLM's one-step
    lag, ragged rows) give, at the prior, exactly the price the plug-in and the simulator charge
    (`step_timing.mixed_step_seconds`, with the profile's ragged shares), so such a step is fitted,
    not set aside."""
    from adaptive_spec.control.step_timing import mixed_step_seconds
    model = SharedCostModel.from_profile(VLLM)
    model.ragged_shares = RAGGED  # what `profile --engine vllm` measures on a lazy draft
    for verified, drafting in (([3, 0, 2, 1], [1, 2, 0, 3]), ([2, 2, 2, 2], [0, 0, 0, 0]), ([0], [4])):
        b = len(verified)
        record = _mixed_record(model, b, 300, verified, drafting)
        predicted = float(model._step_features(b, 300.0, record, max(drafting)).sum(axis=0) @ model.theta)
        assert predicted == pytest.approx(mixed_step_seconds(model, b, 300, verified, drafting), rel=1e-9)


def test_only_lag_mismatched_ragged_steps_teach_the_uniform_prices():
    """True costs: the vLLM profile with verify cost per token x1.3. The model sees only steps whose
    verified and drafted lengths differ, rows ragged (none a (batch, K) cell stands for, which the
    per-cell correction leaves untimed) and still learns the uniform steps' prices at batch 4.
    Negative control: the prior's error on the same prices is several times larger."""
    truth = CostModel.from_profile(scaled_profile(VLLM, verify_per_token=1.3))
    model = SharedCostModel.from_profile(VLLM)
    truth.ragged_shares = model.ragged_shares = RAGGED
    rng = np.random.default_rng(1)
    for _ in range(300):
        verified, drafting = (rng.integers(0, 5, size=4).tolist() for _ in range(2))
        if verified == drafting or max(verified) == 0 or max(drafting) == 0:
            continue
        model.observe(_mixed_record(truth, 4, int(rng.integers(200, 600)), verified, drafting))
    assert model.observations > 250
    true = relative_prices(truth, 4, 400, 4)
    learned_error = np.abs(relative_prices(model, 4, 400, 4) / true - 1).max()
    prior_error = np.abs(relative_prices(CostModel.from_profile(VLLM), 4, 400, 4) / true - 1).max()
    assert prior_error > 0.05 and learned_error < prior_error / 4, (learned_error, prior_error)


def test_an_untimed_step_neither_counts_nor_fades_what_was_learned():
    """A record with no time (a prefill, a catch-up) is not a learned step: observations stay, and
    the information is not faded by forgetting."""
    model = SharedCostModel.from_profile(HF)
    truth = CostModel.from_profile(HF)
    for k in range(5):
        model.observe(step(truth, 1, 300, k))
    information = model._info.copy()
    model.observe(StepRecord(1, 2, (300,), (), 0.0, 0.0, 0.0))
    assert model.observations == 5 and np.array_equal(model._info, information)


def test_a_price_probe_unlocks_a_length_the_lagged_vllm_host_never_timed():
    """Batch 16 through the simulated vLLM host, the machine's profile against the controller's prior
    from another machine: the first steps teach only K = 1, K = 0's price stays the prior's, and
    without a probe the policy locks at K = 1 (measured 0.73x informed, bar < 0.8x); priced probes of
    the untimed length bring it within 5% of the informed controller (measured 0.97x). Deterministic
    (fixed seed and traces), so no false-failure probability."""
    from adaptive_spec.control.goodput import GoodputConfig, GoodputPolicy

    traces = load_traces(TRACES)
    run = dict(batch_size=16, num_requests=320, host="vllm", clock_profile=VLLM)
    informed = simulate(traces, VLLM, "goodput", cost_model="shared", **run)["tokens_per_s"]
    xeon = json.loads((ROOT / "profiles/cpu-2core-xeon-vllm-qwen-coder-fp32.json").read_text())
    rates = {}
    for horizon in (200, 0):
        policy = GoodputPolicy(cost_model_for(xeon, "shared", whole_step=True), GoodputConfig(price_probe_horizon=horizon))
        rates[horizon] = simulate(traces, VLLM, policy, **run)["tokens_per_s"]
        assert (policy.price_probes > 0) == (horizon > 0)
    assert rates[200] >= 0.95 * informed
    assert rates[0] < 0.8 * informed  # the negative control: no probe, the untimed length stays mispriced
