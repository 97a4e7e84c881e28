"""The cost model: fit and interpolation on synthetic profiles with known answers, monotonicity,
extrapolation, leave-one-out error, and online correction (a 2x-wrong profile, a noisy neighbour,
no profile at all). Numbers only: no models run here."""

from __future__ import annotations

import ast
import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from adaptive_spec.control.cost_model import CostModel
from adaptive_spec.control.policy import RequestOutcome, StepRecord

BATCHES = (1, 2, 4, 8)
CONTEXTS = (128, 512, 2048)
QUERIES = tuple(range(1, 10))


def multilinear(b, c, q):
    """Linear in each variable separately: separable piecewise-linear interpolation is exact."""
    return 0.02 + 0.003 * q + 0.004 * b * q + 2e-6 * b * c + 1e-7 * b * c * q


def knee(b, c, q):
    """CPU-fp32-like: a jump between 3 and 4 query tokens, growing with batch."""
    return (0.30 + (0.30 if q >= 4 else 0.0) + 0.02 * (q - 1)) * (1 + 0.45 * (b - 1)) * (1 + c / 8192)


def draft_fn(b, c, q):
    return 0.1 * (1 + 0.2 * (b - 1)) * (1 + 0.1 * (q - 1)) * (1 + c / 16384)


def make_profile(target=multilinear, draft=draft_fn, batches=BATCHES, contexts=CONTEXTS, queries=QUERIES,
                 noise=0.0, seed=0, overhead=True, drop=()):  # fmt: skip
    rng = np.random.default_rng(seed)

    def rows(fn, qs):
        out = []
        for b, c, q in itertools.product(batches, contexts, qs):
            if (b, c, q) in drop:
                continue
            value = fn(b, c, q) * (1 + noise * rng.standard_normal())
            out.append({"batch": b, "context": c, "query_tokens": q, "median": value, "iqr": 0.0, "samples": [value]})
        return out

    profile = {
        "format": "adaptive-spec-profile", "schema_version": 1, "name": "synthetic", "fingerprint": {},
        "target": rows(target, queries), "draft": rows(draft, (1, 2)) if draft else [], "overhead": [],
    }  # fmt: skip
    if overhead:
        for b in batches:
            for k in (0, 1, 2, 4):
                profile["overhead"].append({"batch": b, "k": k, "draft_extra": 0.001 * b * k,
                                            "verify_extra": 0.002 * b * (k + 1), "rest": 0.0005 + 0.0001 * b})  # fmt: skip
    return profile


def record(batch, context, k, draft, verify, rest):
    return StepRecord(batch_size=batch, batch_k=k, context_lengths=(context,) * batch,
                      outcomes=tuple(RequestOutcome(f"r{i}", k, 0, 1) for i in range(batch)),
                      draft_seconds=draft, verify_seconds=verify, total_seconds=draft + verify + rest)  # fmt: skip


# ----------------------------------------------------------------------------- fit and interpolation


def test_grid_points_are_reproduced_and_multilinear_interpolation_is_exact():
    model = CostModel.from_profile(make_profile())
    for b, c, q in itertools.product(BATCHES, CONTEXTS, QUERIES):
        assert model.target_seconds(b, c, q, forward_only=True) == pytest.approx(multilinear(b, c, q), rel=1e-9)
    for b, c, q in [(3, 300, 2), (5, 1000, 7), (7, 2000, 5), (6, 129, 8)]:
        assert model.target_seconds(b, c, q, forward_only=True) == pytest.approx(multilinear(b, c, q), rel=1e-9)


def test_knee_in_query_tokens_is_kept_not_smoothed():
    model = CostModel.from_profile(make_profile(target=knee))
    t3 = model.target_seconds(1, 128, 3, forward_only=True)
    t4 = model.target_seconds(1, 128, 4, forward_only=True)
    assert t3 == pytest.approx(knee(1, 128, 3), rel=1e-9)
    assert t4 == pytest.approx(knee(1, 128, 4), rel=1e-9)
    assert t4 / t3 > 1.8  # the measured jump stands


