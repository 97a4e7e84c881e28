"""The vLLM plug-in's bookkeeping without vLLM: policy failures, step records, settings."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from adaptive_spec.control.cost_model import CostModel
from adaptive_spec.control.policy import KEEP_LAST, StaticPolicy
from adaptive_spec.control.step_timing import whole_step_record
from adaptive_spec.integrations.vllm.controller import (MAX_UNASKED_STEPS, MIN_TIMED_CATCH_UP, POLICY_ENV, PROFILE_ENV,
                                                         ControllerSettings, RunningRequest, SpecController,
                                                         VerifiedRequest)
from adaptive_spec.profiling.profile_file import ProfileError


class RaisingPolicy:
    name = "raising"

    def choose(self, views):
        raise ZeroDivisionError("boom")

    def observe(self, record):
        raise RuntimeError("observe boom")


class RecordingPolicy(StaticPolicy):
    def __post_init__(self):
        super().__post_init__()
        self.records = []

    def observe(self, record):
        self.records.append(record)


def running(*caps):
    return [RunningRequest(f"r{i}", 100 + i, 50, cap) for i, cap in enumerate(caps)]


def test_a_failing_policy_gives_zero_drafts_and_warns_once():
    controller = SpecController(RaisingPolicy())
    with pytest.warns(RuntimeWarning, match="raising.*without speculation") as caught:
        for _ in range(3):
            assert controller.choose(running(4, 4)) == {"r0": 0, "r1": 0}
            controller.finish_step([VerifiedRequest("r0", 0, 0, 1, 101)])  # observe raises too: swallowed
    assert len(caught) == 1
    assert controller.stats.policy_failures == 6
    assert controller.draft_length("r0") == 0


def test_choices_are_clamped_to_each_requests_cap_and_unknown_requests_keep_no_drafts():
    controller = SpecController(StaticPolicy(5))
    assert controller.choose(running(5, 2, 0)) == {"r0": 5, "r1": 2, "r2": 0}
    assert controller.draft_length("r1") == 2
    assert controller.draft_length("never-seen") == 0


def test_finish_step_records_history_ragged_steps_and_tells_the_policy():
    ticks = iter([10.0, 10.5])
    policy = RecordingPolicy(3)
    controller = SpecController(policy, clock=lambda: next(ticks))
    controller.start_step()
    record = controller.finish_step([VerifiedRequest("a", 3, 2, 3, 120), VerifiedRequest("b", 1, 0, 1, 80)])
    assert policy.records == [record]
    assert record.batch_k == 3 and record.total_seconds == 0.0  # ragged: no profile cell's cost
    assert controller.stats.ragged_steps == 1 and controller.stats.accepted == 2
    assert controller._histories["a"].accepted_per_step == [2]
    controller.forget(["b"])
    assert set(controller._histories) == {"b"}


def test_only_steps_a_profile_cell_describes_are_timed():
    """A step is timed when every row verified K drafts and drafts K again (the profile's cell at K);
    one row probing beside rows at 0, or a step switching K, is recorded but untimed. Negative
    control: the same rows all at K = 2 are timed."""
    def step(verified_ks, next_ks):
        ticks = iter([0.0, 0.7])
        controller = SpecController(StaticPolicy(3), clock=lambda: next(ticks))
        controller._chosen = {f"r{i}": k for i, k in enumerate(next_ks)}
        controller.start_step()
        rows = [VerifiedRequest(f"r{i}", k, k, k + 1, 100) for i, k in enumerate(verified_ks)]
        return controller.finish_step(rows).total_seconds

    assert step([4, 0, 0, 0], [0, 0, 0, 0]) == 0.0  # a probe beside rows at k = 0
    assert step([0, 0, 0, 0], [2, 2, 2, 2]) == 0.0  # switching from K = 0 to K = 2
    assert step([2, 2, 2, 2], [2, 2, 2, 2]) == pytest.approx(0.7)
    assert step([0, 0, 0, 0], [0, 0, 0, 0]) == pytest.approx(0.7)


def test_a_step_with_a_few_rows_at_zero_is_timed_as_its_cell():
    """A long prompt left at k = 0 beside seven rows at K = 2 would make every step ragged, and a
    cost model fed only steady steps would never learn the machine. Such a step (rows fill >= 3/4 of
    the batch's K columns) is timed, scaled to its cell by the model's ragged price: 1 without the
    profile's ragged shares, cell / ragged with them. Negative controls: a probe beside idle rows,
    rows filling under 3/4, and a controller without a cost model stay untimed."""
    def step(verified_ks, next_ks, cost_model):
        ticks = iter([0.0, 0.7])
        controller = SpecController(StaticPolicy(3), cost_model, clock=lambda: next(ticks))
        controller._chosen = {f"r{i}": k for i, k in enumerate(next_ks)}
        controller.start_step()
        rows = [VerifiedRequest(f"r{i}", k, k, k + 1, 100) for i, k in enumerate(verified_ks)]
        return controller.finish_step(rows).total_seconds

    plain = CostModel.default()
    seven = [2] * 7 + [0]
    assert step(seven, seven, plain) == pytest.approx(0.7)
    assert step(seven, seven, None) == 0.0
    assert step([2] * 5 + [0] * 3, [2] * 5 + [0] * 3, plain) == 0.0  # 5 of 8 rows: under 3/4
    assert step([2] + [0] * 7, [2] + [0] * 7, plain) == 0.0  # a probe
    shared = CostModel.default()
    shared.ragged_shares = {8: (np.array([1.0, 3.0]), np.array([0.4, 0.4]))}
    full, priced = shared.step_seconds(8, 100, 2), shared.ragged_step_seconds(8, 100, seven)
    assert priced < full
    assert step(seven, seven, shared) == pytest.approx(0.7 * full / priced)


class Scripted(RecordingPolicy):
    """k = 3 for every request; inside the step every row but the last gets `answers[position]`, the
    last row drops its first draft (k = 0 beside the others)."""

    def __init__(self, answers):
        super().__init__(3)
        self.answers = answers
        self.host_stops_drafts = False

    def keep_drafting(self, position, confidences):
        return [False if c is None or row == len(confidences) - 1 else self.answers[position]
                for row, c in enumerate(confidences)]


def test_with_the_in_step_rule_a_step_with_a_row_at_zero_is_timed_unless_a_draft_past_k_ran():
    """With the rule asked inside the step, seven rows keep 2 drafts and the eighth drops its first:
    the loop ran 2 positions, K = 2, and the step is scaled to its cell as without the rule.
    Negative control: the same kept drafts after a loop that ran a third position and dropped it
    there paid a forward no cell holds, and the step stays untimed."""
    def step(answers):
        ticks = iter([0.0, 0.7])
        controller = SpecController(Scripted(answers), CostModel.default(), clock=lambda: next(ticks))
        assert controller.enable_stopping()
        controller.choose(running(*[3] * 8))
        for position in range(len(answers)):
            controller.keep_drafting(position, {f"r{i}": 0.9 for i in range(8)})
        kept = [controller.draft_length(f"r{i}") for i in range(8)]
        assert kept == [2] * 7 + [0] and controller._positions == len(answers)
        controller.start_step()
        rows = [VerifiedRequest(f"r{i}", k, k, k + 1, 100) for i, k in enumerate(kept)]
        return controller.finish_step(rows).total_seconds

    assert step([True, KEEP_LAST]) == pytest.approx(0.7)
    assert step([True, True, False]) == 0.0


def test_untimed_steps_teach_the_cost_model_nothing():
    controller = SpecController(RecordingPolicy(1))
    controller.start_step()
    record = controller.finish_step([VerifiedRequest("a", 1, 1, 2, 50)], timed=False)
    assert record.total_seconds == record.draft_seconds == record.verify_seconds == 0.0


def test_a_whole_step_is_split_in_the_cost_models_proportions():
    model = CostModel.default()
    record = whole_step_record(model, batch_size=2, batch_k=3, context_lengths=(100, 300), outcomes=(),
                               total_seconds=1.0)
    predicted = (model.draft_seconds(2, 300, 3), model.target_seconds(2, 300, 4), model.overhead_seconds(2, 3))
    assert record.draft_seconds / record.verify_seconds == pytest.approx(predicted[0] / predicted[1])
    assert record.total_seconds - record.draft_seconds - record.verify_seconds == pytest.approx(
        predicted[2] / sum(predicted))
    before = model.step_seconds(2, 300, 3)
    for _ in range(6):
        model.observe(record)
    assert before != pytest.approx(1.0) and model.step_seconds(2, 300, 3) == pytest.approx(1.0, rel=1e-6)


def test_settings_come_from_the_environment():
    settings = ControllerSettings.from_environment({POLICY_ENV: "static:2", PROFILE_ENV: "none"})
    assert settings == ControllerSettings("static:2", None)
    assert ControllerSettings.from_environment({}) == ControllerSettings("goodput", None)
    assert ControllerSettings.from_environment(settings.environment()) == settings


def test_a_missing_profile_is_a_clear_error(tmp_path):
    with pytest.raises(ProfileError, match="does not exist"):
        ControllerSettings("goodput", str(tmp_path / "missing.json")).build()


def test_an_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown policy 'fastest'.*known"):
        ControllerSettings("fastest").build()


def test_an_acceptance_state_beside_the_profile_warm_starts_the_plug_ins_goodput(tmp_path):
    """As `--profile` does for our engine: `<profile>.acceptance.json` (from `simulate --save-acceptance`)
    starts the plug-in's goodput from its prior and calibration; without one (the control) goodput
    starts from the usual 0.6 prior; a malformed one warns and is ignored."""
    import json
    import shutil
    from pathlib import Path

    from adaptive_spec.control import make_policy
    from adaptive_spec.profiling.profile_file import acceptance_path, save_acceptance

    root = Path(__file__).resolve().parents[2]
    profile = tmp_path / "vllm-host.json"
    shutil.copy(root / "profiles" / "cpu-2core-vllm-qwen-coder-fp32.json", profile)
    cold, _ = ControllerSettings("goodput", str(profile)).build()
    assert cold.prior.rates()[0] == pytest.approx(0.6)
    learned = make_policy("goodput", CostModel.default())
    for _ in range(40):  # a drafter whose first two drafts are nearly always accepted
        learned.prior.update(4, 3)
    learned.calibration.weight = 1.7
    save_acceptance(acceptance_path(profile), learned.state(), {"test": True})
    warm, cost_model = ControllerSettings("goodput", str(profile)).build()
    assert cost_model.warm_start is not None
    assert warm.prior.rates()[0] > 0.9 and warm.calibration.weight == pytest.approx(1.7)
    acceptance_path(profile).write_text(json.dumps({"format": "something else"}))
    with pytest.warns(UserWarning, match="ignoring acceptance state"):
        ignored, _ = ControllerSettings("goodput", str(profile)).build()
    assert ignored.prior.rates()[0] == pytest.approx(0.6)


def test_goodput_without_a_profile_learns_costs_online():
    policy, cost_model = ControllerSettings("goodput").build()
    assert policy.name == "goodput" and cost_model is not None and cost_model.is_default
    policy, cost_model = ControllerSettings("static:3").build()
    assert cost_model is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SpecController(policy).choose(running(4))


def test_a_reused_vllm_request_id_reaches_the_policy_under_a_fresh_key():
    """vLLM may reuse an id once its request left; the policy must not see the newcomer as the old one."""
    seen = []

    class Recorder(StaticPolicy):
        def choose(self, views):
            seen.append([view.request_id for view in views])
            return super().choose(views)

    controller = SpecController(Recorder(2))
    request = [RunningRequest("a", 10, 20, 5)]
    controller.choose(request)
    controller.choose(request)
    controller.forget([])  # "a" finished
    controller.choose(request)  # a new request under the same id
    assert seen[0] == seen[1] and seen[2] != seen[0]
    assert controller.draft_length("a") == 2  # the plug-in still speaks vLLM's ids


def test_bench_figures_per_workload_and_ratios_to_the_best_static_configuration():
    """Batch 1: per-workload speed is tokens over the requests' own seconds; the best static
    configuration is chosen per scope (overall, and per workload) among vllm-off and vllm-static:K."""
    from types import SimpleNamespace

    from adaptive_spec.integrations.vllm.bench import RequestTiming, _add_ratios, _summary

    def request(workload, seconds, tokens=10):
        return RequestTiming(0.0, workload, [seconds * (i + 1) / tokens for i in range(tokens)],
                             [seconds * (i + 1) / tokens for i in range(tokens)])

    def run(config, code_seconds, prose_seconds):
        return _summary(config, 0.0, [request("humaneval", code_seconds), request("sharegpt", prose_seconds)],
                        None if config == "vllm-off" else SimpleNamespace(stats=None), rate=0)

    rows = [run("vllm-off", 4.0, 4.0), run("vllm-static:3", 2.0, 8.0), run("goodput", 2.0, 4.0)]
    _add_ratios(rows)
    off, static, goodput = rows
    assert off["workloads"]["humaneval"]["tokens_per_request_s"] == 2.5
    assert static["tokens_per_s"] == 2.0 and off["tokens_per_s"] == 2.5  # 20 tokens in 10 s, in 8 s
    assert goodput["best_static"] == "vllm-off" and goodput["ratio_to_best_static"] == pytest.approx(20 / 6 / 2.5, abs=1e-3)
    assert goodput["workloads"]["humaneval"]["best_static"] == "vllm-static:3"
    assert goodput["workloads"]["humaneval"]["ratio_to_best_static"] == 1.0
    assert goodput["workloads"]["sharegpt"]["best_static"] == "vllm-off"
    assert goodput["workloads"]["sharegpt"]["ratio_to_vllm_off"] == 1.0
    assert static["workloads"]["sharegpt"]["ratio_to_best_static"] == 0.5


class CatchUpCosts:
    """A cost model that predicts 1 s per step and keeps the catch-ups it is told of."""

    def __init__(self):
        self.catch_ups = []

    def step_seconds(self, batch, context, k):
        return 1.0

    def draft_seconds(self, batch, context, k):
        return 0.0

    target_seconds = overhead_seconds = step_seconds

    def ragged_step_seconds(self, batch, context, ks):
        return 1.0

    def observe_catch_up(self, tokens, seconds):
        self.catch_ups.append((tokens, seconds))


def test_a_catch_up_step_is_timed_as_catch_up_not_as_a_step():
    ticks = iter([0.0, 4.0, 10.0, 14.0])
    costs = CatchUpCosts()
    policy = RecordingPolicy(1)
    controller = SpecController(policy, costs, clock=lambda: next(ticks))
    controller.choose([RunningRequest("a", 300, 50, 1, draft_behind=300)])
    controller.start_step()
    record = controller.finish_step([VerifiedRequest("a", 0, 0, 1, 301)], catch_up_tokens=300)
    assert costs.catch_ups == [(300, pytest.approx(3.0))]  # 4 s less the predicted 1 s step
    assert record.total_seconds == 0.0 and policy.records == [record]  # the policy learns no step cost
    controller.start_step()
    controller.finish_step([VerifiedRequest("a", 1, 1, 2, 303)], catch_up_tokens=MIN_TIMED_CATCH_UP - 1)
    assert len(costs.catch_ups) == 1  # too short to stand out of a step's noise


def test_the_policy_sees_how_far_each_lazy_draft_is_behind():
    seen = []

    class Looking(StaticPolicy):
        def choose(self, views):
            seen.extend(v.draft_behind for v in views)
            return super().choose(views)

    controller = SpecController(Looking(2))
    controller.choose([RunningRequest("a", 300, 50, 2, draft_behind=280), RunningRequest("b", 40, 50, 2)])
    assert seen == [280, 0]


class EndsAt(RecordingPolicy):
    """k = 3 for every request; inside the step request i's drafts end after ends[i] (0: the first is dropped)."""

    def __init__(self, ends):
        super().__init__(3)
        self.ends = ends
        self.host_stops_drafts = False

    def keep_drafting(self, position, confidences):
        return [False if c is None or end == 0 else True if position + 1 < end else KEEP_LAST
                for c, end in zip(confidences, self.ends)]


def test_the_in_step_rule_ends_each_requests_drafts_where_the_policy_says():
    """Three requests given k = 3: the policy drops r0's first draft, keeps one of r1's, all of r2's.
    The drafter is shown only the rows still drafting, and keeps what the answers say."""
    policy = EndsAt([0, 1, 3])
    controller = SpecController(policy)
    assert controller.enable_stopping() and policy.host_stops_drafts
    assert controller.choose(running(3, 3, 3)) == {"r0": 3, "r1": 3, "r2": 3}
    assert controller.keep_drafting(0, {"r0": 0.5, "r1": 0.9, "r2": 0.9}) == {"r0": 0, "r1": KEEP_LAST, "r2": 1}
    assert controller.keep_drafting(1, {"r0": 0.5, "r1": 0.9, "r2": 0.9}) == {"r2": 1}  # r0, r1 ended
    assert controller.keep_drafting(2, {"r2": 0.9}) == {"r2": KEEP_LAST}
    assert [controller.draft_length(r) for r in ("r0", "r1", "r2")] == [0, 1, 3]
    assert controller.stats.stopped_early == 2
    # negative control: a policy without a rule keeps every draft it chose
    plain = SpecController(RecordingPolicy(3))
    assert not plain.enable_stopping()
    plain.choose(running(3, 3, 3))
    assert plain.keep_drafting(0, {"r0": 0.5}) == {"r0": 1} and plain.draft_length("r0") == 3


def test_with_a_batch_limit_the_rule_runs_only_in_steps_that_small():
    """enable_stopping(max_batch=1): a step of two requests is chosen as for a host that cannot stop
    (the policy is told) and its drafts are kept whole; a step of one request asks the rule. Steps
    above the limit do not count as steps where the drafter failed to ask."""
    policy = EndsAt([1, 1])
    controller = SpecController(policy)
    assert controller.enable_stopping(max_batch=1)
    for _ in range(MAX_UNASKED_STEPS + 1):
        controller.choose(running(3, 3))
        assert not controller.stops_drafts and not policy.host_stops_drafts
        assert controller.keep_drafting(0, {"r0": 0.9, "r1": 0.9}) == {"r0": 1, "r1": 1}
        assert controller.draft_length("r0") == 3
        controller.finish_step([VerifiedRequest("r0", 0, 0, 1, 100), VerifiedRequest("r1", 0, 0, 1, 100)])
    controller.choose(running(3))
    assert controller.stops_drafts and policy.host_stops_drafts
    assert controller.keep_drafting(0, {"r0": 0.9}) == {"r0": KEEP_LAST} and controller.draft_length("r0") == 1
    with pytest.raises(ValueError, match="max_batch"):
        SpecController(EndsAt([1])).enable_stopping(max_batch=0)


def test_a_stop_rule_that_raises_ends_every_draft_and_warns():
    class Raising(EndsAt):
        def keep_drafting(self, position, confidences):
            raise ValueError("boom")

    controller = SpecController(Raising([3, 3]))
    controller.enable_stopping()
    controller.choose(running(3, 3))
    with pytest.warns(RuntimeWarning, match="keep_drafting"):
        assert controller.keep_drafting(0, {"r0": 0.9, "r1": 0.9}) == {"r0": 0, "r1": 0}
    assert controller.draft_length("r0") == controller.draft_length("r1") == 0


def test_records_tell_the_policy_which_choice_their_drafts_came_from():
    """vLLM reports step N's outcomes (the drafts chosen at N - 1) after choosing N's drafts: lag 1.
    The first step verifies drafts no choice made (-1); a step after one whose batch had no
    decoding request (no choice asked) verifies the last choice made: lag 0."""
    policy = RecordingPolicy(2)
    controller = SpecController(policy)
    lags = []
    for batch in ([2, 2], [2, 2], [], [2, 2]):
        controller.choose(running(*batch))
        controller.start_step()
        controller.finish_step([VerifiedRequest("r0", 0, 0, 1, 100)])
        lags.append(policy.records[-1].lag)
    assert lags == [-1, 1, 0, -1]


def test_a_drafter_that_never_asks_the_rule_is_no_longer_counted_on():
    """If drafting steps pass without the drafter asking the stop rule (it cannot stop), the policy
    is told after MAX_UNASKED_STEPS of them, so it stops asking for drafts it expects the rule to end."""
    policy = EndsAt([3])
    controller = SpecController(policy)
    controller.enable_stopping()
    with pytest.warns(RuntimeWarning, match="never asked"):
        for _ in range(MAX_UNASKED_STEPS):
            controller.choose(running(3))
            controller.finish_step([VerifiedRequest("r0", 0, 0, 1, 100)])
    assert not policy.host_stops_drafts and not controller.stops_drafts
    # control: a drafter that asks keeps the rule
    asked = SpecController(EndsAt([3]))
    asked.enable_stopping()
    for _ in range(MAX_UNASKED_STEPS + 1):
        asked.choose(running(3))
        asked.keep_drafting(0, {"r0": 0.9})
        asked.finish_step([VerifiedRequest("r0", 0, 0, 1, 100)])
    assert asked.stops_drafts


def test_the_shared_cost_model_and_its_learned_state_through_the_environment(tmp_path):
    """ADAPTIVE_SPEC_VLLM_SAVE_LEARNED: the plug-in builds the shared model (the generic shape of a
    whole-step host), writes its state once SAVE_EVERY steps were learned, and a plug-in started
    from that file resumes it; contradictions are clear errors."""
    import json

    from adaptive_spec.control.online_cost import SharedCostModel
    from adaptive_spec.integrations.vllm.controller import COST_MODEL_ENV, SAVE_EVERY, SAVE_LEARNED_ENV

    path = tmp_path / "learned.json"
    settings = ControllerSettings.from_environment({POLICY_ENV: "goodput", SAVE_LEARNED_ENV: str(path)})
    assert settings == ControllerSettings("goodput", None, None, str(path))
    assert ControllerSettings.from_environment(settings.environment()) == settings
    policy, model = settings.build()
    assert isinstance(model, SharedCostModel) and not model.has_draft  # vLLM times whole steps
    clock = iter(float(t) for t in range(10 ** 6))
    controller = SpecController(policy, model, clock=lambda: next(clock), saver=settings.saver(model))
    for step in range(SAVE_EVERY + 5):
        controller._chosen = {"r0": 2}
        controller.start_step()
        controller.finish_step([VerifiedRequest("r0", 2, 1, 2, 100 + step)])
        if step == SAVE_EVERY - 2:
            assert not path.exists()  # not yet: one write per SAVE_EVERY learned steps
    saved = json.loads(path.read_text())
    assert saved["fingerprint"]["engine"] == "vllm" and saved["learned"]["whole_step"]
    steps = saved["learned"]["state"]["observations"]
    assert SAVE_EVERY <= steps <= model.observations
    _, resumed = ControllerSettings.from_environment({PROFILE_ENV: str(path)}).build()
    assert isinstance(resumed, SharedCostModel) and resumed.resumed_steps == steps and not resumed.has_draft
    for environ in ({COST_MODEL_ENV: "cells", SAVE_LEARNED_ENV: str(path)}, {COST_MODEL_ENV: "fastest"}):
        with pytest.raises(ValueError, match="ADAPTIVE_SPEC_VLLM"):
            ControllerSettings.from_environment(environ).build()


def test_a_learned_state_that_cannot_be_written_warns_once_and_the_engine_goes_on(tmp_path):
    from adaptive_spec.integrations.vllm.controller import LearnedStateSaver

    (tmp_path / "file").write_text("x")
    _, model = ControllerSettings("goodput", None, "shared").build()
    saver = LearnedStateSaver(model, str(tmp_path / "file" / "learned.json"), None, every=1)  # a file as a folder
    model.observe(whole_step_record(model, batch_size=1, batch_k=2, context_lengths=(100,), outcomes=(),
                                    total_seconds=0.05))
    with pytest.warns(RuntimeWarning, match="cannot write"):
        assert saver.save() is False
    model.observe(whole_step_record(model, batch_size=1, batch_k=2, context_lengths=(100,), outcomes=(),
                                    total_seconds=0.05))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert saver.save() is False  # warned once


def test_bench_lanes_start_their_cost_models_from_their_own_profiles():
    """`bench --engine vllm --policies goodput@FILE,goodput@none`: each lane's controller is built
    from its start (the vLLM bench module imports without vLLM); a bare name takes --profile's."""
    import types

    from adaptive_spec.integrations.vllm import bench

    committed = "profiles/cpu-2core-vllm-qwen-coder-fp32.json"
    args = types.SimpleNamespace(profile="none")
    assert bench._lane_profile("goodput", args) is None
    assert bench._lane_profile(f"goodput@{committed}", args) == committed
    assert bench._lane_profile("goodput@auto", types.SimpleNamespace(profile="none", auto_profile=None)) is None
    assert bench._lane_profile("goodput@auto", types.SimpleNamespace(profile="none", auto_profile=committed)) == committed
    from_file = bench._controller(f"goodput@{committed}", bench._lane_profile(f"goodput@{committed}", args), "shared")
    generic = bench._controller("goodput@none", None, "shared")
    assert from_file.policy.name == generic.policy.name == "goodput"
    assert not from_file.cost_model.is_default and generic.cost_model.is_default
    assert bench.learned_summary(generic.cost_model) == {"kind": "shared", "observations": 0, "outliers": 0, "shifts": 0}
    assert bench.learned_summary(bench._controller("vllm-static:3").cost_model) is None


def test_the_step_log_keeps_each_steps_lengths_times_and_the_price_before_learning():
    """bench --save-steps: one entry per step with what it verified and drafts, its wall time, what the
    cost model was handed, its prediction before it learned the step, and the loop's time between steps."""
    ticks = iter([0.0, 0.5, 0.6, 1.0, 1.25, 2.0])
    model = CostModel.default()
    policy = RecordingPolicy(2)
    controller = SpecController(policy, model, clock=lambda: next(ticks))
    controller.step_log = []
    controller.choose(running(4))
    controller.start_step()  # 0.0
    controller.finish_step([VerifiedRequest("r0", 0, 0, 1, 100)], prefill_tokens=99)  # 0.5: a prefill
    expected = model.ragged_step_seconds(1, 101, [2])  # verified 2, drafts 2: the K = 2 step
    controller.choose(running(4))
    controller.start_step()  # 0.6
    controller.finish_step([VerifiedRequest("r0", 2, 1, 2, 101)])  # 1.0
    controller.choose(running(4))
    controller.start_step()  # 1.25
    controller.finish_step([VerifiedRequest("r0", 2, 2, 3, 103)], timed=False)  # 2.0
    prefill, decode, untimed = controller.step_log
    assert prefill["prefill_tokens"] == 99 and prefill["predicted"] is None and prefill["learned"] == 0.0
    assert prefill["seconds"] == pytest.approx(0.5) and prefill["between"] is None
    assert decode["verified"] == [2] and decode["drafting"] == [2] and decode["accepted"] == [1]
    assert decode["seconds"] == pytest.approx(0.4) and decode["learned"] == pytest.approx(0.4)
    assert decode["predicted"] == pytest.approx(expected) and decode["between"] == pytest.approx(0.1)
    assert untimed["seconds"] == pytest.approx(0.75) and untimed["learned"] == 0.0  # measured, not handed on
    assert untimed["between"] == pytest.approx(0.25)
    assert len(policy.records) == 3


def test_steps_vllm_scheduled_log_no_drafting_lengths():
    """A controller that only counts acceptance (vLLM's own schedule chose K) logs drafting as unknown."""
    controller = SpecController(StaticPolicy(0))
    controller.step_log = []
    controller.start_step()
    controller.finish_step([VerifiedRequest("r0", 3, 2, 3, 100)], observe=False)
    assert controller.step_log[0]["drafting"] is None and controller.step_log[0]["predicted"] is None


def test_a_controller_without_a_log_keeps_none():
    controller = SpecController(StaticPolicy(1))
    controller.choose(running(4))
    controller.start_step()
    controller.finish_step([VerifiedRequest("r0", 0, 0, 1, 100)])
    assert controller.step_log is None


def test_a_start_up_sweep_comes_from_the_environment():
    """ADAPTIVE_SPEC_VLLM_CALIBRATE: the plug-in's policy sweeps draft lengths first; a value that is
    not a number, or a sweep for a policy that reads no costs, is a clear error at start-up."""
    from adaptive_spec.control.price_sweep import PriceSweep
    from adaptive_spec.integrations.vllm.controller import CALIBRATE_ENV

    settings = ControllerSettings.from_environment({POLICY_ENV: "goodput", CALIBRATE_ENV: "12"})
    assert settings.calibrate == 12.0
    assert ControllerSettings.from_environment(settings.environment()) == settings
    policy, model = settings.build()
    assert isinstance(policy, PriceSweep) and policy.cost_model is model and policy.sweeping
    assert not isinstance(ControllerSettings("goodput").build()[0], PriceSweep)
    with pytest.raises(ValueError, match="must be a number of seconds"):
        ControllerSettings.from_environment({CALIBRATE_ENV: "soon"})
    with pytest.raises(ValueError, match="reads no step costs"):
        ControllerSettings("static:2", calibrate=5).build()


def test_a_latency_target_comes_from_the_environment():
    """ADAPTIVE_SPEC_VLLM_SLO_TPOT: the plug-in's goodput holds every row within that many milliseconds
    a token (its `tpot_target`, in seconds); round-trips through `environment()`; a value that is not
    a number, or a target for a policy without the guard, is a clear error at start-up."""
    from adaptive_spec.integrations.vllm.controller import SLO_TPOT_ENV

    settings = ControllerSettings.from_environment({POLICY_ENV: "goodput", SLO_TPOT_ENV: "450"})
    assert settings.slo_tpot == 450.0
    assert ControllerSettings.from_environment(settings.environment()) == settings
    assert settings.build()[0].config.tpot_target == pytest.approx(0.45)
    assert ControllerSettings("goodput").build()[0].config.tpot_target is None
    with pytest.raises(ValueError, match="must be a number of milliseconds"):
        ControllerSettings.from_environment({SLO_TPOT_ENV: "fast"})
    with pytest.raises(ValueError, match="no latency guard"):
        ControllerSettings("static:2", slo_tpot=400).build()