def test_components_add_up_and_overhead_is_fitted():
    model = CostModel.from_profile(make_profile())
    b, c = 2, 512
    for k in range(6):
        step = model.step_seconds(b, c, k)
        assert step == pytest.approx(model.draft_seconds(b, c, k) + model.target_seconds(b, c, k + 1) + model.overhead_seconds(b, k))
    assert model.draft_seconds(b, c, 0) == 0.0
    # verify side: forward + 0.002 * b * (k + 1); draft side: forwards + 0.001 * b * k
    assert model.target_seconds(b, c, 3) == pytest.approx(multilinear(b, c, 3) + 0.002 * b * 3, rel=1e-6)
    catchup = 0.5 * (draft_fn(b, c, 1) + draft_fn(b, c, 2))  # 1.5 catch-up tokens, linear between q=1 and q=2
    expected = catchup + 2 * draft_fn(b, c, 1) + 0.001 * b * 3
    assert model.draft_seconds(b, c, 3) == pytest.approx(expected, rel=1e-6)
    assert model.overhead_seconds(b, 3) == pytest.approx(0.0005 + 0.0001 * b, rel=1e-6)
    assert model.step_seconds_table(b, c, 4) == pytest.approx([model.step_seconds(b, c, k) for k in range(5)])


def test_missing_cells_are_filled_from_neighbours():
    drop = {(2, 512, 5), (4, 2048, 9), (8, 128, 1)}
    model = CostModel.from_profile(make_profile(drop=drop))
    for b, c, q in drop:
        assert model.target_seconds(b, c, q, forward_only=True) == pytest.approx(multilinear(b, c, q), rel=0.02)


# ----------------------------------------------------------------------------- monotone, non-negative, extrapolation


def cpu_rows(b, c, q):
    """Like the 2-core development CPU: matrix kernels run 2 and 3 rows (batch x query tokens) at
    2x and 3x the cost of one, then switch algorithm at 4 rows and get cheaper per row."""
    rows = b * q
    gemm = 0.3 * rows if rows <= 3 else 0.45 + 0.02 * rows
    return gemm * (1 + c / 8192)


def test_measured_mode_keeps_real_drops_and_smooths_noise():
    model = CostModel.from_profile(make_profile(target=cpu_rows, noise=0.01, seed=2))
    t = {q: model.target_seconds(1, 128, q, forward_only=True) for q in (1, 2, 3, 4)}
    assert t[2] == pytest.approx(cpu_rows(1, 128, 2), rel=0.03) and t[3] == pytest.approx(cpu_rows(1, 128, 3), rel=0.03)
    assert t[4] < 0.7 * t[3]  # the measured drop at 4 rows stands: a 3-draft verify is cheaper than a 2-draft one
    assert model.target_seconds(4, 128, 1, forward_only=True) < model.target_seconds(2, 128, 1, forward_only=True)
    assert model.loo_errors().median("target") <= 0.10
    # a noise-sized dip is pooled away; context is always monotone
    profile = make_profile(target=lambda b, c, q: 0.1 * q * (0.97 if q == 5 else 1.0) + 0.001 * c / 128 if q != 4 else 0.41)
    model = CostModel.from_profile(profile)
    values = [model.target_seconds(1, 512, q, forward_only=True) for q in range(1, 10)]
    assert all(x <= y + 1e-12 for x, y in zip(values, values[1:]))
    noisy = CostModel.from_profile(make_profile(target=cpu_rows, noise=0.2, seed=5))
    for b in (1, 2, 3, 4, 8, 20):
        for q in (1, 2, 3, 5, 9, 15):
            cs = [noisy.target_seconds(b, c, q) for c in (10, 128, 400, 512, 2048, 9000)]
            assert all(x <= y + 1e-12 for x, y in zip(cs, cs[1:]))


def test_monotone_all_is_monotone_and_non_negative_even_from_noisy_non_monotone_data():
    model = CostModel.from_profile(make_profile(target=knee, noise=0.3, seed=3), monotone="all")
    bs = [1, 2, 3, 4, 5, 8, 12, 20, 100, 300]
    cs = [1, 50, 128, 300, 512, 1000, 2048, 5000, 20000]
    qs = [1, 2, 3, 4, 5, 6, 9, 12, 20, 40, 80]
    values = np.array([[[model.target_seconds(b, c, q) for q in qs] for c in cs] for b in bs])
    assert (values > 0).all()
    for axis in range(3):
        assert (np.diff(values, axis=axis) >= -1e-12).all(), f"not monotone along axis {axis}"
    drafts = np.array([[model.draft_seconds(b, 512, k) for k in range(0, 20)] for b in bs])
    assert (np.diff(drafts, axis=1) >= 0).all() and (np.diff(drafts, axis=0) >= -1e-12).all()
    steps = [model.step_seconds(4, 700, k) for k in range(0, 40)]
    assert all(x < y for x, y in zip(steps, steps[1:]))


def test_monotone_fit_averages_noise_instead_of_ratcheting_it_up():
    def flat(b, c, q):  # bf16-on-AMX-like: cost flat in query tokens
        return 0.3 * (1 + 0.5 * (b - 1))

    biases = []
    for seed in range(5):
        model = CostModel.from_profile(make_profile(target=flat, noise=0.1, seed=seed), monotone="all")
        biases += [model.target_seconds(b, c, q, forward_only=True) / flat(b, c, q) - 1
                   for b, c, q in itertools.product(BATCHES, CONTEXTS, QUERIES)]  # fmt: skip
    assert abs(np.mean(biases)) < 0.03  # a running max alone would sit ~13% high here


def test_extrapolation_outside_the_grid_is_linear_and_sensible():
    model = CostModel.from_profile(make_profile())
    # multilinear is linear in each axis, so linear extrapolation continues it exactly
    for b, c, q in [(1, 128, 12), (1, 4096, 1), (16, 128, 1), (8, 2048, 15), (20, 9000, 12)]:
        assert model.target_seconds(b, c, q, forward_only=True) == pytest.approx(multilinear(b, c, q), rel=1e-6)
    # below the smallest context the smallest context's cost stands
    assert model.target_seconds(2, 10, 3) == model.target_seconds(2, 128, 3)
    # a flat last segment must not predict free growth: slope >= the mean slope over the axis
    profile = make_profile(target=lambda b, c, q: 0.1 * min(q, 5) + 0.01 * b)
    model = CostModel.from_profile(profile)
    mean_slope = (model.target_seconds(1, 128, 9, forward_only=True) - model.target_seconds(1, 128, 1, forward_only=True)) / 8
    growth = model.target_seconds(1, 128, 19, forward_only=True) - model.target_seconds(1, 128, 9, forward_only=True)
    assert growth == pytest.approx(10 * mean_slope)
    # below the grid (batch grid starting at 2): positive, below the first point, not below proportional
    model = CostModel.from_profile(make_profile(batches=(2, 4, 8)))
    v1, v2 = model.target_seconds(1, 128, 1, forward_only=True), model.target_seconds(2, 128, 1, forward_only=True)
    assert v2 / 2 <= v1 <= v2
    # far outside the precomputed tables
    assert model.target_seconds(1000, 128, 100) > model.target_seconds(64, 128, 33) > 0


# ----------------------------------------------------------------------------- leave-one-out


def test_leave_one_out_on_a_smooth_profile_is_small():
    report = CostModel.from_profile(make_profile(noise=0.02, seed=1)).loo_errors()
    assert len(report.points) == len(BATCHES) * len(CONTEXTS) * (len(QUERIES) + 2)
    assert report.median_rel_error <= 0.10
    assert report.median("target") <= 0.10 and report.median("draft") <= 0.10
    summary = report.summary()
    assert summary["points"] == len(report.points) and math.isfinite(summary["median_rel_error"])


def test_leave_one_out_sees_the_knee():
    report = CostModel.from_profile(make_profile(target=knee)).loo_errors()
    worst = max(report.points, key=lambda p: p.rel_error)
    assert worst.query_tokens in (3, 4) and worst.rel_error > 0.2  # held out at the jump: large error
    assert report.median("target") <= 0.10  # elsewhere the fit holds


# ----------------------------------------------------------------------------- online correction


def _true_step(truth, b, c, k):
    draft = truth.draft_seconds(b, c, k, forward_only=False)
    verify = truth.target_seconds(b, c, k + 1)
    return draft, verify, truth.overhead_seconds(b, k)


def test_online_correction_converges_from_a_2x_wrong_profile():
    profile = make_profile(target=knee)
    truth = CostModel.from_profile(profile)
    wrong = make_profile(target=lambda b, c, q: knee(b, c, q) / 2, draft=lambda b, c, q: draft_fn(b, c, q) / 2)
    for row in wrong["overhead"]:
        for key in ("draft_extra", "verify_extra", "rest"):
            row[key] /= 2
    model = CostModel.from_profile(wrong)
    rng = np.random.default_rng(0)
    cells = [(b, k) for b in (1, 2, 4) for k in (0, 1, 2, 3)]
    assert model.step_seconds(2, 512, 2) == pytest.approx(truth.step_seconds(2, 512, 2) / 2, rel=1e-6)
    window = 8
    for n in range(window // 2 + 1):  # the global factor needs window // 2 + 1 observations
        b, k = cells[rng.integers(len(cells))]
        model.observe(record(b, 512, k, *_true_step(truth, b, 512, k)))
    assert model.corrections().target == pytest.approx(2.0, rel=1e-6)
    for b, k in [(1, 0), (4, 3), (8, 6), (3, 5)]:  # visited or not, inside or outside the grid
        assert model.step_seconds(b, 700, k) == pytest.approx(truth.step_seconds(b, 700, k), rel=0.02)
    for _ in range(40):
        b, k = cells[rng.integers(len(cells))]
        model.observe(record(b, 512, k, *_true_step(truth, b, 512, k)))
    for b, k in cells:
        assert model.step_seconds(b, 512, k) == pytest.approx(truth.step_seconds(b, 512, k), rel=0.02)
    model.reset_corrections()
    assert model.step_seconds(2, 512, 2) == pytest.approx(truth.step_seconds(2, 512, 2) / 2, rel=1e-6)


def test_online_correction_learns_a_knee_the_profile_missed():
    truth = CostModel.from_profile(make_profile(target=knee))
    flat = CostModel.from_profile(make_profile(target=lambda b, c, q: knee(b, c, 1) * (1 + 0.02 * (q - 1))))
    for _ in range(4):
        for k in (1, 3):  # q = 2 (before the knee) and q = 4 (after it)
            flat.observe(record(1, 300, k, *_true_step(truth, 1, 300, k)))
    for k in (1, 3):
        assert flat.target_seconds(1, 300, k + 1) == pytest.approx(truth.target_seconds(1, 300, k + 1), rel=0.02)
    # other cells follow later drift through the global factor while keeping their learned shape
    for _ in range(10):
        for k in (0,):
            d, v, r = _true_step(truth, 2, 300, k)
            flat.observe(record(2, 300, k, d, 3 * v, r))
    assert flat.corrections().target > 2.0


def test_an_unlearned_cell_takes_its_nearest_learned_cell_of_its_kind():
    """The profile underprices every drafting verify by 1.5x and is right at K = 0. Once (4, 1) is
    learned, drafting cells never run (K = 2 at batch 4, K = 3 at batch 8, K = 1 at batch 2) take its
    1.5 while the pooled factor G says 1.0; once G has reached 1.5, a K = 0 cell never run (batch 8)
    takes (4, 0)'s 1.0. Control: a model that has learned only K = 0 keeps the profile's price for
    K = 2 (nothing of its kind to borrow)."""
    profile = make_profile()
    exact = CostModel.from_profile(profile)
    model, control = CostModel.from_profile(profile), CostModel.from_profile(profile)
    context = 512

    def step(b, k):
        draft, verify, rest = _true_step(exact, b, context, k)
        return record(b, context, k, draft, verify * (1.5 if k else 1.0), rest)

    def ratio(m, b, k):
        return m.target_seconds(b, context, k + 1) / exact.target_seconds(b, context, k + 1)

    for b, k, times in [(4, 0, 3), (4, 1, 3), (4, 0, 5)]:
        for _ in range(times):
            model.observe(step(b, k))
    assert model.corrections().target == pytest.approx(1.0)  # G: five of its last eight steps at K = 0
    for b, k in [(4, 2), (8, 3), (2, 1)]:
        assert ratio(model, b, k) == pytest.approx(1.5)
    for _ in range(8):
        model.observe(step(4, 1))
    assert model.corrections().target == pytest.approx(1.5)
    assert ratio(model, 8, 0) == pytest.approx(1.0)
    for _ in range(3):
        control.observe(step(4, 0))
    assert ratio(control, 4, 2) == pytest.approx(1.0)


def test_noisy_neighbour_is_followed_within_bounded_steps_and_outliers_are_ignored():
    truth = CostModel.from_profile(make_profile())
    model = CostModel.from_profile(make_profile())
    b, c, k = 2, 512, 2
    base = model.step_seconds(b, c, k)
    draft, verify, rest = _true_step(truth, b, c, k)
    for _ in range(10):
        model.observe(record(b, c, k, draft, verify, rest))
    model.observe(record(b, c, k, 20 * draft, 20 * verify, 20 * rest))  # one pause: ignored
    assert model.step_seconds(b, c, k) == pytest.approx(base, rel=1e-6)
    steps = 0
    while abs(model.step_seconds(b, c, k) / (3 * base) - 1) > 0.01:  # a neighbour triples every cost
        model.observe(record(b, c, k, 3 * draft, 3 * verify, 3 * rest))
        steps += 1
        assert steps <= 8, "not corrected within the bound"
    steps = 0
    while abs(model.step_seconds(b, c, k) / base - 1) > 0.01:  # and leaves
        model.observe(record(b, c, k, draft, verify, rest))
        steps += 1
        assert steps <= 8


def test_no_profile_safe_start_learns_online():
    model = CostModel.default()
    truth = CostModel.from_profile(make_profile(target=knee))
    for b in (1, 4, 64, 200):
        for k in range(0, 12):
            value = model.step_seconds(b, 1000, k)
            assert math.isfinite(value) and value > 0
    # the safe start does not make speculation look free: a draft token costs a real share of a verify
    assert model.draft_seconds(1, 128, 1) > 0.2 * model.target_seconds(1, 128, 1)
    for _ in range(5):
        for k in (0, 2, 3):
            model.observe(record(1, 256, k, *_true_step(truth, 1, 256, k)))
    for k in (0, 2, 3):
        assert model.step_seconds(1, 256, k) == pytest.approx(truth.step_seconds(1, 256, k), rel=0.02)


def test_observe_ignores_empty_and_bad_records():
    model = CostModel.from_profile(make_profile())
    before = model.step_seconds(1, 128, 1)
    model.observe(StepRecord(0, 0, (), (), 0.0, 0.0, 0.0))
    model.observe(record(1, 128, 1, float("nan"), float("nan"), 0.0))
    assert model.step_seconds(1, 128, 1) == before


# ----------------------------------------------------------------------------- API guards and speed


def test_bad_inputs_raise_clear_errors():
    model = CostModel.from_profile(make_profile())
    with pytest.raises(ValueError):
        model.target_seconds(0, 128, 1)
    with pytest.raises(ValueError):
        model.target_seconds(1, 128, 0)
    with pytest.raises(ValueError):
        model.draft_seconds(1, 128, -1)
    with pytest.raises(ValueError, match="no target"):
        CostModel.from_profile({"target": []})
    with pytest.raises(ValueError, match="median"):
        CostModel.from_profile({"target": [{"batch": 1, "context": 1}]})
    with pytest.raises(ValueError, match="mapping"):
        CostModel.from_profile([1, 2])
    with pytest.raises(ValueError, match="monotone"):
        CostModel.from_profile(make_profile(), monotone="sometimes")


def test_profile_without_draft_or_overhead_still_predicts():
    model = CostModel.from_profile(make_profile(draft=None, overhead=False))
    assert not model.has_draft
    assert 0 < model.draft_seconds(1, 128, 3) < model.target_seconds(1, 128, 1)
    assert model.overhead_seconds(1) > 0


def test_queries_are_pure_and_finite_after_corrections():
    """What the query-speed benchmark (scripts/bench_timings.py) times: asking changes nothing."""
    model = CostModel.from_profile(make_profile(target=knee))
    for _ in range(20):
        model.observe(record(2, 600, 2, 0.1, 0.5, 0.01))
    first = [model.step_seconds(1 + i % 8, 600.0, i % 9) for i in range(72)]
    assert all(math.isfinite(t) and t > 0 for t in first)
    assert [model.step_seconds(1 + i % 8, 600.0, i % 9) for i in range(72)] == first
    assert model.step_seconds(2, 600.0, 2) != CostModel.from_profile(make_profile(target=knee)).step_seconds(2, 600.0, 2)


def test_layer_two_imports_no_torch_or_scipy():
    source = Path(__file__).parents[1] / "adaptive_spec" / "control" / "cost_model.py"
    imported = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"torch", "scipy", "transformers"}


def test_catch_up_is_priced_from_the_profile_then_from_timed_catch_ups():
    profile = make_profile()
    assert CostModel.from_profile(profile).catch_up_seconds(100) == 0.0  # not measured: not priced
    profile["draft_catch_up"] = {"seconds_per_token": 0.006}
    model = CostModel.from_profile(profile)
    assert model.catch_up_seconds(250) == pytest.approx(1.5)
    assert model.catch_up_seconds(0) == 0.0
    for seconds in (2.0, 2.2, 9.0):  # 1000 tokens each; the 9 s step is an outlier the median ignores
        model.observe_catch_up(1000, seconds)
    assert model.catch_up_seconds(500) == pytest.approx(1.1)
    model.reset_corrections()
    assert model.catch_up_seconds(250) == pytest.approx(1.5)
    profile["draft_catch_up"] = {"seconds_per_token": "fast"}
    with pytest.raises(ValueError, match="draft_catch_up"):
        CostModel.from_profile(profile)
    with pytest.raises(ValueError, match="catch_up_per_token"):
        CostModel.from_profile(make_profile(), catch_up_per_token=-1.0)


def test_ragged_steps_pay_their_drafted_tokens_share_of_the_increment():
    """A profile's `ragged` shares price a step where only some rows draft: the K = 0 step plus the
    (b, K) increment times s1 + (1 - s1)(n - 1)/(b - 1), n = drafted tokens / K; uniform steps and
    profiles without shares cost their (b, K) cell whoever drafts."""
    profile = make_profile()
    plain = CostModel.from_profile(profile)
    assert plain.ragged_step_seconds(8, 512, [3] + [0] * 7) == pytest.approx(plain.step_seconds(8, 512, 3))
    profile["ragged"] = {"context": 256, "drafting_rows": 1,
                         "cells": [{"batch": 8, "k": 1, "share": 0.5}, {"batch": 8, "k": 3, "share": 0.3},
                                   {"batch": 4, "k": 3, "share": 0.6}]}
    model = CostModel.from_profile(profile)
    base, full = model.step_seconds(8, 512, 0), model.step_seconds(8, 512, 3)
    assert model.ragged_step_seconds(8, 512, [3] * 8) == pytest.approx(full)
    assert model.ragged_step_seconds(8, 512, [0] * 8) == pytest.approx(base)
    assert model.ragged_step_seconds(8, 512, [3] + [0] * 7) == pytest.approx(base + 0.3 * (full - base))
    four = base + (0.3 + 0.7 * 3 / 7) * (full - base)
    assert model.ragged_step_seconds(8, 512, [3] * 4 + [0] * 4) == pytest.approx(four)
    # n counts drafted tokens: six drafts under K = 3 are two rows' worth, however they are spread
    assert model.ragged_step_seconds(8, 512, [3, 1, 1, 1] + [0] * 4) == pytest.approx(
        model.ragged_step_seconds(8, 512, [3, 3] + [0] * 6))
    assert model.drafting_share(8, 2, 1) == pytest.approx(0.4)  # K interpolated between 1 and 3
    assert model.drafting_share(6, 3, 1) == pytest.approx(0.45)  # batch interpolated between 4 and 8
    assert model.drafting_share(2, 3, 1) == pytest.approx(1 - 0.4 / 3)  # ... and between 1 (share 1) and 4
    assert model.drafting_share(16, 3, 1) == pytest.approx(0.3)  # held beyond the largest batch
    assert model.drafting_share(1, 3, 1) == 1.0
    for bad in ({"cells": "many"}, {"cells": [{"batch": 8, "k": 3}]}, {"cells": [{"batch": 1, "k": 3, "share": 0.5}]},
                {"cells": [{"batch": 8, "k": 3, "share": 1.5}]}, []):
        profile["ragged"] = bad
        with pytest.raises(ValueError, match="ragged"):
            CostModel.from_profile(profile)
